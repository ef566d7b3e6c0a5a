"""Prefill time by prefill chunk size: the engine's own program, side by side in one run.

    nice .venv/bin/python benchmarks/bench_prefill.py [--inflate qwen2.5-0.5b] [--chunks 16,32,64]

Each chunk size gets its own compiled `ar` decode of one new token per prompt (prefill and a
single step, nothing else) over the first N HumanEval prompts with the shipped proposer,
optionally inflated to a preset's shape (`prove_jax/models/inflate.py`), at batch 1 (a queue: each
admitted row prefills alone) and at batch N (one static batch). After a warm-up the sizes are
timed in interleaved rounds; the fastest round counts (a shared machine only adds time). A
prompt's last chunk is padded, so the table also gives the share of padded prompt tokens.

Writes benchmarks/prefill.json and benchmarks/prefill.md.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _ints(what: str):
    from prove_jax.cli.bench_args import arg_type, positive_ints
    return arg_type(lambda text: positive_ints(text, what))


def parse_args(argv=None):
    from prove_jax.models.config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", type=_ints("--chunks"), default=[16, 32, 64], help="prefill chunk sizes (default 16,32,64)")
    p.add_argument("--inflate", default="qwen2.5-0.5b", choices=sorted(PRESETS) + ["none"],
                   help="preset shape to run the shipped proposer in (default qwen2.5-0.5b; none: its own)")
    p.add_argument("--humaneval", type=int, default=16, help="number of HumanEval prompts (default 16)")
    p.add_argument("--batch-sizes", type=_ints("--batch-sizes"), default=[1, 16], help="rows (default 1,16)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    p.add_argument("--out", default=RESULTS,
                   help="folder for prefill.json / prefill.md (default runs/benchmarks/; "
                        "--out benchmarks updates the committed results)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.humaneval < 1:
        p.error("--repeats and --humaneval must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from prove_jax import assets
    from prove_jax.evaluation.benchmark import humaneval_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.timing import fastest_interleaved
    from prove_jax.decoding.options import DecodeOptions, default_prefill_chunk, MemoryLayout

    inflate = None if args.inflate == "none" else args.inflate
    pair = load_pair(assets.DEMO_PROPOSER, inflate_to=inflate)
    prompts = humaneval_prompts(pair.tokenizer, args.humaneval)
    lengths = np.array([len(p) for p in prompts])
    rows = []
    for b in args.batch_sizes:
        runs = {}
        for c in args.chunks:
            decoder = pair.decoder(DecodeOptions("ar", memory=MemoryLayout(prefill_chunk=c)))
            runs[c] = lambda d=decoder: d.generate(prompts, 1, batch_size=b).seconds
        log(f"batch {b}: compiling and timing chunks {args.chunks} ...")
        best = fastest_interleaved(runs, args.repeats)
        for c in args.chunks:
            padded = int((-(-lengths // c) * c).sum())
            rows.append({"batch_size": b, "chunk": c, "seconds": best[c],
                         "relative_to_fastest": best[c] / min(best.values()),
                         "padded_token_share": 1 - lengths.sum() / padded})
            log(f"  chunk {c}: {best[c]:.2f} s")
    meta = {"proposer": assets.DEMO_PROPOSER, "inflated_to": inflate, "prompts": len(prompts),
            "prompt_tokens": int(lengths.sum()), "prompt_lengths": [int(x) for x in lengths],
            "repeats": args.repeats, "device": device_description(), "jax": jax.__version__,
            "default_chunk": default_prefill_chunk()}
    shape = f"inflated to the {inflate} shape" if inflate else "at its own shape"
    md = ["# Prefill by chunk size (`benchmarks/bench_prefill.py`)", "",
          f"The shipped proposer {shape}; the first {len(prompts)} HumanEval prompts "
          f"({lengths.min()}-{lengths.max()} tokens, {lengths.sum()} in all); `ar` with one new token "
          f"per prompt; {meta['device']}, jax {jax.__version__}. Fastest of {args.repeats} interleaved "
          f"rounds after a warm-up. The default chunk here is {meta['default_chunk']}.", "",
          "| batch | chunk | seconds | vs fastest | padded prompt tokens |", "|---|---|---|---|---|"]
    md += [f"| {r['batch_size']} | {r['chunk']} | {r['seconds']:.2f} | {r['relative_to_fastest']:.2f}x | "
           f"{r['padded_token_share']:.0%} |" for r in rows]
    write_results(args.out, "prefill", {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
