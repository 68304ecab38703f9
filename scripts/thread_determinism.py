"""Are fault-free runs of the one-rank demo job bit-identical to each other? Per thread setting, on a busy box.

    .venv/bin/python scripts/thread_determinism.py --runs 60 --busy 1 --out benchmarks/results/X.json

Runs the same fault-free job (``hp run --nproc-per-node 1 -m hp.checkpointless.demo.train --steps 6``) ``--runs``
times for each variant, the variants side by side (each one's load is the others' plus ``--busy`` spinning
processes: the contention of a ``pytest -n 2`` suite on two cores), and counts the runs whose per-step losses
are not the most common sequence of their variant. A variant is a ``--threads`` value of the demo job, or an
environment (``MKL_CBWR=COMPATIBLE``: MKL's reproducible mode). Why it exists: on two intra-op threads, runs
differed now and then (MKL's threaded kernels), and a chaos scenario's shared fault-free reference that
differed failed six scenarios at once in CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

VARIANTS = {"threads-2": ([], ["--threads", "2"]), "threads-1": ([], ["--threads", "1"]),
            "threads-2-mkl-cbwr": (["MKL_CBWR=COMPATIBLE"], ["--threads", "2"])}


def _variant(name: str, runs: int, root: str, out: "multiprocessing.Queue") -> None:
    from hp.checkpointless.demo.run import DemoConfig, run_job

    env_kv, flags = VARIANTS[name]
    cfg = DemoConfig(nproc=1, spares=0, steps=6, train_args=flags)
    seqs = []
    for i in range(runs):
        log_dir = os.path.join(root, f"{name}-{i}")
        r = run_job(cfg, log_dir, [], dict(kv.split("=", 1) for kv in env_kv))
        commits = sorted((e["step"], e["loss"]) for e in r.events if e["event"] == "commit")
        seqs.append(tuple(loss for _, loss in commits) if r.returncode == 0 else ("failed", r.returncode))
        shutil.rmtree(log_dir, ignore_errors=True)
    out.put((name, seqs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--busy", type=int, default=1, help="spinning processes beside the variants")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="hp-threads-")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    q: multiprocessing.Queue = multiprocessing.Queue()
    start = time.monotonic()
    try:
        procs = [multiprocessing.Process(target=_variant, args=(n, args.runs, root, q)) for n in VARIANTS]
        for proc in procs:
            proc.start()
        results = dict(q.get() for _ in procs)
        for proc in procs:
            proc.join()
    finally:
        for b in busy:
            b.kill()
        shutil.rmtree(root, ignore_errors=True)
    variants = {}
    for name, seqs in results.items():
        counts = collections.Counter(seqs)
        common, _ = counts.most_common(1)[0]
        variants[name] = {"runs": len(seqs), "differing_from_most_common": len(seqs) - counts[common],
                          "distinct_sequences": len(counts), "most_common_losses": list(common)}
    base = variants["threads-1"]["most_common_losses"]
    for v in variants.values():
        v["most_common_equals_one_thread"] = v["most_common_losses"] == base
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"schema": "hp-thread-determinism/1", "commit": commit, "wall_s": round(time.monotonic() - start, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "busy": args.busy,
           "job": "hp run --nproc-per-node 1 -m hp.checkpointless.demo.train --steps 6 (fault-free)",
           "variants": variants}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: {x: v[x] for x in ("runs", "differing_from_most_common", "distinct_sequences")}
                      for k, v in variants.items()}))


if __name__ == "__main__":
    main()
