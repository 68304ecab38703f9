"""Test worker: rank 1 raises; ``@record`` writes the error file the agent reports from."""

import os

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 was told to raise")


if __name__ == "__main__":
    main()
