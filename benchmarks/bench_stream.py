"""A 256-request batch job: the one-call engine against the host-driven chunked loop.

    nice .venv/bin/python benchmarks/bench_stream.py [--requests 256] [--batch-size 16] \
        [--chunk-steps 1,4,16,64] [--out benchmarks]

Requests have mixed prompt lengths (HumanEval prompts, each cut to a random length) and mixed
budgets (8-128 new tokens), decoded by the shipped proposer at batch 16. `generate` is the
engine as `run_requests` drives it: 16 batches of requests per compiled call, admission inside
the loop one row at a time, results at the end of each call. `stream` is `Decoder.stream`
(what `prove-jax generate` runs): up to N steps per call, results as requests finish, waiting
requests admitted together between calls. Outputs are checked equal. After a warm-up each
setting is timed in interleaved rounds; the fastest round counts.

Writes stream.json and stream.md under --out (default runs/benchmarks/).
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
    from prove_jax.cli.bench_args import arg_type, positive_ints
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256, help="requests in the job (default 256)")
    p.add_argument("--batch-size", type=int, default=16, help="rows (default 16)")
    p.add_argument("--chunk-steps", type=arg_type(lambda t: positive_ints(t, "--chunk-steps")),
                   default=[1, 4, 16, 64], help="steps per call of the chunked loop (default 1,4,16,64)")
    p.add_argument("--modes", default="ar,lossless", help="ar and/or lossless (K=4, G=2) (default both)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds after the warm-up (default 2)")
    p.add_argument("--out", default=RESULTS, help="folder for stream.json / stream.md (default runs/benchmarks/; "
                                                  "--out benchmarks updates the committed results)")
    args = p.parse_args(argv)
    if min(args.requests, args.batch_size, args.repeats) < 1:
        p.error("--requests, --batch-size and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import time

    import jax
    import numpy as np

    from prove_jax import assets
    from prove_jax.decoding import DecodeOptions, SamplingParams, LosslessRule
    from prove_jax.timing import fastest_interleaved
    from prove_jax.decoding.request_run import RequestStream, run_requests
    from prove_jax.decoding.requests import encode_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.evaluation import humaneval

    pair = load_pair(assets.DEMO_PROPOSER)
    base = encode_prompts(humaneval.prompt_records(humaneval.load_problems()), pair.tokenizer)
    rs = np.random.RandomState(0)
    prompts = [p[: rs.randint(8, len(p) + 1)] for p in (base[i % len(base)] for i in range(args.requests))]
    budgets = rs.randint(8, 129, args.requests).tolist()
    params = [SamplingParams(max_new_tokens=b) for b in budgets]
    options = {"ar": DecodeOptions("ar"), "lossless": DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))}
    modes = [m for m in args.modes.split(",") if m]
    outputs, runs = {}, {}
    for mode in modes:
        decoder = pair.decoder(options[mode])

        def one_call(decoder=decoder, key=(mode, "generate")):
            t0 = time.perf_counter()
            results, _ = run_requests(decoder, prompts, 128, args.batch_size, progress=False, params=params)
            outputs[key] = [r.output_ids for r in results]
            return time.perf_counter() - t0
        runs[(mode, "generate")] = one_call
        for n in args.chunk_steps:
            def chunked(decoder=decoder, n=n, key=(mode, f"stream N={n}")):
                t0 = time.perf_counter()
                got = {}
                for event, result in RequestStream(decoder, prompts, 128, args.batch_size, params=params,
                                                   chunk_steps=n):
                    if result is not None:
                        got[event.index] = result.output_ids
                outputs[key] = [got[i] for i in range(len(prompts))]
                return time.perf_counter() - t0
            runs[(mode, f"stream N={n}")] = chunked
    log(f"compiling and timing {len(runs)} settings, {args.repeats} round(s) ...")
    best = fastest_interleaved(runs, args.repeats)
    rows = []
    for mode in modes:
        ref = outputs[(mode, "generate")]
        tokens = sum(len(o) for o in ref)
        for (m, how), seconds in best.items():
            if m != mode:
                continue
            assert outputs[(m, how)] == ref, f"{m} {how}: outputs differ from generate's"
            rows.append({"mode": m, "engine": how, "seconds": seconds, "tokens": tokens,
                         "tokens_per_second": tokens / seconds,
                         "vs_generate": best[(mode, "generate")] / seconds})
            log(f"  {m} {how}: {seconds:.2f} s, {tokens / seconds:.0f} tok/s")
    device = device_description()
    meta = {"requests": args.requests, "batch_size": args.batch_size, "prompt_tokens": [min(map(len, prompts)),
            max(map(len, prompts))], "budgets": [min(budgets), max(budgets)], "repeats": args.repeats,
            "device": device, "jax": jax.__version__}
    md = ["# A batch job: one-call engine vs chunked loop (`benchmarks/bench_stream.py`)", "",
          f"{args.requests} requests (HumanEval prompts cut to {meta['prompt_tokens'][0]}-{meta['prompt_tokens'][1]} "
          f"tokens, budgets {meta['budgets'][0]}-{meta['budgets'][1]} new tokens) at batch {args.batch_size}, the "
          f"shipped proposer at its own size, whole job wall time including host work (compile excluded by a "
          f"warm-up); {device}, jax {jax.__version__}. Fastest of {args.repeats} interleaved rounds. "
          f"`generate`: 16 batches per compiled call, one-row admission inside the loop; `stream N`: the "
          f"chunked loop with up to N steps per call and batched admission between calls. Outputs equal.", "",
          "| mode | engine | seconds | tok/s | vs generate |", "|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['engine']} | {r['seconds']:.2f} | {r['tokens_per_second']:.0f} | "
           f"{r['vs_generate']:.2f}x |" for r in rows]
    write_results(args.out, "stream", {"meta": meta, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
