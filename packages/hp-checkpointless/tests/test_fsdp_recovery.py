"""FSDP2 and HSDP recovered in process, end to end: real `hp run` jobs (4 workers on gloo, the demo GPT
sharded with `fully_shard` on hp's device mesh), one or two faults each, compared with a fault-free run
of the same job: every step's losses on every rank, and every rank's final parameters, buffers,
optimizer and scheduler state, bit for bit."""

from __future__ import annotations

import pytest

from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, compare_state, run_job, sharded_parts
from hp.testing import kill_tagged

STEPS, AT, NPROC = 10, 5, 4
HSDP, FSDP = ["--hsdp", "2"], ["--fsdp"]

pytestmark = pytest.mark.slow


def config(train_args: list[str], **kw) -> DemoConfig:
    return DemoConfig(corpus_mb=2, steps=STEPS, hang_timeout_s=10.0, nproc=NPROC, train_args=train_args, **kw)


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    env = {"HP_DATA_CACHE_DIR": str(root / "cache"), "HP_TEST_DIR": str(root)}
    (root / "cache").mkdir()
    yield env
    kill_tagged(f"HP_TEST_DIR={root}")


@pytest.fixture(scope="module")
def references(job_env, tmp_path_factory, chaos_reference_cache) -> dict[str, RunResult]:
    out = {}  # once for the session, whichever xdist worker asks first (the other waits for it)
    for name, args in (("hsdp", HSDP), ("fsdp", FSDP)):
        result = chaos_reference_cache.demo(config(args, spares=0), job_env, str(tmp_path_factory.mktemp(f"reference-{name}")))
        assert result.returncode == 0, result.output[-3000:]
        assert len(result.losses()) == STEPS
        out[name] = result
    return out


def faulted(tmp_path, job_env, args, faults, spares=1) -> RunResult:
    result = run_job(config(args, spares=spares), str(tmp_path / "logs"), faults, job_env)
    assert result.returncode == 0, result.output[-3000:]
    return result


def assert_identical(reference: RunResult, result: RunResult, args: list[str]) -> None:
    verdict = compare(reference, result)
    assert verdict == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}, (
        verdict, reference.losses(), result.losses())
    state = compare_state(reference, result, NPROC, sharded_parts(args))
    assert state["state_equal"], state["state_differences"]


def rebuilt(result: RunResult) -> list[tuple[int, int | None, bool, int]]:
    return [(e["rank"], e["buddy"], e["rolled_forward"], e["step"]) for e in result.events
            if e["event"] == "shard_rebuilt"]


def kill(rank: int, phase: str, step: int = AT) -> dict:
    return {"at_step": step, "phase": phase, "kind": "kill", "rank": rank}


def test_hsdp_shards_come_back_from_the_replicate_group_in_every_phase(references, job_env, tmp_path):
    """Three failures in a row, one in each phase: in the forward pass (peers fail in FSDP's all-gathers),
    at the first reduce-scatter (peers fail in FSDP's reductions, inside backward), and after the vote (the
    survivors committed the step; the replacement of the first failure dies). Each lost shard comes back
    from the rank holding it in the other replicate group (r + 2); a failure before the vote leaves the
    step before it as the newest."""
    result = faulted(tmp_path, job_env, HSDP, [kill(1, "forward", 3), kill(2, "allreduce", 5), kill(1, "optimizer", 7)],
                     spares=3)
    assert_identical(references["hsdp"], result, HSDP)
    assert rebuilt(result) == [(1, 3, False, 2), (2, 0, False, 4), (1, 3, False, 7)]


def test_hsdp_survives_the_death_of_the_source_during_hydration(references, job_env, tmp_path):
    """Rank 0 (the source of the replicated state, and of nothing else) dies while rank 1's replacement
    is hydrated: its own shard is still held by rank 2."""
    result = faulted(tmp_path, job_env, HSDP, [kill(1, "forward"), kill(0, "hydration", AT - 1)], spares=2)
    assert_identical(references["hsdp"], result, HSDP)
    assert {r for r, *_ in rebuilt(result)} == {0, 1}


def test_hsdp_shard_lost_with_its_replicate_group_stops_the_job_naming_it(job_env, tmp_path):
    result = run_job(config(HSDP, spares=2), str(tmp_path / "logs"), [kill(1, "forward"), kill(3, "forward")], job_env)
    assert result.returncode != 0
    assert "HSDP shard of rank 1 at step 4 is lost: no rank of its replicate group [1, 3] holds it" in result.output, \
        result.output[-3000:]


SCALED = ["--scaler", "--inf-step", str(AT - 1), "--inf-rank", "2"]


@pytest.mark.parametrize("layout", [HSDP, FSDP], ids=["hsdp", "fsdp"])
def test_a_scaled_sharded_model_skips_its_inf_step_through_two_failures_in_it(layout, job_env, tmp_path,
                                                                               chaos_reference_cache):
    """AMP (bfloat16 autocast, a GradScaler): rank 2's backward overflows at step 4 on every attempt. Rank 1
    dies in that step's reduction (the survivors forget the unscale, the replacement gets the scaler's state
    with the rest), then rank 2 after the replayed step's vote: the job skipped the step, and so did the copy
    rank 2's shard comes back from (HSDP: its replica; FSDP: its buddy's shadow, which skipped the update)."""
    args = layout + SCALED
    reference = chaos_reference_cache.demo(config(args, spares=0), job_env, str(tmp_path / "reference"))
    assert reference.returncode == 0, reference.output[-3000:]
    skipped = {(e["step"], e["scale"]) for e in reference.events if e["event"] == "step_skipped"}
    assert skipped == {(AT - 1, 4096.0)}, skipped  # 2**12, grown once after 3 clean steps, halved
    result = faulted(tmp_path, job_env, args, [kill(1, "allreduce", AT - 1), kill(2, "optimizer", AT - 1)], spares=2)
    assert_identical(reference, result, args)
    assert "scaler" in compare_state(reference, result, NPROC, sharded_parts(args))["state_parts"]
    holder = 0 if layout == HSDP else 3  # rank 2's replica (r - 2), or its buddy (r + 1)
    assert [(r, src) for r, src, *_ in rebuilt(result)] == [(1, 3 if layout == HSDP else 2), (2, holder)], rebuilt(result)


def test_fsdp_survives_a_second_failure_during_hydration(references, job_env, tmp_path):
    """Rank 3 dies while rank 1's replacement is hydrated: its shard is still at its buddy (rank 0), and
    rank 1's buddy keeps its copy until a transfer completes."""
    result = faulted(tmp_path, job_env, FSDP, [kill(1, "forward"), kill(3, "hydration", AT - 1)], spares=2)
    assert_identical(references["fsdp"], result, FSDP)
    assert {r for r, *_ in rebuilt(result)} == {1, 3}


def test_fsdp_shards_come_back_from_buddies_in_every_phase_and_shadows_are_kept(references, job_env, tmp_path):
    """Three failures in a row, one in each phase: in the forward pass, in the reduction, after the vote.
    Each lost shard comes back from its buddy's shadow (of rank r, held by r + 1), at the committed step:
    the buddy re-ran the ward's update with the gradients the ward sent before the vote, whether that
    vote was the failed step's (after the vote) or the one before (a failure before it); a buddy that
    missed the vote rolls forward (the plan's unit tests). After a recovery only the replacement's shadow
    (of its ward) is copied whole again; every other shadow is kept, advanced by each step's gradients. So
    each failure is rebuilt from a shadow of another history: rank 1's from rank 2's shadow made at the
    start, rank 2's from rank 3's, kept through the first recovery, rank 0's from rank 1's, copied whole
    at the first recovery and kept through the second."""
    result = faulted(tmp_path, job_env, FSDP, [kill(1, "forward", 3), kill(2, "allreduce", 5), kill(0, "optimizer", 7)],
                     spares=3)
    assert_identical(references["fsdp"], result, FSDP)
    assert rebuilt(result) == [(1, 2, False, 2), (2, 3, False, 4), (0, 1, False, 7)]
    copied = sorted({(e["generation"], tuple(e["ranks"])) for e in result.events if e["event"] == "shadows_copied"})
    assert [ranks for _, ranks in copied] == [(0, 1, 2, 3), (1,), (2,), (0,)], copied  # the start, then one each


MICRO = ["--micro-batches", "8", "--batch-size", "2"]  # 8 micro-batches of 2 samples a step: 2 per rank


@pytest.mark.parametrize("layout, rank, phase", [(FSDP, 1, "backward"), (HSDP, 2, "allreduce")])
def test_a_sharded_models_micro_batches_are_recovered_bit_identically(job_env, tmp_path, layout, rank, phase):
    """step.micro_batches() with FSDP2: FSDP reduces each micro-batch's backward and accumulates, hp makes
    the sum the mean over the step's micro-batches; a rank killed midway is recovered like any other."""
    args = layout + MICRO
    reference = run_job(config(args, spares=0), str(tmp_path / "reference"), [], job_env)
    assert reference.returncode == 0, reference.output[-3000:]
    assert_identical(reference, faulted(tmp_path, job_env, args, [kill(rank, phase)]), args)


def test_micro_batches_that_do_not_divide_among_an_fsdp_models_ranks_are_refused(job_env, tmp_path):
    result = run_job(config(FSDP + ["--micro-batches", "6"], spares=0), str(tmp_path / "logs"), [], job_env)
    assert result.returncode != 0
    assert "with an FSDP2 model every rank runs as many micro-batches as the others: 6 micro-batches per step " \
           "do not divide among 4 ranks" in result.output, result.output[-3000:]
