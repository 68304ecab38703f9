"""``hp bench step``: what hp's step transaction costs a steady-state training step, against plain DDP.

The same training (:func:`hp.checkpointless.demo.model.build_model`, dropout 0.1, AdamW, the
:class:`hp.checkpointless.data.Batches` of one token cache) runs once per mode and repeat, each time as a
job of ``nproc`` ranks started by ``hp run`` (the same launcher for all), every rank pinned to its own core
(``HP_PIN_CORES=1``, ``OMP_NUM_THREADS=1``):

* ``ddp``: ``DistributedDataParallel`` (its bucketed all-reduce overlaps the backward), ``zero_grad``,
  ``backward``, ``optimizer.step``;
* ``hp``: ``@recoverable`` with ``ctx.register(model, optimizer)`` and ``with step: ... ctx.commit(loss)``:
  hp's flat gradient all-reduce after the backward, the commit vote, the optimizer step, the commit event;
* ``hp_overlap``: the same with ``reduction=OverlappedMeanReduction()`` (:mod:`hp.checkpointless.overlap`):
  the all-reduce starts during backward, in buckets of 25 MB as DDP's, the vote after the last one;
* ``fsdp``: the model sharded with FSDP2 (``fully_shard`` on each transformer layer, then the root) over
  all ranks on torch's own device mesh, ``backward``, ``optimizer.step``, ``zero_grad``;
* ``hp_fsdp``: the same sharding on ``ctx.device_mesh()`` under ``@recoverable``: FSDP's reductions in
  backward, then hp's copy of this rank's shard and its gradients to the buddy rank, the vote, the update
  (:mod:`hp.checkpointless.fsdp`).

The modes alternate (in order, then reversed, ...) so that none always runs first.
Each rank times each step after ``warmup`` (wall clock, from the step's start to the end of its optimizer
step) and, inside it, ``compute`` (forward and backward: an overlapped all-reduce is in there) and the rest
(``tail``: for hp the reduction, or what is left of it, vote and update in ``ctx.commit``; for DDP the
optimizer step and the all-reduce left to wait for). A step's figure is its slowest rank's. ``overhead``
= median hp step / median DDP step - 1, and per repeat (``overhead_by_repeat``), so its spread shows;
``overlap_overhead`` the same for ``hp_overlap``; ``fsdp_overhead`` = median hp_fsdp step / median fsdp step
- 1. Nothing is pickled: settings go to the ranks as JSON, timings come back as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hp.chaos.bench.meta import BenchRun, module_main, report, spread
from hp.core.devices import PIN_ENV
from hp.core.errors import UsageError

MODES = ("hp", "hp_overlap", "ddp", "fsdp", "hp_fsdp")
# 1: hp and DDP; 2: hp_overlap too (per-step wall time, slowest rank, the modes alternating under one launcher);
# 3: fsdp and hp_fsdp too
DEFINITION_VERSION = 3
OVERHEADS = (("hp", "ddp", "overhead"), ("hp_overlap", "ddp", "overlap_overhead"), ("hp_fsdp", "fsdp", "fsdp_overhead"))


@dataclass
class StepBenchConfig:
    model_size: str = "25m"  # a name of hp.checkpointless.demo.sizes.MODEL_SIZES
    vocab: int = 8192
    seq: int = 64
    batch_size: int = 8  # sequences per rank and step
    steps: int = 12  # timed steps per job
    warmup: int = 3  # untimed steps first
    repeats: int = 2  # jobs per mode
    nproc: int = 2
    corpus_mb: int = 8
    timeout_s: float = 900.0  # per job
    seed: int = 0

    def check(self) -> None:
        from hp.checkpointless.demo.sizes import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {self.model_size!r}")
        if min(self.steps, self.repeats, self.batch_size, self.seq, self.corpus_mb) < 1 or self.warmup < 0:
            raise UsageError("--steps, --repeats, --batch-size, --seq and --corpus-mb must be >= 1, --warmup >= 0")
        if self.vocab < 256:
            raise UsageError(f"--vocab must be >= 256 (the corpus is bytes), got {self.vocab}")
        if self.nproc < 2:
            raise UsageError(f"--nproc must be >= 2 (an all-reduce needs peers), got {self.nproc}")


def run(cfg: StepBenchConfig, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict[str, Any]:
    """Run the jobs; the result (module docstring). Raises RuntimeError when a job fails."""
    cfg.check()
    bench = BenchRun("step", DEFINITION_VERSION)
    cores = sorted(os.sched_getaffinity(0))
    per_mode: dict[str, list[dict[str, list[float]]]] = {m: [] for m in MODES}
    params = 0
    with tempfile.TemporaryDirectory(prefix="hp-bench-step-") as tmp:
        for repeat in range(cfg.repeats):
            for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
                log(f"hp bench step: repeat {repeat + 1}/{cfg.repeats}, {mode}")
                timings, params = _job(cfg, mode, Path(tmp) / f"{mode}{repeat}")
                per_mode[mode].append(timings)
    result: dict[str, Any] = {"model_size": cfg.model_size, "vocab": cfg.vocab, "seq": cfg.seq,
                              "batch_size": cfg.batch_size, "world": cfg.nproc, "steps": cfg.steps,
                              "warmup": cfg.warmup, "repeats": cfg.repeats, "pinned": cfg.nproc <= len(cores),
                              "cores": len(cores), "params": params}
    for mode in MODES:
        for what in ("step", "compute", "tail"):
            result[f"{mode}_{what}"] = spread(v for job in per_mode[mode] for v in job[what])
        result[f"{mode}_step_s"] = result[f"{mode}_step"]["median"]
    for mode, base, key in OVERHEADS:
        result[key] = round(result[f"{mode}_step_s"] / result[f"{base}_step_s"] - 1, 4)
        result[f"{key}_by_repeat"] = [round(statistics.median(h["step"]) / statistics.median(d["step"]) - 1, 4)
                                      for h, d in zip(per_mode[mode], per_mode[base])]
    return bench.stamp(result)


def _job(cfg: StepBenchConfig, mode: str, out: Path) -> tuple[dict[str, list[float]], int]:
    """One ``hp run`` job of ``mode``: per step, the slowest rank's figures; the model's parameters."""
    from hp.core.procs import free_port

    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", PIN_ENV: "1"}
    cmd = [sys.executable, "-m", "hp.core.cli", "run", "--nproc-per-node", str(cfg.nproc), "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--tee", "0", "--log-dir", str(out / "logs"), "--max-restarts", "0",
           "-m", "hp.chaos.bench.step", "--worker", mode, str(out), json.dumps(asdict(cfg))]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"hp bench step: the {mode} job did not finish in {cfg.timeout_s:g} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"hp bench step: the {mode} job failed ({done.returncode}): {done.stderr[-2000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cfg.nproc)]
    return {what: [max(r[what][i] for r in ranks) for i in range(cfg.steps)]
            for what in ("step", "compute", "tail")}, ranks[0]["params"]


# ---- the ranks ------------------------------------------------------------------------------------
def _worker(mode: str, out: Path, cfg: StepBenchConfig) -> None:
    from hp.core.devices import pin_to_core

    pin_to_core(int(os.environ["RANK"]))
    import torch

    torch.set_num_threads(1)
    if mode in ("ddp", "fsdp"):
        _train_plain(out, cfg, fsdp=mode == "fsdp")
    else:
        _train_hp(out, cfg, overlap=mode == "hp_overlap", fsdp=mode == "hp_fsdp")


def _setup(cfg: StepBenchConfig):  # noqa: ANN202
    import torch

    from hp.checkpointless.data import Batches, TokenCache, synthetic_corpus, tokenize
    from hp.checkpointless.demo.model import build_model

    cache = TokenCache.open(f"bench-step-{cfg.corpus_mb}mb-s{cfg.seed}",
                            lambda: tokenize(synthetic_corpus(cfg.corpus_mb << 20, cfg.seed)))
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model_size, vocab=cfg.vocab, seq=cfg.seq, dropout=0.1)
    return Batches(cache, cfg.seq, cfg.batch_size, cfg.seed), model


def _write(out: Path, rank: int, params: int, times: list[tuple[float, float]], cfg: StepBenchConfig) -> None:
    """``times``: per step (whole step, forward and backward)."""
    timed = times[cfg.warmup:]
    (out / f"rank{rank}.json").write_text(json.dumps({
        "params": params, "step": [t[0] for t in timed], "compute": [t[1] for t in timed],
        "tail": [t[0] - t[1] for t in timed]}))


def _train_plain(out: Path, cfg: StepBenchConfig, fsdp: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hp.checkpointless.demo.model import shard_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batches, model = _setup(cfg)
    model = shard_model(model, init_device_mesh("cpu", (world,))) if fsdp else DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    times = []
    for step in range(cfg.warmup + cfg.steps):
        x, y = batches.get(step, rank, world)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        computed = time.perf_counter()
        optimizer.step()
        times.append((time.perf_counter() - start, computed - start))
    _write(out, rank, sum(p.numel() for p in model.parameters()), times, cfg)
    dist.destroy_process_group()


def _train_hp(out: Path, cfg: StepBenchConfig, overlap: bool, fsdp: bool) -> None:
    import torch
    import torch.nn.functional as F

    from hp.checkpointless import recoverable
    from hp.checkpointless.demo.model import shard_model
    from hp.checkpointless.overlap import OverlappedMeanReduction

    @recoverable
    def train(ctx) -> None:  # noqa: ANN001
        mesh = ctx.device_mesh() if fsdp else None
        batches, model = _setup(cfg)
        if mesh is not None:
            model = shard_model(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        ctx.register(model, optimizer, reduction=OverlappedMeanReduction() if overlap else None)
        times = []
        for step in ctx.steps(cfg.warmup + cfg.steps):
            x, y = batches.get(step, ctx.rank, ctx.world_size)
            start = time.perf_counter()
            with step:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                computed = time.perf_counter()
                ctx.commit(loss)
            times.append((time.perf_counter() - start, computed - start))
        _write(out, ctx.rank, sum(p.numel() for p in model.parameters()), times, cfg)

    train()


# ---- the command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    d = StepBenchConfig()
    add_workload_args(p, "model_size", "vocab", "seq", model_size=d.model_size, vocab=d.vocab, seq=d.seq,
                      helps={"model_size": "tiny | small | 25m"})
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--repeats", type=int, default=d.repeats, help="jobs per mode, alternating")
    p.add_argument("--nproc", type=int, default=d.nproc)
    add_workload_args(p, "corpus_mb", corpus_mb=d.corpus_mb)
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def format_table(r: dict[str, Any]) -> str:
    def ms(s: dict | None) -> str:
        return "-" if s is None else f"{s['median'] * 1e3:.1f} ms [{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}]"

    lines = [f"hp bench step: {r['model_size']} ({r['params'] / 1e6:.1f} M params), {r['world']} ranks "
             f"{'pinned one per core' if r['pinned'] else 'NOT pinned (more ranks than cores)'}, "
             f"{r['steps']} steps x {r['repeats']} jobs per mode",
             f"{'':10}{'step':>26}{'forward+backward':>28}{'after backward':>28}"]
    for mode in MODES:
        lines.append(f"{mode:10}{ms(r[f'{mode}_step']):>26}{ms(r[f'{mode}_compute']):>28}{ms(r[f'{mode}_tail']):>28}")
    for mode, base, key in OVERHEADS:
        lines.append(f"overhead ({mode} / {base} - 1): {r[key]:+.1%} (per job pair: "
                     f"{', '.join(f'{o:+.1%}' for o in r[f'{key}_by_repeat'])})")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    cfg = StepBenchConfig(model_size=args.model_size, vocab=args.vocab, seq=args.seq, batch_size=args.batch_size,
                          steps=args.steps, warmup=args.warmup, repeats=args.repeats, nproc=args.nproc,
                          corpus_mb=args.corpus_mb)
    result = run(cfg)
    return report(result, format_table(result), args)


def main(argv: list[str] | None = None) -> int:
    def worker(args: list[str]) -> None:
        mode, out, cfg = args[:3]
        _worker(mode, Path(out), StepBenchConfig(**json.loads(cfg)))

    return module_main(argv, "python -m hp.chaos.bench.step", __doc__, add_arguments, run_cli, worker)


if __name__ == "__main__":
    sys.exit(main())
