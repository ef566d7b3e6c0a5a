"""Converter cost and forward latency at the real Qwen2.5-0.5B shapes (random weights).

    nice python benchmarks/bench_convert.py [--runs 9] [--tokens 128]

1. transformers builds a random-init Qwen2ForCausalLM with the 0.5B shapes and `save_pretrained`s
   it in its default dtype (float32: ~2 GB of safetensors).
2. `python -m prove_jax convert hf-to-flax` and then `flax-to-hf` run as subprocesses; wall time
   and peak RSS come from `os.wait4` (that child only). Target: peak RSS < 2x checkpoint size.
3. Forward latency, batch 1 x T tokens, median after a warm-up: our jitted model (loaded from the
   converted checkpoint) vs transformers on torch CPU (same weights, same tokens).

Writes benchmarks/convert.json and benchmarks/convert.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# a rerun never overwrites the committed results unless asked to (--out benchmarks)
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # for prove_jax: the script runs from anywhere

from prove_jax.models.config import PRESETS


def run_child(args: list[str]) -> dict:
    """Run a subprocess; its own wall time and peak RSS (ru_maxrss is KiB on Linux)."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=env, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(args)} exited with {proc.returncode}")
    return {"wall_s": round(wall, 2), "peak_rss_bytes": usage.ru_maxrss * 1024}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def interleaved_seconds(fns: dict, runs: int) -> dict[str, list[float]]:
    """Time each fn `runs` times after one warm-up, alternating between them every run, so that
    load from other jobs on a shared CPU hits every implementation alike."""
    for fn in fns.values():
        fn()  # warm-up (and compile)
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=sorted(PRESETS),
                   help="prove_jax.models.config preset giving the shapes")
    p.add_argument("--tokens", type=int, default=128, help="sequence length of the latency input (batch 1)")
    p.add_argument("--runs", type=int, default=9, help="timed forward runs per framework after one warm-up")
    p.add_argument("--out", default=RESULTS,
                   help="folder for convert.json / convert.md (default runs/benchmarks/; "
                        "--out benchmarks updates the committed results)")
    p.add_argument("--workdir", default=None, help="scratch dir for the checkpoints (default: a temp dir)")
    args = p.parse_args()
    for name in ("tokens", "runs"):
        if getattr(args, name) < 1:  # --runs 0 was a StatisticsError after both conversions
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    import numpy as np
    import torch
    import transformers

    from prove_jax.files import atomic_write_text

    cfg = PRESETS[args.preset]
    work = tempfile.mkdtemp(prefix="bench-convert-", dir=args.workdir)
    hf_dir, ckpt, back = (os.path.join(work, n) for n in ("hf", "ckpt", "back"))
    try:
        print(f"building random {args.preset} in transformers ...", file=sys.stderr, flush=True)
        torch.manual_seed(0)
        start = time.perf_counter()
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg.to_hf_dict()))
        hf.save_pretrained(hf_dir)
        hf_dtype = str(next(hf.parameters()).dtype).replace("torch.", "")
        del hf
        build_s = time.perf_counter() - start
        hf_bytes = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir)
                       if f.endswith(".safetensors"))

        print("hf-to-flax ...", file=sys.stderr, flush=True)
        to_flax = run_child(["-m", "prove_jax", "convert", "hf-to-flax", "--hf-dir", hf_dir, "--out", ckpt])
        to_flax["output_bytes"] = dir_bytes(ckpt)
        print("flax-to-hf ...", file=sys.stderr, flush=True)
        to_hf = run_child(["-m", "prove_jax", "convert", "flax-to-hf", "--ckpt", ckpt, "--out", back])
        to_hf["output_bytes"] = dir_bytes(back)
        for r in (to_flax, to_hf):
            r["peak_rss_over_checkpoint"] = round(r["peak_rss_bytes"] / hf_bytes, 3)

        print("forward latency ...", file=sys.stderr, flush=True)
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from prove_jax.checkpoints.checkpoint import load_model
        from prove_jax.models.attention import causal_mask

        tokens = np.random.RandomState(0).randint(0, 151_643, (1, args.tokens)).astype(np.int32)
        model = load_model(ckpt)
        forward = nnx.jit(lambda m, t, pos, mask: m(t, pos, mask)[0])
        pos = jnp.arange(args.tokens, dtype=jnp.int32)[None]
        mask = causal_mask(1, args.tokens)
        tok = jnp.asarray(tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(back).eval()
        tt = torch.tensor(tokens, dtype=torch.long)
        with torch.no_grad():
            times = interleaved_seconds({
                "ours": lambda: forward(model, tok, pos, mask).block_until_ready(),
                "torch": lambda: hf(tt).logits}, args.runs)
            torch_logits = hf(tt).logits.numpy()
        ours_logits = np.asarray(forward(model, tok, pos, mask))
        max_err = float(np.abs(ours_logits - torch_logits).max())
        ours_s, torch_s = (statistics.median(times[k]) for k in ("ours", "torch"))
        ours_min, torch_min = (min(times[k]) for k in ("ours", "torch"))

        result = {
            "preset": args.preset,
            "num_params": cfg.num_params,
            "hf_dtype": hf_dtype,
            "hf_checkpoint_bytes": hf_bytes,
            "build_and_save_pretrained_s": round(build_s, 1),
            "hf_to_flax": to_flax,
            "flax_to_hf": to_hf,
            "forward": {"batch": 1, "tokens": args.tokens, "runs": args.runs,
                        "ours_jax_median_s": round(ours_s, 4), "torch_median_s": round(torch_s, 4),
                        "ours_jax_min_s": round(ours_min, 4), "torch_min_s": round(torch_min, 4),
                        "torch_over_ours_median": round(torch_s / ours_s, 3),
                        "torch_over_ours_min": round(torch_min / ours_min, 3),
                        "all_runs_s": {k: [round(x, 4) for x in v] for k, v in times.items()},
                        "max_abs_logit_diff": max_err},
            "env": {"jax": jax.__version__, "torch": torch.__version__,
                    "transformers": transformers.__version__, "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
                    "note": "shared 2-core CPU; other jobs were running"},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)

    atomic_write_text(os.path.join(args.out, "convert.json"), json.dumps(result, indent=2))
    gb = 1e9
    rows = [
        f"# Converter and forward latency: {args.preset} shapes, random weights ({cfg.num_params / 1e6:.0f}M params)",
        "",
        f"HF checkpoint written by transformers `save_pretrained` ({hf_dtype}): {hf_bytes / gb:.2f} GB. "
        "Peak RSS is the converter subprocess alone (`os.wait4`), including the Python/JAX runtime.",
        "",
        "| step | wall (s) | peak RSS (GB) | peak RSS / checkpoint | output (GB) |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("hf-to-flax", to_flax), ("flax-to-hf", to_hf)):
        rows.append(f"| {name} | {r['wall_s']} | {r['peak_rss_bytes'] / gb:.2f} | "
                    f"{r['peak_rss_over_checkpoint']}x | {r['output_bytes'] / gb:.2f} |")
    fw = result["forward"]
    rows += [
        "",
        f"Forward, batch 1 x {fw['tokens']} tokens, float32, {fw['runs']} runs each after a warm-up, "
        "the two implementations alternating run by run (the CPU is shared with other jobs, so "
        "the minimum is the steadier figure):",
        "",
        "| implementation | median (s) | min (s) |",
        "|---|---|---|",
        f"| ours (jax.jit, XLA CPU) | {fw['ours_jax_median_s']} | {fw['ours_jax_min_s']} |",
        f"| transformers (torch {torch.__version__} CPU, {torch.get_num_threads()} threads) | "
        f"{fw['torch_median_s']} | {fw['torch_min_s']} |",
        "",
        f"torch / ours: {fw['torch_over_ours_median']} (medians), {fw['torch_over_ours_min']} (minimums); "
        f"max |logit difference| = {max_err:.2e}. Timings on a shared CPU swing by several x from "
        "run to run (torch's OpenMP threads suffer most when cores are oversubscribed): rerun on a "
        "quiet machine before quoting the ratio. "
        "Regenerate: `nice .venv/bin/python benchmarks/bench_convert.py`.",
        "",
    ]
    atomic_write_text(os.path.join(args.out, "convert.md"), "\n".join(rows))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
