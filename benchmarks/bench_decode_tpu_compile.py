"""The paper's pair compiled for TPU slices: a Qwen2.5-32B proposer with a Qwen2.5-3B verifier.

    nice .venv/bin/python benchmarks/bench_decode_tpu_compile.py [--accelerators v5p-8,v6e-8]
        [--batch-sizes 1,16,64] [--contexts 2048,8192] [--out benchmarks]

Each row is `prove-jax generate --dry-run`'s compile (prove_jax/decoding/dry_run.py): the whole
decode program, prefill, loop and verifier, for the slice, with abstract bfloat16 weights on the
mesh `generate` picks there, layers scanned. Verify runs K=16 with the top-1 rule at every batch
size and context; lossless runs the TPU adaptive table (K and groups shrink as the batch
grows) at each batch size and the shorter context; one verify row is compiled with the layers
unrolled (compile time) and two with the Pallas TPU attention kernel (the first slice's batch 16,
the last one's largest program). Needs libtpu.

Writes decode_tpu_compile.json and decode_tpu_compile.md.
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
    p.add_argument("--contexts", type=ints("--contexts"), default=[2048, 8192], help="tokens per row (default 2048,8192)")
    p.add_argument("--new-tokens", type=int, default=512, help="of each context, tokens generated (default 512)")
    p.add_argument("--proposer", default="qwen2.5-32b")
    p.add_argument("--verifier", default="qwen2.5-3b")
    p.add_argument("--block-size", type=int, default=16, help="verify's K (default 16)")
    p.add_argument("--extras", action=argparse.BooleanOptionalAction, default=True,
                   help="the lossless rows, the unrolled row and the Pallas-kernel rows (default on)")
    p.add_argument("--out", default=RESULTS, help="folder for decode_tpu_compile.json/.md (default runs/benchmarks/; "
                                                   "--out benchmarks updates the committed results)")
    return p.parse_args(argv)


def notes(rows: list[dict]) -> str:
    """What the table shows beyond its cells, each number taken from this run's rows (a note
    whose rows were not compiled is left out)."""
    ok = [r for r in rows if not r.get("error")]
    out = ["Notes."]
    meshes = []
    for acc in dict.fromkeys(r["accelerator"] for r in ok):
        for label, what in (("verify", "the pair"), ("lossless adaptive", "the proposer alone")):
            r = next((x for x in ok if x["accelerator"] == acc and x["label"] == label), None)
            if r is not None:  # weight_bytes is per chip: the weights split over tensor x fsdp
                total = r["weight_bytes"] * r["mesh"]["tensor"] * r["mesh"]["fsdp"]
                meshes.append(f"{what} ({total / GIB:.0f} GiB of bfloat16 weights) takes "
                              f"tensor={r['mesh']['tensor']} on {acc} ({r['hbm_bytes'] / GIB:.0f} GiB chips)")
    if meshes:
        out.append("- Mesh: " + "; ".join(meshes) + ", as `sharding.inference_tensor_size` picks. Rows "
                   "are rounded up to whole data shards (and to whole data x tensor shards where that "
                   "splits the verifier's cache and holds less KV).")
    unrolled = next((r for r in ok if r["label"] == "verify, unrolled"), None)
    scanned = unrolled and next((r for r in ok if r["label"] == "verify" and all(
        r[k] == unrolled[k] for k in ("accelerator", "batch", "context"))), None)
    if scanned:
        n = lambda r, k: r["collectives"][k]["count"]  # noqa: E731
        out.append(f"- Collectives are counted per program, a loop body's once: scanned, the proposer's and "
                   f"the verifier's layers are one body each ({n(scanned, 'all-reduce')} all-reduces); "
                   f"unrolled, every layer's appear ({n(unrolled, 'all-reduce')}), and the compile took "
                   f"{unrolled['compile_seconds']:.0f} s against {scanned['compile_seconds']:.0f}. The "
                   f"{n(scanned, 'all-gather')} all-gathers are the final token buffers, replicated so every "
                   f"host can read them (`Decoder`'s out_shardings), once per call; no weight or KV cache "
                   f"is gathered.")
    split = [r for r in ok if r["label"] == "verify" and r["collectives"]["all-to-all"]["count"]]
    if split:
        r = max(split, key=lambda x: (x["batch"], x["context"]))
        a2a = r["collectives"]["all-to-all"]
        out.append(f"- On {r['accelerator']} the verifier's kv heads cannot split over "
                   f"tensor={r['mesh']['tensor']}: its KV cache and attention split over the rows instead "
                   f"(`sharding.kv_rules`, docs/decoding.md), each chip holding its share of the rows, and "
                   f"the step's queries and attention outputs cross by all-to-all ({a2a['count']} per "
                   f"program, {a2a['bytes'] / 2**20:.0f} MiB at batch {r['batch']}); no all-reduce is "
                   f"added, as the chunked KV read's bound, the longest row, is taken before the rows "
                   f"move. At batch 1 (one row) the cache stays whole on every chip.")
    pallas = []
    for r in (x for x in ok if x["label"] == "verify, Pallas attention"):
        xla = next((x for x in ok if x["label"] == "verify" and all(
            x[k] == r[k] for k in ("accelerator", "batch", "context"))), None)
        if xla is not None:
            pallas.append(f"{r['accelerator']} batch {r['batch']} at {r['context']} tokens "
                          f"{r['peak_bytes'] / GIB:.1f} GiB against XLA's {xla['peak_bytes'] / GIB:.1f}")
    if pallas:
        out.append("- The Pallas TPU attention kernel (`--attention pallas_tpu`) compiled inside the whole "
                   "program: " + "; ".join(pallas) + " (peak per chip).")
    if any(r["label"] == "lossless adaptive" for r in ok):
        out.append("- Lossless adaptive follows the TPU table (`decoding/adaptive.py`), whose break-even "
                   "was measured on an H200, not on TPU.")
    return "\n".join(out)


def table_row(r: dict) -> str:
    """One markdown row: a compiled program, one XLA refused for memory, or one that failed."""
    head = f"| {r['accelerator']} | {r['label']}"
    if "error" in r:
        return f"{head} | {r['batch']} | {r['context']} | - | - | - | - | - | failed: {r['error'][:160]} |"
    layout = "AR: the table's choice" if r["mode"] == "ar" else (
        f"K={r['block_size']}" + (f" G={r['groups']}" if r["mode"] == "lossless" else ""))
    head += (f" ({layout}) | {r['batch']} | {r['context']} | {r['mesh']['data']} x {r['mesh']['tensor']} | "
             f"{r['weight_bytes'] / GIB:.1f}")
    if "peak_bytes" not in r:
        return f"{head} | - | does not fit: {r['does_not_fit'].split('XLA: ')[-1][:150]} | - | - |"
    collectives = ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f})"
                            for k, v in r["collectives"].items() if v["count"]) or "none"
    return (f"{head} | {r['peak_bytes'] / GIB:.1f} | {100 * r['peak_bytes'] / r['hbm_bytes']:.0f}% | "
            f"{r['compile_seconds']:.0f} | {collectives} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    import dataclasses

    import jax

    from prove_jax import aot
    from prove_jax.decoding.dry_run import dry_run_decode, SliceRun
    from prove_jax.decoding.options import DecodeOptions, LosslessRule, MemoryLayout
    from prove_jax.evaluation.progress import log
    from prove_jax.evaluation.report import device_description, write_results
    from prove_jax.models.config import preset
    from prove_jax.models.compute import ComputeOptions

    if not aot.libtpu_available():
        print('error: needs libtpu: pip install "libtpu==0.0.42.*" (docs/environment.md)', file=sys.stderr)
        return 2
    proposer = preset(args.proposer)
    proposer = proposer.replace(mask_token_id=proposer.vocab_size - 1)
    verifier = preset(args.verifier)
    verify = DecodeOptions("verify", args.block_size, memory=MemoryLayout(scan_layers=True))
    lossless = DecodeOptions("lossless", args.block_size, lossless=LosslessRule(adaptive=True), memory=MemoryLayout(scan_layers=True))
    jobs = []
    for accelerator in args.accelerators.split(","):
        for context in args.contexts:
            for batch in args.batch_sizes:
                jobs.append((accelerator, verify, batch, context, "verify"))
        if args.extras:
            for batch in args.batch_sizes:
                jobs.append((accelerator, lossless, batch, args.contexts[0], "lossless adaptive"))
    if args.extras:
        first = args.accelerators.split(",")[0]
        jobs.append((first, dataclasses.replace(verify, memory=dataclasses.replace(verify.memory, scan_layers=False)), 16, args.contexts[0], "verify, unrolled"))
        pallas = dataclasses.replace(verify, compute=ComputeOptions(attention="pallas_tpu"))
        jobs.append((first, pallas, 16, args.contexts[0], "verify, Pallas attention"))
        last = args.accelerators.split(",")[-1]
        if last != first:  # the largest program, where a verifier's cache splits over rows
            jobs.append((last, pallas, max(args.batch_sizes), max(args.contexts), "verify, Pallas attention"))
    rows = []
    for accelerator, options, batch, context, label in jobs:
        chip, chips = aot.accelerator_chips(accelerator)
        log(f"{accelerator}: {label}, batch {batch}, context {context}")
        try:
            report = dry_run_decode(SliceRun(proposer, options, chip=chip, chips=chips, batch=batch, context=context,
                                    new_tokens=args.new_tokens, verifier=verifier if options.mode == "verify" else None))
        except Exception as e:  # a program that fails to compile is a result too, said in its row
            log(f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rows.append(dict(accelerator=accelerator, label=label, batch=batch, context=context,
                             error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
            continue
        log("  " + report.describe().replace("\n", "\n  "))
        rows.append(dict(accelerator=accelerator, label=label, **report.record()))
    doc = dict(proposer=args.proposer, verifier=args.verifier, dtype="bfloat16", jax=jax.__version__,
               host=device_description(), new_tokens=args.new_tokens, rows=rows)
    md = ["# The paper's pair compiled for TPU slices (`prove-jax generate --dry-run`)", "",
          f"`benchmarks/bench_decode_tpu_compile.py`: {args.proposer} proposer, {args.verifier} verifier, "
          f"bfloat16, the whole decode program (prefill, loop, verifier) compiled with libtpu for each "
          f"slice from a CPU host (jax {jax.__version__}), abstract weights on the mesh `generate` picks. "
          f"Each row decodes `batch` rows of a prompt of (context - {args.new_tokens}) tokens and "
          f"{args.new_tokens} new tokens; layers scanned unless the row says otherwise. Memory is XLA's "
          f"per-chip count; collectives are those of the compiled program (count and result MiB, per "
          f"program: a loop body's count once). Compile seconds are wall time on a shared 2-core host.", "",
          "| slice | program | batch | context | mesh (data x tensor) | weights GiB/chip | peak GiB/chip | "
          "of HBM | compile s | collectives |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(table_row(r))
    md += ["", notes(rows)]
    write_results(args.out, "decode_tpu_compile", doc, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
