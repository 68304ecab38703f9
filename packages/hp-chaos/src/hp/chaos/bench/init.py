"""``hp bench init``: how long a generation's process group takes to form, rootless against TCPStore.

N real processes (forked from this one once it has imported torch, each on its own) wait at a
barrier; the clock starts when they are released and stops when ``init_process_group("gloo")`` has
returned on every rank (the latest rank's return). Import time is outside the span; creating or
connecting to the store is inside it, as it is in a job. Each rank forms the group the way an hp
worker does (:meth:`hp.core.transport.ProcessGroupTransport.init_process_group`: generation-prefixed
store, gloo on CPU), then checks it with one ``all_reduce`` (not timed). Variants:

- ``tcpstore``: the classic ``torchrun``/``env://`` way: rank 0's process hosts a ``TCPStore`` (on
  a port chosen beforehand) and waits for every rank to connect; rank 0 is a single point of failure.
- ``rootless``: what an hp job with the HA controller does (``hp run --store etcd``): the group forms on
  a ``TCPStore`` hosted by a process that is no rank (a node's agent; here, this process), started
  before the ranks. The controller names a live node's store in each generation's plan
  (:attr:`hp.core.protocol.Plan.forming_store`), so losing any host costs at most the generation being
  formed: the next one forms on another node's store.
- ``etcd``: the group forms on the ``etcd`` store itself (:mod:`hp.core.etcd_store`), a real etcd that
  no rank hosts, started before the ranks, a fresh job prefix per run: the durable store, for comparison
  (gloo does a wait and a get per peer: ~2N+1 HTTP requests per rank).

On the same etcd it then times controller failover (``failover_s``, :mod:`hp.chaos.bench.failover`):
SIGKILL of the leading HA controller replica until its standby answers.

Sizes run in turn; within a size the variants alternate repeat by repeat, so drift on a shared
machine hits them alike. One untimed 2-rank round per variant warms up first. Each figure is the
median of the repeats with min, max and every value (:func:`hp.chaos.bench.meta.spread`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hp.chaos.bench.meta import int_list
from hp.core.errors import UsageError

DEFINITION_VERSION = 2  # 2: rootless is the agent-hosted forming store; etcd its own variant; failover_s
VARIANTS = ("rootless", "tcpstore", "etcd")
GENERATION = 1  # the store prefix a worker of generation 1 uses (hp/g1/)


@dataclass
class InitBenchConfig:
    ranks: tuple[int, ...] = (8, 16, 32)
    repeats: int = 3
    variants: tuple[str, ...] = VARIANTS
    timeout_s: float = 180.0
    warmup: bool = True
    failover_repeats: int = 5  # controller failovers timed (hp.chaos.bench.failover); 0: none
    lease_s: int = 2


# ---- one rank (a forked child) ------------------------------------------------------------------

def _rank(variant: str, rank: int, world: int, addr: tuple[str, int], job: str, timeout_s: float,
          ready, go, results) -> None:
    """One rank: announce readiness, wait for the release, form the group, report when it formed."""
    try:
        import torch
        import torch.distributed as dist

        from hp.core.devices import pin_to_core
        from hp.core.plugins import get_backend

        pin_to_core(rank)
        torch.set_num_threads(1)
        timeout = timedelta(seconds=timeout_s)
        host, port = addr
        ready.release()
        go.wait()
        if variant == "tcpstore":  # rank 0 hosts it, as torchrun's static rendezvous does
            store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout)
        else:
            store = get_backend("store", "etcd" if variant == "etcd" else "tcp").connect(host, port, timeout, job=job)
        get_backend("transport", "gloo").init_process_group(store, rank, world, GENERATION, timeout)
        formed = time.monotonic()
        x = torch.ones(1)
        dist.all_reduce(x)
        ok = int(x.item()) == world
        results.put((rank, formed, ok, None))
        dist.barrier()  # the store's host (rank 0 in 'tcpstore') stays until every rank is through
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, then this rank ends
        results.put((rank, None, False, f"{type(e).__name__}: {str(e)[:300]}"))
    finally:
        os._exit(0)  # no gloo destructors at exit (they can abort a finished process)


# ---- one timed formation ----------------------------------------------------------------------------

def _trial(variant: str, world: int, etcd_endpoint: tuple[str, int] | None, timeout_s: float) -> dict[str, Any]:
    """Fork ``world`` ranks, release them together, and time until every rank has formed the group."""
    from hp.core.store import TCPStoreBackend
    from hp.core.procs import free_port

    ctx = mp.get_context("fork")
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.SimpleQueue()
    server = None
    if variant == "etcd":
        addr = etcd_endpoint
    elif variant == "tcpstore":
        addr = ("127.0.0.1", free_port())
    else:
        server = TCPStoreBackend().serve("127.0.0.1")  # before the ranks exist, like the agent's
        addr = ("127.0.0.1", server.port)
    job = f"bench-init-{uuid.uuid4().hex[:12]}"
    procs = [ctx.Process(target=_rank, args=(variant, r, world, addr, job, timeout_s, ready, go, results),
                         daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for _ in range(world):  # every rank started, torch imported (inherited), nothing else done
            if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return {"s": None, "error": "ranks not ready in time"}
        start = time.monotonic()
        go.set()
        got, errors = [], []
        for _ in range(world):
            item = _get(results, start + timeout_s)
            if item is None:
                errors.append(f"{world - len(got) - len(errors)} rank(s) did not report in {timeout_s:g} s")
                break
            rank, formed, ok, error = item
            if error is not None or not ok:
                errors.append(f"rank {rank}: {error or 'all_reduce gave a wrong sum'}")
            else:
                got.append(formed)
        if errors:
            return {"s": None, "error": "; ".join(errors[:4])}
        return {"s": max(got) - start, "first_s": min(got) - start}
    finally:
        end = time.monotonic() + 10  # ranks leave right after their barrier; a hung one is killed
        for p in procs:
            if p.pid is not None:
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
        if server is not None:
            server.close()


def _get(queue, deadline: float):
    """The next item of a SimpleQueue, or None after ``deadline`` (it has no timeout of its own)."""
    while time.monotonic() < deadline:
        if not queue.empty():
            return queue.get()
        time.sleep(0.002)
    return None


# ---- the benchmark ----------------------------------------------------------------------------------

def run_bench(cfg: InitBenchConfig, log=print) -> dict[str, Any]:
    import torch  # noqa: F401 -- imported once here, inherited by every forked rank

    from hp.chaos.bench.meta import BenchRun, spread
    from hp.core.etcd_store import EtcdServer, etcd_version

    run = BenchRun("init", DEFINITION_VERSION)
    etcd = (EtcdServer("127.0.0.1", die_with_parent=True).start()
            if "etcd" in cfg.variants or cfg.failover_repeats else None)
    failover = None
    endpoint = (etcd.host, etcd.port) if etcd is not None else None
    rows, errors = [], []
    try:
        if cfg.warmup:
            for v in cfg.variants:
                _trial(v, 2, endpoint, cfg.timeout_s)
        for world in cfg.ranks:
            samples: dict[str, list[float | None]] = {v: [] for v in cfg.variants}
            for i in range(cfg.repeats):
                for v in cfg.variants:
                    t = _trial(v, world, endpoint, cfg.timeout_s)
                    samples[v].append(t["s"])
                    if t.get("error"):
                        errors.append({"ranks": world, "variant": v, "repeat": i, "error": t["error"]})
                    log(f"hp bench init: {world} ranks, {v}, repeat {i + 1}/{cfg.repeats}: "
                        + (f"{t['s']:.3f} s" if t["s"] is not None else f"FAILED ({t['error']})"))
            row: dict[str, Any] = {"ranks": world}
            for v in cfg.variants:
                sp = spread(samples[v])
                row[f"{v}_s"] = sp["median"] if sp else None
                row[v] = sp
            if row.get("rootless_s") and row.get("tcpstore_s"):
                row["rootless_over_tcpstore"] = row["rootless_s"] / row["tcpstore_s"]
            rows.append(row)
        if cfg.failover_repeats:
            from hp.chaos.bench.failover import measure

            failover = measure(etcd.endpoint, cfg.failover_repeats, cfg.lease_s, log)
            if not failover["state_intact"]:
                errors.append({"failover": "the standby did not answer with the job's state intact"})
    finally:
        if etcd is not None:
            etcd.stop()
    result = {
        "definition": "seconds from releasing N ready processes (torch imported) until init_process_group('gloo') "
                      "has returned on every rank (max over ranks), store creation/connection included; "
                      "median of the repeats",
        "variants": {"rootless": "TCPStore hosted by a non-rank process started before the ranks: the node agent's "
                                 "forming store that the controller names per generation (hp run --store etcd)",
                     "tcpstore": "TCPStore hosted by rank 0's process (torchrun / env:// style)",
                     "etcd": "the etcd store itself (real etcd, hosted by no rank), hp's generation-prefixed store"},
        "rows": rows,
        "failover_s": failover["failover"]["median"] if failover else None,
        "failover": failover,
        "notes": [f"{run_cores()} usable cores for up to {max(cfg.ranks)} ranks plus etcd: ranks share cores"]
        + ([] if failover else ["failover_s is null: --failover-repeats 0"]),
        "config": {"ranks": list(cfg.ranks), "repeats": cfg.repeats, "variants": list(cfg.variants),
                   "timeout_s": cfg.timeout_s, "warmup": cfg.warmup, "transport": "gloo", "pin_cores":
                   os.environ.get("HP_PIN_CORES") == "1", "failover_repeats": cfg.failover_repeats,
                   "lease_s": cfg.lease_s},
        "etcd": {"version": etcd_version(), "data_dir": "local disk (tempfile), fsync on"} if etcd else None,
        "errors": errors,
        "completed": not errors,
    }
    return run.stamp(result)


def run_cores() -> int:
    return len(os.sched_getaffinity(0))


def format_table(r: dict[str, Any]) -> str:
    def fig(sp):
        return f"{sp['median']:.3f} [{sp['min']:.3f}-{sp['max']:.3f}]" if sp else "failed"

    variants = r["config"]["variants"]
    lines = [f"hp bench init: process-group init (gloo), median [min-max] of {r['config']['repeats']}, "
             f"{r['machine']['cores']} cores",
             f"{'ranks':>5}  " + "  ".join(f"{v:>24}" for v in variants)]
    for row in r["rows"]:
        lines.append(f"{row['ranks']:>5}  " + "  ".join(f"{fig(row[v]):>24}" for v in variants))
    f = r.get("failover")
    lines.append(f"failover_s: {f['failover']['median']:.3f} [{f['failover']['min']:.3f}-{f['failover']['max']:.3f}] "
                 f"(lease {f['lease_s']} s; SIGKILL of the leading replica until the standby answers)"
                 if f else "failover_s: not measured (--failover-repeats 0)")
    return "\n".join(lines)


# ---- the CLI: hp bench init ---------------------------------------------------------------------------

def run_cli(args: argparse.Namespace) -> int:
    variants = tuple(v for v in args.variants.split(",") if v)
    if not variants or set(variants) - set(VARIANTS):
        raise UsageError(f"--variants: a comma-separated subset of {','.join(VARIANTS)}, got {args.variants!r}")
    if args.repeats < 1:
        raise UsageError("--repeats must be >= 1")
    if args.failover_repeats < 0 or args.lease < 1:
        raise UsageError("--failover-repeats must be >= 0 and --lease >= 1")
    cfg = InitBenchConfig(ranks=int_list(args.ranks, "--ranks", 2, "sizes of at least 2 ranks"), repeats=args.repeats,
                          variants=variants,
                          timeout_s=args.timeout, warmup=not args.no_warmup, failover_repeats=args.failover_repeats,
                          lease_s=args.lease)
    if "etcd" in variants or cfg.failover_repeats:
        from hp.core.etcd_store import etcd, etcd_binary

        etcd_binary()  # one line when the server is missing (BackendUnavailableError is a UsageError)
        if etcd is None:
            raise UsageError("hp bench init needs python-etcd: pip install 'hp-core[etcd]'")
    import sys

    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(result), flush=True)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0 if result["completed"] else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", default="8,16,32", help="comma-separated world sizes (default 8,16,32)")
    p.add_argument("--repeats", type=int, default=3, help="timed formations per size and variant (default 3)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {','.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds one formation may take before it fails")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed 2-rank round per variant")
    p.add_argument("--failover-repeats", type=int, default=5,
                   help="controller failovers to time on the same etcd (0: none; default 5)")
    p.add_argument("--lease", type=int, default=2, help="the HA controller's lease in seconds (default 2, as hp run)")
    p.add_argument("--json", action="store_true", help="after the table, the result as the last stdout line")

