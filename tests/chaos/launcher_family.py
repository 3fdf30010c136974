"""A stand-in server for the launcher's reaper test: starts a grandchild (its own child, which
outlives it unless someone stops it), ignores SIGTERM, writes both pids, then sleeps."""
import os
import signal
import subprocess
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                              start_new_session=True)  # even out of the server's group
with open(sys.argv[1], "w") as fh:
    fh.write(f"{os.getpid()} {grandchild.pid}\n")
time.sleep(300)
