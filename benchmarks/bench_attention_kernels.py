"""One layer's cached attention for a decode step, compiled for a TPU chip from this CPU (libtpu):
the XLA path (models/attention.py, chunked) beside the Pallas TPU kernel path
(models/attention_kernels.py, ComputeOptions(attention="pallas_tpu")), at Qwen2.5-32B's attention
shape (40 query heads, 8 kv heads, head dim 128), 16 rows, an 8192-slot buffer, bf16.

Reports for each: compile OK and seconds, XLA's per-chip memory analysis, and its cost analysis
(FLOPs, bytes accessed). The cost analysis counts a loop body once and takes a Pallas kernel's
own estimate, so it is a lower bound for the chunked XLA path; see the .md. Needs the optional
libtpu package (docs/environment.md). Writes attention_kernels.json into --out-dir and prints the table.

    python benchmarks/bench_attention_kernels.py [--chip v6e] [--steps 1,8] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))

HEADS, KV_HEADS, HEAD_DIM, ROWS, SLOTS = 40, 8, 128, 16, 8192


def compile_one(kind: str, chip: str, step: int, chips: int = 1) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from prove_jax.models import attention
    from prove_jax.models.compute import ComputeOptions
    from prove_jax.aot import topology_mesh

    # rows on the data axis: `chips` chips, ROWS rows each
    mesh, topology = topology_mesh(chip, (chips,), ("data",))
    rep = NamedSharding(mesh, P("data"))
    rows = ROWS * chips
    g = HEADS // KV_HEADS
    bf = jnp.bfloat16
    shapes = (jax.ShapeDtypeStruct((rows, step, KV_HEADS, g, HEAD_DIM), bf, sharding=rep),  # q
              jax.ShapeDtypeStruct((rows, KV_HEADS, step, HEAD_DIM), bf, sharding=rep),  # own k
              jax.ShapeDtypeStruct((rows, KV_HEADS, step, HEAD_DIM), bf, sharding=rep),  # own v
              jax.ShapeDtypeStruct((rows, step, step), jnp.bool_, sharding=rep),  # intra
              jax.ShapeDtypeStruct((rows, KV_HEADS, SLOTS, HEAD_DIM), bf, sharding=rep),  # cache k
              jax.ShapeDtypeStruct((rows, KV_HEADS, SLOTS, HEAD_DIM), bf, sharding=rep),  # cache v
              jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=rep))  # cache_len
    compute = ComputeOptions(attention=kind, platform="tpu")

    def step_attention(q, k, v, intra, ck, cv, cache_len):
        if kind == "xla":
            return attention._attend_cached(q, (k, v), intra, (ck, cv), cache_len)
        return attention._attend_cached_kernel(q, (k, v), intra, (ck, cv), cache_len, compute)

    start = time.perf_counter()
    with jax.set_mesh(mesh):  # the kernel path runs per shard under it (attention_kernels._per_shard)
        compiled = jax.jit(step_attention).trace(*shapes).lower(lowering_platforms=("tpu",)).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    return {"kind": kind, "topology": topology, "chips": chips, "step_tokens": step, "compile_ok": True,
            "compile_seconds": round(seconds, 2),
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "temp_bytes": mem.temp_size_in_bytes,
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "has_pallas_kernel": "tpu_custom_call" in text, "has_while_loop": " while(" in text,
            "all_gathers": text.count("all-gather(") + text.count("all-gather-start(")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chip", default="v6e")
    ap.add_argument("--steps", default="1,8", help="step widths (tokens a row) to compile")
    ap.add_argument("--mesh-chips", type=int, default=4, help="chips of the sharded (rows) compile")
    ap.add_argument("--out-dir", default=RESULTS)
    args = ap.parse_args(argv)
    rows = []
    for chips, step in [(1, int(x)) for x in args.steps.split(",")] + [(args.mesh_chips, 8)]:
        for kind in ("xla", "pallas_tpu"):
            try:
                rows.append(compile_one(kind, args.chip, step, chips))
            except Exception as e:  # recorded: the table says which shape did not compile and why
                rows.append({"kind": kind, "step_tokens": step, "chips": chips, "compile_ok": False,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    meta = {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "rows": ROWS,
                      "slots": SLOTS, "dtype": "bfloat16"}, "chip": args.chip,
            "host": platform.processor() or platform.machine(), "results": rows}
    with open(os.path.join(args.out_dir, "attention_kernels.json"), "w") as f:
        json.dump(meta, f, indent=1)
    lines = ["| kernel | step tokens | compiled | compile s | args MiB | temp MiB | cost-analysis GFLOP "
             "| cost-analysis GB accessed | Pallas call | while loop | all-gathers |", "|" + "---|" * 11]
    for r in rows:
        if not r["compile_ok"]:
            lines.append(f"| {r['kind']} | {r['step_tokens']} | no ({r['chips']} chips): {r['error']} |" + " |" * 8)
            continue
        lines.append(f"| {r['kind']} | {r['step_tokens']} | yes ({r['topology']}) | {r['compile_seconds']} "
                     f"| {r['argument_bytes'] / 2**20:.0f} | {r['temp_bytes'] / 2**20:.1f} "
                     f"| {r['flops'] / 1e9:.3f} | {r['bytes_accessed'] / 1e9:.3f} "
                     f"| {r['has_pallas_kernel']} | {r['has_while_loop']} | {r['all_gathers']} |")
    print("\n".join(lines))  # the table benchmarks/attention_kernels.md quotes


if __name__ == "__main__":
    main()
