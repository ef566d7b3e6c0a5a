"""Where a decode step's time goes: its matmuls inside the step vs the same matmuls alone.

`bench_step_cost.py` times the decoder layers' matmuls in a loop of their own, where the dots
are independent of each other and the same few weights come round every iteration. Inside a
decode step they run one after another, between attention, norms and the LM head, against a
KV cache. This script times, side by side in one run, for AR and two lossless layouts:

- the engine's whole decode step (as in `bench_step_cost.py`);
- the same step with every `matmul.dense` (the layers' matmuls and the LM head) replaced by an
  operation that keeps its output shape and its dependence on the input but does no
  arithmetic: the rest of the step (attention, norms, rotary, acceptance, commit);
- those matmuls alone: every layer weight and the LM head times x [B*T, D], in a loop of their
  own, at the step's width T.

The difference of the first two is what the matmuls cost inside the step (an estimate: without
its matmuls the step's other work may also overlap differently on the CPU's threads); its ratio
to the third says how far a loop of bare matmuls understates them. The demo proposer's shapes (random float32
weights: the cost does not depend on the values) at batch 1, 4 and 16.
Writes benchmarks/step_parts.{json,md}.

    .venv/bin/python benchmarks/bench_step_parts.py [--repeats 9] [--batch-sizes 1,16]
        [--steps 50] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for prove_jax: runs from anywhere

import jax
import jax.numpy as jnp

from bench_step_cost import dense_matmul_runs, layer_kernels
from prove_jax import assets
from prove_jax.cli.bench_args import arg_type, positive_ints
from prove_jax.models import attention, qwen2
from prove_jax.evaluation.report import cpu_description
from prove_jax.files import atomic_write_text
from prove_jax.checkpoints.checkpoint import load_config
from prove_jax.decoding.step_timing import AR, decode_step_runs, layout_name
from prove_jax.timing import fastest_interleaved
from prove_jax.decoding.options import DecodeOptions, LosslessRule
from prove_jax.decoding.program import step_shape
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions, default_cpu_form
from prove_jax.models.matmul import dense
from prove_jax.models.params import create_model

LAYOUTS = ((4, 2), (6, 2))  # lossless K, G; with AR


def _free_dense(x: jax.Array, w: jax.Array, n_in: int = 1, compute: ComputeOptions = DEFAULT_COMPUTE) -> jax.Array:
    """`matmul.dense`'s output shape, no arithmetic: x's first feature broadcast over the output
    features (so the step still depends on every layer) plus one weight element."""
    lead = x.shape[:x.ndim - n_in]
    out = w.shape[:w.ndim - n_in]
    first = x.reshape(lead + (-1,))[..., :1].reshape(lead + (1,) * len(out))
    return jnp.broadcast_to(first, lead + out) + w.reshape(-1)[0].astype(x.dtype)


@contextlib.contextmanager
def matmuls_free():
    """Trace decode steps with `_free_dense` in place of `matmul.dense` where the layers and the
    LM head call it (read at trace time)."""
    for module in (attention, qwen2):
        module.dense = _free_dense
    try:
        yield
    finally:
        for module in (attention, qwen2):
            module.dense = dense


def _width(key) -> int:
    options = DecodeOptions("ar") if key == AR else DecodeOptions("lossless", key[0], lossless=LosslessRule(max_groups=key[1]))
    return step_shape(options.validate())[0]


def matmuls_alone_runs(model, batch: int, widths, steps: int) -> dict:
    """{T: callable} timing every layer weight and the LM head times x [B*T, D], `steps` times in
    one jitted loop (`bench_step_cost.dense_matmul_runs` with the head added), in this CPU's
    decode form."""
    head = model.embed[...] if model.cfg.tie_word_embeddings else model.lm_head[...]
    form = default_cpu_form()
    runs = dense_matmul_runs(model, batch, widths, steps, kernels=layer_kernels(model) + [head],
                             forms=(form,))
    return {t: runs[(form, t)] for t in widths}


def measure(cfg, batches, repeats: int, steps: int) -> list[dict]:
    model = create_model(cfg, seed=0)
    keys = [AR] + list(LAYOUTS)
    rows = []
    for batch in batches:
        runs = {}
        for part, ctx in (("step", contextlib.nullcontext), ("step_without_matmuls", matmuls_free)):
            with ctx():
                for key, run in decode_step_runs(model, batch, LAYOUTS, steps=steps).items():
                    run()  # traced and compiled now, under this dense
                    runs[(part, layout_name(key))] = run
        for t, run in matmuls_alone_runs(model, batch, sorted({_width(k) for k in keys}), steps).items():
            run()
            runs[("matmuls_alone", t)] = run
        ms = {k: v / steps * 1e3 for k, v in fastest_interleaved(runs, repeats, warm_up=False).items()}
        for key in keys:
            name, t = layout_name(key), _width(key)
            full, rest, alone = ms[("step", name)], ms[("step_without_matmuls", name)], ms[("matmuls_alone", t)]
            rows.append({"batch_size": batch, "step": name, "width": t, "step_ms": full,
                         "step_without_matmuls_ms": rest, "matmuls_in_step_ms": full - rest,
                         "matmul_share_of_step": (full - rest) / full, "matmuls_alone_ms": alone,
                         "in_step_over_alone": (full - rest) / alone})
            print(f"batch {batch} {name:9s} step {full:.3f} ms, without matmuls {rest:.3f} ms, "
                  f"matmuls alone {alone:.3f} ms", flush=True)
    return rows


def markdown(result: dict) -> list[str]:
    lines = [f"# Decode step parts: matmuls inside the step vs alone ({result['cpu']}, "
             f"jax {result['jax']}, float32)", "",
             f"Demo proposer shapes ({result['params'] / 1e6:.1f}M parameters, random weights); 200 committed "
             f"tokens in a 384-slot KV cache; fastest of {result['repeats']} interleaved rounds of "
             f"{result['steps']} steps in one jitted loop, all in one run. *Step*: the engine's decode step. "
             "*Without matmuls*: the same step with every `matmul.dense` (layer matmuls and LM head) doing no "
             "arithmetic. *Matmuls in step*: the difference (an estimate: without its matmuls the rest of the "
             "step may overlap differently on the CPU's threads). *Matmuls alone*: the same weights times x "
             "[B*T, D] in a loop of their own (`bench_step_cost.py` times the layers' part of this). "
             "*In step / alone*: how much dearer the matmuls are inside the step.", "",
             "| batch | step | T | step | without matmuls | matmuls in step | share | matmuls alone | in step / alone |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['batch_size']} | {r['step']} | {r['width']} | {r['step_ms']:.3f} ms | "
                     f"{r['step_without_matmuls_ms']:.3f} ms | {r['matmuls_in_step_ms']:.3f} ms | "
                     f"{r['matmul_share_of_step']:.0%} | {r['matmuls_alone_ms']:.3f} ms | "
                     f"{r['in_step_over_alone']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=arg_type(
        lambda text: positive_ints(text, "--batch-sizes")), default=(1, 4, 16))
    ap.add_argument("--repeats", type=int, default=9,
                    help="interleaved timing rounds, the fastest counts (default 9)")
    ap.add_argument("--steps", type=int, default=50, help="decode steps per timed loop (default 50)")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for step_parts.json / step_parts.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    os.makedirs(args.out_dir, exist_ok=True)
    cfg = load_config(assets.DEMO_PROPOSER).replace(param_dtype="float32", dtype="float32")
    rows = measure(cfg, args.batch_sizes, args.repeats, args.steps)
    result = {"device": str(jax.devices()[0]), "machine": platform.machine(), "cpu": cpu_description(),
              "cpu_count": os.cpu_count(), "jax": jax.__version__, "matmul_form": default_cpu_form(),
              "params": cfg.num_params, "repeats": args.repeats, "steps": args.steps, "rows": rows}
    atomic_write_text(os.path.join(args.out_dir, "step_parts.json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(os.path.join(args.out_dir, "step_parts.md"), "\n".join(markdown(result)) + "\n")


if __name__ == "__main__":
    main()
