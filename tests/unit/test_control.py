"""The control channel's agent end in one process, no thread: whose socket it trusts, and that
garbage never gets through. The two ends with the sidecar's server thread and forked agents:
tests/integration/test_control_socket.py."""
from __future__ import annotations

import os
import socket

from torch_watchdog.agent import drain


def client(path, requests, trusted=None):
    return drain.ControlClient(path, {os.geteuid()} if trusted is None else trusted,
                               requests.append, lambda e: None, reconnect_s=0.05)


def test_a_private_directory_vouches_for_its_owner(short_tmp):
    """A folder no one else may write in, in a parent no one else may write in (root's /run):
    its owner bound the socket. One made in a sticky world-writable parent (/tmp) vouches for
    no one: anyone could have made it (issue 28, item 5)."""
    os.chmod(short_tmp, 0o755)
    folder = os.path.join(short_tmp, "run")
    os.mkdir(folder, 0o750)
    path = os.path.join(folder, "c.ctl")
    assert drain.dir_owner(path) == {os.stat(folder).st_uid}
    os.chmod(folder, 0o770)
    assert drain.dir_owner(path) == frozenset()
    os.chmod(folder, 0o750)
    os.chmod(short_tmp, 0o1777)  # a /tmp-style parent: the folder may be an attacker's
    assert drain.dir_owner(path) == frozenset()


def test_garbage_from_the_sidecar_end_never_starts_a_drain(short_tmp):
    path = os.path.join(short_tmp, "c.ctl")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    requests: list = []
    c = client(path, requests)
    try:
        c.poll()
        conn, _ = listener.accept()
        conn.sendall(b'not json\n{"v":2,"kind":"drain"}\n{"v":1,"kind":"stop"}\n[1]\n'
                     b'{"v":1,"kind":"drain","grace_s":"soon"}\n'
                     b'{"v":1,"kind":"drain","grace_s":1e9}\n')
        # a Unix stream delivers as sendall returns: one poll reads all of it (< MAX_LINE)
        c.poll()
        # only well-formed drain requests, a bad grace replaced, an absurd one capped
        assert requests == [30.0, drain.MAX_GRACE_S]
        conn.close()
        c.poll()
        assert not c.connected  # EOF: reconnects later
    finally:
        c.close()
        listener.close()
