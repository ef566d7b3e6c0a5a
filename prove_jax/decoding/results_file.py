"""The output file of a request job: checked before any model loads, filled one whole JSON line
per finished request, locked against a second job, resumed after a kill."""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from typing import Sequence

from prove_jax.decoding.options import DecodeError
from prove_jax.decoding.request_run import RequestResult
from prove_jax.decoding.requests import ERROR_KEY
from prove_jax.files import atomic_write_text, is_stream, read_json


def check_output_path(path: str, input_path: str | None, flag: str = "--output",
                      probe: bool = True) -> None:
    """Refuse, before any model is loaded, an output that cannot or must not be written: an
    empty path, a directory, the request file itself (its requests would be replaced by the
    outputs), a path under a file, or one whose directory cannot be written. With `probe` the
    output's directory is created if missing and a file is created and removed in it (only the
    process that writes the outputs should probe)."""
    if not path:
        raise DecodeError(f"{flag} is empty; give a file path")
    if os.path.isdir(path):
        raise DecodeError(f"{flag} {path} is a directory; give a file path (in it, or elsewhere)")
    if (input_path is not None and os.path.exists(path) and os.path.exists(input_path)
            and os.path.samefile(path, input_path)):
        raise DecodeError(f"{flag} {path} is the input file; write the outputs elsewhere")
    if not probe:
        return
    if is_stream(path):
        if not os.access(path, os.W_OK):
            raise DecodeError(f"{flag} {path} is not writable")
        return
    target = os.path.realpath(path)  # a symlink's target is written: the link stays
    parent = os.path.dirname(target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:  # FileExistsError / NotADirectoryError: a file where a directory must be
        raise DecodeError(f"{flag} {path}: cannot make its directory {parent} "
                          f"({e.strerror or e})") from None
    trial = os.path.join(parent, f".tmp-{os.path.basename(target)}-probe-{uuid.uuid4().hex[:12]}")
    try:
        os.close(os.open(trial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.unlink(trial)
    except OSError as e:
        raise DecodeError(
            f"{flag} {path} cannot be written: {e.strerror or e} in {parent}"
        ) from None


def output_record(
    rid, result: RequestResult, tokenizer, logprobs: int | None = -1, **extra
) -> dict:
    """{"id", "output_ids", "text" (with a tokenizer), "finish_reason", "stop" (the stop string,
    when one ended it), "logprobs" (when asked for: `logprobs` alternatives per token, -1: as
    decoded), `extra` (e.g. truncated, request_hash), "stats"}."""
    row = {"id": rid, "output_ids": result.output_ids}
    if tokenizer is not None:
        row["text"] = result.text if result.text is not None else tokenizer.decode(
            result.output_ids, skip_special_tokens=True)
    row["finish_reason"] = result.finish_reason
    if result.stop is not None:
        row["stop"] = result.stop
    if result.logprobs is not None and logprobs is not None:
        row["logprobs"] = [_logprob_entry(t, lp, top if logprobs < 0 else top[:logprobs], tokenizer)
                           for t, (lp, top) in zip(result.output_ids, result.logprobs)]
    row.update(extra)
    row["stats"] = result.stats
    return row


def _logprob_entry(token: int, logprob: float, top, tokenizer) -> dict:
    def named(t: int, lp: float) -> dict:
        entry = {"id": int(t), "logprob": lp}
        if tokenizer is not None:
            entry["token"] = tokenizer.decode([int(t)])
        return entry
    return named(token, logprob) | {"top_logprobs": [named(t, lp) for t, lp in top]}


class ResultsFile:
    """--output filled as requests finish: one whole JSON line each, flushed, so a killed job
    leaves every finished request on disk. `start` reads what an earlier run of the job wrote
    (a line torn by the kill is cut off) so that a rerun skips those ids, once it has checked
    that they were decoded with this job's settings (kept beside the output in
    OUT.settings.json) and from the same requests (each record's `request_hash`). `lock` keeps
    a second job from writing the same file meanwhile. A stream (/dev/stdout, a FIFO) is written
    into, without resuming."""

    def __init__(self, path: str):
        self.path = path
        self.stream = is_stream(path)
        self.settings_path = f"{path}.settings.json"
        self._file = None
        self._lock = None

    def lock(self) -> None:
        """Hold the output for this job (an advisory lock on OUT.lock, released when the process
        ends); a job already holding it makes this a one-line error."""
        if self.stream:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
        f = open(f"{self.path}.lock", "a+", encoding="utf-8")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another job"
            f.close()
            raise DecodeError(f"--output {self.path} is being written by {holder}; wait for it to "
                              f"finish, or write elsewhere") from None
        f.seek(0)
        f.truncate()
        f.write(f"prove-jax generate (pid {os.getpid()})\n")
        f.flush()
        self._lock = f

    def start(self, settings: dict, hashes: dict, overwrite: bool = False) -> dict:
        """{id: record} of the requests an earlier run already decoded (see `done`), after
        checking that it ran with `settings` and that each of those ids still names the request
        whose `request_hash` is in `hashes`; a mismatch is an error naming what differs. With
        `overwrite` the file starts over. Records this job's settings beside the output."""
        if self.stream:
            return {}
        if overwrite:
            for path in (self.path, self.settings_path):
                if os.path.isfile(path):
                    os.unlink(path)
        done = self.done()
        if done:
            self._check_settings(settings, len(done))
            changed = [
                rid
                for rid, rec in done.items()
                if rid in hashes and rec.get("request_hash") != hashes[rid]
            ]
            if changed:
                more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
                raise DecodeError(
                    f"--output {self.path}: request {changed[0]!r}{more} is not the request its "
                    f"record there was decoded from (its prompt or fields changed); "
                    f"--overwrite starts over"
                )
        atomic_write_text(self.settings_path, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        return done

    def _check_settings(self, settings: dict, count: int) -> None:
        try:
            saved = read_json(self.settings_path)
        except (OSError, ValueError):
            raise DecodeError(
                f"--output {self.path} holds {count} records but not the settings they were "
                f"decoded with ({self.settings_path} is missing or unreadable): --overwrite "
                f"starts over, or write elsewhere"
            ) from None
        differ = [k for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
        if differ:
            was = ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
            now = ", ".join(f"{k}={settings.get(k)!r}" for k in differ)
            raise DecodeError(
                f"--output {self.path} holds records decoded with {was}; this run has {now}: "
                f"rerun with those settings to resume, or --overwrite to start over"
            )

    def done(self) -> dict:
        """{id: record} of the requests already decoded in the file; cuts off a torn last line
        and drops the records of requests that failed (a rerun tries them again)."""
        records = self._read()
        failed = [k for k, rec in records.items() if ERROR_KEY in rec]
        if failed:
            for k in failed:
                del records[k]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in records.values()))
        return records

    def _read(self) -> dict:
        """{id: record} of every record in the file; cuts off a line torn by a kill."""
        if self.stream or not os.path.isfile(self.path):
            return {}
        with open(self.path, "rb") as f:
            data = f.read()
        records, good = {}, 0
        for line in data.splitlines(keepends=True):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("torn")
                rec = json.loads(line)
                if not isinstance(rec, dict) or "id" not in rec:
                    raise ValueError("not a record")
            except ValueError:
                if good + len(line) < len(data):
                    raise DecodeError(
                        f"--output {self.path} holds a line that is not an output record "
                        f"(byte {good}); give a new output file, or delete this one"
                    ) from None
                break
            records[rec["id"]] = rec
            good += len(line)
        if good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return records

    def write(self, record: dict) -> None:
        if self._file is None:
            if not self.stream:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
            self._file = open(self.path, "a" if not self.stream else "w", encoding="utf-8")
        self._file.write(json.dumps(record) + "\n")  # one write of a whole line
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._lock is not None:
            os.unlink(self._lock.name)
            self._lock.close()  # closing releases the lock
            self._lock = None

    def sort(self, ids: Sequence) -> None:
        """Rewrite the file (atomically) with its records in the order of `ids`."""
        if self.stream:
            return
        records = self._read()
        lines = [json.dumps(records[i]) for i in ids if i in records]
        atomic_write_text(self.path, "\n".join(lines) + "\n" if lines else "")
