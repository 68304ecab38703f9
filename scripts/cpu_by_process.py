"""Where a test run's CPU goes, by kind of process: every 0.5 s, each process's CPU time (utime + stime) and
command line (the newest: setproctitle renames hp's processes, and a process is classified by it); on SIGTERM,
the CPU seconds and process count per kind as JSON. Until 2026-12-02 the first command line counted too, which
put forked fork servers and workers under "hp run agent" and processes with a test path under "pytest". A process's CPU after its last sample is missed (at most 0.5 s of it).

    python3 scripts/cpu_by_process.py out.json & S=$!; CI=true bash .ci/run; kill -TERM $S; wait $S
"""
import json, os, signal, sys, time
HZ = os.sysconf("SC_CLK_TCK")
procs = {}  # pid -> [starttime, cmd, cpu]
def kind(cmd):
    """By the newest command line only (setproctitle renames hp's processes): the first one of a forked
    process is its parent's, and test paths (pytest-of-root/popen-gw0) are in many command lines."""
    if cmd.startswith("hp forkserver"): return "fork server"
    if cmd.startswith(("hp rank", "hp spare", "hp worker")) or "hp.core.worker_main" in cmd \
            or "hp.checkpointless.demo.train" in cmd or "hp.elastic.demo.train" in cmd: return "worker/spare"
    if "hp.core.warm_server" in cmd: return "warm-start server"
    if "hp.core.cli run" in cmd or cmd.startswith("hp run") or "/hp run" in cmd or "hp agent" in cmd: return "hp run agent"
    if "hp.core.cli" in cmd or "bin/hp " in cmd: return "other hp CLI"
    if cmd.startswith("[pytest-xdist") or " -m pytest" in cmd or "bin/pytest" in cmd: return "pytest"
    if "slurm" in cmd or "munged" in cmd: return "slurm"
    if "etcd" in cmd or "weed" in cmd or "maria" in cmd or "mysqld" in cmd: return "servers"
    if "pip" in cmd: return "pip"
    if "python" in cmd: return "other python"
    return "other"
def sample():
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            with open(f"/proc/{p}/stat") as f: st = f.read()
            rest = st.rsplit(")", 1)[1].split()
            cpu = (int(rest[11]) + int(rest[12])) / HZ; start = int(rest[19])
            with open(f"/proc/{p}/cmdline", "rb") as f: cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
        except (OSError, IndexError, ValueError):
            continue
        key = (int(p), start)
        old = procs.get(key)
        procs[key] = [cmd if cmd else (old[0] if old else ""), cpu, (old[2] if old and old[2] else cmd)]
def done(*_):
    out = {}
    for (pid, start), (cmd, cpu, first) in procs.items():
        k = kind(cmd or first)
        o = out.setdefault(k, {"n": 0, "cpu_s": 0.0})
        o["n"] += 1; o["cpu_s"] = round(o["cpu_s"] + cpu, 1)
    json.dump(out, open(sys.argv[1], "w"), indent=1); sys.exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    sample(); time.sleep(0.5)
