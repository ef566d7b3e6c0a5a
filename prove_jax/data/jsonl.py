"""JSON Lines input: the one reader behind training data, corpus files and request files.

Records end at "\n" only. `str.splitlines` (and text-mode files' universal newlines) also break
at characters that `json.dumps(ensure_ascii=False)` leaves raw inside strings (U+2028, U+2029,
U+0085), which corpus.py writes, so the file is read as bytes and split at b"\n". Each line is
decoded on its own, so a byte that is not UTF-8 is named with its line; a leading BOM (editors
on Windows write one) is not part of the first record.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, BinaryIO, Iterator


def read_jsonl(source: str | os.PathLike | BinaryIO, error: type[Exception],
               name: str | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON value) of every non-blank line of `source`, a path or an open
    binary file (standard input's buffer); a line that is not UTF-8 or not JSON raises `error`
    as "NAME:LINE: ..." (NAME: `name`, else the path; the caller checks the record's shape)."""
    is_file = hasattr(source, "read")
    path = name or source
    with contextlib.nullcontext(source) if is_file else open(source, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                hint = (" (JSON Lines: one object per line, not one JSON array)"
                        if n == 1 and line.lstrip().startswith("[") else "")
                raise error(f"{path}:{n}: not valid JSON ({e.msg}){hint}") from None
