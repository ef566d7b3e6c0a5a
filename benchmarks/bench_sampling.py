"""Lossless vs AR sampling by temperature: tokens per forward and speedup, side by side in one run.

    nice .venv/bin/python benchmarks/bench_sampling.py [--inflate qwen2.5-0.5b|none] \
        [--temperatures 0,0.3,0.7,1.0] [--out benchmarks]

The shipped proposer (optionally inflated to a preset's shape, `prove_jax/models/inflate.py`)
completes the first N HumanEval prompts at batch 1 with `ar` and with lossless (K and groups
given), at each temperature (top-p 1, a fixed seed per prompt). Lossless sampling draws from
AR sampling's distribution exactly, so the outputs differ draw by draw but not in law; what
the temperature changes is how often a drawn draft survives the acceptance test. After a
warm-up every (mode, temperature) is timed in interleaved rounds; the fastest round counts.

Writes NAME.json and NAME.md under --out (default runs/benchmarks/, name sampling).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parse_args(argv=None):
    from prove_jax.cli.bench_args import arg_type
    from prove_jax.models.config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--temperatures", default=[0.0, 0.3, 0.7, 1.0],
                   type=arg_type(lambda t: [float(x) for x in t.split(",")]),
                   help="temperatures (default 0,0.3,0.7,1.0)")
    p.add_argument("--inflate", default="qwen2.5-0.5b", choices=sorted(PRESETS) + ["none"],
                   help="preset shape to run the shipped proposer in (default qwen2.5-0.5b; none: its own)")
    p.add_argument("--block-size", type=int, default=6, help="lossless K (default 6)")
    p.add_argument("--groups", type=int, default=2, help="lossless mask groups (default 2)")
    p.add_argument("--humaneval", type=int, default=8, help="number of HumanEval prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up (default 2)")
    p.add_argument("--out", default=RESULTS, help="folder for sampling.json / sampling.md (default "
                                                  "runs/benchmarks/; --out benchmarks updates the committed results)")
    p.add_argument("--name", default="sampling", help="file name of the results (default sampling)")
    args = p.parse_args(argv)
    if min(args.repeats, args.humaneval, args.max_new_tokens) < 1 or min(args.temperatures) < 0:
        p.error("--repeats, --humaneval and --max-new-tokens must be >= 1, temperatures >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from prove_jax import assets
    from prove_jax.decoding import DecodeOptions, SamplingParams, LosslessRule
    from prove_jax.timing import fastest_interleaved
    from prove_jax.evaluation.benchmark import humaneval_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results

    inflate = None if args.inflate == "none" else args.inflate
    pair = load_pair(assets.DEMO_PROPOSER, inflate_to=inflate)
    prompts = humaneval_prompts(pair.tokenizer, args.humaneval)
    settings = {"ar": DecodeOptions("ar"),
                "lossless": DecodeOptions("lossless", args.block_size, lossless=LosslessRule(max_groups=args.groups))}
    results, runs = {}, {}
    for mode, options in settings.items():
        decoder = pair.decoder(options)
        for t in args.temperatures:
            params = [SamplingParams(temperature=t, seed=i) for i in range(len(prompts))]

            def run(key=(mode, t), decoder=decoder, params=params):
                res = decoder.generate(prompts, args.max_new_tokens, batch_size=1, params=params)
                results[key] = res
                return res.seconds
            runs[(mode, t)] = run
    log(f"compiling and timing {len(runs)} settings, {args.repeats} round(s) ...")
    best = fastest_interleaved(runs, args.repeats)
    rows = []
    for t in args.temperatures:
        ar_rate = None
        for mode in settings:
            res = results[(mode, t)]
            tokens = sum(len(o) for o in res.output_ids)
            rate = tokens / best[(mode, t)]
            ar_rate = rate if mode == "ar" else ar_rate
            rows.append({"temperature": t, "mode": mode, "tokens": tokens,
                         "tokens_per_forward": tokens / int(res.forwards.sum()),
                         "seconds": best[(mode, t)], "tokens_per_second": rate,
                         "speedup_vs_ar": rate / ar_rate})
            log(f"  T={t:g} {mode}: {rows[-1]['tokens_per_forward']:.2f} tok/fwd, "
                f"{rate:.1f} tok/s, {rows[-1]['speedup_vs_ar']:.2f}x")
    device = device_description()
    meta = {"proposer": "demo proposer", "inflated_to": inflate, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "batch_size": 1, "lossless": {"K": args.block_size,
                                                                                   "groups": args.groups},
            "repeats": args.repeats, "device": device, "jax": jax.__version__}
    shape = f"inflated to the {inflate} shape" if inflate else "at its own shape (4M parameters, in cache)"
    md = ["# Lossless vs AR sampling by temperature (`benchmarks/bench_sampling.py`)", "",
          f"The shipped proposer {shape}; the first {len(prompts)} HumanEval prompts x "
          f"{args.max_new_tokens} new tokens at batch 1; lossless K={args.block_size}, G={args.groups}; "
          f"top-p 1, one seed per prompt; {device}, jax {jax.__version__}, float32. Fastest of "
          f"{args.repeats} interleaved rounds after a warm-up; speedup is against `ar` at the same "
          f"temperature in the same run. Temperature 0 is the greedy program.", "",
          "| temperature | mode | tokens/forward | tok/s | speedup vs ar |", "|---|---|---|---|---|"]
    md += [f"| {r['temperature']:g} | {r['mode']} | {r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
           f"{r['speedup_vs_ar']:.2f}x |" for r in rows]
    write_results(args.out, args.name, {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
