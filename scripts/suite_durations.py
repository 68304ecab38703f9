"""Turn one run of the test suite into a durations results file (JSON): where the suite's time goes.

    .venv/bin/python -m pytest -n 2 -v --junitxml=junit.xml > pytest.log
    .venv/bin/python scripts/suite_durations.py junit.xml pytest.log --wall 1234 --out benchmarks/results/X.json

Every test's own time (setup + call + teardown, from the JUnit file), which xdist worker ran it (from the
``-v`` log), each worker's total, and the totals by kind: ``install`` (wheels and the install-alone
venvs), ``benchmark`` (tests of ``hp bench``), ``scenario`` (chaos scenario files), ``real-process``
(any other test of 1 s or more: those start processes) and ``unit`` (the rest). The conftest at the
repository root orders the next runs longest first from the newest such file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

SCHEMA = "hp-suite-durations/1"


def kind(test_id: str, seconds: float) -> str:
    if "test_repo_layout.py::test_each_distribution_installs_alone" in test_id or "::test_wheel_builds" in test_id:
        return "install"
    if "/test_bench_" in test_id:
        return "benchmark"
    if "test_scenarios.py::test_scenario[" in test_id or "scenario" in test_id.split("::")[0]:
        return "scenario"
    return "real-process" if seconds >= 1.0 else "unit"


def test_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase (classname ``a.b.test_x[.Class]``, name ``test_y[...]``)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    file = case.get("file")
    parts = classname.split(".")
    # the module is the longest prefix of the dotted classname that is a file on disk
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(path) or (file and file.endswith(path)):
            rest = parts[i:]
            return "::".join([path, *rest, name])
    return f"{classname}::{name}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit")
    p.add_argument("log", help="the -v output of the same run (which worker ran which test)")
    p.add_argument("--wall", type=float, required=True, help="the test command's wall time, seconds")
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    worker_of: dict[str, str] = {}
    for line in open(args.log, errors="replace"):
        m = re.match(r"\[(gw\d+)\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (.+?)\s*$", line)
        if m:
            worker_of[m.group(3)] = m.group(1)
    tests, outcomes = [], defaultdict(int)
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        tid = test_id(case)
        seconds = float(case.get("time", 0))
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        outcomes[outcome] += 1
        tests.append({"id": tid, "s": round(seconds, 3), "worker": worker_of.get(tid), "outcome": outcome,
                      "kind": kind(tid, seconds)})
    tests.sort(key=lambda t: -t["s"])
    by_worker, by_kind = defaultdict(float), defaultdict(lambda: {"count": 0, "total_s": 0.0})
    for t in tests:
        by_worker[t["worker"] or "?"] += t["s"]
        by_kind[t["kind"]]["count"] += 1
        by_kind[t["kind"]]["total_s"] += t["s"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    out = {"schema": SCHEMA, "label": args.label, "commit": commit, "wall_s": args.wall,
           "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
           "outcomes": dict(outcomes), "tests_total_s": round(sum(t["s"] for t in tests), 1),
           "workers_s": {w: round(s, 1) for w, s in sorted(by_worker.items())},
           "kinds": {k: {"count": v["count"], "total_s": round(v["total_s"], 1)} for k, v in
                     sorted(by_kind.items(), key=lambda kv: -kv[1]["total_s"])},
           "tests": tests}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(tests)} tests, {out['tests_total_s']} s of test time, wall {args.wall:.0f} s, "
          f"workers {out['workers_s']}, kinds {out['kinds']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
