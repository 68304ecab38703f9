"""The step as a transaction, end to end: real `hp run` jobs of transaction_worker.py (CPU gloo,
3 workers + 1 hot spare unless noted) through the ``StepSampler``/``StepLoader``/``ctx.reduce()``/
``ctx.commit()`` API, with BatchNorm + dropout, gradient clipping, AMP with a GradScaler, gradient
accumulation and a DataLoader with worker processes.

Every faulted job is compared with the fault-free job of the same configuration: every rank's final
parameters, buffers, optimizer, scheduler and scaler state bit for bit (twice: the runtime's
``final_state`` digests, and the tensors each rank wrote itself), every rank with every other, the
state after every step, and every committed loss.

The fault-free references are shared by the tests (and by pytest-xdist's workers: the first to
need one runs it, under a file lock, the others read its logs).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pytest
import torch

from hp.checkpointless.demo.run import RunResult, compare
from hp.checkpointless.events import read_events
from hp.testing import kill_tagged

WORKER = Path(__file__).with_name("transaction_worker.py")
STEPS, AT = 10, 5
JOB_TIMEOUT_S = 120  # a hang bound only (two jobs stay within pytest.ini's 300 s); a job takes ~12-20 s

INF_STEP, INF_RANK = 3, 2  # the AMP job's injected inf gradient
# name -> (workers, transaction_worker.py flags); each runs once fault-free as a reference
CONFIGS = {
    "bn": (3, ["--model", "bn"]),
    "clip": (3, ["--model", "bn", "--clip", "0.5"]),
    "amp": (3, ["--model", "bn", "--scaler", "--inf-step", str(INF_STEP), "--inf-rank", str(INF_RANK)]),
    "accum": (2, ["--model", "bn", "--accum", "4"]),  # 2 micro-batches per rank and step
    "dataset": (3, ["--model", "bn", "--dataset", "--accum", "6"]),
}


@dataclass
class Job:
    returncode: int
    wall_s: float
    log_dir: Path
    output: str

    @cached_property
    def events(self) -> list[dict]:
        return read_events(str(self.log_dir / "events"))

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def dumps(self) -> dict[int, dict]:
        """Each rank's own dump of its final state (written by whichever process held the rank last)."""
        out = {}
        for f in sorted((self.log_dir / "state").glob("rank*.pt")):
            try:
                out[int(f.stem[4:])] = torch.load(f, weights_only=True)
            except RuntimeError as e:  # what a user's torch.save(optimizer.state_dict()) checkpoint would hit
                raise AssertionError(f"{f.stem}'s torch.save of its final state (model, optimizer, scheduler, "
                                     f"scaler state_dicts) cannot be loaded back: {e}") from None
        return out

    def result(self) -> RunResult:
        return RunResult(self.returncode, self.wall_s, self.events, self.output)


def hp_run(log_dir: Path, nproc: int, spares: int, args: list[str], faults: list[dict], env: dict) -> Job:
    cmd = [sys.executable, "-m", "hp.core.cli", "run", "--nproc-per-node", str(nproc), "--spares", str(spares),
           "--monitor-interval", "0.02", "--hang-timeout", "10", "--max-restarts", "0",
           "--log-dir", str(log_dir), "--tee", "0",
           str(WORKER), "--steps", str(STEPS), "--dump", str(log_dir / "state"), *args]
    tag = f"HP_TEST_JOB={log_dir}"
    env = {**os.environ, **env, "HP_FAULTS": json.dumps(faults), "HP_TEST_JOB": str(log_dir)}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[test: killed after {JOB_TIMEOUT_S} s]"
    finally:
        kill_tagged(tag)  # workers live in sessions of their own
    return Job(proc.returncode, time.monotonic() - start, log_dir, out)


@pytest.fixture(scope="session")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("transaction")
    yield {"HP_TEST_DIR": str(root)}
    kill_tagged(f"HP_TEST_DIR={root}")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, job_env):
    """``reference(name)``: the fault-free job of CONFIGS[name], run once per test session."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the base temp of the whole run, shared by the xdist workers
    shared = shared / "transaction-references"
    shared.mkdir(exist_ok=True)
    cache: dict[str, Job] = {}

    def get(name: str) -> Job:
        if name not in cache:
            log_dir = shared / name
            with open(shared / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not (log_dir / "job.json").exists():
                    shutil.rmtree(log_dir, ignore_errors=True)
                    nproc, args = CONFIGS[name]
                    job = hp_run(log_dir, nproc, 0, args, [], job_env)
                    (log_dir / "job.json").write_text(json.dumps(
                        {"returncode": job.returncode, "wall_s": job.wall_s, "output": job.output}))
            meta = json.loads((log_dir / "job.json").read_text())
            job = Job(meta["returncode"], meta["wall_s"], log_dir, meta["output"])
            assert job.returncode == 0, job.output[-3000:]
            cache[name] = job
        return cache[name]

    return get


def faulted(tmp_path: Path, job_env: dict, name: str, faults: list[dict], spares: int = 1) -> Job:
    nproc, args = CONFIGS[name]
    job = hp_run(tmp_path / "logs", nproc, spares, args, faults, job_env)
    assert job.returncode == 0, job.output[-3000:]
    assert [e["rank"] for e in job.of("fault_injected")] == [f["rank"] for f in faults]
    return job


# ---- comparisons ------------------------------------------------------------------------------
def final_states(job: Job) -> dict[int, dict]:
    return {e["rank"]: e for e in job.of("final_state")}  # the last one of each rank


def flat(obj, path: str = "") -> dict[str, object]:
    """Every leaf of a nested state; a tensor as (dtype, shape, its bytes)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        return {path: (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())}
    if isinstance(obj, dict):
        return {k: v for key in sorted(obj, key=str) for k, v in flat(obj[key], f"{path}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, x in enumerate(obj) for k, v in flat(x, f"{path}[{i}]").items()}
    return {path: obj.hex() if isinstance(obj, float) else obj}


def differences(a: dict, b: dict, keys=("params", "buffers", "optimizer", "scheduler", "scaler")) -> list[str]:
    fa, fb = flat({k: a[k] for k in keys}), flat({k: b[k] for k in keys})
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def assert_state_identical(reference: Job, job: Job, nproc: int) -> None:
    """Every rank's final state equals the same rank's of the reference and every other rank's."""
    ref, got = final_states(reference), final_states(job)
    assert sorted(ref) == sorted(got) == list(range(nproc)), (sorted(ref), sorted(got))
    for r in range(nproc):
        digests = got[r]["digests"]
        assert all(isinstance(digests[k], str) for k in ("params", "buffers", "optimizer", "scheduler")), digests
        assert got[r]["step"] == ref[r]["step"] == STEPS - 1
        assert digests == ref[r]["digests"], f"rank {r} differs from the reference: {digests} != {ref[r]['digests']}"
        assert digests == got[0]["digests"], f"rank {r} differs from rank 0: {digests} != {got[0]['digests']}"
    # the same, from each rank's own dump of its tensors
    ref_dump, got_dump = reference.dumps(), job.dumps()
    assert sorted(ref_dump) == sorted(got_dump) == list(range(nproc))
    for r in range(nproc):
        assert got_dump[r]["step"] == STEPS - 1
        assert not (d := differences(got_dump[r], ref_dump[r])), f"rank {r} vs the reference: {d}"
        assert not (d := differences(got_dump[r], got_dump[0])), f"rank {r} vs rank 0: {d}"


def committed(job: Job) -> dict[int, dict[int, list[str]]]:
    """rank -> step -> the losses it committed (a step twice would be lost work)."""
    out: dict[int, dict[int, list[str]]] = {}
    for e in job.of("commit"):
        out.setdefault(e["rank"], {}).setdefault(e["step"], []).append(e["loss"])
    return out


def per_step(job: Job) -> dict[tuple[int, int], dict]:
    """(rank, step) -> the worker's test_step record (state digests after the step)."""
    keys = ("params", "buffers", "optimizer", "lr", "scale", "micro", "grad_norm")
    return {(e["rank"], e["step"]): {k: e.get(k) for k in keys} for e in job.of("test_step")}


def assert_losses_identical(reference: Job, job: Job, nproc: int, replaced: int | None = None,
                            hydrated_at: int | None = None) -> None:
    verdict = compare(reference.result(), job.result())  # rank 0, as `hp demo` and hp-chaos see it
    assert verdict["bitwise_equal"] and verdict["lost_steps"] == 0, verdict
    ref, got = committed(reference), committed(job)
    for r in range(nproc):
        assert all(len(v) == 1 for v in got[r].values()), f"rank {r} committed a step twice: {got[r]}"
        assert {s: v for s, v in got[r].items()} == {s: ref[r][s] for s in got[r]}, f"rank {r}'s losses differ"
        missing = set(ref[r]) - set(got[r])
        # a replacement hydrated at a step the dead process had voted for commits from the next one
        assert missing <= ({hydrated_at} if r == replaced and hydrated_at is not None else set()), (r, missing)
        assert {s: ref[r][s] for s in ref[r]} == {s: ref[0][s] for s in ref[r]}  # one global loss per step
    # the state after every step the job committed, as in the reference
    ref_steps, got_steps = per_step(reference), per_step(job)
    for key in sorted(got_steps, key=lambda k: (k[1], k[0])):
        assert got_steps[key] == ref_steps[key], f"(rank, step) {key}: {got_steps[key]} != {ref_steps[key]}"


def assert_replaced_by_the_spare(job: Job, rank: int, hydrated_at: int) -> None:
    hydrated = job.of("hydrated")
    assert [(e["rank"], e["step"]) for e in hydrated] == [(rank, hydrated_at)]
    spare = [e for e in job.of("assigned") if e["rank"] == rank]
    assert len(spare) == 1 and spare[0]["pid"] == hydrated[0]["pid"]
    assert final_states(job)[rank]["pid"] == spare[0]["pid"]  # the final state of the rank is the spare's
    assert job.dumps()[rank]["pid"] == spare[0]["pid"]


def kill(rank: int, phase: str, step: int = AT) -> dict:
    return {"at_step": step, "phase": phase, "kind": "kill", "rank": rank}


# ---- BatchNorm + dropout ------------------------------------------------------------------------
@pytest.mark.parametrize("phase", ["forward", "allreduce", "optimizer"])
def test_a_killed_rank_is_replaced_bit_identically(reference, job_env, tmp_path, phase):
    """SIGKILL of rank 1 before the step's reduction, inside it, and after the vote: the spare
    hydrates (at the step before, or at the step itself once voted) and the job ends in the
    reference's state on every rank, BatchNorm running statistics and momentum included."""
    ref = reference("bn")
    job = faulted(tmp_path, job_env, "bn", [kill(1, phase)])
    at = AT if phase == "optimizer" else AT - 1
    assert_replaced_by_the_spare(job, 1, at)
    assert_losses_identical(ref, job, 3, replaced=1, hydrated_at=at)
    assert_state_identical(ref, job, 3)


def test_buffers_are_broadcast_from_rank_0(reference):
    """Fault-free, broadcast_buffers on (the default): every rank ends every step with the same
    BatchNorm running statistics, although each saw other samples."""
    ref = reference("bn")
    steps = per_step(ref)
    for s in range(STEPS):
        assert len({steps[(r, s)]["buffers"] for r in range(3)}) == 1, s
        assert len({steps[(r, s)]["params"] for r in range(3)}) == 1, s
    assert len({e["digests"]["buffers"] for e in final_states(ref).values()}) == 1
    # and the running statistics did move: not the initial zeros/ones
    buffers = ref.dumps()[0]["buffers"]
    assert buffers["1.num_batches_tracked"].item() == STEPS * 1  # one micro-batch per rank and step
    assert not torch.equal(buffers["1.running_mean"], torch.zeros_like(buffers["1.running_mean"]))


def test_without_broadcast_buffers_each_rank_keeps_its_own_statistics(reference, job_env, tmp_path):
    """--no-broadcast-buffers: ranks' running statistics differ (each from its own samples); the
    parameters and optimizer state do not (train-mode BatchNorm uses batch statistics), and rank 0
    holds exactly what a broadcast would have given every rank."""
    ref = reference("bn")
    nproc, args = CONFIGS["bn"]
    job = hp_run(tmp_path / "logs", nproc, 0, [*args, "--no-broadcast-buffers"], [], job_env)
    assert job.returncode == 0, job.output[-3000:]
    got, want = final_states(job), final_states(ref)
    assert sorted(got) == [0, 1, 2]
    assert len({got[r]["digests"]["buffers"] for r in range(3)}) == 3
    for r in range(3):
        for key in ("params", "optimizer", "scheduler"):
            assert got[r]["digests"][key] == want[r]["digests"][key], (r, key)
    assert got[0]["digests"]["buffers"] == want[0]["digests"]["buffers"]
    dumps = job.dumps()
    assert differences(dumps[0], dumps[1], keys=("buffers",))
    assert not differences(dumps[0], dumps[1], keys=("params", "optimizer"))


# ---- gradient clipping --------------------------------------------------------------------------
def test_clipped_gradients_with_a_kill(reference, job_env, tmp_path):
    """ctx.reduce() then clip_grad_norm_ on the averaged gradients; rank 1 dies in the reduction."""
    ref = reference("clip")
    norms = [float.fromhex(e["grad_norm"]) for e in ref.of("test_step") if e["rank"] == 0]
    assert len(norms) == STEPS and max(norms) > 0.5  # the clipping did cut some steps
    job = faulted(tmp_path, job_env, "clip", [kill(1, "allreduce")])
    assert_replaced_by_the_spare(job, 1, AT - 1)
    assert_losses_identical(ref, job, 3, replaced=1, hydrated_at=AT - 1)
    assert_state_identical(ref, job, 3)


# ---- AMP: GradScaler and a skipped step ---------------------------------------------------------
def assert_step_skipped_everywhere(job: Job, nproc: int, at: int) -> None:
    skipped = job.of("step_skipped")
    assert sorted((e["step"], e["rank"]) for e in skipped) == [(at, r) for r in range(nproc)], skipped
    steps = per_step(job)
    for r in range(nproc):
        before, after = steps[(r, at - 1)], steps[(r, at)]
        assert after["params"] == before["params"], f"rank {r}: parameters changed in the skipped step"
        assert after["optimizer"] == before["optimizer"], f"rank {r}: momentum changed in the skipped step"
    for s in range(STEPS):
        scales = {steps[(r, s)]["scale"] for r in range(nproc) if (r, s) in steps}
        assert scales == ({256.0} if s < at else {128.0}), (s, scales)  # halved once, identically


def test_an_inf_gradient_on_one_rank_skips_the_step_on_every_rank(reference):
    ref = reference("amp")
    assert_step_skipped_everywhere(ref, 3, INF_STEP)
    steps = per_step(ref)
    for s in range(1, STEPS):
        if s != INF_STEP:  # every other step does update the parameters
            assert steps[(0, s)]["params"] != steps[(0, s - 1)]["params"], s
    for r, e in final_states(ref).items():
        assert isinstance(e["digests"]["scaler"], str), (r, e["digests"])
    assert ref.dumps()[1]["scaler"]["scale"] == 128.0


def test_amp_with_a_kill_after_the_skipped_step(reference, job_env, tmp_path):
    """Rank 1 dies at the commit phase (after the reduction unscaled the survivors' gradients, before
    the vote) three steps after the skipped one: the survivors' scaler must not keep the half-done
    step (an unscale already done), the spare gets the halved scale."""
    ref = reference("amp")
    job = faulted(tmp_path, job_env, "amp", [kill(1, "commit", INF_STEP + 3)])
    assert_step_skipped_everywhere(job, 3, INF_STEP)
    assert_replaced_by_the_spare(job, 1, INF_STEP + 2)
    assert_losses_identical(ref, job, 3, replaced=1, hydrated_at=INF_STEP + 2)
    assert_state_identical(ref, job, 3)
    for r, dump in job.dumps().items():
        assert dump["scaler"]["scale"] == 128.0, r


# ---- gradient accumulation, DataLoader ------------------------------------------------------------
def test_accumulation_over_micro_batches_with_a_kill(reference, job_env, tmp_path):
    """2 workers + 1 spare, 4 micro-batches per step (2 per rank); rank 1 dies in the backward pass
    of its first micro-batch."""
    ref = reference("accum")
    assert {v["micro"] for v in per_step(ref).values()} == {2}
    job = faulted(tmp_path, job_env, "accum", [kill(1, "backward")])
    assert_replaced_by_the_spare(job, 1, AT - 1)
    assert_losses_identical(ref, job, 2, replaced=1, hydrated_at=AT - 1)
    assert_state_identical(ref, job, 2)


def test_a_dataloader_with_workers_with_a_kill(reference, job_env, tmp_path):
    """A map-style Dataset read by StepLoader through a DataLoader with 2 worker processes, 2
    micro-batches per rank; rank 2 dies in backward while its loader is mid-step."""
    ref = reference("dataset")
    assert {v["micro"] for v in per_step(ref).values()} == {2}
    job = faulted(tmp_path, job_env, "dataset", [kill(2, "backward")])
    assert_replaced_by_the_spare(job, 2, AT - 1)
    assert_losses_identical(ref, job, 3, replaced=2, hydrated_at=AT - 1)
    assert_state_identical(ref, job, 3)
