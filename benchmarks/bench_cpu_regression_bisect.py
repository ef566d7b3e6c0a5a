"""The decode step of one checkout at the Qwen2.5-0.5B shape: compiled program and step time.

Issue #50 item 6 asked whether the CPU's lossless K=6,G=2 step got dearer relative to AR
between two commits (see benchmarks/cpu_regression_bisect.md). This script runs against any
checkout from then to now: put the checkout first on the path and pass its label,

    git worktree add /tmp/at_X X
    PYTHONPATH=/tmp/at_X JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_cpu_regression_bisect.py \
        step --label X --out /tmp/step_X.json

It inflates the demo proposer to the qwen2.5-0.5b shape, builds the engine's own decode-step
loops at batch 1 (`decode_step_runs`: AR and lossless K=6,G=2, rows at 200 of 384 slots), and
records for each the compiled CPU program's cost analysis and op counts (deterministic) and
its seconds per step, AR and K=6,G=2 interleaved in the one process (`--repeats` rounds of
`--steps` steps each). `--kv-write indexed` (the current checkout only) writes the step's KV
with the explicit-index scatter that the vmapped per-row write replaced, to time the two side
by side in one process (`--kv-write both`). `program` compiles the whole `generate` program of
both settings for one prompt instead (what the bisection compared) and, with `--repeats`,
times generate calls.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import json
import os
import re
import statistics
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the checkout on PYTHONPATH comes first; without one, this repository's package
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

LAYOUT = (6, 2)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
OP = re.compile(r"= (?:\([^)]*\)|[\w\[\]{},:\d]+) ([a-z][a-z\-]*)\(")


def _first(*names):
    """The first (module, attribute) that imports: the layout moved between checkouts."""
    for mod, attr in names:
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError):
            pass
    raise ImportError(f"none of {names}")


def op_counts(hlo_text: str) -> dict[str, int]:
    """Instructions of the compiled HLO by opcode (fusion bodies included)."""
    counts = collections.Counter(m.group(1) for m in map(OP.search, hlo_text.splitlines()) if m)
    return dict(sorted(counts.items()))


def indexed_write(orig):
    """The step's KV write as an explicit (row, head, slot) scatter of new [B, T, K, Dh]: the
    form before the vmapped per-row write (measurement only; per-layer caches only)."""
    def write(cache, new, start, layer=None, rules=None, slots_minor=False):
        if layer is not None or slots_minor:
            return orig(cache, new, start, layer, rules, slots_minor)
        b, k, t, _ = new.shape
        rows = jnp.arange(b)[:, None, None]
        heads = jnp.arange(k)[None, None, :]
        slots = (start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :])[:, :, None]
        return cache.at[rows, heads, slots].set(jnp.swapaxes(new, 1, 2).astype(cache.dtype),
                                                mode="drop")
    return write


def step(args) -> None:
    from flax import nnx

    from prove_jax import assets
    load_pair = _first(("prove_jax.evaluation.model_pair", "load_pair"),
                       ("prove_jax.evaluation.benchmark", "load_pair"),
                       ("prove_jax.bench_lib", "load_pair"))
    decode_step_runs = _first(("prove_jax.decoding.step_timing", "decode_step_runs"),
                              ("prove_jax.decoding.calibrate", "decode_step_runs"))
    pair = load_pair(assets.DEMO_PROPOSER, None, dtype="float32", inflate_to="qwen2.5-0.5b")
    params = nnx.split(pair.proposer)[1]
    variants = {"current": None}
    if args.kv_write != "current":
        from prove_jax.models import attention
        orig = attention.write_step
        variants = ({"indexed": indexed_write(orig)} if args.kv_write == "indexed"
                    else {"current": None, "indexed": indexed_write(orig)})
    programs, runs = {}, {}
    for variant, write in variants.items():
        if write is not None:
            attention.write_step = write
        try:
            for key, run in decode_step_runs(pair.proposer, 1, [LAYOUT], steps=args.steps).items():
                name = "ar" if key[0] == 1 else "lossless K=%d,G=%d" % key
                _, fn, state = run.__defaults__  # (steps, jitted loop, start state)
                compiled = fn.lower(params, state, jnp.int32(1)).compile()
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, list) else cost
                programs[f"{variant}/{name}"] = {
                    "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
                    "ops": op_counts(compiled.as_text())}
                run(1)  # compile (the jit's own) and warm up, under this variant
                runs[f"{variant}/{name}"] = functools.partial(run, args.steps)
        finally:
            if write is not None:
                attention.write_step = orig
    seconds = {k: [] for k in runs}
    keys = list(runs)
    for i in range(args.repeats):  # rotated order: a load change hits every program alike
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:
            seconds[k].append(runs[k]() / args.steps)
    ratios = {}
    for variant in variants:
        ar, wide = seconds[f"{variant}/ar"], seconds[f"{variant}/lossless K=6,G=2"]
        ratios[variant] = {"min": min(wide) / min(ar),
                           "median": statistics.median(wide) / statistics.median(ar)}
        print(f"{args.label} {variant}: AR {1e3 * min(ar):.2f} ms (median "
              f"{1e3 * statistics.median(ar):.2f}), K=6,G=2 {1e3 * min(wide):.2f} ms (median "
              f"{1e3 * statistics.median(wide):.2f}); wide/AR {ratios[variant]['min']:.3f} by "
              f"fastest, {ratios[variant]['median']:.3f} by median", flush=True)
    out = {"label": args.label, "jax": jax.__version__, "steps_per_timing": args.steps,
           "programs": programs, "step_seconds": seconds, "wide_over_ar": ratios}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def program(args) -> None:
    """The whole `generate` program (prefill + decode loop) of AR and lossless K=6,G=2 for one
    prompt at batch 1: cost analysis and op counts (the bisection's signal), and optionally
    `--repeats` interleaved generate calls (seconds per loop step, prefill included)."""
    from prove_jax import assets
    load_pair = _first(("prove_jax.evaluation.model_pair", "load_pair"),
                       ("prove_jax.evaluation.benchmark", "load_pair"),
                       ("prove_jax.bench_lib", "load_pair"))
    ar_setting = _first(("prove_jax.evaluation.sweep", "ar_setting"),
                        ("prove_jax.evaluation.benchmark", "ar_setting"),
                        ("prove_jax.bench_lib", "ar_setting"))
    lossless_setting = _first(("prove_jax.evaluation.sweep", "lossless_setting"),
                              ("prove_jax.evaluation.benchmark", "lossless_setting"),
                              ("prove_jax.bench_lib", "lossless_setting"))
    pair = load_pair(assets.DEMO_PROPOSER, None, dtype="float32", inflate_to="qwen2.5-0.5b")
    prompt = [int(t) for t in pair.tokenizer.encode(PROMPT)]
    decoders, out = {}, {"label": args.label, "jax": jax.__version__, "prompt_tokens": len(prompt),
                         "max_new_tokens": args.max_new, "programs": {}}
    for name, setting in (("ar", ar_setting()), ("lossless K=6,G=2", lossless_setting(*LAYOUT))):
        dec = pair.decoder(setting.options)
        res = dec.generate([prompt], args.max_new, batch_size=1)
        compiled = list((getattr(dec, "_compiled", None) or dec._programs).values())[0][0]
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        out["programs"][name] = {
            "flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed"),
            "ops": op_counts(compiled.as_text()), "loop_steps": res.loop_steps,
            "output_ids": [int(t) for t in res.output_ids[0]]}
        decoders[name] = dec
    seconds = {k: [] for k in decoders}
    for i in range(args.repeats):
        for k in list(decoders)[i % 2:] + list(decoders)[:i % 2]:
            res = decoders[k].generate([prompt], args.max_new, batch_size=1)
            seconds[k].append(res.seconds / res.loop_steps)
    if args.repeats:
        out["seconds_per_loop_step"] = seconds
        ar, wide = seconds["ar"], seconds["lossless K=6,G=2"]
        steps = {k: out["programs"][k]["loop_steps"] for k in decoders}
        # the measure: AR's time over lossless's for the same tokens
        out["speedup"] = {"min": min(ar) * steps["ar"] / (min(wide) * steps["lossless K=6,G=2"]),
                          "median": statistics.median(ar) * steps["ar"]
                          / (statistics.median(wide) * steps["lossless K=6,G=2"])}
        print(f"{args.label}: lossless {out['speedup']['min']:.3f}x AR by fastest, "
              f"{out['speedup']['median']:.3f}x by median", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("step", help="one checkout's step programs and step times")
    s.add_argument("--label", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--repeats", type=int, default=9)
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--kv-write", default="current", choices=("current", "indexed", "both"))
    g = sub.add_parser("program", help="one checkout's generate programs (and generate times)")
    g.add_argument("--label", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--repeats", type=int, default=0)
    g.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    {"step": step, "program": program}[args.cmd](args)


if __name__ == "__main__":
    main()
