"""Side-by-side decoding measurements: our modes and the transformers peers on one prompt set.

Shared by `prove-jax demo` (AR and lossless, optionally the lossy modes, batch 1) and
`prove-jax benchmark` (sweeps, batch sizes, peers, repeats). Conventions, so that every ratio in
a table means the same thing:

- **Outputs** are compared in one form: the new ids up to and including the first EOS (which
  is mapped to the model's first EOS id). Our engine keeps the EOS; transformers peers drop it,
  so a peer row that stopped before `max_new_tokens` gets it back (`peer_sequence`).
- **Throughput** = generated tokens (that form, summed over prompts) / wall seconds of the
  decode calls, measured after a warm-up call per (setting, batch size); compile time is
  reported separately and never timed. Each setting is timed `repeats` times, interleaved with
  the other settings of the same batch size (rotated order), and the median is used, so slow
  phases of a shared machine hit every setting alike.
- **Batching**: at batch size B our settings serve the whole prompt set as one queue with B
  rows (continuous batching: a row that finishes takes the next prompt inside the compiled
  loop); the transformers peers run static batches of B prompts, as `generate` does.
- **Speedup** is against our `ar` measured in the same run at the same batch size.
- **Agreement with AR**: token level = same token at the same output position (denominator:
  the longer of the two sequences), exact = whole sequence identical. Both against our `ar`
  at the same batch size.
- **Accuracy**: over the prompts whose record carries a reference answer (`graders`; HumanEval
  prompts carry theirs implicitly), correct / graded, with a Wilson 95% interval. Each distinct
  completion is graded once; lossless rows, whose outputs are AR's, get AR's accuracy exactly.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

from prove_jax.checkpoints.convert import flax_to_hf
from prove_jax.decoding.requests import encode_prompts
from prove_jax.evaluation import humaneval, peers
from prove_jax.evaluation.model_pair import ModelPair
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.records import (PREFILL_LABEL, add_decode_only, add_vs_lossless,
                                          make_record)
from prove_jax.evaluation.runners import Measurement, OurRunner, PeerRunner, measure_batch
from prove_jax.evaluation.sweep import BenchError, Setting, ar_setting
from prove_jax.profiling import StepProfile


def humaneval_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
    """The first `limit` HumanEval prompts, encoded as `prove-jax benchmark` and `generate` do."""
    return encode_prompts(humaneval.prompt_records(humaneval.load_problems(limit=limit)), tokenizer)


def long_prompts(prompts: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """Each prompt led by the tokens of the prompts after it (cyclically) until it is `length`
    tokens long, itself last: long-context prompts of real text for timing. A prompt already that
    long is kept whole."""
    out = []
    for i, p in enumerate(prompts):
        lead: list[int] = []
        j = i
        while len(lead) + len(p) < length:
            j = (j + 1) % len(prompts)
            lead = list(prompts[j]) + lead
        out.append(lead[len(lead) + len(p) - length:] + list(p))  # no lead: p whole
    return out


def convert_for_peers(pair: ModelPair, out_dir: str, need_draft: bool,
                      progress: Callable[[str], None] = log) -> dict:
    """HF copies (float32) of our checkpoints via our flax-to-hf converter, loaded in torch."""
    peers._torch()  # a clear error when torch is missing
    out = {}
    names = [("proposer", pair.proposer_path)]
    if need_draft:
        names.append(("verifier", pair.verifier_path))
    for name, path in names:
        if path is None:
            raise BenchError(f"peer runs need a {name} checkpoint")
        hf_dir = os.path.join(out_dir, name)
        progress(f"converting {name} to HF format for the transformers peers -> {hf_dir}")
        flax_to_hf(path, hf_dir, dtype="float32", overwrite=True)
        out[name] = peers.load_hf_model(hf_dir)
    return out


def run_settings(pair: ModelPair, settings: Sequence[Setting], prompts: Sequence[Sequence[int]],
                 max_new_tokens: int, batch_sizes: Sequence[int], repeats: int,
                 hf_models: dict | None = None, progress: Callable[[str], None] = log,
                 prefill_baseline: bool = False,
                 on_batch_done: Callable[[list[dict]], None] | None = None,
                 profile: StepProfile | None = None) -> tuple[list[dict], list[Measurement]]:
    """Measure every setting at every batch size it supports; records in (batch, setting) order.

    `prefill_baseline`: also time our AR with one new token per prompt, interleaved with the
    rest (the prompts' prefill and little else), and give each of our records the decode-loop
    throughput without it (`add_decode_only`).
    `on_batch_done(records)`: called with the records so far after each batch size, so that a
    run of an hour or more can keep what it measured if it is stopped before the end.
    `profile`: traces the first timed passes of our settings (each after its warm-up pass).
    """
    if not prompts:
        raise BenchError("no prompts to decode")
    if max_new_tokens < 1:
        raise BenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise BenchError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if not settings or settings[0].mode != "ar":
        raise BenchError("the first setting must be our ar (the reference of every ratio)")
    records, measurements = [], []
    for b in batch_sizes:
        progress(f"batch size {b}: {len(prompts)} prompts, {max_new_tokens} new tokens each")
        runners = []
        for s in settings:
            if not s.supports_batch(b):
                continue
            if s.is_peer:
                if hf_models is None:
                    raise BenchError(f"{s.mode} needs the HF copies of the models (peers disabled)")
                runners.append(PeerRunner(hf_models, s, prompts, max_new_tokens, b, pair.eos_ids,
                                          pair.pad_id))
            else:
                runners.append(OurRunner(pair, s, prompts, max_new_tokens, b, profile))
        if prefill_baseline:
            baseline = Setting("ar", PREFILL_LABEL, ar_setting().options)
            runners.append(OurRunner(pair, baseline, prompts, 1, b))
        ms = measure_batch(runners, repeats, progress)
        prefill = ms.pop() if prefill_baseline else None
        batch_records = [make_record(m, ms[0], max_new_tokens, len(prompts)) for m in ms]
        if prefill is not None:
            add_decode_only(batch_records, prefill.median_seconds)
        add_vs_lossless(batch_records)
        records += batch_records
        measurements += ms
        if on_batch_done is not None:
            on_batch_done(list(records))
    return records, measurements
