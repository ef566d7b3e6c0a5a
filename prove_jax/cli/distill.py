"""`prove-jax distill`: self-distillation data, the proposer's own greedy continuations.

    prove-jax distill --model CKPT --corpus CORPUS_DIR --out distill.jsonl \\
        [--num-prompts 2048] [--max-new-tokens 128] [--batch-size 32] \\
        [--mix-corpus-chars 2000000] [--mesh 4,1,2]

Prompts are the documented functions of the corpus's train split (signature + docstring), or
any `{"id", "prompt"}` JSONL given with `--prompts`. `--mix-corpus-chars` appends real
train-split text, which keeps the AR stream anchored; why is in prove_jax/training/distill.py.
`--mesh data,fsdp,tensor` splits the batch over data x fsdp and the model over tensor; on
several hosts the same command runs on each, and process 0 alone logs and writes.
"""

from __future__ import annotations

import argparse
import json
import sys

from prove_jax.errors import ProveJaxError
from prove_jax import distributed
from prove_jax.cli.runner import fail, run_cli
from prove_jax.training.distill import (corpus_text_sample, distill_records, sample_prompts,
                                        train_function_prompts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prove-jax distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", required=True, help="proposer checkpoint whose greedy output is the target"
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus", help="corpus directory (prove-jax corpus): prompts from its train split"
    )
    src.add_argument("--prompts", help='JSONL of {"id", "prompt"} records')
    ap.add_argument("--out", required=True, help="output JSONL (written atomically)")
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="sample this many prompts (default: all)"
    )
    ap.add_argument("--max-prompt-tokens", type=int, default=192,
                    help="skip prompts longer than this many tokens")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mix-corpus-chars",
        type=int,
        default=0,
        help="also write about this many characters of real train-split text (needs --corpus)",
    )
    ap.add_argument(
        "--mesh",
        default=None,
        help="data,fsdp,tensor device mesh, e.g. 4,1,2 (default: tensor parallel over the "
        "kv heads as far as the weights need to fit, the rest on data)",
    )
    distributed.add_arguments(ap)
    args = ap.parse_args(argv)

    from prove_jax.files import atomic_write_text
    from prove_jax.decoding.options import DecodeError, DecodeOptions
    from prove_jax.decoding.loading import build_decoder
    from prove_jax.decoding.requests import encode_prompts, read_requests
    from prove_jax.decoding.results_file import check_output_path
    main_process = True

    def log(msg: str) -> None:
        if main_process:
            print(msg, file=sys.stderr, flush=True)
    try:
        for flag, value in (
            ("--max-new-tokens", args.max_new_tokens),
            ("--batch-size", args.batch_size),
            ("--max-prompt-tokens", args.max_prompt_tokens),
            ("--num-prompts", args.num_prompts),
        ):
            if value is not None and value < 1:  # a negative --num-prompts was a slice bound
                raise DecodeError(f"{flag} must be >= 1, got {value}")
        if args.mix_corpus_chars < 0:
            raise DecodeError(f"--mix-corpus-chars must be >= 0, got {args.mix_corpus_chars}")
        check_output_path(args.out, args.prompts, flag="--out")  # before decoding, not at the write
        if args.mix_corpus_chars and not args.corpus:
            raise DecodeError("--mix-corpus-chars takes its text from --corpus")
        distributed.initialize_from_args(args)  # before anything touches a device
        main_process = distributed.is_main_process()
        records = (
            read_requests(args.prompts) if args.prompts else train_function_prompts(args.corpus)
        )
        decoder, tokenizer = build_decoder(
            args.model, DecodeOptions(mode="ar"), mesh_shape=args.mesh
        )
        ids = encode_prompts(records, tokenizer)
        kept = [(r, p) for r, p in zip(records, ids) if 0 < len(p) <= args.max_prompt_tokens]
        kept = sample_prompts(kept, args.num_prompts, args.seed)
        if not kept:
            raise DecodeError(f"no prompt of 1..{args.max_prompt_tokens} tokens to distill")
        log(
            f"distill: {len(kept)} prompts (of {len(records)}), {args.max_new_tokens} new tokens "
            "each"
        )
        out = distill_records(decoder, [p for _, p in kept], [r["id"] for r, _ in kept],
                              args.max_new_tokens, args.batch_size, log=log, progress=main_process)
        if args.mix_corpus_chars > 0:
            text = corpus_text_sample(args.corpus, args.mix_corpus_chars, args.seed)
            log(
                f"distill: + {len(text)} train-split files ({sum(len(t['text']) for t in text):,} "
                "chars) of real text"
            )
            out += text
        if main_process:
            atomic_write_text(args.out, "".join(json.dumps(r) + "\n" for r in out))
    # ValueError: a library's bad-input error (tokenizer, JSON)
    except (ProveJaxError, OSError, ValueError) as e:
        return fail(e)
    log(f"wrote {args.out}: {len(out)} records")
    return 0


if __name__ == "__main__":
    run_cli(main)
