"""The train step of each paper config compiled for its real TPU slice from this CPU (libtpu).

For each run (a config plus overrides, e.g. the 32B step under each remat policy): the dry
run's analytic estimate beside XLA's own per-chip numbers from the compile for the config's
slice (arguments, temporaries, peak), the compile time, and the count and result bytes of each
collective kind in the compiled program. Needs the optional libtpu package
(docs/environment.md). Writes tpu_compile.{json,md} into --out-dir.

    python benchmarks/bench_tpu_compile.py [--runs "configs/A.yaml key=v ...;configs/B.yaml"] [--out-dir DIR]
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

P32_V5P, P32_V6E = "configs/proposer_qwen2.5_32b_v5p.yaml", "configs/proposer_qwen2.5_32b_v6e.yaml"
# (config, overrides): the 32B step scanned under three remat policies, the v6e configs, then the
# 32B step unrolled (the compile time the scan saves; last, the slowest).
RUNS = ((P32_V5P, ("model.remat=dots",)),
        (P32_V5P, ("model.remat=attn_proj",)),
        (P32_V5P, ()),  # remat full, scanned
        (P32_V6E, ()),
        ("configs/verifier_qwen2.5_3b_v6e.yaml", ()),
        (P32_V5P, ("model.scan_layers=false",)))


def parse_runs(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """'configs/A.yaml k=v k=v;configs/B.yaml' -> [(config, overrides), ...]."""
    runs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        config, *overrides = item.split()
        runs.append((config, tuple(overrides)))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=";".join(" ".join((c,) + o) for c, o in RUNS),
                    help="';'-separated runs, each a training config and its key=value overrides")
    ap.add_argument("--out-dir", default=RESULTS,
                    help="folder for tpu_compile.json / tpu_compile.md (default runs/benchmarks/; "
                         "--out-dir benchmarks updates the committed results)")
    args = ap.parse_args(argv)
    import jax
    jax.config.update("jax_platforms", "cpu")  # abstract and libtpu-topology devices only
    from prove_jax import aot
    from prove_jax.training.config import load_config
    from prove_jax.training.dry_run import dry_run
    if not aot.libtpu_available():
        print("error: libtpu is not installed (docs/environment.md)", file=sys.stderr)
        return 2
    meta = {"jax": jax.__version__, "libtpu": __import__("importlib.metadata").metadata.version("libtpu"),
            "cpu_count": os.cpu_count(), "machine": platform.machine()}
    rows = []
    for path, overrides in parse_runs(args.runs):
        cfg = load_config(os.path.join(os.path.dirname(HERE), path), list(overrides))
        print(f"== {path} {' '.join(overrides)}", flush=True)
        try:
            report = dry_run(cfg)
        except aot.DoesNotFit as e:  # a cell too large for its chip is a result: record it, go on
            print(f"does not fit: {e}", flush=True)
            rows.append({"config": path, "overrides": list(overrides), "objective": cfg.objective,
                         "global_batch_size": cfg.global_batch_size, "max_length": cfg.max_length,
                         "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
                         "does_not_fit": str(e), "compiled": None})
            write_results(rows, meta, args.out_dir)
            continue
        print(report.describe(), flush=True)
        c = report.compiled
        rows.append({"config": path, "overrides": list(overrides), "chip": report.chip,
                     "mesh": report.mesh, "devices": report.devices,
                     "model_params": report.model_params, "objective": cfg.objective,
                     "global_batch_size": cfg.global_batch_size, "max_length": cfg.max_length,
                     "remat": cfg.model.remat, "scan_layers": cfg.model.scan_layers,
                     "estimate_bytes": report.total_bytes, "hbm_bytes": report.hbm_bytes,
                     "compiled": None if c is None else dataclasses.asdict(c) | {"peak_bytes": c.peak_bytes}})
        write_results(rows, meta, args.out_dir)  # after each run: a long sweep keeps what it has
    print(f"wrote {args.out_dir}/tpu_compile.json, tpu_compile.md")
    return 0


def write_results(rows: list[dict], meta: dict, out_dir: str) -> None:
    from prove_jax.files import atomic_write_text
    from prove_jax.training.dry_run import GIB
    atomic_write_text(os.path.join(out_dir, "tpu_compile.json"),
                      json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = ["# Train steps compiled for their TPU slice (AOT, from a CPU)", "",
          f"`python benchmarks/bench_tpu_compile.py --out-dir benchmarks` (jax {meta['jax']}, libtpu "
          f"{meta['libtpu']}, {meta['cpu_count']} CPU cores). Per chip, GiB; the estimate is the dry "
          "run's analytic count (parameters, gradients and optimizer exact, activations estimated); "
          "XLA's figures are from `compiled.memory_analysis()`. Collectives: count (result GiB).", "",
          "| config | remat | layers | slice | mesh (data, fsdp, tensor) | estimate | XLA arguments | "
          "XLA temporaries | XLA peak | of HBM | compile s (CPU s) | all-gather | reduce-scatter | all-reduce | "
          "collective-permute |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["compiled"]
        if r.get("does_not_fit"):
            md.append(f"| `{os.path.basename(r['config'])}` ({r['objective']}) | {r['remat']} | "
                      f"{'scan' if r['scan_layers'] else 'unrolled'} | does not fit: {r['does_not_fit']} |"
                      + " |" * 11)
            continue
        coll = lambda k: f"{c['collectives'][k]['count']} ({c['collectives'][k]['bytes'] / GIB:.2f})"  # noqa: E731
        md.append(f"| `{os.path.basename(r['config'])}` ({r['model_params'] / 1e9:.1f}B, {r['objective']}) | "
                  f"{r['remat']} | {'scan' if r['scan_layers'] else 'unrolled'} | "
                  f"{c['topology']} | {tuple(r['mesh'].values())} | {r['estimate_bytes'] / GIB:.2f} | "
                  f"{c['argument_bytes'] / GIB:.2f} | {c['temp_bytes'] / GIB:.2f} | {c['peak_bytes'] / GIB:.2f} | "
                  f"{100 * c['peak_bytes'] / r['hbm_bytes']:.0f}% | {c['compile_seconds']:.0f} ({c.get('compile_cpu_seconds', 0):.0f}) | "
                  f"{coll('all-gather')} | {coll('reduce-scatter')} | {coll('all-reduce')} | "
                  f"{coll('collective-permute')} |")
    atomic_write_text(os.path.join(out_dir, "tpu_compile.md"), "\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
