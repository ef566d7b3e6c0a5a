"""The proposer's data and quality tools on several hosts: `prove-jax distill` and
`prove-jax evaluate` run as two processes on loopback, 4 simulated CPU devices each, one mesh
over all 8 (as on a pod slice, the same command on every host). Their results must equal one
process's; only process 0 writes and prints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prove_jax.evaluation import heldout
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer, save_model
from prove_jax.models.config import ModelConfig
from prove_jax.data.pipeline import TokenizedRows, tokenize_examples
from prove_jax.decoding import DecodeOptions, Decoder
from prove_jax.models.params import create_model
from tests.multihost import CommandsJob
from tests.tokenizers_fixture import stdlib_text
from tests.train_helpers import write_tokenizer

pytestmark = pytest.mark.slow

CFG = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, eos_token_ids=(0,), pad_token_id=0)


def test_distill_and_evaluate_on_two_hosts_equal_one_process(tmp_path):
    """Both commands in one two-process job (tests/multihost.CommandsJob: one launch, distill
    joins and evaluate runs after it on the same hosts); the references are computed here
    while it runs."""
    model = create_model(CFG, seed=5)
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, model, tokenizer_dir=write_tokenizer(tmp_path))
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, 300, n).tolist() for n in (4, 9, 2, 7, 5)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "distill.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    logs = tmp_path / "job"
    logs.mkdir()
    job = CommandsJob([
        ["prove_jax.cli.distill", "--model", ckpt, "--prompts", str(inp), "--out", str(out),
         "--mesh", "4,1,2", "--batch-size", "4", "--max-new-tokens", "16"],
        ["prove_jax.cli.evaluate", "--model", ckpt, "--data", str(data), "--max-length", "32",
         "--max-rows", "6", "--batch-size", "4", "--mesh", "2,2,2"]], logs)
    try:
        ar = Decoder(model, [0], DecodeOptions("ar")).generate(prompts, 16).output_ids
        rows = tokenize_examples([{"text": data.read_text()}], load_tokenizer(ckpt), max_length=32, block_size=1)
        rows = TokenizedRows(rows.input_ids[:6], rows.loss_mask[:6], rows.valid[:6], 0, 0)
        here = heldout.heldout_metrics(load_model(ckpt, dtype="float32", param_dtype="float32"), rows)
        distill, evaluate = job.results()
    finally:
        job.stop()

    records = {r["id"]: r["response_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert records == {f"r{i}": o for i, o in enumerate(ar)}
    assert "wrote" in distill[0].stderr and distill[1].stderr.strip() == "", distill[1].stderr[-500:]

    # (CPU collectives: Gloo prints its connections to stdout first)
    [result] = json.loads(evaluate[0].stdout.splitlines()[-1])
    assert result["nll"] == pytest.approx(here["nll"], rel=1e-5) and result["tokens"] == here["tokens"]
    assert "nll" not in evaluate[1].stdout and "perplexity" not in evaluate[1].stderr
