"""DCP ``StorageWriter`` of the memory tier: the training process only copies tensor bytes.

``write_data`` lays the rank's items out as one ``.distcp`` file (tensor items as ``torch.save``
images whose fixed prefix/suffix are written once per slot and reused), copies every tensor into
the staging slot the node daemon handed out (a ``/dev/shm`` file mapped once and kept mapped), and
seals it. Checksums, replication and upload happen in the daemon.

The coordinator gives the save an id (:func:`hp.tiered_ckpt.signed.new_save_id`) in
``prepare_global_plan``; DCP hands each rank its plan with it (``SavePlan.storage_data``, as
``FileSystemWriter`` does with its file prefixes), and every seal and the commit carry it.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
from torch.futures import Future

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from hp.core.privfs import open_private
from hp.tiered_ckpt import fmt, signed
from hp.tiered_ckpt.client import DaemonClient
from hp.tiered_ckpt.config import TieredConfig


class _Mapping:
    """A staging file kept mapped across saves (re-mapping would page-fault every save)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_private(path, os.O_RDWR)  # the daemon's slot: ours, never a symlink
        st = os.fstat(self.fd)
        self.size, self.ino = st.st_size, st.st_ino
        self.mm = mmap.mmap(self.fd, self.size)
        self.layout: tuple | None = None  # signature of the prefixes/suffixes written in place

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)


_MAPPINGS: dict[str, _Mapping] = {}


def _mapping(path: str) -> _Mapping:
    m = _MAPPINGS.get(path)
    st = os.stat(path)
    if m is not None and (st.st_size != m.size or st.st_ino != m.ino):  # grown, or a new daemon's file
        m.close()
        m = None
    if m is None:
        m = _MAPPINGS[path] = _Mapping(path)
    return m


_CLIENTS: dict[tuple, DaemonClient] = {}


def _client(cfg: TieredConfig) -> DaemonClient:
    key = (cfg.daemon_addr(), cfg.token)
    if key not in _CLIENTS:
        _CLIENTS[key] = DaemonClient(*key)
    return _CLIENTS[key]


def mapped_slots() -> list[str]:
    """The daemon's slot files this process has mapped (and keeps mapped across saves)."""
    return list(_MAPPINGS)


def release(shm_dir: str, cfg: TieredConfig) -> None:
    """Unmap this process's slot files under ``shm_dir`` and close its connection to ``cfg``'s daemon: a daemon
    that is gone (a benchmark's, a test's) otherwise stays mapped in /dev/shm until this process exits."""
    for path in [p for p in _MAPPINGS if p.startswith(f"{shm_dir}/")]:
        _MAPPINGS.pop(path).close()
    client = _CLIENTS.pop((cfg.daemon_addr(), cfg.token), None)
    if client is not None:
        client.close()


class TieredWriter(StorageWriter):
    def __init__(self, cfg: TieredConfig, step: int, persist: bool | None = None) -> None:
        super().__init__()
        self.cfg, self.step = cfg, step
        self.persist = (step % cfg.persist_every == 0) if persist is None else persist
        self.client = _client(cfg)
        self.rank, self.world, self.is_coordinator = 0, 1, True
        self.save_id = ""  # set by the coordinator's prepare_global_plan

    def reset(self, checkpoint_id=None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0) or 0
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self.save_id = signed.new_save_id()
        return [dataclasses.replace(p, storage_data=self.save_id) for p in plans]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"{self.cfg.namespace}/{fmt.step_dir(self.step)}")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        tensors, blobs = [], []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                blobs.append((item, data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)))
            else:
                t = data.detach()  # a GPU tensor is copied device -> staging directly by copy_ below
                tensors.append((item, t, fmt.tensor_image(str(t.dtype).removeprefix("torch."), tuple(t.shape))))
        # fixed part first (tensor images), then the variable-size byte items
        offset, placed = 0, []
        for item, t, img in tensors:
            placed.append((item, offset, img.size))
            offset = fmt.align(offset + img.size)
        for item, buf in blobs:
            placed.append((item, offset, len(buf)))
            offset = fmt.align(offset + len(buf))
        size = max(offset, fmt.ALIGN)
        path = self.client.slot(self.cfg.namespace, self.rank, self.step, size)
        m = _mapping(path)
        signature = tuple((o, img.prefix[-64:], len(img.prefix), img.nbytes)
                          for (_, o, _), (_, _, img) in zip(placed, tensors))
        if m.layout != signature:  # first save into this slot (or the model changed): write headers
            for (_, o, _), (_, _, img) in zip(placed, tensors):
                m.mm[o:o + len(img.prefix)] = img.prefix
                end = o + len(img.prefix) + img.nbytes
                m.mm[end:end + len(img.suffix)] = img.suffix
            m.layout = signature
        for (_, o, _), (_, t, img) in zip(placed, tensors):
            if img.nbytes:
                dst = torch.frombuffer(m.mm, dtype=t.dtype, count=t.numel(), offset=o + len(img.prefix))
                dst.view(t.shape).copy_(t)
        for (_, o, n), (_, buf) in zip(placed[len(tensors):], blobs):
            m.mm[o:o + n] = buf
        spans = [[o, n] for _, o, n in placed]
        url = self.cfg.persist_url if self.persist else None
        if not signed.is_save_id(plan.storage_data):
            raise RuntimeError(f"the save plan carries no save id (storage_data={plan.storage_data!r})")
        self.client.seal(self.cfg.namespace, self.rank, self.step, self.world, path, size, spans, url,
                         plan.storage_data)
        name = fmt.rank_file(self.rank)
        results = [WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(name, o, n))
                   for item, o, n in placed]
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = "1.0.0"
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        metadata.storage_meta = self.storage_meta()
        # pickled here, by the process that built the object, for plain-DCP readers of the
        # persistent tier (only steps that get persisted need it); hp itself reads the JSON form
        url = self.cfg.persist_url if self.persist else None
        blob = pickle.dumps(metadata) if url else b""
        self.client.commit(self.cfg.namespace, self.step, self.world, fmt.metadata_to_json(metadata), blob, url,
                           self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False
