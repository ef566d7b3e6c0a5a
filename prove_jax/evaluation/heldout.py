"""Held-out language-model quality of a checkpoint: next-token NLL, perplexity, top-1 accuracy.

ProVe-lossless reproduces the proposer's greedy output exactly, so any change to the proposer
(MARS fine-tuning, self-distillation) must be checked for what it does to the model itself:

    python -m prove_jax.evaluation.heldout --model CKPT [--model CKPT2 ...] \\
        --data runs/demo/corpus/heldout.jsonl [--max-length 256] [--max-rows 256] [--mesh 1,4,2]

`--data` is anything the training loader reads (text, a folder, JSONL). Every trained token of
every row counts once (all of plain text, the response of prompt/response records; a
token-weighted mean, unlike the per-sequence training loss). A proposer too
large for one device is read straight into the shards of `--mesh data,fsdp,tensor` (the rows
of each batch split over data x fsdp, the model as training splits it); on several hosts the
same command runs on each (`--coordinator/--num-processes/--process-id` off TPU) and process 0
alone prints.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from prove_jax import distributed
from prove_jax.data.pipeline import load_examples, tokenize_examples
from prove_jax.models.qwen2 import causal_mask
from prove_jax.training.objectives import next_token_targets, token_nll
from prove_jax.models.sharding import batch_shards
from prove_jax.training.step import BATCH_SPEC


def heldout_metrics(model, rows, batch_size: int = 16, mesh=None) -> dict:
    """Token-weighted NLL / perplexity / top-1 accuracy of `model` over TokenizedRows; with a
    mesh (the model already sharded on it) each batch's rows are split over data x fsdp."""
    graphdef, state = nnx.split(model)
    place = lambda batch: batch  # noqa: E731
    out_shardings = None
    if mesh is not None:
        shards = batch_shards(mesh)
        batch_size = -(-batch_size // shards) * shards
        rows_sharding = NamedSharding(mesh, BATCH_SPEC)
        place = lambda batch: jax.device_put(batch, rows_sharding)  # noqa: E731
        out_shardings = NamedSharding(mesh, PartitionSpec())  # every host reads the sums

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def sums(state, batch):
        m = nnx.merge(graphdef, state)
        ids = batch["input_ids"]
        b, length = ids.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        logits, _ = m(ids, positions, causal_mask(b, length, batch["valid"]))
        labels, w = next_token_targets(batch)
        hit = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        return (token_nll(logits, labels) * w).sum(), (hit * w).sum(), w.sum()

    n = rows.input_ids.shape[0]
    nll = hits = count = 0.0
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        for start in range(0, n, batch_size):
            sl = slice(start, start + batch_size)
            batch = {"input_ids": rows.input_ids[sl], "loss_mask": rows.loss_mask[sl], "valid": rows.valid[sl]}
            pad = batch_size - batch["input_ids"].shape[0]  # one shape for every batch: one compile
            batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
            s = sums(state, place(batch))
            nll, hits, count = nll + float(s[0]), hits + float(s[1]), count + float(s[2])
    mean = nll / max(count, 1.0)
    return {"nll": mean, "perplexity": float(np.exp(mean)), "top1_accuracy": hits / max(count, 1.0),
            "tokens": int(count), "rows": int(n)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prove_jax.evaluation.heldout", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="checkpoint (repeatable)")
    ap.add_argument("--data", required=True, help="held-out text, folder or JSONL")
    ap.add_argument("--max-length", type=int, default=256, help="tokens per row (default 256)")
    ap.add_argument("--max-rows", type=int, default=256, help="evaluate at most this many rows (default 256)")
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
                rows = tokenize_examples(examples, tokenizer, max_length=args.max_length, block_size=1)
                keep = slice(0, args.max_rows)
                rows_by_tokenizer[key] = type(rows)(rows.input_ids[keep], rows.loss_mask[keep],
                                                    rows.valid[keep], rows.truncated, rows.dropped)
            result = {"model": path, **heldout_metrics(model, rows_by_tokenizer[key], args.batch_size, mesh)}
            if result["tokens"] == 0:  # else nll 0, perplexity 1: a perfect score over nothing
                raise DataError(f"no tokens to evaluate in {args.data} at --max-length "
                                f"{args.max_length}: no row has a trained token after its first (text "
                                f"shorter than two tokens, or prompts that fill --max-length)")
            if main_process:
                print(f"{path}: nll {result['nll']:.4f}, perplexity {result['perplexity']:.2f}, top-1 "
                      f"{result['top1_accuracy']:.3f} over {result['tokens']} tokens "
                      f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
            results.append(result)
    except (CheckpointError, DataError, OSError, ValueError) as e:  # project errors are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    if main_process:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    from prove_jax.cli.runner import run_cli
    run_cli(main)
