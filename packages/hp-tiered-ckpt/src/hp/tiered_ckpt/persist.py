"""The persistent tier: one fsspec URL (``s3://bucket/prefix`` through s3fs, ``file:///fsx/...`` or a
plain path for a mounted shared filesystem such as FSx for Lustre) holding ``<namespace>/step_N/``
directories in DCP layout (see :mod:`hp.tiered_ckpt.fmt`). Manifests, the metadata JSON and the
commit marker are signed with the job token (:mod:`hp.tiered_ckpt.signed`): a reader trusts sizes and
CRCs only once the commit marker's signature and the digests it pins check out, so resuming from
this tier needs the token of the job that wrote it.

Credentials and the S3 endpoint come from the usual AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``): hp never carries secrets in its messages.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import dataclass, field

import fsspec

from hp.tiered_ckpt import fmt, signed

_CHUNK = 32 << 20
TIMEOUT_ENV = "HP_CKPT_S3_TIMEOUT"  # seconds before an unanswered S3 request is retried


def _session_without_expect_100():
    """aiohttp waits for a "100 Continue" with no timeout at all: against a hung endpoint a
    PUT would block forever instead of timing out and being retried. botocore adds the
    ``Expect`` header to every S3 PUT with a body; this session does not."""
    import aiobotocore.session
    from botocore.handlers import add_expect_header

    session = aiobotocore.session.AioSession()
    session.unregister("before-call.s3", add_expect_header)
    return session


def open_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, root path) for ``url``. S3 timeouts are short so that an outage is noticed and
    retried by hp's backoff instead of hanging an upload for minutes inside botocore."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    opts: dict = {}
    if protocol == "s3":
        timeout = float(os.environ.get(TIMEOUT_ENV, "20"))
        opts = {"config_kwargs": {"connect_timeout": min(timeout, 5), "read_timeout": timeout,
                                  "retries": {"max_attempts": 1, "mode": "standard"}},
                "skip_instance_cache": True, "session": _session_without_expect_100()}
    elif protocol in ("file", "local"):
        opts = {"auto_mkdir": True}
    fs, root = fsspec.core.url_to_fs(url, **opts)
    if protocol == "s3":
        fs.retries = 1  # hp backs off and retries; s3fs's own loop (5 by default, with sleeps) would hide an outage from hp's backoff
    return fs, root.rstrip("/")


@dataclass
class PersistentTier:
    """Reads and writes checkpoints of one namespace under one fsspec URL."""

    url: str
    namespace: str
    token: str = field(repr=False)

    def __post_init__(self) -> None:
        self.fs, self.root = open_fs(self.url)
        self.base = f"{self.root}/{self.namespace}"

    def path(self, step: int, name: str = "") -> str:
        return f"{self.base}/{fmt.step_dir(step)}" + (f"/{name}" if name else "")

    # --- writing (the node daemon's persister) --------------------------------------------------
    def put_bytes(self, step: int, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(step, name), bytes(data))

    def put_file(self, step: int, name: str, local_path: str, nbytes: int) -> None:
        """Stream the first ``nbytes`` of a local (shared-memory) file to the tier."""
        with open(local_path, "rb") as src, self.fs.open(self.path(step, name), "wb", block_size=_CHUNK) as f:
            for chunk in fmt.chunks(src, nbytes, _CHUNK):
                f.write(chunk)

    def put_signed(self, step: int, name: str, doc: dict) -> None:
        self.put_bytes(step, name, signed.dumps(self.token, doc))

    def exists(self, step: int, name: str) -> bool:
        return self.fs.exists(self.path(step, name))

    def read_signed(self, step: int, name: str) -> tuple[dict, bytes]:
        """(verified document, its exact bytes); FileNotFoundError, or SignatureError."""
        raw = self.fs.cat_file(self.path(step, name))
        return signed.loads(self.token, raw, f"step {step} {name}"), raw

    def uncommit(self, step: int, save_id: str) -> None:
        """Before (re)uploading anything of ``save_id``: a commit marker of another save of the same
        step goes first, so that the step is not listed complete while its files change."""
        try:
            doc, _ = self.read_signed(step, fmt.COMMIT)
            if doc.get("save_id") == save_id:
                return
        except FileNotFoundError:
            return
        except signed.SignatureError:
            pass
        self.fs.rm_file(self.path(step, fmt.COMMIT))

    def commit(self, step: int, world: int, save_id: str) -> None:
        """Write the commit marker once every rank's manifest and the metadata are there, signed, and
        of ``save_id``; it pins their digests. :class:`NotCommittable` (a FileNotFoundError: the
        committer waits) while some are missing or still of another save."""
        pinned, waiting = {}, []
        for name in [fmt.rank_manifest(r) for r in range(world)] + [fmt.META_JSON]:
            try:
                doc, raw = self.read_signed(step, name)
            except (FileNotFoundError, signed.SignatureError):
                waiting.append(name)  # not uploaded yet, or a leftover this save's upload will replace
                continue
            if doc.get("save_id") != save_id:
                waiting.append(name)
            else:
                pinned[name] = signed.digest(raw)
        if waiting:
            raise NotCommittable(f"step {step}: {', '.join(waiting[:4])}{' ...' if len(waiting) > 4 else ''} "
                                 f"not uploaded yet for save {save_id}")
        self.put_signed(step, fmt.COMMIT, {"step": step, "world": world, "save_id": save_id,
                                            "time": time.time(), "digests": pinned})

    # --- reading ---------------------------------------------------------------------------------
    def commits(self) -> dict[int, dict | None]:
        """Every step directory → its commit marker, verified (None: none, or one that fails its
        signature: such a step is not complete)."""
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[int, dict | None] = {}
        for e in entries:
            step = fmt.parse_step_dir(e)
            if step is not None:
                try:
                    out[step] = self.read_signed(step, fmt.COMMIT)[0]
                except (FileNotFoundError, signed.SignatureError):
                    out[step] = None
        return out

    def steps(self) -> dict[int, bool]:
        """Every step directory → whether it holds a verified commit marker."""
        return {s: doc is not None for s, doc in self.commits().items()}

    def committed(self) -> list[int]:
        return sorted(s for s, ok in self.steps().items() if ok)

    def manifest(self, step: int, save_id: str | None = None) -> tuple[dict, dict[int, dict]]:
        """(metadata JSON, rank → file manifest) of a committed step (of ``save_id`` if given), each
        checked against the digest its commit marker pins; :class:`~hp.tiered_ckpt.signed.SignatureError`
        when one does not match."""
        commit, _ = self.read_signed(step, fmt.COMMIT)
        if save_id is not None and commit.get("save_id") != save_id:
            raise signed.SignatureError(f"step {step}: committed save is {commit.get('save_id')}, not {save_id}")
        pins = commit["digests"]

        def pinned(name: str) -> dict:
            raw = self.fs.cat_file(self.path(step, name))
            if signed.digest(raw) != pins.get(name):
                raise signed.SignatureError(f"step {step} {name}: not the file its commit marker pins "
                                            f"(of another save, or altered)")
            return json.loads(raw)

        files = {r: pinned(fmt.rank_manifest(r)) for r in range(int(commit["world"]))}
        return pinned(fmt.META_JSON), files

    def fetch(self, step: int, rank: int, offset: int, length: int) -> bytes:
        return self.fs.cat_file(self.path(step, fmt.rank_file(rank)), start=offset, end=offset + length)

    def size_problems(self, step: int) -> list[str]:
        """A committed step whose files are not the sizes its manifests say (truncated, missing):
        what ``hp ckpt ls`` checks without reading the data (``verify`` reads it all)."""
        problems = []
        try:
            _, files = self.manifest(step)
        except (OSError, ValueError, KeyError, TypeError, signed.SignatureError) as e:
            return [f"step {step}: unreadable commit marker or manifest: {type(e).__name__}: {e}"]
        for rank, man in files.items():
            name = fmt.rank_file(rank)
            try:
                size = self.fs.size(self.path(step, name))
            except FileNotFoundError:
                problems.append(f"step {step}: {name} missing")
                continue
            if size != man["nbytes"]:
                problems.append(f"step {step}: {name} is {size} bytes, expected {man['nbytes']} (truncated?)")
        return problems

    def verify(self, step: int) -> list[str]:
        """Problems found re-reading a step: missing marker, size or per-item CRC mismatches."""
        problems: list[str] = []
        if not self.exists(step, fmt.COMMIT):
            return [f"step {step}: no commit marker (incomplete upload)"]
        try:
            self.read_signed(step, fmt.COMMIT)
        except signed.SignatureError as e:
            return [f"unreadable commit marker: {e}"]
        try:
            meta, files = self.manifest(step)
            byte_items = {(path, off, n): fqn for fqn, _, _, path, off, n in meta["storage_data"]
                          if meta["state_dict_metadata"].get(fqn, {}).get("kind") == "bytes"}
        except (OSError, ValueError, KeyError, TypeError, signed.SignatureError) as e:  # bad commit, manifest, metadata
            return [f"step {step}: unreadable commit marker, manifest or metadata: {type(e).__name__}: {e}"]
        for rank, man in files.items():
            name = fmt.rank_file(rank)
            try:
                data = self.fs.cat_file(self.path(step, name))
            except FileNotFoundError:
                problems.append(f"step {step}: {name} missing")
                continue
            if len(data) != man["nbytes"]:
                problems.append(f"step {step}: {name} is {len(data)} bytes, expected {man['nbytes']} (truncated?)")
            for off, n, crc in man["items"]:
                if zlib.crc32(data[off:off + n]) != crc:
                    problems.append(f"step {step}: {name} item at {off}+{n}: checksum mismatch")
            for (path, off, n), fqn in byte_items.items():
                if path == name and len(data) >= off + n:
                    try:
                        fmt.load_bytes_item(data[off:off + n], fqn)
                    except (fmt.UnsafeItemError, ValueError) as e:
                        problems.append(f"step {step}: {e}")
        return problems

    def remove(self, step: int) -> None:
        # the commit marker goes first, so a half-deleted step is never taken for complete
        try:
            self.fs.rm_file(self.path(step, fmt.COMMIT))
        except FileNotFoundError:
            pass
        try:
            self.fs.rm(self.path(step), recursive=True)
        except FileNotFoundError:
            pass

    def gc(self, keep: int) -> list[int]:
        """Keep the newest ``keep`` committed steps; drop older steps (committed or abandoned)."""
        steps = self.steps()
        kept = sorted((s for s, ok in steps.items() if ok), reverse=True)[:max(keep, 0)]
        if not kept:
            return []
        oldest_kept = min(kept)
        gone = [s for s in steps if s < oldest_kept]
        for s in gone:
            self.remove(s)
        return sorted(gone)


class NotCommittable(FileNotFoundError):
    """Some manifest (or the metadata) of the save being committed is not in the tier yet."""
