"""Request files for batch inference: the JSON Lines records read in, each checked once
(its prompt, its fields, their values), and the token ids of their prompts.

Decoding them is `request_run.py`; the output file they fill is `results_file.py`.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import sys
from typing import Sequence

from prove_jax.decoding.engine import request_seed
from prove_jax.decoding.options import MAX_LOGPROBS, DecodeError
from prove_jax.decoding.sampling import SamplingParams
from prove_jax.data.chat import chat_prompt_ids
from prove_jax.data.jsonl import read_jsonl


ERROR_KEY = "error"  # an output record's field naming why its request was not decoded


def read_requests(path: str, strict: bool = True, defaults: SamplingParams | None = None,
                  base_seed: int = 0) -> list[dict]:
    """Records {"id", "prompt"} or {"id", "prompt_ids": [...]}, one JSON object per line
    (`path` "-": standard input).

    A record without an id gets its index among the records; ids must be unique (outputs are
    matched to requests by id), strings or integers. A default id that another record already
    has is an error telling the two apart (give every record an id), not a renumbering.
    `prompt_ids` must be a non-empty list of non-negative integers (whether they are within the
    model's vocabulary is checked once it is loaded). With `strict` off, a record whose prompt is
    missing or malformed is kept with its problem under ERROR_KEY instead of stopping the job
    (file-level problems, such as bad JSON or duplicate ids, still stop it). A record's fields
    are checked too (`record_problem`: unknown names, and with `defaults` their values), each
    line before the next is read, so a strict job stops at the first bad line.
    """
    if path != "-" and not os.path.exists(path):
        raise DecodeError(f"input file not found: {path}")
    if os.path.isdir(path):
        raise DecodeError(f"input {path} is a directory; give a JSON Lines file of requests")
    records, line_of_id, defaulted = [], {}, set()
    source = sys.stdin.buffer if path == "-" else path
    for lineno, rec in read_jsonl(source, DecodeError, name="<stdin>" if path == "-" else path):
        where = f"{'<stdin>' if path == '-' else path}:{lineno}"
        if isinstance(rec, list) and rec and all(isinstance(r, dict) for r in rec):
            raise DecodeError(f"{where}: a JSON array of records; JSON Lines has one record "
                              f"(a JSON object) per line")
        if not isinstance(rec, dict):
            raise DecodeError(f"{where}: a record needs 'prompt' (text) or 'prompt_ids'")
        problem = record_problem(rec, defaults, len(records), base_seed)
        if problem is not None:
            if strict:
                raise DecodeError(f"{where}: {problem}")
            rec = {k: rec[k] for k in ("id",) if k in rec} | {ERROR_KEY: f"{where}: {problem}"}
        has_id = "id" in rec
        rec.setdefault("id", len(records))
        rid = rec["id"]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise DecodeError(f"{where}: 'id' must be a string or an integer, got {rid!r}")
        if rid in line_of_id:
            first = line_of_id[rid]
            if not has_id:
                raise DecodeError(
                    f"{where}: this record has no 'id', and its default id {rid!r} "
                    f"(its index) is already used on line {first}: give every record an id"
                )
            if rid in defaulted:
                raise DecodeError(
                    f"{where}: duplicate id {rid!r} (the record on line {first} has no "
                    f"'id' and got {rid!r}, its index, by default): give every record an id"
                )
            raise DecodeError(f"{where}: duplicate id {rid!r} (first on line {first})")
        line_of_id[rid] = lineno
        if not has_id:
            defaulted.add(rid)
        records.append(rec)
    if not records:
        raise DecodeError(f"input file {path} has no records")
    return records


def _prompt_problem(rec: dict) -> str | None:
    """What is wrong with a request record's prompt fields, or None."""
    if "prompt" not in rec and "prompt_ids" not in rec:
        return "a record needs 'prompt' (text) or 'prompt_ids'"
    if "prompt" in rec and "prompt_ids" in rec:
        return "give 'prompt' or 'prompt_ids', not both"
    if "prompt" in rec and not isinstance(rec["prompt"], str):
        return "'prompt' must be a string (token ids go in 'prompt_ids')"
    if "prompt_ids" in rec:
        return prompt_ids_problem(rec["prompt_ids"])
    return None


# Fields of a request record that override the job's SamplingParams for that request.
PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
# Names other tools give the same control (OpenAI's completions API), read as ours.
FIELD_ALIASES = {"max_tokens": "max_new_tokens"}
# Carried in the record, not read by decoding: free-form `metadata`, and the reference answer
# and grader that `prove-jax benchmark` scores a completion with (evaluation/graders.py).
DATA_FIELDS = ("metadata", "answer", "grader")
RECORD_FIELDS = (
    ("id", "prompt", "prompt_ids", "logprobs") + PARAM_FIELDS + tuple(FIELD_ALIASES) + DATA_FIELDS
)


def record_problem(rec: dict, defaults: SamplingParams | None = None, index: int = 0,
                   base_seed: int = 0) -> str | None:
    """What is wrong with a request record, or None: its prompt, a field no request has (named
    with the nearest valid one: a typo would otherwise be ignored), and with `defaults` the
    values of its sampling fields and `logprobs`."""
    for key in rec:
        if key not in RECORD_FIELDS:
            near = difflib.get_close_matches(key, RECORD_FIELDS, n=1, cutoff=0.6)
            return (f"unknown field {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                    + f"; a request's fields are {', '.join(RECORD_FIELDS)}")
    for alias, name in FIELD_ALIASES.items():
        if alias in rec and name in rec:
            return f"give {name!r} or {alias!r} (the same control), not both"
    problem = _prompt_problem(rec)
    if problem is None and defaults is not None:
        try:
            request_params(rec, defaults, index, base_seed)
            request_logprobs(rec, None)
        except DecodeError as e:
            problem = str(e)
    return problem


def request_params(
    rec: dict, defaults: SamplingParams, index: int, base_seed: int
) -> SamplingParams:
    """The record's own SamplingParams: `defaults` (the command line's) overridden by the
    record's fields of those names (or their aliases, `max_tokens`); a request with no seed gets
    request_seed(base_seed, index), its position in the file. Raises DecodeError naming the
    field."""
    rec = {FIELD_ALIASES.get(k, k): v for k, v in rec.items()}
    given = {k: rec[k] for k in PARAM_FIELDS if k in rec and rec[k] is not None}
    for key in ("stop", "stop_token_ids"):
        if isinstance(given.get(key), list):
            given[key] = tuple(given[key])
        # one of them, as OpenAI allows
        elif isinstance(given.get(key), str if key == "stop" else int):
            given[key] = (given[key],)
    params = dataclasses.replace(defaults, **given).validate()
    if params.seed is None:
        params = dataclasses.replace(params, seed=request_seed(base_seed, index))
    return params


def request_logprobs(rec: dict, default: int | None) -> int | None:
    """Alternatives per token the record's logprobs ask for (its own `logprobs` field, else the
    job's `default`; None: no logprobs)."""
    n = rec.get("logprobs", default)
    if n is None or n is False:
        return None
    if n is True:
        return default or 0
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS:
        raise DecodeError(f"logprobs must be an integer between 0 and {MAX_LOGPROBS} (alternatives "
                          f"per token), or true/false, got {n!r}")
    return n


def request_controls(
    records: Sequence[dict], defaults: SamplingParams, default_logprobs: int | None, base_seed: int
) -> tuple[list[SamplingParams | None], list[int | None]]:
    """Each record's SamplingParams and logprobs count (None for a record that failed already),
    from records `read_requests` checked with the same `defaults`: their values were validated
    there, so this only reads them."""
    ok = [ERROR_KEY not in rec for rec in records]
    params = [request_params(rec, defaults, i, base_seed) if good else None
              for i, (rec, good) in enumerate(zip(records, ok))]
    logprobs = [
        request_logprobs(rec, default_logprobs) if good else None for rec, good in zip(records, ok)
    ]
    return params, logprobs


def prompt_ids_problem(ids) -> str | None:
    """What is wrong with a record's `prompt_ids`, or None: a non-empty list of integers >= 0."""
    # bool is an int subclass: `true` would decode as token 1
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        return f"'prompt_ids' must be a list of integers (token ids), got {json.dumps(ids)[:80]}"
    if not ids:
        return "'prompt_ids' is empty"
    if min(ids) < 0:
        return f"'prompt_ids' has a negative token id {min(ids)}"
    return None


def encode_prompts(
    records: Sequence[dict],
    tokenizer,
    chat: bool = False,
    strict: bool = True,
    enable_thinking: bool | None = None,
) -> list[list[int] | None]:
    """Token ids of each record's prompt. With `strict` off, a record that cannot be encoded
    gets its problem under ERROR_KEY and None here (records already failed stay None).
    `enable_thinking`: with `chat`, the template's thinking switch (Qwen3's; data/chat.py)."""
    prompts = []
    for rec in records:
        if ERROR_KEY in rec:
            prompts.append(None)
            continue
        if "prompt" in rec and tokenizer is None:
            problem = (
                "has a text prompt but the checkpoint has no tokenizer; give prompt_ids instead"
            )
            if strict:
                raise DecodeError(f"request {rec['id']!r} {problem}")
            rec[ERROR_KEY] = f"the request {problem}"
            prompts.append(None)
            continue
        if "prompt_ids" in rec:
            problem = prompt_ids_problem(rec["prompt_ids"])
            if problem:
                raise DecodeError(f"request {rec['id']!r}: {problem}")
            prompts.append(rec["prompt_ids"])
            continue
        text = rec["prompt"]
        if chat and not getattr(tokenizer, "chat_template", None):
            raise DecodeError(
                "--chat: the checkpoint's tokenizer has no chat template; drop --chat "
                "or give prompts already in the model's chat format"
            )
        if chat:
            ids = chat_prompt_ids(tokenizer, text, enable_thinking)
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(list(ids))
    return prompts


def request_hash(rec: dict) -> str:
    """A digest of what a request asks (its prompt and controls, not its id or carried data):
    a resumed job checks that a finished id still names the same request."""
    asked = {k: v for k, v in rec.items() if k not in ("id", ERROR_KEY) + DATA_FIELDS}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:16]


def error_record(rec: dict) -> dict:
    return {"id": rec["id"], ERROR_KEY: rec[ERROR_KEY]}
