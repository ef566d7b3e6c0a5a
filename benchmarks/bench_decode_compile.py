"""Compile time of the whole decode program by depth, layers unrolled vs one `lax.scan`.

    nice .venv/bin/python benchmarks/bench_decode_compile.py [--preset qwen2.5-1.5b]
        [--layers 28,64] [--modes ar,lossless] [--out benchmarks]

The program is `Decoder.generate`'s (prefill, the `while_loop`, admission of queued requests),
lowered with abstract weights of the preset's widths at each depth (nothing is allocated) and
compiled for this machine's backend, at batch 2 serving a queue of 4 (so admission is compiled
too) with 128-token prompts and 128 new tokens. Each program is compiled once, in a fresh
Decoder; the table gives wall and CPU seconds and the compiled program's instruction count.

With `--time PRESET` it also times decoding, scanned against unrolled in interleaved rounds
(the fastest round counts), with the shipped proposer inflated to that preset's shape (the
same outputs, a real model's cost per step): ar and lossless over HumanEval prompts at batch 1.

Writes decode_compile.json and decode_compile.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def scan_note(timed: list[dict], backend: str) -> str:
    """Why scanned decoding ran slower, said only when this run's rows show it (on CPU)."""
    slower = [r for r in timed if r["layout"] == "scan" and r["vs_unrolled"] < 1]
    if not slower or backend != "cpu":
        return ""
    ran = ", ".join(f"{r['mode']} {r['vs_unrolled']:.2f}x" for r in slower)
    return (f"Scanned decoding ran slower than unrolled here ({ran}): XLA:CPU's matmuls take whole "
            "buffers, so each step slices every layer's weights out of the stack into a copy, a "
            "second pass over the weights at a shape bound by reading them. Compiled for a TPU the "
            "matmuls read the stack at the layer's offset, with no copy (tests/decoding/test_decode_scan.py "
            "checks both programs). Hence scan_layers is off by default and meant for large models "
            "on TPU, where the unrolled program's compile time grows with depth.")


def parse_args(argv=None):
    from prove_jax.cli.bench_args import arg_type, parse_choices, positive_ints
    from prove_jax.models.config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(PRESETS), help="widths (default qwen2.5-1.5b)")
    p.add_argument("--layers", type=arg_type(lambda t: positive_ints(t, "--layers")),
                   default=[28, 64], help="depths to compile (default 28,64)")
    p.add_argument("--modes", type=arg_type(lambda t: parse_choices(t, ("ar", "lossless"), "--modes")),
                   default=["ar", "lossless"], help="ar and/or lossless (K=8, 2 mask groups)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--time", default=None, choices=sorted(PRESETS), metavar="PRESET",
                   help="also time decoding at this inflated shape, scanned vs unrolled (e.g. qwen2.5-0.5b)")
    p.add_argument("--prompts", type=int, default=4, help="HumanEval prompts timed with --time (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds with --time (default 3)")
    p.add_argument("--out", default=RESULTS, help="folder for decode_compile.json/.md (default runs/benchmarks/; "
                                                   "--out benchmarks updates the committed results)")
    return p.parse_args(argv)


def abstract_model(cfg, scan_layers: bool):
    """The model with `ShapeDtypeStruct` weights: its layers stacked for a scanned program."""
    from flax import nnx

    from prove_jax.models.qwen2 import Qwen2, stack_layers

    def build():
        model = Qwen2(cfg, nnx.Rngs(0))
        return stack_layers(model) if scan_layers else model
    return nnx.eval_shape(build)


def compile_once(cfg, options) -> dict:
    from prove_jax.decoding.engine import Decoder
    decoder = Decoder(abstract_model(cfg, options.memory.scan_layers), list(cfg.eos_token_ids), options,
                      pad_id=cfg.pad_token_id)
    prompts = [[3] * 128] * 4
    t0 = time.perf_counter()
    lowered = decoder.lower(prompts, 128, batch_size=2)
    lower_seconds = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), time.process_time()
    compiled = lowered.compile()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    instructions = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
    return dict(lower_seconds=round(lower_seconds, 2), compile_seconds=round(seconds, 2),
                compile_cpu_seconds=round(cpu, 2), hlo_instructions=instructions)


def time_decoding(inflate_to: str, num_prompts: int, repeats: int) -> list[dict]:
    """Seconds per generated token, scanned vs unrolled, for ar and lossless K=8 G=2 at batch 1."""
    from prove_jax import assets
    from prove_jax.timing import fastest_interleaved
    from prove_jax.decoding.options import DecodeOptions, LosslessRule, MemoryLayout
    from prove_jax.evaluation.benchmark import humaneval_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.progress import log

    pair = load_pair(assets.DEMO_PROPOSER, inflate_to=inflate_to)
    prompts = humaneval_prompts(pair.tokenizer, num_prompts)
    runs, outputs, tokens = {}, {}, {}
    for mode in ("ar", "lossless"):
        for scan in (False, True):
            options = (DecodeOptions("ar", memory=MemoryLayout(scan_layers=scan)) if mode == "ar"
                       else DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(scan_layers=scan)))
            decoder = pair.decoder(options)
            key = (mode, scan)

            def run(decoder=decoder, key=key):
                result = decoder.generate(prompts, 128, batch_size=1)
                outputs[key] = result.output_ids
                tokens[key] = sum(map(len, result.output_ids))
                return result.seconds
            runs[key] = run
    log(f"timing ar and lossless at the {inflate_to} shape, scanned vs unrolled ...")
    best = fastest_interleaved(runs, repeats)
    rows = []
    for (mode, scan), seconds in best.items():
        rows.append(dict(mode=mode, layout="scan" if scan else "unrolled", seconds=round(seconds, 3),
                         tokens=tokens[(mode, scan)], tok_per_s=round(tokens[(mode, scan)] / seconds, 2),
                         vs_unrolled=round(best[(mode, False)] / seconds, 3),
                         same_output_as_unrolled=outputs[(mode, scan)] == outputs[(mode, False)]))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from prove_jax.decoding.options import DecodeOptions, LosslessRule, MemoryLayout
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.models.config import preset

    base = preset(args.preset).replace(dtype=args.dtype, param_dtype=args.dtype, mask_token_id=151665)
    rows = []
    for layers in args.layers:
        cfg = base.replace(num_layers=layers)
        for mode in args.modes:
            for scan in (False, True):
                options = (DecodeOptions("ar", memory=MemoryLayout(scan_layers=scan)) if mode == "ar"
                           else DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(scan_layers=scan)))
                log(f"compiling {mode} at {layers} layers, {'scanned' if scan else 'unrolled'}")
                row = dict(layers=layers, mode=mode, layout="scan" if scan else "unrolled", **compile_once(cfg, options))
                log(f"  {row}")
                rows.append(row)
    timed = time_decoding(args.time, args.prompts, args.repeats) if args.time else []
    device = device_description()
    doc = dict(preset=args.preset, dtype=args.dtype, backend=jax.default_backend(), device=device,
               jax=jax.__version__, batch=2, queue=4, prompt_tokens=128, new_tokens=128, rows=rows,
               decode_time=dict(inflate_to=args.time, prompts=args.prompts, repeats=args.repeats, rows=timed))
    md = ["# Decode program compile time by depth: unrolled vs scanned layers",
          "",
          f"`benchmarks/bench_decode_compile.py`: `Decoder.generate`'s whole program (prefill, loop, "
          f"admission) at the {args.preset} widths in {args.dtype}, abstract weights, compiled for "
          f"{jax.default_backend()} ({device}), jax {jax.__version__}; batch 2 serving 4 requests, 128 prompt "
          f"and 128 new tokens. Lossless is K=8 with 2 mask groups. Compile seconds are wall time on a "
          f"shared 2-core machine (CPU seconds beside them); the instruction count is the optimised HLO's.",
          "",
          "| layers | mode | layout | compile s | compile CPU s | HLO instructions |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['layers']} | {r['mode']} | {r['layout']} | {r['compile_seconds']:.1f} | "
           f"{r['compile_cpu_seconds']:.1f} | {r['hlo_instructions']} |" for r in rows]
    if timed:
        md += ["", f"Decoding with the shipped proposer inflated to the {args.time} shape (float32), "
                   f"{args.prompts} HumanEval prompts x 128 new tokens at batch 1, the fastest of "
                   f"{args.repeats} interleaved rounds:", "",
               "| mode | layout | tok/s | vs unrolled | same output as unrolled |", "|---|---|---|---|---|"]
        md += [f"| {r['mode']} | {r['layout']} | {r['tok_per_s']:.1f} | {r['vs_unrolled']:.2f}x | "
               f"{'yes' if r['same_output_as_unrolled'] else 'NO'} |" for r in timed]
        note = scan_note(timed, jax.default_backend())
        md += ["", note] if note else []
    write_results(args.out, "decode_compile", doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
