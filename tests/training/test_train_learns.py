"""A tiny model trained from scratch on real Python source (CPython stdlib) with the MARS
objective, through the train CLI, learns (here: mostly memorises json/__init__.py, ~10k
tokens): the loss falls well below its start, and the masked stream's top-1 accuracy two
tokens ahead (block offset 0) beats always guessing the most frequent token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prove_jax.data import pipeline as data_lib
from prove_jax.training.config import load_config
from prove_jax.training.run_tokenizer import resolve_tokenizer
from tests.train_helpers import write_config, write_text

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 240


def test_tiny_mars_model_learns_stdlib_source(tmp_path):
    text = write_text(tmp_path, modules=("json",), name="src.py")
    config = write_config(
        tmp_path, "learn", data=text, steps=STEPS, log_every=10, save_every=STEPS,
        max_length=64, global_batch_size=16, block_size=4,
        model={"config": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0)},
        optimizer={"lr": 3e-3, "warmup_ratio": 0.05, "min_lr_ratio": 0.1})
    # This test runs 240 steps, so unlike the rest of the suite (see conftest) it is bound by
    # run time, not compile time: the training process gets fully optimised kernels.
    env = os.environ | {"PYTHONPATH": ROOT, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    r = subprocess.run([sys.executable, "-m", "train.train", "--config", config, "--no-progress"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"step {STEPS}: loss" in r.stdout

    cfg = load_config(config)
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    first, last = recs[0], recs[-3:]
    assert first["step"] == 1 and last[-1]["step"] == STEPS
    final_loss = np.mean([r["loss"] for r in last])
    assert final_loss < 0.6 * first["loss"], (first["loss"], final_loss)
    for key in ("loss_masked", "loss_clean"):
        assert np.mean([r[key] for r in last]) < 0.7 * first[key], key

    # baseline: how often the single most frequent trained token is the answer
    tokenizer, _ = resolve_tokenizer(cfg)
    rows = data_lib.tokenize_examples(data_lib.load_examples(text), tokenizer, max_length=64,
                                      block_size=4)
    targets = rows.input_ids[:, 1:][(rows.loss_mask & rows.valid)[:, 1:]]
    majority = np.bincount(targets).max() / targets.size
    acc_distance_2 = np.mean([r["masked_acc_by_pos"][0] for r in last])
    assert acc_distance_2 > majority + 0.1, (acc_distance_2, majority)
    assert acc_distance_2 > first["masked_acc_by_pos"][0] + 0.1
