"""The sidecar daemon side (no torch here). So far: the `torch-watchdog` command line."""
