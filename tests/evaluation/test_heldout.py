"""evaluation/heldout.py and the `evaluate` CLI: held-out NLL, perplexity and top-1 weight every
trained token once, against transformers' own token-weighted loss; the CLI's context and count
checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prove_jax.cli import evaluate as evaluate_cli
from prove_jax.evaluation import heldout
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer, save_model
from prove_jax.checkpoints.convert import hf_to_flax
from prove_jax.data.pipeline import TokenizedRows, tokenize_examples
from tests.hf_models import make_hf_qwen2
from tests.tokenizers_fixture import stdlib_text
from tests.train_helpers import write_tokenizer


CONTEXT = 32  # the evaluated model's max_position_embeddings


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A transformers model with a 32-position context, and our checkpoint of it with a tokenizer."""
    d = tmp_path_factory.mktemp("tools_eval")
    hf = make_hf_qwen2(d / "hf", seed=7, vocab_size=320, max_position_embeddings=CONTEXT)
    hf_to_flax(str(d / "hf"), str(d / "ours"))
    ckpt = str(d / "ckpt")
    save_model(ckpt, load_model(str(d / "ours")), tokenizer_dir=write_tokenizer(d, vocab_size=300))
    return hf, ckpt


def _hf_token_mean(hf, ids, trained, valid):
    """transformers' loss and top-1 over the targets whose token is trained and valid: HF shifts
    the labels itself and averages over every target that is not -100, across the whole batch."""
    labels = np.where(trained & valid, ids, -100)
    with torch.no_grad():
        out = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(valid, dtype=torch.long),
                 labels=torch.tensor(labels, dtype=torch.long))
    target = (trained & valid)[:, 1:]
    hits = (out.logits[:, :-1].argmax(-1).numpy() == ids[:, 1:]) & target
    return out.loss.item(), hits.sum() / target.sum(), int(target.sum())


def test_heldout_nll_weights_every_trained_token_once_across_rows_of_different_lengths(evaluated):
    """One mean over all trained tokens, not per row and then over rows (the training loss's
    per-sequence mean); top-1 hits only at trained targets (not a prompt the model predicts,
    not padding)."""
    hf, ckpt = evaluated
    rs = np.random.RandomState(1)
    ids = rs.randint(2, 300, (4, 16)).astype(np.int64)
    # Row 0's 7-token prompt is the model's own greedy text: every untrained target is a top-1 hit.
    with torch.no_grad():
        for p in range(1, 7):
            ids[0, p] = int(hf(torch.tensor(ids[:1, :p])).logits[0, -1].argmax())
    lengths = [16, 5, 11, 2]
    valid = np.arange(16)[None] < np.array(lengths)[:, None]
    trained = valid.copy()
    trained[0, :7] = False
    ids[~valid] = 0
    want_nll, want_top1, want_tokens = _hf_token_mean(hf, ids, trained, valid)
    rows = TokenizedRows(ids.astype(np.int32), trained, valid, 0, 0)
    got = heldout.heldout_metrics(load_model(ckpt, dtype="float32", param_dtype="float32"), rows, batch_size=3)
    assert got["tokens"] == want_tokens == 9 + 4 + 10 + 1 and got["rows"] == 4
    assert got["nll"] == pytest.approx(want_nll, abs=1e-4)
    assert got["perplexity"] == pytest.approx(np.exp(want_nll), rel=1e-3)
    assert got["top1_accuracy"] == pytest.approx(want_top1)


def test_cli_evaluates_at_the_models_full_context_and_agrees_with_transformers(evaluated, tmp_path, capsys):
    """`--max-length` equal to the model's context is allowed; one more is refused."""
    hf, ckpt = evaluated
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", str(CONTEXT),
                          "--max-rows", "3", "--batch-size", "2"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    rows = tokenize_examples([{"text": data.read_text()}], load_tokenizer(ckpt), max_length=CONTEXT, block_size=1)
    ids, trained, valid = (np.asarray(a[:3]) for a in (rows.input_ids, rows.loss_mask, rows.valid))
    want_nll, want_top1, want_tokens = _hf_token_mean(hf, ids.astype(np.int64), trained, valid)
    assert (result["rows"], result["tokens"]) == (3, want_tokens)
    assert result["nll"] == pytest.approx(want_nll, abs=1e-4)
    assert result["top1_accuracy"] == pytest.approx(want_top1)
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", str(CONTEXT + 1)]) == 2
    assert f"--max-length {CONTEXT + 1} is past" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--max-rows", "--max-length"])
def test_cli_refuses_a_zero_count_with_an_error(evaluated, tmp_path, capsys, flag):
    """Each count flag must be >= 1 (a zero --batch-size would be a zero step for `range`)."""
    _, ckpt = evaluated
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", "16", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert "must be >= 1" in err and flag in err
