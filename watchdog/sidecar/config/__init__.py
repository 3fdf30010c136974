"""The sidecar's configuration: its schema (schema.py: frozen dataclasses and the rules their
values follow), reading a file into it (loading.py), and the host checks of where it writes
(files.py). Imported from here by the rest of the sidecar."""
from torch_watchdog.sidecar.config.files import PSEUDO_FS, host_problems
from torch_watchdog.sidecar.config.loading import (MAX_FILE_BYTES, MAX_NODES, ConfigError, check,
                                                   from_mapping, load)
from torch_watchdog.sidecar.config.schema import (GPU_ATTRIBUTIONS, MIN_POLL_S, RELOAD_METHODS,
                                                  SIGNALLING, AgentSocketConfig, AlertsConfig,
                                                  Config, CorrelateConfig, ForecastConfig,
                                                  GpuConfig, MiB, PolicyConfig, ReloadConfig,
                                                  ServerConfig, ServerEntry, semantic_problems,
                                                  server_budgets, server_sources)

__all__ = ["GPU_ATTRIBUTIONS", "MAX_FILE_BYTES", "MAX_NODES", "MIN_POLL_S", "PSEUDO_FS",
           "RELOAD_METHODS", "SIGNALLING", "AgentSocketConfig", "AlertsConfig", "Config",
           "ConfigError", "CorrelateConfig", "ForecastConfig", "GpuConfig", "MiB",
           "PolicyConfig", "ReloadConfig", "ServerConfig", "ServerEntry", "check",
           "from_mapping", "host_problems", "load", "semantic_problems", "server_budgets",
           "server_sources"]
