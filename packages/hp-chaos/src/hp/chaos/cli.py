"""hp-chaos's sub-commands: ``hp bench <benchmark>``.

``hp bench`` is a group so that each benchmark (``recovery`` now; ``goodput`` and ``ckpt`` later) is
one more ``_add_<name>`` function here and one flat module beside it. Nothing heavy is imported
while the parser is built: every ``hp`` invocation builds it, and hp-chaos must import without
hp-checkpointless (it is a dependency of the benchmarks, not of the distribution).
"""

from __future__ import annotations

import argparse
import json

from hp.core.errors import UsageError
from hp.core.hookspecs import hookimpl


def _recovery(args: argparse.Namespace) -> int:
    try:
        from hp.chaos.bench_recovery import BenchConfig, format_table, run_bench
        from hp.checkpointless.demo.model import MODEL_SIZES
    except ImportError as e:
        raise UsageError(f"hp bench recovery needs hp-checkpointless and torch ({e}); "
                         "pip install packages/hp-checkpointless") from None
    if args.model_size not in MODEL_SIZES:
        raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {args.model_size!r}")
    if args.nproc < 2:
        raise UsageError("--nproc must be >= 2 (rank 1 is the one killed)")
    if args.ckpt_every < 1 or args.corpus_mb < 1 or (args.vocab is not None and args.vocab < 2):
        raise UsageError("--ckpt-every and --corpus-mb must be >= 1, --vocab >= 2")
    if not 0 <= args.fault_step < args.steps - 1:
        raise UsageError(f"--fault-step must be in [0, steps - 1): step {args.fault_step} + 1, the step "
                         f"downtime is measured to, must exist in a {args.steps}-step run")
    cfg = BenchConfig(model_size=args.model_size, vocab=args.vocab, seq=args.seq, nproc=args.nproc,
                      steps=args.steps, fault_step=args.fault_step, ckpt_every=args.ckpt_every,
                      corpus_mb=args.corpus_mb, log_dir=args.log_dir, timeout_s=args.timeout)
    result = run_bench(cfg)
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if result["completed"] else 1


def _add_recovery(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("recovery", help="downtime after a SIGKILL of rank 1: hp with a hot spare vs "
                                          "torchrun + DCP checkpoint-restart (vs torchft where installed)")
    p.add_argument("--model-size", default="25m", help="tiny | small | 25m (default 25m: INFRA.md's baseline model)")
    p.add_argument("--vocab", type=int, default=None, help="default: 8192 for 25m (~27 M params), else 256")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nproc", type=int, default=4, help="ranks per variant (hp adds one hot spare)")
    p.add_argument("--steps", type=int, default=14, help="default keeps a 25m bench to a few minutes")
    p.add_argument("--fault-step", type=int, default=12, help="rank 1 is SIGKILLed right after committing it")
    p.add_argument("--ckpt-every", type=int, default=10, help="baseline: DCP save after each step s, s %% K == 0")
    p.add_argument("--corpus-mb", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job before it is killed")
    p.add_argument("--log-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")
    p.set_defaults(handler=_recovery)


@hookimpl
def hp_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks of hp against the traditional ways to do the same")
    bench = p.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    _add_recovery(bench)
