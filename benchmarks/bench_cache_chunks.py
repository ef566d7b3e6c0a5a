"""What reading the KV buffer in chunks, only as far as the batch's longest row, saves.

The engine's decode steps (AR and lossless K=6,G=2) with 200 committed tokens per row in
buffers of several lengths, timed side by side in one run: committed KV read by the engine's
rule (`attention.cache_chunk`: chunk by chunk, on CPU chunks of at least 128 slots from
`attention.CPU_SHORT_CHUNK_ROWS` batch rows up, else 256; on a GPU in one pass below
`attention.GPU_CHUNKED_MIN_ROWS` rows), read in one pass over the whole buffer (what the engine did
before chunks; `attention.CACHE_CHUNK` raised past the buffer) and, where the rule differs by batch
size, as the rule did before: on CPU chunks of at least 256 slots at every batch size
(`CPU_SHORT_CHUNK_ROWS` raised past the batch), on a GPU chunks at every batch size
(`GPU_CHUNKED_MIN_ROWS` = 1). A read that comes to the same chunking as one already compiled
times that same program again (their ratio is the run's noise). The demo proposer's shapes at
batch 1, 4 and 16, or with `--preset` a real Qwen2.5 shape (random weights: the cost does not
depend on the values). Writes cache_chunks.{json,md} (with --preset cache_chunks_PRESET.*).

    .venv/bin/python benchmarks/bench_cache_chunks.py [--repeats 7] [--buffers 640,1024]
        [--batch-sizes 1,16] [--steps 30] [--preset qwen2.5-1.5b] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for prove_jax: runs from anywhere

import jax

from prove_jax import assets
from prove_jax.cli.bench_args import arg_type, positive_ints
from prove_jax.evaluation.progress import log
from prove_jax.models import attention
from prove_jax.evaluation.report import cpu_description
from prove_jax.files import atomic_write_text
from prove_jax.checkpoints.checkpoint import load_config
from prove_jax.models.config import PRESETS, preset
from prove_jax.decoding.step_timing import AR, decode_step_runs, layout_name
from prove_jax.timing import fastest_interleaved
from prove_jax.models.params import create_model

BUFFERS = (384, 640, 1024, 2048)  # 384: one pass below CPU_SHORT_CHUNK_ROWS rows; 2048: 256-slot chunks at any batch
FILLED = 200
LAYOUT = (6, 2)
# (attention.CACHE_CHUNK, attention.CPU_SHORT_CHUNK_ROWS, attention.GPU_CHUNKED_MIN_ROWS) during the trace
RULE = ("CACHE_CHUNK", "CPU_SHORT_CHUNK_ROWS", "GPU_CHUNKED_MIN_ROWS")
DEFAULT = tuple(getattr(attention, name) for name in RULE)
NEVER = 1 << 30
READS = {"chunked": DEFAULT,
         "256-slot chunks": (DEFAULT[0], NEVER, DEFAULT[2]),  # CPU: the rule before short chunks
         "always chunked": DEFAULT[:2] + (1,),  # GPU: the rule before one pass at small batch
         "one pass": (NEVER, NEVER, NEVER)}
# the read that shows this backend's previous rule (the other one is the engine's own program)
PREVIOUS = {"cpu": "256-slot chunks", "gpu": "always chunked"}


def reads() -> dict:
    """READS this device distinguishes (a TPU has only the chunked rule and one pass)."""
    previous = PREVIOUS.get(jax.default_backend())
    return {k: v for k, v in READS.items() if k not in PREVIOUS.values() or k == previous}


def _set_rule(values) -> None:
    for name, value in zip(RULE, values):
        setattr(attention, name, value)


def step_runs(model, batch: int, slots: int, steps: int) -> dict:
    """{(read, step): callable} for AR and the lossless layout, each compiled under its read;
    a read that chunks these buffers as an earlier one did reuses its programs."""
    runs, compiled = {}, {}
    for read, rule in reads().items():
        _set_rule(rule)
        try:  # the AR step's buffer has one slot more (decode_step_runs)
            chunking = tuple(attention.cache_chunk(n, rows=batch) for n in (slots, slots + 1))
            if chunking not in compiled:
                compiled[chunking] = decode_step_runs(model, batch, [LAYOUT], slots=slots,
                                                      filled=FILLED, steps=steps)
                for run in compiled[chunking].values():
                    run()  # traced and compiled now, under this read
            for key, run in compiled[chunking].items():
                runs[(read, layout_name(key))] = run
        finally:
            _set_rule(DEFAULT)
    return runs


def measure(cfg, batches, buffers, repeats: int, steps: int) -> list[dict]:
    model = create_model(cfg, seed=0)
    log(f"{cfg.num_params / 1e6:.0f}M parameters, reads: {', '.join(reads())}")
    rows = []
    for batch in batches:
        for slots in buffers:
            best = fastest_interleaved(step_runs(model, batch, slots, steps), repeats, warm_up=False)
            ms = {f"{read}/{step}": seconds / steps * 1e3 for (read, step), seconds in best.items()}
            row = {"batch_size": batch, "buffer_slots": slots, "step_ms": ms,  # the AR cache: buffer + 1 slot
                   "ar_chunk": attention.cache_chunk(slots + 1, rows=batch)}
            for step in (layout_name(AR), layout_name(LAYOUT)):
                for read in (r for r in reads() if r != "chunked"):  # READS order: stable JSON
                    row[f"{read}_over_chunked/{step}"] = ms[f"{read}/{step}"] / ms[f"chunked/{step}"]
            rows.append(row)
            log(f"batch {batch} buffer {slots}: " + ", ".join(
                f"{k} {v:.3f} ms" for k, v in ms.items()))
    return rows


READ_TEXT = {
    "256-slot chunks": f"chunks of at least {attention.CACHE_CHUNK} slots at every batch size (the "
                       f"CPU rule before the shorter chunks)",
    "always chunked": f"chunks at every batch size (the GPU rule before one pass below "
                      f"{attention.GPU_CHUNKED_MIN_ROWS} rows)",
    "one pass": "the whole buffer every step"}


def markdown(result: dict) -> list[str]:
    others = [r for r in result["reads"] if r != "chunked"]
    model = (f"The {result['preset']} shape, random weights" if result.get("preset")
             else "Demo proposer")
    lines = [f"# KV buffer read in chunks vs in one pass ({result['cpu'] or result['device']}, "
             f"jax {result['jax']}, float32)", "",
             f"{model} ({result['params'] / 1e6:.1f}M parameters); {FILLED} committed tokens per "
             f"row; decode steps of a jitted loop, fastest of {result['repeats']} interleaved rounds, "
             f"all in one run. *Chunked*: the engine's rule, `attention.cache_chunk` (KV read a chunk at "
             f"a time up to the batch's longest row: on CPU chunks of at least "
             f"{attention.CACHE_CHUNK // 2} slots from {attention.CPU_SHORT_CHUNK_ROWS} rows up, else "
             f"{attention.CACHE_CHUNK}; on a GPU one pass below {attention.GPU_CHUNKED_MIN_ROWS} rows; "
             f"a buffer that cannot hold two chunks is one pass). "
             + " ".join(f"*{r[0].upper() + r[1:]}*: {READ_TEXT[r]}." for r in others)
             + " Where two columns come to the same chunking they time the same program, and their "
             "ratio is this run's noise. Ratio > 1: the engine's rule is faster."]
    for step in (layout_name(AR), layout_name(LAYOUT)):
        lines += ["", f"{step} step:", "",
                  "| batch | buffer | AR chunk | chunked | " + " | ".join(others) + " | "
                  + " | ".join(f"{r} / chunked" for r in others) + " |",
                  "|---|---|---|---|" + "---|" * (2 * len(others))]
        for r in result["rows"]:
            ms = r["step_ms"]
            lines.append(f"| {r['batch_size']} | {r['buffer_slots']} | {r['ar_chunk']} | "
                         f"{ms[f'chunked/{step}']:.3f} ms | "
                         + " | ".join(f"{ms[f'{o}/{step}']:.3f} ms" for o in others) + " | "
                         + " | ".join(f"{r[f'{o}_over_chunked/{step}']:.2f}x" for o in others) + " |")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7,
                    help="interleaved timing rounds, the fastest counts (default 7)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps per timed loop (default 30)")
    ap.add_argument("--buffers", type=arg_type(lambda t: positive_ints(t, "--buffers")),
                    default=BUFFERS, help="buffer lengths in slots (default %(default)s)")
    ap.add_argument("--batch-sizes", type=arg_type(lambda t: positive_ints(t, "--batch-sizes")),
                    default=(1, 4, 16), help="rows per step (default %(default)s)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="time this real Qwen2.5 shape (random weights) instead of the demo proposer's")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for cache_chunks.json / cache_chunks.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    if min(args.buffers) <= FILLED:
        ap.error(f"--buffers: every buffer must be longer than the {FILLED} committed tokens")
    os.makedirs(args.out_dir, exist_ok=True)
    cfg = preset(args.preset) if args.preset else load_config(assets.DEMO_PROPOSER)
    cfg = cfg.replace(param_dtype="float32", dtype="float32")
    rows = measure(cfg, args.batch_sizes, args.buffers, args.repeats, args.steps)
    result = {"device": str(jax.devices()[0]), "machine": platform.machine(), "cpu": cpu_description(),
              "cpu_count": os.cpu_count(), "jax": jax.__version__, "params": cfg.num_params,
              "preset": args.preset, "reads": list(reads()), "repeats": args.repeats,
              "steps": args.steps, "filled": FILLED, "rows": rows}
    name = "cache_chunks" + (f"_{args.preset}" if args.preset else "")
    atomic_write_text(os.path.join(args.out_dir, name + ".json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(os.path.join(args.out_dir, name + ".md"), "\n".join(markdown(result)) + "\n")


if __name__ == "__main__":
    main()
