"""The job-level rung of the recovery ladder: hp-checkpointless falls back on hp-tiered-ckpt's tiers
when no peer holds the state, and a job started again resumes from the newest complete checkpoint.
Real `hp run` jobs, a real `hp ckpt daemon`; losses compared bit for bit with a fault-free run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, compare_state, run_job, sharded_parts
from hp.core.auth import new_token
from hp.testing import free_port, kill_tagged, wait_for
from hp.tiered_ckpt.client import DaemonClient

STEPS = 10


def config(**kw) -> DemoConfig:
    return DemoConfig(corpus_mb=2, steps=STEPS, hang_timeout_s=10.0, **kw)


@contextlib.contextmanager
def node_daemon(root: Path):
    """A real `hp ckpt daemon` over a fresh /dev/shm directory: yields (the job's environment, that
    directory); kills it, every process of the jobs that ran with it, and removes the directory."""
    (root / "cache").mkdir(parents=True)
    token = new_token()
    shm = Path(tempfile.mkdtemp(prefix="hp-rung-test-", dir="/dev/shm"))
    port = free_port()
    env = {**os.environ, "HP_JOB_TOKEN": token, "HP_TEST_DIR": str(root)}
    daemon = subprocess.Popen([sys.executable, "-m", "hp.core.cli", "ckpt", "daemon", "--listen", f"127.0.0.1:{port}",
                               "--dir", str(shm), "--replicas", "0"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    client = DaemonClient(("127.0.0.1", port), token, timeout=10)

    def up() -> bool:
        assert daemon.poll() is None, "hp ckpt daemon exited"
        try:
            client.ping()
            return True
        except OSError:
            return False

    try:
        wait_for(up, 60, "hp ckpt daemon")
        yield {"HP_DATA_CACHE_DIR": str(root / "cache"), "HP_TEST_DIR": str(root), "HP_JOB_TOKEN": token,
               "HP_CKPT_DAEMON": f"127.0.0.1:{port}"}, shm
    finally:
        client.close()
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()
        kill_tagged(f"HP_TEST_DIR={root}")
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    with node_daemon(tmp_path_factory.mktemp("rung")) as (env, _):
        yield env


@pytest.fixture(scope="module")
def reference(job_env, tmp_path_factory, chaos_reference_cache) -> RunResult:
    return _reference(job_env, tmp_path_factory, chaos_reference_cache, [], "reference")


def restored(result: RunResult) -> list[dict]:
    return [e for e in result.events if e["event"] == "restored"]


def _reference(job_env, tmp_path_factory, cache, args: list[str], name: str) -> RunResult:
    # once for the session, whichever xdist worker asks first (the other waits for it)
    result = cache.demo(config(spares=0, train_args=args), job_env, str(tmp_path_factory.mktemp(name)))
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def zero_reference(job_env, tmp_path_factory, chaos_reference_cache) -> RunResult:
    return _reference(job_env, tmp_path_factory, chaos_reference_cache, ["--zero"], "zero-reference")


@pytest.fixture(scope="module")
def fsdp_reference(job_env, tmp_path_factory, chaos_reference_cache) -> RunResult:
    return _reference(job_env, tmp_path_factory, chaos_reference_cache, ["--fsdp"], "fsdp-reference")


@pytest.fixture(scope="module")
def hsdp_reference(job_env, tmp_path_factory, chaos_reference_cache) -> RunResult:
    return _reference(job_env, tmp_path_factory, chaos_reference_cache, ["--hsdp", "2"], "hsdp-reference")


@pytest.mark.parametrize("layout, killed, reference_of, lost", [
    # ZeRO-1: rank 1 and its buddy: no peer holds rank 1's optimizer shard
    (["--zero"], (1, 2), "zero_reference", "the optimizer shard of rank 1"),
    # pure FSDP2: rank 1 and its buddy, which holds the only other copy of rank 1's shard (a shadow)
    (["--fsdp"], (1, 2), "fsdp_reference", "the FSDP shard of rank 1"),
    # HSDP 2 x 2: ranks 1 and 3 hold shard 1 in the two replica groups
    (["--hsdp", "2"], (1, 3), "hsdp_reference", "the HSDP shard of rank 1"),
])
def test_a_lost_shard_comes_back_from_the_memory_tier(request, job_env, tmp_path, layout, killed, reference_of, lost):
    """Both holders of a shard die together, so no peer can rebuild it: every rank loads its part of the
    newest checkpoint (step 4, saved every 2 steps) from the node daemon (an FSDP2 rank its shard of the
    parameters and of the optimizer state; the buddies' shadows are made again from it) and training goes
    on: losses and every rank's final state the bits of the fault-free run of the same layout."""
    reference = request.getfixturevalue(reference_of)
    faults = [{"at_step": 5, "phase": "forward", "kind": "kill", "rank": r} for r in killed]
    args = [*layout, "--checkpoint", f"rung-{layout[0].lstrip('-')}", "--checkpoint-every", "2"]
    result = run_job(config(spares=2, train_args=args), str(tmp_path / "logs"), faults, job_env)
    assert result.returncode == 0, result.output[-3000:]
    assert compare(reference, result) == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}
    assert {(e["rank"], e["step"], e["tier"]) for e in restored(result)} == {(r, 4, "memory") for r in range(4)}
    assert f"hp: restored step 4 from the memory tier ({lost}" in result.output
    state = compare_state(reference, result, nproc=4, sharded=sharded_parts(layout))
    assert state["state_equal"] and {"params", "optimizer"} <= set(state["state_parts"]), state


def test_an_fsdp_job_started_again_resumes_from_its_newest_checkpoint(fsdp_reference, job_env, tmp_path):
    """The whole FSDP2 job dies at step 7; started again, each rank loads its shard of step 6 and the
    job ends with the fault-free run's losses and final shards."""
    args = ["--fsdp", "--checkpoint", "rung-fsdp-restart", "--checkpoint-every", "3"]
    kill = [{"at_step": 7, "phase": "forward", "kind": "kill", "rank": 1}]
    first = run_job(config(spares=0, train_args=args), str(tmp_path / "first"), kill, job_env)
    assert first.returncode != 0 and sorted(first.losses()) == list(range(7)), first.output[-3000:]
    again = run_job(config(spares=0, train_args=args), str(tmp_path / "again"), [], job_env)
    assert again.returncode == 0, again.output[-3000:]
    assert {(e["step"], e["tier"]) for e in restored(again)} == {(6, "memory")}
    assert sorted(again.losses()) == list(range(7, STEPS))
    assert all(again.losses()[s] == fsdp_reference.losses()[s] for s in range(7, STEPS))
    state = compare_state(fsdp_reference, again, nproc=4, sharded={"params", "optimizer"})
    assert state["state_equal"], state


def test_a_sharded_checkpoint_of_another_mesh_shape_is_refused_naming_both(job_env, tmp_path):
    """An FSDP job over 4 leaves a checkpoint of its [4] mesh; started again as HSDP 2 x 2 with the same
    namespace, each rank's shard would be another slice: the job stops naming both shapes instead."""
    namespace = ["--checkpoint", "rung-fsdp-shape", "--checkpoint-every", "3"]
    first = run_job(config(spares=0, train_args=["--fsdp", *namespace]), str(tmp_path / "first"),
                    [{"at_step": 7, "phase": "forward", "kind": "kill", "rank": 1}], job_env)
    assert first.returncode != 0 and sorted(first.losses()) == list(range(7)), first.output[-3000:]
    again = run_job(config(spares=0, train_args=["--hsdp", "2", *namespace]), str(tmp_path / "again"), [], job_env)
    assert again.returncode != 0 and not again.losses()
    assert "the checkpoint of step 6 holds FSDP shards of a [4] mesh, the job's is [2, 2]: restart it at that shape" \
        in again.output, again.output[-3000:]


def test_a_job_started_again_resumes_from_the_newest_checkpoint(reference, job_env, tmp_path):
    """The whole job dies at step 7 (no spare, no restart left); started again with the same
    checkpoint namespace it resumes after step 6, the newest checkpoint, instead of from scratch."""
    args = ["--checkpoint", "rung-restart", "--checkpoint-every", "3"]
    kill = [{"at_step": 7, "phase": "allreduce", "kind": "kill", "rank": 1}]
    first = run_job(config(spares=0, train_args=args), str(tmp_path / "first"), kill, job_env)
    assert first.returncode != 0 and sorted(first.losses()) == list(range(7)), first.output[-3000:]
    again = run_job(config(spares=0, train_args=args), str(tmp_path / "again"), [], job_env)
    assert again.returncode == 0, again.output[-3000:]
    assert {(e["step"], e["tier"]) for e in restored(again)} == {(6, "memory")}
    assert sorted(again.losses()) == list(range(7, STEPS))  # nothing before the checkpoint recomputed
    assert all(again.losses()[s] == reference.losses()[s] for s in range(7, STEPS))


def _corrupt_everywhere(shm: Path, persist: Path, namespace: str, step: int) -> list[str]:
    """Flip one byte in the middle of the largest tensor item of ``step`` (the replicated model and
    optimizer state) in every copy: the persistent tier's file and the daemon's slot (and replica, if
    any) holding that file. Headers, manifests and metadata are left alone: only the item's CRC can
    tell. Returns the paths changed."""
    import json

    from hp.tiered_ckpt import fmt

    step_dir = persist / namespace / fmt.step_dir(step)
    meta = json.loads((step_dir / fmt.META_JSON).read_text())
    fqn, _, _, name, offset, length = max(meta["storage_data"], key=lambda e: e[5])
    rank = int(name.removeprefix("__").split("_")[0])
    assert name == fmt.rank_file(rank) and fqn.endswith(".data"), (fqn, name)
    items = json.loads((step_dir / fmt.rank_manifest(rank)).read_text())["items"]
    assert [offset, length] in [i[:2] for i in items], (offset, length, items)
    at = offset + length // 2  # inside the tensor's bytes, far from the torch.save header before them
    good = (step_dir / name).read_bytes()[offset:offset + length]
    # the daemon's copies (a staging slot, replicas) are whichever of its files hold these very bytes there
    held = [p for p in sorted((shm / namespace).rglob("*")) if p.is_file() and p.suffix != ".json"]
    copies = [step_dir / name, *(p for p in held if p.read_bytes()[offset:offset + length] == good)]
    assert len(copies) >= 2, f"step {step} of rank {rank}: no copy in the memory tier among {held}"
    for path in copies:
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x10]))
    return [str(c) for c in copies]


def test_a_restart_skips_a_newest_checkpoint_corrupt_in_every_tier(reference, tmp_path):
    """The whole job dies at step 7 after checkpointing steps 3 and 6 into node memory and a persistent
    tier; then a byte of step 6's model state flips in both tiers (only its CRC can tell). Started
    again, the job warns that step 6 has no good copy, every rank loads step 3 instead, and steps
    4..9 and the final weights and optimizer state of every rank are the bits of the fault-free run."""
    namespace, newest, older = "rung-corrupt", 6, 3
    args = ["--checkpoint", namespace, "--checkpoint-every", "3", "--checkpoint-persist-every", "3"]
    persist = tmp_path / "persist"
    with node_daemon(tmp_path / "node") as (env, shm):
        env = {**env, "HP_CKPT_URL": f"file://{persist}"}
        kill = [{"at_step": 7, "phase": "allreduce", "kind": "kill", "rank": 1}]
        first = run_job(config(spares=0, train_args=args), str(tmp_path / "first"), kill, env)
        assert first.returncode != 0 and sorted(first.losses()) == list(range(7)), first.output[-3000:]
        client = DaemonClient(("127.0.0.1", int(env["HP_CKPT_DAEMON"].rsplit(":", 1)[1])), env["HP_JOB_TOKEN"])
        try:
            wait_for(lambda: [s["step"] for s in client.steps(namespace) if s["complete"] and s["persisted"]]
                     == [older, newest], 60, f"steps {older} and {newest} complete in memory and persisted")
        finally:
            client.close()
        changed = _corrupt_everywhere(Path(shm), persist, namespace, newest)

        again = run_job(config(spares=0, train_args=args), str(tmp_path / "again"), [], env)
    assert again.returncode == 0, f"corrupted {changed}\n{again.output[-6000:]}"
    assert {(e["rank"], e["step"], e["tier"]) for e in restored(again)} == {(r, older, "memory") for r in range(4)}
    assert f"step {newest} has no good copy" in again.output and "checksum mismatch" in again.output
    assert sorted(again.losses()) == list(range(older + 1, STEPS))
    assert all(again.losses()[s] == reference.losses()[s] for s in range(older + 1, STEPS))
    assert all(again.local_losses()[s] == reference.local_losses()[s] for s in range(older + 1, STEPS))
    state = compare_state(reference, again, nproc=4)
    assert state["state_equal"] and {"params", "optimizer"} <= set(state["state_parts"]), state
    assert not [e for e in again.events if e["event"] == "checkpoint_failed"]  # step 6 saved anew, and step 9


def test_a_preempted_job_saves_its_last_committed_step_and_a_restart_resumes_there(job_env, tmp_path):
    """Graceful preemption's tiered-checkpoint rung: SIGTERM to the agent of an elastic job that cannot go on
    without its node (it hosts the controller; the policy's minimum is the job's size). Every rank abandons
    its step, saves the last committed one through hp-tiered-ckpt, exits, and `hp run` exits 143. `hp run`
    again resumes from that step: no committed step lost, and the two runs' losses and final states are the
    bits of a run that was never preempted (exact mode)."""
    import json
    import time

    from hp.checkpointless.events import read_events

    steps, policy = 30, tmp_path / "policy.yaml"
    policy.write_text("min_replicas: 2\nmax_replicas: 2\nglobal_batch: 8\nmicro_batch: 2\n")

    def command(logs: Path, namespace: str) -> list[str]:
        return [sys.executable, "-m", "hp.core.cli", "run", "--nnodes", "1:1", "--nproc-per-node", "2",
                "--scaling-policy", str(policy), "--grace-period", "60", "--log-dir", str(logs), "--tee", "0",
                "-m", "hp.elastic.demo.train", "--steps", str(steps), "--exact", "--corpus-mb", "2",
                "--checkpoint", namespace, "--checkpoint-every", "1000"]

    def run(logs: Path, namespace: str) -> list[dict]:
        done = subprocess.run(command(logs, namespace), env={**os.environ, **job_env}, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return read_events(str(logs / "events"))

    def losses(events: list[dict]) -> dict[tuple[int, int], str]:
        return {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "commit"}

    def final(events: list[dict]) -> dict[int, dict]:
        return {e["rank"]: e["digests"] for e in events if e["event"] == "final_state"}

    reference = run(tmp_path / "reference", "preempt-reference")
    logs = tmp_path / "preempted"
    job = subprocess.Popen(command(logs, "preempt"), env={**os.environ, **job_env}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: any(e["event"] == "commit" and e["step"] >= 8 for e in read_events(str(logs / "events"))),
                 120, "step 8 committed")
        job.send_signal(signal.SIGTERM)  # to the agent only, as Kubernetes does
        _, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 143, err[-3000:]
    first = read_events(str(logs / "events"))
    saved = {e["rank"]: e["step"] for e in first if e["event"] == "preempt_saved"}
    last = max(e["step"] for e in first if e["event"] == "commit")
    why = [e for e in first if e["event"] in ("checkpoint_failed", "reform_failed", "failure_detected", "left")]
    decisions = (logs / "controller_decisions.jsonl").read_text().splitlines()[-6:]
    assert saved == {0: last, 1: last} and 8 <= last < steps - 1, (saved, last, why, decisions, err[-1500:])
    decisions = [json.loads(line)["decision"] for line in (logs / "controller_decisions.jsonl").read_text().splitlines()]
    assert "preempt_job" in decisions

    start = time.monotonic()
    second = run(tmp_path / "restarted", "preempt")
    assert time.monotonic() - start < 300
    assert {(e["rank"], e["step"]) for e in second if e["event"] == "restored"} == {(0, last), (1, last)}
    assert min(e["step"] for e in second if e["event"] == "commit") == last + 1  # nothing redone, nothing skipped
    assert {**losses(first), **losses(second)} == losses(reference)  # every rank's every step, bit for bit
    assert final(second) == final(reference)
