"""Where GPU recovery time goes, measured on a lent GPU machine (run by scripts/gpu_check.sh; one JSON line).

* ``abort``: a one-rank ``cpu:gloo,cuda:nccl`` group (what ``--transport nccl`` makes) after an all-reduce,
  then ``_abort_process_group()`` and ``destroy_process_group()`` timed apart, as ``NcclTransport.abort``
  runs them; and a new group's first all-reduce (nccl connects lazily). ``abort_variants``: the same
  without the gloo half, destroy alone, and with torch's NCCL monitoring settings changed.
* ``d2h``: 328 MB (the 25m model's state) copied from the GPU into a spare's shared-memory receive buffer
  (:class:`hp.checkpointless.shm.SharedBuffer`, pages faulted in), pageable as hydration copies today,
  then after ``cudaHostRegister`` of the same mapping (and what registering costs), against pinned memory.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta


def _time(fn, repeats: int = 5) -> dict:
    import torch

    values = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        values.append(time.perf_counter() - start)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": repeats}


def abort_timing(repeats: int = 3, backend: str = "cpu:gloo,cuda:nccl", op: str = "abort") -> dict:
    """A one-rank group of ``backend`` after an all-reduce, then ``op``: ``abort`` (torch's
    ``_abort_process_group()`` then ``destroy_process_group()``, as ``NcclTransport.abort``) or ``destroy``
    (``destroy_process_group()`` alone), each call timed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    from hp.core.procs import free_port

    torch.cuda.set_device(0)
    out: dict[str, list[float]] = {"init_s": [], "first_allreduce_s": [], "abort_s": [], "destroy_s": []}
    for _ in range(repeats):
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=60))
        t0 = time.perf_counter()
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        t1 = time.perf_counter()
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if op == "abort":
            _abort_process_group()
        t3 = time.perf_counter()
        if dist.is_initialized():
            dist.destroy_process_group()
        t4 = time.perf_counter()
        for key, v in zip(out, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            out[key].append(v)
        del store
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)} for k, v in out.items()}


# where the second goes: the same abort with the gloo half or without, destroy alone, and torch's NCCL
# watchdog/monitor threads configured otherwise (each in a process of its own: torch reads them at init)
ABORT_VARIANTS = [
    ("gloo+nccl abort", "cpu:gloo,cuda:nccl", "abort", {}),
    ("nccl abort", "nccl", "abort", {}),
    ("gloo+nccl destroy only", "cpu:gloo,cuda:nccl", "destroy", {}),
    ("nccl abort, no monitoring thread", "nccl", "abort", {"TORCH_NCCL_ENABLE_MONITORING": "0"}),
    ("nccl abort, coord check 10 ms", "nccl", "abort", {"TORCH_NCCL_COORD_CHECK_MILSEC": "10"}),
    ("nccl abort, no async error handling", "nccl", "abort", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
]


def abort_variants() -> dict:
    import os
    import subprocess

    out = {}
    for name, backend, op, env in ABORT_VARIANTS:
        done = subprocess.run([sys.executable, __file__, "abort", backend, op], env={**os.environ, **env},
                              capture_output=True, text=True, timeout=120, check=False)
        lines = done.stdout.strip().splitlines()
        out[name] = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-500:]}
    return out


def d2h_timing(nbytes: int = 328_132_144) -> dict:
    import torch

    from hp.checkpointless import shm

    gpu = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    buf = shm.SharedBuffer.create(nbytes)
    dst = buf.tensor[:nbytes]
    dst.fill_(0)  # faulted in, as a spare's buffer is before it is promoted
    out = {"nbytes": nbytes, "pageable_shm_s": _time(lambda: dst.copy_(gpu))}
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    rc = cudart.cudaHostRegister(dst.data_ptr(), nbytes, 0)
    out["register_s"] = time.perf_counter() - start
    out["register_rc"] = int(rc if isinstance(rc, int) else getattr(rc, "value", -1))
    out["registered_shm_s"] = _time(lambda: dst.copy_(gpu, non_blocking=True))
    cudart.cudaHostUnregister(dst.data_ptr())
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["pinned_s"] = _time(lambda: pinned.copy_(gpu, non_blocking=True))
    for key in ("pageable_shm_s", "registered_shm_s", "pinned_s"):
        out[key.removesuffix("_s") + "_gbps"] = round(nbytes / out[key]["median"] / 1e9, 2)
    buf.close()
    return out


def main() -> int:
    import torch

    if sys.argv[1:2] == ["abort"]:  # one variant, in this process
        print(json.dumps(abort_timing(3, sys.argv[2], sys.argv[3])))
        return 0
    result = {"probe": "gpu", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "abort": abort_timing(), "abort_variants": abort_variants(), "d2h": d2h_timing()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
