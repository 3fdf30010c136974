"""sd_notify without libsystemd: READY, STATUS, WATCHDOG, STOPPING and RELOADING datagrams."""
from __future__ import annotations

import os
import socket
import time
from typing import Mapping, Optional

# A wedged service manager must not wedge the daemon loop; a lost WATCHDOG=1 is resent anyway.
SEND_TIMEOUT_S = 1.0


class Notifier:
    """Sends assignments to $NOTIFY_SOCKET (read once, at construction); a no-op without it."""

    def __init__(self, environ: Mapping[str, str] = os.environ):
        value = environ.get("NOTIFY_SOCKET", "")
        # '@' names a socket in the abstract namespace, which the kernel spells with a NUL byte.
        self._address = "\0" + value[1:] if value.startswith("@") else value

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([_status(status)] if status else []))

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        return self.notify(_status(text))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def reloading(self) -> bool:
        # Type=notify-reload (systemd >= 253) needs the reload's start on CLOCK_MONOTONIC.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def notify(self, *assignments: str) -> bool:
        """Send one datagram of newline-separated assignments; True if it was sent.

        Never raises: a missing or refusing socket returns False. Callers pass single-line
        assignments (status() and ready() flatten their text)."""
        if not self._address or not assignments:
            return False
        try:
            data = "\n".join(assignments).encode()
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(data, self._address)
        except (OSError, ValueError, UnicodeError):  # ValueError: a NUL in a path address
            return False
        return True


def watchdog_interval_s(environ: Mapping[str, str] = os.environ) -> Optional[float]:
    """How often to send WATCHDOG=1: half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises,
    when the watchdog is on and meant for this process (WATCHDOG_PID unset or ours); else None."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
        pid = environ.get("WATCHDOG_PID")
        if pid is not None and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return usec / 2 / 1e6 if usec > 0 else None


def _status(text: str) -> str:
    # STATUS= is one line: a newline would start a new (bogus) assignment.
    return "STATUS=" + " ".join(text.splitlines())
