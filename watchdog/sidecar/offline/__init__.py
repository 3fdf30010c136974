"""Tools over recorded files: replay, traces, the report, the bucket advisor."""
