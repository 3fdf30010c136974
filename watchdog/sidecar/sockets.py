"""The Unix sockets the sidecar binds (the agents' datagrams, the drain control): a socket left
by a dead sidecar is replaced; a live one, or any other kind of file, is refused."""
from __future__ import annotations

import errno
import os
import socket
import stat


def remove_stale_socket(path: str) -> None:
    """Unlink a socket left by a dead receiver; refuse a live one or any other kind of file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "not a socket; refusing to replace it", path)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(path)  # succeeds only while some process still has it bound
    except ConnectionRefusedError:
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, "another receiver is listening on this socket", path)
