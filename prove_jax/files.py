"""Output files and directories that appear whole or not at all (temp sibling + rename)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import uuid


def check_replaceable(path: str, marker: str, what: str, error: type[Exception]) -> None:
    """Raise `error` unless the output directory `path`, about to be replaced whole, may be.

    It may be new, empty, or an earlier output of the same kind (it holds `marker`); anything
    else (a file, a source tree given as --out by mistake) is kept.
    """
    # URLs too; cycle: storage writes its local files through this module
    from prove_jax import storage
    if storage.exists(path) and not storage.isdir(path):
        raise error(f"output {path} is a file; give a directory")
    if (storage.isdir(path) and storage.listdir(path)
            and not storage.exists(storage.join(path, marker))):
        raise error(f"output {path} exists and is not {what} (no {marker}); refusing to replace "
                    f"it: choose a new directory")


def _temp_sibling(path: str) -> str:
    """A fresh hidden name beside `path` for writing it under before the rename: on the same
    filesystem (so the rename is atomic) and recognisable as ours (.tmp-NAME-...)."""
    return os.path.join(os.path.dirname(path),
                        f".tmp-{os.path.basename(path)}-{uuid.uuid4().hex[:12]}")


def atomic_dir(final_path: str):
    """Context manager yielding a temp dir next to `final_path`, renamed onto it on success.

    A symlinked `final_path` is followed, so the output lands where the link points (and the
    rename stays on that filesystem). The temp dir is made with `os.mkdir`, so the output gets
    the umask's permissions like any other directory (`tempfile.mkdtemp` would make it 0700).
    """
    class _Atomic:
        def __enter__(self):
            self.final = os.path.realpath(final_path)
            os.makedirs(os.path.dirname(self.final), exist_ok=True)
            self.tmp = _temp_sibling(self.final)
            os.mkdir(self.tmp)
            return self.tmp

        def __exit__(self, exc_type, exc, tb):
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            if os.path.lexists(self.final):
                old = self.tmp + ".old"
                os.rename(self.final, old)
                os.rename(self.tmp, self.final)
                if os.path.isdir(old):
                    shutil.rmtree(old, ignore_errors=True)
                else:  # a file given --overwrite
                    os.unlink(old)
            else:
                os.rename(self.tmp, self.final)
            return False
    return _Atomic()


def nearest_existing(path: str) -> str:
    """`path`'s nearest ancestor that exists (what a directory to be created below it depends
    on: a file there, or one that cannot be written, stops it)."""
    parent = os.path.dirname(os.path.realpath(path))
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    return parent


# a process's own descriptors: /dev/stdout resolves to the file, pipe or terminal behind fd 1
_FD_PATH = re.compile(r"/(dev/(stdin|stdout|stderr|fd/\d+)|proc/(self|thread-self|\d+)/fd/\d+)")


def is_stream(path: str) -> bool:
    """An existing output that is written into, never renamed over: a character device or FIFO
    (/dev/null, a named pipe) or a descriptor (/dev/stdout, /dev/fd/N: renaming a file over what
    it resolves to would drop the output, or replace a log it appends to)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISDIR(mode):
        return False
    return not stat.S_ISREG(mode) or _FD_PATH.fullmatch(os.path.abspath(path)) is not None


@contextlib.contextmanager
def replacing(path: str, suffix: str = ""):
    """Yield a fresh temporary path beside `path` for the caller to write (a file it creates);
    renamed onto `path` when the block ends, removed if it raises: never a half-written file.
    Through a symlink its target is replaced (the link stays). `suffix`: an extension a writer
    reads the format from (matplotlib's savefig: .png)."""
    path = os.path.realpath(path)
    if os.path.isdir(path):  # else the rename fails, naming the temporary file
        raise IsADirectoryError(f"{path} is a directory; give a file path")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = _temp_sibling(path) + suffix
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """Write a text file via a temporary name + rename (`replacing`). Through a symlink its
    target is written (the link stays); a stream (`is_stream`: /dev/stdout, a FIFO, /dev/null)
    is written into, appending, as there is no file to rename over."""
    if is_stream(path):
        with open(path, "a") as f:  # append: a /dev/stdout redirected with >> keeps what it had
            f.write(text)
        return
    with replacing(path) as tmp:
        # os.open with 0o666: the umask's permissions, like any file (mkstemp's are 0600)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as f:
            f.write(text)


def read_json(path: str):
    """The JSON value in the file at `path`, a local path or a URL (gs://); OSError when it
    cannot be read, ValueError when it is not JSON."""
    from prove_jax import storage  # cycle: storage writes its local files through this module
    return json.loads(storage.read_text(path))
