"""`prove-jax evaluate`: held-out NLL, perplexity and top-1 accuracy of one or more checkpoints.

    prove-jax evaluate --model CKPT [--model CKPT2 ...] --data runs/demo/corpus/heldout.jsonl \\
        [--max-length 256] [--max-rows 256] [--mesh 1,4,2]

`--data` is anything the training loader reads (text, a folder, JSONL); every trained token
counts once (prove_jax/evaluation/heldout.py). On several hosts the same command runs on each
and process 0 alone prints. The JSON list of results goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from prove_jax.errors import ProveJaxError
from prove_jax import distributed
from prove_jax.cli.runner import fail, run_cli
from prove_jax.data.pipeline import load_examples, tokenize_examples
from prove_jax.evaluation.heldout import heldout_metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="prove-jax evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="checkpoint (repeatable)")
    ap.add_argument("--data", required=True, help="held-out text, folder or JSONL")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per row (default 256)")
    ap.add_argument(
        "--max-rows", type=int, default=256, help="evaluate at most this many rows (default 256)"
    )
    ap.add_argument("--batch-size", type=int, default=16,
                    help="rows per forward (default 16; rounded up to a multiple of data x fsdp)")
    ap.add_argument("--mesh", default=None,
                    help="data,fsdp,tensor device mesh, e.g. 1,4,2 (default: all devices on data)")
    distributed.add_arguments(ap)
    args = ap.parse_args(argv)

    from prove_jax.checkpoints.checkpoint import CheckpointError, load_model, load_tokenizer
    from prove_jax.data.pipeline import DataError
    from prove_jax.decoding.loading import parse_mesh
    main_process = True
    try:
        if min(args.max_length, args.max_rows, args.batch_size) < 1:
            raise DataError("--max-length, --max-rows and --batch-size must be >= 1")
        distributed.initialize_from_args(args)  # before anything touches a device
        main_process = distributed.is_main_process()
        mesh = parse_mesh(args.mesh)
        examples = load_examples(args.data)
        rows_by_tokenizer: dict[str, object] = {}
        results = []
        for path in args.model:
            t0 = time.perf_counter()
            model = load_model(path, mesh=mesh, dtype="float32", param_dtype="float32")
            tokenizer = load_tokenizer(path)
            if tokenizer is None:
                raise CheckpointError(f"{path} has no tokenizer: cannot encode {args.data}")
            if args.max_length > model.cfg.max_position_embeddings:
                raise DataError(f"--max-length {args.max_length} is past {path}'s context of "
                                f"{model.cfg.max_position_embeddings} positions")
            key = json.dumps(tokenizer.get_vocab(), sort_keys=True)  # same vocab -> same rows
            if key not in rows_by_tokenizer:
                rows = tokenize_examples(
                    examples, tokenizer, max_length=args.max_length, block_size=1
                )
                keep = slice(0, args.max_rows)
                rows_by_tokenizer[key] = type(rows)(rows.input_ids[keep], rows.loss_mask[keep],
                                                    rows.valid[keep], rows.truncated, rows.dropped)
            result = {
                "model": path,
                **heldout_metrics(model, rows_by_tokenizer[key], args.batch_size, mesh),
            }
            if result["tokens"] == 0:  # else nll 0, perplexity 1: a perfect score over nothing
                raise DataError(
                    f"no tokens to evaluate in {args.data} at --max-length "
                    f"{args.max_length}: no row has a trained token after its first (text "
                    f"shorter than two tokens, or prompts that fill --max-length)"
                )
            if main_process:
                print(
                    f"{path}: nll {result['nll']:.4f}, perplexity {result['perplexity']:.2f}, "
                    f"top-1 {result['top1_accuracy']:.3f} over {result['tokens']} tokens "
                    f"({time.perf_counter() - t0:.0f}s)",
                    file=sys.stderr,
                    flush=True,
                )
            results.append(result)
    except (ProveJaxError, OSError, ValueError) as e:  # ValueError: a library's bad-input error
        return fail(e)
    if main_process:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    run_cli(main)
