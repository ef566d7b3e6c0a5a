"""files.py: atomic writes of a file and of a folder get the umask's modes, replace the old
output whole, leave nothing behind on an error and follow a symlinked output."""

from __future__ import annotations

import os

import pytest

from prove_jax import files
from prove_jax.checkpoints import checkpoint


def _mode(path):
    return os.stat(path).st_mode & 0o777


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_text_gets_the_umask_mode_and_leaves_nothing_behind_on_error(tmp_path, umask_022):
    out = tmp_path / "sub" / "out.txt"  # the parent is made
    files.atomic_write_text(str(out), "one\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert out.read_text() == "one\n" and _mode(out) == _mode(plain) == 0o644
    with pytest.raises(UnicodeEncodeError):
        files.atomic_write_text(str(out), "two \ud800\n")  # fails mid-write
    assert out.read_text() == "one\n" and os.listdir(out.parent) == ["out.txt"]


def test_atomic_dir_mode_replacement_failure_and_symlinks(tmp_path, umask_022):
    base = tmp_path / "base"
    base.mkdir()
    final = base / "out"
    with files.atomic_dir(str(final)) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
    os.mkdir(tmp_path / "plain")
    assert _mode(final) == _mode(tmp_path / "plain") == 0o755
    with files.atomic_dir(str(final)) as tmp:  # replaces the earlier output whole
        open(os.path.join(tmp, "b"), "w").close()
    assert os.listdir(final) == ["b"] and os.listdir(base) == ["out"]
    with pytest.raises(RuntimeError):
        with files.atomic_dir(str(final)) as tmp:
            open(os.path.join(tmp, "c"), "w").close()
            raise RuntimeError("crash mid-write")
    assert os.listdir(final) == ["b"] and os.listdir(base) == ["out"]
    # a symlinked output is followed: the link stays, its target gets the new contents
    os.symlink(final, tmp_path / "link")
    with files.atomic_dir(str(tmp_path / "link")) as tmp:
        open(os.path.join(tmp, "d"), "w").close()
    assert os.path.islink(tmp_path / "link") and os.listdir(final) == ["d"]
    assert os.listdir(base) == ["out"]


def test_an_empty_directory_may_be_the_output():
    import tempfile
    with tempfile.TemporaryDirectory() as empty:
        files.check_replaceable(empty, "params", "a checkpoint", checkpoint.CheckpointError)
