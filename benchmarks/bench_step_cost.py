"""What a wide decode step costs on this device: one decode step vs its width, in each matmul form.

Times, inside a jitted `fori_loop` against a static KV cache (200 slots filled, 384-slot
buffer): one forward of T new tokens, relative to T=1; the decoder layers' matmuls alone at
each width (where the cost of a few extra tokens comes from on this device); and the engine's
whole decode step of each lossless layout, relative to an AR step. The matmuls and the steps
are timed side by side in the forms `matmul.dense` can take for decode steps (weight-major, its
rows padded to whole kernel tiles; the same unpadded; input-major; plain); ratios are against
this CPU's default form (`compute.default_cpu_form`). For the demo proposer's shapes at batch
1/4/16 and, with `--preset`, for real Qwen2.5 shapes (random weights: cost does not depend on
the values) at batch 1. From the step ratios it derives, per lossless layout, the tokens per
step needed to break even and the speedup a *perfect* proposer (every draft accepted, K tokens per
step) would reach: the ceiling of ProVe-lossless on that hardware.
Writes benchmarks/step_cost.{json,md}.

    .venv/bin/python benchmarks/bench_step_cost.py [--preset qwen2.5-0.5b] [--repeats 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for prove_jax: runs from anywhere

import jax
import jax.numpy as jnp

from prove_jax import assets
from prove_jax.cli.bench_args import arg_type, parse_layouts, positive_ints
from prove_jax.evaluation.sweep import BenchError
from prove_jax.evaluation.report import cpu_description
from prove_jax.files import atomic_write_text
from prove_jax.checkpoints.checkpoint import load_config
from prove_jax.models.config import PRESETS
from prove_jax.decoding.step_timing import AR, decode_step_runs, layout_name, time_step_widths
from prove_jax.timing import fastest_interleaved, timed
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.decoding.mode_steps import head_in_one_pass
from prove_jax.models.compute import CPU_DECODE_MAX_ROWS, ComputeOptions, default_cpu_form
from prove_jax.models.matmul import dense
from prove_jax.models.params import create_model

WIDTHS = (1, 4, 7, 9, 10, 16, 29)  # 1 = AR; lossless K=2,G=2 .. K=8,G=3 (see LosslessLayout.width)
LAYOUTS = ((2, 2), (3, 3), (4, 2), (4, 4), (6, 2), (8, 2), (8, 3))  # (K, G) as benchmarked in decode.md


def ceilings(step_relative: dict[str, float], layouts=LAYOUTS) -> dict[str, dict]:
    """Per lossless layout: break-even tokens per step and the speedup of a perfect proposer."""
    out = {}
    for k, g in layouts:
        name = layout_name((k, g))
        cost = step_relative[name]
        out[name] = {"width": LosslessLayout.build(k, g).width,
                     "break_even_tokens_per_forward": cost, "perfect_proposer_speedup": k / cost}
    return out


def layer_kernels(model) -> list[jax.Array]:
    """Every decoder-layer weight matrix as [out, in] (q, k, v, o, gate, up, down per layer)."""
    out = []
    for layer in model.layers:
        a, m = layer.attn, layer.mlp
        out += [w[...].reshape(-1, w.shape[-1]) for w in (a.q_kernel, a.k_kernel, a.v_kernel)]
        out += [a.o_kernel[...].reshape(a.o_kernel.shape[0], -1)]
        out += [m.gate_kernel[...], m.up_kernel[...], m.down_kernel[...]]
    return out


class Form(NamedTuple):
    """A form `matmul.dense` can take for up to CPU_DECODE_MAX_ROWS rows (`matmul`, one of
    model.MATMUL_FORMS), weight-major rows padded to whole tiles or not; `suffix` tags its JSON
    keys, `title` its markdown rows."""
    matmul: str
    pad: bool
    suffix: str
    title: str

    @property
    def compute(self) -> ComputeOptions:
        """The compute options that trace `matmul.dense` in this form, on any platform."""
        return ComputeOptions(matmul_form=self.matmul, matmul_max_rows=CPU_DECODE_MAX_ROWS, pad_dot_rows=self.pad)


FORMS = {"weight_major": Form("weight_major", True, "_weight_major", "weight-major"),
         "unpadded": Form("weight_major", False, "_unpadded", "weight-major, rows unpadded"),
         "input_major": Form("input_major", True, "_input_major", "input-major"),
         "plain": Form("plain", False, "_plain", "plain")}


def dense_matmul_runs(model, batch: int, widths, steps: int, kernels=None, forms=FORMS) -> dict:
    """{(form, T): run} timing the decoder layers' matmuls alone (`matmul.dense` of x [B*T, in]
    with every layer weight, or with the weight matrices `kernels`; no attention, norms or LM
    head) in each of `forms`: isolates how XLA's dot kernels scale with T. (Reading one element
    of each product times the same as reducing all of it: XLA drops no part of the dots.)"""
    weights = layer_kernels(model) if kernels is None else kernels

    def make(kernel_options: ComputeOptions):
        @jax.jit
        def run(weights, x):
            def body(_, acc):
                xs = {d: v + acc for d, v in x.items()}  # inputs depend on the carry: nothing hoisted
                return acc + sum(dense(xs[w.shape[1]], w, compute=kernel_options)[0, 0] for w in weights) * 1e-9
            return jax.lax.fori_loop(0, steps, body, jnp.float32(0))
        return run

    runs = {}
    for form in forms:
        run = make(FORMS[form].compute)
        for t in widths:
            x = {d: jnp.ones((batch * t, d), jnp.float32) for d in {w.shape[1] for w in weights}}
            runs[(form, t)] = functools.partial(timed, run, weights, x)
    return runs


def measure(name: str, cfg, batches, repeats: int, steps: int, widths=WIDTHS, layouts=LAYOUTS) -> dict:
    rows = []
    for batch in batches:
        model = create_model(cfg, seed=0)
        ms = time_step_widths(model, batch, widths, repeats=repeats, steps=steps)
        dense_s = {k: v / steps for k, v in fastest_interleaved(
            dense_matmul_runs(model, batch, widths, steps), repeats).items()}
        step_runs = {}
        for form in FORMS:  # all forms interleaved: ratios side by side
            for key, run in decode_step_runs(model, batch, layouts, steps=steps, compute=FORMS[form].compute).items():
                step_runs[(form, layout_name(key))] = run
        default = FORMS[default_cpu_form()].compute
        one_pass = [key for key in layouts if head_in_one_pass(LosslessLayout.build(*key), batch, default)]
        two_passes = dataclasses.replace(default, lm_head_one_pass=False)
        for key, run in decode_step_runs(model, batch, one_pass, steps=steps, compute=two_passes).items():
            if key != AR:  # the default form with the LM head forced to two passes
                step_runs[("head_two_pass", layout_name(key))] = run
        step_s = {k: v / steps for k, v in fastest_interleaved(step_runs, repeats).items()}
        row = {"batch_size": batch, "forward_ms": {str(t): v * 1e3 for t, v in ms.items()},
               "forward_relative_to_T1": {str(t): v / ms[1] for t, v in ms.items()}}
        for form in FORMS:
            suffix = FORMS[form].suffix
            dense_f = {t: dense_s[(form, t)] for t in widths}
            step_ms = {key: v * 1e3 for (f, key), v in step_s.items() if f == form}
            step_rel = {key: v / step_ms["AR"] for key, v in step_ms.items()}
            row.update({f"dense_matmuls{suffix}_ms": {str(t): v * 1e3 for t, v in dense_f.items()},
                        f"dense_matmuls{suffix}_relative_to_T1": {str(t): v / dense_f[1] for t, v in dense_f.items()},
                        f"decode_step{suffix}_ms": step_ms, f"decode_step{suffix}_relative_to_ar": step_rel,
                        f"lossless_ceiling{suffix}": ceilings(step_rel, layouts)})
        row["decode_step_head_two_pass_ms"] = {key: v * 1e3 for (f, key), v in step_s.items()
                                               if f == "head_two_pass"}
        rows.append(row)
        print(name, batch, "forward vs T=1:", {t: round(v / ms[1], 2) for t, v in ms.items()}, flush=True)
        for form, f in FORMS.items():
            print(f"  step vs AR, {f.title}:", {key: round(v, 2) for key, v in
                                                 row[f"decode_step{f.suffix}_relative_to_ar"].items()}, flush=True)
    return {"name": name, "params": cfg.num_params, "widths": list(widths),
            "layouts": [list(x) for x in layouts], "decode_max_rows": CPU_DECODE_MAX_ROWS,
            "forms": list(FORMS), "default_form": default_cpu_form(), "rows": rows}


def _width_table(rows: list[dict], widths, key: str) -> list[str]:
    """Markdown rows: per batch, `key`_ms at T=1, then `key`_relative_to_T1 at each wider T."""
    lines = ["| batch | " + " | ".join(f"T={t}" for t in widths) + " |", "|---|" + "---|" * len(widths)]
    for r in rows:
        cells = [f"{r[key + '_ms']['1']:.2f} ms"] + [f"{r[key + '_relative_to_T1'][str(t)]:.2f}x"
                                                     for t in widths[1:]]
        lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + " |")
    return lines


def _ceiling_table(rows: list[dict], layouts, suffix: str) -> list[str]:
    ceil0 = rows[0]["lossless_ceiling" + suffix]
    lines = ["| batch | AR step | " + " | ".join(f"{l} (T={ceil0[l]['width']})" for l in layouts) + " |",
             "|---|---|" + "---|" * len(layouts)]
    for r in rows:
        c = r["lossless_ceiling" + suffix]
        lines.append(f"| {r['batch_size']} | {r['decode_step' + suffix + '_ms']['AR']:.2f} ms | " + " | ".join(
            f"{c[l]['break_even_tokens_per_forward']:.2f} / {c[l]['perfect_proposer_speedup']:.2f}x"
            for l in layouts) + " |")
    return lines


def markdown(models: list[dict]) -> list[str]:
    dev = jax.devices()[0]
    cpu = cpu_description()
    lines = [f"# Decode step cost vs width ({dev.platform}, {os.cpu_count()} cores{', ' + cpu if cpu else ''}, "
             "float32)", "",
             "Fastest of interleaved runs, 200 committed tokens in a 384-slot KV cache. Times are "
             "per step of a loop of 20 steps (3 at the preset shapes), all of one call: the "
             "input-major form's once-per-call weight transposes are spread over those steps, "
             "so at the preset shapes its rows mostly show what transposing the weights costs. "
             "*Forward*: one model forward of T new tokens, relative to T=1. *Decode step*: the "
             "engine's whole step (forward, LM head on the rows it needs, acceptance, commit) of "
             "each lossless layout (K tokens, G mask groups, width T), relative to an AR step. "
             "A layout pays off only when it commits more tokens per step than its step costs.", "",
             "The forms `matmul.dense` can run a decode step's at most "
             f"{models[0]['decode_max_rows']} token rows in: *weight-major*, W @ x^T, the weight as "
             "the dot's left operand, its rows padded with zero rows to whole 8-row kernel tiles "
             "past 4 rows (`matmul.padded_dot_rows`; *unpadded*: without that); *input-major*, "
             "x @ t(W) with the weight transposed to [in, out] once, outside the loop; *plain*, "
             "x @ W^T as written (what runs for more rows, and on accelerators). This CPU's "
             f"default (`compute.default_cpu_form`) is **{FORMS[models[0]['default_form']].title}**. "
             "All forms are timed in the same run, interleaved, on the same weights.", ""]
    for m in models:
        widths = m["widths"]
        layouts = [layout_name(key) for key in m["layouts"]]
        lines += [f"## {m['name']} ({m['params'] / 1e6:.1f}M params)", "", "Forward of T tokens:", ""]
        lines += _width_table(m["rows"], widths, "forward")
        # measured at the demo proposer's shapes only (bench_step_parts.py)
        in_step = (" In a loop of their own the weights stay in cache; inside a decode step the same "
                   "matmuls cost 1.2-4x more (`benchmarks/step_parts.md`)." if m["name"] == "demo proposer" else "")
        lines += ["", "The decoder layers' matmuls alone (every layer weight times x [B*T, D]; no "
                  f"attention, norms or LM head), ms per step, in each form.{in_step}", "",
                  "| batch | form | " + " | ".join(f"T={t}" for t in widths) + " |",
                  "|---|---|" + "---|" * len(widths)]
        for r in m["rows"]:
            for form in m["forms"]:
                lines.append(f"| {r['batch_size']} | {FORMS[form].title} | " + " | ".join(
                    f"{r['dense_matmuls' + FORMS[form].suffix + '_ms'][str(t)]:.2f}" for t in widths) + " |")
        default = FORMS[m["default_form"]]
        lines += ["", "Decode step, and the lossless ceiling: tokens per step needed to break even / "
                  "speedup over AR with a perfect proposer (K tokens every step), in each form, AR "
                  "in the same form:"]
        for form in m["forms"]:
            lines += ["", f"{FORMS[form].title}{' (the default)' if FORMS[form] == default else ''}:", ""]
            lines += _ceiling_table(m["rows"], layouts, FORMS[form].suffix)
        for form in [f for f in m["forms"] if FORMS[f] != default]:
            lines += ["", f"Step time {FORMS[form].title} / {default.title} (above 1: {default.title} "
                      "is faster):", "",
                      "| batch | AR | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
            for r in m["rows"]:
                w, other = r["decode_step" + default.suffix + "_ms"], r["decode_step" + FORMS[form].suffix + "_ms"]
                lines.append(f"| {r['batch_size']} | " + " | ".join(
                    f"{other[k] / w[k]:.2f}x" for k in ["AR"] + layouts) + " |")
        names = [k for k in layouts if any(k in r.get("decode_step_head_two_pass_ms", {}) for r in m["rows"])]
        if names:
            lines += ["", "LM head in one pass over the step's slots (the engine's choice where "
                      "`mode_steps.head_in_one_pass` allows it; - where it does not) / in two passes "
                      f"over only the slots it needs, {default.title} step time (below 1: one pass "
                      "is faster):", "",
                      "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
            for r in m["rows"]:
                w, other = r["decode_step" + default.suffix + "_ms"], r.get("decode_step_head_two_pass_ms", {})
                lines.append(f"| {r['batch_size']} | " + " | ".join(
                    f"{w[k] / other[k]:.2f}x" if k in other else "-" for k in names) + " |")
        lines.append("")
    lines += ["Regenerate: `.venv/bin/python benchmarks/bench_step_cost.py --preset qwen2.5-0.5b"
              " --repeats 9`"]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", default=[], choices=sorted(PRESETS),
                    help="also time this real model shape at batch 1 (repeatable)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="interleaved timing rounds, the fastest counts (default 5; more on a noisy machine)")
    ap.add_argument("--widths", type=arg_type(_widths), default=WIDTHS,
                    help="forward widths T to time, 1 first (default %(default)s)")
    ap.add_argument("--layouts", type=arg_type(_layouts), default=LAYOUTS,
                    help="lossless layouts KxG to time, e.g. 4x2,8x3 (default: the decode benchmark's)")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for step_cost.json / step_cost.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    if args.widths[0] != 1:
        ap.error("--widths must start with 1 (the AR forward every ratio is relative to)")
    if args.repeats < 1:  # zero rounds would time nothing and print inf ratios
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    os.makedirs(args.out_dir, exist_ok=True)
    demo = load_config(assets.DEMO_PROPOSER).replace(param_dtype="float32", dtype="float32")
    runs = [("demo proposer", demo, (1, 4, 16), args.repeats, 20)]
    runs += [(name, PRESETS[name].replace(param_dtype="float32", dtype="float32"), (1,),
              max(3, args.repeats // 2), 3) for name in args.preset]
    models = []
    for name, cfg, batches, repeats, steps in runs:  # results written after each model
        models.append(measure(name, cfg, batches, repeats=repeats, steps=steps, widths=args.widths,
                              layouts=args.layouts))
        result = {"device": str(jax.devices()[0]), "machine": platform.machine(), "cpu": cpu_description(),
                  "cpu_count": os.cpu_count(), "jax": jax.__version__, "models": models}
        atomic_write_text(os.path.join(args.out_dir, "step_cost.json"), json.dumps(result, indent=1) + "\n")
        atomic_write_text(os.path.join(args.out_dir, "step_cost.md"), "\n".join(markdown(models)) + "\n")


def _widths(text: str) -> tuple[int, ...]:
    return tuple(positive_ints(text, "--widths"))


def _layouts(text: str) -> tuple[tuple[int, int], ...]:
    layouts = parse_layouts(text, "--layouts")
    if not layouts or any(g is None for _, g in layouts):
        raise BenchError(f"--layouts: give K x G for each layout, e.g. 4x2,8x3; got {text!r}")
    return layouts


if __name__ == "__main__":
    main()
