"""``hp bench hydrate``: how fast a hot spare receives the training state, against a memcpy of the same bytes.

Two processes on this node, each pinned to a core of its own: a source holding the demo GPT's state after
one AdamW step (the 25m model: parameters and both moments, ~328 MB), and a receiver as a promoted spare
finds itself (the same model, an optimizer without state, a receive buffer faulted in before the timer).
Each repeat times the hydration the runtime does (:func:`hp.checkpointless.hydration.replicated`, the
code a re-form runs), from both processes leaving a barrier to the receiver's state being restored:

* ``shm``: the receiver's buffer is shared memory and the source packs the state straight into it
  (:mod:`hp.checkpointless.shm`; skeleton and header over gloo), mapping it when the failure comes;
* ``premapped``: the same, with the buffer mapped by the source before the failure, as a job's sources
  do once a spare has offered it (:mod:`hp.checkpointless.premap`: the offer file, the background
  mapping, taken by the hydration), waited for before the timer starts;
* ``tcp``: the same state over gloo (header, skeleton and the flat buffer, CRC-checked on both sides), as
  between two nodes.

``floor_s`` is a memcpy of the same number of bytes into memory allocated and faulted in beforehand, in
the source process, timed in the same run. With ``--device cuda`` both processes keep the state on the
node's first GPU (what a spare on the same node as its source does: no nccl, the state staged through host
memory) and ``staging_s`` is that copy's floor: the same bytes from the GPU to pinned host memory and
back. ``shm_of_floor`` = the floor's throughput / shm's (the issue's goal: >= 0.5), ``premapped_of_floor``
the same for ``premapped``. Modes alternate (shm, premapped, tcp, floor, then reversed). The state's
checksums match after every transfer (the receiver's state digest against the source's), or the run fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hp.chaos.bench.meta import BenchRun, module_main, report, spread
from hp.core.auth import TOKEN_ENV
from hp.core.errors import UsageError

MODES = ("shm", "premapped", "tcp", "floor")
DEFINITION_VERSION = 2  # 2: the premapped mode


@dataclass
class HydrateBenchConfig:
    model_size: str = "25m"
    vocab: int = 8192
    repeats: int = 5
    device: str = "cpu"
    timeout_s: float = 600.0

    def check(self) -> None:
        from hp.checkpointless.demo.sizes import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise UsageError(f"--model-size must be one of {sorted(MODEL_SIZES)}, got {self.model_size!r}")
        if self.repeats < 1 or self.vocab < 256:
            raise UsageError(f"--repeats must be >= 1 and --vocab >= 256, got {self.repeats} and {self.vocab}")
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UsageError("--device cuda needs a CUDA GPU, and torch.cuda.is_available() is False here")

    @property
    def modes(self) -> tuple[str, ...]:
        return (*MODES, "staging") if self.device == "cuda" else MODES


def run(cfg: HydrateBenchConfig) -> dict[str, Any]:
    cfg.check()
    from hp.core.procs import free_port

    bench = BenchRun("hydrate", DEFINITION_VERSION)
    with tempfile.TemporaryDirectory(prefix="hp-bench-hydrate-") as tmp:
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", TOKEN_ENV: secrets.token_hex(16)}
        procs = [subprocess.Popen([sys.executable, "-m", "hp.chaos.bench.hydrate", "--worker", str(rank),
                                   str(port), tmp, json.dumps(asdict(cfg))], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        try:
            outs = [p.communicate(timeout=cfg.timeout_s) for p in procs]
        finally:
            for p in procs:
                p.kill()
        for p, (_, err) in zip(procs, outs):
            if p.returncode != 0:
                raise RuntimeError(f"hp bench hydrate: a rank failed ({p.returncode}): {err[-2000:]}")
        times = json.loads((Path(tmp) / "times.json").read_text())
    nbytes = times.pop("nbytes")
    result: dict[str, Any] = {"model_size": cfg.model_size, "vocab": cfg.vocab, "repeats": cfg.repeats,
                              "device": cfg.device, "nbytes": nbytes, "pinned": len(os.sched_getaffinity(0)) >= 2}
    for mode in cfg.modes:
        result[f"{mode}_s"] = spread(times[mode])
        result[f"{mode}_gbps"] = round(nbytes / statistics.median(times[mode]) / 1e9, 3)
    result["shm_of_floor"] = round(statistics.median(times["floor"]) / statistics.median(times["shm"]), 3)
    result["premapped_of_floor"] = round(statistics.median(times["floor"]) / statistics.median(times["premapped"]), 3)
    result["tcp_of_floor"] = round(statistics.median(times["floor"]) / statistics.median(times["tcp"]), 3)
    if cfg.device == "cuda":
        result["shm_of_staging"] = round(statistics.median(times["staging"]) / statistics.median(times["shm"]), 3)
    return bench.stamp(result)


# ---- the two processes ---------------------------------------------------------------------------
def _worker(rank: int, port: int, out: Path, cfg: HydrateBenchConfig) -> None:
    from datetime import timedelta

    from hp.core.devices import pin_to_core

    pin_to_core(rank)
    import torch
    import torch.distributed as dist

    from hp.checkpointless import hydration, shm
    from hp.checkpointless.agreement import Agreement
    from hp.checkpointless.premap import Premaps
    from hp.checkpointless.demo.model import build_model
    from hp.checkpointless.events import EventLog
    from hp.checkpointless.registry import TrainingState, digest
    from hp.checkpointless.sharded import Versions
    from hp.checkpointless.state import StateBuffer, place_parameters, wire_nbytes

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))

    def training_state() -> TrainingState:
        torch.manual_seed(0)
        model = build_model(cfg.model_size, vocab=cfg.vocab, seq=64).to(cfg.device)
        return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    source = None
    if rank == 0:
        source = training_state()
        for p in source.params:  # one step: AdamW holds both moments, as in training
            p.grad = torch.randn_like(p)
        source.optimizer.step()
    nbytes = torch.tensor([wire_nbytes(source.capture()) if source else 0])
    dist.all_reduce(nbytes)
    nbytes = int(nbytes)
    events = EventLog(None, f"rank{rank}")
    premaps = Premaps(str(out / "offers"), os.environ[TOKEN_ENV])  # the node's offers folder, sealed as a job's
    premaps.active = rank == 0
    times: dict[str, list[float]] = {m: [] for m in cfg.modes}
    floors = [m for m in cfg.modes if m not in ("shm", "premapped", "tcp")]
    for repeat in range(cfg.repeats):
        for mode in (cfg.modes if repeat % 2 == 0 else cfg.modes[::-1]):
            if mode in floors:  # the source process: contiguous copies into memory allocated before
                if rank == 0:
                    times[mode].append(_floor(mode, nbytes, cfg.device))
                dist.barrier()
                continue
            st = source if rank == 0 else training_state()
            if rank == 1:  # a promoted spare: its receive buffer allocated and faulted in while it waited
                size = -(-(nbytes + (nbytes >> 6)) // 64) * 64
                if mode != "tcp":
                    st.receive_shared = shm.SharedBuffer.create(size)
                    data = st.receive_shared.tensor
                    if mode == "premapped":
                        premaps.offer("n0s0", st.receive_shared)
                else:
                    data = torch.zeros(size, dtype=torch.uint8)
                st.receive_buffer = StateBuffer(None, data)
                place_parameters(st.model, data)  # as Formation does for a spare while it waits
            dist.barrier()  # offered
            if rank == 0:  # a source's step boundaries after the offer: the buffer mapped in the background
                st.premaps = premaps if mode != "tcp" else None  # shm: no offer seen before the failure
                if mode == "premapped":
                    premaps.poll()
                    if premaps.wait_mapped(60) != 1:
                        raise RuntimeError("the spare's offered buffer was not mapped")
            a = Agreement(1, 0, source=0, behind=[1], versions=Versions([0, -1], [-1] * 2, [-1] * 2, [-1] * 2),
                                    nodes=(0, 1) if mode == "tcp" else (0, 0))
            gc.collect()  # the last repeat's state is garbage here (a spare collects while it waits: Formation)
            dist.barrier()
            start = time.perf_counter()
            hydration.replicated(st, a, rank, events)
            if rank == 1:
                times[mode].append(time.perf_counter() - start)
                if mode == "premapped":
                    premaps.withdraw("n0s0")
            captured = st.capture()
            mine = torch.tensor(list(bytes.fromhex(digest({k: captured[k] for k in ("model", "optimizer")}))),
                                dtype=torch.int64)
            theirs = mine.clone()
            dist.broadcast(theirs, 0)
            if not torch.equal(mine, theirs):
                raise RuntimeError(f"the {mode} hydration delivered another optimizer state than the source's")
            if rank == 0:
                premaps.poll()  # the source's next step boundary: it unmaps what it packed into
    for mode in floors:
        if rank == 1:
            floor = torch.zeros(cfg.repeats, dtype=torch.float64)
            dist.recv(floor, 0)
            times[mode] = floor.tolist()
        else:
            dist.send(torch.tensor(times[mode], dtype=torch.float64), 1)
    if rank == 1:
        (out / "times.json").write_text(json.dumps({"nbytes": nbytes, **times}))
    dist.destroy_process_group()


def _floor(mode: str, nbytes: int, device: str) -> float:
    """Seconds of one floor copy of ``nbytes``: ``floor``, host memory to host memory; ``staging``, the
    GPU's memory to pinned host memory and back (the least a hydration staged through the host costs)."""
    import torch

    if mode == "floor":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    back = torch.zeros_like(gpu)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    host.copy_(gpu)
    back.copy_(host)
    torch.cuda.synchronize()
    return time.perf_counter() - start


# ---- the command ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from hp.checkpointless.demo.workload import add_workload_args

    d = HydrateBenchConfig()
    add_workload_args(p, "model_size", "vocab", model_size=d.model_size, vocab=d.vocab,
                      helps={"model_size": "tiny | small | 25m (~328 MB with AdamW)"})
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--device", default=d.device, help="cpu | cuda (the state on the node's first GPU)")
    p.add_argument("--out", default=None, help="also write the result JSON here")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def format_table(r: dict[str, Any]) -> str:
    lines = [f"hp bench hydrate: {r['model_size']}, {r['nbytes'] / 1e6:.0f} MB on {r['device']}, 2 processes on one "
             f"node {'pinned one per core' if r['pinned'] else 'NOT pinned'}, {r['repeats']} repeats"]
    for mode in [m for m in (*MODES, "staging") if f"{m}_s" in r]:
        s = r[f"{mode}_s"]
        lines.append(f"{mode:6} {s['median'] * 1e3:8.1f} ms [{s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}]  "
                     f"{r[f'{mode}_gbps']:.2f} GB/s")
    lines.append(f"shm hydration at {r['shm_of_floor']:.0%} of the memcpy floor's throughput, "
                 f"{r['premapped_of_floor']:.0%} premapped (tcp: {r['tcp_of_floor']:.0%})")
    if "shm_of_staging" in r:
        lines.append(f"shm hydration at {r['shm_of_staging']:.0%} of the GPU-host-GPU staging floor's throughput")
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    result = run(HydrateBenchConfig(model_size=args.model_size, vocab=args.vocab, repeats=args.repeats,
                                    device=args.device))
    return report(result, format_table(result), args)


def main(argv: list[str] | None = None) -> int:
    def worker(args: list[str]) -> None:
        rank, port, out, cfg = args[:4]
        _worker(int(rank), int(port), Path(out), HydrateBenchConfig(**json.loads(cfg)))

    return module_main(argv, "python -m hp.chaos.bench.hydrate", __doc__, add_arguments, run_cli, worker)


if __name__ == "__main__":
    sys.exit(main())
