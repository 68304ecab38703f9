"""Private local state: per-user 0700 directories, 0600 files, no symlink followed, owner checked.

What a job keeps on a node (checkpoint slots in ``/dev/shm``, token caches, replicas) is the job's
weights and data: another local user must be able neither to read it nor to plant a file (or a
symlink) where the job will look for it. Every place that creates or reuses such state goes through
:func:`private_dir` and :func:`open_private`; :func:`user_dir` is the default location, one per user.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _check_owner(st: os.stat_result, path: object) -> None:
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}): "
                              f"refusing to keep or reuse private state there")


def private_dir(path: str | os.PathLike) -> Path:
    """``path`` as a directory only this user can enter (created 0700, tightened to 0700 if looser);
    PermissionError if it is a symlink, not a directory, or another user's."""
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{p} is a symlink or not a directory: refusing to keep private state there")
    _check_owner(st, p)
    if st.st_mode & 0o077:
        os.chmod(p, 0o700)
    return p


def open_private(path: str | os.PathLike, flags: int) -> int:
    """``os.open`` of a 0600 file that is this user's, never through a symlink (``O_NOFOLLOW``): a new
    file is created 0600; an existing one must be ours and is tightened to 0600."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        _check_owner(st, path)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def user_dir(name: str) -> Path:
    """``/dev/shm/<name>-<uid>`` (RAM, where writable), else the temp dir's: one per user, 0700."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return private_dir(Path(base) / f"{name}-{os.getuid()}")
