"""The one place where hp reaches into torch's private process-group API, and works around torch
process-group behaviour it cannot change (torchft keeps its c10d workarounds in one seam the same way).

Every function here names the torch private it uses, why no public API does the job, and the torch
version it was checked against. No other hp module names a torch private of the process-group API
(``packages/hp-core/tests/test_pg.py`` walks every hp module to check); ZeroRedundancyOptimizer's
privates have their own seam in :mod:`hp.checkpointless.sharded`. A torch upgrade re-checks this module,
and only this one. Nothing here imports torch at module level: :mod:`hp.core.worker_main` imports it
before the user's script imports torch.

**Destroyed groups are kept until the worker's exit.** A plain DDP script ends with
``dist.destroy_process_group()`` and returns from ``main()``; the DDP module is freed on return, and its
``Reducer``, whose Python binding does not release the GIL while it is destroyed, drops the last
reference to the gloo group. ``ProcessGroupGloo``'s destructor then joins its worker threads with the GIL
held. A worker thread still finishing the last gradient all-reduce needs the GIL to drop that work: the
work holds the backward pass's thread-local Python state (the ``contextvars`` context torch stashes for
every backward). Both wait forever: the script printed its last line and never exits. Measured on the
2-core box with two spinning processes beside it: ``hp run --nproc-per-node 4 examples/train_ddp.py``
hung in 3 of 10 runs, torchrun 0 of 20, spawn 0 of 12: the DDP module is freed at ``main()``'s return
only when ``torch._dynamo`` was imported before DDP was built, as hp's fork server preloads it (else a
reference cycle keeps DDP, and the group, past ``main``) (``gdb``: the main thread in ``~ProcessGroupGloo`` → ``thread::join`` under ``~Reducer``, the
``pt_gloo_runloop`` thread in ``take_gil`` under ``~AsyncWork`` → ``~ThreadLocalState``).

The cure is the order of the last two references: a group ``destroy_process_group`` removes is held here
until the worker's ``atexit``, where it is released from Python, whose ``ProcessGroup`` binding drops the
GIL for the destructor. The user's script and what ``destroy_process_group`` does are unchanged; only the
moment the group's threads are joined (and its sockets closed) moves to the exit. hp's own abort of a
failed generation must close the sockets at once (peers blocked on them are released that way): it calls
:func:`destroy_process_group_now`, torch's function unwrapped.
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

CHECKED_WITH = "2.13.0"  # the torch version every private below was read against

_kept: list[Any] = []
_original: Any = None  # torch's destroy_process_group, once wrapped


# ---- a worker's groups at exit ------------------------------------------------------------------------
def _release_kept_groups() -> None:
    """Drop the held groups while the interpreter is whole (at exit: the GIL is released in their destructor)."""
    while _kept:
        _kept.pop()


def keep_destroyed_groups_until_exit() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` in this process (once; before the script runs).

    Private: ``distributed_c10d._world.pg_map`` (every group the default one's destruction takes down; no
    public list of the groups a process has). Checked against torch 2.13.0."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if _original is not None:
        return
    original = _original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if dist.is_initialized() and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            everything = group is None or group is c10d.GroupMember.WORLD  # the default one and dist.new_group's
            _kept.extend(list(c10d._world.pg_map) if everything else [group])
        original(group)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    atexit.register(_release_kept_groups)


def destroy_process_group_now(group: Any = None) -> None:
    """torch's ``destroy_process_group``, never held: the group's threads are joined and its sockets closed
    now if nothing else holds it (hp's abort of a failed generation)."""
    from torch.distributed import distributed_c10d as c10d

    (_original or c10d.destroy_process_group)(group)


# ---- forming and aborting a generation's group ----------------------------------------------------------
def set_timeout(timeout: timedelta, group: Any = None) -> None:
    """Give the collectives of ``group`` (the default one: None) ``timeout``, after it was initialised
    with a shorter one to bound its first connect (:meth:`hp.core.transport.ProcessGroupTransport.init_timeout`).

    Private: ``distributed_c10d._set_pg_timeout``; ``init_process_group`` and ``new_group`` take one timeout
    for both and torch has no public setter. Checked against torch 2.13.0."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def forget_failed_group() -> None:
    """A failed init used up a group name (torch names groups by a process-wide counter that only
    destroying an *initialised* default group resets), so this process's next group would rendezvous
    under a name a fresh process does not use, and both would wait on each other's keys until timeout.

    Private: ``distributed_c10d._world.group_count``, set to 0 as ``destroy_process_group`` does; torch has
    no public reset. Checked against torch 2.13.0."""
    from torch.distributed import distributed_c10d

    distributed_c10d._world.group_count = 0


def abort_process_group() -> None:
    """Abort the default group's communicators (NCCL ones stuck in a kernel, which destroying would wait
    on forever).

    Private: ``distributed_c10d._abort_process_group``; torch has no public abort (``destroy`` waits).
    Checked against torch 2.13.0."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def collective_timeout(group: Any = None) -> timedelta:
    """The collective timeout of ``group`` (the default one: None) for a send's or a receive's wait: gloo
    fixes their default at init, and a group formed with a short connect bound would time them out by it.
    0 (the backend's default) where the group has no CPU backend. Raises where there is no default group.

    Privates: ``distributed_c10d._get_default_group`` (``dist.group.WORLD`` is None instead of raising),
    ``ProcessGroup._get_backend`` and its ``options._timeout``: torch has no public getter of a group's
    timeout. Checked against torch 2.13.0."""
    import torch
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except (RuntimeError, AttributeError):
        return timedelta(0)


# ---- process groups torch did not make (hp.checkpointless.mesh's StableGroup) -----------------------------
def record_group(group: Any, ranks: Sequence[int], inner: Any) -> None:
    """torch's bookkeeping of a group it did not make, as if it had: ``get_rank(group)`` (``ranks``: global
    ranks in group-rank order), and ``get_backend(group)`` (that of ``inner``, the group it forwards to),
    which torch's logging calls on the way out of a failed collective (without an entry it raises a
    ValueError of its own that hides the collective's error).

    Privates: ``distributed_c10d._world.pg_group_ranks`` and ``_world.pg_map``; torch only fills them for the
    groups ``new_group`` makes. Destroying the default group clears them. Checked against torch 2.13.0."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    c10d._world.pg_group_ranks[group] = {g: i for i, g in enumerate(ranks)}
    c10d._world.pg_map[group] = (dist.get_backend(inner), None)


def register_by_name(name: str, group: Any) -> None:
    """Register ``group`` under ``name`` where functional collectives and DTensor look groups up (once;
    again after the default group was destroyed, which clears the registry).

    Privates: ``distributed_c10d._resolve_process_group`` and ``_register_process_group``; torch has no
    public registry for a process group it did not create (torchft registers its reconfigurable groups the
    same way). Checked against torch 2.13.0."""
    from torch.distributed import distributed_c10d as c10d

    try:
        if c10d._resolve_process_group(name) is group:
            return
    except RuntimeError:  # not registered (yet, or no more since the last default group was destroyed)
        pass
    c10d._register_process_group(name, group)


def device_mesh_of(device_type: str, mesh: Any, names: Sequence[str], groups: Sequence[Any], rank: int) -> Any:
    """A ``DeviceMesh`` over ``groups`` (one per dimension, each with a ``group_name``), for ``rank``, made
    before any default group exists: what ``DeviceMesh.from_group`` does, which needs the default group.

    Privates: ``DeviceMesh(_init_backend=False, _rank=...)``, its ``_dim_group_names`` and ``_pg_registry``.
    Checked against torch 2.13.0."""
    from torch.distributed.device_mesh import DeviceMesh

    device_mesh = DeviceMesh(device_type, mesh, mesh_dim_names=tuple(names), _init_backend=False, _rank=rank)
    device_mesh._dim_group_names = [g.group_name for g in groups]
    device_mesh._pg_registry.update({g.group_name: g for g in groups})
    return device_mesh
