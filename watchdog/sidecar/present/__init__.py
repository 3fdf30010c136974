"""What the sidecar shows: Prometheus metrics, the status page and its history."""
