"""#13 finding 2: a commit never mixes two saves of a step. Every save has an id; the memory tier
counts a step complete only when its metadata and every rank's file are of one save, and refuses
messages of an older save; the persistent tier's manifests, metadata and commit marker are signed
with the job token, the marker pins the others' digests, and a re-upload removes it first."""

from __future__ import annotations

import json
import time
import zlib

import pytest

from hp.core.auth import new_token
from hp.tiered_ckpt import fmt, signed
from hp.tiered_ckpt.persist import NotCommittable, PersistentTier
from hp.tiered_ckpt.reader import find_readable
from hp.tiered_ckpt.sources import PersistentSource
from hp.tiered_ckpt.store import MemoryStore


def test_save_ids_sort_by_creation_and_signed_documents_reject_tampering():
    a = signed.new_save_id()
    time.sleep(0.001)
    b = signed.new_save_id()
    assert a < b and signed.is_save_id(a) and not signed.is_save_id("../x")
    token = new_token()
    raw = signed.dumps(token, {"rank": 0, "items": [[0, 8, 123]], "save_id": a})
    assert signed.loads(token, raw, "m") == {"rank": 0, "items": [[0, 8, 123]], "save_id": a}
    doc = json.loads(raw)
    doc["items"][0][2] = 456  # a CRC recomputed by someone without the token
    for bad, why in ((json.dumps(doc).encode(), "bad signature"), (raw, "bad signature"),
                     (json.dumps({"rank": 0}).encode(), "unsigned"), (b"\xff", "not JSON")):
        with pytest.raises(signed.SignatureError, match=why):
            signed.loads(token if bad is not raw else new_token(), bad, "m")


# --- memory tier ------------------------------------------------------------------------------------

def _sealed(store: MemoryStore, rank: int, step: int, save_id: str, world: int = 2):
    path = store.acquire_slot("job", rank, step, 64)
    f = store.seal("job", rank, step, world, path, 64, [[0, 64]], None, save_id)
    store.checksum(f)
    return f


def test_memory_step_is_complete_only_when_metadata_and_every_file_are_of_one_save(tmp_path):
    store = MemoryStore(tmp_path / "shm")
    first, second = signed.new_save_id(), signed.new_save_id()
    for r in (0, 1):
        _sealed(store, r, 4, first)
    store.put_meta("job", 4, 2, {"m": 1}, b"", primary=True, save_id=first)
    assert [s["complete"] for s in store.listing("job")] == [True]
    _sealed(store, 0, 4, second)  # the step saved again (a retried step): rank 1 not yet
    assert [s["complete"] for s in store.listing("job")] == [False]
    store.put_meta("job", 4, 2, {"m": 2}, b"", primary=True, save_id=second)
    assert [(s["complete"], s["ranks"]) for s in store.listing("job")] == [(False, [0])]  # rank 1 still first
    _sealed(store, 1, 4, second)
    assert [(s["complete"], s["save_id"]) for s in store.listing("job")] == [(True, second)]
    with pytest.raises(KeyError):
        store.file("job", 4, 0, first)  # a reader of the first save gets nothing of the second
    assert store.file("job", 4, 0, second).save_id == second


def test_memory_tier_refuses_a_message_of_an_older_save(tmp_path):
    store = MemoryStore(tmp_path / "shm")
    old, new = signed.new_save_id(), signed.new_save_id()
    _sealed(store, 0, 4, new)
    with pytest.raises(ValueError, match="stale"):  # a worker of a superseded generation
        _sealed(store, 1, 4, old)
    with pytest.raises(ValueError, match="stale"):
        store.put_meta("job", 4, 2, {}, b"", primary=False, save_id=old)
    with pytest.raises(ValueError, match="stale"):  # a late replica of the earlier save
        store.put_replica("job", 4, 2, 1, [[0, 4, 0]], 4, old, lambda out: out.write(b"abcd"))
    with pytest.raises(ValueError, match="bad save id"):
        store.seal("job", 0, 4, 2, store.acquire_slot("job", 0, 4, 64), 64, [[0, 64]], None, "../../x")


# --- persistent tier -------------------------------------------------------------------------------

def _upload(tier: PersistentTier, step: int, world: int, save_id: str, ranks=None, value: int = 0) -> None:
    """What the daemons upload for one save: each rank's file then its signed manifest; the
    metadata (signed) from the coordinator's daemon. Re-uploading removes another save's marker first."""
    tier.uncommit(step, save_id)
    for r in ranks if ranks is not None else range(world):
        data = bytes([value]) * 64
        tier.put_bytes(step, fmt.rank_file(r), data)
        tier.put_signed(step, fmt.rank_manifest(r), {"rank": r, "nbytes": 64, "items": [[0, 64, zlib.crc32(data)]],
                                                      "save_id": save_id})
    tier.put_signed(step, fmt.META_JSON, {"state_dict_metadata": {}, "storage_data": [], "save_id": save_id})


def test_a_retried_upload_never_commits_while_a_manifest_is_of_the_earlier_save(tmp_path):
    token = new_token()
    tier = PersistentTier(f"file://{tmp_path}/p", "job", token)
    first, second = signed.new_save_id(), signed.new_save_id()
    _upload(tier, 20, 2, first, value=1)
    tier.commit(20, 2, first)
    assert tier.committed() == [20]
    _upload(tier, 20, 2, second, ranks=[0], value=2)  # rank 1's node died before re-uploading
    assert tier.committed() == []  # the old marker went before any of the new files landed
    with pytest.raises(NotCommittable, match="hp_rank1.json"):
        tier.commit(20, 2, second)  # the finding: the old code committed here (every manifest *existed*)
    with pytest.raises(NotCommittable):
        tier.commit(20, 2, first)  # nor can the earlier save's committer, arriving late
    assert tier.committed() == []
    _upload(tier, 20, 2, second, ranks=[1], value=2)
    tier.commit(20, 2, second)
    meta, files = tier.manifest(20, second)
    assert meta["save_id"] == second and {f["save_id"] for f in files.values()} == {second}


def test_readers_trust_only_what_the_commit_marker_pins(tmp_path):
    token = new_token()
    root = tmp_path / "p" / "job"
    tier = PersistentTier(f"file://{tmp_path}/p", "job", token)
    sid = signed.new_save_id()
    for step in (10, 20):
        _upload(tier, step, 1, sid)
        tier.commit(step, 1, sid)
    source = PersistentSource(tier)
    assert find_readable([source]).step == 20
    # a manifest rewritten after the commit (CRC recomputed, re-signed by nobody): refused, older step used
    man = root / fmt.step_dir(20) / fmt.rank_manifest(0)
    doc = json.loads(man.read_bytes())
    doc["items"][0][2] ^= 1
    man.write_text(json.dumps(doc))
    with pytest.raises(signed.SignatureError, match="not the file its commit marker pins"):
        tier.manifest(20)
    assert find_readable([source]).step == 10
    assert any("unreadable commit marker or manifest" in p for p in tier.size_problems(20))
    # a commit marker written without the token does not make a step complete
    commit = root / fmt.step_dir(10) / fmt.COMMIT
    commit.write_text(json.dumps({"step": 10, "world": 1, "save_id": sid, "digests": {}}))
    assert tier.committed() == [20] and tier.verify(10) == [f"unreadable commit marker: step 10 {fmt.COMMIT}: unsigned"]
    # another job's token: nothing here is complete for it (resuming needs the token that wrote it)
    assert PersistentTier(f"file://{tmp_path}/p", "job", new_token()).committed() == []
