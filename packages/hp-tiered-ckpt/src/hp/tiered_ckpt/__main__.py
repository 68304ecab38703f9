"""``python -m hp.tiered_ckpt daemon ...``: the node daemon without building the whole ``hp`` CLI
(which imports every installed hp plugin; the daemon itself needs neither torch nor them)."""

from __future__ import annotations

import argparse
import logging
import sys

from hp.core.errors import UsageError
from hp.tiered_ckpt.cli import add_daemon_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hp.tiered_ckpt")
    parser.add_argument("--log-level", default="WARNING")
    add_daemon_args(parser.add_subparsers(required=True, metavar="daemon").add_parser("daemon"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s %(levelname)s: %(message)s")
    try:
        return args.handler(args)
    except UsageError as e:
        print(f"hp: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
