"""The paged KV pool against contiguous per-row buffers: memory of the compiled program at a
real model's shape, and decode speed side by side.

    nice .venv/bin/python benchmarks/bench_paged_kv.py [--preset qwen2.5-7b] [--time qwen2.5-0.5b]
        [--out benchmarks]

Memory: `Decoder.generate`'s whole program (lossless K=8, 2 mask groups) at the preset's widths
in bfloat16 with abstract weights, compiled for this machine's backend, serving a queue of 64
requests with 16 rows. Prompt lengths follow a long tail (most short, a few near 4k tokens, a
fixed seed), 256 new tokens each. Contiguous rows each reserve the longest request's slots; the
pool holds what 16 rows of the queue's mean request need, and a request waits for free pages.
The table gives the compiled program's argument, temporary and output bytes (XLA's numbers).

TPU (`--tpu ACCELERATOR`, needs libtpu): the same queue's program for that slice (e.g. v5p-8),
as `generate --dry-run` compiles it: contiguous, the pool read by XLA and the pool read by the
paged Pallas kernel (`--attention pallas_tpu`); XLA's per-chip memory, compile time and
collectives.

The paper's pair (`--pair ACCELERATOR`, needs libtpu; runs alone and writes paged_kv_pair.json
and .md): verify with a Qwen2.5-32B proposer (K=16) and a Qwen2.5-3B verifier, whose KV sits on
the same pages of pools of its own, the same queue compiled for that slice, contiguous against
the pool (XLA read and Pallas kernel), scanned layers as `generate --dry-run` compiles them.

Speed (`--time PRESET`): the shipped proposer inflated to that shape (the same outputs, a real
model's cost per step), HumanEval prompts at batch 4, 128 new tokens; contiguous against the
pool at its default size and at half of it, the fastest of interleaved rounds.

Writes paged_kv.json and paged_kv.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

PAGE = 64
ROWS, QUEUE, NEW = 16, 64, 256


def reading_note(rows: list[dict], kv: list[int], timed: list[dict], tpu: list[dict], tpu_name: str | None) -> str:
    """How to read this run's tables, each claim said from its own rows (nothing when they do
    not show it)."""
    gib, out = 2 ** 30, []
    saved, kv_saved = rows[0]["total_bytes"] - rows[1]["total_bytes"], kv[0] - kv[1]
    if saved > kv_saved:
        out.append(f"The pool saves {saved / gib:.2f} GiB, more than the {kv_saved / gib:.2f} GiB KV "
                   "difference, because the contiguous program also holds row-sized temporaries of the "
                   "cache (the admitted row's prefill buffer). The temporaries both programs share are "
                   "the CPU program's own and are not broken down here (bench_decode_tpu_compile.py "
                   "gives a TPU program's).")
    if timed:
        base = timed[0]
        out.append("Against contiguous rows (" + f"{base['loop_steps']} loop steps): " + "; ".join(
            f"{r['layout']} {r['loop_steps']} steps, {r['vs_contiguous']:.2f}x its speed" for r in timed[1:])
            + ". A pool too small for the rows makes them wait for pages, so fewer decode side by side "
            "and the loop runs more steps: memory traded for throughput, as in any paged server.")
    if tpu:
        out.append(f"On {tpu_name} the XLA read gathers a chunk of pages per layer into temporaries; the "
                   "paged Pallas kernel (`--attention pallas_tpu`) reads them in place. Extra all-reduces "
                   "of the paged programs are admission's: a row prefilled into the pool of whichever "
                   "shard it lands on is written and read by explicit shard indices, which GSPMD combines "
                   "across the data axis; the decode step itself moves no page (tests/models/test_paged_kv.py, on "
                   "an 8-device CPU mesh).")
    return " ".join(out)


def parse_args(argv=None):
    from prove_jax.models.config import PRESETS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-7b", choices=sorted(PRESETS), help="widths (default qwen2.5-7b)")
    p.add_argument("--time", default=None, choices=sorted(PRESETS), metavar="PRESET",
                   help="also time decoding at this inflated shape (e.g. qwen2.5-0.5b)")
    p.add_argument("--tpu", default=None, metavar="ACCELERATOR",
                   help="also compile the queue's program for this TPU slice (e.g. v5p-8; needs libtpu)")
    p.add_argument("--pair", default=None, metavar="ACCELERATOR",
                   help="only compile the paper's pair (32B proposer, 3B verifier) on this TPU slice "
                        "(e.g. v6e-8; needs libtpu), writing paged_kv_pair.json/.md")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts timed with --time (default 8)")
    p.add_argument("--repeats", type=int, default=2, help="timed rounds with --time (default 2)")
    p.add_argument("--out", default=RESULTS, help="folder for paged_kv.json/.md (default runs/benchmarks/; "
                                                   "--out benchmarks updates the committed results)")
    return p.parse_args(argv)


def queue_lengths() -> list[int]:
    """64 prompt lengths with a long tail: 8 to 4000 tokens, median a few hundred."""
    import numpy as np
    rng = np.random.RandomState(0)
    return np.clip(rng.lognormal(5.5, 1.1, QUEUE), 8, 4000).astype(int).tolist()


def pool_variants(lengths: list[int]):
    """(pages each request needs, the pool's pages: ROWS rows of the mean request, [(name,
    options)] for contiguous rows and the pool), lossless K=8 with 2 mask groups."""
    import numpy as np

    from prove_jax.decoding.options import DecodeOptions, LosslessRule
    need = [-(-(n + NEW) // PAGE) for n in lengths]
    pool = ROWS * int(np.ceil(np.mean(need)))
    lossless = DecodeOptions("lossless", block_size=8, lossless=LosslessRule(max_groups=2))
    return need, pool, [("contiguous", lossless),
                        (f"paged, {pool} pages of {PAGE}", dataclasses.replace(lossless, memory=dataclasses.replace(lossless.memory, page_size=PAGE, kv_pages=pool)))]


def compiled_bytes(cfg, options, lengths) -> dict:
    from flax import nnx

    from prove_jax.decoding.engine import Decoder
    from prove_jax.models.qwen2 import Qwen2
    model = nnx.eval_shape(lambda: Qwen2(cfg, nnx.Rngs(0)))
    decoder = Decoder(model, list(cfg.eos_token_ids), options, pad_id=cfg.pad_token_id)
    compiled = decoder.lower([[3] * n for n in lengths], NEW, batch_size=ROWS).compile()
    stats = compiled.memory_analysis()
    return dict(argument_bytes=int(stats.argument_size_in_bytes), temp_bytes=int(stats.temp_size_in_bytes),
                output_bytes=int(stats.output_size_in_bytes))


def memory_rows(preset_name: str) -> tuple[list[dict], dict]:
    import numpy as np

    from prove_jax.evaluation.progress import log
    from prove_jax.models.config import preset
    cfg = preset(preset_name).replace(dtype="bfloat16", param_dtype="bfloat16", mask_token_id=151665)
    lengths = queue_lengths()
    need, pool, variants = pool_variants(lengths)
    per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # k and v, bf16
    rows = []
    for name, options in variants:
        log(f"compiling {name} at the {preset_name} widths ...")
        row = dict(layout=name, **compiled_bytes(cfg, options, lengths))
        row["total_bytes"] = row["argument_bytes"] + row["temp_bytes"] + row["output_bytes"]
        rows.append(row)
    workload = dict(lengths=lengths, longest=max(lengths), median=int(np.median(lengths)), pages_needed=need,
                    pool_pages=pool, kv_bytes_per_slot=per_slot,
                    contiguous_kv_bytes=ROWS * (max(lengths) + NEW) * per_slot,
                    pool_kv_bytes=pool * PAGE * per_slot)
    return rows, workload


def tpu_rows(preset_name: str, accelerator: str, verifier: str | None = None) -> list[dict]:
    """The queue's program compiled for `accelerator`: lossless K=8 G=2 at the preset's
    widths, or with `verifier` (a preset) verify K=16 with scanned layers."""
    from prove_jax import aot
    from prove_jax.decoding.dry_run import dry_run_decode, SliceRun
    from prove_jax.decoding.options import DecodeOptions, MemoryLayout
    from prove_jax.evaluation.progress import log
    from prove_jax.models.config import preset
    from prove_jax.models.compute import ComputeOptions
    cfg = preset(preset_name).replace(mask_token_id=151665)
    chip, chips = aot.accelerator_chips(accelerator)
    lengths = queue_lengths()
    _, _, ((contiguous, base), (paged_name, paged)) = pool_variants(lengths)
    verifier_cfg = None
    if verifier is not None:
        verifier_cfg = preset(verifier)
        verify = DecodeOptions("verify", block_size=16, memory=MemoryLayout(scan_layers=True))
        base, paged = verify, dataclasses.replace(verify, memory=dataclasses.replace(verify.memory, page_size=paged.memory.page_size, kv_pages=paged.memory.kv_pages))
    variants = [(contiguous, base), (f"{paged_name}, XLA read", paged),
                (f"{paged_name}, Pallas kernel", dataclasses.replace(paged, compute=ComputeOptions(attention="pallas_tpu")))]
    rows = []
    for name, options in variants:
        log(f"compiling {name} for {accelerator} at the {preset_name} widths ...")
        report = dry_run_decode(SliceRun(cfg, options, chip=chip, chips=chips, batch=ROWS, context=max(lengths) + NEW + 1,
                                new_tokens=NEW, verifier=verifier_cfg), prompt_lengths=lengths)
        stats = report.stats
        row = dict(layout=name, accelerator=accelerator, mesh=report.mesh, fits=report.fits,
                   does_not_fit=report.does_not_fit)
        if stats is not None:
            row.update(compile_seconds=round(stats.compile_seconds, 1), argument_bytes=stats.argument_bytes,
                       temp_bytes=stats.temp_bytes, peak_bytes=stats.peak_bytes, collectives=stats.collectives)
        rows.append(row)
    return rows


def time_rows(inflate_to: str, num_prompts: int, repeats: int) -> list[dict]:
    from prove_jax import assets
    from prove_jax.timing import fastest_interleaved
    from prove_jax.decoding.options import DecodeOptions, LosslessRule, MemoryLayout
    from prove_jax.evaluation.benchmark import humaneval_prompts
    from prove_jax.evaluation.model_pair import load_pair
    from prove_jax.evaluation.progress import log

    pair = load_pair(assets.DEMO_PROPOSER, inflate_to=inflate_to)
    prompts = humaneval_prompts(pair.tokenizer, num_prompts)
    need = max(-(-(len(p) + 128) // 16) for p in prompts)
    variants = {"contiguous": DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2)),
                "paged, default pool": DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(page_size=16)),
                "paged, half the pool": DecodeOptions("lossless", 8, lossless=LosslessRule(max_groups=2), memory=MemoryLayout(page_size=16, kv_pages=max(need, 4 * need // 2)))}
    outputs, steps, tokens, runs = {}, {}, {}, {}
    for name, options in variants.items():
        decoder = pair.decoder(options)

        def run(decoder=decoder, name=name):
            result = decoder.generate(prompts, 128, batch_size=4)
            outputs[name], steps[name] = result.output_ids, result.loop_steps
            tokens[name] = sum(map(len, result.output_ids))
            return result.seconds
        runs[name] = run
    log(f"timing contiguous and paged at the {inflate_to} shape ...")
    best = fastest_interleaved(runs, repeats)
    return [dict(layout=name, seconds=round(s, 3), tok_per_s=round(tokens[name] / s, 2), loop_steps=steps[name],
                 vs_contiguous=round(best["contiguous"] / s, 3),
                 same_output_as_contiguous=outputs[name] == outputs["contiguous"]) for name, s in best.items()]


def tpu_table(rows: list[dict]) -> list[str]:
    """Markdown rows of compiled TPU programs: per-chip memory, compile time, collectives."""
    gib = 2 ** 30
    md = ["| layout | arguments GiB | temporaries GiB | peak GiB | compile s | collectives (count, MiB) |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        if "peak_bytes" not in r:
            md.append(f"| {r['layout']} | - | - | - | - | does not fit: {r['does_not_fit']} |")
            continue
        coll = ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f})" for k, v in r["collectives"].items()
                         if v["count"])
        md.append(f"| {r['layout']} | {r['argument_bytes'] / gib:.2f} | {r['temp_bytes'] / gib:.2f} | "
                  f"{r['peak_bytes'] / gib:.2f} | {r['compile_seconds']:.0f} | {coll or 'none'} |")
    return md


def pair_note(verifier_cfg, rows: list[dict]) -> str:
    """How to read the pair's table, its numbers from the verifier's shape and this run's rows."""
    tensor, heads = rows[0]["mesh"]["tensor"], verifier_cfg.num_kv_heads
    a2a = rows[0].get("collectives", {}).get("all-to-all", {}).get("count", 0)
    split = (f"The verifier's {heads} kv heads cannot split over tensor={tensor}: its contiguous cache "
             f"splits over the rows instead (docs/decoding.md, Several devices), each chip holding "
             f"{ROWS // tensor} of the {ROWS} rows, at the cost of {a2a} small all-to-alls of the "
             f"verifier's queries and outputs; its pools do not split that way yet and lie whole on "
             f"every chip. " if heads < tensor else "")
    return ("Reading the table: the verifier's KV holds the same tokens as the proposer's, so its pools "
            f"(of its own {verifier_cfg.num_layers} layers and {heads} kv heads) use the proposer's page "
            "table and free list: one allocation serves both. The pool keeps per-chip temporaries to "
            "what the queue's requests hold at once instead of every row at the longest request, for "
            "both models. " + split + "With the Pallas kernel the proposer's layers read through the "
            "kernel and the verifier's pool through XLA: a kernel runs per device on whole kv heads, and "
            "GSPMD lays such a pool out like the query heads, so the kernel would gather the verifier's "
            "whole pool in the loop.")


def pair_main(args) -> int:
    """--pair: the paper's pair on a TPU slice, contiguous against the pool; its own files."""
    import jax
    import numpy as np

    from prove_jax.evaluation.report import write_results
    from prove_jax.models.config import preset
    proposer, verifier = "qwen2.5-32b", "qwen2.5-3b"
    rows = tpu_rows(proposer, args.pair, verifier=verifier)
    lengths = queue_lengths()
    need, pool, _ = pool_variants(lengths)
    slot = {name: 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 for name, c in
            ((proposer, preset(proposer)), (verifier, preset(verifier)))}  # k and v, bf16
    workload = dict(lengths=lengths, pages_needed=need, pool_pages=pool, kv_bytes_per_slot=slot,
                    contiguous_kv_bytes={m: ROWS * (max(lengths) + NEW) * b for m, b in slot.items()},
                    pool_kv_bytes={m: pool * PAGE * b for m, b in slot.items()})
    doc = dict(proposer=proposer, verifier=verifier, accelerator=args.pair, jax=jax.__version__, rows=ROWS,
               queue=QUEUE, new_tokens=NEW, page_size=PAGE, workload=workload, tpu=rows)
    gib = 2 ** 30
    kv = workload["contiguous_kv_bytes"], workload["pool_kv_bytes"]
    md = ["# Paged KV pool for the paper's pair on a TPU slice",
          "",
          f"`benchmarks/bench_paged_kv.py --pair {args.pair}`: verify (K=16, scanned layers) with a {proposer} "
          f"proposer and a {verifier} verifier in bfloat16, the whole decode program compiled for {args.pair} "
          f"from a CPU host with libtpu (jax {jax.__version__}), abstract weights on the mesh `generate` picks "
          f"({rows[0]['mesh']}): {ROWS} rows serving {QUEUE} requests of {NEW} new tokens, prompts of "
          f"{min(lengths)} to {max(lengths)} tokens (median {int(np.median(lengths))}). "
          f"Contiguous rows each reserve the longest request's slots in both caches; the pools hold "
          f"{pool} pages of {PAGE} slots each ({ROWS} rows of the mean request). KV in all (computed): "
          f"proposer {kv[0][proposer] / gib:.2f} -> {kv[1][proposer] / gib:.2f} GiB, verifier "
          f"{kv[0][verifier] / gib:.2f} -> {kv[1][verifier] / gib:.2f} GiB. XLA's per-chip numbers:",
          ""] + tpu_table(rows) + ["", pair_note(preset(verifier), rows)]
    write_results(args.out, "paged_kv_pair", doc, md)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.pair:
        return pair_main(args)
    import jax

    from prove_jax.evaluation.report import device_description, write_results
    rows, workload = memory_rows(args.preset)
    tpu = tpu_rows(args.preset, args.tpu) if args.tpu else []
    timed = time_rows(args.time, args.prompts, args.repeats) if args.time else []
    device = device_description()
    doc = dict(preset=args.preset, backend=jax.default_backend(), device=device, jax=jax.__version__,
               rows=ROWS, queue=QUEUE, new_tokens=NEW, page_size=PAGE, workload=workload, memory=rows, tpu=tpu,
               decode_time=dict(inflate_to=args.time, prompts=args.prompts, repeats=args.repeats, rows=timed))
    gib = 2 ** 30
    md = ["# Paged KV pool against contiguous rows",
          "",
          f"`benchmarks/bench_paged_kv.py`: `Decoder.generate`'s whole program, lossless K=8 with 2 mask "
          f"groups, at the {args.preset} widths in bfloat16 (abstract weights), compiled for "
          f"{jax.default_backend()} ({device}), jax {jax.__version__}: {ROWS} rows serving {QUEUE} requests "
          f"of {NEW} new tokens, prompts of {min(workload['lengths'])} to {workload['longest']} tokens "
          f"(median {workload['median']}). Contiguous rows each reserve the longest request's slots; the "
          f"pool holds {workload['pool_pages']} pages of {PAGE} slots ({ROWS} rows of the mean request), and "
          f"a request waits until its pages are free. Bytes are the compiled program's (XLA's memory analysis).",
          "",
          "| layout | KV bytes (computed) | arguments GiB | temporaries GiB | outputs GiB | total GiB |",
          "|---|---|---|---|---|---|"]
    kv = [workload["contiguous_kv_bytes"], workload["pool_kv_bytes"]]
    md += [f"| {r['layout']} | {kv[i] / gib:.2f} GiB | {r['argument_bytes'] / gib:.2f} | {r['temp_bytes'] / gib:.2f} | "
           f"{r['output_bytes'] / gib:.2f} | {r['total_bytes'] / gib:.2f} |" for i, r in enumerate(rows)]
    if tpu:
        md += ["", f"The same queue's program compiled for {args.tpu} from this CPU with libtpu, as "
                   f"`generate --dry-run` compiles it (mesh {tpu[0]['mesh']}), XLA's per-chip numbers:", "",
               ] + tpu_table(tpu)
    if timed:
        md += ["", f"Decoding with the shipped proposer inflated to the {args.time} shape (float32), "
                   f"{args.prompts} HumanEval prompts x 128 new tokens at batch 4, pages of 16 slots, the "
                   f"fastest of {args.repeats} interleaved rounds:", "",
               "| layout | tok/s | loop steps | vs contiguous | same output |", "|---|---|---|---|---|"]
        md += [f"| {r['layout']} | {r['tok_per_s']:.1f} | {r['loop_steps']} | {r['vs_contiguous']:.2f}x | "
               f"{'yes' if r['same_output_as_contiguous'] else 'NO'} |" for r in timed]
    note = reading_note(rows, kv, timed, tpu, args.tpu)
    md += ["", note] if note else []
    write_results(args.out, "paged_kv", doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
