"""The learned commit head: labels, plumbing into verify mode, training from the train CLI."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.cli import generate
from prove_jax.cli import train as train_cli
from prove_jax.checkpoints.checkpoint import CheckpointError, save_model
from prove_jax.models.commit_head import CommitHead
from prove_jax.training.commit_head_training import (head_examples, head_loss, propose_and_label,
                                                     sample_contexts, train_commit_head,
                                                     verifier_inputs)
from prove_jax.checkpoints.commit_head_io import load_commit_head, save_commit_head
from prove_jax.models.config import ModelConfig
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, ThresholdRule, VerifyRule
from prove_jax.models.params import create_model
from prove_jax.training.config import load_config
from tests.tokenizers_fixture import make_tokenizer, stdlib_text
from tests.vocab_helpers import with_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mask_token_id=299, eos_token_ids=(0,), pad_token_id=0)


@pytest.fixture(scope="module")
def proposer():
    return create_model(CFG, seed=11)


@pytest.fixture(scope="module")
def verifier():
    return create_model(CFG.replace(hidden_size=16, num_heads=2, num_kv_heads=1), seed=12)


def _prompts():
    rs = np.random.RandomState(4)
    return [rs.randint(5, 290, n).tolist() for n in (6, 6, 6)]


def _save_pair(tmp_path, proposer, verifier) -> None:
    """tmp_path/p and /v: the pair saved with one 300-token tokenizer (/tok); /data.txt: text."""
    make_tokenizer(300).save_pretrained(str(tmp_path / "tok"))
    save_model(str(tmp_path / "p"), proposer, tokenizer_dir=str(tmp_path / "tok"))
    save_model(str(tmp_path / "v"), verifier, tokenizer_dir=str(tmp_path / "tok"))
    (tmp_path / "data.txt").write_text(stdlib_text(("textwrap",)))


def test_labels_match_greedy_ar(proposer):
    k = 5
    prompts = _prompts()
    block, labels = propose_and_label(proposer, jnp.asarray(prompts), k, CFG.mask_token_id)
    ar = Decoder(proposer, [-1], DecodeOptions("ar")).generate(prompts, k).output_ids
    for row, (d, lab) in enumerate(zip(np.asarray(block), np.asarray(labels))):
        assert d[0] == ar[row][0]  # D_0 is exact greedy AR
        want = np.cumprod([d[i + 1] == ar[row][i + 1] for i in range(k - 1)])
        assert (lab == want).all()


def test_head_rule_drives_commit_length(proposer, verifier):
    head = CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(0))
    ar = Decoder(proposer, [-1], DecodeOptions("ar")).generate(_prompts(), 12)

    def run(threshold):
        options = DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="head", head_threshold=threshold))
        return Decoder(proposer, [-1], options, verifier=verifier, commit_head=head).generate(_prompts(), 12)
    never = run(1.1)  # only the exact first token of each block: greedy AR, one per forward
    assert never.output_ids == ar.output_ids and (never.forwards == 12).all()
    always = run(0.0)  # every proposed token: the whole block, like threshold mode with tau 0
    blocks = Decoder(proposer, [-1], DecodeOptions("threshold", 4, threshold=ThresholdRule(tau=0.0))).generate(_prompts(), 12)
    assert always.output_ids == blocks.output_ids and (always.forwards == 3).all()
    head.threshold = 1.1  # the default is the head's own threshold
    assert run(None).output_ids == ar.output_ids


def test_save_load_roundtrip_and_missing_head(tmp_path, verifier):
    head = CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(3))
    save_model(str(tmp_path / "v"), verifier)
    save_commit_head(str(tmp_path / "v"), head)
    again = load_commit_head(str(tmp_path / "v"))
    h = jnp.ones((2, 3, verifier.cfg.hidden_size))
    logits = jnp.zeros((2, 3, CFG.vocab_size))
    nxt = jnp.zeros((2, 3), jnp.int32)
    np.testing.assert_allclose(np.asarray(head(h, logits, nxt)), np.asarray(again(h, logits, nxt)))
    save_model(str(tmp_path / "plain"), verifier)
    with pytest.raises(CheckpointError, match="no trained commit head"):
        load_commit_head(str(tmp_path / "plain"))
    head_config = tmp_path / "v" / "commit_head" / "config.json"
    assert head_config.is_file()
    head_config.write_text('{"hidden_size": 16, "width": 64')  # cut short
    with pytest.raises(CheckpointError, match="bad commit head config"):
        load_commit_head(str(tmp_path / "v"))
    head_config.write_text('{"width": 64, "threshold": 0.5}')
    with pytest.raises(CheckpointError, match="missing key 'hidden_size'"):
        load_commit_head(str(tmp_path / "v"))


def test_head_for_another_verifier_is_refused(proposer, verifier):
    wrong = CommitHead(verifier.cfg.hidden_size * 2, rngs=nnx.Rngs(0))
    with pytest.raises(DecodeError, match="hidden states of width 32 but the verifier's hidden size is 16"):
        Decoder(proposer, [-1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="head")), verifier=verifier,
                commit_head=wrong)
    right = CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(0))
    Decoder(proposer, [-1], DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="head")), verifier=verifier,
            commit_head=right)  # the same call with a matching head is accepted


@pytest.mark.slow
def test_train_cli_commit_head_objective(tmp_path, capsys, proposer, verifier):
    _save_pair(tmp_path, proposer, verifier)
    # the train CLI in this process (no interpreter and JAX start-up of its own)
    tiny = os.path.join(ROOT, "configs", "tiny.yaml")
    assert train_cli.main(
        ["--config", tiny, "objective=commit_head",
         f"proposer={tmp_path / 'p'}", f"model.checkpoint={tmp_path / 'v'}", f"data={tmp_path / 'data.txt'}",
         "steps=4", "log_every=2", "max_length=32", "block_size=4", "global_batch_size=8",
         f"run_dir={tmp_path / 'run'}", f"tokenizer.path={tmp_path / 'tok'}", "--no-progress"]) == 0, \
        capsys.readouterr().err[-2000:]
    head = load_commit_head(str(tmp_path / "run" / "model"))
    assert head.hidden_size == verifier.cfg.hidden_size
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"loss"') == 2

    # decode with it from the CLI: a threshold above 1 commits only exact greedy tokens
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(_prompts())))
    common = ["--model", str(tmp_path / "p"), "--verifier", str(tmp_path / "run" / "model"), "--mode", "verify",
              "--commit-rule", "head", "--block-size", "4", "--input", str(inp), "--max-new-tokens", "8"]
    assert generate.main(common + ["--head-threshold", "1.5", "--output", str(out)]) == 0
    ar = Decoder(proposer, [0], DecodeOptions("ar")).generate(_prompts(), 8).output_ids
    assert [json.loads(line)["output_ids"] for line in out.read_text().splitlines()] == ar
    assert generate.main(common + ["--head-threshold", "nan", "--output", str(tmp_path / "bad.jsonl")]) == 2
    assert "--head-threshold must be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()
    assert train_cli.main(["--config", tiny, "objective=commit_head", f"model.checkpoint={tmp_path / 'v'}",
                           f"data={tmp_path / 'data.txt'}", "steps=2"]) == 2
    assert "needs proposer=PATH" in capsys.readouterr().err


def test_left_padded_contexts_propose_and_judge_like_unpadded_ones(proposer, verifier):
    """Training contexts of different lengths are right-aligned in one array: the padding
    changes neither the proposed block, its labels, nor the verifier's view of it."""
    k, short = 4, jnp.asarray(_prompts())[:, :4]
    padded = jnp.concatenate([jnp.full((3, 3), 7, short.dtype), short], axis=1)
    valid = jnp.arange(7)[None].repeat(3, 0) >= 3

    @nnx.jit
    def both(proposer, verifier, context, context_valid):
        block, labels = propose_and_label(proposer, context, k, CFG.mask_token_id, context_valid)
        return block, labels, verifier_inputs(verifier, context, block, context_valid)[0]

    block, labels, h = both(proposer, verifier, short, jnp.ones(short.shape, bool))
    block_p, labels_p, h_p = both(proposer, verifier, padded, valid)
    assert (np.asarray(block_p) == np.asarray(block)).all()
    assert (np.asarray(labels_p) == np.asarray(labels)).all()
    np.testing.assert_allclose(np.asarray(h_p), np.asarray(h), atol=1e-5)
    # a context ends at a trained (response) position, never in the right padding
    ids = jnp.arange(20).reshape(2, 10)
    trained = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 0, 0], [0] * 10], bool)
    context, context_valid, used = sample_contexts(ids, trained, jnp.arange(10)[None] < 8, 6,
                                                   jax.random.key(0))
    assert used.tolist() == [True, False]
    n = int(context_valid[0].sum())
    assert 3 <= n <= 6 and context[0, 6 - n:].tolist() == list(range(n))


def test_commit_head_trains_on_prompt_response_data(tmp_path, proposer, verifier):
    """SFT rows are right-padded: the head used to weight only rows without padding, so it got
    loss 0 and learnt nothing; and warmup_ratio=1 (or steps=1) was an optax traceback."""
    _save_pair(tmp_path, proposer, verifier)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": f" return x + {i}"}) + "\n"
                            for i in range(8)))
    common = [f"proposer={tmp_path / 'p'}", f"model.checkpoint={tmp_path / 'v'}", f"data={data}",
              "objective=commit_head", "max_length=32", "block_size=4", "global_batch_size=8",
              "log_every=1", f"run_dir={tmp_path / 'run'}", "tokenizer.bpe_vocab_size=null",
              f"tokenizer.path={tmp_path / 'tok'}"]
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      common + ["steps=2", "optimizer.warmup_ratio=1.0", "optimizer.lr=1e-2"])
    metrics = tmp_path / "run" / "metrics.jsonl"  # an earlier run's: a rerun appended to it
    metrics.parent.mkdir()
    metrics.write_text(json.dumps({"step": 7, "loss": 9.0}) + "\n")
    result = train_commit_head(cfg, show_bar=False)
    losses = [r["loss"] for r in result["records"]]
    assert len(losses) == 2 and all(loss > 0.01 for loss in losses), losses
    logged = metrics.read_text()
    assert [json.loads(line)["step"] for line in logged.splitlines()] == [1, 2]
    initial = CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(cfg.seed))
    trained = load_commit_head(result["model_dir"])
    assert not np.allclose(np.asarray(trained.out_proj.kernel[...]), np.asarray(initial.out_proj.kernel[...]))
    # prompts longer than max_length - block_size leave no context: one clear error
    data.write_text(json.dumps({"prompt_ids": list(range(5, 35)), "response_ids": [40, 41]}) + "\n")
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      common + ["steps=1"])
    with pytest.raises(ValueError, match="no row of the batch has a trained .* within its first "
                                         "max_length - block_size = 28 tokens"):
        train_commit_head(cfg, show_bar=False)
    assert metrics.read_text() == logged  # a rerun that failed before its first record
    # a one-token block has nothing to judge (it trained nothing, loss 0, and exported the
    # untrained head); max_length = block_size leaves no context (an XLA reshape traceback)
    for shape, expect in ((["max_length=32", "block_size=1"], "needs block_size >= 2"),
                          (["max_length=4", "block_size=4"], "needs max_length > block_size")):
        with pytest.raises(ValueError, match=expect):  # refused by the config check
            train_commit_head(load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                                          common + ["steps=1"] + shape + [f"run_dir={tmp_path / 'bad'}"]),
                              show_bar=False)
        assert not (tmp_path / "bad").exists()


def test_pairs_sharing_a_tokenizer_may_differ_in_padded_rows_other_vocabularies_are_refused(
        tmp_path, capsys, proposer, verifier):
    """The paper's pair (Qwen2.5-32B: 152,064 rows, -3B: 151,936, one tokenizer) must train a
    head and decode; a verifier without a row for every token, or with its own tokenizer,
    must not: both CLIs say which, before any weight is read, and write nothing."""
    wide = create_model(verifier.cfg.replace(vocab_size=320), seed=12)  # more rows than the proposer
    _save_pair(tmp_path, proposer, wide)
    save_model(str(tmp_path / "narrow"), create_model(verifier.cfg.replace(vocab_size=256, mask_token_id=None), seed=12),
               tokenizer_dir=str(tmp_path / "tok"))
    make_tokenizer(300, modules=("textwrap",)).save_pretrained(str(tmp_path / "other_tok"))
    save_model(str(tmp_path / "other"), wide, tokenizer_dir=str(tmp_path / "other_tok"))

    def head_config(verifier_dir, run):
        return load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [
            "objective=commit_head", f"proposer={tmp_path / 'p'}", f"model.checkpoint={verifier_dir}",
            f"data={tmp_path / 'data.txt'}", "steps=1", "max_length=32", "block_size=4",
            "global_batch_size=8", f"run_dir={tmp_path / run}", "tokenizer.bpe_vocab_size=null"])

    result = train_commit_head(head_config(tmp_path / "v", "run"), show_bar=False)
    assert np.isfinite(result["records"][-1]["loss"])
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt_ids": p}) + "\n" for i, p in enumerate(_prompts())))
    common = ["--model", str(tmp_path / "p"), "--mode", "verify", "--block-size", "4", "--input", str(inp),
              "--max-new-tokens", "8"]
    out = tmp_path / "out.jsonl"
    assert generate.main(common + ["--verifier", result["model_dir"], "--commit-rule", "head",
                                   "--output", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3

    narrow, other = tmp_path / "narrow", tmp_path / "other"
    for verifier_dir, decode_error, train_error in [
        (narrow, f"the verifier {narrow} has 256 embedding rows, but the tokenizer in {tmp_path / 'p'} "
                 f"has ids up to 299: the verifier was trained on another vocabulary",
         f"the verifier {narrow} has 256 embedding rows, but the tokenizer in {narrow} has ids up to 299"),
        (other, f"the verifier's tokenizer ({other}) is not the one in {tmp_path / 'p'}: ",
         f"the proposer's tokenizer ({tmp_path / 'p'}) is not the one in {other}: ")]:
        bad = tmp_path / "bad.jsonl"
        assert generate.main(common + ["--verifier", str(verifier_dir), "--output", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"error: {decode_error}" in err and not bad.exists()
        with pytest.raises(ValueError, match=re.escape(train_error)):
            train_commit_head(head_config(verifier_dir, "run_bad"), show_bar=False)
        assert not (tmp_path / "run_bad").exists()


def test_head_examples_read_a_draft_past_the_verifier_rows_as_decoding_does(proposer, verifier):
    """A proposer with more rows than the verifier drafts ids the verifier cannot read: they must
    reach it as 0 (not NaN, which poisoned every later position) and never be a commit target."""
    eager = with_rows(proposer, 320, copy_of=77, scale=2.0)
    ids = jnp.asarray(np.random.RandomState(0).randint(5, 290, (8, 32)))
    trained = jnp.ones(ids.shape, bool)

    key = jax.random.key(0)

    @nnx.jit
    def examples(proposer, verifier):
        ctx, ctx_valid, _ = sample_contexts(ids, trained, trained, 28, key)
        block, _ = propose_and_label(proposer, ctx, 4, CFG.mask_token_id, ctx_valid)
        return block, head_examples(proposer, verifier, ids, trained, trained, key, context_len=28,
                                    block_size=4, mask_id=CFG.mask_token_id)

    block, ex = examples(eager, verifier)
    past = np.asarray(block[:, 1:]) >= 300  # drafts the verifier has no row for
    assert past.any()
    assert np.isfinite(np.asarray(ex.hidden)).all() and np.isfinite(np.asarray(ex.verifier_logits)).all()
    assert (np.asarray(ex.next_tokens) < 300).all()
    assert (np.asarray(ex.labels)[np.cumsum(past, axis=1) > 0] == 0).all()
    head = CommitHead(verifier.cfg.hidden_size, rngs=nnx.Rngs(0))
    assert np.isfinite(float(head_loss(head, ex)[0]))


def test_a_commit_head_step_that_cannot_fit_is_refused_before_any_weight_is_read(
        tmp_path, capsys, monkeypatch, proposer, verifier):
    """A 32B proposer takes minutes to read: the step is compiled and its memory (both frozen
    models, their forwards, the head) checked from the configs first."""
    from prove_jax import memory
    from prove_jax.checkpoints import checkpoint
    _save_pair(tmp_path, proposer, verifier)
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 1024)

    def no_reading(*args, **kwargs):
        raise AssertionError("weights read before the memory check")
    monkeypatch.setattr(checkpoint, "load_model", no_reading)
    from train.train import main
    assert main(["--config", os.path.join(ROOT, "configs", "tiny.yaml"), "objective=commit_head",
                 f"proposer={tmp_path / 'p'}", f"model.checkpoint={tmp_path / 'v'}",
                 f"data={tmp_path / 'data.txt'}", "max_length=32", "block_size=4", "global_batch_size=8",
                 f"run_dir={tmp_path / 'run'}", "tokenizer.bpe_vocab_size=null", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "compiled the commit-head step" in err
    assert re.search(r"error: a commit-head step of 8 x 32 tokens \(the frozen proposer and verifier in "
                     r"float32, their forwards, the head\) needs \d+\.\d\d GiB, but the host has 0\.00 GiB "
                     r"free: lower global_batch_size or max_length, or use more devices", err), err
    assert not (tmp_path / "run").exists()
