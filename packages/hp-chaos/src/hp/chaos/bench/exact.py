"""``hp bench exact``: what exact mode costs a training step, against the float all-reduce.

``nproc`` ranks (processes, 2 by default), each pinned to its own core (``os.sched_setaffinity``,
``OMP_NUM_THREADS=1``), train the demo model (:func:`hp.checkpointless.demo.model.build_model`, dropout
0.1, AdamW) on gloo the way the step transaction does: the parameters' ``.grad`` are views of one flat
buffer, a step is ``M = micro_batches * nproc`` micro-batches of which each rank computes its block
(:func:`hp.elastic.ownership.owned`), then the reduction, then the optimizer step. Both reductions run
in the same processes, interleaved step by step (float, exact, exact, float, ...: neither always goes
first), on the same model: ``float`` is :class:`hp.checkpointless.reduction.MeanReduction` (one float32
all-reduce, what the transaction does by default), ``exact`` is :class:`hp.elastic.exact.ExactReduction`.

Every step starts at a barrier, and a second barrier right before the reduction lets ``reduce_s``
time the reduction alone (plus, for exact mode, the slot copies made after each backward), not a
peer's slower backward. ``step_s`` is the whole step, barrier to end of the optimizer step. Each
figure is the slowest rank's for that step; the result gives the median over the timed steps and the
min / max (``*_range_s``). ``*_cpu_s`` are the same medians in CPU time of the rank's process (all its
threads, gloo's included): on a machine shared with other jobs, wall time swings with their load and
CPU time much less. Nothing is pickled: the workers get their settings as JSON and write JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hp.chaos.bench.meta import BenchRun, module_main, report
from hp.core.devices import PIN_ENV, pin_to_core
from hp.core.errors import UsageError

MODES = ("float", "exact")
KINDS = ("step", "reduce", "slots", "step_cpu", "reduce_cpu")  # what a worker times per step


DEFINITION_VERSION = 1  # per-step wall time of both modes, interleaved, the slowest rank's


@dataclass
class ExactBenchConfig:
    model_size: str = "small"  # a name of hp.checkpointless.demo.sizes.MODEL_SIZES
    vocab: int = 256
    seq: int = 64
    micro_batches: int = 4  # per rank; the step has micro_batches * nproc
    micro_batch: int = 4  # samples (sequences of seq tokens) per micro-batch
    steps: int = 10  # timed steps per mode
    warmup: int = 2  # untimed steps per mode first
    nproc: int = 2
    timeout_s: float = 600.0
    seed: int = 0

    def check(self) -> None:
        try:
            from hp.checkpointless.demo.sizes import MODEL_SIZES
        except ImportError as e:
            raise UsageError(f"hp bench exact needs hp-checkpointless ({e}); pip install packages/hp-checkpointless") from None
        if self.model_size not in MODEL_SIZES:
            raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {self.model_size!r}")
        if min(self.micro_batches, self.micro_batch, self.steps, self.seq) < 1 or self.vocab < 2 or self.warmup < 0:
            raise UsageError("--micro-batches, --micro-batch, --steps and --seq must be >= 1, --vocab >= 2, --warmup >= 0")
        if self.nproc < 2:
            raise UsageError(f"--nproc must be >= 2 (a reduction needs peers), got {self.nproc}")


def _spread(values: list[float]) -> tuple[float, list[float]]:
    return round(statistics.median(values), 6), [round(min(values), 6), round(max(values), 6)]


def run(cfg: ExactBenchConfig) -> dict[str, Any]:
    """Run the ranks, return the result (module docstring); raises RuntimeError when a rank fails."""
    cfg.check()
    bench = BenchRun("exact", DEFINITION_VERSION)
    cores = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", PIN_ENV: "1"}
    with tempfile.TemporaryDirectory(prefix="hp-bench-exact-") as tmp:
        out = Path(tmp)
        procs = [subprocess.Popen([sys.executable, "-m", "hp.chaos.bench.exact", "--worker", str(rank), str(out), json.dumps(asdict(cfg))], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
                 for rank in range(cfg.nproc)]
        try:
            deadline = time.monotonic() + cfg.timeout_s
            logs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"hp bench exact: ranks did not finish in {cfg.timeout_s:g} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        failed = [(r, p.returncode, log[-2000:]) for r, (p, log) in enumerate(zip(procs, logs)) if p.returncode]
        if failed:
            raise RuntimeError(f"hp bench exact: ranks failed: {failed}")
        raw = json.loads((out / "result.json").read_text())
    result: dict[str, Any] = {"model_size": cfg.model_size, "params": raw["params"], "grad_bytes": raw["grad_bytes"],
                              "world": cfg.nproc, "micro_batches_per_rank": cfg.micro_batches,
                              "micro_batches_per_step": cfg.micro_batches * cfg.nproc, "micro_batch": cfg.micro_batch,
                              "seq": cfg.seq, "steps": cfg.steps, "warmup": cfg.warmup,
                              "pinned": cfg.nproc <= len(cores), "cores": len(cores)}
    for mode in MODES:
        for what in ("step", "reduce"):
            result[f"{mode}_{what}_s"], result[f"{mode}_{what}_range_s"] = _spread(raw[mode][what])
            result[f"{mode}_{what}_cpu_s"] = _spread(raw[mode][f"{what}_cpu"])[0]
    result["exact_slot_copy_s"], result["exact_slot_copy_range_s"] = _spread(raw["exact"]["slots"])
    result["ratio"] = round(result["exact_step_s"] / result["float_step_s"], 4)
    result["reduce_ratio"] = round(result["exact_reduce_s"] / result["float_reduce_s"], 3)
    result["overhead_s"] = round(result["exact_step_s"] - result["float_step_s"], 6)
    result["cpu_ratio"] = round(result["exact_step_cpu_s"] / result["float_step_cpu_s"], 4)
    return bench.stamp(result)


def _worker(rank: int, out: Path, cfg: ExactBenchConfig) -> None:
    """One rank: pin, train both modes interleaved, write the slowest rank's timings (rank 0). The ranks meet
    through a file store in ``out``: no port chosen ahead (another process can take a free port before rank 0
    binds it, which the test suite's parallel jobs make likely)."""
    pin_to_core(rank)
    import torch
    import torch.distributed as dist

    from hp.checkpointless.demo.model import build_model
    from hp.checkpointless.reduction import MeanReduction
    from hp.elastic.exact import ExactReduction
    from hp.elastic.ownership import micro_batch_seed, owned

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=cfg.nproc)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model_size, vocab=cfg.vocab, seq=cfg.seq, dropout=0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    opt = torch.optim.AdamW(params, lr=1e-4)
    reductions = {"float": MeanReduction(), "exact": ExactReduction()}
    m_total = cfg.micro_batches * cfg.nproc
    mine = owned(m_total, rank, cfg.nproc)

    def collective(fn, *args, **kwargs):
        fn(*args, **kwargs)

    def step(mode: str, s: int) -> tuple[float, ...]:
        red = reductions[mode]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        red.begin()
        flat.zero_()
        slots = slots_cpu = 0.0
        for m in mine:
            torch.manual_seed(micro_batch_seed(cfg.seed, s, m))
            tokens = torch.randint(0, cfg.vocab, (cfg.micro_batch, cfg.seq + 1))
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1)).backward()
            t, c = time.perf_counter(), time.process_time()
            red.micro_batch_done(flat, m)
            slots += time.perf_counter() - t
            slots_cpu += time.process_time() - c
        dist.barrier()  # the reduction alone is timed from here: no waiting for a peer's backward
        t, c = time.perf_counter(), time.process_time()
        red.reduce(flat, m_total, collective)
        reduce_s, reduce_cpu = time.perf_counter() - t + slots, time.process_time() - c + slots_cpu
        opt.step()
        return time.perf_counter() - t0, reduce_s, slots, time.process_time() - c0, reduce_cpu

    times = torch.zeros(len(MODES), len(KINDS), cfg.steps, dtype=torch.float64)  # [mode, kind, step]
    for i in range(cfg.warmup + cfg.steps):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            got = step(mode, i)
            if i >= cfg.warmup:
                times[MODES.index(mode), :, i - cfg.warmup] = torch.tensor(got, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per step, the slowest rank's figure
    if rank == 0:
        raw: dict[str, Any] = {"params": flat.numel(), "grad_bytes": flat.numel() * flat.element_size()}
        for k, mode in enumerate(MODES):
            raw[mode] = {kind: times[k, j].tolist() for j, kind in enumerate(KINDS)}
        (out / "result.json").write_text(json.dumps(raw))
    dist.barrier()
    dist.destroy_process_group()


def format_table(r: dict[str, Any]) -> str:
    def row(name: str, key: str) -> str:
        lo, hi = r[f"{key}_range_s"]
        return f"{name:<28}{r[f'{key}_s'] * 1e3:>10.2f} ms   (min {lo * 1e3:.2f}, max {hi * 1e3:.2f})"

    head = (f"exact mode vs float all-reduce: {r['model_size']} model, {r['params'] / 1e6:.2f} M params, "
            f"{r['world']} ranks{' (one core each)' if r['pinned'] else ' (sharing cores)'}, "
            f"{r['micro_batches_per_rank']} micro-batches of {r['micro_batch']}x{r['seq']} tokens per rank, "
            f"median of {r['steps']} steps per mode")
    return "\n".join([head, row("step, float", "float_step"), row("step, exact", "exact_step"),
                      row("reduction, float", "float_reduce"), row("reduction, exact", "exact_reduce"),
                      row("  of which slot copies", "exact_slot_copy"),
                      f"{'step ratio exact / float':<28}{r['ratio']:>10.3f}   (CPU time: {r['cpu_ratio']:.3f})",
                      f"{'reduction ratio':<28}{r['reduce_ratio']:>10.2f}   (CPU time: exact "
                      f"{r['exact_reduce_cpu_s'] * 1e3:.2f} ms, float {r['float_reduce_cpu_s'] * 1e3:.2f} ms)"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    d = ExactBenchConfig()
    add_workload_args(p, "model_size", "vocab", "seq", model_size=d.model_size, vocab=d.vocab, seq=d.seq,
                      helps={"model_size": "tiny | small | 25m (the demo model)"})
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, help="micro-batches per rank per step")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per mode first")
    p.add_argument("--nproc", type=int, default=d.nproc, help="ranks, one core each where there are enough")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds before the ranks are killed")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def run_cli(args: argparse.Namespace) -> int:
    cfg = ExactBenchConfig(model_size=args.model_size, vocab=args.vocab, seq=args.seq, micro_batches=args.micro_batches,
                           micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup, nproc=args.nproc,
                           timeout_s=args.timeout)
    result = run(cfg)
    return report(result, format_table(result), args)


def main(argv: list[str] | None = None) -> int:
    def worker(args: list[str]) -> None:
        rank, out, cfg = args[:3]
        _worker(int(rank), Path(out), ExactBenchConfig(**json.loads(cfg)))

    return module_main(argv, "python -m hp.chaos.bench.exact", __doc__, add_arguments, run_cli, worker)


if __name__ == "__main__":
    sys.exit(main())
