"""The real training corpus: the CPython standard library source of the running interpreter.

It is written by others (PSF licence), present wherever Python is, and needs no download, so
the shipped model pair can be reproduced offline from it. Tests and generated data are left
out (see `EXCLUDED_DIRS` / `EXCLUDED_FILE_PREFIXES`). Everything here is deterministic for a given
interpreter: files are sorted by relative path, and whether a file is held out depends only on
a SHA-256 hash of that path, so a shrunken corpus (`max_bytes`) holds out a subset of the full
corpus's held-out files and never leaks them into training.

CLI: `prove-jax corpus --out DIR [--max-bytes N] [--heldout-fraction F]` writes
DIR/train.jsonl, DIR/heldout.jsonl (records `{"path", "text"}`), DIR/heldout_prompts.jsonl
(records `{"id", "prompt", "reference"}`) and DIR/manifest.json.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import os
import sys
import sysconfig
from typing import Iterable, Iterator

from prove_jax.data.jsonl import read_jsonl
from prove_jax.errors import ProveJaxError
from prove_jax.files import atomic_dir, check_replaceable

# Directory names skipped anywhere in the tree: test suites, installed third-party packages,
# byte code, compiled extensions, build configuration and pydoc's generated topic strings.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                           "__pycache__", "lib-dynload", "pydoc_data"})
# Generated, machine-specific files (build paths of this interpreter).
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)
DEFAULT_HELDOUT_FRACTION = 0.05


class CorpusError(ProveJaxError, ValueError):
    """Bad corpus options or an unreadable corpus directory."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str   # relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> str:
    """The standard library directory of the running interpreter."""
    return sysconfig.get_paths()["stdlib"]


def _excluded(rel_parts: tuple[str, ...]) -> bool:
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel_parts[:-1]):
        return True
    return rel_parts[-1].startswith(EXCLUDED_FILE_PREFIXES)


def list_source_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the corpus's `.py` files under `root` (default: the stdlib)."""
    root = root or stdlib_root()
    if not os.path.isdir(root):
        raise CorpusError(f"corpus root is not a directory: {root}")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = () if rel_dir == "." else tuple(rel_dir.split(os.sep))
        # Prune excluded directories so os.walk never descends into them.
        dirnames[:] = [d for d in dirnames if not _excluded(parts + (d, "_"))]
        for name in filenames:
            if name.endswith(".py") and not _excluded(parts + (name,)):
                found.append("/".join(parts + (name,)))
    return sorted(found)


def path_hash_fraction(rel_path: str) -> float:
    """A stable number in [0, 1) from the path alone (same on every machine and run)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    return path_hash_fraction(rel_path) < heldout_fraction


def read_source_files(rel_paths: Iterable[str], root: str | None = None
                      ) -> tuple[list[SourceFile], list[str]]:
    """(files decoded as UTF-8, paths skipped because they are not UTF-8 text)."""
    root = root or stdlib_root()
    files, skipped = [], []
    for rel in rel_paths:
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            raw = f.read()
        try:
            files.append(SourceFile(rel, raw.decode("utf-8")))
        except UnicodeDecodeError:
            skipped.append(rel)
    return files, skipped


@dataclasses.dataclass(frozen=True)
class CorpusSplit:
    train: list[SourceFile]
    heldout: list[SourceFile]
    skipped: list[str]   # not UTF-8
    root: str


def _first_by_hash(files: list[SourceFile], budget: int) -> list[SourceFile]:
    """The files that fit `budget` UTF-8 bytes, taken in path-hash order, sorted by path."""
    chosen, total = [], 0
    for sf in sorted(files, key=lambda sf: path_hash_fraction(sf.path)):
        size = len(sf.text.encode("utf-8"))
        if total + size <= budget:
            chosen.append(sf)
            total += size
    return sorted(chosen, key=lambda sf: sf.path)


def build_corpus(root: str | None = None, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                 max_bytes: int | None = None) -> CorpusSplit:
    """Read and split the corpus.

    `max_bytes` caps the total UTF-8 size (train + held-out), each side getting its share
    (`heldout_fraction` of the bytes for held-out). Within a side files are taken in the order
    of their path hash (a fixed pseudo-random order), so a capped corpus is a representative
    sample of the library rather than its alphabetically first modules.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise CorpusError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive, got {max_bytes}")
    root = root or stdlib_root()
    rel_paths = list_source_files(root)
    if not rel_paths:
        raise CorpusError(f"no .py files found under {root}")
    files, skipped = read_source_files(rel_paths, root)
    train = [sf for sf in files if not is_heldout(sf.path, heldout_fraction)]
    heldout = [sf for sf in files if is_heldout(sf.path, heldout_fraction)]
    if max_bytes is not None:
        # Cap each side on its own: one hash order over both would fill the budget with
        # held-out files first (their hashes are the lowest), starving training.
        heldout_budget = int(max_bytes * heldout_fraction)
        train = _first_by_hash(train, max_bytes - heldout_budget)
        heldout = _first_by_hash(heldout, heldout_budget)
    if not train or not heldout:
        raise CorpusError(f"split is empty (train {len(train)} files, held-out {len(heldout)}); "
                          f"raise --max-bytes or change --heldout-fraction")
    return CorpusSplit(train, heldout, skipped, root)


# ----------------------------------------------------------------------------------------------
# Held-out completion prompts, HumanEval style: signature + docstring in, body out.

def _function_prompt(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef
                     ) -> tuple[str, str] | None:
    """(prompt, reference body) for a documented function, dedented to column 0, or None."""
    body = node.body
    if len(body) < 2 or not (isinstance(body[0], ast.Expr)
                             and isinstance(body[0].value, ast.Constant)
                             and isinstance(body[0].value.value, str)):
        return None  # no docstring, or nothing to complete after it
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    first_line = lines[start - 1]
    indent = first_line[:len(first_line) - len(first_line.lstrip())]
    doc_end, end = body[0].end_lineno, node.end_lineno
    if not lines[doc_end - 1].rstrip().endswith(('"""', "'''")):
        return None  # docstring shares its last line with code: no clean cut
    segment = lines[start - 1:end]
    dedented = []
    for line in segment:
        if line.strip() and not line.startswith(indent):
            return None  # a line left of the def (odd continuation): skip rather than mangle
        dedented.append(line[len(indent):] if line.strip() else line.lstrip(" \t"))
    cut = doc_end - start + 1
    prompt = "".join(dedented[:cut])
    reference = "".join(dedented[cut:])
    if not reference.strip():
        return None
    return prompt, reference


def function_prompts(source: SourceFile, max_prompt_chars: int = 2000,
                     max_reference_chars: int = 4000) -> list[dict]:
    """Prompt records for the documented functions and methods of one source file."""
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return []
    # ast numbers lines at \n, \r and \r\n only; str.splitlines also breaks at form feeds,
    # U+2028 and more, which would shift every later function's lines
    lines = io.StringIO(source.text, newline="").readlines()
    records = []

    def visit(node, qual: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{qual}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                cut = _function_prompt(lines, child)
                if cut is not None:
                    prompt, reference = cut
                    if len(prompt) <= max_prompt_chars and len(reference) <= max_reference_chars:
                        where = f"{source.path}:{qual}{child.name}:{child.lineno}"
                        records.append({"id": f"stdlib/{where}", "prompt": prompt,
                                        "reference": reference})
    visit(tree, "")
    return records


def heldout_prompts(heldout: Iterable[SourceFile], limit: int | None = None,
                    **kwargs) -> list[dict]:
    """Completion prompts `{"id", "prompt", "reference"}` from held-out files, in file order.

    With `limit`, prompts are spread over the files (round robin) so no single large module
    dominates a small prompt set.
    """
    per_file = [function_prompts(sf, **kwargs) for sf in heldout]
    if limit is None:
        return [r for recs in per_file for r in recs]
    out, depth = [], 0
    while len(out) < limit and any(depth < len(recs) for recs in per_file):
        for recs in per_file:
            if depth < len(recs) and len(out) < limit:
                out.append(recs[depth])
        depth += 1
    return out


# ----------------------------------------------------------------------------------------------
# Files on disk.

def _iter_records(jsonl_path: str, fields: tuple[str, ...]) -> Iterator[dict]:
    """Every record of a corpus JSONL file, each checked to have `fields`."""
    if not os.path.isfile(jsonl_path):
        raise CorpusError(f"corpus file not found: {jsonl_path}")
    for n, record in read_jsonl(jsonl_path, CorpusError):
        if isinstance(record, dict) and all(isinstance(record.get(k), str) for k in fields):
            yield record
            continue
        names = ", ".join(repr(k) for k in fields)
        raise CorpusError(f"{jsonl_path}:{n}: not a JSON record with string field(s) {names}")


def iter_texts(jsonl_path: str) -> Iterator[str]:
    """The `text` field of every record of a corpus JSONL file."""
    return (record["text"] for record in _iter_records(jsonl_path, ("text",)))


def iter_source_files(jsonl_path: str) -> Iterator[SourceFile]:
    """Every `{"path", "text"}` record of a corpus JSONL file, as a SourceFile."""
    return (SourceFile(r["path"], r["text"]) for r in _iter_records(jsonl_path, ("path", "text")))


def _write_jsonl(path: str, records: Iterable[dict]) -> str:
    sha = hashlib.sha256()
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            line = json.dumps(rec, ensure_ascii=False) + "\n"
            f.write(line)
            sha.update(line.encode("utf-8"))
    return sha.hexdigest()


def _split_summary(files: list[SourceFile], sha: str) -> dict:
    return {"files": len(files), "bytes": sum(len(sf.text.encode("utf-8")) for sf in files),
            "sha256": sha, "paths": [sf.path for sf in files]}


def write_corpus(out_dir: str, root: str | None = None,
                 heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, max_bytes: int | None = None,
                 max_prompts: int | None = 256) -> dict:
    """Build the corpus and write it to `out_dir` atomically; returns the manifest."""
    check_replaceable(out_dir, "manifest.json", "a corpus written by this tool", CorpusError)
    if max_prompts is not None and max_prompts < 0:
        raise CorpusError(f"max_prompts must be >= 0, got {max_prompts}")
    split = build_corpus(root, heldout_fraction, max_bytes)
    prompts = heldout_prompts(split.heldout, limit=max_prompts)
    with atomic_dir(out_dir) as tmp:
        train_sha = _write_jsonl(os.path.join(tmp, "train.jsonl"),
                                 ({"path": sf.path, "text": sf.text} for sf in split.train))
        heldout_sha = _write_jsonl(os.path.join(tmp, "heldout.jsonl"),
                                   ({"path": sf.path, "text": sf.text} for sf in split.heldout))
        prompts_sha = _write_jsonl(os.path.join(tmp, "heldout_prompts.jsonl"), prompts)
        manifest = {
            "source": "CPython standard library (PSF licence), tests and generated files excluded",
            "python_version": sys.version.split()[0],
            "root": split.root,
            "heldout_fraction": heldout_fraction,
            "max_bytes": max_bytes,
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "skipped_not_utf8": split.skipped,
            "train": _split_summary(split.train, train_sha),
            "heldout": _split_summary(split.heldout, heldout_sha),
            "heldout_prompts": {"records": len(prompts), "sha256": prompts_sha},
        }
        with open(os.path.join(tmp, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
    return manifest
