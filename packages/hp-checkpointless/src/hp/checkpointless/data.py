"""Per-node memory-mapped token cache and a deterministic batch sampler.

Why: after a fault, a recovering (or brand-new) worker must not redo preprocessing nor read the
dataset again. Tokens are built once per node into a file under /dev/shm, and every later process
attaches to it with ``np.memmap`` in O(1). Batches are a pure function of (seed, step, rank, world),
so a process that resumes at the committed step sees exactly the samples an uninterrupted run sees.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from hp.core.privfs import open_private, private_dir, user_dir

if TYPE_CHECKING:  # torch is imported lazily: a process that only attaches the cache stays light
    import torch

__all__ = ["synthetic_corpus", "tokenize", "cache_directory", "TokenCache", "Batches", "measure_cold_warm"]

# ---------------------------------------------------------------- synthetic corpus + tokenizer
_DET = "the a this that every one some no my our".split()
_ADJ = "old young small large quiet bright dark cold warm red green blue happy slow fast wise".split()
_NOUN = ("cat dog bird fox horse river tree house city road king queen child teacher farmer ship "
         "book song garden mountain window door letter market").split()
_VERB = "sees finds likes follows builds reads carries watches opens helps paints remembers".split()
_PREP = "near under over behind beside inside across with".split()
_END = [". ", "? ", "! ", ".\n\n"]
_END_P = np.array([0.8, 0.08, 0.05, 0.07])


def _piece_table() -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Every word/punctuation piece once in a flat byte buffer, so sentences assemble vectorised."""
    pieces: list[bytes] = []
    groups: dict[str, np.ndarray] = {}
    for name, items in (("cap", [w.capitalize() for w in _DET]), ("det", [" " + w for w in _DET]),
                        ("adj", [" " + w for w in _ADJ]), ("noun", [" " + w for w in _NOUN]),
                        ("verb", [" " + w for w in _VERB]), ("prep", [" " + w for w in _PREP]), ("end", _END)):
        groups[name] = np.arange(len(pieces), len(pieces) + len(items))
        pieces += [s.encode() for s in items]
    lens = np.array([len(p) for p in pieces], dtype=np.int64)
    buf = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    return buf, lens, np.cumsum(lens) - lens, groups


_BUF, _LENS, _OFFS, _GROUPS = _piece_table()


def _draw(rng: np.random.Generator, group: str, n: int, p: np.ndarray | None = None) -> np.ndarray:
    """Zipf-like choice inside a group (frequent words dominate, as in real text)."""
    ids = _GROUPS[group]
    w = p if p is not None else 1.0 / np.arange(1, len(ids) + 1)
    cdf = np.cumsum(w) / np.sum(w)
    return ids[np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(ids) - 1)]


def _sentences(rng: np.random.Generator, n: int) -> bytes:
    """n sentences from the template Det [Adj] Noun Verb Det [Adj] Noun [Prep Det Noun] End."""
    slots = np.stack([_draw(rng, "cap", n), _draw(rng, "adj", n), _draw(rng, "noun", n), _draw(rng, "verb", n),
                      _draw(rng, "det", n), _draw(rng, "adj", n), _draw(rng, "noun", n), _draw(rng, "prep", n),
                      _draw(rng, "det", n), _draw(rng, "noun", n), _draw(rng, "end", n, _END_P)], axis=1)
    mask = np.ones_like(slots, dtype=bool)
    mask[:, 1] = rng.random(n) < 0.4
    mask[:, 5] = rng.random(n) < 0.3
    mask[:, 7:10] = (rng.random(n) < 0.5)[:, None]
    ids = slots[mask]  # row-major: sentence by sentence
    lens = _LENS[ids]
    starts = np.cumsum(lens) - lens
    owner = np.repeat(np.arange(len(ids)), lens)
    pos = np.arange(int(lens.sum())) - starts[owner] + _OFFS[ids][owner]
    return _BUF[pos].tobytes()


def synthetic_corpus(n_bytes: int, seed: int) -> bytes:
    """Deterministic English-like ASCII text of exactly n_bytes: learnable structure, no download needed."""
    rng, out, have = np.random.default_rng(seed), [], 0
    while have < n_bytes:  # a fixed chunk size keeps the output a function of the seed alone
        out.append(_sentences(rng, 50_000))
        have += len(out[-1])
    return b"".join(out)[:n_bytes]


def tokenize(text: bytes, vocab: int = 256) -> np.ndarray:
    """Byte-level tokens (uint16): identity for vocab >= 256, bytes folded modulo vocab below that."""
    if not 2 <= vocab <= 65536:
        raise ValueError(f"vocab must be in [2, 65536], got {vocab}")
    lut = (np.arange(256) % vocab).astype(np.uint16)
    return lut[np.frombuffer(text, dtype=np.uint8)]


# ---------------------------------------------------------------- token cache
_MAGIC = b"HPTOKCCH"
_VERSION = 1
_HEADER = struct.Struct("<8sII8sQI")  # magic, version, header size, dtype str, length, data crc32
_HEADER_SIZE = 64  # data starts aligned; the last 4 bytes are a crc32 of bytes [0, 60)


def cache_directory(directory: str | None = None) -> str:
    """Argument, else $HP_DATA_CACHE_DIR, else ``/dev/shm/hp-data-<uid>`` (RAM, shared by this user's
    processes on the node), else the temp dir's: a directory only this user may enter (0700, ours), so
    that nobody else can read the tokens or plant a cache file under a name we will look up."""
    d = directory or os.environ.get("HP_DATA_CACHE_DIR")
    return str(private_dir(d) if d else user_dir("hp-data"))


def _cache_path(key: str, directory: str | None) -> str:
    """Readable (sanitised) and collision-free (hash of the full key) file name."""
    safe, digest = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[:64], hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(cache_directory(directory), f"hp-tokens-{safe}-{digest}.bin")


def _crc(data: np.ndarray, chunk: int = 1 << 24) -> int:
    """crc32 of an array's bytes, in chunks so a memmap is streamed rather than copied."""
    raw, crc = data.reshape(-1).view(np.uint8), 0
    for i in range(0, len(raw), chunk):
        crc = zlib.crc32(raw[i:i + chunk], crc)
    return crc


class TokenCache:
    """One read-only token file per (node, key); many processes map the same pages."""

    def __init__(self, path: str, tokens: np.memmap, crc: int, built: bool, open_s: float) -> None:
        self.path, self.tokens, self.built, self.open_s, self._crc = path, tokens, built, open_s, crc

    @classmethod
    def open(cls, key: str, build: Callable[[], np.ndarray], directory: str | None = None) -> TokenCache:
        """Attach to the cache for key, building it first if no process on this node has.

        A complete file only ever appears through os.replace, so its existence alone means "ready" and
        attaching needs no lock. Building happens under an exclusive flock, so exactly one process builds;
        the others wait on the lock, then attach. The flock dies with its holder, so a crashed builder
        never wedges the node; its half-written tmp file is removed by the next builder.
        """
        t0 = time.perf_counter()
        path = _cache_path(key, directory)
        built = False
        if not os.path.exists(path):
            with os.fdopen(open_private(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_APPEND), "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    if not os.path.exists(path):
                        cls._build(path, build)
                        built = True
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
        tokens, crc = cls._attach(path)
        return cls(path, tokens, crc, built, time.perf_counter() - t0)

    @staticmethod
    def _build(path: str, build: Callable[[], np.ndarray]) -> None:
        for stale in glob.glob(glob.escape(path) + ".tmp.*"):  # we hold the lock: nobody else is writing
            os.unlink(stale)
        arr = np.ascontiguousarray(build())
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{path}: build() must return a non-empty 1-D integer array, got {arr.dtype}{arr.shape}")
        head = _HEADER.pack(_MAGIC, _VERSION, _HEADER_SIZE, arr.dtype.str.encode(), arr.size, _crc(arr))
        head = head.ljust(_HEADER_SIZE - 4, b"\0")
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
                f.write(head + struct.pack("<I", zlib.crc32(head)))
                f.write(memoryview(arr).cast("B"))
                f.flush()
                os.fsync(f.fileno())  # a power cut must not leave a renamed but empty file behind
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    @staticmethod
    def _attach(path: str) -> tuple[np.memmap, int]:
        """Read and check the 64-byte header only, then map the tokens (no data page is touched)."""
        with os.fdopen(open_private(path, os.O_RDONLY), "rb") as f:  # ours, no symlink: nobody else's tokens
            size = os.fstat(f.fileno()).st_size
            raw = f.read(_HEADER_SIZE)
        if len(raw) < _HEADER_SIZE:
            raise ValueError(f"{path}: truncated token cache header ({len(raw)} < {_HEADER_SIZE} bytes)")
        if raw[:8] != _MAGIC:
            raise ValueError(f"{path}: not an hp token cache (bad magic {raw[:8]!r})")
        if struct.unpack("<I", raw[-4:])[0] != zlib.crc32(raw[:-4]):
            raise ValueError(f"{path}: corrupted token cache header (header checksum mismatch)")
        _, version, hsize, dtype_s, length, crc = _HEADER.unpack(raw[:_HEADER.size])
        if version != _VERSION or hsize != _HEADER_SIZE:
            raise ValueError(f"{path}: unsupported token cache version {version} / header size {hsize}")
        dtype = np.dtype(dtype_s.rstrip(b"\0").decode())
        if size != _HEADER_SIZE + length * dtype.itemsize:
            raise ValueError(f"{path}: token cache size {size} does not match header "
                             f"({length} x {dtype.itemsize} bytes + {_HEADER_SIZE}); truncated or overwritten")
        return np.memmap(path, dtype=dtype, mode="r", offset=_HEADER_SIZE, shape=(length,)), crc

    def verify(self) -> None:
        """Full crc32 of the tokens against the header (reads every page: not on the attach path)."""
        got = _crc(self.tokens)
        if got != self._crc:
            raise ValueError(f"{self.path}: token data checksum mismatch (crc32 {got:#010x} != {self._crc:#010x})")

    def close(self) -> None:
        """Drop our mapping; pages stay in /dev/shm for other processes. Views still alive keep it mapped."""
        self.tokens = None  # type: ignore[assignment]

    def __enter__(self) -> TokenCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def remove(key: str, directory: str | None = None) -> bool:
        """Delete the cache file (and its lock and any stale tmp files); True if a cache file existed.

        Run it when no process is opening this key: mappings already made stay valid (Linux unlink).
        """
        path = _cache_path(key, directory)
        existed = os.path.exists(path)
        for p in [path, path + ".lock", *glob.glob(glob.escape(path) + ".tmp.*")]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        return existed


# ---------------------------------------------------------------- deterministic batches
class EpochOrder:
    """The sample at global position g: epoch = g // n, index = perm(seed, epoch)[g % n]. Every sample is
    used exactly once per epoch and nothing depends on history, so any process can produce the samples
    of any step (a replay after a failed commit, a resume after a restart, a spare taking a rank)."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n < 1:
            raise ValueError("nothing to draw from: 0 samples")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """Per-epoch permutation seeded by (seed, epoch); a couple are memoised (pure, so caching is safe)."""
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))  # oldest first
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> list[int]:
        """Sample indices at global positions ``start .. start + count - 1``."""
        if not self.shuffle:
            return [g % self.n for g in range(start, start + count)]
        return [int(self._perm(g // self.n)[g % self.n]) for g in range(start, start + count)]


class Batches:
    """Windows of seq+1 tokens of a :class:`TokenCache`, in :class:`EpochOrder`: rank r's batch of step s
    holds positions s * world * batch_per_rank + r * batch_per_rank + j."""

    def __init__(self, cache: TokenCache, seq: int, batch_per_rank: int, seed: int) -> None:
        if seq < 1 or batch_per_rank < 1:
            raise ValueError("seq and batch_per_rank must be >= 1")
        self.cache, self.seq, self.batch_per_rank, self.seed = cache, seq, batch_per_rank, seed
        self.n_windows = len(cache.tokens) // (seq + 1)
        if self.n_windows == 0:
            raise ValueError(f"{cache.path}: {len(cache.tokens)} tokens hold no window of {seq + 1}")
        self._order = EpochOrder(self.n_windows, seed)

    def windows_for(self, step: int, rank: int, world: int) -> list[int]:
        """Window indices of (step, rank, world), in batch order."""
        if not 0 <= rank < world or step < 0:
            raise ValueError(f"bad step/rank/world {step}/{rank}/{world}")
        return self._order.indices(step * world * self.batch_per_rank + rank * self.batch_per_rank, self.batch_per_rank)

    def get(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_per_rank, seq]; only the selected windows' pages are read."""
        import torch

        starts = np.asarray(self.windows_for(step, rank, world), dtype=np.int64) * (self.seq + 1)
        rows = torch.from_numpy(self.cache.tokens[starts[:, None] + np.arange(self.seq + 1)].astype(np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class Windows:
    """A map-style dataset over a :class:`TokenCache`: item i is window i as (inputs, targets), int64
    [seq] each. For :class:`hp.checkpointless.sampler.StepSampler` (micro-batches at any world size)."""

    def __init__(self, cache: TokenCache, seq: int) -> None:
        if seq < 1 or len(cache.tokens) < seq + 1:
            raise ValueError(f"{cache.path}: {len(cache.tokens)} tokens hold no window of {seq + 1}")
        self.cache, self.seq = cache, seq

    def __len__(self) -> int:
        return len(self.cache.tokens) // (self.seq + 1)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        start = i * (self.seq + 1)
        row = torch.from_numpy(self.cache.tokens[start:start + self.seq + 1].astype(np.int64))
        return row[:-1], row[1:]


def measure_cold_warm(key: str, n_bytes: int, directory: str | None, seed: int = 0) -> dict[str, float | int]:
    """Cold = generate + tokenize + write the cache (what every restart would redo without it);
    warm = a fresh process-style attach. Removes any previous cache for key first; leaves the new one."""
    TokenCache.remove(key, directory)
    cold = TokenCache.open(key, lambda: tokenize(synthetic_corpus(n_bytes, seed)), directory)
    cold.close()

    def _no_build() -> np.ndarray:
        raise RuntimeError("warm attach must not rebuild")

    warm = TokenCache.open(key, _no_build, directory)
    out = {"cold_preprocess_s": cold.open_s, "warm_attach_s": warm.open_s, "tokens": int(len(warm.tokens))}
    warm.close()
    return out
