"""What each process of a job that ran out of time is doing: its Python stacks, taken with py-spy
(``py-spy dump``, every thread, native frames left out) before the harness kills the job.

CI keeps a failure's message, not its log directory: :func:`summary` gives one line per process (its
title and where its main thread is, innermost frames first); :func:`dump` writes each full dump to
``<log_dir>/stacks/<pid>.txt`` for a person with the directory. Without py-spy (``pip install
py-spy``; hp-chaos's ``test`` extra has it) a process shows its kernel state and wait channel only.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

DUMP_TIMEOUT_S = 10.0  # one process's dump (py-spy stops the process while it reads its memory)
SHOWN_FRAMES = 4  # innermost frames of the main thread per process in the summary
_FRAME = re.compile(r"^\s{4}(\S.*?) \((.+?):(\d+)\)$")  # "    function (path/file.py:line)"


def py_spy() -> str | None:
    """The py-spy next to this interpreter (a virtual environment's bin), else on PATH; None without one."""
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.access(here, os.X_OK) else shutil.which("py-spy")


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _state(pid: int) -> str:
    stat = _read(f"/proc/{pid}/stat")
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return f"state {state}, wchan {_read(f'/proc/{pid}/wchan') or '?'}"


def main_thread_frames(text: str, limit: int = SHOWN_FRAMES) -> list[str]:
    """The innermost ``limit`` frames of the first thread in a ``py-spy dump`` (the main thread is
    listed first) as ``function (file:line)``, the file's base name only."""
    frames: list[str] = []
    started = False
    for line in text.splitlines():
        if line.startswith("Thread "):
            if started:
                break
            started = True
            continue
        m = _FRAME.match(line)
        if started and m:
            frames.append(f"{m.group(1)} ({os.path.basename(m.group(2))}:{m.group(3)})")
    return frames[:limit]


def dump(pids: list[int], log_dir: str) -> dict[int, tuple[str, str]]:
    """Each live process's title (command line) and stacks (py-spy's text; or its kernel state without
    py-spy or when the dump fails), also written to ``<log_dir>/stacks/<pid>.txt``."""
    tool, out = py_spy(), {}
    directory = os.path.join(log_dir, "stacks")
    os.makedirs(directory, exist_ok=True)
    for pid in pids:
        text = ""
        if tool is not None:
            try:
                done = subprocess.run([tool, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                      timeout=DUMP_TIMEOUT_S)
                text = done.stdout if done.returncode == 0 else ""
            except (OSError, subprocess.TimeoutExpired):
                text = ""
        if not os.path.exists(f"/proc/{pid}"):
            continue  # ended meanwhile
        title, text = _read(f"/proc/{pid}/cmdline"), text or f"(no Python stack: {_state(pid)})"
        out[pid] = (title, text)
        with open(os.path.join(directory, f"{pid}.txt"), "w") as f:
            f.write(f"{title}\n{_state(pid)}\n\n{text}\n")
    return out


def summary(stacks: dict[int, tuple[str, str]]) -> list[str]:
    """One line per process: ``pid N (title): innermost <- ... <- outer`` frames of its main thread."""
    lines = []
    for pid, (title, text) in sorted(stacks.items()):
        frames = main_thread_frames(text)
        where = " <- ".join(frames) if frames else (text.splitlines() or ["?"])[0][:160]
        lines.append(f"pid {pid} ({title[:80] or '?'}): {where}")
    return lines
