"""The sidecar's configuration: its schema (schema.py: frozen dataclasses and the rules their
values follow), reading a file into it (loading.py), and the host checks of where it writes
(files.py). Imported from here by the rest of the sidecar; the core imports the schema alone
(`config.schema`), and reading and host checks load on first use of their names here.
"""
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from torch_watchdog.sidecar.config.files import PSEUDO_FS, host_problems
    from torch_watchdog.sidecar.config.loading import (MAX_FILE_BYTES, MAX_NODES, ConfigError,
                                                       check, from_mapping, load)

_LAZY = {"PSEUDO_FS": "files", "host_problems": "files", "MAX_FILE_BYTES": "loading",
         "MAX_NODES": "loading", "ConfigError": "loading", "check": "loading",
         "from_mapping": "loading", "load": "loading"}


def __getattr__(name: str) -> Any:
    """The reading and host-check names, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
