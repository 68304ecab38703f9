"""``python -m hp.core.worker_main [-m MODULE | SCRIPT] [ARGS...]``: how ``hp run`` starts a worker.

It runs the training script or module as ``python SCRIPT`` / ``python -m MODULE`` would (``__main__``,
``sys.argv``, the script's directory first on ``sys.path``), after one thing no script should have to do:
leaving SIGTERM to the agent (:mod:`hp.core.worker_signals`), done here while the process has one thread,
before the script imports torch (whose import starts a thread that could otherwise take the signal);
then the process-group workarounds of :mod:`hp.core.pg` (a plain DDP script's exit).
Workers started cold (torch elastic) and forked ones (:mod:`hp.core.forkserver`) both come through
:func:`exec_main`.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types

from hp.core.pg import keep_destroyed_groups_until_exit
from hp.core.worker_signals import defer_sigterm_to_agent


def exec_main(args: list[str]) -> None:
    """Run ``args`` (``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT ARGS``, after the interpreter's own
    flags) as ``__main__``."""
    if args and args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args and args[0] == "-c":  # as `python -c`: a fresh __main__, "" (the cwd) first on sys.path
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)  # noqa: S102  the caller's own program
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def main(args: list[str]) -> None:
    defer_sigterm_to_agent()
    keep_destroyed_groups_until_exit()
    exec_main(args)


if __name__ == "__main__":
    main(sys.argv[1:])
