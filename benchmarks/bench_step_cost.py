"""Why wide steps do not pay on this CPU: cost of one decode step vs its width.

Times one jitted forward of T new tokens against a static KV cache (200 slots filled, 384-slot
buffer) inside a `fori_loop`, relative to T=1 (an AR step), for the demo proposer's shapes at
batch 1/4/16 and, with `--preset`, for real Qwen2.5 shapes (random weights: cost does not
depend on the values) at batch 1. From the ratios it derives, per lossless layout, the
tokens per forward needed to break even and the speedup a *perfect* proposer (every draft
accepted, K tokens per forward) would reach: the ceiling of ProVe-lossless on that hardware.
Writes benchmarks/step_cost.{json,md}.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_cost.py [--preset qwen2.5-0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax

from prove_jax import assets
from prove_jax.checkpoint import atomic_write_text, load_config
from prove_jax.config import PRESETS
from prove_jax.decoding.calibrate import time_step_widths
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.params import create_model

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTHS = (1, 4, 7, 9, 10, 16, 29)  # 1 = AR; lossless K=2,G=2 .. K=8,G=3 (see LosslessLayout.width)
LAYOUTS = ((2, 2), (3, 3), (4, 2), (4, 4), (8, 3))  # (K, G) as benchmarked in decode.md


def ceilings(relative: dict[str, float]) -> dict[str, dict]:
    """Per lossless layout: width, break-even tokens/forward, speedup of a perfect proposer."""
    out = {}
    for k, g in LAYOUTS:
        width = LosslessLayout.build(k, g).width
        cost = relative[str(width)]
        out[f"K={k},G={g}"] = {"width": width, "break_even_tokens_per_forward": cost,
                               "perfect_proposer_speedup": k / cost}
    return out


def measure(name: str, cfg, batches, repeats: int, steps: int) -> dict:
    rows = []
    for batch in batches:
        ms = time_step_widths(create_model(cfg, seed=0), batch, WIDTHS, repeats=repeats, steps=steps)
        rel = {str(t): v / ms[1] for t, v in ms.items()}
        rows.append({"batch_size": batch, "step_ms": {str(t): v * 1e3 for t, v in ms.items()},
                     "relative_to_T1": rel, "lossless_ceiling": ceilings(rel)})
        print(name, batch, {t: round(v / ms[1], 2) for t, v in ms.items()}, flush=True)
    return {"name": name, "params": cfg.num_params, "rows": rows}


def markdown(models: list[dict]) -> list[str]:
    dev = jax.devices()[0]
    lines = [f"# Decode step cost vs width ({dev.platform}, {os.cpu_count()} cores, float32)", "",
             "One forward of T new tokens against a 384-slot KV cache, median over interleaved runs; "
             "ratio to T=1 (an AR step). A lossless step of width T pays off only when it commits more "
             "than that ratio in tokens.", ""]
    layouts = [f"K={k},G={g}" for k, g in LAYOUTS]
    for m in models:
        lines += [f"## {m['name']} ({m['params'] / 1e6:.1f}M params)", "",
                  "| batch | " + " | ".join(f"T={t}" for t in WIDTHS) + " |",
                  "|---|" + "---|" * len(WIDTHS)]
        for r in m["rows"]:
            cells = [f"{r['step_ms']['1']:.2f} ms"] + [f"{r['relative_to_T1'][str(t)]:.2f}x" for t in WIDTHS[1:]]
            lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + " |")
        lines += ["", "Lossless ceiling: tokens per forward needed to break even / speedup over AR with a "
                  "perfect proposer (K tokens every forward).", "",
                  "| batch | " + " | ".join(f"{l} (T={m['rows'][0]['lossless_ceiling'][l]['width']})" for l in layouts) + " |",
                  "|---|" + "---|" * len(layouts)]
        for r in m["rows"]:
            c = r["lossless_ceiling"]
            lines.append(f"| {r['batch_size']} | " + " | ".join(
                f"{c[l]['break_even_tokens_per_forward']:.2f} / {c[l]['perfect_proposer_speedup']:.2f}x"
                for l in layouts) + " |")
        lines.append("")
    lines += ["Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/bench_step_cost.py --preset qwen2.5-0.5b`"]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", default=[], choices=sorted(PRESETS),
                    help="also time this real model shape at batch 1 (repeatable)")
    args = ap.parse_args(argv)
    demo = load_config(assets.DEMO_PROPOSER).replace(param_dtype="float32", dtype="float32")
    models = [measure("demo proposer", demo, (1, 4, 16), repeats=5, steps=20)]
    for name in args.preset:
        cfg = PRESETS[name].replace(param_dtype="float32", dtype="float32")
        models.append(measure(name, cfg, (1,), repeats=3, steps=3))
    result = {"device": str(jax.devices()[0]), "machine": platform.machine(), "cpu_count": os.cpu_count(),
              "jax": jax.__version__, "models": models}
    atomic_write_text(os.path.join(HERE, "step_cost.json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(os.path.join(HERE, "step_cost.md"), "\n".join(markdown(models)) + "\n")


if __name__ == "__main__":
    main()
