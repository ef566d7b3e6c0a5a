"""What reading the KV buffer in chunks, only as far as the batch's longest row, saves.

The engine's decode steps (AR and lossless K=6,G=2) with 200 committed tokens per row in
buffers of several lengths, timed side by side in one run: committed KV read chunk by chunk
(`model.cache_chunk`, the default: on CPU chunks of at least 128 slots from
`model.CPU_SHORT_CHUNK_ROWS` batch rows up, else 256), read in chunks of at least 256 slots at
every batch size (the rule before the short chunks; `CPU_SHORT_CHUNK_ROWS` raised past the
batch), and read in one pass over the whole buffer (what the engine did before chunks;
`model.CACHE_CHUNK` raised past the buffer). The demo proposer's shapes at batch 1, 4 and 16.
Writes benchmarks/cache_chunks.{json,md}.

    .venv/bin/python benchmarks/bench_cache_chunks.py [--repeats 7] [--buffers 640,1024]
        [--batch-sizes 1,16] [--steps 30] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for prove_jax: runs from anywhere

import jax

from prove_jax import assets, bench_lib, model as model_lib
from prove_jax.bench_lib import cpu_description
from prove_jax.checkpoint import atomic_write_text, load_config
from prove_jax.decoding.calibrate import AR, decode_step_runs, fastest_interleaved, layout_name
from prove_jax.params import create_model

BUFFERS = (384, 640, 1024, 2048)  # 384: one pass below CPU_SHORT_CHUNK_ROWS rows; 2048: 256-slot chunks at any batch
FILLED = 200
LAYOUT = (6, 2)
# (model.CACHE_CHUNK, model.CPU_SHORT_CHUNK_ROWS) during the trace
DEFAULT = (model_lib.CACHE_CHUNK, model_lib.CPU_SHORT_CHUNK_ROWS)
READS = {"chunked": DEFAULT, "256-slot chunks": (DEFAULT[0], 1 << 30), "one pass": (1 << 30, 1 << 30)}


def reads() -> dict:
    """READS this device distinguishes: off CPU the shorter chunks never apply, so the
    256-slot rule is the engine's own program and is not timed twice."""
    return {k: v for k, v in READS.items() if jax.default_backend() == "cpu" or k != "256-slot chunks"}


def step_runs(model, batch: int, slots: int, steps: int) -> dict:
    """{(read, step): callable} for AR and the lossless layout, each compiled under its read."""
    runs = {}
    for read, (chunk, short_rows) in reads().items():
        model_lib.CACHE_CHUNK, model_lib.CPU_SHORT_CHUNK_ROWS = chunk, short_rows
        try:
            for key, run in decode_step_runs(model, batch, [LAYOUT], slots=slots, filled=FILLED,
                                             steps=steps).items():
                run()  # traced and compiled now, under this read
                runs[(read, layout_name(key))] = run
        finally:
            model_lib.CACHE_CHUNK, model_lib.CPU_SHORT_CHUNK_ROWS = DEFAULT
    return runs


def measure(cfg, batches, buffers, repeats: int, steps: int) -> list[dict]:
    model = create_model(cfg, seed=0)
    rows = []
    for batch in batches:
        for slots in buffers:
            best = fastest_interleaved(step_runs(model, batch, slots, steps), repeats, warm_up=False)
            ms = {f"{read}/{step}": seconds / steps * 1e3 for (read, step), seconds in best.items()}
            row = {"batch_size": batch, "buffer_slots": slots, "step_ms": ms,  # the AR cache: buffer + 1 slot
                   "ar_chunk": model_lib.cache_chunk(slots + 1, rows=batch)}
            for step in (layout_name(AR), layout_name(LAYOUT)):
                for read in (r for r in reads() if r != "chunked"):  # READS order: stable JSON
                    row[f"{read}_over_chunked/{step}"] = ms[f"{read}/{step}"] / ms[f"chunked/{step}"]
            rows.append(row)
            bench_lib.log(f"batch {batch} buffer {slots}: " + ", ".join(
                f"{k} {v:.3f} ms" for k, v in ms.items()))
    return rows


def markdown(result: dict) -> list[str]:
    lines = [f"# KV buffer read in chunks vs in one pass ({result['cpu']}, jax {result['jax']}, float32)", "",
             f"Demo proposer ({result['params'] / 1e6:.1f}M parameters); {FILLED} committed tokens per "
             f"row; decode steps of a jitted loop, fastest of {result['repeats']} interleaved rounds, "
             f"all in one run. *Chunked*: committed KV read `model.cache_chunk` slots at a time, up "
             f"to the batch's longest row (the engine's default: on CPU chunks of at least "
             f"{model_lib.CACHE_CHUNK // 2} slots from {model_lib.CPU_SHORT_CHUNK_ROWS} rows up, else "
             f"{model_lib.CACHE_CHUNK}; a buffer that cannot hold two chunks is one pass, and where the "
             f"columns run the same program their ratio is this run's noise). *256-slot chunks*: "
             f"chunks of at least {model_lib.CACHE_CHUNK} slots at every batch size (the rule before "
             f"the shorter chunks). *One pass*: the whole buffer every step. Ratio > 1: chunked is faster."]
    for step in (layout_name(AR), layout_name(LAYOUT)):
        lines += ["", f"{step} step:", "",
                  "| batch | buffer | AR chunk | chunked | 256-slot chunks | one pass | 256-slot / chunked "
                  "| one pass / chunked |", "|---|---|---|---|---|---|---|---|"]
        for r in result["rows"]:
            ms = r["step_ms"]
            long_only = ms.get(f"256-slot chunks/{step}")  # off CPU: the engine's own program
            lines.append(f"| {r['batch_size']} | {r['buffer_slots']} | {r['ar_chunk']} | "
                         f"{ms[f'chunked/{step}']:.3f} ms | "
                         + ("- | " if long_only is None else f"{long_only:.3f} ms | ")
                         + f"{ms[f'one pass/{step}']:.3f} ms | "
                         + ("- | " if long_only is None else f"{r[f'256-slot chunks_over_chunked/{step}']:.2f}x | ")
                         + f"{r[f'one pass_over_chunked/{step}']:.2f}x |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7,
                    help="interleaved timing rounds, the fastest counts (default 7)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per timed loop (default 30)")
    ap.add_argument("--buffers", type=bench_lib.arg_type(lambda t: bench_lib.positive_ints(t, "--buffers")),
                    default=BUFFERS, help="buffer lengths in slots (default %(default)s)")
    ap.add_argument("--batch-sizes", type=bench_lib.arg_type(lambda t: bench_lib.positive_ints(t, "--batch-sizes")),
                    default=(1, 4, 16), help="rows per step (default %(default)s)")
    ap.add_argument("--out-dir", default=HERE, help="where cache_chunks.{json,md} go (default benchmarks/)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    if min(args.buffers) <= FILLED:
        ap.error(f"--buffers: every buffer must be longer than the {FILLED} committed tokens")
    os.makedirs(args.out_dir, exist_ok=True)
    cfg = load_config(assets.DEMO_PROPOSER).replace(param_dtype="float32", dtype="float32")
    rows = measure(cfg, args.batch_sizes, args.buffers, args.repeats, args.steps)
    result = {"device": str(jax.devices()[0]), "machine": platform.machine(), "cpu": cpu_description(),
              "cpu_count": os.cpu_count(), "jax": jax.__version__, "params": cfg.num_params,
              "repeats": args.repeats, "steps": args.steps, "filled": FILLED, "rows": rows}
    atomic_write_text(os.path.join(args.out_dir, "cache_chunks.json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(os.path.join(args.out_dir, "cache_chunks.md"), "\n".join(markdown(result)) + "\n")


if __name__ == "__main__":
    main()
