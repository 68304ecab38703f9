"""The ``hp`` command. Sub-commands come from plugins through the ``hp_cli_commands`` hook."""

from __future__ import annotations

import argparse
import logging
import sys

from hp.core.errors import HpError, UsageError
from hp.core.plugins import get_plugin_manager


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input raises :class:`UsageError` so that it is reported as one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hp", description="hp: keep PyTorch training jobs making progress through faults.")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level for hp's own logs")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    get_plugin_manager().hook.hp_cli_commands(subparsers=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
