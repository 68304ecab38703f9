"""The ``hp`` command. Sub-commands come from plugins through the ``hp_cli_commands`` hook."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from hp.core.errors import HpError, UsageError
from hp.core.plugins import get_plugin_manager


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input raises :class:`UsageError` so that it is reported as one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hp", description="hp: keep PyTorch training jobs making progress through faults.")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="Python logging level for hp's own logs")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    get_plugin_manager().hook.hp_cli_commands(subparsers=sub)
    return parser


def _terminated(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a CI timeout, `timeout`, `kill`) ends a command the way Ctrl-C does: its `finally` blocks run.
    # Benchmarks, chaos runs and `hp demo` start jobs in sessions of their own; killed outright they left
    # those jobs training, unsupervised, for good (seen: a killed `hp bench goodput` left its 2-rank job
    # holding a core for 90 min). A command that handles SIGTERM itself (`hp run`, `hp controller`) still
    # installs its own handler. Only as a program (``argv`` None): an in-process caller keeps its signals.
    if argv is None:  # a program: `hp run` may be forked, warm, by a warm-start server (hp.core.warm_start)
        from hp.core import warm_start

        code = warm_start.delegate(sys.argv[1:])
        if code is not None:
            return code
    if argv is None and threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s: %(message)s")
        return args.handler(args)
    except UsageError as e:
        print(f"hp: error: {e}", file=sys.stderr)
        return 2
    except HpError as e:
        print(f"hp: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
