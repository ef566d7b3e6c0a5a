"""The greedy-token reduction, jnp.argmax vs `tokens.greedy_tokens`, alone and inside decode steps.

    .venv/bin/python benchmarks/bench_argmax.py [--preset qwen2.5-0.5b] [--repeats 9]

Both pick the first index of the largest logit (tests/models/test_greedy_tokens.py). jnp.argmax is one
(value, index) reduction; `greedy_tokens` is two plain ones (the maximum, then the smallest
index holding it). Timed side by side, interleaved, the fastest round counting (a shared
machine only adds time):
- the reduction alone over logits [rows, V] for the step widths of AR (1 row) and lossless
  K=6,G=2 (16 rows), inside a jitted `fori_loop`;
- the engine's whole decode step (AR and K=6,G=2, the shipped demo proposer's shape at batch 1
  and, with --preset, a real Qwen2.5 shape with its own vocabulary and random weights), traced
  once with each reduction.

Writes benchmarks/argmax.json and benchmarks/argmax.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

STEPS = 50  # reductions per timed loop
DECODE_STEPS = 20  # decode steps per timed loop
LAYOUTS = ((6, 2),)  # K=6,G=2: the demo's lossless layout (16 rows a step at batch 1)


@contextlib.contextmanager
def plain_argmax():
    """Decode steps traced inside pick tokens with jnp.argmax (the reduction before)."""
    import jax.numpy as jnp
    from prove_jax.decoding import mode_steps as steps
    old = steps.greedy_tokens
    steps.greedy_tokens = lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)
    try:
        yield
    finally:
        steps.greedy_tokens = old


def reduction_runs(rows: int, vocab: int) -> dict:
    import jax
    import jax.numpy as jnp
    from prove_jax.timing import timed
    from prove_jax.models.tokens import greedy_tokens

    logits = jax.random.normal(jax.random.PRNGKey(0), (rows, vocab), jnp.float32)
    runs = {}
    for name, fn in (("argmax", lambda x: jnp.argmax(x, -1).astype(jnp.int32)), ("greedy_tokens", greedy_tokens)):
        @jax.jit
        def loop(x, fn=fn):
            def body(_, carry):  # the logits are carried and touched in place, so the reduction
                x, c = carry      # cannot be hoisted out of the loop and no step copies them
                x = x.at[0, 0].add(c.astype(jnp.float32))
                return x, c + fn(x)[0] % 2
            return jax.lax.fori_loop(0, STEPS, body, (x, jnp.int32(0)))[1]
        runs[name] = functools.partial(timed, loop, logits)
    return runs


def step_runs(model) -> dict:
    from prove_jax.decoding.step_timing import decode_step_runs
    runs = {("greedy_tokens",) + k: r for k, r in decode_step_runs(model, 1, LAYOUTS, steps=DECODE_STEPS).items()}
    with plain_argmax():
        before = decode_step_runs(model, 1, LAYOUTS, steps=DECODE_STEPS)
        for k, r in before.items():
            r()  # trace and compile under jnp.argmax
    runs.update({("argmax",) + k: r for k, r in before.items()})
    return runs


def main(argv=None) -> int:
    from prove_jax.models.config import PRESETS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", action="append", default=[], choices=sorted(PRESETS),
                    help="also time a real Qwen2.5 shape (random weights)")
    ap.add_argument("--repeats", type=int, default=9, help="timed rounds (default 9)")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for argmax.json / argmax.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    import jax
    from prove_jax import assets
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import cpu_description
    from prove_jax.files import atomic_write_text
    from prove_jax.checkpoints.checkpoint import load_model
    from prove_jax.decoding.step_timing import AR, layout_name
    from prove_jax.timing import fastest_interleaved
    from prove_jax.models.params import create_model

    shapes = [("demo proposer", load_model(assets.DEMO_PROPOSER, dtype="float32", param_dtype="float32"))]
    shapes += [(name, create_model(PRESETS[name].replace(param_dtype="float32", dtype="float32"), seed=0))
               for name in args.preset]
    reductions, steps = [], []
    for name, model in shapes:
        vocab = model.cfg.vocab_size
        for rows in (1, 16):
            log(f"{name}: reduction over [{rows}, {vocab}] ...")
            best = fastest_interleaved(reduction_runs(rows, vocab), args.repeats)
            reductions.append({"shape": name, "rows": rows, "vocab": vocab,
                               "argmax_us": best["argmax"] / STEPS * 1e6,
                               "greedy_tokens_us": best["greedy_tokens"] / STEPS * 1e6})
        log(f"{name}: decode steps (AR, K=6,G=2), both reductions ...")
        runs = step_runs(model)
        best = fastest_interleaved(runs, args.repeats if model is shapes[0][1] else max(3, args.repeats // 3))
        for key in [AR] + list(LAYOUTS):
            old, new = (best[(form,) + key] / DECODE_STEPS for form in ("argmax", "greedy_tokens"))
            steps.append({"shape": name, "vocab": vocab, "step": layout_name(key),
                          "argmax_ms": old * 1e3, "greedy_tokens_ms": new * 1e3})
        for s in steps[-2:]:
            log(f"  {s['step']}: {s['argmax_ms']:.2f} ms -> {s['greedy_tokens_ms']:.2f} ms")

    cpu = cpu_description() or str(jax.devices()[0])
    doc = {"device": cpu, "jax": jax.__version__, "repeats": args.repeats, "reductions": reductions,
           "decode_steps": steps}
    md = ["# Greedy-token reduction: jnp.argmax vs `tokens.greedy_tokens` (`benchmarks/bench_argmax.py`)", "",
          f"{cpu}, jax {jax.__version__}; fastest of {args.repeats} interleaved rounds (decode steps at "
          "a preset shape: a third of them, at least 3). Both reductions return the same tokens.", "",
          "The reduction alone, per call:", "",
          "| shape | logits | jnp.argmax | greedy_tokens | speedup |", "|---|---|---|---|---|"]
    md += [f"| {r['shape']} | [{r['rows']}, {r['vocab']}] | {r['argmax_us']:.1f} us | {r['greedy_tokens_us']:.1f} us "
           f"| {r['argmax_us'] / r['greedy_tokens_us']:.2f}x |" for r in reductions]
    md += ["", "The engine's whole decode step at batch 1 (`step_timing.decode_step_runs`), each traced with "
           "one reduction:", "", "| shape | step | with jnp.argmax | with greedy_tokens | time saved |",
           "|---|---|---|---|---|"]
    md += [f"| {s['shape']} | {s['step']} | {s['argmax_ms']:.2f} ms | {s['greedy_tokens_ms']:.2f} ms "
           f"| {1 - s['greedy_tokens_ms'] / s['argmax_ms']:.0%} |" for s in steps]
    by = {(s["shape"], s["step"]): s for s in steps}
    md += ["", "K=6,G=2 step cost in AR steps, each with its reduction:", ""]
    for name, _ in shapes:
        ar, ll = by[(name, "AR")], by[(name, "K=6,G=2")]
        md.append(f"- {name}: {ll['argmax_ms'] / ar['argmax_ms']:.2f}x with jnp.argmax, "
                  f"{ll['greedy_tokens_ms'] / ar['greedy_tokens_ms']:.2f}x with greedy_tokens")
    md += ["", "The reduction is a small share of a step (mostly matmuls), so the step rows are within "
           "this shared machine's round-to-round noise: read them as 'no step got dearer beyond "
           "noise', not as a speedup."]
    atomic_write_text(os.path.join(args.out_dir, "argmax.json"), json.dumps(doc, indent=1) + "\n")
    atomic_write_text(os.path.join(args.out_dir, "argmax.md"), "\n".join(md) + "\n")
    print(f"wrote {os.path.join(args.out_dir, 'argmax.json')}, {os.path.join(args.out_dir, 'argmax.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
