"""Request files for batch inference: JSONL in, JSONL out (atomically), per-request stats."""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import hashlib
import json
import os
import sys
import uuid
from typing import Sequence

import numpy as np

from prove_jax.files import atomic_write_text, is_stream
from prove_jax.decoding.engine import BatchResult, Decoder, request_seed
from prove_jax.decoding.options import MAX_LOGPROBS, DecodeError, DecodeOptions
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.sampling import GREEDY, SamplingParams
from prove_jax.decoding.stopping import StopStrings
from prove_jax.decoding.stream import RequestOutput
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
                raise DecodeError(f"{where}: this record has no 'id', and its default id {rid!r} "
                                  f"(its index) is already used on line {first}: give every record an id")
            if rid in defaulted:
                raise DecodeError(f"{where}: duplicate id {rid!r} (the record on line {first} has no "
                                  f"'id' and got {rid!r}, its index, by default): give every record an id")
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
RECORD_FIELDS = ("id", "prompt", "prompt_ids", "logprobs") + PARAM_FIELDS + tuple(FIELD_ALIASES) + DATA_FIELDS


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


def request_params(rec: dict, defaults: SamplingParams, index: int, base_seed: int) -> SamplingParams:
    """The record's own SamplingParams: `defaults` (the command line's) overridden by the
    record's fields of those names (or their aliases, `max_tokens`); a request with no seed gets
    request_seed(base_seed, index), its position in the file. Raises DecodeError naming the
    field."""
    rec = {FIELD_ALIASES.get(k, k): v for k, v in rec.items()}
    given = {k: rec[k] for k in PARAM_FIELDS if k in rec and rec[k] is not None}
    for key in ("stop", "stop_token_ids"):
        if isinstance(given.get(key), list):
            given[key] = tuple(given[key])
        elif isinstance(given.get(key), str if key == "stop" else int):  # one of them, as OpenAI allows
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


def prompt_ids_problem(ids) -> str | None:
    """What is wrong with a record's `prompt_ids`, or None: a non-empty list of integers >= 0."""
    # bool is an int subclass: `true` would decode as token 1
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return f"'prompt_ids' must be a list of integers (token ids), got {json.dumps(ids)[:80]}"
    if not ids:
        return "'prompt_ids' is empty"
    if min(ids) < 0:
        return f"'prompt_ids' has a negative token id {min(ids)}"
    return None


def encode_prompts(records: Sequence[dict], tokenizer, chat: bool = False,
                   strict: bool = True, enable_thinking: bool | None = None) -> list[list[int] | None]:
    """Token ids of each record's prompt. With `strict` off, a record that cannot be encoded
    gets its problem under ERROR_KEY and None here (records already failed stay None).
    `enable_thinking`: with `chat`, the template's thinking switch (Qwen3's; data/chat.py)."""
    prompts = []
    for rec in records:
        if ERROR_KEY in rec:
            prompts.append(None)
            continue
        if "prompt" in rec and tokenizer is None:
            problem = "has a text prompt but the checkpoint has no tokenizer; give prompt_ids instead"
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
            raise DecodeError("--chat: the checkpoint's tokenizer has no chat template; drop --chat "
                              "or give prompts already in the model's chat format")
        if chat:
            ids = chat_prompt_ids(tokenizer, text, enable_thinking)
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        prompts.append(list(ids))
    return prompts


def request_stats(result: BatchResult, i: int) -> dict:
    return decode_stats(len(result.output_ids[i]), int(result.forwards[i]), int(result.verifier_forwards[i]),
                        result.accept_hist[i].tolist())


def decode_stats(n_out: int, forwards: int, verifier_forwards: int, accept_hist: list[int]) -> dict:
    return {
        "generated_tokens": n_out,
        "proposer_forwards": forwards,
        "verifier_forwards": verifier_forwards,
        "tokens_per_forward": n_out / forwards if forwards else 0.0,
        "accept_hist": accept_hist,
    }


@dataclasses.dataclass
class RequestResult:
    """One decoded request, as its output record reports it."""
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS, a stop token or a stop string) or "length"
    stats: dict
    text: str | None = None  # set when a stop string cut the output (else decoded on writing)
    stop: str | None = None  # the stop string that ended it
    # with --logprobs: per output token (logprob, [(id, logprob), ...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


def _stop_strings(params: SamplingParams, tokenizer) -> StopStrings:
    if tokenizer is None:
        raise DecodeError("stop strings need the checkpoint's tokenizer (this one has none); "
                          "use stop_token_ids")
    return StopStrings(tokenizer, params.stop)


def device_params(params: SamplingParams) -> SamplingParams:
    """What the compiled loop reads of a request's params: all but its stop strings, which are
    found on the host's text (the Decoder refuses them, as it would otherwise ignore them)."""
    return dataclasses.replace(params, stop=()) if params.stop else params


def feed_blocks(stops: StopStrings, ids: Sequence[int], blocks: Sequence[int]) -> bool:
    """Feed `ids` to `stops` block by block, as decoding committed them; whether one stopped it
    (a stop string is looked for as each block arrives, so the cut never depends on block size)."""
    start = 0
    for n in blocks:
        if stops.feed(ids[start: start + n]):
            return True
        start += n
    return False


def cut_at_stop(result: RequestResult, stops: StopStrings, step_commits: Sequence[int] | None
                 ) -> RequestResult:
    """`result` ended where `stops` (fed its blocks) found the first stop string. Its stats
    count what it returns: the kept tokens and the forwards that committed them (from
    `step_commits`, tokens per forward; without them every forward the row ran)."""
    kept = len(stops.ids)
    stats = dict(result.stats)
    ran, forwards = stats["proposer_forwards"], stats["proposer_forwards"]
    if step_commits is not None:
        done = np.cumsum(np.asarray(step_commits, np.int64))
        forwards = min(ran, int(np.searchsorted(done, kept)) + 1) if kept else 0
    stats.update(generated_tokens=kept, proposer_forwards=forwards,
                 discarded_tokens=len(result.output_ids) - kept,
                 tokens_per_forward=kept / forwards if forwards else 0.0)
    if stats["verifier_forwards"]:  # one verifier forward a step
        stats["verifier_forwards"] = max(0, stats["verifier_forwards"] - (ran - forwards))
    return dataclasses.replace(result, output_ids=result.output_ids[:kept], finish_reason="stop",
                               text=stops.text, stop=stops.stopped_by, stats=stats,
                               logprobs=None if result.logprobs is None else result.logprobs[:kept])


def _result(batch: BatchResult, i: int, params: SamplingParams, tokenizer) -> RequestResult:
    """Request i of a decode call, cut at its first stop string (found on the decoded text as
    the committed blocks arrive; needs a tokenizer)."""
    ids = batch.output_ids[i]
    result = RequestResult(output_ids=ids, finish_reason=batch.finish_reasons[i], stats=request_stats(batch, i),
                           logprobs=None if batch.logprobs is None else batch.logprobs[i])
    if not params.stop:
        return result
    stops = _stop_strings(params, tokenizer)
    commits = batch.step_commits[i] if batch.step_commits is not None else None
    return cut_at_stop(result, stops, commits) if feed_blocks(stops, ids, commits or [len(ids)]) else result


def stream_result(out: RequestOutput, stops: StopStrings | None) -> RequestResult:
    """A streamed request's result, cut where `stops` (fed its blocks as they came) found a
    stop string."""
    result = RequestResult(output_ids=out.output_ids, finish_reason=out.finish_reason, logprobs=out.logprobs,
                           stats=decode_stats(len(out.output_ids), out.forwards, out.verifier_forwards,
                                              out.accept_hist))
    return result if stops is None or not stops.stopped else cut_at_stop(result, stops, out.step_commits)


def summarize(results: Sequence[RequestResult], mode: str, setting: str, seconds: float,
              compile_seconds: float) -> dict:
    """Throughput and counts of finished requests: the summary a run prints and writes."""
    stats = [r.stats for r in results]
    total = sum(s["generated_tokens"] for s in stats)
    fwd = sum(s["proposer_forwards"] for s in stats)
    return {"mode": mode, "setting": setting, "requests": len(results), "generated_tokens": total,
            "decode_seconds": seconds, "compile_seconds": compile_seconds,
            "tokens_per_second": total / seconds if seconds else 0.0,
            "tokens_per_forward": total / fwd if fwd else 0.0, "proposer_forwards": fwd,
            "verifier_forwards": sum(s["verifier_forwards"] for s in stats)}


class RequestStream:
    """Decode requests through `Decoder.stream`: iterate for (StreamEvent, RequestResult or
    None until that request finished). Stop strings are looked for as each block arrives; at
    the first, the request finishes at the end of that chunk (its row is free for the next
    request) and its result is cut there, its stats counting only what it returns."""

    def __init__(self, decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batch_size: int, params: Sequence[SamplingParams] | None = None, tokenizer=None,
                 chunk_steps: int = 16, log=None):
        self.params = list(params) if params is not None else [GREEDY] * len(prompts)
        self.stops = {i: _stop_strings(p, tokenizer) for i, p in enumerate(self.params) if p.stop}
        if self.stops and not decoder.options.record_steps:  # the forwards a cut output took
            decoder = decoder.with_options(dataclasses.replace(decoder.options, record_steps=True))
        self.stream = decoder.stream(prompts, max_new_tokens, batch_size=batch_size,
                                     params=[device_params(p) for p in self.params],
                                     chunk_steps=chunk_steps, log=log)

    def __iter__(self):
        for event in self.stream:
            stops = self.stops.get(event.index)
            if stops is not None and not stops.stopped and \
                    feed_blocks(stops, event.new_ids, event.blocks or [len(event.new_ids)]):
                self.stream.cancel(event.index)
            yield event, None if event.output is None else self._result(event.index, event.output)

    def _result(self, index: int, out: RequestOutput) -> RequestResult:
        return stream_result(out, self.stops.get(index))

    def summary(self, results: Sequence[RequestResult]) -> dict:
        """Throughput and counts of `results` (this stream's finished requests)."""
        return summarize(results, self.stream.options.mode, describe_options(self.stream.options),
                         self.stream.seconds, self.stream.compile_seconds)


QUEUE_BATCHES = 16  # requests per generate call = this many batches (progress + bounded buffers)


def run_requests(decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batch_size: int, progress: bool = True, ids: Sequence | None = None,
                 params: Sequence[SamplingParams] | None = None, tokenizer=None
                 ) -> tuple[list[RequestResult], dict]:
    """Decode all prompts with `batch_size` rows and continuous batching (see queue.py).

    Requests go to the device in chunks of QUEUE_BATCHES * batch_size, all padded to one prompt
    width and queue size (one compiled program); progress is printed after each chunk. `ids`
    (the request ids) name a bad prompt in errors; `params` (default greedy) are each request's
    sampling and controls, `tokenizer` finds stop strings. The summary's `setting` says what
    ran: the adaptive and calibrated settings may choose a narrower layout, or AR, for the batch.
    """
    if batch_size < 1:
        raise DecodeError(f"batch size must be >= 1, got {batch_size}")
    params = list(params) if params is not None else [GREEDY] * len(prompts)
    budgets = [p.max_new_tokens or max_new_tokens for p in params]
    decoder.check_prompts(prompts, budgets, names=ids)
    if any(p.stop for p in params) and not decoder.options.record_steps:  # the forwards a cut output took
        decoder = decoder.with_options(dataclasses.replace(decoder.options, record_steps=True))
    ran = set()
    results = []
    seconds = compile_s = 0.0
    width = max(len(p) for p in prompts)
    chunk_size = min(len(prompts), QUEUE_BATCHES * batch_size)
    for start in range(0, len(prompts), chunk_size):
        chunk = list(prompts[start: start + chunk_size])
        chunk_params = params[start: start + chunk_size]
        result = decoder.generate(chunk, max_new_tokens, batch_size=batch_size, prompt_width=width,
                                  queue_size=chunk_size, params=[device_params(p) for p in chunk_params])
        ran.add(describe_options(result.options))
        seconds += result.seconds
        compile_s += result.compile_seconds
        results += [_result(result, i, p, tokenizer) for i, p in enumerate(chunk_params)]
        if progress:
            done = sum(len(r.output_ids) for r in results)
            print(f"[{len(results)}/{len(prompts)} requests] {done} tokens, {seconds:.2f}s decode, "
                  f"{compile_s:.1f}s compile", file=sys.stderr, flush=True)
    return results, summarize(results, decoder.options.mode, ", ".join(sorted(ran)), seconds, compile_s)


def describe_options(options: DecodeOptions) -> str:
    """What a decode call ran, e.g. 'lossless K=6,G=2', 'verify K=8,top1', 'ar'."""
    if options.mode == "ar":
        return "ar"
    k = options.block_size
    if options.mode == "lossless":
        return f"lossless K={k},G={LosslessLayout.build(k, options.max_groups).num_groups}"
    if options.mode == "verify":
        return f"verify K={k},{options.commit_rule}"
    return f"threshold K={k},{options.confidence}>={options.tau:g}" if options.confidence != "entropy" \
        else f"threshold K={k},entropy<={options.tau:g}"


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
        raise DecodeError(f"{flag} {path} cannot be written: {e.strerror or e} in {parent}") from None


def output_record(rid, result: RequestResult, tokenizer, logprobs: int | None = -1, **extra) -> dict:
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


def request_hash(rec: dict) -> str:
    """A digest of what a request asks (its prompt and controls, not its id or carried data):
    a resumed job checks that a finished id still names the same request."""
    asked = {k: v for k, v in rec.items() if k not in ("id", ERROR_KEY) + DATA_FIELDS}
    return hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()[:16]


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
            changed = [rid for rid, rec in done.items() if rid in hashes and rec.get("request_hash") != hashes[rid]]
            if changed:
                more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
                raise DecodeError(f"--output {self.path}: request {changed[0]!r}{more} is not the request its "
                                  f"record there was decoded from (its prompt or fields changed); "
                                  f"--overwrite starts over")
        atomic_write_text(self.settings_path, json.dumps(settings, indent=1, sort_keys=True) + "\n")
        return done

    def _check_settings(self, settings: dict, count: int) -> None:
        try:
            with open(self.settings_path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            raise DecodeError(f"--output {self.path} holds {count} records but not the settings they were "
                              f"decoded with ({self.settings_path} is missing or unreadable): --overwrite "
                              f"starts over, or write elsewhere") from None
        differ = [k for k in sorted(set(saved) | set(settings)) if saved.get(k) != settings.get(k)]
        if differ:
            was = ", ".join(f"{k}={saved.get(k)!r}" for k in differ)
            now = ", ".join(f"{k}={settings.get(k)!r}" for k in differ)
            raise DecodeError(f"--output {self.path} holds records decoded with {was}; this run has {now}: "
                              f"rerun with those settings to resume, or --overwrite to start over")

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
                    raise DecodeError(f"--output {self.path} holds a line that is not an output record "
                                      f"(byte {good}); give a new output file, or delete this one") from None
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


def error_record(rec: dict) -> dict:
    return {"id": rec["id"], ERROR_KEY: rec[ERROR_KEY]}
