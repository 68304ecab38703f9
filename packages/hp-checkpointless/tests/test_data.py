"""The per-node token cache and the deterministic batch sampler (hp.checkpointless.data)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hp.checkpointless.data import (
    Batches, TokenCache, cache_directory, measure_cold_warm, synthetic_corpus, tokenize,
)
from hp.core.warm_start import python_command


def _fail() -> np.ndarray:
    raise AssertionError("build() must not run when the cache exists")


def _small(seed: int = 1, n: int = 20_000) -> np.ndarray:
    return tokenize(synthetic_corpus(n, seed))


# ---------------------------------------------------------------- corpus and tokenizer
def test_corpus_is_deterministic_english_like_text():
    a, b = synthetic_corpus(100_000, 7), synthetic_corpus(100_000, 7)
    assert a == b and len(a) == 100_000
    assert a != synthetic_corpus(100_000, 8)
    assert synthetic_corpus(1000, 7) == a[:1000]  # a prefix does not depend on the requested size
    text = a.decode("ascii")
    assert text.count(" ") > 10_000 and text.count(".") > 1000 and "The " in text
    assert synthetic_corpus(0, 1) == b""


def test_tokenizer_is_byte_level_and_deterministic():
    text = synthetic_corpus(50_000, 3)
    ids = tokenize(text)
    assert ids.dtype == np.uint16 and ids.shape == (50_000,)
    assert np.array_equal(ids, np.frombuffer(text, np.uint8))  # vocab 256 = identity on bytes
    small = tokenize(text, vocab=100)
    assert small.max() < 100 and np.array_equal(small, tokenize(text, vocab=100))
    assert tokenize(bytes(range(256)), vocab=65536).max() == 255
    with pytest.raises(ValueError):
        tokenize(text, vocab=1)


# ---------------------------------------------------------------- cache
def test_build_then_attach_without_building(tmp_path):
    tokens = _small()
    c1 = TokenCache.open("corpus/v1 seed=1", lambda: tokens, str(tmp_path))
    assert c1.built and isinstance(c1.tokens, np.memmap) and np.array_equal(c1.tokens, tokens)
    assert Path(c1.path).parent == tmp_path and "/" not in Path(c1.path).name[len("hp-tokens-"):]
    c2 = TokenCache.open("corpus/v1 seed=1", _fail, str(tmp_path))
    assert not c2.built and c2.path == c1.path and np.array_equal(c2.tokens, tokens)
    assert c2.open_s >= 0
    c2.verify()
    with pytest.raises(ValueError):  # read-only mapping: nobody can scribble on the shared pages
        c2.tokens[0] = 1
    c3 = TokenCache.open("corpus/v1 seed=2", lambda: tokens[:100], str(tmp_path))
    assert c3.built and c3.path != c1.path and len(c3.tokens) == 100
    for c in (c1, c2, c3):
        c.close()
    assert TokenCache.remove("corpus/v1 seed=1", str(tmp_path))
    assert not TokenCache.remove("corpus/v1 seed=1", str(tmp_path))
    assert not os.path.exists(c1.path)


def test_directory_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("HP_DATA_CACHE_DIR", str(tmp_path / "env"))
    assert cache_directory() == str(tmp_path / "env") and (tmp_path / "env").is_dir()
    assert cache_directory(str(tmp_path / "arg")) == str(tmp_path / "arg")
    with TokenCache.open("k", lambda: np.arange(10, dtype=np.uint16)) as c:
        assert Path(c.path).parent == tmp_path / "env"
    monkeypatch.delenv("HP_DATA_CACHE_DIR")
    default = Path(cache_directory())  # one per user, 0700: nobody else reads the tokens or plants a cache
    assert default.name == f"hp-data-{os.getuid()}" and str(default.parent) in ("/dev/shm", tempfile.gettempdir())
    assert default.stat().st_mode & 0o777 == 0o700


def test_a_planted_cache_file_is_never_attached(tmp_path):
    """#13 finding 6: caches had predictable names in a shared directory, opened without an owner check."""
    with TokenCache.open("k", lambda: np.arange(10, dtype=np.uint16), str(tmp_path)) as c:
        path = Path(c.path)
    assert path.stat().st_mode & 0o777 == 0o600 and tmp_path.stat().st_mode & 0o777 == 0o700
    elsewhere = tmp_path / "attacker.bin"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)  # what another user could plant in a shared directory
    with pytest.raises(OSError):
        TokenCache.open("k", _fail, str(tmp_path))


_RACER = textwrap.dedent("""
    import hashlib, json, os, sys, time
    from hp.checkpointless.data import TokenCache, synthetic_corpus, tokenize
    d, me = sys.argv[1], sys.argv[2]
    def build():
        time.sleep(1.0)  # keep the build window open so the others really contend for the lock
        return tokenize(synthetic_corpus(300_000, 5))
    open(os.path.join(d, "ready-" + me), "w").close()
    while not os.path.exists(os.path.join(d, "go")):
        time.sleep(0.002)
    c = TokenCache.open("race", build, d)
    print(json.dumps({"built": c.built, "n": len(c.tokens), "sha": hashlib.sha256(c.tokens.tobytes()).hexdigest()}))
""")


def test_three_concurrent_processes_build_once(tmp_path):
    env = {**os.environ, "HP_DATA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen(python_command(["-c", _RACER, str(tmp_path), str(i)]), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{i}").exists() for i in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "racers did not start"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    res = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert sorted(r["built"] for r in res) == [False, False, True]
    expected = tokenize(synthetic_corpus(300_000, 5))
    assert {r["sha"] for r in res} == {hashlib.sha256(expected.tobytes()).hexdigest()}
    assert not list(tmp_path.glob("*.tmp.*"))


def _mapped_rss_kb(path: str) -> int:
    """Resident kB of this process's mappings of path (/proc/self/smaps): what attach actually read."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            inside = line.rstrip().endswith(path)
        elif inside and head[0] == "Rss:":
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_attach_is_o1_and_reads_no_token_pages(tmp_path):
    n = 32 << 20  # 64 MB of uint16
    t0 = time.perf_counter()
    c = TokenCache.open("big", lambda: (np.arange(n) % 251).astype(np.uint16), str(tmp_path))
    build_s = time.perf_counter() - t0
    c.close()
    del c
    warm = TokenCache.open("big", _fail, str(tmp_path))
    assert not warm.built and len(warm.tokens) == n
    assert _mapped_rss_kb(warm.path) < 1024  # nothing of the 64 MB was read by attach
    assert warm.open_s < build_s and warm.open_s < 1.0  # generous: only catches a full read
    assert int(warm.tokens[n - 1]) == (n - 1) % 251
    assert int(warm.tokens.sum(dtype=np.int64)) > 0
    assert _mapped_rss_kb(warm.path) > 32 * 1024  # the probe does see pages once they are touched


def test_truncated_or_corrupted_header_raises_naming_the_file(tmp_path):
    c = TokenCache.open("bad", lambda: _small(2, 4000), str(tmp_path))
    path, original = c.path, Path(c.path).read_bytes()
    c.close()
    for cut in (len(original) - 1, len(original) - 2000, 64, 10, 0):
        Path(path).write_bytes(original[:cut])
        with pytest.raises(ValueError, match=path.replace(".", r"\.")):
            TokenCache.open("bad", _fail, str(tmp_path))
    for i in range(64):  # every header byte, flipped, is detected
        broken = bytearray(original)
        broken[i] ^= 0x10
        Path(path).write_bytes(bytes(broken))
        with pytest.raises(ValueError, match="bad"):
            TokenCache.open("bad", _fail, str(tmp_path))
    Path(path).write_bytes(original)
    TokenCache.open("bad", _fail, str(tmp_path)).verify()


def test_verify_catches_a_flipped_token_byte(tmp_path):
    c = TokenCache.open("flip", lambda: _small(3, 10_000), str(tmp_path))
    c.verify()
    c.close()
    with open(c.path, "r+b") as f:
        f.seek(64 + 5000)
        b = f.read(1)
        f.seek(64 + 5000)
        f.write(bytes([b[0] ^ 1]))
    bad = TokenCache.open("flip", _fail, str(tmp_path))  # the hot path does not read tokens ...
    with pytest.raises(ValueError, match="checksum"):
        bad.verify()  # ... verify() does


def test_failed_build_leaves_nothing_and_the_next_open_builds(tmp_path):
    def boom() -> np.ndarray:
        raise RuntimeError("preprocessing crashed")

    with pytest.raises(RuntimeError):
        TokenCache.open("k", boom, str(tmp_path))
    assert [p.name.endswith(".lock") for p in tmp_path.iterdir()] == [True]
    with pytest.raises(ValueError):
        TokenCache.open("k", lambda: np.zeros(0, np.uint16), str(tmp_path))
    path = TokenCache.open("k", lambda: np.arange(3, dtype=np.uint16), str(tmp_path)).path
    TokenCache.remove("k", str(tmp_path))
    Path(path + ".tmp.999999").write_bytes(b"half written")  # a builder that died mid-write
    c = TokenCache.open("k", lambda: np.arange(5, dtype=np.uint16), str(tmp_path))
    assert c.built and list(c.tokens) == [0, 1, 2, 3, 4]
    assert not list(tmp_path.glob("*.tmp.*"))


def test_measure_cold_warm(tmp_path):
    m = measure_cold_warm("demo", 200_000, str(tmp_path))
    assert m["tokens"] == 200_000 and 0 < m["warm_attach_s"] and 0 < m["cold_preprocess_s"]
    with TokenCache.open("demo", _fail, str(tmp_path)) as c:
        assert np.array_equal(c.tokens, tokenize(synthetic_corpus(200_000, 0)))


# ---------------------------------------------------------------- batches
@pytest.fixture
def cache(tmp_path):
    c = TokenCache.open("batches", lambda: _small(4, 8 * 125 + 3), str(tmp_path))  # 125 windows of 8
    yield c
    c.close()


def test_batches_are_a_pure_function_of_seed_step_rank_world(cache):
    a, b = Batches(cache, seq=7, batch_per_rank=2, seed=11), Batches(cache, seq=7, batch_per_rank=2, seed=11)
    x, y = a.get(9, 1, 3)
    assert x.dtype == torch.int64 and x.shape == (2, 7) and y.shape == (2, 7)
    b.get(50, 0, 3)  # different history must not matter
    x2, y2 = b.get(9, 1, 3)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    w = a.windows_for(9, 1, 3)[0]
    assert np.array_equal(x[0].numpy(), cache.tokens[w * 8:w * 8 + 7])
    assert a.windows_for(9, 1, 3) != Batches(cache, 7, 2, seed=12).windows_for(9, 1, 3)


@pytest.mark.parametrize("world,bpr", [(3, 2), (2, 3), (1, 6), (4, 5)])
def test_every_window_exactly_once_per_epoch(cache, world, bpr):
    bt = Batches(cache, seq=7, batch_per_rank=bpr, seed=5)
    assert bt.n_windows == 125
    order = [w for s in range(3 * 125 // (world * bpr) + 1) for r in range(world) for w in bt.windows_for(s, r, world)]
    for e in range(3):
        epoch = order[e * 125:(e + 1) * 125]
        assert sorted(epoch) == list(range(125)), f"epoch {e} has duplicates or skips"
    assert order[:125] != order[125:250]  # each epoch is reshuffled
    if world * bpr == 6:  # same global batch ⇒ same global sample order, whatever the split
        other = Batches(cache, 7, 2, 5)
        assert order[:240] == [w for s in range(40) for r in range(3) for w in other.windows_for(s, r, 3)]


def test_resume_gives_the_uninterrupted_batches(cache):
    straight = Batches(cache, seq=7, batch_per_rank=2, seed=3)
    ref = {(s, r): straight.get(s, r, 2) for s in range(40) for r in range(2)}
    with TokenCache.open("batches", _fail, os.path.dirname(cache.path)) as reopened:  # a restarted process
        resumed = Batches(reopened, seq=7, batch_per_rank=2, seed=3)
        for s in range(25, 40):
            for r in range(2):
                x, y = resumed.get(s, r, 2)
                assert torch.equal(x, ref[(s, r)][0]) and torch.equal(y, ref[(s, r)][1])
