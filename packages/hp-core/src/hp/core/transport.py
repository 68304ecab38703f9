"""Transport backends: the collective process group of one generation (``gloo``, ``nccl``).

A transport builds the process group of generation ``g`` on a store namespaced by ``g`` (so a
rank of an older generation can never read or write the new group's rendezvous keys), and aborts
a group so that a rank blocked inside a collective is released.
"""

from __future__ import annotations

import glob
import os
from datetime import timedelta
from typing import TYPE_CHECKING

from hp.core import pg
from hp.core.backends.api import TransportBackend
from hp.core.errors import BackendUnavailableError
from hp.core.hookspecs import hookimpl

if TYPE_CHECKING:
    import torch.distributed as dist


def generation_prefix(generation: int) -> str:
    """Store prefix of every key that belongs to generation ``generation``."""
    return f"hp/g{generation}/"


class ProcessGroupTransport(TransportBackend):
    """What gloo and nccl share: a torch.distributed default group per generation on a prefixed store."""

    def init_process_group(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        generation: int,
        timeout: timedelta = timedelta(minutes=10),
        connect_timeout: timedelta | None = None,
    ) -> None:
        """Initialise the default process group of ``generation`` on a generation-prefixed store;
        its collectives time out after ``timeout``.

        ``connect_timeout`` bounds the wait for a peer that published its address and died before it
        connected (without it, gloo waits five times ``timeout``). Pass it only with a store whose
        waits keep their own bound (gloo hands them the shorter init timeout) and make point-to-point
        waits pass their own timeout (``Work.wait(timeout)``): gloo fixes their default at init."""
        import torch.distributed as dist

        self.check_available()
        init_timeout = self.init_timeout(timeout, connect_timeout)
        try:
            dist.init_process_group(
                self.torch_backend,
                store=dist.PrefixStore(generation_prefix(generation), store),
                rank=rank,
                world_size=world_size,
                timeout=init_timeout,
            )
        except BaseException:
            if not dist.is_initialized():
                pg.forget_failed_group()
            raise
        if init_timeout != timeout:
            pg.set_timeout(timeout)  # the group's collectives get ``timeout``

    def new_subgroup(self, ranks: list[int], timeout: timedelta = timedelta(minutes=10),
                     connect_timeout: timedelta | None = None) -> dist.ProcessGroup:
        """A process group of ``ranks`` inside the current default group (one dimension of a device
        mesh), formed by its members only and on the default group's generation-prefixed store; the
        same bounds as :meth:`init_process_group`. Destroying the default group destroys it too."""
        import torch.distributed as dist

        init_timeout = self.init_timeout(timeout, connect_timeout)
        group = dist.new_group(sorted(ranks), timeout=init_timeout, backend=self.torch_backend,
                               use_local_synchronization=True)
        if init_timeout != timeout:
            pg.set_timeout(timeout, group)
        return group

    def abort(self) -> None:
        """Tear down the default process group of a failed generation so that peers blocked in
        one of its collectives are released. For gloo that takes destroying the group: it closes the
        sockets (an abort alone leaves them open and a peer waiting on them blocked until timeout).
        Call it when no Python frame of the failed collective is alive any more, or the group (and
        its sockets) outlive the call."""
        import torch.distributed as dist

        if dist.is_initialized():
            pg.destroy_process_group_now()


class GlooTransport(ProcessGroupTransport):
    """CPU collectives over TCP. ``GLOO_SOCKET_IFNAME`` picks the interface across namespaces."""

    name = "gloo"
    torch_backend = "gloo"

    def check_available(self) -> None:
        import torch.distributed as dist

        if not dist.is_gloo_available():
            raise BackendUnavailableError("transport 'gloo' is not built into this torch")

    def init_timeout(self, timeout: timedelta, connect_timeout: timedelta | None) -> timedelta:
        # gloo's tcp pair waits GLOO_CONNECT_FACTOR times its timeout for the first connect (pair.h)
        if connect_timeout is None:
            return timeout
        return min(timeout, connect_timeout / GLOO_CONNECT_FACTOR)


# gloo/transport/tcp/pair.h, Pair::waitUntil: "Use a longer timeout when waiting for initial connect"
GLOO_CONNECT_FACTOR = 5


def efa_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """Names of the AWS Elastic Fabric Adapter devices on this host (empty off AWS)."""
    found = []
    for dev in sorted(glob.glob(os.path.join(sysfs, "*"))):
        driver = os.path.realpath(os.path.join(dev, "device", "driver"))
        if os.path.basename(driver) == "efa" or os.path.basename(dev).startswith("rdmap"):
            found.append(os.path.basename(dev))
    return found


# What AWS recommends for NCCL over EFA (libfabric provider, GPUDirect RDMA, fork safety for data
# loader workers); applied only where an EFA device exists and never over the user's own values.
EFA_ENV_DEFAULTS = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}


class NcclTransport(ProcessGroupTransport):
    """GPU collectives. One GPU per local rank; EFA-friendly defaults where EFA is present. The group
    has a gloo half for host tensors (torch's ``cpu:gloo,cuda:nccl``): the commit vote, the agreement
    after a re-form and hydration's flat buffers are host tensors. Run on one GPU (one rank: README, "What
    has run on a GPU"), not yet between GPUs."""

    name = "nccl"
    torch_backend = "cpu:gloo,cuda:nccl"

    def __init__(self, sysfs: str = "/sys/class/infiniband") -> None:
        self._sysfs = sysfs

    def check_available(self) -> None:
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "transport 'nccl' needs CUDA GPUs, but torch.cuda.is_available() is False on this "
                "machine; use --transport gloo"
            )
        if not dist.is_nccl_available():
            raise BackendUnavailableError("transport 'nccl' is not built into this torch")

    def env_defaults(self) -> dict[str, str]:
        return dict(EFA_ENV_DEFAULTS) if efa_devices(self._sysfs) else {}

    def device_for(self, local_rank: int) -> str:
        return f"cuda:{local_rank}"

    def init_timeout(self, timeout: timedelta, connect_timeout: timedelta | None) -> timedelta:
        return GlooTransport.init_timeout(self, timeout, connect_timeout)  # the gloo half connects at init

    def abort(self) -> None:
        # NCCL communicators stuck in a kernel must be aborted first (destroying them would wait forever);
        # then destroying the group closes the gloo half's sockets, which releases peers blocked on them
        import torch.distributed as dist

        if dist.is_initialized():
            pg.abort_process_group()
        if dist.is_initialized():
            pg.destroy_process_group_now()

    def init_process_group(self, store, rank, world_size, generation, timeout=timedelta(minutes=10),
                           connect_timeout=None):
        import torch

        self.check_available()
        torch.cuda.set_device(self.device_for(int(os.environ.get("LOCAL_RANK", "0"))))
        super().init_process_group(store, rank, world_size, generation, timeout, connect_timeout)


@hookimpl
def hp_transport_backends() -> list[TransportBackend]:
    return [GlooTransport(), NcclTransport()]
