"""What one decode step of a proposer (and its verifier) would cost on TPU slices, from the
compiled program.

    nice .venv/bin/python benchmarks/bench_decode_step_cost.py [--accelerators v5p-8,v6e-8]
        [--proposer qwen2.5-32b --verifier qwen2.5-3b] [--batch-sizes 1,16,64] [--context 8192]
        [--paged-batches 16] [--out benchmarks [--append]]

Each row is `prove-jax generate --dry-run SLICE --report FILE` (prove_jax/decoding/step_report.py)
for one program `generate` streams: the chunk program compiled with libtpu for the slice, its
HLO walked with every loop at its trip count, one trip of its step loop priced: HBM bytes of one
decode step per chip, what must move (weights once, the live KV once, the new KV, the
activations, the logits),
their ratio, dot FLOPs and the roofline time (the larger of bytes over the chip's HBM bandwidth
and FLOPs over its bf16 peak). Modes: ar, lossless (K=6 G=2) and verify (K=8, top-1, with
`--verifier`), the settings whose tokens per forward HumanEval measured; rows filled to
`--context` slots (a request's dearest step); contiguous KV at every `--batch-sizes` (none: no
contiguous rows), the paged pool (`--page-size 64`) at `--paged-batches` for `--paged-modes`.
The first slice's verify row at the first paged batch also prices the prefill and an admission
(unless `--programs` says otherwise). Needs libtpu.

Every row names its own proposer, verifier (verify rows) and context, so one file holds
several pairs and contexts; `--append` adds the rows to those in `--out`, a cell priced again
(slice, proposer, context, batch, mode, K and G, page size, attention: `cell_key`) replacing
its row; `--merge A.json,B.json` does the same with rows priced elsewhere, compiling
nothing. The markdown has a table per proposer and context.

Writes decode_step_cost.json and decode_step_cost.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

GIB = 1024 ** 3


def parse_args(argv=None):
    from prove_jax.cli.bench_args import arg_type, positive_ints
    # "none": no rows of that kind (e.g. only paged rows)
    ints = lambda flag: arg_type(lambda t: [] if t == "none" else positive_ints(t, flag))  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accelerators", default="v5p-8,v6e-8", help="Cloud TPU types (default v5p-8,v6e-8)")
    p.add_argument("--batch-sizes", type=ints("--batch-sizes"), default=[1, 16, 64],
                   help="batch sizes priced with the contiguous cache (default 1,16,64; none: no such rows)")
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
                   help="ComputeOptions.attention (default auto: what generate runs on TPU, the Pallas kernel)")
    p.add_argument("--programs", default=None,
                   help="programs priced in every cell, e.g. step (default: step; the first slice's verify "
                        "row at the first paged batch also prefill,admit)")
    p.add_argument("--append", action="store_true",
                   help="add the rows to the results already in --out (a cell priced again replaces its row)")
    p.add_argument("--merge", default=None,
                   help="comma-separated step-cost JSONs priced elsewhere: their rows join (or replace, cell by "
                        "cell) those in --out, and nothing is compiled")
    p.add_argument("--out", default=RESULTS, help=f"results directory (default {RESULTS}; the committed ones: benchmarks)")
    return p.parse_args(argv)


# what makes two rows the same cell: a rerun of one replaces its row
CELL_KEY = ("accelerator", "proposer", "context", "batch", "mode", "block_size", "groups", "page_size",
            "attention")
MODE_ORDER = {"ar": 0, "lossless": 1, "verify": 2}


def cell_key(r: dict) -> tuple:
    return tuple(r.get(k) for k in CELL_KEY)


def load_rows(path: str) -> list[dict]:
    """The rows of a step-cost JSON, each with its own proposer, verifier and context (a file
    written before rows carried them has them at the top: they are copied into each row)."""
    with open(path) as f:
        doc = json.load(f)
    rows = []
    for r in doc["rows"]:
        r = dict(r)
        r.setdefault("proposer", doc.get("proposer"))
        r.setdefault("verifier", doc.get("verifier") if r.get("mode") == "verify" else None)
        r.setdefault("context", r.get("filled", doc.get("context")))
        rows.append(r)
    return rows


def merge_rows(rows: list[dict], new: list[dict]) -> list[dict]:
    """`rows` with each of `new` replacing the row of its cell (`cell_key`) in place, or added
    after them."""
    out = list(rows)
    where = {cell_key(r): i for i, r in enumerate(out)}
    for r in new:
        k = cell_key(r)
        if k in where:
            out[where[k]] = r
        else:
            where[k] = len(out)
            out.append(r)
    return out


def groups(rows: list[dict]) -> dict:
    """{(proposer, context): its rows, by slice, attention path, layout, batch, mode and K}."""
    out = {}
    for r in rows:
        out.setdefault((r["proposer"], r["context"]), []).append(r)
    order = lambda r: (r["accelerator"], r.get("attention") or "", r.get("page_size") or 0,  # noqa: E731
                       r["batch"], MODE_ORDER.get(r["mode"], 9), r.get("block_size") or 0)
    return {k: sorted(v, key=order) for k, v in sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1]))}


def _layer_activations(r: dict) -> list[tuple[int, int]]:
    """(one layer's, the step's) activation bytes per chip of each model the row's step runs
    (`step_report.activation_bytes`): the proposer, and the verifier in verify."""
    from prove_jax.decoding.step_report import activation_bytes
    from prove_jax.models.config import preset
    mesh = r["mesh"]
    chip_rows = max(1, r["rows"] // (mesh.get("data", 1) * mesh.get("fsdp", 1)))
    models = [(preset(r["proposer"]), r["step_width"])]
    if r["mode"] == "verify" and r.get("verifier"):
        models.append((preset(r["verifier"]), r["block_size"]))
    out = []
    for cfg, width in models:
        step = activation_bytes(cfg, chip_rows * width, mesh.get("tensor", 1), 2)
        out.append((step // (2 * cfg.num_layers), step))
    return out


def vmem_note(rows: list[dict]) -> str:
    """The priced step rows whose one layer of activations (`step_report.activation_bytes`, per
    chip) does not fit the chip's VMEM, so that must-move counts them; computed from each row."""
    from prove_jax.decoding.step_report import CHIP_VMEM_BYTES
    over = []
    for r in rows:
        if not r.get("programs") or not r.get("mesh") or r["chip"] not in CHIP_VMEM_BYTES:
            continue
        for layer, step in _layer_activations(r):
            if layer > CHIP_VMEM_BYTES[r["chip"]]:
                over.append(f"{r['accelerator']} {r['proposer']} {label(r)} at {r['batch']} rows, "
                            f"{r['context']} slots ({layer / 2 ** 20:.0f} MiB a layer, {step / GIB:.1f} GiB a step)")
    if not over:
        return "No row here has a layer's activations over its chip's VMEM."
    return "The rows here whose layer's activations do not fit (must counts them): " + "; ".join(over) + "."


def over_note(rows: list[dict], limit: float = 1.3) -> str:
    """The pallas_tpu step rows (generate's path on TPU) over `limit` times what they must move,
    each with its dearest layout move (copy, reshape), else its dearest instruction: opcode and
    (first) shape, and its ratio with the activations counted where the VMEM rule left them out
    of must; computed from the rows."""
    from prove_jax.decoding.step_report import CHIP_VMEM_BYTES
    over = []
    for r in rows:
        step = next((p for p in r.get("programs") or [] if p["name"] == "step"), None)
        if step is None or step["waste"] <= limit or r.get("attention") != "pallas_tpu":
            continue
        largest = step.get("largest") or []
        # a layout move (copy, or a reshape that is one) names the waste better than the top
        moves = [t for t in largest if t[3] in ("copy", "reshape")]
        top = (moves or largest or [None])[0]
        shape = re.search(r"\w+\[[\d,]*\]", top[4]) if top else None
        what = f", {top[3]} {shape.group(0) if shape else ''}" if top else ""
        # activations the VMEM rule leaves out of must: libtpu may still round-trip them in HBM
        vmem = CHIP_VMEM_BYTES.get(r["chip"], 0)
        left = sum(step_ for layer, step_ in _layer_activations(r) if layer <= vmem) if r.get("mesh") else 0
        if left > 0.05 * step["min_hbm_bytes"]:
            what += (f"; {step['hbm_bytes'] / (step['min_hbm_bytes'] + left):.2f} with the "
                     f"{left / GIB:.1f} GiB of activations the VMEM rule leaves out")
        over.append(f"{r['accelerator']} {r['proposer']} {label(r)}, batch {r['batch']}, {r['context']} slots "
                    f"({step['waste']:.2f}{what})")
    if not over:
        return f"No pallas_tpu step row here moves over {limit}x what it must."
    return f"The pallas_tpu step rows over {limit}x what they must move: " + "; ".join(over) + "."


def narrow_pool_note(rows: list[dict]) -> str:
    """The paged verify step rows of a verifier whose head dim is under 128 lanes (on TPU its
    cache is contiguous beside the proposer's pool, `paged.pooled`), each with its ratio;
    computed from the rows."""
    from prove_jax.models.config import preset
    priced = []
    for r in rows:
        step = next((p for p in r.get("programs") or [] if p["name"] == "step"), None)
        if (step is None or r["mode"] != "verify" or not r.get("page_size") or not r.get("verifier")
                or preset(r["verifier"]).head_dim >= 128):
            continue
        priced.append(f"{r['accelerator']} {r['proposer']} + {r['verifier']} batch {r['batch']} "
                      f"of {r['context']} {step['waste']:.2f}")
    if not priced:
        return "No paged verify row here has such a verifier."
    return "The paged verify rows of such a verifier (ratio): " + "; ".join(priced) + "."


def label(r: dict) -> str:
    """The row's setting, ending with its attention path (rows from before the label named it)."""
    if r.get("attention") and r["attention"] not in r["label"]:
        return f"{r['label']}, {r['attention']}"
    return r["label"]


def table_row(r: dict) -> str:
    r = dict(r, label=label(r))
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
- A weight that libtpu hands a dot through a nested fusion that only bitcasts it (each LM head)
  is priced at the dot's read of it. Rows priced before left the heads out (the 7B's lossless
  and verify steps came out at 0.91-0.99 of must): the 7B rows and the 32B's lossless K=6 G=2
  and verify K=16 rows at 8k (batch 16 and 64, pallas_tpu) are priced with it; the 32B's other
  rows are short by their heads' share per chip (on v5p-8 0.73 GiB for the 32B's, read twice by
  a lossless step, and 0.29 GiB for the 3B's).
- Past `ComputeOptions.head_one_pass_max_extra_rows` extra rows (a row of K=6 G=2 has 5: it
  needs the head at 11 of its 16 slots) a lossless step runs its LM head in two passes, each
  reading the head; resolved per platform on the host: 8 on CPU (benchmarks/step_cost.md), 80
  on TPU and GPU, so one pass up to 16 rows. The lossless step priced both ways (pallas_tpu,
  contiguous, 8k; `ComputeOptions(head_one_pass_max_extra_rows=...)`), HBM GiB / TFLOP /
  roofline ms: at 16 rows, bound by bytes, one pass is cheaper (v5e-4 7B 9.15 / 1.08 / 12.00
  two, 8.64 / 1.10 / 11.33 one; v5p-8 32B 42.34 / 4.63 / 16.44 two, 41.64 / 4.66 / 16.17 one);
  at 64 rows it is about even, dearer where the step is bound by FLOPs (v5e-4 7B 15.32 / 4.31 /
  21.88 two, 15.25 / 4.40 / 22.32 one; v5p-8 32B 78.48 / 18.53 / 40.38 two, 77.88 / 18.66 /
  40.65 one), cheaper where by bytes (v6e-4 7B 22.56 / 4.30 / 14.77 two, 21.98 / 4.39 / 14.39
  one; v6e-8 32B 27.67 / 9.33 / 18.12 two, 27.49 / 9.39 / 18.00 one): two passes there, as the
  64-row rows are. The 16-row lossless rows at 8k are priced with one pass; those at 2k were
  priced before, with two (most of the 7B's 16-row ratio over 1 there).
- A contiguous cache holds a row's buffer and one step past it rounded up to whole 16-slot bf16
  tiles (`program.cache_slots`). The 7B's 28 stacked layers at AR and verify widths had made it
  no whole number of tiles, and libtpu copied it whole in every layer of every step (AR ratios
  1.46-12.7; AR at 64 rows of 8k on v5e-4 did not fit).
- A stacked cache whose head dim is under 128 lanes (the 0.5B verifier's 64) is held as
  libtpu's scatter lays it out for the step's write, which it picks by the buffer's bytes a
  chip (one of K, V; v5e and v6e alike): held [B, K, L * S, Dh], it laid one of 133 MiB and
  more out slots minor (so as not to pad the 64-wide head dim to 128 lanes) while the kernel
  read it as shaped, and copied it whole per layer per step (the 7B's verify rows on the
  contiguous cache at 16 and 64 rows of 8k, and at 64 of 2k, 192-770 MiB a chip: 2.1-6.6x
  must); held slots minor, [B, K, Dh, L * S], one of 120 MiB and less was laid out head dim
  minor and copied (16 rows of 2k, 48 MiB: v5e-4 1.60x, v6e-4 1.24x; one row a chip at 8k on
  v6e-4, 48 MiB: 1.47x). So on TPU such a cache is held slots minor from
  `compute.KV_SLOTS_MINOR_MIN_BYTES` (128 MiB) a chip, head dim minor below
  (`ComputeOptions.kv_slots_minor`, resolved on the host; CPU and GPU hold it head dim minor).
  The bound, from 7B verify K=8 steps held slots minor (ratio, per-chip buffer): v6e-4 8k
  batch 8 (96 MiB) 1.60, copied; v6e-4 4k batch 20 (120 MiB) 1.74, copied, and 1.02 held head
  dim minor; v6e-4 2k batch 44 (133 MiB) 1.03; v6e-4 8k batch 12 (144 MiB) 1.01; v5e-4 2k
  batch 48 (145 MiB, one head a chip) 1.05. An admission's rows are held as the batch's they
  join. In a paged pool such a verifier's pages were written as one flat [K, L * P * page, Dh]
  scatter that libtpu laid out slots minor while the kernel read [page, Dh] blocks: the whole
  pool copied per layer per step (the 7B's paged verify K=8 rows 4.15-13.28x must; a pool held
  slots minor needs page windows aligned to 128 lanes, and Mosaic refuses 64-slot offsets). So
  on TPU such a verifier keeps a contiguous cache beside the proposer's pool, held as above
  (`paged.pooled`, `ComputeOptions.pool_narrow_kv`; CPU and GPU pool it). {narrow} A layout
  no scatter chooses (the step's KV written by a kernel in place, as JAX's ragged paged
  attention does) would not depend on libtpu's choice. {over}
- A cache whose kv heads the tensor axis cannot split at a batch too small to split over rows
  (the 3B verifier's 2 over v6e-8's tensor=8 at batch 1) lies whole on each chip while the
  queries split over heads; XLA reads it (a per-chip kernel would gather it). GSPMD had taken
  each chip's head out of the whole stacked [1, 2, L * S, 128] buffer ahead of the chunked
  read, a copy of it in every layer of every step (v6e-8 verify K=8 batch 1: 1.85x must at 8k,
  1.12x at 2k); each read is now pinned whole, as the cache lies (`attention._attend_cached`,
  tests/models/test_unsplit_kv_read.py), so the head comes out of the chunk read.
- Must move: the weights once (an untied embedding: the looked-up rows), each row's KV over the
  filled slots once, the step's new KV, its activations (each projection's output and the
  residual stream written and read once, per chip as tensor and data split them:
  `step_report.activation_bytes`) unless one layer's fit the chip's VMEM (64 MiB on v5p, 128
  MiB on v5e and v6e: XLA could keep them there, and on v6e-8 libtpu does: a wide step's fusion
  outputs, up to 20 MiB each, are `S(1)` in the compiled step, while on v5p-8 they are in HBM),
  float32 logits written and read. {vmem} A row just under the limit keeps its activations out
  of must though libtpu may put them in HBM (it does for the 32B's lossless K=6 G=2 at 64 rows on
  v5p-8), which raises its ratio. A ratio of 1 is a step at the memory-bandwidth limit; the
  roofline time is what such a step would take. The pallas_tpu lossless K=6 G=2 and verify K=16
  step rows at 8k were repriced with this rule, and every row priced since follows it; the other
  8k rows of the 32B (and the v5p-8 verify K=16 row's prefill and admit) were priced before,
  activations left out, which changes only the xla verify K=16 64-row v5p-8 one.
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
    from prove_jax.decoding.options import DecodeOptions, LosslessRule, MemoryLayout
    from prove_jax.models.compute import ComputeOptions
    from prove_jax.decoding.dry_run import SliceRun
    from prove_jax.decoding.step_report import step_report
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.models.config import preset

    out_json = os.path.join(args.out, "decode_step_cost.json")
    if args.merge:
        rows = load_rows(out_json) if os.path.exists(out_json) else []
        for path in args.merge.split(","):
            rows = merge_rows(rows, load_rows(path))
        doc = dict(dtype="bfloat16", jax=jax.__version__, host=device_description(), rows=rows)
        write_results(args.out, "decode_step_cost", doc, markdown(rows, jax.__version__))
        return 0
    if not aot.libtpu_available():
        print('error: needs libtpu: pip install "libtpu==0.0.42.*" (docs/environment.md)', file=sys.stderr)
        return 2
    proposer = preset(args.proposer)
    proposer = proposer.replace(mask_token_id=proposer.vocab_size - 1)
    verifier = preset(args.verifier)
    lossless_k, lossless_g = (int(x) for x in args.lossless.split(","))
    compute = ComputeOptions(attention=args.attention)
    options = {"ar": ("ar", DecodeOptions("ar", 1, memory=MemoryLayout(scan_layers=True), compute=compute)),
               "lossless": (f"lossless K={lossless_k} G={lossless_g}",
                            DecodeOptions("lossless", lossless_k, lossless=LosslessRule(max_groups=lossless_g), memory=MemoryLayout(scan_layers=True),
                                          compute=compute)),
               "verify": (f"verify K={args.block_size}", DecodeOptions("verify", args.block_size, memory=MemoryLayout(scan_layers=True),
                                                                        compute=compute))}
    modes = args.modes.split(",")
    jobs = []
    for accelerator in args.accelerators.split(","):
        for batch in args.batch_sizes:
            for mode in modes:
                jobs.append((accelerator, mode, batch, None))
        for batch in args.paged_batches:
            for mode in (m for m in modes if m in args.paged_modes.split(",")):
                jobs.append((accelerator, mode, batch, 64))
    rows = load_rows(out_json) if args.append and os.path.exists(out_json) else []
    first = (args.accelerators.split(",")[0], "verify", args.paged_batches[0] if args.paged_batches else 16, None)
    new = []
    for accelerator, mode, batch, page in jobs:
        chip, chips = aot.accelerator_chips(accelerator)
        label, opts = options[mode]
        if page is not None:
            opts = dataclasses.replace(opts, memory=dataclasses.replace(opts.memory, page_size=page))
            label += f", paged ({page})"
        log(f"{accelerator}: {args.proposer}, {label}, batch {batch}, {args.context} slots")
        programs = ("step", "prefill", "admit") if (accelerator, mode, batch, page) == first else ("step",)
        programs = programs if args.programs is None else tuple(args.programs.split(","))
        cell = dict(accelerator=accelerator, proposer=args.proposer,
                    verifier=args.verifier if mode == "verify" else None, context=args.context)
        try:
            report = step_report(SliceRun(proposer, opts, chip=chip, chips=chips, batch=batch, context=args.context,
                                 new_tokens=args.new_tokens, verifier=verifier if mode == "verify" else None), programs=programs)
        except Exception as e:  # a program that fails to compile is a result too, said in its row
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            log(f"  failed: {error}")
            new.append(dict(cell, label=label, batch=batch, mode=mode, block_size=opts.block_size,
                            groups=opts.lossless.max_groups, page_size=opts.memory.page_size,
                            attention=opts.compute.resolve_attention("tpu").attention, error=error))
            continue
        log("  " + report.table().replace("\n", "\n  "))
        new.append(dict(cell, label=f"{label}, {report.setting['attention']}", **report.record()))
    rows = merge_rows(rows, new)
    doc = dict(dtype="bfloat16", jax=jax.__version__, host=device_description(), rows=rows)
    write_results(args.out, "decode_step_cost", doc, markdown(rows, jax.__version__))
    return 0


def markdown(rows: list[dict], jax_version: str) -> list[str]:
    md = ["# One decode step on TPU slices, from the compiled program (`generate --dry-run --report`)", "",
          f"`benchmarks/bench_decode_step_cost.py`: bfloat16, layers scanned, the chunk program `generate` "
          f"streams compiled with libtpu (jax {jax_version}) for each slice from a CPU host, abstract weights "
          f"on the mesh `generate` picks; a table per proposer and context. Per chip and per decode step, "
          f"every row filled to the table's slots. *HBM*: what the compiled program reads and writes in one "
          f"execution (one decode step for *step*); *must*: what it has to; *ratio*: the two; *TFLOP*: its "
          f"dots."]
    for (proposer, context), group in groups(rows).items():
        verifiers = sorted({r["verifier"] for r in rows if r.get("verifier") and r["proposer"] == proposer})
        pair = f" ({', '.join(verifiers)} verifier in verify)" if verifiers else ""
        md += ["", f"## {proposer}{pair}, rows filled to {context} slots", "",
               "| slice | setting | batch | program | HBM GiB | must GiB | ratio | TFLOP | roofline ms | collectives |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        md += [table_row(r) for r in group]
    md += ["", NOTES.format(vmem=vmem_note(rows), over=over_note(rows),
                                narrow=narrow_pool_note(rows))]
    return md

if __name__ == "__main__":
    sys.exit(main())
