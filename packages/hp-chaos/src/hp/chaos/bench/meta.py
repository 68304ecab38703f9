"""What every ``hp bench`` result carries, and how a bench command ends with it.

A figure means something only with its definition, its spread and the machine it ran on. Every
benchmark wraps its run in :class:`BenchRun` and returns ``run.stamp(result)``: the result gains

- ``definition_version`` (bumped whenever what a figure measures changes, so two results files are
  compared only where the versions match),
- ``machine`` (cores usable by this process, CPU model, memory, python and torch versions),
- ``load_avg`` before and after (a run on a loaded machine says so), and ``bench_wall_s``.

:func:`spread` is the one shape of a repeated measurement: median, min, max, n and the values.
:func:`hp.core.devices.pin_to_core` is the one way a benchmark process takes a core of its own
(``HP_PIN_CORES=1``): ranks that share cores finish faster while another idles, which no user with one
accelerator per rank would see. :func:`report` and :func:`print_result` are the two ways a bench command
ends (the table, then ``--json``'s last line); :func:`int_list` reads a size flag.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from importlib import metadata
from typing import Any


def spread(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min, max, n and the values themselves (None entries dropped; None when none is left)."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs), "values": xs}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _mem_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine as this process sees it (usable cores are its affinity set, not the host's count)."""
    return {"cores": len(os.sched_getaffinity(0)), "host_cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "mem_gib": _mem_gib(), "platform": platform.platform(), "python": sys.version.split()[0],
            "torch": _version("torch")}


class BenchRun:
    """Load average and wall time around one benchmark run; :meth:`stamp` adds them to its result."""

    def __init__(self, name: str, definition_version: int) -> None:
        self.name, self.definition_version = name, definition_version
        self.load_before = os.getloadavg()
        self.started = time.monotonic()

    def stamp(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"benchmark": self.name, "definition_version": self.definition_version, **result,
                "machine": machine(),
                "load_avg": {"before": list(self.load_before), "after": list(os.getloadavg())},
                "bench_wall_s": time.monotonic() - self.started}


def int_list(text: str, flag: str, minimum: int, what: str) -> tuple[int, ...]:
    """``"8,16,32"`` -> ``(8, 16, 32)`` for a benchmark's size flag; a one-line :class:`UsageError` when an
    item is not an integer, none is given, or one is below ``minimum`` (``what`` names the rule)."""
    from hp.core.errors import UsageError

    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"{flag}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise UsageError(f"{flag}: {what}, got {text!r}")
    return values


def print_result(result: dict[str, Any], table: str, as_json: bool, ok: str = "completed") -> int:
    """The table for people, then (``--json``) the result as the last stdout line; the exit code: 0 when
    ``result[ok]`` holds."""
    import json

    print(table, flush=True)
    if as_json:
        print(json.dumps(result), flush=True)
    return 0 if result[ok] else 1


def report(result: dict[str, Any], table: str, args: Any) -> int:
    """What a bench command does with its result: the table for people, with ``--json`` the JSON as the
    last stdout line, with ``--out FILE`` the JSON in FILE as well."""
    import json

    out = getattr(args, "out", None)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(table, flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def module_main(argv: list[str] | None, prog: str, doc: str, add_arguments: Any, run_cli: Any,
                worker: Any) -> int:
    """A bench module run with ``python -m``: ``--worker ARGS...`` is one of the processes it starts
    (``worker(ARGS)``), anything else its command (bad input: one line, exit 2)."""
    import argparse

    from hp.core.errors import UsageError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])  # its results are written and its group destroyed when it returns
        # Leave without the interpreter's teardown: C++ static destructors at exit() can find a torch thread
        # still joinable and abort (SIGABRT, "terminate called without an active exception"), which turned a
        # finished rank into a failed benchmark under load (bench exact's rank 1 in a fresh-clone suite run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    p = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    add_arguments(p)
    try:
        return run_cli(p.parse_args(argv))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

