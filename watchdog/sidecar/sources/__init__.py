"""What the sidecar reads: NVML, processes, the agents' datagrams, as plain samples."""
