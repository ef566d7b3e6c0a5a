"""The train step of each paper config compiled for its real TPU slice from this CPU (libtpu).

For each config: the dry run's analytic estimate beside XLA's own per-chip numbers from the
compile for the config's slice (arguments, temporaries, peak), the compile time, and the count
and result bytes of each collective kind in the compiled program. Needs the optional libtpu
package (docs/environment.md). Writes tpu_compile.{json,md} into --out-dir.

    python benchmarks/bench_tpu_compile.py [--configs configs/A.yaml,...] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out-dir benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for prove_jax: runs from anywhere

CONFIGS = ("configs/verifier_qwen2.5_3b.yaml", "configs/proposer_qwen2.5_32b_v5p.yaml")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated training configs")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for tpu_compile.json / tpu_compile.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    import jax
    jax.config.update("jax_platforms", "cpu")  # abstract and libtpu-topology devices only
    from prove_jax.files import atomic_write_text
    from prove_jax.training import aot
    from prove_jax.training.config import load_config
    from prove_jax.training.dry_run import GIB, dry_run
    if not aot.libtpu_available():
        print("error: libtpu is not installed (docs/environment.md)", file=sys.stderr)
        return 2
    rows = []
    for path in args.configs.split(","):
        cfg = load_config(os.path.join(os.path.dirname(HERE), path))
        report = dry_run(cfg)
        print(report.describe(), flush=True)
        c = report.compiled
        rows.append({"config": path, "chip": report.chip, "mesh": report.mesh, "devices": report.devices,
                     "model_params": report.model_params, "objective": cfg.objective,
                     "global_batch_size": cfg.global_batch_size, "max_length": cfg.max_length,
                     "remat": cfg.model.remat,
                     "estimate_bytes": report.total_bytes, "hbm_bytes": report.hbm_bytes,
                     "compiled": None if c is None else dataclasses.asdict(c) | {"peak_bytes": c.peak_bytes}})
    meta = {"jax": jax.__version__, "libtpu": __import__("importlib.metadata").metadata.version("libtpu"),
            "cpu_count": os.cpu_count(), "machine": platform.machine()}
    atomic_write_text(os.path.join(args.out_dir, "tpu_compile.json"),
                      json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = ["# Train steps compiled for their TPU slice (AOT, from a CPU)", "",
          f"`python benchmarks/bench_tpu_compile.py --out-dir benchmarks` (jax {meta['jax']}, libtpu "
          f"{meta['libtpu']}, {meta['cpu_count']} CPU cores). Per chip, GiB; the estimate is the dry "
          "run's analytic count (parameters, gradients and optimizer exact, activations estimated); "
          "XLA's figures are from `compiled.memory_analysis()`. Collectives: count (result GiB).", "",
          "| config | slice | mesh (data, fsdp, tensor) | estimate | XLA arguments | XLA temporaries | "
          "XLA peak | of HBM | compile s | all-gather | reduce-scatter | all-reduce | collective-permute |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["compiled"]
        coll = lambda k: f"{c['collectives'][k]['count']} ({c['collectives'][k]['bytes'] / GIB:.2f})"  # noqa: E731
        md.append(f"| `{os.path.basename(r['config'])}` ({r['model_params'] / 1e9:.1f}B, {r['objective']}) | "
                  f"{c['topology']} | {tuple(r['mesh'].values())} | {r['estimate_bytes'] / GIB:.2f} | "
                  f"{c['argument_bytes'] / GIB:.2f} | {c['temp_bytes'] / GIB:.2f} | {c['peak_bytes'] / GIB:.2f} | "
                  f"{100 * c['peak_bytes'] / r['hbm_bytes']:.0f}% | {c['compile_seconds']:.0f} | "
                  f"{coll('all-gather')} | {coll('reduce-scatter')} | {coll('all-reduce')} | "
                  f"{coll('collective-permute')} |")
    atomic_write_text(os.path.join(args.out_dir, "tpu_compile.md"), "\n".join(md) + "\n")
    print(f"wrote {args.out_dir}/tpu_compile.json, tpu_compile.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
