"""drain_server.py under the standby launcher: first a progress line `script` saying whether
torch was already imported when the script began (True only in a released standby), and
whether `xml.dom.minidom` was, a library this script imports and the launcher's preload list
does not name (a released standby has it from the first generation's recorded imports).
Run as a script only (the launcher runs it as __main__); importing it does nothing."""
import json
import os
import sys
import time

PRELOADED = "torch" in sys.modules  # before this script imports anything heavy
RECORDED = "xml.dom.minidom" in sys.modules


def main() -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    progress = sys.argv[sys.argv.index("--progress") + 1]
    with open(progress, "a") as fh:
        fh.write(json.dumps({"kind": "script", "t": time.time(), "pid": os.getpid(),
                             "ppid": os.getppid(), "name": __name__, "preloaded": PRELOADED,
                             "cuda_preload_ran": "fake_cuda_preload" in sys.modules,
                             "recorded_preloaded": RECORDED,
                             "own_module_preloaded": "drain_server" in sys.modules}) + "\n")
    import xml.dom.minidom  # noqa: F401  (the server's library, recorded by the agent)

    import drain_server

    return drain_server.main()


if __name__ == "__main__":
    sys.exit(main())
