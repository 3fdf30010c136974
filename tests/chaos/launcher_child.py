"""A stand-in server for the launcher's fault tests: appends its pid to a file, then exits with
a code after a while (75: a drain), or runs until killed."""
import os
import sys
import time


def main(progress: str, seconds: float, code: int) -> int:
    with open(progress, "a") as fh:
        fh.write(f"{os.getpid()} {time.time():.3f}\n")
    time.sleep(seconds)
    return code


if __name__ == "__main__":  # a script: importing it (pytest given its path) does nothing
    sys.exit(main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3])))
