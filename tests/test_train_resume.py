"""Resumption: a run stopped halfway and resumed equals an uninterrupted run, bit for bit in
float32; a damaged latest checkpoint falls back to the previous one and says so."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from prove_jax import checkpoint
from prove_jax.trainer import train
from tests.train_helpers import tiny_config


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["loss_masked"], r["loss_clean"]) for r in map(json.loads, f)]


def _params(state):
    return jax.tree.map(np.asarray, state["params"])


def _assert_same_params(a, b, atol=1e-6):
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    assert max(diffs) <= atol, max(diffs)


def test_resume_is_exact_and_corrupt_latest_falls_back(tmp_path):
    full = train(tiny_config(tmp_path, "full"), show_bar=False)
    assert full.final_step == 8 and full.start_step == 0

    cfg = tiny_config(tmp_path, "halves")
    first = train(cfg, show_bar=False, stop_after=4)
    assert first.final_step == 4 and first.model_dir is None  # stopped early: no export yet
    second = train(cfg, show_bar=False)
    assert second.start_step == 4 and second.final_step == 8

    # same data order and same numbers: every step's losses, then the final weights
    a, b = _losses(full.run_dir), _losses(second.run_dir)
    assert [s for s, *_ in a] == list(range(1, 9)) == [s for s, *_ in b]
    np.testing.assert_allclose(np.array(b)[:, 1:], np.array(a)[:, 1:], rtol=1e-6, atol=0)
    _assert_same_params(_params(second.state), _params(full.state))

    # the exported model is a loadable prove_jax checkpoint that records the mask token
    model = checkpoint.load_model(second.model_dir)
    assert model.cfg.mask_token_id is not None
    tok = checkpoint.load_tokenizer(second.model_dir)
    assert tok.convert_tokens_to_ids("<|mask|>") == model.cfg.mask_token_id
    _assert_same_params(checkpoint.params_pure_dict(model), _params(full.state))

    # damage the newest checkpoint (step 8): its array data disappears
    step8 = os.path.join(second.run_dir, "checkpoints", "8", "state")
    for root, _, files in os.walk(step8):
        for name in files:
            if not name.startswith("_"):
                os.remove(os.path.join(root, name))
    messages = []
    third = train(cfg, show_bar=False, log=messages.append)
    text = "\n".join(messages)
    assert "checkpoint step 8" in text and "falling back to step 4" in text, text
    assert third.start_step == 4 and third.final_step == 8
    assert os.path.isdir(os.path.join(second.run_dir, "corrupt", "8"))
    _assert_same_params(_params(third.state), _params(full.state))
    # metrics.jsonl was rewound to the restored step, so it holds each step once
    assert [s for s, *_ in _losses(third.run_dir)] == list(range(1, 9))
