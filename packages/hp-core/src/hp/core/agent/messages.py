"""The agent's one-line messages: every part of ``hp run``'s agent speaks through :func:`say`."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    print(f"hp run: {message}", file=sys.stderr, flush=True)
