"""What one decode step of the paper's pair would cost on TPU slices, from the compiled program.

    nice .venv/bin/python benchmarks/bench_decode_step_cost.py [--accelerators v5p-8,v6e-8]
        [--batch-sizes 1,16,64] [--context 8192] [--paged-batches 16] [--out benchmarks]

Each row is `prove-jax generate --dry-run SLICE --report FILE` (prove_jax/decoding/step_report.py)
for one program `generate` streams: the chunk program compiled with libtpu for the slice, its
HLO walked with every loop at its trip count, one trip of its step loop priced: HBM bytes of one
decode step per chip, what must move (weights once, the live KV once, the new KV, the
activations, the logits),
their ratio, dot FLOPs and the roofline time (the larger of bytes over the chip's HBM bandwidth
and FLOPs over its bf16 peak). Modes: ar, lossless (K=6 G=2) and verify (K=8, top-1, the 3B
verifier), the settings whose tokens per forward HumanEval measured; rows filled to
`--context` slots (a request's dearest step); contiguous KV at every batch size, the paged pool
(`--page-size 64`) at `--paged-batches` for `--paged-modes`. The first slice's verify row at the first paged batch
also prices the prefill and an admission. Needs libtpu.

Writes decode_step_cost.json and decode_step_cost.md.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GIB = 1024 ** 3


def parse_args(argv=None):
    from prove_jax.cli.bench_args import arg_type, positive_ints
    ints = lambda flag: arg_type(lambda t: positive_ints(t, flag))  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerators", default="v5p-8,v6e-8", help="Cloud TPU types (default v5p-8,v6e-8)")
    p.add_argument("--batch-sizes", type=ints("--batch-sizes"), default=[1, 16, 64], help="default 1,16,64")
    p.add_argument("--paged-batches", type=ints("--paged-batches"), default=[16],
                   help="batch sizes also priced with the paged pool (default 16)")
    p.add_argument("--paged-modes", default="verify", help="modes priced paged too (default verify; none: no paged rows)")
    p.add_argument("--context", type=int, default=8192, help="slots each row is filled to (default 8192)")
    p.add_argument("--new-tokens", type=int, default=512, help="of the context, tokens generated (default 512)")
    p.add_argument("--modes", default="ar,lossless,verify", help="default ar,lossless,verify")
    p.add_argument("--proposer", default="qwen2.5-32b")
    p.add_argument("--verifier", default="qwen2.5-3b")
    p.add_argument("--block-size", type=int, default=8, help="verify's K (default 8, as HumanEval measured it)")
    p.add_argument("--lossless", default="6,2", help="lossless K,G (default 6,2, as HumanEval measured it)")
    p.add_argument("--attention", default="auto",
                   help="KernelOptions.attention (default auto: what generate runs on TPU, the Pallas kernel)")
    p.add_argument("--programs", default=None,
                   help="programs priced in every cell, e.g. step (default: step; the first slice's verify "
                        "row at the first paged batch also prefill,admit)")
    p.add_argument("--append", action="store_true", help="add the rows to the results already in --out")
    p.add_argument("--out", default=RESULTS, help=f"results directory (default {RESULTS}; the committed ones: benchmarks)")
    return p.parse_args(argv)


def table_row(r: dict) -> str:
    if r.get("attention") and r["attention"] not in r["label"]:  # rows from before the label named it
        r = dict(r, label=f"{r['label']}, {r['attention']}")
    if r.get("error"):
        return f"| {r['accelerator']} | {r['label']} | {r['batch']} | | | | | | error: {r['error']} |"
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    cells = []
    for p in r["programs"]:
        coll = ", ".join(f"{k} {v['count']}" for k, v in p["collectives"].items()) or "none"
        cells.append(f"| {r['accelerator']} | {r['label']} | {r['batch']} ({r['rows']} rows) | {p['name']} | "
                     f"{gib(p['hbm_bytes'])} | {gib(p['min_hbm_bytes'])} | {p['waste']:.2f} | {p['flops'] / 1e12:.2f} | "
                     f"{p['roofline_seconds'] * 1e3:.2f} | {coll} |")
    if r.get("does_not_fit"):
        cells.append(f"| {r['accelerator']} | {r['label']} | {r['batch']} | | | | | | does not fit: {r['does_not_fit'][:200]} |")
    return "\n".join(cells)


NOTES = """Notes.
- *setting* ends with the attention path: `pallas_tpu`, the Pallas kernel `generate` runs on TPU
  (`--attention auto`), or `xla` (`--attention xla`, the rows from before the kernel).
- Bytes are XLA's compiled program read by `prove_jax.hlo_cost`: every top-level instruction
  reads its operands and writes its result in HBM once, a fusion reads what it slices out of an
  operand, an in-place update writes only the update, VMEM buffers (`S(1)`) are not HBM, and a
  loop costs its body times its trip count (a scan's from its condition; the chunked KV read,
  bounded by the longest row, at `ceil(filled / chunk)`). A Pallas kernel costs the
  `pl.CostEstimate` it carries in the compiled custom call: the K and V blocks a row filled to
  its whole buffer fetches (every slot of the layer's span, plus the block it straddles into the
  next layer on the contiguous cache: up to 512 slots, 6% at 8k), its queries and its float32
  outputs; its operands (the whole stacked cache or pool) are not read.
- The xla rows were priced before `hlo_cost` priced an async slice (libtpu's `slice-start` of a
  buffer into VMEM) at the slice it takes: they count its whole source per piece (most of the
  v6e-8 prefill row's bytes).
- Must move: the weights once (an untied embedding: the looked-up rows), each row's KV over the
  filled slots once, the step's new KV, its activations (each projection's output and the
  residual stream written and read once, per chip as tensor and data split them:
  `step_report.activation_bytes`) unless one layer's fit the chip's VMEM (64 MiB on v5p, 128
  MiB on v6e: XLA could keep them there, and on v6e-8 libtpu does: a wide step's fusion outputs,
  up to 20 MiB each, are `S(1)` in the compiled step, while on v5p-8 they are in HBM), float32
  logits written and read. Of the rows here only the 32B's in verify K=16 at 64 rows on v5p-8
  passes that (119 MiB a layer: 14.9 GiB a step); lossless K=6 G=2 there (16 tokens a row, 61.5
  MiB a layer) just fits, though libtpu puts it in HBM (counted, its ratio would be 1.09, paged
  1.04). A ratio of 1 is a step at the memory-bandwidth limit; the roofline time is what such a
  step would take. The pallas_tpu lossless K=6 G=2 and verify K=16 step rows were repriced
  with this rule; the others (and the v5p-8 verify K=16 row's prefill and admit) were priced
  before, activations left out, which changes only the xla verify K=16 64-row v5p-8 one.
- The prefill and admission rows price whole programs: a chunked prefill reads the weights
  once per chunk of 256 prompt tokens and writes each chunk's attention
  scores, so its bytes stand against one pass over the weights and KV only for scale; it is
  compute-bound (its FLOPs over the chip's peak are the roofline). The xla admission rows
  predate admission in blocks, one per data shard, each row written where it lies
  (`program.put_shard_rows`): their all-gathers were the admitted rows' caches crossing the data
  axis. Since (`--modes verify --batch-sizes 16 --paged-modes none --programs admit`, pallas_tpu):
  v5p-8 K=8 1234.5 GiB, all-reduce 7 alone (the K=16 row above); v6e-8 K=8 493.3 GiB, 76.18
  TFLOP, 323 ms, all-gather 2, all-reduce 6. v6e-8's data axis is 1: those two gather over the
  tensor axis the 3B verifier's KV of the admitted row, which GSPMD splits over 2 of the 8 tensor
  devices in the prefill. Admitted in 8 blocks (the verifier cache's row split) it gathers
  nothing, but prefills 8 rows (621.02 TFLOP, 676 ms), so a lone request is admitted as one row.
- On the XLA attention path a wide step (verify K=16 reads 31 tokens, 155 queries per kv head
  of the 32B) writes float32 scores of each KV chunk to HBM and reads them back, which at 8k
  contexts is as much as the KV itself, and the paged pool gathers each chunk's pages through
  HBM: those rows' ratios. The Pallas kernel keeps the scores in VMEM and reads the blocks in
  place."""


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from prove_jax import aot
    from prove_jax.decoding.options import DecodeOptions
    from prove_jax.models.kernels import KernelOptions
    from prove_jax.decoding.step_report import step_report
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.models.config import preset

    if not aot.libtpu_available():
        print('error: needs libtpu: pip install "libtpu==0.0.42.*" (docs/environment.md)', file=sys.stderr)
        return 2
    proposer = preset(args.proposer)
    proposer = proposer.replace(mask_token_id=proposer.vocab_size - 1)
    verifier = preset(args.verifier)
    lossless_k, lossless_g = (int(x) for x in args.lossless.split(","))
    kernels = KernelOptions(attention=args.attention)
    options = {"ar": ("ar", DecodeOptions("ar", 1, scan_layers=True, kernels=kernels)),
               "lossless": (f"lossless K={lossless_k} G={lossless_g}",
                            DecodeOptions("lossless", lossless_k, max_groups=lossless_g, scan_layers=True,
                                          kernels=kernels)),
               "verify": (f"verify K={args.block_size}", DecodeOptions("verify", args.block_size, scan_layers=True,
                                                                        kernels=kernels))}
    modes = args.modes.split(",")
    jobs = []
    for accelerator in args.accelerators.split(","):
        for batch in args.batch_sizes:
            for mode in modes:
                jobs.append((accelerator, mode, batch, None))
        for batch in args.paged_batches:
            for mode in (m for m in modes if m in args.paged_modes.split(",")):
                jobs.append((accelerator, mode, batch, 64))
    rows = []
    if args.append and os.path.exists(os.path.join(args.out, "decode_step_cost.json")):
        import json
        with open(os.path.join(args.out, "decode_step_cost.json")) as f:
            rows = json.load(f)["rows"]
    first = (args.accelerators.split(",")[0], "verify", args.paged_batches[0] if args.paged_batches else 16, None)
    for accelerator, mode, batch, page in jobs:
        chip, chips = aot.accelerator_chips(accelerator)
        label, opts = options[mode]
        if page is not None:
            import dataclasses
            opts = dataclasses.replace(opts, page_size=page)
            label += f", paged ({page})"
        log(f"{accelerator}: {label}, batch {batch}")
        programs = ("step", "prefill", "admit") if (accelerator, mode, batch, page) == first else ("step",)
        programs = programs if args.programs is None else tuple(args.programs.split(","))
        try:
            report = step_report(proposer, opts, chip=chip, chips=chips, batch=batch, context=args.context,
                                 new_tokens=args.new_tokens, verifier=verifier if mode == "verify" else None,
                                 programs=programs)
        except Exception as e:  # a program that fails to compile is a result too, said in its row
            log(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rows.append(dict(accelerator=accelerator, label=label, batch=batch, mode=mode,
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
            continue
        log("  " + report.table().replace("\n", "\n  "))
        rows.append(dict(accelerator=accelerator, label=f"{label}, {report.setting['attention']}", **report.record()))
    doc = dict(proposer=args.proposer, verifier=args.verifier, dtype="bfloat16", jax=jax.__version__,
               host=device_description(), context=args.context, new_tokens=args.new_tokens, rows=rows)
    md = ["# One decode step on TPU slices, from the compiled program (`generate --dry-run --report`)", "",
          f"`benchmarks/bench_decode_step_cost.py`: {args.proposer} proposer ({args.verifier} verifier in "
          f"verify), bfloat16, layers scanned, the chunk program `generate` streams compiled with libtpu "
          f"(jax {jax.__version__}) for each slice from a CPU host, abstract weights on the mesh `generate` "
          f"picks. Per chip and per decode step, every row filled to {args.context} slots. *HBM*: what "
          f"the compiled program reads and writes in one execution (one decode step for *step*); *must*: "
          f"what it has to; *ratio*: the two; *TFLOP*: its dots.", "",
          "| slice | setting | batch | program | HBM GiB | must GiB | ratio | TFLOP | roofline ms | collectives |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(table_row(r))
    md += ["", NOTES]
    write_results(args.out, "decode_step_cost", doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
