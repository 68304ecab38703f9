"""The checkpoint format: standard DCP files plus hp's JSON sidecars.

A step directory holds what ``FileSystemWriter`` would write (``__<rank>_0.distcp`` files whose
tensor items are ``torch.save`` images, and the pickled ``.metadata``) so that plain
``torch.distributed.checkpoint.load`` reads it, plus:

- ``hp_metadata.json``: the same DCP ``Metadata`` as JSON, which is what hp's reader uses (hp never
  unpickles bytes that came from another machine);
- ``hp_rank<r>.json``: per file, its size and every item's (offset, length, crc32), and the save id;
- ``hp_COMMIT``: written last, once every manifest is of the same save; it pins their digests and a
  step without a valid one is never loaded.

The three JSON files are signed with the job token (:mod:`hp.tiered_ckpt.signed`).

Non-tensor items (ints, optimizer ``param_groups``, scheduler state) are DCP's: ``torch.save``
pickles. DCP's own load planner unpickles them with ``weights_only=False``, which runs whatever a
rewritten item names; hp decodes each with ``weights_only=True`` first (:func:`load_bytes_item`: plain
Python values and tensors only) and refuses, naming the item, what would need more. Plain
``dcp.load`` of the same directory trusts the storage: use it only on storage you trust.

Tensor items are laid out so that the training process only copies tensor bytes: the
``torch.save`` image of a tensor of a given dtype and shape is the same bytes around the data
whatever the values, so the image's prefix and suffix are built once and reused (CRC32 fields of
the zip are left 0; ``torch.load`` does not check them, hp's own per-item CRC does the checking).
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
from dataclasses import dataclass

from hp.core.errors import HpError

COMMIT = "hp_COMMIT"
META_JSON = "hp_metadata.json"
DCP_METADATA = ".metadata"
ALIGN = 64  # torch.save aligns record data to 64 bytes; keep item starts aligned too


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def rank_manifest(rank: int) -> str:
    return f"hp_rank{rank}.json"


def step_dir(step: int) -> str:
    return f"step_{step:010d}"


def parse_step_dir(name: str) -> int | None:
    name = name.rstrip("/").rsplit("/", 1)[-1]
    if name.startswith("step_") and name[5:].isdigit():
        return int(name[5:])
    return None


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorImage:
    """``torch.save`` bytes of a tensor of one dtype/shape, split around its raw data."""

    prefix: bytes
    nbytes: int
    suffix: bytes

    @property
    def size(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)


@functools.lru_cache(maxsize=4096)
def tensor_image(dtype_name: str, shape: tuple[int, ...]) -> TensorImage:
    import torch
    from torch.utils.serialization import config

    dtype = getattr(torch, dtype_name)
    old = config.save.compute_crc32
    config.save.compute_crc32 = False  # values change every save; our per-item CRC covers them
    try:
        buf = io.BytesIO()
        # meta-free placeholder: empty() allocates but does not touch the pages it will not need
        torch.save(torch.empty(shape, dtype=dtype), buf)
    finally:
        config.save.compute_crc32 = old
    raw = buf.getbuffer()
    zf = zipfile.ZipFile(io.BytesIO(raw))
    data = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
    if len(data) != 1:
        raise RuntimeError(f"unexpected torch.save layout: {[i.filename for i in zf.infolist()]}")
    info = data[0]
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return TensorImage(bytes(raw[:start]), info.file_size, bytes(raw[start + info.file_size:]))


class UnsafeItemError(HpError):
    """A checkpoint item that only a full unpickler could load (it names code to run): refused."""


def load_bytes_item(data: bytes, fqn: str):
    """A non-tensor item's value, decoded without running anything it names (``weights_only=True``).

    Raises :class:`UnsafeItemError` naming ``fqn`` when the bytes need more than plain Python values
    and tensors, and ``ValueError`` when they are no ``torch.save`` image at all."""
    import pickle

    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        what = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UnsafeItemError(f"checkpoint item {fqn!r} would need unpickling arbitrary objects, refused "
                              f"(hp loads tensors and plain Python values only): {what}") from None
    except Exception as e:  # noqa: BLE001  a torn or foreign item: corrupt, not unsafe
        raise ValueError(f"checkpoint item {fqn!r} is not a torch.save image: {type(e).__name__}: {e}") from None


# --- DCP Metadata <-> JSON (so that reading never needs pickle) --------------------------------

def _size(s) -> list[int]:
    return [int(x) for x in s]


def metadata_to_json(md) -> dict:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    sdm = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            sdm[fqn] = {"kind": "tensor", "dtype": str(p.dtype).removeprefix("torch."),
                        "requires_grad": bool(p.requires_grad), "size": _size(m.size),
                        "chunks": [[_size(c.offsets), _size(c.sizes)] for c in m.chunks]}
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"kind": "bytes"}
        else:
            raise TypeError(f"unsupported DCP storage metadata for {fqn!r}: {type(m).__name__}")
    storage = [[idx.fqn, None if idx.offset is None else _size(idx.offset), idx.index,
                info.relative_path, info.offset, info.length]
               for idx, info in (md.storage_data or {}).items()]
    planner = md.planner_data
    if planner is not None:
        planner = {k: list(v) for k, v in planner.items()}
    return {"state_dict_metadata": sdm, "storage_data": storage, "planner_data": planner,
            "version": md.version}


def metadata_from_json(obj: dict):
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
        TensorProperties, TensorStorageMetadata,
    )

    sdm = {}
    for fqn, m in obj["state_dict_metadata"].items():
        if m["kind"] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        dtype = getattr(torch, m["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad dtype {m['dtype']!r} for {fqn!r}")
        sdm[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=m["requires_grad"]),
            size=torch.Size(m["size"]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in m["chunks"]])
    storage = {MetadataIndex(fqn, None if off is None else torch.Size(off), index): _StorageInfo(path, o, n)
               for fqn, off, index, path, o, n in obj["storage_data"]}
    planner = obj.get("planner_data")
    if planner is not None:
        planner = {k: tuple(v) for k, v in planner.items()}
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(), version=obj.get("version"))


def item_key(offset: int, length: int) -> str:
    return f"{offset}:{length}"


def chunks(src, nbytes: int, size: int = 8 << 20):
    """The first ``nbytes`` of the open binary file ``src`` in chunks of at most ``size`` bytes; a file
    that ends early raises OSError (a staging slot must hold what its seal announced)."""
    left = nbytes
    while left:
        chunk = src.read(min(size, left))
        if not chunk:
            raise OSError(f"{getattr(src, 'name', 'file')} ended with {left} of {nbytes} bytes unread")
        yield chunk
        left -= len(chunk)
