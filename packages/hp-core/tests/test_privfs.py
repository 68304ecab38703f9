"""Private local state (hp.core.privfs): 0700 directories, 0600 files, no symlink, never another user's."""

from __future__ import annotations

import os
import stat

import pytest
from hp.core import privfs


def test_a_loose_directory_is_tightened_and_a_new_file_is_0600(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert privfs.private_dir(d) == d and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    fd = privfs.open_private(d / "slot", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert stat.S_IMODE(os.stat(d / "slot").st_mode) == 0o600
    (d / "loose").write_text("x")
    os.chmod(d / "loose", 0o644)
    os.close(privfs.open_private(d / "loose", os.O_RDONLY))
    assert stat.S_IMODE(os.stat(d / "loose").st_mode) == 0o600


def test_symlinks_are_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        privfs.private_dir(tmp_path / "link")
    (target / "f").write_text("x")
    (tmp_path / "flink").symlink_to(target / "f")
    with pytest.raises(OSError):  # ELOOP: O_NOFOLLOW
        privfs.open_private(tmp_path / "flink", os.O_RDONLY)


def test_another_users_directory_or_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "f").write_text("planted")
    mine = os.getuid()
    monkeypatch.setattr(privfs.os, "getuid", lambda: mine + 1)  # as if another user had made them
    with pytest.raises(PermissionError, match="not to this user"):
        privfs.private_dir(tmp_path)
    with pytest.raises(PermissionError, match="not to this user"):
        privfs.open_private(tmp_path / "f", os.O_RDONLY)


def test_the_default_location_is_one_per_user():
    d = privfs.user_dir("hp-test")
    assert d.name == f"hp-test-{os.getuid()}" and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    d.rmdir()
