"""Reading picks the newest complete step and checks every item's CRC: a bit-flipped or truncated
shard falls back to the next tier with a warning, and with no good copy left the load fails —
never a silent bad load. Persistent tier on a local path here (FSx-style mount)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hp.testing import HP, wait_for
from hp.tiered_ckpt import CheckpointCorruptError, TieredConfig, api, fmt


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "extra": {"step": step}}


def _blank() -> dict:
    return {"w": torch.zeros(64, 32), "b": torch.zeros(32), "extra": {"step": -1}}


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["w"], b["w"]) and torch.equal(a["b"], b["b"]) and a["extra"] == b["extra"]


@pytest.fixture
def saved(daemons, token, tmp_path, monkeypatch):
    """Step 5 saved to the memory tier and committed to a file:// persistent tier."""
    monkeypatch.setenv("HP_JOB_TOKEN", token)
    node = daemons("node0", replicas=0)
    url = f"file://{tmp_path}/persist"
    cfg = TieredConfig("job", daemon=node.addr, persist_url=url, persist_every=5)
    assert api.save(_state(5), 5, cfg)
    wait_for(lambda: node.events("committed"), 60, "the commit marker")
    return node, cfg, tmp_path / "persist" / "job" / fmt.step_dir(5) / fmt.rank_file(0)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _tensor_offset(node, step: int = 5) -> int:
    """An offset inside the raw data of the first tensor item (past its torch.save header)."""
    man = node.client.manifest("job", step)["files"]["0"]
    off, n, _ = man["items"][0]
    return off + n - 200


def test_bitflip_in_memory_tier_falls_back_to_persistent_with_warning(saved, caplog):
    node, cfg, _ = saved
    slot = next(node.root.rglob("rank0.*.buf"))
    _flip(slot, _tensor_offset(node))
    sd = _blank()
    with caplog.at_level(logging.WARNING, logger="hp.tiered_ckpt"):
        reader = api.load(sd, cfg)
    assert _same(sd, _state(5))
    assert reader.ref.tier == "memory" and "persistent" in reader.tiers_used
    assert any("checksum mismatch" in f and f.startswith("memory") for f in reader.fallbacks)
    assert "trying the next tier" in caplog.text


def test_truncated_persisted_shard_is_detected_and_never_loaded(saved):
    node, cfg, persisted = saved
    data = persisted.read_bytes()
    persisted.write_bytes(data[: len(data) // 2])
    verify = subprocess.run([*HP, "ckpt", "verify", "job", "--url", cfg.persist_url], capture_output=True, text=True)
    assert verify.returncode == 1 and "truncated" in verify.stdout, verify.stdout + verify.stderr
    assert node.client.gc("job", 0) == [5]  # memory copy gone: only the truncated one is left
    sd = _blank()
    with pytest.raises(CheckpointCorruptError, match="short read"):
        api.load(sd, cfg)
    assert torch.count_nonzero(sd["w"]) == 0 or not _same(sd, _state(5))


def test_bitflipped_persisted_shard_fails_verify_and_load_uses_the_memory_copy(saved):
    node, cfg, persisted = saved
    _flip(persisted, _tensor_offset(node))
    verify = subprocess.run([*HP, "ckpt", "verify", "job", "--url", cfg.persist_url], capture_output=True, text=True)
    assert verify.returncode == 1 and "checksum mismatch" in verify.stdout
    sd = _blank()
    reader = api.load(sd, cfg)
    assert _same(sd, _state(5)) and reader.tiers_used == {"memory"}
    slot = next(node.root.rglob("rank0.*.buf"))  # now both copies are bad: the load must fail
    _flip(slot, _tensor_offset(node))
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        api.load(_blank(), cfg)


def test_newest_complete_step_wins_and_incomplete_steps_are_skipped(saved, tmp_path):
    node, cfg, _ = saved
    assert api.save(_state(6), 6, TieredConfig("job", daemon=node.addr))  # memory only
    # listed complete once the daemon has it all (a loaded fresh-clone run saw step 5 still newest just after)
    wait_for(lambda: api.latest(cfg).step == 6, 30, "step 6 in the memory tier")
    assert api.latest(cfg).tiers == ("memory",)
    # a persisted step without its commit marker (upload cut short) is never picked
    step9 = tmp_path / "persist" / "job" / fmt.step_dir(9)
    step9.mkdir(parents=True)
    (step9 / fmt.rank_file(0)).write_bytes(b"partial")
    node.client.gc("job", 0)
    ref = api.latest(cfg)
    assert (ref.step, ref.tier) == (5, "persistent")
    sd = _blank()
    api.load(sd, cfg)
    assert _same(sd, _state(5))


class _Evil:
    """What an attacker who can write the bucket (no job token needed) puts in a non-tensor item."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.marker),)


def _rewrite_byte_item(step_dir: Path, fqn: str, payload: bytes, token: str | None = None) -> None:
    """Point ``fqn`` at ``payload`` appended to rank 0's file, checksums recomputed: every file the
    reader trusts is consistent, as an attacker with write access to the storage makes it. With
    ``token`` (an attacker who holds the job token too) the manifest, the metadata and the commit
    marker are signed again, the marker pinning the new digests."""
    import json
    import zlib

    from hp.tiered_ckpt import signed

    shard, meta_path, man_path = step_dir / fmt.rank_file(0), step_dir / fmt.META_JSON, step_dir / fmt.rank_manifest(0)
    data = shard.read_bytes()
    offset = fmt.align(len(data))
    data = data.ljust(offset, b"\0") + payload
    shard.write_bytes(data)
    meta = json.loads(meta_path.read_text())
    for entry in meta["storage_data"]:
        if entry[0] == fqn:
            entry[4], entry[5] = offset, len(payload)
    meta_path.write_text(json.dumps(meta))
    man = json.loads(man_path.read_text())
    man["items"].append([offset, len(payload), zlib.crc32(payload)])
    man["nbytes"] = len(data)
    man_path.write_text(json.dumps(man))
    if token is not None:
        for path, doc in ((meta_path, meta), (man_path, man)):
            path.write_bytes(signed.dumps(token, doc))
        commit = json.loads((step_dir / fmt.COMMIT).read_text())
        commit["digests"] = {p.name: signed.digest(p.read_bytes()) for p in (meta_path, man_path)}
        (step_dir / fmt.COMMIT).write_bytes(signed.dumps(token, commit))


def test_a_rewritten_non_tensor_item_is_refused_never_unpickled(saved, token, tmp_path):
    """#13 finding 1: DCP's load planner unpickles non-tensor items with weights_only=False; a
    rewritten item with recomputed CRCs made verify say ok and load run the attacker's call. Now the
    signed manifests refuse it (finding 2); and an attacker who also holds the job token and signs
    again meets the decoder that never unpickles."""
    import io

    from hp.tiered_ckpt import UnsafeItemError

    node, cfg, persisted = saved
    marker = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save(_Evil(marker), evil)
    saved_files = {p: p.read_bytes() for p in persisted.parent.iterdir()}
    _rewrite_byte_item(persisted.parent, "extra.step", evil.getvalue())
    assert node.client.gc("job", 0) == [5]  # only the rewritten persistent copy is left
    verify = subprocess.run([*HP, "ckpt", "verify", "job", "--url", cfg.persist_url], capture_output=True, text=True)
    assert verify.returncode == 1 and "not the file its commit marker pins" in verify.stdout, verify.stdout
    with pytest.raises(CheckpointCorruptError, match="no tier's manifests verify"):
        api.load(_blank(), cfg)
    for p, data in saved_files.items():
        p.write_bytes(data)
    _rewrite_byte_item(persisted.parent, "extra.step", evil.getvalue(), token=token)
    verify = subprocess.run([*HP, "ckpt", "verify", "job", "--url", cfg.persist_url], capture_output=True, text=True)
    assert verify.returncode == 1 and "'extra.step' would need unpickling" in verify.stdout, verify.stdout
    sd = _blank()
    with pytest.raises(UnsafeItemError, match="'extra.step' would need unpickling"):
        api.load(sd, cfg)
    assert not marker.exists()  # nothing ran, in verify or in load
    assert sd["extra"] == {"step": -1}


def test_plain_values_in_non_tensor_items_still_load(saved):
    """The safe decoder keeps what DCP saves for an optimizer: nested dicts, lists, tuples, floats, bools."""
    node, cfg, _ = saved
    opt_like = {"param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "amsgrad": False, "params": [0, 1],
                                  "name": None}], "step": 7}
    state = {**_state(7), "extra": opt_like}
    memory = TieredConfig("job", daemon=node.addr)
    assert api.save(state, 7, memory)
    # a save is staged when save() returns and listed complete once the daemon has checksummed it (the
    # fresh-clone run at 37c6e6a loaded at once and found no complete step 7)
    wait_for(lambda: api.latest(memory).step == 7, 30, "step 7 in the memory tier")
    sd = {**_blank(), "extra": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "amsgrad": True, "params": [],
                                                  "name": "x"}], "step": -1}}
    api.load(sd, memory, step=7)
    assert sd["extra"] == opt_like


def test_a_newest_step_bad_everywhere_falls_back_to_the_older_complete_step(saved, caplog):
    """#13 finding 3: when no tier has a good copy of the newest step, load the next older complete
    one (every item of it: nothing of the bad step remains) instead of failing the restart."""
    node, cfg, persisted5 = saved
    assert api.save(_state(6), 6, cfg, force=True)
    wait_for(lambda: len(node.events("committed")) >= 2, 60, "step 6's commit marker")
    # memory copies gone: the persistent tier holds both (step 6 stays pinned until its upload job ends)
    removed: set[int] = set()
    wait_for(lambda: removed.update(node.client.gc("job", 0)) or removed == {5, 6}, 30, "memory gc")
    _flip(persisted5.parent.parent / fmt.step_dir(6) / fmt.rank_file(0), _tensor_offset_persisted(cfg, 6))
    sd = _state(6)  # a live state the bad step would have partly overwritten
    with caplog.at_level(logging.WARNING, logger="hp.tiered_ckpt"):
        reader = api.load(sd, cfg)
    assert reader.step == 5 and _same(sd, _state(5))
    assert len(reader.skipped) == 1 and reader.skipped[0].startswith("step 6:") and "checksum mismatch" in reader.skipped[0]
    assert "trying an older step" in caplog.text
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):  # a step asked for is never swapped
        api.load(_blank(), cfg, step=6)


def _tensor_offset_persisted(cfg, step: int) -> int:
    import json

    root = Path(cfg.persist_url.removeprefix("file://")) / "job" / fmt.step_dir(step)
    off, n, _ = json.loads((root / fmt.rank_manifest(0)).read_text())["items"][0]
    return off + n - 200
