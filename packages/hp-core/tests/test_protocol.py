"""The cross-process contracts: store keys, the plan and spare-assignment schemas, verbs and names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hp.core.controller import Controller, ControllerConfig
from hp.core.protocol import (
    GENERATION_KEY, STATE_NBYTES_KEY, Decision, Event, JobState, Plan, ProtocolError, SpareAssignment, Verb,
    arrive_prefix, node_service_key, plan_key, spare_holder, spare_id, spare_key, worker_holder,
)

PLAN = Plan(3, 4, "running", "", {0: "r0.0", 1: "spare.n0s0", 2: "r2.1", 3: "r3.0"}, why="spare_promoted")


def test_keys_and_ids_are_the_published_strings():
    assert (GENERATION_KEY, STATE_NBYTES_KEY) == ("hp/generation", "hp/state_nbytes")
    assert (plan_key(7), spare_key("n1s2"), arrive_prefix(7)) == ("hp/plan/7", "hp/spare/n1s2", "hp/arrive/7/")
    assert node_service_key("ckpt", 2) == "hp/node_service/ckpt/2"
    assert (worker_holder(5, 1), spare_id(1, 2), spare_holder("n1s2")) == ("r5.1", "n1s2", "spare.n1s2")


def test_plan_round_trips_in_the_controllers_format():
    raw = PLAN.to_json()
    assert json.loads(raw) == {"generation": 3, "world_size": 4, "why": "spare_promoted", "state": "running",
                               "reason": "", "at_boundary": False,
                               "holders": {"0": "r0.0", "1": "spare.n0s0", "2": "r2.1", "3": "r3.0"}}
    assert list(json.loads(raw)) == ["generation", "world_size", "why", "state", "reason", "at_boundary", "holders"]
    assert Plan.from_json(raw) == Plan.from_json(raw.encode()) == PLAN
    assert Plan.from_json(raw).state is JobState.RUNNING


def test_a_process_finds_its_rank_by_holder():
    assert PLAN.rank_of("spare.n0s0") == 1 and PLAN.rank_of("r3.0") == 3
    assert PLAN.rank_of("r1.0") is None  # replaced: no rank in this generation


def test_a_plan_without_why_reads_as_empty():
    value = json.loads(PLAN.to_json())
    del value["why"]
    assert Plan.from_json(json.dumps(value)).why == ""


def _plan(**change) -> str:
    value = json.loads(PLAN.to_json())
    value.update(change)
    return json.dumps({k: v for k, v in value.items() if v is not ...})


@pytest.mark.parametrize("raw, message", [
    (b"\xff\xfe", "not JSON"),
    ("{", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (_plan(generation=...), "field 'generation' must be int, got missing"),
    (_plan(generation="3"), "field 'generation' must be int, got str"),
    (_plan(generation=True), "field 'generation' must be int, got bool"),
    (_plan(generation=-1), "field 'generation' must be >= 0"),
    (_plan(world_size=4.0), "field 'world_size' must be int, got float"),
    (_plan(state="exploded"), "unknown state 'exploded'"),
    (_plan(state=None), "field 'state' must be str, got NoneType"),
    (_plan(reason=1), "field 'reason' must be str, got int"),
    (_plan(why=[]), "field 'why' must be str, got list"),
    (_plan(holders=[]), "field 'holders' must be dict, got list"),
    (_plan(holders={"one": "r1.0"}), "'holders' must map decimal ranks to process ids"),
    (_plan(holders={"1": 1}), "'holders' must map decimal ranks to process ids"),
    (_plan(holders={"\u00b2": "r2.0"}), "'holders' must map decimal ranks to process ids"),
])
def test_a_malformed_plan_is_a_one_line_protocol_error(raw, message):
    with pytest.raises(ProtocolError) as e:
        Plan.from_json(raw)
    assert isinstance(e.value, ValueError)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("malformed plan")


def test_spare_assignment_round_trips():
    raw = SpareAssignment(rank=4, generation=2).to_json()
    assert json.loads(raw) == {"rank": 4, "generation": 2}
    assert SpareAssignment.from_json(raw.encode()) == SpareAssignment(4, 2)


@pytest.mark.parametrize("raw, message", [
    ("", "not JSON"),
    ("4", "expected a JSON object, got int"),
    ('{"rank": 4}', "field 'generation' must be int, got missing"),
    ('{"rank": "4", "generation": 2}', "field 'rank' must be int, got str"),
    ('{"rank": -1, "generation": 2}', "field 'rank' must be >= 0"),
])
def test_a_malformed_spare_assignment_is_a_one_line_protocol_error(raw, message):
    with pytest.raises(ProtocolError, match="^malformed spare assignment") as e:
        SpareAssignment.from_json(raw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_every_controller_handler_is_a_verb_and_every_verb_is_handled():
    handlers = Controller(ControllerConfig(nnodes=1))._handlers
    assert all(type(verb) is Verb for verb in handlers)
    assert set(handlers) == set(Verb)


def test_what_the_controller_publishes_parses():
    published: list[tuple[str, str]] = []
    c = Controller(ControllerConfig(nnodes=2), publish=lambda k, v: published.append((k, v)))
    for n in range(2):
        c.handle(Verb.JOIN, {"node_rank": n, "nproc": 2, "host": f"h{n}", "spares": 1})
    c.handle(Verb.WORKER_FAILED, {"node_rank": 1, "generation": 1, "rank": 3, "holder": c.holders[3], "signal": "SIGKILL"})
    store = dict(published)
    assert store[GENERATION_KEY] == "2"
    assert Plan.from_json(store[plan_key(1)]) == Plan(1, 4, "running", "", {r: worker_holder(r, 0) for r in range(4)},
                                                      why="rendezvous_complete")
    plan = Plan.from_json(store[plan_key(2)])
    assert (plan.generation, plan.world_size, plan.state, plan.why) == (2, 4, JobState.RUNNING, "spare_promoted")
    assert plan.holders[3] == spare_holder(spare_id(1, 0))
    assert SpareAssignment.from_json(store[spare_key(spare_id(1, 0))]) == SpareAssignment(3, 2)
    assert all(type(d["decision"]) is Decision for d in c.decisions)


def test_names_are_their_lower_case_strings_on_the_wire():
    for kind in (Verb, Event, Decision, JobState):
        assert all(member == member.name.lower() for member in kind)
    assert (Event.FINAL_STATE, Event.STEP_SKIPPED) == ("final_state", "step_skipped")
    assert json.dumps({"event": Event.COMMIT}) == '{"event": "commit"}' and f"{Verb.RANK_FAILED}" == "rank_failed"


def test_the_protocol_loads_neither_the_controller_nor_torch():
    code = "import hp.core.protocol, sys; print(sorted(m for m in sys.modules if m.startswith(('hp.', 'torch'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hp.core', 'hp.core.errors', 'hp.core.protocol', 'hp.core.worker_env']"


def _worker_env(**kw):
    from hp.core.worker_env import WorkerEnv

    base = dict(generation=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1, nnodes=2,
                store_host="10.0.0.1", store_port=29500, run_id="job", token="s3cret" * 6, rank=3, holder="r3.0",
                log_dir="/tmp/logs", heartbeat_file="/tmp/hb", agent_pid=42, max_restarts=2)
    return WorkerEnv(**{**base, **kw})


def test_the_worker_environment_reads_back_what_the_agent_wrote_with_torchruns_names():
    from hp.core.worker_env import WorkerEnv

    w = _worker_env()
    env = w.to_env()
    assert WorkerEnv.from_env(env) == w
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("3", "1", "1", "2")
    spare = _worker_env(rank=-1, spare_id="n1s0", holder="spare.n1s0")
    senv = spare.to_env()
    assert "RANK" not in senv and senv["HP_ROLE"] == "spare" and WorkerEnv.from_env(senv) == spare
    assert "s3cret" not in repr(w)  # the token never prints


@pytest.mark.parametrize("change, says", [
    ({"RANK": None}, "missing RANK"), ({"MASTER_PORT": None, "HP_GENERATION": None}, "missing HP_GENERATION, MASTER_PORT"),
    ({"WORLD_SIZE": "four"}, "malformed"),
])
def test_a_process_not_started_by_hp_run_gets_one_line(change, says):
    from hp.core.errors import UsageError
    from hp.core.worker_env import WorkerEnv

    env = _worker_env().to_env()
    for k, v in change.items():
        env.pop(k) if v is None else env.__setitem__(k, v)
    with pytest.raises(UsageError, match=says) as e:
        WorkerEnv.from_env(env)
    assert "\n" not in str(e.value)


def test_a_finishing_plan_says_so_and_others_leave_the_field_out():
    from dataclasses import replace

    finishing = replace(PLAN, finishing=True)
    assert json.loads(finishing.to_json())["finishing"] is True and "finishing" not in json.loads(PLAN.to_json())
    assert Plan.from_json(finishing.to_json()) == finishing and Plan.from_json(PLAN.to_json()).finishing is False
    with pytest.raises(ProtocolError, match="field 'finishing' must be bool"):
        Plan.from_json(json.dumps({**json.loads(PLAN.to_json()), "finishing": "yes"}))
