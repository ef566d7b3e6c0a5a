"""Reproduce the shipped arithmetic pair: the demo pair fine-tuned on synthetic word problems.

    python scripts/build_arithmetic_models.py                # full recipe (docs/demo_models.md has its run time)
    python scripts/build_arithmetic_models.py --quick --work /tmp/wa --out /tmp/arith   # smoke test

Steps, each one of the project's own commands: `prove-jax task arithmetic` (train pairs and a
test set split by a hash of each problem) -> the shipped demo proposer fine-tuned on the pairs,
AR stage then MARS stage (block 8) -> the shipped demo verifier fine-tuned (AR) on the pairs ->
`prove-jax distill`: the new proposer's own greedy solutions of train problems -> the verifier
fine-tuned (AR) on those trajectories, and its commit head trained on them against the proposer
(a verifier judges the proposer's outputs, not the reference solutions: on the test set this
raised verify's top-1 rule from 3.24 to 4.21 tokens per forward and from 0.520 to 0.620
accuracy, benchmarks/trajectory_verifier.md) -> bfloat16 copies in OUT/arith_proposer and
OUT/arith_verifier, and the test set as OUT/arith_test.jsonl. The tokenizer is the demo pair's (it writes every
digit as its own token).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prove_jax import assets  # noqa: E402
from build_demo_models import export_bf16  # noqa: E402

FULL = {"proposer_ar": 1000, "proposer_mars": 500, "verifier": 300, "verifier_trajectories": 300,
        "commit_head": 150}
QUICK = {"proposer_ar": 4, "proposer_mars": 4, "verifier": 4, "verifier_trajectories": 4, "commit_head": 4}
# train problems the proposer solves for the verifier's second stage (distill: --max-new-tokens 48
# covers every worked solution)
TRAJECTORIES = 3000
QUICK_TRAJECTORIES = 16
TASK = {"train": 20000, "test": 300, "seed": 0}
QUICK_TASK = {"train": 200, "test": 12, "seed": 0}
# Problems are 40-110 tokens: rows of 256 hold about three, each attending only to itself.
ROWS = ["pack_documents=true", "max_length=256", "global_batch_size=8"]
QUICK_ROWS = ["pack_documents=true", "max_length=128", "global_batch_size=2", "log_every=2",
              "save_every=1000"]
# The commit head cuts one context per row (no packing); rows of 128 hold any problem.
HEAD_ROWS = ["pack_documents=false", "max_length=128", "global_batch_size=16"]
QUICK_HEAD_ROWS = ["pack_documents=false", "max_length=128", "global_batch_size=2", "log_every=2",
                   "save_every=1000"]


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": ROOT})
    print(f"  ({time.time() - t0:.0f}s)", flush=True)


def train(config: str, run_dir: str, steps: int, *overrides: str) -> str:
    run([sys.executable, "-m", "prove_jax", "train", "--config", config, f"run_dir={run_dir}",
         f"steps={steps}", "model.config=null", "tokenizer.path=null", *overrides])
    return os.path.join(run_dir, "model")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/arith", help="scratch dir for the task data and runs")
    ap.add_argument("--out", default=assets.DEMO_DIR,
                    help="where arith_proposer, arith_verifier and arith_test.jsonl are written")
    ap.add_argument("--proposer", default=assets.DEMO_PROPOSER, help="proposer to fine-tune")
    ap.add_argument("--verifier", default=assets.DEMO_VERIFIER, help="verifier to fine-tune")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = ap.parse_args(argv)
    steps = QUICK if args.quick else FULL
    task = QUICK_TASK if args.quick else TASK
    rows = QUICK_ROWS if args.quick else ROWS
    head_rows = QUICK_HEAD_ROWS if args.quick else HEAD_ROWS
    w = os.path.abspath(args.work)
    t0 = time.time()
    run([sys.executable, "-m", "prove_jax", "task", "arithmetic", "--out", f"{w}/task",
         *[f"--{k}={v}" for k, v in task.items()]])
    data = f"data={w}/task/train.jsonl"
    base = train("configs/demo_proposer.yaml", f"{w}/proposer_ar", steps["proposer_ar"],
                 "objective=ar", f"model.checkpoint={args.proposer}", data, "optimizer.lr=2e-3",
                 *rows)
    proposer = train("configs/demo_proposer.yaml", f"{w}/proposer_mars", steps["proposer_mars"],
                     "objective=mars", f"model.checkpoint={base}", data, "optimizer.lr=1e-3", *rows)
    verifier = train("configs/demo_verifier.yaml", f"{w}/verifier", steps["verifier"],
                     "objective=ar", f"model.checkpoint={args.verifier}", data, "optimizer.lr=2e-3",
                     *rows)
    n = QUICK_TRAJECTORIES if args.quick else TRAJECTORIES
    with open(f"{w}/task/train.jsonl") as src, open(f"{w}/trajectory_prompts.jsonl", "w") as dst:
        for i, line in zip(range(n), src):
            dst.write(json.dumps({"id": i, "prompt": json.loads(line)["prompt"]}) + "\n")
    run([sys.executable, "-m", "prove_jax", "distill", "--model", proposer, "--prompts",
         f"{w}/trajectory_prompts.jsonl", "--out", f"{w}/trajectories.jsonl", "--num-prompts", str(n),
         "--max-new-tokens", "48", "--batch-size", "64"])
    trajectories = f"data={w}/trajectories.jsonl"
    verifier = train("configs/demo_verifier.yaml", f"{w}/verifier_trajectories", steps["verifier_trajectories"],
                     "objective=ar", f"model.checkpoint={verifier}", trajectories, "optimizer.lr=1e-3", *rows)
    verifier = train("configs/demo_verifier.yaml", f"{w}/verifier_head", steps["commit_head"],
                     "objective=commit_head", f"proposer={proposer}", f"model.checkpoint={verifier}",
                     trajectories, "optimizer.lr=1e-3", *head_rows)
    os.makedirs(args.out, exist_ok=True)
    export_bf16(proposer, os.path.join(args.out, "arith_proposer"))
    export_bf16(verifier, os.path.join(args.out, "arith_verifier"))
    shutil.copyfile(f"{w}/task/test.jsonl", os.path.join(args.out, "arith_test.jsonl"))
    print(f"wrote {args.out}/arith_test.jsonl; done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
