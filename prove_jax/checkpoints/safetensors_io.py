"""Read and write safetensors with numpy only (no torch), one tensor at a time.

The format is small enough to own: 8 bytes little-endian header length N, N bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then the
raw little-endian tensor bytes. Parsing the header ourselves lets us check every offset against
the real file size before reading anything, so a truncated or corrupt file is a one-line error
naming the file and tensor, and lets conversion read each tensor into its own buffer (peak
memory = one tensor, not the file; an mmap of the whole file would count towards RSS).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import BinaryIO, Iterable, Iterator

import ml_dtypes
import numpy as np

from prove_jax.errors import ProveJaxError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_CODE_OF = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ProveJaxError, ValueError):
    """A safetensors file or index that is missing, truncated or corrupt."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # absolute path of the .safetensors file holding it
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one file's header: every tensor's bytes must lie inside the file."""
    if not os.path.isfile(path):
        raise SafetensorsError(f"safetensors file not found: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise SafetensorsError(f"{path}: corrupt safetensors header (header length "
                                   f"{header_len} does not fit in a {size}-byte file)")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(path))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: corrupt safetensors header (not valid JSON: {e})"
                               ) from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    infos = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        code, shape, begin, end = _header_entry(path, name, entry)
        if code not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {code!r}; "
                                   f"supported: {', '.join(DTYPES)}")
        want = math.prod(shape) * DTYPES[code].itemsize
        if end - begin != want or begin < 0:
            raise SafetensorsError(f"{path}: corrupt header for tensor {name!r}: offsets "
                                   f"[{begin}, {end}) hold {end - begin} bytes, shape {shape} "
                                   f"{code} needs {want}")
        if end > data_size:
            raise SafetensorsError(f"{path}: truncated file: tensor {name!r} needs bytes up to "
                                   f"{data_start + end} but the file has only {size}")
        infos[name] = TensorInfo(name, os.path.abspath(path), DTYPES[code], shape,
                                 data_start + begin, want)
    return infos


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _header_entry(path: str, name: str, entry) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype code, shape, begin, end) of one header entry, checked the way the reference
    implementation checks it: dtype a string, shape a list of non-negative ints, data_offsets
    two ints with 0 <= begin <= end; anything else is a SafetensorsError naming file and tensor."""
    def bad(why: str) -> SafetensorsError:
        return SafetensorsError(f"{path}: corrupt safetensors header entry for {name!r} ({why}): "
                                f"{str(entry)[:200]}")
    if not isinstance(entry, dict):
        raise bad("not a JSON object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(code, str):
        raise bad("dtype must be a string")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad("shape must be a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_int, offsets))
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad("data_offsets must be two integers [begin, end] with 0 <= begin <= end")
    return code, tuple(shape), offsets[0], offsets[1]


def _no_duplicate_keys(path):
    def hook(pairs):
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise SafetensorsError(f"{path}: duplicate key {k!r} in JSON")
            seen.add(k)
        return dict(pairs)
    return hook


def model_files(model_dir: str) -> list[str]:
    """The safetensors files of an HF model dir: the single file, or the shards of the index.

    The single file comes first, as in transformers' `from_pretrained`: `save_pretrained` leaves
    a stale index behind when it re-saves a sharded model unsharded, and vice versa.
    """
    if not os.path.isdir(model_dir):
        raise SafetensorsError(f"model directory not found: {model_dir}")
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f, object_pairs_hook=_no_duplicate_keys(index))["weight_map"]
        except SafetensorsError:
            raise
        except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or not UTF-8
            raise SafetensorsError(f"{index}: corrupt index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise SafetensorsError(f"{index}: corrupt index (weight_map must be an object of "
                                   f"tensor name -> shard file, got {type(weight_map).__name__})")
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise SafetensorsError(f"{index}: corrupt index (tensor {name!r} maps to "
                                       f"{shard!r}, not a shard file name)")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(model_dir, name)):
                raise SafetensorsError(f"{index} lists shard {name} which is missing from "
                                       f"{model_dir}")
        return [os.path.join(model_dir, name) for name in files]
    raise SafetensorsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir} "
                           f"(only safetensors checkpoints are supported)")


def model_index(model_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of an HF model dir by name; a name found in two shards is an error."""
    infos: dict[str, TensorInfo] = {}
    for path in model_files(model_dir):
        for name, info in read_header(path).items():
            if name in infos:
                raise SafetensorsError(f"duplicate tensor {name!r}: in both "
                                       f"{os.path.basename(infos[name].file)} and "
                                       f"{os.path.basename(path)}")
            infos[name] = info
    return infos


def read_tensor(info: TensorInfo, f: BinaryIO | None = None) -> np.ndarray:
    """Read one tensor into a fresh array (the only copy of its bytes in memory)."""
    out = np.empty(info.shape, info.dtype)
    own = f is None
    f = open(info.file, "rb") if own else f
    try:
        f.seek(info.offset)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    finally:
        if own:
            f.close()
    if got != info.nbytes:
        raise SafetensorsError(f"{info.file}: truncated while reading tensor {info.name!r} "
                               f"(got {got} of {info.nbytes} bytes)")
    return out


def iter_tensors(infos: Iterable[TensorInfo]) -> Iterator[tuple[TensorInfo, np.ndarray]]:
    """Yield (info, array) in file order, one file handle per file, one tensor alive at a time."""
    by_file: dict[str, list[TensorInfo]] = {}
    for info in infos:
        by_file.setdefault(info.file, []).append(info)
    for path, group in by_file.items():
        with open(path, "rb") as f:
            for info in sorted(group, key=lambda i: i.offset):
                yield info, read_tensor(info, f)


# ---- writing ---------------------------------------------------------------------------------

def header_bytes(entries: Iterable[tuple[str, np.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """(length-prefixed header padded to 8 bytes, data offset of each entry) for a planned file."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offsets, pos = [], 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _CODE_OF[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [pos, pos + n]}
        offsets.append(pos)
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, offsets


def write_file(path: str, entries: list[tuple[str, np.dtype, tuple[int, ...]]],
               arrays: Iterator[tuple[str, np.ndarray]],
               metadata: dict[str, str] | None = None) -> int:
    """Write a planned file, pulling arrays one at a time; returns bytes of tensor data.

    `arrays` must yield exactly the planned names, dtypes and shapes in order: the header is
    written before any data, so a mismatch is a bug, caught here rather than in the reader.
    """
    head, _ = header_bytes(entries, metadata)
    total = 0
    with open(path, "wb") as f:
        f.write(head)
        for name, dtype, shape in entries:
            got_name, array = next(arrays)
            if (got_name != name or array.dtype != np.dtype(dtype)
                    or tuple(array.shape) != tuple(shape)):
                raise SafetensorsError(f"writer expected {name} {np.dtype(dtype)} {tuple(shape)}, "
                                       f"got {got_name} {array.dtype} {tuple(array.shape)}")
            data = np.ascontiguousarray(array)
            f.write(memoryview(data.reshape(-1).view(np.uint8)))
            total += data.nbytes
    return total
