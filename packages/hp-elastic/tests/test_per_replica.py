"""A per-replica batch through 4 -> 3 -> 4 with real `hp run` processes (CPU gloo): rank 2 is killed with no
spare (the job shrinks to 3 and replays the failed step there), its slot gets a new process, and the job
grows back to 4. The global batch follows the world size, so where a step's samples start depends on the
world size of every step before it: the runtime keeps that position as committed state (``ctx.samples``)
and hands it to the joiner. The test checks, from what each rank says it trained on, that the committed
steps read the sample stream in order (none skipped, none repeated), and that the LR follows the policy's
linear rule on every rank, scheduler included."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hp.checkpointless.events import finished_at, read_events
from hp.checkpointless.sampler import StepSampler
from hp.core import auth
from hp.testing import finish_when, free_port, kill_tagged
from hp.elastic import ScalingPolicy
from hp.elastic.demo.run import events_went_through

WORKER = Path(__file__).with_name("per_replica_worker.py")
POLICY = "min_replicas: 2\nmax_replicas: 4\nmicro_batch: 2\nreplica_batch: 4\nlr: 0.1\nlr_rule: linear\nbase_world: 4\n"
# at most 1000 steps: the job is asked to end (hp finish) 5 steps after it grew back to 4, however long the
# regrown process takes to be ready on a loaded machine
STEPS, SAMPLES = 1000, 200


@pytest.mark.timeout(300)
def test_a_per_replica_batch_skips_and_repeats_nothing_through_4_3_4_and_the_lr_follows_the_rule(tmp_path):
    (tmp_path / "policy.yaml").write_text(POLICY)
    logs = tmp_path / "logs"
    faults = json.dumps([{"kind": "kill", "at_step": 3, "rank": 2, "phase": "forward"}])
    port, token = free_port(), auth.new_token()
    env = {**os.environ, "HP_FAULTS": faults, "OMP_NUM_THREADS": "1", "HP_TEST_DIR": str(tmp_path),
           auth.TOKEN_ENV: token}
    cmd = [sys.executable, "-m", "hp.core.cli", "run", "--nnodes", "1:1", "--nproc-per-node", "4",
           "--scaling-policy", str(tmp_path / "policy.yaml"), "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--log-dir", str(logs), "--tee", "0", str(WORKER), "--steps", str(STEPS), "--samples", str(SAMPLES)]

    def regrown() -> bool:  # 5 steps at 4 after 4 -> 3 -> 4
        return events_went_through(read_events(str(logs / "events")), [4, 3, 4], 5)

    with open(tmp_path / "job.out", "w") as out:  # the agent keeps its own descriptor
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        finish_when(job, f"127.0.0.1:{port}", token, regrown, 240, "5 steps at 4 after 4 -> 3 -> 4")
        job.wait(timeout=240)
    finally:
        kill_tagged(f"HP_TEST_DIR={tmp_path}")
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, (tmp_path / "job.out").read_text()[-4000:]
    ended = finished_at(read_events(str(logs / "events")))
    assert ended is not None and ended < STEPS - 1
    steps = ended + 1  # every step to the one every rank ended after
    records = [e for e in read_events(str(logs / "events")) if e["event"] == "test_samples"]
    by_step: dict[int, dict[int, dict]] = {}
    for e in records:
        assert e["rank"] not in by_step.setdefault(e["step"], {}), f"step {e['step']} committed twice by rank {e['rank']}"
        by_step[e["step"]][e["rank"]] = e
    assert sorted(by_step) == list(range(steps))

    worlds = [by_step[s][0]["world"] for s in range(steps)]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert changes == [4, 3, 4], worlds
    assert worlds[:3] == [4, 4, 4] and worlds[3] == 3  # the failed step 3 was replayed at 3 ranks

    policy = ScalingPolicy.from_yaml(tmp_path / "policy.yaml")
    stream = StepSampler(SAMPLES, 1, 1, seed=5)  # the sample stream: position g holds stream.indices(g, 0)
    position = 0
    for s in range(steps):
        ranks = by_step[s]
        world = worlds[s]
        assert sorted(ranks) == list(range(world)), (s, sorted(ranks))
        assert {e["world"] for e in ranks.values()} == {world}
        assert all(len(e["indices"]) == 4 for e in ranks.values())  # replica_batch samples per rank at any W
        read = [i for r in range(world) for i in ranks[r]["indices"]]  # rank order = micro-batch order
        assert read == [stream.indices(g, 0)[0] for g in range(position, position + 4 * world)], f"step {s}"
        position += policy.global_batch_for(world)
        assert {e["samples"] for e in ranks.values()} == {position}  # ctx.samples, the joiner's included
        lr = policy.lr_for(world) * 0.5 ** ((s + 1) // 4)  # the rule's LR, on the scheduler's schedule
        assert all(math.isclose(e["lr"], lr, rel_tol=1e-9) for e in ranks.values()), (s, lr, ranks)
    assert position == sum(4 * w for w in worlds)

    final = [e for e in read_events(str(logs / "events")) if e["event"] == "final_state"]
    assert len(final) == 4 and len({json.dumps(e["digests"], sort_keys=True) for e in final}) == 1  # one model
