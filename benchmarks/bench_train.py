"""Train-step throughput of the MARS objective vs plain AR, same model and batch, this CPU.

    nice .venv/bin/python benchmarks/bench_train.py [--steps 8] [--batch 8] [--length 128]

Both objectives run the real jitted train step (forward + backward + AdamW update, donated
state) of prove_jax.training.step on one device, float32, on a batch of real text (CPython
stdlib source, byte-level BPE built here). MARS forwards 2L positions (clean + masked stream),
so it should cost about 2x the AR step (a bit more from the 4x larger attention matrix), never
far more. Reports the median step time after a warm-up, tokens/s counted in input tokens
(B x L, the same for both), and the MARS / AR time ratio.

Writes benchmarks/train.json and benchmarks/train.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per objective (after 2 warm-up)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence (L)")
    p.add_argument("--block-size", type=int, default=16, help="MARS block size K")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--vocab", type=int, default=2048, help="BPE vocabulary size")
    p.add_argument("--out", default=RESULTS,
                   help="folder for train.json / train.md (default runs/benchmarks/; "
                        "--out benchmarks updates the committed results)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "length", "block_size", "hidden", "layers", "vocab"):
        if getattr(args, name) < 1:  # --steps 0 was a StatisticsError after the whole set-up
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.length % args.block_size:  # MARS rows are whole blocks (data/pipeline.py)
        p.error(f"--length {args.length} must be a multiple of --block-size {args.block_size}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from prove_jax.data import pipeline as data_lib
    from prove_jax.models import params as params_lib
    from prove_jax.models import sharding
    from prove_jax.training import step as ts
    from prove_jax.training.objectives import make_loss_fn
    from prove_jax.files import atomic_write_text
    from prove_jax.models.config import ModelConfig
    from prove_jax.data.corpus import list_source_files, read_source_files
    from prove_jax.training.optimizer import make_optimizer
    from prove_jax.data.tokenizer import to_transformers, train_bpe
    from prove_jax.training.config import OptimizerConfig

    print("building tokenizer and batch ...", file=sys.stderr, flush=True)
    files, _ = read_source_files(list_source_files()[:60])
    texts = [f.text for f in files]
    tok, _, _ = train_bpe(texts, vocab_size=args.vocab)
    tokenizer = to_transformers(tok)
    it = data_lib.make_dataset([{"text": t} for t in texts], tokenizer, max_length=args.length,
                               block_size=args.block_size, global_batch_size=args.batch, seed=0,
                               process_index=0, process_count=1)
    batch = next(it)
    heads = max(1, args.hidden // 64)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=heads,
                      num_kv_heads=max(1, heads // 2), head_dim=64, rope_theta=10000.0,
                      mask_token_id=tokenizer.mask_token_id)
    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    tx = make_optimizer(OptimizerConfig(lr=1e-4), total_steps=1000)
    layout = ts.state_layout(params_lib.abstract_model(cfg), tx, mesh)
    init_params = jax.tree.map(np.asarray, params_lib.flat_params(params_lib.create_model(cfg)))

    results = {}
    for objective in ("ar", "mars"):
        print(f"timing {objective} ...", file=sys.stderr, flush=True)
        model = params_lib.create_model(cfg)
        params_lib.set_flat_params(model, {k: np.copy(v) for k, v in init_params.items()})
        state = ts.init_state(model, tx, layout)
        loss_fn = make_loss_fn(objective, block_size=args.block_size,
                               mask_token_id=cfg.mask_token_id)
        step = ts.jit_step(ts.build_step_fn(layout.graphdef, tx, loss_fn), layout, mesh)
        times = []
        with jax.set_mesh(mesh):
            gb = data_lib.to_global_batch(batch, mesh, ts.BATCH_SPEC)
            t0 = time.perf_counter()
            state, m = step(state, gb)
            jax.block_until_ready(m)
            compile_s = time.perf_counter() - t0
            state, m = step(state, gb)
            jax.block_until_ready(m)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, m = step(state, gb)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        results[objective] = {"median_step_s": round(med, 4), "min_step_s": round(min(times), 4),
                              "tokens_per_s": round(args.batch * args.length / med, 1),
                              "first_step_with_compile_s": round(compile_s, 2),
                              "loss_after": float(m["loss"])}
    ratio = results["mars"]["median_step_s"] / results["ar"]["median_step_s"]
    record = {"config": {"batch": args.batch, "length": args.length, "block_size": args.block_size,
                         "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                         "params": cfg.num_params, "dtype": "float32", "timed_steps": args.steps},
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "jax": jax.__version__, "device": jax.devices()[0].device_kind},
              "results": results, "mars_over_ar_step_time": round(ratio, 3)}
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "train.json"), json.dumps(record, indent=2) + "\n")
    c = record["config"]
    md = [f"# Train step: MARS vs AR ({c['params'] / 1e6:.1f}M params, batch {c['batch']} x "
          f"{c['length']} tokens, K={c['block_size']}, float32, {record['machine']['device']})",
          "",
          "Real jitted train step (forward + backward + AdamW), one device, median of "
          f"{c['timed_steps']} steps after a warm-up; tokens/s counts input tokens (B x L).",
          "",
          "| objective | positions per sequence | median step (s) | tokens/s |",
          "|---|---|---|---|"]
    for obj, mult in (("ar", 1), ("mars", 2)):
        r = results[obj]
        md.append(f"| {obj} | {mult * c['length']} | {r['median_step_s']} | {r['tokens_per_s']} |")
    md += ["", f"MARS / AR step time = **{ratio:.2f}x** (expected about 2x: twice the positions, "
           "and a 4x larger attention matrix).",
           "", "Regenerate: `nice .venv/bin/python benchmarks/bench_train.py`"]
    atomic_write_text(os.path.join(args.out, "train.md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
