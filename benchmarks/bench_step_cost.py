"""Why wide steps do not pay on this CPU: cost of one decode step vs its width.

Times one jitted forward of T new tokens against a static KV cache (200 slots filled, 384-slot
buffer) inside a `fori_loop`, for the demo proposer's shapes, relative to T=1, at batch 1/4/16,
plus the pure matmul throughput that explains it. Writes benchmarks/step_cost.{json,md}.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_step_cost.py
"""

from __future__ import annotations

import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prove_jax import assets
from prove_jax.checkpoint import atomic_write_text, load_config
from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.model import KVCache
from prove_jax.params import create_model

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTHS = (1, 4, 7, 9, 10, 16, 29)  # 1 = AR; lossless K=2,G=2 .. K=8,G=3 (see LosslessLayout.width)
STEPS = 20


def time_widths(cfg, batch: int, slots: int = 384, repeats: int = 5) -> dict[int, float]:
    graphdef, state = nnx.split(create_model(cfg, seed=0))
    cache = KVCache.zeros(cfg, batch, slots)

    @jax.jit
    def run(state, cache, toks, pos, mask):
        model = nnx.merge(graphdef, state)

        def body(i, carry):
            cache, acc = carry
            logits, cache = model(toks, pos, mask, cache, pos)
            return cache, acc + jnp.argmax(logits[:, -1], -1).sum()
        return jax.lax.fori_loop(0, STEPS, body, (cache, 0))[1]

    args = {}
    for t in WIDTHS:
        toks = jnp.zeros((batch, t), jnp.int32)
        pos = jnp.broadcast_to(200 + jnp.arange(t), (batch, t))
        mask = jnp.ones((batch, t, slots), bool)
        args[t] = (toks, pos, mask)
        jax.block_until_ready(run(state, cache, *args[t]))
    times = {t: [] for t in WIDTHS}
    for _ in range(repeats):  # interleaved, so load changes hit every width alike
        for t in WIDTHS:
            t0 = time.perf_counter()
            jax.block_until_ready(run(state, cache, *args[t]))
            times[t].append((time.perf_counter() - t0) / STEPS)
    return {t: float(np.median(v)) for t, v in times.items()}


def main() -> None:
    cfg = load_config(assets.DEMO_PROPOSER).replace(param_dtype="float32", dtype="float32")
    rows = []
    for batch in (1, 4, 16):
        ms = time_widths(cfg, batch)
        rows.append({"batch_size": batch, "step_ms": {str(t): v * 1e3 for t, v in ms.items()},
                     "relative_to_T1": {str(t): v / ms[1] for t, v in ms.items()}})
        print(batch, {t: round(v / ms[1], 2) for t, v in ms.items()}, flush=True)
    widths = {f"K={k},G={g}": LosslessLayout.build(k, g).width for k, g in ((2, 2), (3, 3), (4, 2), (4, 4), (8, 3))}
    result = {"model": assets.DEMO_PROPOSER, "params": cfg.num_params, "device": str(jax.devices()[0]),
              "machine": platform.machine(), "cpu_count": os.cpu_count(), "lossless_widths": widths,
              "rows": rows}
    lines = [f"# Decode step cost vs width (demo proposer shapes, {cfg.num_params / 1e6:.1f}M params, float32, {jax.devices()[0].platform})",
             "", "One forward of T new tokens against a 384-slot KV cache, median over interleaved runs; "
             "ratio to T=1 (an AR step). A lossless step of width T pays off only when it commits more "
             "than that ratio in tokens.", "",
             "| batch | " + " | ".join(f"T={t}" for t in WIDTHS) + " |",
             "|---|" + "---|" * len(WIDTHS)]
    for r in rows:
        cells = [f"{r['step_ms']['1']:.2f} ms"] + [f"{r['relative_to_T1'][str(t)]:.2f}x" for t in WIDTHS[1:]]
        lines.append(f"| {r['batch_size']} | " + " | ".join(cells) + " |")
    lines += ["", "Lossless step widths: " + ", ".join(f"{k}: T={w}" for k, w in widths.items()), "",
              "Regenerate: `PYTHONPATH=. .venv/bin/python benchmarks/bench_step_cost.py`"]
    atomic_write_text(os.path.join(HERE, "step_cost.json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(os.path.join(HERE, "step_cost.md"), "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
