"""The sidecar's unit under a real systemd: READY=1 and the watchdog pings."""
from __future__ import annotations

from tests.systemd.conftest import SERVER, SIDECAR


def test_the_sidecar_starts_ready_and_watches_the_server(machine):
    props = machine.show(SIDECAR, "ActiveState", "SubState", "Type", "WatchdogUSec", "StatusText")
    assert props["ActiveState"] == "active", machine.journal(SIDECAR)
    print(props)
    print(machine.status())
    print(machine.journal(SIDECAR))
    print(machine.journal(SERVER))
