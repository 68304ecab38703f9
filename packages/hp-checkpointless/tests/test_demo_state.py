"""`hp demo`'s final-state verdict, from event logs alone (no job is run here)."""

from __future__ import annotations

from hp.checkpointless.demo.run import RunResult, compare, compare_state, final_states, format_table


def digests(params="p", buffers="b", optimizer="o", scheduler="s", scaler=None) -> dict:
    return {"params": params, "buffers": buffers, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}


def run(*states: dict, losses=("0x1.0p+0",)) -> RunResult:
    events = [{"t": float(s), "event": "commit", "rank": 0, "step": s, "generation": 1, "loss": loss}
              for s, loss in enumerate(losses)]
    events += [{"t": 10.0 + r, "event": "final_state", "rank": r, "step": len(losses) - 1, "digests": d}
               for r, d in enumerate(states)]
    return RunResult(0, 1.0, events, "")


def test_every_rank_equal_to_the_reference_and_to_each_other():
    ref, got = run(digests(), digests()), run(digests(), digests())
    verdict = compare_state(ref, got, nproc=2)
    assert verdict == {"state_equal": True, "state_parts": ["params", "buffers", "optimizer", "scheduler"],
                       "state_differences": []}
    assert final_states(got) == {"0": digests(), "1": digests()}
    # compare() keeps its shape: hp-chaos and test_recovery compare it whole
    assert compare(ref, got) == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": 1}


def test_a_rank_that_differs_from_the_reference_or_from_its_peers():
    ref = run(digests(), digests(), digests())
    verdict = compare_state(ref, run(digests(), digests(buffers="x"), digests()))
    assert not verdict["state_equal"]
    assert verdict["state_differences"] == ["rank 1 buffers: not the reference's", "rank 1 buffers: not rank 0's"]
    # the same divergence in both runs still differs across ranks
    both = run(digests(), digests(params="y"), digests())
    assert compare_state(both, both)["state_differences"] == ["rank 1 params: not rank 0's"]


def test_a_missing_final_state_is_not_equal():
    ref = run(digests(), digests())
    assert compare_state(ref, run())["state_differences"] == ["no final state recorded by the faulted run"]
    assert not compare_state(run(), ref)["state_equal"]
    assert not compare_state(ref, run(digests()))["state_equal"]  # rank 1 never finished
    assert not compare_state(ref, ref, nproc=3)["state_equal"]


def test_a_sharded_optimizer_is_compared_rank_to_same_rank():
    ref = same = run(digests(optimizer="o0"), digests(optimizer="o1"))
    swapped = run(digests(optimizer="o1"), digests(optimizer="o0"))
    assert compare_state(ref, same, sharded={"optimizer"})["state_equal"]
    assert not compare_state(ref, same)["state_equal"]
    assert not compare_state(ref, swapped, sharded={"optimizer"})["state_equal"]


def test_a_scaler_is_compared_once_any_rank_has_one():
    ref = run(digests(scaler="c"), digests(scaler="c"))
    assert compare_state(ref, ref)["state_parts"] == ["params", "buffers", "optimizer", "scheduler", "scaler"]
    assert not compare_state(ref, run(digests(scaler="c"), digests(scaler=None)))["state_equal"]


def table(**state) -> str:
    r = {"fault": {"kind": "kill", "rank": 1, "at_step": 5, "phase": "allreduce"}, "world_size": 4, "spares": 1,
         "steps": 10, "model_size": "tiny", "completed": True, "step_time_s": 0.01, "recovery_s": 1.0, "phases": {},
         "lost_steps": 0, "bitwise_equal": True, "losses_equal": True, "steps_compared": 10,
         "data_cache": {"cold_preprocess_s": 0.1, "warm_attach_s": 0.001},
         "reference": {"wall_s": 1.0}, "faulted": {"wall_s": 2.0}, "log_dir": "/tmp/x", **state}
    return next(line for line in format_table(r).splitlines() if line.startswith("final state"))


def test_the_table_row():
    ranks = {str(r): digests() for r in range(4)}
    assert table(state_equal=True, state_parts=["params", "buffers", "optimizer"], state_differences=[],
                 final_state={"reference": ranks, "faulted": ranks}).split(None, 3)[3] == \
        "yes (4 ranks: params, buffers, optimizer)"
    assert table(state_equal=True, state_parts=["params", "optimizer"], state_differences=[], sharded_optimizer=True,
                 final_state={"reference": ranks, "faulted": ranks}).endswith("(4 ranks: params, optimizer (per rank))")
    no = table(state_equal=False, state_parts=[], state_differences=["no final state recorded by the faulted run"],
               final_state={"reference": ranks, "faulted": {}})
    assert no.endswith("NO (no final state recorded by the faulted run)")


def test_losses_are_every_rank_s_from_whichever_ranks_committed_the_step():
    def job(*commits: tuple[int, int, int, str, dict]) -> RunResult:
        return RunResult(0, 1.0, [{"t": 0.0, "event": "commit", "rank": r, "step": s, "generation": g, "loss": mean,
                                   "local": local} for r, s, g, mean, local in commits], "")

    a, b = {"0": "0x1.0p+0", "1": "0x1.8p+0"}, {"0": "0x1.0p+0", "1": "0x1.8000000000001p+0"}
    ref = job((0, 0, 1, "0x1.4p+0", a), (1, 0, 1, "0x1.4p+0", a), (0, 1, 1, "0x1.4p+0", a), (1, 1, 1, "0x1.4p+0", a))
    # rank 0 hydrated past step 1: rank 1's commit covers it
    assert compare(ref, job((0, 0, 1, "0x1.4p+0", a), (1, 0, 1, "0x1.4p+0", a), (1, 1, 2, "0x1.4p+0", a)))["bitwise_equal"]
    # the same global mean, one rank's own loss one ulp off
    assert compare(ref, job((0, 0, 1, "0x1.4p+0", a), (1, 0, 1, "0x1.4p+0", b), (1, 1, 1, "0x1.4p+0", a))) == \
        {"bitwise_equal": False, "lost_steps": 0, "steps_compared": 2}
    # step 1 committed again by a later generation (the job went back): lost, and still equal
    again = job((0, 0, 1, "0x1.4p+0", a), (0, 1, 1, "0x1.4p+0", a), (0, 1, 3, "0x1.4p+0", a), (1, 1, 3, "0x1.4p+0", a))
    assert compare(ref, again) == {"bitwise_equal": True, "lost_steps": 1, "steps_compared": 2}
