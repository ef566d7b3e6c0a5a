"""Reproduce the shipped demo pair from scratch with the project's own CLIs.

    python scripts/build_demo_models.py                # full recipe (see docs/demo_models.md for run time)
    python scripts/build_demo_models.py --quick --work /tmp/w --out /tmp/demo   # smoke test

Steps: CPython stdlib corpus (held-out split) -> byte-level BPE tokenizer -> proposer AR stage
-> proposer MARS stage (block 8) -> self-distillation rounds: the proposer's own greedy
continuations of train-split function prompts plus real text (`prove-jax distill`),
then a MARS stage on them -> smaller AR verifier -> its commit head (labels from the final proposer) ->
bfloat16 copies in prove_jax/demo_models/{proposer,verifier}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from prove_jax import assets  # noqa: E402

# (steps, extra overrides) per stage; --quick shrinks everything to seconds.
FULL = {"proposer_ar": 600, "proposer_mars": 1200, "proposer_distill": 400, "verifier": 600,
        "commit_head": 200}
QUICK = {"proposer_ar": 6, "proposer_mars": 6, "proposer_distill": 6, "verifier": 6, "commit_head": 6}
# self-distillation rounds (each: distill the current proposer, then 400 MARS steps on it)
DISTILL_ROUNDS = 4
# self-distillation data: prompts sampled from the train split, prompt/new-token caps (rows fit 192)
# plus real train-split text, which keeps the AR stream from sharpening onto its own outputs
DISTILL = {"num_prompts": 3072, "max_prompt_tokens": 96, "max_new_tokens": 96, "batch_size": 64,
           "mix_corpus_chars": 2_000_000}
QUICK_DISTILL = {"num_prompts": 8, "max_prompt_tokens": 16, "max_new_tokens": 8, "batch_size": 8,
                 "mix_corpus_chars": 20_000}
QUICK_OVERRIDES = ["max_length=32", "global_batch_size=4", "log_every=2", "save_every=1000"]


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT, env=os.environ | {"PYTHONPATH": ROOT})
    print(f"  ({time.time() - t0:.0f}s)", flush=True)


def train(config: str, run_dir: str, steps: int, *overrides: str, quick: bool) -> str:
    extra = QUICK_OVERRIDES if quick else []
    run([sys.executable, "-m", "prove_jax", "train", "--config", config, f"run_dir={run_dir}",
         f"steps={steps}", *overrides, *extra])
    return os.path.join(run_dir, "model")


def export_bf16(src: str, dst: str) -> None:
    """Shipped copies are stored in bfloat16 (half the bytes); loaders upcast for CPU."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from prove_jax.checkpoints.checkpoint import load_model, save_model
    model = load_model(src)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, state)
    cfg = model.cfg.replace(param_dtype="bfloat16")
    model = nnx.merge(graphdef, state)
    model.cfg = cfg
    save_model(dst, model, cfg, tokenizer_dir=src)
    if os.path.isdir(os.path.join(src, "commit_head")):
        import shutil
        shutil.copytree(os.path.join(src, "commit_head"), os.path.join(dst, "commit_head"))
    print(f"exported {dst}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="runs/demo", help="scratch dir for corpus, tokenizer and runs")
    ap.add_argument("--out", default=assets.DEMO_DIR, help="where the shipped pair is written")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke test")
    args = ap.parse_args(argv)
    steps = QUICK if args.quick else FULL
    w = os.path.abspath(args.work)
    t0 = time.time()
    corpus_args = ["--max-bytes", "1500000"] if args.quick else []
    run([sys.executable, "-m", "prove_jax", "corpus", "--out", f"{w}/corpus", *corpus_args])
    run([sys.executable, "scripts/train_tokenizer.py", "--corpus", f"{w}/corpus", "--out",
         f"{w}/tokenizer", "--vocab-size", "4096"])
    common = [f"tokenizer.path={w}/tokenizer", f"data={w}/corpus/train.jsonl"]
    base = train("configs/demo_proposer.yaml", f"{w}/proposer_ar", steps["proposer_ar"],
                 "objective=ar", *common, quick=args.quick)
    proposer = train("configs/demo_proposer.yaml", f"{w}/proposer_mars", steps["proposer_mars"],
                     "objective=mars", "model.config=null", f"model.checkpoint={base}",
                     "optimizer.lr=1e-3", *[c for c in common if not c.startswith("model.")],
                     quick=args.quick)
    d = QUICK_DISTILL if args.quick else DISTILL
    # Stage 3, in rounds: MARS again on the current proposer's own greedy text (fresh prompts each
    # round): lossless accepts a draft only when it equals that greedy token, and greedy text is
    # far easier to predict several tokens ahead.
    for r in range(1 if args.quick else DISTILL_ROUNDS):
        data = f"{w}/distill_{r}.jsonl"
        run([sys.executable, "-m", "prove_jax", "distill", "--model", proposer, "--corpus", f"{w}/corpus",
             "--out", data, f"--seed={r}", *[f"--{k.replace('_', '-')}={v}" for k, v in d.items()]])
        proposer = train("configs/demo_proposer.yaml", f"{w}/proposer_distill_{r}", steps["proposer_distill"],
                         "objective=mars", "model.config=null", f"model.checkpoint={proposer}",
                         "tokenizer.path=null", f"data={data}", "max_length=192",
                         "global_batch_size=8", "optimizer.lr=5e-4", quick=args.quick)
    verifier = train("configs/demo_verifier.yaml", f"{w}/verifier", steps["verifier"],
                     "objective=ar", *common, quick=args.quick)
    # The commit head learns what it sees: on real text alone the proposer's drafts rarely match
    # its greedy (1.3 of 8) and the head learns to reject (1.0 tokens per forward at decode
    # time); on greedy text alone they nearly always do and it accepts everything (31% AR
    # agreement). Decoding commits proposer text to real prompts, between the two: the last
    # round's mix of greedy continuations and real text, rows of 128 so that greedy rows count.
    verifier = train("configs/demo_verifier.yaml", f"{w}/verifier_head", steps["commit_head"],
                     "objective=commit_head", f"proposer={proposer}", "model.config=null",
                     f"model.checkpoint={verifier}", "optimizer.lr=1e-3", f"tokenizer.path={w}/tokenizer",
                     f"data={data}", "max_length=128", quick=args.quick)
    export_bf16(proposer, os.path.join(args.out, "proposer"))
    export_bf16(verifier, os.path.join(args.out, "verifier"))
    print(f"done in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
