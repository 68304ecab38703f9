"""The one place where a worker works around torch process-group behaviour it cannot change.

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
from typing import Any

_kept: list[Any] = []
_original: Any = None  # torch's destroy_process_group, once wrapped


def _release_kept_groups() -> None:
    """Drop the held groups while the interpreter is whole (at exit: the GIL is released in their destructor)."""
    while _kept:
        _kept.pop()


def keep_destroyed_groups_until_exit() -> None:
    """Wrap ``torch.distributed.destroy_process_group`` in this process (once; before the script runs)."""
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
