"""Test worker for the TorchX tests; it does not import torch, to keep them fast.

Writes HP_TEST_DIR/tx_rank<R>.pid on start, sleeps TX_SLEEP_S seconds (default 0), then writes
HP_TEST_DIR/tx_rank<R>.done and exits with TX_EXIT_CODE (default 0). RANK defaults to 0 so the
script also runs bare, as a plain TorchX role without `hp run`.
"""

import json
import os
import sys
import time


def main() -> None:
    out = os.environ["HP_TEST_DIR"]
    rank = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"tx_rank{rank}.pid"), "w") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("TX_SLEEP_S", "0")))
    with open(os.path.join(out, f"tx_rank{rank}.done"), "w") as f:
        json.dump({"pid": os.getpid(), "rank": rank, "world_size": os.environ.get("WORLD_SIZE")}, f)
    print(f"tx worker rank {rank} done", flush=True)
    sys.exit(int(os.environ.get("TX_EXIT_CODE", "0")))


if __name__ == "__main__":
    main()
