"""Decoding a list of requests: in chunks of one compiled program (`run_requests`) or as a
stream (`RequestStream`), each cut at its first stop string, with per-request stats and the
run's summary."""

from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import numpy as np

from prove_jax.decoding.engine import BatchResult, Decoder
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.options import DecodeError, DecodeOptions
from prove_jax.decoding.sampling import GREEDY, SamplingParams
from prove_jax.decoding.stopping import StopStrings
from prove_jax.decoding.stream import RequestOutput


def request_stats(result: BatchResult, i: int) -> dict:
    return decode_stats(
        len(result.output_ids[i]),
        int(result.forwards[i]),
        int(result.verifier_forwards[i]),
        result.accept_hist[i].tolist(),
    )


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
    result = RequestResult(
        output_ids=ids,
        finish_reason=batch.finish_reasons[i],
        stats=request_stats(batch, i),
        logprobs=None if batch.logprobs is None else batch.logprobs[i],
    )
    if not params.stop:
        return result
    stops = _stop_strings(params, tokenizer)
    commits = batch.step_commits[i] if batch.step_commits is not None else None
    return (
        cut_at_stop(result, stops, commits)
        if feed_blocks(stops, ids, commits or [len(ids)])
        else result
    )


def stream_result(out: RequestOutput, stops: StopStrings | None) -> RequestResult:
    """A streamed request's result, cut where `stops` (fed its blocks as they came) found a
    stop string."""
    result = RequestResult(
        output_ids=out.output_ids,
        finish_reason=out.finish_reason,
        logprobs=out.logprobs,
        stats=decode_stats(
            len(out.output_ids), out.forwards, out.verifier_forwards, out.accept_hist
        ),
    )
    return (
        result
        if stops is None or not stops.stopped
        else cut_at_stop(result, stops, out.step_commits)
    )


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
    # the forwards a cut output took
    if any(p.stop for p in params) and not decoder.options.record_steps:
        decoder = decoder.with_options(dataclasses.replace(decoder.options, record_steps=True))
    ran = set()
    results = []
    seconds = compile_s = 0.0
    width = max(len(p) for p in prompts)
    chunk_size = min(len(prompts), QUEUE_BATCHES * batch_size)
    for start in range(0, len(prompts), chunk_size):
        chunk = list(prompts[start: start + chunk_size])
        chunk_params = params[start: start + chunk_size]
        result = decoder.generate(
            chunk,
            max_new_tokens,
            batch_size=batch_size,
            prompt_width=width,
            queue_size=chunk_size,
            params=[device_params(p) for p in chunk_params],
        )
        ran.add(describe_options(result.options))
        seconds += result.seconds
        compile_s += result.compile_seconds
        results += [_result(result, i, p, tokenizer) for i, p in enumerate(chunk_params)]
        if progress:
            done = sum(len(r.output_ids) for r in results)
            print(f"[{len(results)}/{len(prompts)} requests] {done} tokens, {seconds:.2f}s decode, "
                  f"{compile_s:.1f}s compile", file=sys.stderr, flush=True)
    return results, summarize(
        results, decoder.options.mode, ", ".join(sorted(ran)), seconds, compile_s
    )


def describe_options(options: DecodeOptions) -> str:
    """What a decode call ran, e.g. 'lossless K=6,G=2', 'verify K=8,top1', 'ar'."""
    if options.mode == "ar":
        return "ar"
    k = options.block_size
    if options.mode == "lossless":
        return f"lossless K={k},G={LosslessLayout.build(k, options.lossless.max_groups).num_groups}"
    if options.mode == "verify":
        return f"verify K={k},{options.verify.commit_rule}"
    return (
        f"threshold K={k},{options.threshold.confidence}>={options.threshold.tau:g}"
        if options.threshold.confidence != "entropy"
        else f"threshold K={k},entropy<={options.threshold.tau:g}"
    )
