"""Per-process JSON-lines event log: what recovery did and when (read by `hp demo`, hp-chaos)."""

from __future__ import annotations

import json
import os
import time
from typing import Any


class EventLog:
    """Appends one JSON object per line to ``<dir>/<name>-<pid>.jsonl``; no-op without a dir."""

    def __init__(self, directory: str | None, name: str) -> None:
        self._file = None
        if directory:
            os.makedirs(directory, exist_ok=True)
            self._file = open(os.path.join(directory, f"{name}-{os.getpid()}.jsonl"), "a", buffering=1)

    def record(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_events(directory: str) -> list[dict]:
    """Every event of every process, oldest first."""
    events = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        with open(os.path.join(directory, name)) as f:
            events += [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=lambda e: e["t"])


def finished_at(events: list[dict]) -> int | None:
    """The step every rank ended after when the job was asked to finish (``hp finish``: their
    ``finish_agreed`` events, one step), else None (it ran to its last step, or did not end)."""
    ended = {e["step"] for e in events if e["event"] == "finish_agreed"}
    return ended.pop() if len(ended) == 1 else None
