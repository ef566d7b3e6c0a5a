"""Paths that may be URLs: local paths and `gs://` (any scheme `etils.epath` knows) through one
layer, the one orbax itself writes checkpoints through (tensorstore moves the array bytes,
gcsfs the other files).

Local paths keep their exact local behaviour (`files.py`: temporary sibling + rename, symlinks
followed); for a URL an object store has no rename, and none is needed: an object appears whole
when its upload completes, so a file is written in one upload, and a directory output is made
whole by the marker its reader checks (a checkpoint's `params/`, written by orbax with its own
commit marker, and `config.json`). A missing bucket or object is a `StorageError`, one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from typing import Callable

import fsspec
from etils import epath

from prove_jax import files
from prove_jax.errors import ProveJaxError


class StorageError(ProveJaxError, OSError):
    """A path that cannot be read or written: a missing bucket or object, no access."""


def is_url(path) -> bool:
    return "://" in str(path)


def as_path(path) -> epath.Path:
    return epath.Path(str(path))


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is."""
    return str(path) if is_url(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    if is_url(base):
        return "/".join([str(base).rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def bucket_of(path: str) -> str | None:
    """'gs://bucket' of a URL (None for a local path)."""
    if not is_url(path):
        return None
    scheme, rest = str(path).split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def _quiet_gcsfs() -> None:
    # gcsfs logs a warning with the credentials lookup on every new bucket it opens, and each
    # retried request with its traceback; the errors that end a command are said in one line
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def errors(path: str, what: str = "read"):
    """Turn the storage client's errors about `path` into one-line `StorageError`s naming it
    (a missing bucket named as such)."""
    try:
        yield
    except StorageError:
        raise
    except OSError:
        if not is_url(path):  # local paths keep their own errors
            raise
        _raise_storage_error(path, what)


def _raise_storage_error(path: str, what: str):
    try:
        raise
    except FileNotFoundError:
        bucket = bucket_of(path)
        if bucket is not None and not _bucket_exists(bucket):
            raise StorageError(f"bucket {bucket} not found (or not accessible), for {path}"
                               ) from None
        raise StorageError(f"not found: {path}") from None
    except PermissionError as e:
        raise StorageError(f"no permission to {what} {path}: {_first_line(e)}") from None
    except OSError as e:
        raise StorageError(f"could not {what} {path}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _bucket_exists(bucket: str) -> bool:
    _quiet_gcsfs()
    try:
        fs, _ = fsspec.core.url_to_fs(bucket)
        return bool(fs.exists(bucket.split("://", 1)[1]))
    except Exception:  # noqa: BLE001 - unknown (no access to list it): let the write say why
        return True


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    _quiet_gcsfs()
    with errors(path):
        return as_path(path).exists()


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    _quiet_gcsfs()
    with errors(path):
        return as_path(path).is_dir()


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    _quiet_gcsfs()
    with errors(path):
        return as_path(path).is_file()


def listdir(path: str) -> list[str]:
    if not is_url(path):
        return os.listdir(path)
    _quiet_gcsfs()
    with errors(path):
        return [p.name for p in as_path(path).iterdir()]


def require_bucket(path: str) -> None:
    """Raise a one-line `StorageError` when `path` is a URL whose bucket does not exist, before
    anything is written there: gcsfs's mkdir would create a missing bucket (a typo's)."""
    bucket = bucket_of(path)
    if bucket is not None and not _bucket_exists(bucket):
        raise StorageError(f"bucket {bucket} not found (or not accessible), for {path}")


def makedirs(path: str) -> None:
    """A local directory (and its parents); at a URL nothing is made (an object store has no
    directories: writing an object makes its prefix), but the bucket must exist."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    _quiet_gcsfs()
    require_bucket(path)


def read_text(path: str) -> str:
    if not is_url(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    _quiet_gcsfs()
    with errors(path):
        return as_path(path).read_text()


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    _quiet_gcsfs()
    with errors(path):
        return as_path(path).read_bytes()


def write_text(path: str, text: str) -> None:
    """A whole file: locally through a temporary name and a rename (`files.atomic_write_text`),
    at a URL in one upload (the object appears whole or not at all)."""
    if not is_url(path):
        files.atomic_write_text(path, text)
        return
    _quiet_gcsfs()
    with errors(path, "write"):
        as_path(path).write_text(text)


def remove_tree(path: str) -> None:
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    _quiet_gcsfs()
    with contextlib.suppress(FileNotFoundError), errors(path, "delete"):
        if as_path(path).exists():
            as_path(path).rmtree()


def fingerprint(path: str) -> list:
    """[size, version] of a file, reading none of it: locally the modification time in ns, at a
    URL the object's generation (or update time), either of which changes when it is rewritten."""
    if not is_url(path):
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns]
    _quiet_gcsfs()
    with errors(path):
        fs, key = fsspec.core.url_to_fs(path)
        info = fs.info(key)
    return [int(info.get("size") or 0), str(info.get("generation") or info.get("updated") or "")]


def _open(path: str, mode: str):
    return as_path(path).open(mode) if is_url(path) else open(path, mode)


def _copy_file(src: str, dest: str) -> None:
    """One file, streamed (a multi-GB shard never sits in memory whole); either side a URL."""
    with errors(src), _open(src, "rb") as f, errors(dest, "write"), _open(dest, "wb") as g:
        shutil.copyfileobj(f, g, 16 << 20)


def upload_dir(local_dir: str, dest: str, names=None) -> list[str]:
    """Copy the files of `local_dir` (only `names`, when given) into `dest`; returns the names."""
    copied = []
    for name in sorted(os.listdir(local_dir)):
        src = os.path.join(local_dir, name)
        if os.path.isfile(src) and (names is None or name in names):
            if is_url(dest):
                _quiet_gcsfs()
                _copy_file(src, join(dest, name))
            else:
                shutil.copy2(src, os.path.join(dest, name))
            copied.append(name)
    return copied


@contextlib.contextmanager
def local_copy(path: str, names=None):
    """A local directory with the files of `path` (those of `names` that exist, when given):
    `path` itself when local, else a temporary download, removed afterwards. For readers that
    take only local paths (HF tokenizers)."""
    if not is_url(path):
        yield path
        return
    _quiet_gcsfs()
    with tempfile.TemporaryDirectory(prefix="prove-jax-") as tmp:
        with errors(path):
            children = [c for c in as_path(path).iterdir()
                        if (names is None or c.name in names) and c.is_file()]
        for child in children:
            _copy_file(str(child), os.path.join(tmp, child.name))
        yield tmp


@contextlib.contextmanager
def staged_dir(final: str):
    """Like `files.atomic_dir`: yields a directory to write an output into. Locally the
    temporary sibling renamed onto `final`; at a URL a local staging directory whose files
    are uploaded into `final` (emptied first) when the block ends without error."""
    if not is_url(final):
        with files.atomic_dir(final) as tmp:
            yield tmp
        return
    with tempfile.TemporaryDirectory(prefix="prove-jax-") as tmp:
        yield tmp
        remove_tree(final)
        upload_tree(tmp, final)


def upload_tree(local_dir: str, dest: str) -> None:
    """Every file below `local_dir` copied to the same relative path under the URL `dest`."""
    require_bucket(dest)
    for root, _, names in os.walk(local_dir):
        rel = os.path.relpath(root, local_dir)
        if names:
            upload_dir(root, dest if rel == "." else join(dest, *rel.split(os.sep)), names)


@contextlib.contextmanager
def local_file(path: str | None, upload: Callable[[], bool] | bool = False,
               companions: tuple[str, ...] = ()):
    """A local stand-in for the file `path` (and its `companions`, suffixes of the same name:
    `.settings.json`), for readers and writers that take local files only: `path` itself when
    local or None; for a URL, a temporary copy of what exists there, copied back when the
    block ends if `upload` (or `upload()`, asked then), also when it ends by an error or an
    interrupt, so that a relaunch resumes a partial output as it would a local one. Each file
    appears at the URL whole, in one upload."""
    if path is None or not is_url(path):
        yield path
        return
    _quiet_gcsfs()
    with tempfile.TemporaryDirectory(prefix="prove-jax-") as tmp:
        local = os.path.join(tmp, os.path.basename(str(path).rstrip("/")) or "file")
        for suffix in ("", *companions):
            if exists(path + suffix):
                _copy_file(path + suffix, local + suffix)
        try:
            yield local
        finally:
            if upload() if callable(upload) else upload:
                for suffix in ("", *companions):
                    if os.path.isfile(local + suffix):
                        _copy_file(local + suffix, path + suffix)
