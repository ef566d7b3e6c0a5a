"""Held-out evaluation (`prove-jax evaluate`): oracle is transformers' own loss."""

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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    hf = make_hf_qwen2(d / "hf", seed=2, vocab_size=320)
    hf_to_flax(str(d / "hf"), str(d / "ours"))
    with_tok = str(d / "with_tokenizer")
    save_model(with_tok, load_model(str(d / "ours")), tokenizer_dir=write_tokenizer(d, vocab_size=300))
    return hf, str(d / "ours"), with_tok


def test_nll_and_accuracy_match_transformers(pair):
    hf, ours, _ = pair
    ids = np.random.RandomState(0).randint(2, 300, (3, 24)).astype(np.int32)
    ones = np.ones_like(ids, bool)
    m = heldout.heldout_metrics(load_model(ours, dtype="float32", param_dtype="float32"),
                                 TokenizedRows(ids, ones, ones, 0, 0), batch_size=2)  # padded tail batch
    with torch.no_grad():
        out = hf(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids, dtype=torch.long))
    assert m["nll"] == pytest.approx(out.loss.item(), abs=1e-4)
    top1 = (out.logits[:, :-1].argmax(-1).numpy() == ids[:, 1:]).mean()
    assert m["top1_accuracy"] == pytest.approx(top1)
    assert m["perplexity"] == pytest.approx(np.exp(out.loss.item()), rel=1e-3)
    assert (m["tokens"], m["rows"]) == (3 * 23, 3)


def test_cli_reports_each_model_and_fails_cleanly(pair, tmp_path, capsys):
    _, no_tok, ckpt = pair
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", "32", "--max-rows", "5",
                          "--batch-size", "2"]) == 0
    out = capsys.readouterr()
    [result] = json.loads(out.out)
    rows = tokenize_examples([{"text": data.read_text()}], load_tokenizer(ckpt), max_length=32, block_size=1)
    rows = TokenizedRows(rows.input_ids[:5], rows.loss_mask[:5], rows.valid[:5], 0, 0)
    expected = heldout.heldout_metrics(load_model(ckpt, dtype="float32", param_dtype="float32"), rows)
    assert result["nll"] == pytest.approx(expected["nll"], rel=1e-5) and result["rows"] == 5
    assert "perplexity" in out.err
    # sharded: rows over data x fsdp = 4 (the batch of 2 rounded up to 4), the model over tensor
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", "32", "--max-rows", "5",
                          "--batch-size", "2", "--mesh", "2,2,2"]) == 0
    [sharded] = json.loads(capsys.readouterr().out)
    assert sharded["nll"] == pytest.approx(expected["nll"], rel=1e-5)
    assert (sharded["top1_accuracy"], sharded["tokens"]) == (expected["top1_accuracy"], expected["tokens"])
    long_prompts = tmp_path / "long_prompts.jsonl"
    long_prompts.write_text(json.dumps({"prompt": data.read_text()[:400], "response": "x = 1"}) + "\n")
    for args, expect in [(["--model", str(tmp_path / "nope"), "--data", str(data)], "nope"),
                         (["--model", ckpt, "--data", str(tmp_path / "missing.txt")], "data path not found"),
                         (["--model", no_tok, "--data", str(data)], "has no tokenizer"),
                         (["--model", ckpt, "--data", str(data), "--max-length", "1"], "no tokens to evaluate"),
                         # the message said "every row is shorter than two tokens" here too
                         (["--model", ckpt, "--data", str(long_prompts), "--max-length", "8"],
                          "prompts that fill --max-length"),
                         (["--model", ckpt, "--data", str(data), "--max-length", "100000"],
                          "--max-length 100000 is past"),
                         (["--model", ckpt, "--data", str(data), "--mesh", "16,1,1"], "needs 16 devices")]:
        assert evaluate_cli.main(args) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err, err
