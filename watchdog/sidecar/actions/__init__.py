"""What the sidecar does: Alertmanager alerts, reloads and their durable record, sd_notify."""
