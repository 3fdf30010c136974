"""A stand-in server for the launcher's fault tests: appends its pid to a file, then exits with
a code after a while (75: a drain), or runs until killed."""
import os
import sys
import time

progress, seconds, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
with open(progress, "a") as fh:
    fh.write(f"{os.getpid()} {time.time():.3f}\n")
time.sleep(seconds)
sys.exit(code)
