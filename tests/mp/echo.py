"""A launcher test child without JAX. Modes (argv[1]):

- `ok`: print this rank's coordinator settings and exit 0;
- `fail R C`: rank R exits with status C after a moment, the others sleep (to be stopped);
- `term`: print READY, then on SIGTERM print "got SIGTERM" and exit 75.
"""

import os
import signal
import sys
import time

rank = int(os.environ["EQGPT_PROCESS_ID"])
count = int(os.environ["EQGPT_NUM_PROCESSES"])
mode = sys.argv[1]
if mode == "ok":
    print(f"hello from {rank} of {count} via {os.environ['EQGPT_COORDINATOR']} "
          f"with {os.environ.get('JAX_NUM_CPU_DEVICES')} devices")
    print("second line", file=sys.stderr)
elif mode == "fail":
    bad, code = int(sys.argv[2]), int(sys.argv[3])
    if rank == bad:
        time.sleep(0.5)
        print("failing now", flush=True)
        sys.exit(code)
    print(f"pid {os.getpid()} waiting", flush=True)
    time.sleep(120)
elif mode == "term":
    def stop(signum, frame):
        print("got SIGTERM", flush=True)
        sys.exit(75)

    signal.signal(signal.SIGTERM, stop)
    print("READY", flush=True)
    time.sleep(120)
