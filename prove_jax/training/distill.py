"""Self-distillation data for the MARS stage: the proposer's own greedy continuations.

ProVe-lossless accepts a draft only when it equals the proposer's own greedy token, so the mask
stream should learn the model's greedy continuation, not the corpus. Real text mixed in
(`corpus_text_sample`) keeps the clean stream from sharpening onto its own outputs. Measured
effect: docs/demo_models.md; commands: docs/training.md; the CLI: prove_jax/cli/distill.py.
"""

from __future__ import annotations

import os
import random
import time
from typing import Sequence

from prove_jax.data.corpus import CorpusError, function_prompts, iter_source_files, iter_texts
from prove_jax.decoding.request_run import run_requests


def train_function_prompts(corpus_dir: str, max_prompt_chars: int = 1500) -> list[dict]:
    """`{"id", "prompt"}` for every documented function of CORPUS_DIR/train.jsonl, in file order."""
    path = os.path.join(corpus_dir, "train.jsonl")
    if not os.path.isfile(path):
        raise CorpusError(f"{path} not found: --corpus must be a directory written by "
                          f"`prove-jax corpus`")
    records = []
    for source in iter_source_files(path):
        records += function_prompts(source, max_prompt_chars=max_prompt_chars)
    return [{"id": r["id"], "prompt": r["prompt"]} for r in records]


def corpus_text_sample(corpus_dir: str, max_chars: int, seed: int) -> list[dict]:
    """`{"text"}` records of whole train-split files, seeded order, until max_chars is passed."""
    texts = list(iter_texts(os.path.join(corpus_dir, "train.jsonl")))
    random.Random(seed).shuffle(texts)
    out, total = [], 0
    for text in texts:
        if total > max_chars:
            break
        out.append({"text": text})
        total += len(text)
    return out


def sample_prompts(records: Sequence[dict], num: int | None, seed: int) -> list[dict]:
    """A seeded sample of `num` records (all of them, shuffled, when num is None or larger)."""
    records = list(records)
    random.Random(seed).shuffle(records)
    return records if num is None else records[:num]


def distill_records(decoder, prompt_ids: Sequence[Sequence[int]], ids: Sequence[str],
                    max_new_tokens: int, batch_size: int, log=print,
                    progress: bool = True) -> list[dict]:
    """Greedy continuations as `{"id", "prompt_ids", "response_ids"}` records, which the data
    loader trains as given: a response keeps its EOS when one was generated, none is added at
    the token budget."""
    t0 = time.perf_counter()
    results, summary = run_requests(decoder, prompt_ids, max_new_tokens, batch_size,
                                    progress=progress, ids=list(ids))
    outputs = [r.output_ids for r in results]
    log(f"distill: {summary['generated_tokens']} tokens for {len(outputs)} prompts in "
        f"{time.perf_counter() - t0:.0f}s ({summary['tokens_per_second']:.0f} tok/s decoding)")
    return [{"id": i, "prompt_ids": list(map(int, p)), "response_ids": list(map(int, o))}
            for i, p, o in zip(ids, prompt_ids, outputs)]
