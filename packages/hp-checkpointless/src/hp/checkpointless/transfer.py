"""Moving a training state between ranks over the process group: point to point (a replacement pulls it
from a healthy peer), one to many, and the small fixed-size messages around them (offers, flags).

What travels and how it is framed and checked is :mod:`hp.checkpointless.state`'s; here each frame is
bound to a torch.distributed send, receive or broadcast. Ranks are global ranks, as torch.distributed
takes them. A send's or a receive's wait is bounded by the group's collective timeout
(:func:`hp.core.pg.collective_timeout`): gloo fixes their default at init, and a group formed with a short
connect bound (``group.CONNECT_TIMEOUT``) would time them out by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from hp.checkpointless.state import (DEFAULT_MAX_BYTES, Op, StateBuffer, StateTransferError, encode, move, receive,
                                     transmit)
from hp.core import pg

__all__ = ["broadcast_state", "from_peer", "recv_state", "recv_tensor", "send_state", "send_tensor"]


def send_state(state: Mapping[str, Any], dst: int, group: Any = None, *,
               buffer: StateBuffer | None = None, in_place: torch.Tensor | None = None) -> None:
    """Send `state` to rank `dst` in 3 messages; pass a kept `buffer` to avoid re-faulting pages. With
    ``in_place`` (the receiver's buffer in shared memory, :mod:`hp.checkpointless.shm`; it must hold
    :func:`wire_nbytes` of the state) the flat buffer is packed there and 2 messages are sent."""
    frames = encode(state, buffer, in_place)
    transmit(frames, lambda t: dist.isend(t, dst, group=group).wait(pg.collective_timeout(group)), dst)


@contextlib.contextmanager
def from_peer(peer: int, what: str) -> Iterator[None]:
    """Using a state a peer sent (its tensors checked by :func:`recv_state`, its structure not): a message
    without the fields or types the code reads is a :class:`StateTransferError` (the re-form is retried),
    never a crash of the receiver."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise StateTransferError(f"rank {peer} sent a malformed {what}: {type(e).__name__}: {e}") from None


def send_tensor(t: torch.Tensor, dst: int, group: Any = None) -> None:
    """One small fixed-size message (an offer, a flag) to rank ``dst``, waited on with the group's timeout."""
    move(lambda x: dist.isend(x, dst, group=group).wait(pg.collective_timeout(group)), t, "message", dst)


def recv_tensor(t: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """Receive into ``t`` what :func:`send_tensor` sent; returns ``t``."""
    move(lambda x: dist.irecv(x, src, group=group).wait(pg.collective_timeout(group)), t, "message", src)
    return t


def recv_state(src: int, template: Mapping[str, Any] | None = None, group: Any = None, *,
               buffer: StateBuffer | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Receive a state sent by `send_state` from rank `src`; raises StateTransferError, never partial.

    Without `template` the returned tensors are views into one receive buffer (`buffer`'s if given and
    big enough; it is overwritten by every receive, even a failed one). With `template` (same structure)
    its tensors are overwritten in place, only after every check passed, and returned.
    """
    return receive(lambda t: dist.irecv(t, src, group=group).wait(pg.collective_timeout(group)), src, template,
                   buffer, max_bytes)


def broadcast_state(state: Mapping[str, Any] | None, src: int, group: Any = None, *,
                    template: Mapping[str, Any] | None = None, buffer: StateBuffer | None = None,
                    max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """1->many with the same 3-message framing; every rank of `group` calls it. `src` gets `state` back."""
    op: Op = lambda t: dist.broadcast(t, src, group=group)  # noqa: E731
    if dist.get_rank() == src:
        if state is None:
            raise ValueError("the source rank must pass a state")
        transmit(encode(state, buffer), op, src)
        return dict(state)
    return receive(op, src, template, buffer, max_bytes)
