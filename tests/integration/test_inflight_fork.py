"""watch() across fork: a child forked while another thread of the parent is in a watched
call has no calls in flight, on the C and the Python hot path. The hot paths in one process:
tests/unit/test_timing.py."""
import os
import threading

import pytest
import torch

from torch_watchdog.agent import inflight
from torch_watchdog.agent.wrapper import watch

pytestmark = pytest.mark.usefixtures("hot_path")  # on the C and the Python path


def test_a_forked_child_has_no_calls_in_flight_from_the_parents_other_threads():
    entered, release = threading.Event(), threading.Event()
    f = watch(lambda x: entered.set() or release.wait(10), name="slow")
    t = threading.Thread(target=f, args=(torch.ones(3),))
    t.start()
    try:
        assert entered.wait(10) and inflight.calls_in_flight()
        pid = os.fork()
        if pid == 0:  # the child: only the forking thread, in no watched call
            os._exit(0 if not inflight.calls_in_flight() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        release.set()
        t.join(10)
