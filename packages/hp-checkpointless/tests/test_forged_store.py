"""Issue #14, end to end: a process without the job token writes into a live job's store (torch's
TCPStore authenticates nobody) the values the workers act on: a generation that does not exist, a
fencing plan, a spare assignment, a hydration size of a PiB, the finished marker, and an old genuine
generation replayed. The workers refuse every one (``store_value_refused`` events), a rank killed
meanwhile is still replaced by the spare, and the job ends with the same bits as a fault-free run."""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from hp.checkpointless.demo.run import DemoConfig, RunResult, compare, compare_state, job_command, run_job
from hp.checkpointless.events import read_events
from hp.core.auth import TOKEN_ENV
from hp.core.protocol import (
    FINISHED_KEY, GENERATION_KEY, STATE_NBYTES_KEY, Plan, SpareAssignment, plan_key, spare_id, spare_key,
)
from hp.core.signed_values import seal
from hp.testing import kill_tagged, wait_for

STEPS, AT = 10, 5
TOKEN, OTHER = secrets.token_hex(32), secrets.token_hex(32)
SPARE = spare_id(0, 0)


def config(**kw) -> DemoConfig:
    return DemoConfig(corpus_mb=2, **{"steps": STEPS, "hang_timeout_s": 10.0, **kw})


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    root = tmp_path_factory.mktemp("forged")
    (root / "cache").mkdir()
    yield {"HP_DATA_CACHE_DIR": str(root / "cache"), "HP_TEST_DIR": str(root), TOKEN_ENV: TOKEN}
    kill_tagged(f"HP_TEST_DIR={root}")


# written once, as soon as the store is up: long before the controller writes these keys itself
ONCE = {
    plan_key(2): seal(OTHER, plan_key(2), Plan(2, 4, "failed", "forged", {}).to_json()),  # another job's token
    spare_key(SPARE): SpareAssignment(0, 1).to_json(),  # unsealed: the spare would take rank 0 of generation 1
    STATE_NBYTES_KEY: seal(TOKEN, plan_key(99), str(1 << 50)),  # a genuine seal, moved from another key
    FINISHED_KEY: "0",  # a joiner would leave the job
}
# written again and again, for the whole job
GENERATIONS = ["99", seal(OTHER, GENERATION_KEY, "99"), seal(TOKEN, spare_key("x"), "99"),
               seal(TOKEN, GENERATION_KEY, "1")]  # the last: generation 1's genuine value, replayed later
FORGED_PLAN = (plan_key(99), Plan(99, 1, "failed", "forged", {0: "r0.0"}).to_json())


def _attack(store: dist.Store, stop: threading.Event, writes: list[int]) -> None:
    while not stop.is_set():
        try:
            for value in GENERATIONS:
                store.set(GENERATION_KEY, value)
                store.set(*FORGED_PLAN)
                writes[0] += 1
                if stop.wait(0.01):
                    return
        except Exception:  # the store went away with the job
            return


def test_forged_store_values_are_refused_and_the_job_is_bit_identical(job_env, tmp_path):
    reference = run_job(config(spares=0), str(tmp_path / "reference"), [], job_env)
    assert reference.returncode == 0, reference.output[-3000:]

    log_dir = tmp_path / "logs"
    kill = [{"at_step": AT, "phase": "allreduce", "kind": "kill", "rank": 1}]
    job = subprocess.Popen(job_command(config(spares=1), str(log_dir)),
                           env={**os.environ, **job_env, "HP_FAULTS": json.dumps(kill)},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: [output.append(line) for line in job.stdout], daemon=True)
    reader.start()
    stop, writes = threading.Event(), [0]
    try:
        # the agent says where its store is before any worker starts
        wait_for(lambda: any("store at" in line for line in output) or job.poll() is not None, 60, "the store")
        found = next((re.search(r"store at (\S+):(\d+),", line) for line in output if "store at" in line), None)
        assert found, "".join(output)[-3000:]
        store = dist.TCPStore(found[1], int(found[2]), is_master=False, timeout=timedelta(seconds=10))
        for key, value in ONCE.items():
            store.set(key, value)
        attacker = threading.Thread(target=_attack, args=(store, stop, writes), daemon=True)
        attacker.start()
        assert job.wait(timeout=240) == 0, "".join(output)[-3000:]
    finally:
        stop.set()
        if job.poll() is None:
            job.kill()
    reader.join(10)
    result = RunResult(0, 0.0, read_events(str(log_dir / "events")), "".join(output))
    events = result.events

    assert writes[0] > 10  # the attack ran during the job
    refused = [e for e in events if e["event"] == "store_value_refused"]
    refused_keys = {e["key"] for e in refused}
    # without the node relay (--no-node-relay) the workers read the forged generation key and refuse it;
    # with it (hp.core.fanout, the default), the forged plan 2 reaches them through the relay, sealed bytes unchanged,
    # and they refuse that (they no longer read the generation key)
    assert refused_keys & {GENERATION_KEY, plan_key(2)}, refused_keys
    assert refused_keys <= {*ONCE, GENERATION_KEY, plan_key(99)}, refused_keys
    assert all("not sealed" in e["error"] or "bad signature" in e["error"] for e in refused)
    # never acted on: nobody was fenced out or left, the spare took rank 1 in generation 2 (not the forged
    # rank 0 of generation 1) and made no PiB buffer, and the job went through generation 2 only
    assert not [e for e in events if e["event"] in ("fenced_out", "left", "reform_failed")]
    assigned = [e for e in events if e["event"] == "assigned"]
    assert [(e["rank"], e["generation"]) for e in assigned] == [(1, 2)]
    assert all(e["nbytes"] < 1 << 40 for e in events if e["event"] == "receive_buffer_ready")
    assert {e["generation"] for e in events if e["event"] == "commit"} == {1, 2}
    decisions = [json.loads(line)["decision"] for line in (log_dir / "controller_decisions.jsonl").read_text().splitlines()]
    assert "promote_spare" in decisions and "fail_job" not in decisions
    # the same bits as the fault-free run: every loss, and every rank's final state
    assert compare(reference, result) == {"bitwise_equal": True, "lost_steps": 0, "steps_compared": STEPS}
    state = compare_state(reference, result, nproc=4)
    assert state["state_equal"], state["state_differences"]
