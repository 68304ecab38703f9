"""What a training state is on the wire: its layout in one flat checksummed buffer, its framing, and its
capture from (and restore into) live objects. :mod:`hp.checkpointless.transfer` moves it between ranks.

A replacement rank pulls the full training state from a healthy peer:

* 3 messages (int64 header, JSON skeleton, ONE flat uint8 buffer) whatever the tensor count, so the
  per-message cost does not scale with the hundreds of small tensors of an optimizer state.
* Structure travels as JSON, never pickle: a recovering process must not execute bytes a peer sent.
* Everything is checksummed and validated before use: a restored-but-wrong state silently corrupts
  training, which is worse than a failed recovery. No partial state is ever returned.
* Buffers can be allocated once and reused (`StateBuffer`, `buffer=`, `template=`): page faults into
  fresh memory cost several times the copy itself (INFRA.md "Measured floors").

The framing here runs over any :data:`Op` (a function that sends or fills one tensor); which rank and
which process group it talks to is :mod:`hp.checkpointless.transfer`'s. After a header-level error (magic,
version, header CRC, size) the receiver cannot know how much to drain: re-form the group. Payload-level
errors (checksums, skeleton, template mismatch) are raised after all 3 messages were consumed: the group
stays usable.
"""

from __future__ import annotations

import json
import math
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hp.checkpointless.rng import capture_rng, restore_rng

__all__ = ["DEFAULT_MAX_BYTES", "Op", "StateBuffer", "StateTransferError", "capture", "checksum", "encode",
           "flatten", "move", "receive", "restore", "transmit", "unflatten", "wire_nbytes"]

MAGIC = int.from_bytes(b"HPSTATE1", "big")
VERSION = 2  # 2: the header's CRC covers its flags (IN_PLACE)
IN_PLACE = 1  # header flag: the buffer is already in the receiver's memory (hp.checkpointless.shm), not on the wire
ALIGN = 8  # every tensor starts at a multiple of max(ALIGN, itemsize) so dtype views need no copy
DEFAULT_MAX_BYTES = 64 << 30  # a header announcing more is rejected before anything is allocated
MAX_JSON_BYTES = 256 << 20  # ~100 bytes per tensor: millions of tensors still fit
_HEADER_LEN = 8  # magic, version, json_len, buf_len, json_crc, buf_crc, header_crc, reserved
Spec = tuple[str, torch.dtype, tuple[int, ...]]  # (path in the state, dtype, shape)


class StateTransferError(RuntimeError):
    """A transfer failed or delivered something unusable (corrupt, truncated, mismatched, peer died)."""


def _alloc(nbytes: int) -> torch.Tensor:
    """Every receive-side allocation goes through here, so tests can prove a bad header allocates nothing."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):  # the name came from a peer: never getattr anything but a dtype
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def flatten(state: Mapping[str, Any]) -> tuple[dict, list[torch.Tensor]]:
    """Split a nested state into a JSON-able skeleton and its tensors, in skeleton order.

    Dict keys carry a type tag ("s:name", "i:3") because optimizer state dicts key parameters by int and
    JSON would silently turn them into strings; tuples become {"__tuple__": [...]} for the same reason.
    Tagged keys also mean a user dict can never be mistaken for a {"__tensor__": i, ...} placeholder.
    """
    tensors: list[torch.Tensor] = []

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided or obj.is_quantized:
                raise TypeError(f"{path or '/'}: only dense tensors can be shipped, got {obj.layout}")
            tensors.append(obj)
            return {"__tensor__": len(tensors) - 1, "dtype": str(obj.dtype).removeprefix("torch."),
                    "shape": list(obj.shape)}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"{path or '/'}: dict key {k!r} is not str or int")
                out[("s:" if isinstance(k, str) else "i:") + str(k)] = enc(v, f"{path}/{k}")
            return out
        if isinstance(obj, (list, tuple)):
            items = [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return {"__tuple__": items} if isinstance(obj, tuple) else items
        raise TypeError(f"{path or '/'}: cannot ship {type(obj).__name__} without pickling")

    return enc(state, ""), tensors


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Inverse of `flatten`: tuples come back as tuples, int keys as ints, tensors by index (not copied)."""

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if isinstance(node, dict):
            if "__tensor__" in node:
                return tensors[node["__tensor__"]]
            if "__tuple__" in node:
                return tuple(dec(v) for v in node["__tuple__"])
            return {_key(k): dec(v) for k, v in node.items()}
        return node

    return dec(skeleton)


def _key(tag: str) -> str | int:
    if tag[:2] not in ("s:", "i:"):
        raise ValueError(f"untagged dict key {tag!r} in skeleton")
    return tag[2:] if tag[0] == "s" else int(tag[2:])


def _tensor_specs(skeleton: Any) -> list[Spec]:
    """(path, dtype, shape) per tensor index; validates placeholders since skeletons arrive from peers."""
    found: dict[int, Spec] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, dict) and "__tensor__" in node:
            i, shape = node["__tensor__"], node.get("shape")
            if (not isinstance(i, int) or i in found or not isinstance(shape, list)
                    or not all(isinstance(s, int) and s >= 0 for s in shape)):
                raise ValueError(f"bad tensor placeholder at {path or '/'}: {node}")
            found[i] = (path, _dtype(node.get("dtype")), tuple(shape))
        elif isinstance(node, dict):
            for k, v in (enumerate(node["__tuple__"]) if "__tuple__" in node else node.items()):
                walk(v, f"{path}/{k}")

    walk(skeleton, "")
    if sorted(found) != list(range(len(found))):
        raise ValueError("tensor indices in skeleton are not 0..n-1")
    return [found[i] for i in range(len(found))]


def _layout(specs: Sequence[Spec]) -> tuple[list[int], int]:
    """Aligned byte offsets and total size (at least ALIGN, so the buffer message is never empty)."""
    offsets, pos = [], 0
    for _, dt, shape in specs:
        a = max(ALIGN, dt.itemsize)
        pos = -(-pos // a) * a
        offsets.append(pos)
        pos += math.prod(shape) * dt.itemsize
    return offsets, max(ALIGN, -(-pos // ALIGN) * ALIGN)


def wire_nbytes(state: Mapping[str, Any]) -> int:
    """Size of the flat buffer `state` travels in: what a receiver can allocate (and fault in) ahead."""
    return _layout(_tensor_specs(flatten(state)[0]))[1]


class StateBuffer:
    """All tensors of one state at aligned offsets in ONE contiguous uint8 tensor (`data`).

    One buffer means one message and one checksum pass. Storage is allocated once and kept by later
    `relayout`/`pack`/receives while it is large enough, so the page-fault cost of fresh memory is paid
    ahead of a failure (`prefault=True`), not during recovery. Never receive into a buffer whose views
    are still live state (e.g. restored optimizer moments): a receive overwrites it before validation.
    """

    def __init__(self, skeleton: Any, data: torch.Tensor | None = None, *, prefault: bool = False) -> None:
        """`data` (1-D contiguous uint8) is adopted as storage if big enough; else storage is allocated."""
        self.data = data if data is not None else torch.empty(0, dtype=torch.uint8)
        self.relayout(skeleton)
        if prefault:
            self.data.zero_()

    @classmethod
    def for_layout(cls, skeleton: Any, *, prefault: bool = False) -> StateBuffer:
        """Allocate once for `skeleton` (from `flatten`); prefault=True touches every page now."""
        return cls(skeleton, prefault=prefault)

    def relayout(self, skeleton: Any) -> None:
        """Adopt another layout, reallocating only when the current storage is too small."""
        self.specs = _tensor_specs(skeleton)
        self.offsets, self.nbytes = _layout(self.specs)
        if self.data.numel() < self.nbytes:
            self.data = _alloc(self.nbytes)
        ends = [o + math.prod(s) * dt.itemsize for (_, dt, s), o in zip(self.specs, self.offsets)]
        for start, stop in zip([0, *ends], [*self.offsets, self.nbytes]):
            self.data[start:stop].zero_()  # alignment gaps: no stale process memory goes on the wire

    @property
    def flat(self) -> torch.Tensor:
        """The bytes that go on the wire (`data` may have spare capacity past them)."""
        return self.data[: self.nbytes]

    def _views(self) -> list[torch.Tensor]:
        return [self.data[o: o + math.prod(s) * dt.itemsize].view(dt).view(s)
                for (_, dt, s), o in zip(self.specs, self.offsets)]

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy `tensors` (same count/dtype/shape as the layout) into the buffer; returns `flat`."""
        if len(tensors) != len(self.specs):
            raise ValueError(f"layout has {len(self.specs)} tensors, got {len(tensors)}")
        for (path, dt, shape), dst, src in zip(self.specs, self._views(), tensors):
            if src.dtype != dt or tuple(src.shape) != shape:
                raise ValueError(f"{path}: layout wants {dt}{list(shape)}, got {src.dtype}{list(src.shape)}")
            dst.copy_(src)
        return self.flat

    def unpack(self, copy: bool = False) -> list[torch.Tensor]:
        """Tensors in layout order: zero-copy VIEWS into `data` by default (the next pack or receive into
        this buffer overwrites them), or independent clones with copy=True."""
        views = self._views()
        return [v.clone() for v in views] if copy else views


def checksum(buf: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes: zlib.crc32 measured 1.5-3 GB/s on this 2-core box (100 MiB in 35-70 ms);
    CRCs of 8 MiB chunks on 2 threads were no faster, and cheaper sums miss swapped words."""
    t = buf.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(t.view(torch.uint8).numpy())


def _header(json_len: int, buf_len: int, json_crc: int, buf_crc: int, flags: int = 0) -> torch.Tensor:
    h = torch.tensor([MAGIC, VERSION, json_len, buf_len, json_crc, buf_crc, 0, flags], dtype=torch.int64)
    return _seal(h)


def _header_crc(h: torch.Tensor) -> int:
    return zlib.crc32(torch.cat([h[:6], h[7:]]).numpy().tobytes())


def _seal(h: torch.Tensor) -> torch.Tensor:
    h[6] = _header_crc(h)
    return h


def encode(state: Mapping[str, Any], buffer: StateBuffer | None = None,
           in_place: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The 3 wire messages for `state`: header, JSON skeleton bytes, flat buffer. With ``in_place`` (the
    receiver's shared buffer, large enough) the buffer is packed there and only the first 2 are sent."""
    skeleton, tensors = flatten(state)
    payload = json.dumps(skeleton, separators=(",", ":")).encode()
    meta = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    if in_place is not None:
        nbytes = _layout(_tensor_specs(skeleton))[1]
        if in_place.numel() < nbytes:  # StateBuffer would allocate a buffer of its own: not the receiver's
            raise StateTransferError(f"the receiver's buffer holds {in_place.numel()} bytes, the state needs {nbytes}")
        flat = StateBuffer(skeleton, in_place).pack(tensors)
        return [_header(len(payload), flat.numel(), zlib.crc32(payload), 0, IN_PLACE), meta]
    if buffer is None:
        buffer = StateBuffer(skeleton)
    else:
        buffer.relayout(skeleton)
    flat = buffer.pack(tensors)
    return [_header(len(payload), flat.numel(), zlib.crc32(payload), checksum(flat)), meta, flat]


Op = Callable[[torch.Tensor], Any]  # sends one tensor, or receives into it (transfer.py binds it to a group)


def move(op: Op, t: torch.Tensor, stage: str, peer: int) -> None:
    """``op(t)``, its failure surfaced as a :class:`StateTransferError` (callers catch one type)."""
    try:
        op(t)
    except RuntimeError as e:  # gloo: peer reset / timeout; surfaced as ours so callers catch one type
        raise StateTransferError(f"state transfer with rank {peer} failed in the {stage} message "
                                 f"(peer died or timed out?): {e}") from e


def transmit(frames: Sequence[torch.Tensor], op: Op, peer: int) -> None:
    """Send the frames of :func:`encode` with ``op``, in order."""
    for stage, t in zip(("header", "json", "buffer"), frames):
        move(op, t, stage, peer)


def receive(op: Op, peer: int, template: Mapping[str, Any] | None, buffer: StateBuffer | None,
            max_bytes: int) -> dict:
    """Receive with ``op`` what :func:`transmit` sent and check it all before anything is returned (never
    partial); ``template`` and ``buffer`` as :func:`hp.checkpointless.transfer.recv_state` takes them."""
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    move(op, header, "header", peer)
    magic, version, json_len, buf_len, json_crc, buf_crc, header_crc, flags = header.tolist()
    if magic != MAGIC:
        raise StateTransferError(f"bad magic {magic:#x} from rank {peer}: not an hp state stream")
    if version != VERSION:
        raise StateTransferError(f"rank {peer} speaks state wire version {version}, this is {VERSION}")
    if header_crc != _header_crc(header):
        raise StateTransferError(f"header checksum mismatch from rank {peer}: header corrupted")
    if not 0 < json_len <= MAX_JSON_BYTES or not 0 < buf_len <= max_bytes:
        raise StateTransferError(f"rank {peer} announced json_len={json_len}, buf_len={buf_len}: exceeds "
                                 f"limit ({MAX_JSON_BYTES}, max_bytes={max_bytes}); refusing to allocate")
    in_place = flags == IN_PLACE
    if flags not in (0, IN_PLACE) or (in_place and (buffer is None or buffer.data.numel() < buf_len)):
        raise StateTransferError(f"rank {peer} sent flags {flags} for {buf_len} bytes: not what this rank offered")
    meta = _alloc(json_len)
    move(op, meta, "json", peer)
    data = buffer.data if buffer is not None and buffer.data.numel() >= buf_len else _alloc(buf_len)
    if not in_place:  # in place: the sender packed it into our buffer before sending the header
        move(op, data[:buf_len], "buffer", peer)
    if zlib.crc32(meta.numpy()) != json_crc:
        raise StateTransferError(f"JSON skeleton checksum mismatch from rank {peer}: corrupted in transit")
    if not in_place and checksum(data[:buf_len]) != buf_crc:
        raise StateTransferError(f"buffer checksum mismatch from rank {peer}: corrupted in transit")
    try:
        skeleton = json.loads(meta.numpy().tobytes())
        specs = _tensor_specs(skeleton)
        unflatten(skeleton, [None] * len(specs))  # type: ignore[list-item]  # dry run: tags must decode
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:
        raise StateTransferError(f"malformed skeleton from rank {peer}: {e}") from e
    if _layout(specs)[1] != buf_len:  # checked before StateBuffer could allocate a bigger layout
        raise StateTransferError(f"skeleton needs {_layout(specs)[1]} bytes, header announced {buf_len}")
    if buffer is None:
        buffer = StateBuffer(skeleton, data)
    else:
        buffer.data = data
        buffer.relayout(skeleton)
    received = buffer.unpack()
    if template is None:
        return unflatten(skeleton, received)
    t_skel, t_tensors = flatten(template)
    mine = {p: (t, dt, s) for (p, dt, s), t in zip(_tensor_specs(t_skel), t_tensors)}
    theirs = {p for p, _, _ in specs}
    if theirs != set(mine):
        raise StateTransferError(f"template structure differs from the sender's: template lacks "
                                 f"{sorted(theirs - set(mine))[:5]}, has extra {sorted(set(mine) - theirs)[:5]}")
    for path, dt, shape in specs:
        if mine[path][1:] != (dt, shape):
            raise StateTransferError(f"template {path}: {mine[path][1]}{list(mine[path][2])} but sender "
                                     f"has {dt}{list(shape)} (dtype/shape mismatch)")
    for (path, _, _), src in zip(specs, received):  # all checks passed: only now touch the template
        mine[path][0].copy_(src)
    return unflatten(skeleton, [mine[p][0] for p, _, _ in specs])


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, extra: dict | None = None, scaler: Any = None) -> dict:
    """Everything a replacement needs to continue bit-identically. Model/optimizer tensors are the live
    ones (not copies), so the result is a valid `template` for an in-place
    :func:`hp.checkpointless.transfer.recv_state`."""
    sd = model.state_dict()
    rng = capture_rng()
    state = {"model": dict(sd), "model_meta": dict(getattr(sd, "_metadata", {}) or {}), "rng": rng,
             "extra": extra if extra is not None else {}}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if scaler is not None:  # torch.amp.GradScaler: floats and ints only
        state["scaler"] = scaler.state_dict()
    return state


def restore(state: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
            scheduler: Any = None, scaler: Any = None, adopt: bool = False) -> dict:
    """Load a `capture`d state (e.g. from :func:`hp.checkpointless.transfer.recv_state`) into live objects;
    returns its `extra`.

    ``adopt``: the received tensors are the receiver's to keep (views into its own receive buffer, as the
    optimizer keeps its state): each parameter of the same shape, dtype and device takes its received
    tensor as its data instead of a copy of it (the same ``Parameter`` object, hooks and optimizer
    references intact)."""
    sd = OrderedDict(state["model"])
    adopted = _adopt_parameters(model, sd) if adopt else set()
    meta = OrderedDict(state.get("model_meta", {}))
    sd = OrderedDict((k, v) for k, v in sd.items() if k not in adopted)
    sd._metadata = meta  # type: ignore[attr-defined]
    missing, unexpected = model.load_state_dict(sd, strict=not adopted)
    if adopted and (unexpected or set(missing) - adopted):
        raise KeyError(f"the state does not fit the model: missing {sorted(set(missing) - adopted)}, "
                       f"unexpected {sorted(unexpected)}")
    for obj, key in ((optimizer, "optimizer"), (scheduler, "scheduler"), (scaler, "scaler")):
        if obj is not None:
            if key not in state:
                raise KeyError(f"state has no {key!r} to restore")
            obj.load_state_dict(state[key])
    restore_rng(state["rng"])
    return dict(state.get("extra", {}))


def place_parameters(model: torch.nn.Module, data: torch.Tensor) -> int:
    """Move the model's parameters into ``data`` (a spare's receive buffer), each where a full state's
    parameter lands in it (the model's tensors come first in :func:`capture`'s order, so their offsets do
    not depend on the rest); their values are kept. A hydration into that buffer then writes the
    parameters in place and :func:`restore` adopts them without a copy, and the memory they had is freed
    now, not while the job waits. Returns how many moved (none of another device than ``data``'s)."""
    sd = model.state_dict()
    skeleton, _ = flatten({"model": sd})
    views = StateBuffer(skeleton, data).unpack() if data.numel() >= _layout(_tensor_specs(skeleton))[1] else []
    at = {name: view for name, view in zip(sd, views)}
    moved = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = at.get(name)
            if v is not None and type(p.data) is torch.Tensor and v.device == p.device and v.shape == p.shape:
                v.copy_(p)
                p.data = v
                moved += 1
    return moved


def _adopt_parameters(model: torch.nn.Module, sd: Mapping[str, Any]) -> set[str]:
    """The names of the parameters that took their received tensor as their data (see :func:`restore`)."""
    adopted = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            v = sd.get(name)
            if (isinstance(v, torch.Tensor) and type(p.data) is torch.Tensor and type(v) is torch.Tensor
                    and v.shape == p.shape and v.dtype == p.dtype and v.device == p.device):
                if v.data_ptr() != p.data_ptr() or v.stride() != p.stride():  # else: placed there already
                    p.data = v
                adopted.add(name)
    return adopted
