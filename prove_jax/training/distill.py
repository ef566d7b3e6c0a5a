"""Self-distillation data for the MARS stage: the proposer's own greedy continuations.

ProVe-lossless accepts a draft only when it equals the proposer's *own* greedy token, so what
the mask stream has to learn is the model's greedy continuation, not the corpus. Greedy text is
a deterministic function of its prefix (and, for small models, very repetitive), so it is far
easier to predict several tokens ahead than human text. This module decodes prompts greedily
with the compiled engine and writes `{"id", "prompt_ids", "response_ids"}` records that the
training data loader reads as they are (the response keeps its EOS when one was generated, and
none is added when decoding stopped at the budget).

Trained on greedy text alone, the clean (AR) stream sharpens onto its own outputs and the model
gets worse (demo proposer: held-out perplexity 25.6 -> 80.1). `--mix-corpus-chars` appends real
train-split text records to the file, which keeps the AR stream anchored while the mask stream
still learns the greedy continuations. Four such rounds, each distilling the current proposer
(lossless K=4: 1.44 -> 3.45 tokens per forward, held-out perplexity 25.6 -> 25.3); see the
README's "Self-distillation" section.

    python -m prove_jax.training.distill --model CKPT --corpus CORPUS_DIR --out distill.jsonl \\
        [--num-prompts 2048] [--max-new-tokens 128] [--batch-size 32] [--mix-corpus-chars 2000000] \\
        [--mesh 4,1,2]

`--mesh data,fsdp,tensor` splits the batch over data x fsdp and the model over tensor, as
`infer.generate` does; on several hosts the same command runs on each
(`--coordinator/--num-processes/--process-id` off TPU), and process 0 alone logs and writes.

Prompts are the documented functions of the corpus's *train* split (signature + docstring,
as in `prove_jax.data.corpus`), or any `{"id", "prompt"}` JSONL given with `--prompts`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Sequence

from prove_jax import distributed
from prove_jax.data.corpus import CorpusError, function_prompts, iter_source_files, iter_texts


def train_function_prompts(corpus_dir: str, max_prompt_chars: int = 1500) -> list[dict]:
    """`{"id", "prompt"}` for every documented function of CORPUS_DIR/train.jsonl, in file order."""
    path = os.path.join(corpus_dir, "train.jsonl")
    if not os.path.isfile(path):
        raise CorpusError(f"{path} not found: --corpus must be a directory written by "
                          f"`python -m prove_jax.data.corpus`")
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
                    max_new_tokens: int, batch_size: int, log=print, progress: bool = True) -> list[dict]:
    """Greedy continuations as `{"id", "prompt_ids", "response_ids"}` records."""
    from prove_jax.decoding.requests import run_requests
    t0 = time.perf_counter()
    outputs, _, summary = run_requests(decoder, prompt_ids, max_new_tokens, batch_size,
                                       progress=progress, ids=list(ids))
    log(f"distill: {summary['generated_tokens']} tokens for {len(outputs)} prompts in "
        f"{time.perf_counter() - t0:.0f}s ({summary['tokens_per_second']:.0f} tok/s decoding)")
    return [{"id": i, "prompt_ids": list(map(int, p)), "response_ids": list(map(int, o))}
            for i, p, o in zip(ids, prompt_ids, outputs)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prove_jax.training.distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="proposer checkpoint whose greedy output is the target")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="corpus directory (prove_jax.data.corpus): prompts from its train split")
    src.add_argument("--prompts", help='JSONL of {"id", "prompt"} records')
    ap.add_argument("--out", required=True, help="output JSONL (written atomically)")
    ap.add_argument("--num-prompts", type=int, default=None, help="sample this many prompts (default: all)")
    ap.add_argument("--max-prompt-tokens", type=int, default=192,
                    help="skip prompts longer than this many tokens")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mix-corpus-chars", type=int, default=0,
                    help="also write about this many characters of real train-split text (needs --corpus)")
    ap.add_argument("--mesh", default=None,
                    help="data,fsdp,tensor device mesh, e.g. 4,1,2 (default: all devices on data)")
    distributed.add_arguments(ap)
    args = ap.parse_args(argv)

    from prove_jax.checkpoints.checkpoint import CheckpointError
    from prove_jax.files import atomic_write_text
    from prove_jax.decoding.engine import DecodeError, DecodeOptions
    from prove_jax.decoding.loading import build_decoder
    from prove_jax.decoding.requests import check_output_path, encode_prompts, read_requests
    main_process = True

    def log(msg: str) -> None:
        if main_process:
            print(msg, file=sys.stderr, flush=True)
    try:
        for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                            ("--max-prompt-tokens", args.max_prompt_tokens), ("--num-prompts", args.num_prompts)):
            if value is not None and value < 1:  # a negative --num-prompts was a slice bound
                raise DecodeError(f"{flag} must be >= 1, got {value}")
        if args.mix_corpus_chars < 0:
            raise DecodeError(f"--mix-corpus-chars must be >= 0, got {args.mix_corpus_chars}")
        check_output_path(args.out, args.prompts, flag="--out")  # before decoding, not at the write
        if args.mix_corpus_chars and not args.corpus:
            raise DecodeError("--mix-corpus-chars takes its text from --corpus")
        distributed.initialize_from_args(args)  # before anything touches a device
        main_process = distributed.is_main_process()
        records = read_requests(args.prompts) if args.prompts else train_function_prompts(args.corpus)
        decoder, tokenizer = build_decoder(args.model, DecodeOptions(mode="ar"), mesh_shape=args.mesh)
        ids = encode_prompts(records, tokenizer)
        kept = [(r, p) for r, p in zip(records, ids) if 0 < len(p) <= args.max_prompt_tokens]
        kept = sample_prompts(kept, args.num_prompts, args.seed)
        if not kept:
            raise DecodeError(f"no prompt of 1..{args.max_prompt_tokens} tokens to distill")
        log(f"distill: {len(kept)} prompts (of {len(records)}), {args.max_new_tokens} new tokens each")
        out = distill_records(decoder, [p for _, p in kept], [r["id"] for r, _ in kept],
                              args.max_new_tokens, args.batch_size, log=log, progress=main_process)
        if args.mix_corpus_chars > 0:
            text = corpus_text_sample(args.corpus, args.mix_corpus_chars, args.seed)
            log(f"distill: + {len(text)} train-split files ({sum(len(t['text']) for t in text):,} chars) of real text")
            out += text
        if main_process:
            atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in out))
    except (CorpusError, CheckpointError, DecodeError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log(f"wrote {args.out}: {len(out)} records")
    return 0


if __name__ == "__main__":
    from prove_jax.cli.runner import run_cli
    run_cli(main)
