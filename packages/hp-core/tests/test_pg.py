"""The seam of torch's private process-group API (:mod:`hp.core.pg`): no other hp module names a torch
private, and what the seam does.

A plain DDP script that destroys its group and returns exits, forked or cold. The hang it guards against is a race in torch (a gloo worker thread that needs the GIL while the
``Reducer``'s destructor joins it with the GIL held). Here the race is made certain rather than likely: a
callback on the group's last all-reduce, attached before the all-reduce ends (so it runs on the group's
worker thread), keeps that thread busy without the GIL for a second, so the thread needs the GIL back while
the script's DDP module is freed. The DDP module is freed on return only if
``torch._dynamo`` was imported before it was built (otherwise a cycle keeps it to the next collection): hp's
fork server preloads it, a script using ``torch.compile`` imports it, torchrun's workers of
``examples/train_ddp.py`` import it only later (with the optimizer). Without the workaround both cases hang
(the worker never ends); with it both exit 0."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import Std

from hp.core import forkserver
from hp.testing import free_port
from hp.core.workers import python_command

SCRIPT = """
import sys, threading, time
import torch, torch.distributed as dist
import torch._dynamo  # imported before DDP is built (torch.compile, hp's fork server): no cycle keeps DDP alive
from torch.nn.parallel import DistributedDataParallel as DDP

ran = []

def late(_):  # on a gloo thread: busy for a second without the GIL, then needs it back
    if threading.current_thread() is not threading.main_thread():
        time.sleep(1.0)
    ran.append(threading.current_thread().name)

def main():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    for _ in range(1000):  # until the callback is attached before the all-reduce ends (else it runs right here)
        ran.clear()
        dist.all_reduce(torch.ones(1), async_op=True).get_future().then(late)
        if not ran:
            break
    dist.destroy_process_group()
    print("destroyed with a late gloo thread", flush=True)
    # returning frees `model`: its Reducer drops the group's last reference unless hp holds one

main()
print("returned", flush=True)
"""

HANG_S = 60  # a hang guard: the script ends in ~1 s once imported


def test_a_forked_ddp_worker_that_destroys_its_group_exits(tmp_path: Path):
    script = tmp_path / "ddp_exit.py"
    script.write_text(SCRIPT)
    w = forkserver.ForkedWorker(0, 0, python_command(str(script), [str(free_port())], False), str(tmp_path), Std.ALL)
    w.start({"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + HANG_S
    try:
        while (status := w.poll()) is None:
            assert time.monotonic() < deadline, "the forked DDP worker hung at exit"
            time.sleep(0.05)
    finally:
        if w.poll() is None:
            w.kill_hung()
        w.finish()  # stops the log tails: their threads would keep this process from exiting
    out = (tmp_path / w.name / "attempt_0" / "stdout.log").read_text()
    assert status.ok and out.splitlines() == ["destroyed with a late gloo thread", "returned"], out


def test_a_cold_ddp_worker_that_destroys_its_group_exits(tmp_path: Path):
    script = tmp_path / "ddp_exit.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "hp.core.worker_main", str(script), str(free_port())],
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.returncode == 0 and out.stdout.splitlines() == ["destroyed with a late gloo thread", "returned"], out.stdout + out.stderr


# ---- the seam: every torch private of the process-group API is named in hp.core.pg only ------------------
PACKAGES = Path(__file__).resolve().parents[2]  # packages/: every distribution's src/hp
SEAM = "hp/core/pg.py"
ZERO_SEAM = "hp/checkpointless/sharded.py"  # ZeroRedundancyOptimizer's privates (its own seam)
# torch privates of the process-group API that do not sit on a c10d module (objects' attributes, names)
PG_PRIVATES = {"_abort_process_group", "_set_pg_timeout", "_get_default_group", "_register_process_group",
               "_resolve_process_group", "_world", "_get_backend", "_pg_registry", "_dim_group_names"}
ZERO_PRIVATES = {"_overlap_with_ddp", "_partition_parameters", "_clear_cache", "_local_step", "_opt_called",
                 "_init_local_optimizer", "_build_param_buckets", "_sync_param_groups", "_sync_params",
                 "_optim_constructor", "_optim_defaults"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torch_privates(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of a torch process-group private in ``source``, and every ZeRO private."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = _dotted(node.value)
            on_c10d = owner.split(".")[-1] in ("c10d", "distributed_c10d") or owner.startswith("torch._C")
            if ((_private(node.attr) and on_c10d) or node.attr in PG_PRIVATES | ZERO_PRIVATES
                    or (node.attr == "_timeout" and owner.endswith(".options"))):  # a backend's options._timeout
                found.append((node.lineno, f"{owner}.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in PG_PRIVATES:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module.startswith("torch._C") or (
                        node.module.endswith("c10d") and _private(alias.name)) or alias.name in PG_PRIVATES:
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "DeviceMesh":
            found += [(node.lineno, f"DeviceMesh({k.arg}=)") for k in node.keywords if k.arg and _private(k.arg)]
    return sorted(set(found))


def test_no_hp_module_but_the_seams_names_a_torch_process_group_private():
    offenders = []
    for path in sorted(PACKAGES.glob("*/src/hp/**/*.py")):
        module = Path(*path.relative_to(PACKAGES).parts[2:]).as_posix()  # without "<distribution>/src/"
        if module == SEAM:
            continue
        for line, what in torch_privates(path.read_text()):
            if module == ZERO_SEAM and what.rsplit(".", 1)[-1] in ZERO_PRIVATES:
                continue
            offenders.append(f"{module}:{line}: {what}")
    assert not offenders, "torch privates outside hp.core.pg (and ZeRO's outside sharded.py):\n" + "\n".join(offenders)


def test_the_guard_sees_every_spelling_of_a_private():
    src = ("from torch.distributed.distributed_c10d import _set_pg_timeout\n"
           "import torch.distributed as dist\nfrom torch.distributed import distributed_c10d as c10d\n"
           "c10d._world.pg_map\ndist.distributed_c10d._get_default_group()\ntorch._C._distributed_c10d.x\n"
           "pg._get_backend(d).options._timeout\nzero._clear_cache()\nDeviceMesh('cpu', m, _rank=0)\n")
    assert [line for line, _ in torch_privates(src)] == [1, 4, 5, 6, 7, 7, 8, 9]
    assert torch_privates("import torch\nc10d.new_group()\nself._world_size = 1\n") == []


def test_the_seam_imports_no_torch_before_a_script_runs():
    """worker_main wraps destroy_process_group before the script imports torch (whose import starts a thread
    that could take SIGTERM): importing the seam must not import torch."""
    out = subprocess.run([sys.executable, "-c", "import sys, hp.core.pg; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=HANG_S)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
