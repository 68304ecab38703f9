"""An elastic HSDP job end to end: real `hp run` jobs, the model sharded with FSDP2 on hp's 2-D mesh
(shard groups of 2 ranks, replicated across them), CPU gloo.

A rank killed with no spare left takes its whole replica group out of the job (the policy's unit is the
shard group): 2 x 2 -> 1 x 2, the survivors keep their shards (no transfer, no storage) and replay the step
on the smaller mesh. The processes started in the freed slots join once ready and the job grows back to
2 x 2, each joiner copying its shard from the rank holding it in the other replica group.
"""

from __future__ import annotations

import pytest

from hp.checkpointless.demo.run import RunResult, final_states
from hp.core.testing import kill_tagged
from hp.elastic.demo.run import ElasticDemoConfig, commits, lost_steps, one_node_run, world_by_step

pytestmark = pytest.mark.slow
STEPS = 16
POLICY = "min_replicas: 2\nmax_replicas: 4\nunit: 2\nglobal_batch: 8\nmicro_batch: 2\n"


@pytest.fixture
def job(tmp_path, monkeypatch):
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HP_TEST_DIR", str(tmp_path))
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)

    def run(name: str, ranks: int, faults: list[dict] | None = None, steps: int = STEPS, unit: int = 2,
            exact: bool = False) -> RunResult:
        if unit != 2:
            policy.write_text(POLICY.replace("unit: 2", f"unit: {unit}"))
        cfg = ElasticDemoConfig(steps=steps, exact=exact, corpus_mb=2, timeout_s=240,
                                train_args=["--hsdp-shard", "2", "--dropout", "0"])
        return one_node_run(cfg, str(tmp_path), str(policy), ranks, name, faults, elastic=faults is not None)

    yield run
    kill_tagged(f"HP_TEST_DIR={tmp_path}")


def kill(step: int) -> list[dict]:
    return [{"kind": "kill", "at_step": step, "rank": 1, "phase": "forward"}]


def sizes(events: list[dict]) -> list[int]:
    """The world sizes the job committed its steps at, each run of one size once."""
    worlds = world_by_step(events)
    out = [worlds[s] for s in sorted(worlds)]
    return [w for i, w in enumerate(out) if i == 0 or w != out[i - 1]]


def losses(events: list[dict]) -> dict[int, set[str]]:
    return {s: {e["loss"] for e in es} for s, es in commits(events).items()}


def assert_replicas_equal(result: RunResult) -> None:
    """2 x 2 at the end: each shard is held by one rank of each replica group, and both copies are the same
    bits (parameters and optimizer state): a joiner got its holder's shard and both trained on alike."""
    final = final_states(result)
    assert sorted(final) == ["0", "1", "2", "3"], sorted(final)
    for r in (0, 1):
        for part in ("params", "optimizer"):
            assert final[str(r)][part] == final[str(r + 2)][part], (r, part)
        assert final["0"]["params"] != final["1"]["params"]  # two different shards


def test_a_replica_group_lost_at_the_first_step_leaves_the_job_training_as_one_born_at_its_size(job):
    """Killed in step 0's forward: the job replays it at 1 x 2, bit for bit what a job started at 2 ranks
    computes, step after step, until the freed slots' processes grow it back to 2 x 2."""
    born = job("born-at-2", 2)
    shrunk = job("shrunk-at-0", 4, kill(0))
    assert born.returncode == 0 and shrunk.returncode == 0, (born.output[-2000:], shrunk.output[-2000:])
    assert sizes(born.events) == [2]
    assert sizes(shrunk.events)[0] == 2 and sizes(shrunk.events) in ([2], [2, 4]), sizes(shrunk.events)
    at_two = [s for s, w in world_by_step(shrunk.events).items() if w == 2]
    assert len(at_two) >= 2 and at_two == list(range(len(at_two))), at_two
    want, got = losses(born.events), losses(shrunk.events)
    assert {s: got[s] for s in at_two} == {s: want[s] for s in at_two}
    assert all(len(v) == 1 for v in got.values())
    assert lost_steps(shrunk.events, STEPS) == 0
    if sizes(shrunk.events) == [2, 4]:
        assert_replicas_equal(shrunk)


def test_a_replica_group_lost_mid_run_shrinks_the_mesh_and_joiners_grow_it_back(job):
    # long enough for the freed slots' new processes to start and join on a loaded 2-core box
    run = job("shrink-grow", 4, kill(3), steps=80)
    assert run.returncode == 0, run.output[-3000:]
    assert sizes(run.events) == [4, 2, 4], sizes(run.events)
    assert lost_steps(run.events, 80) == 0
    worlds = world_by_step(run.events)
    assert [worlds[s] for s in range(4)] == [4, 4, 4, 2]  # step 3 replayed at the smaller size
    left = [e for e in run.events if e["event"] == "left"]
    assert len(left) == 1 and left[0]["why"] == "shrink"  # the dead rank's unit-mate, at once
    rebuilt = [e for e in run.events if e["event"] == "shard_rebuilt"]
    assert sorted((e["rank"], e["buddy"]) for e in rebuilt if e["buddy"] is not None)[-2:] == [(2, 0), (3, 1)], rebuilt
    assert_replicas_equal(run)


def test_a_policy_whose_unit_splits_a_shard_group_stops_the_job_naming_the_fix(job):
    """Unit 1: the controller shrinks 4 -> 3, which no HSDP mesh of shard groups of 2 covers; every rank
    sees it at once and the job stops with one line (no hang, no wrong shard)."""
    run = job("unit-1", 4, kill(3), unit=1)
    assert run.returncode != 0
    assert "only an HSDP mesh changes its world size, by whole replica groups of 2 (a scaling policy's unit must be " \
           "a multiple of 2)" in run.output, run.output[-3000:]


def test_exact_mode_with_an_fsdp_model_is_refused_in_one_line(job):
    run = job("exact", 2, exact=True)
    assert run.returncode != 0
    assert "an FSDP2 model's gradients are reduced by FSDP: pass no reduction=" in run.output, run.output[-3000:]
