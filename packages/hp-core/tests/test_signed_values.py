"""Sealed store values (hp.core.signed_values): what the workers act on is signed with the job token,
bound to its key, and can pass for no other signed message of hp."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hp.core import auth
from hp.core.protocol import (
    FINISHED_KEY, GENERATION_KEY, STATE_NBYTES_KEY, Plan, ProtocolError, arrive_prefix, is_sealed_key,
    node_service_key, plan_key, spare_key,
)
from hp.core.signed_values import DOMAIN, Refusals, seal, sealing, unseal

TOKEN = "a" * 64
PLAN = Plan(2, 4, "running", "", {0: "r0.0", 1: "spare.n0s0", 2: "r2.0", 3: "r3.0"}, why="spare_promoted")


@pytest.mark.parametrize("key, value", [
    (GENERATION_KEY, "7"), (plan_key(2), PLAN.to_json()), (STATE_NBYTES_KEY, "123456"),
    (node_service_key("ckpt", 1), "10.0.0.2:4711"), (FINISHED_KEY, "é\n\"\\ {}"),  # any text, exactly
])
def test_a_sealed_value_opens_to_itself(key, value):
    sealed = seal(TOKEN, key, value)
    assert json.loads(sealed).keys() == {"v", "sig"}
    assert unseal(TOKEN, key, sealed) == unseal(TOKEN, key, sealed.encode()) == value


def test_a_tampered_value_is_refused_naming_its_key():
    doc = json.loads(seal(TOKEN, GENERATION_KEY, "7"))
    doc["v"] = "99"
    with pytest.raises(ProtocolError, match=r"^store value at 'hp/generation' has a bad signature") as e:
        unseal(TOKEN, GENERATION_KEY, json.dumps(doc))
    assert "\n" not in str(e.value)


def test_a_value_moved_to_another_key_is_refused():
    sealed = seal(TOKEN, plan_key(2), PLAN.to_json())
    with pytest.raises(ProtocolError, match="'hp/plan/5' has a bad signature"):
        unseal(TOKEN, plan_key(5), sealed)
    with pytest.raises(ProtocolError, match="'hp/state_nbytes'"):  # the generation's "1" is no size
        unseal(TOKEN, STATE_NBYTES_KEY, seal(TOKEN, GENERATION_KEY, "1"))


def test_a_value_sealed_with_another_token_is_refused():
    with pytest.raises(ProtocolError, match="bad signature"):
        unseal(TOKEN, spare_key("n0s0"), seal("b" * 64, spare_key("n0s0"), '{"rank": 0, "generation": 1}'))


@pytest.mark.parametrize("raw", [b"7", "7", b"\xff\xfe", "", "[1]", '{"v": "7"}', '{"v": 7, "sig": "00"}',
                                 '{"sig": "00"}', '{"v": "7", "sig": 1}'])
def test_an_unsealed_value_is_refused(raw):
    with pytest.raises(ProtocolError, match=r"^store value at 'hp/generation' is not sealed"):
        unseal(TOKEN, GENERATION_KEY, raw)


def test_a_signature_that_is_not_hex_ascii_is_refused_not_crashed():
    with pytest.raises(ProtocolError, match="bad signature"):
        unseal(TOKEN, GENERATION_KEY, json.dumps({"v": "7", "sig": "é" * 64}))


def test_the_key_and_value_cannot_be_shifted_into_each_other():
    # key "hp/plan/1", value "2\nx" and key "hp/plan/1\n2", value "x" would sign the same bytes: a key
    # has no newline, so the first newline ends it
    sealed = seal(TOKEN, "hp/plan/1", "2\nx")
    with pytest.raises(ProtocolError, match="bad signature"):
        unseal(TOKEN, "hp/plan/1\n2", json.dumps({"v": "x", "sig": json.loads(sealed)["sig"]}))
    with pytest.raises(ValueError, match="no newline"):
        seal(TOKEN, "hp/plan/1\n2", "x")


def test_a_signed_request_cannot_pass_for_a_sealed_value_nor_the_reverse():
    body, signature = auth.encode_request(TOKEN, {"node_rank": 0, "generation": 9})
    for key in (GENERATION_KEY, plan_key(9), "", body.decode()):
        with pytest.raises(ProtocolError):
            unseal(TOKEN, key, json.dumps({"v": body.decode(), "sig": signature}))
    # a store value whose text is a valid request body: its signature does not sign that body
    sealed_sig = json.loads(seal(TOKEN, GENERATION_KEY, body.decode()))["sig"]
    with pytest.raises(auth.AuthError, match="signature"):
        auth.verify_request(TOKEN, body, sealed_sig)
    # nor the bytes it does sign (they are no JSON object, whatever the key and value)
    assert DOMAIN.startswith(b"hp-store-value\n") and not DOMAIN.lstrip().startswith((b"{", b"["))


def test_a_signed_checkpoint_document_cannot_pass_for_a_sealed_value_nor_the_reverse():
    signed = pytest.importorskip("hp.tiered_ckpt.signed")
    doc = json.loads(signed.dumps(TOKEN, {"v": "7", "save_id": "x"}))
    assert doc["v"] == "7"  # shaped like a sealed value: {"v": ..., "sig": ...} and more
    with pytest.raises(ProtocolError):
        unseal(TOKEN, GENERATION_KEY, json.dumps({"v": "7", "sig": doc["sig"]}))
    sealed = json.loads(seal(TOKEN, "save_id", "x"))
    with pytest.raises(signed.SignatureError):
        signed.loads(TOKEN, json.dumps({"v": "7", "sig": sealed["sig"]}).encode(), "doc")


def test_sealing_publishes_what_readers_open():
    written: dict[str, str] = {}
    publish = sealing(written.__setitem__, TOKEN)
    publish(GENERATION_KEY, "3")
    assert unseal(TOKEN, GENERATION_KEY, written[GENERATION_KEY]) == "3"
    with pytest.raises(ValueError, match="HP_JOB_TOKEN"):
        sealing(written.__setitem__, "")
    with pytest.raises(ValueError, match="HP_JOB_TOKEN"):
        unseal("", GENERATION_KEY, written[GENERATION_KEY])


def test_refusals_are_reported_at_most_once_per_key_and_period():
    now = [0.0]
    said: list[str] = []
    refusals = Refusals(lambda key, message: said.append(key), every_s=30, clock=lambda: now[0])
    for t in (0, 1, 29):
        now[0] = t
        refusals.report(GENERATION_KEY, "forged")
    refusals.report(plan_key(2), "forged")
    now[0] = 31
    refusals.report(GENERATION_KEY, "forged")
    assert said == [GENERATION_KEY, plan_key(2), GENERATION_KEY] and refusals.count == 5


def test_the_sealed_keys_are_what_workers_act_on():
    for key in (GENERATION_KEY, STATE_NBYTES_KEY, FINISHED_KEY, plan_key(3), spare_key("n1s0"),
                node_service_key("ckpt", 0)):
        assert is_sealed_key(key), key
    # add counters and torch's own rendezvous keys are not
    for key in (arrive_prefix(3) + "count", "hp/fault/0/5", "hp/g3/0", "hp/generations"):
        assert not is_sealed_key(key), key


def test_stdlib_only():
    code = "import hp.core.signed_values, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
