"""Test worker: records its pid and environment, then waits for the test to say how to end.

HP_TEST_DIR/rank<R>.pids gets one line per process that held rank R; the process exits 0 once
HP_TEST_DIR/finish exists. It does not import torch, to keep agent tests fast.
"""

import json
import os
import sys
import time

def main() -> None:
    out = os.environ["HP_TEST_DIR"]
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"rank{rank}.pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(os.path.join(out, f"rank{rank}.env.json"), "w") as f:
        json.dump({k: v for k, v in os.environ.items() if k.isupper()}, f)
    print(f"worker rank {rank} started", flush=True)
    print(f"worker rank {rank} on stderr", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 120  # a hang guard, never the expected path
    while time.monotonic() < deadline:
        if os.path.exists(os.path.join(out, "finish")):
            print(f"worker rank {rank} finished", flush=True)
            return
        time.sleep(0.05)
    sys.exit(3)


if __name__ == "__main__":
    main()
