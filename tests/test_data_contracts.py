"""Data and objective contracts the rest of the suite let through: each test was written against
a plausible bug (a mutant of the code) that every other test passed, and fails on it. The
oracles are written out by hand from the documented contracts: docs/method.md section 2 (position p
predicts token p + 1; a target is trained when it is a response/text token and real; EOS pads
to a block multiple, then the row is right-padded), data/pipeline.py's docstrings (truncation
and drop counts, the stats, a finite run ending on the same step on every host, what a folder of data
holds), the tokenizer's Qwen2 pipeline (NFC, by `unicodedata`) and its verification, and the
mask token's row (inside the vocabulary, a multiple of 64). Most mutants hid behind the test
fixtures: a tokenizer whose pad token is its EOS, batches whose loss_mask never leaves `valid`,
a dataset that fills its global batches exactly, a random model that never guesses right."""

from __future__ import annotations

import json
import shutil
import unicodedata

import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax.data import corpus
from prove_jax.data.pipeline import DataError, load_examples, make_dataset, tokenize_examples
from prove_jax.training.objectives import mars_loss
from tests.tokenizers_fixture import IM_END, make_tokenizer, stdlib_text

# ---- the MARS loss, on logits chosen by hand -------------------------------------------------

VOCAB, MASK_ID = 16, 15


def _fixed_logits_model(logits):
    """A stand-in for the model: returns the given [B, 2L, V] logits, whatever the inputs."""
    logits = jnp.asarray(logits, jnp.float32)

    def model(tokens, positions, attn_mask):
        assert tokens.shape == positions.shape == logits.shape[:2]
        assert attn_mask.shape == (logits.shape[0], logits.shape[1], logits.shape[1])
        return logits, None
    return model


def _hand_targets(ids, loss_mask, valid):
    """docs/method.md section 2: stream position p predicts ids[p + 1], trained iff that token is a
    loss_mask token and real (not right padding); the last position predicts nothing."""
    rows, length = ids.shape
    labels = np.zeros((rows, length), np.int64)
    trained = np.zeros((rows, length), bool)
    for r in range(rows):
        for p in range(length - 1):
            labels[r, p] = ids[r, p + 1]
            trained[r, p] = bool(loss_mask[r, p + 1]) and bool(valid[r, p + 1])
    return labels, trained


def _hand_stream_loss(logits, labels, trained):
    """Mean NLL over each row's trained targets, then over the rows that have any (float64)."""
    per_row = []
    for r in range(labels.shape[0]):
        nll = []
        for p in np.flatnonzero(trained[r]):
            row = logits[r, p].astype(np.float64)
            log_z = row.max() + np.log(np.exp(row - row.max()).sum())
            nll.append(log_z - row[labels[r, p]])
        if nll:
            per_row.append(np.mean(nll))
    return float(np.mean(per_row))


def test_a_loss_mask_token_in_the_padding_is_not_a_trained_target():
    """The objective's contract is loss_mask AND valid: a batch whose loss_mask runs on into the
    right padding (all ones, say) must not train on the padding tokens."""
    length, block = 8, 4
    rng = np.random.default_rng(0)
    ids = rng.integers(1, MASK_ID, size=(2, length))
    loss_mask = np.ones((2, length), bool)
    loss_mask[1, :3] = False                       # row 1: a 3-token prompt, no padding
    valid = np.ones((2, length), bool)
    valid[0, 5:] = False                           # row 0: 5 real tokens, then padding
    ids[~valid] = 0
    logits = rng.normal(size=(2, 2 * length, VOCAB)) * 3.0
    batch = dict(input_ids=jnp.asarray(ids, jnp.int32), loss_mask=jnp.asarray(loss_mask),
                 valid=jnp.asarray(valid))
    _, m = mars_loss(_fixed_logits_model(logits), batch, block_size=block, mask_token_id=MASK_ID,
                     ar_weight=1.0)

    labels, trained = _hand_targets(ids, loss_mask, valid)
    assert trained[0].sum() == 4 and trained[1].sum() == 5   # row 0: targets 1..4 only
    np.testing.assert_allclose(float(m["loss_clean"]), _hand_stream_loss(logits[:, :length], labels, trained),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m["loss_masked"]), _hand_stream_loss(logits[:, length:], labels, trained),
                               rtol=1e-5)
    assert float(m["tokens"]) == trained.sum() == 9


def test_masked_accuracy_by_offset_counts_only_trained_targets():
    """masked_acc_by_pos[j] = hits / trained targets at in-block offset j of the masked stream.
    The logits put the argmax on the label at every untrained position (prompt, padding, the
    last position) and on a chosen pattern of trained ones, so a hit that is not a trained
    target shows up in the metric."""
    length, block = 12, 4
    rng = np.random.default_rng(1)
    ids = rng.integers(1, MASK_ID, size=(2, length))
    loss_mask = np.zeros((2, length), bool)
    valid = np.ones((2, length), bool)
    loss_mask[0, 2:9], valid[0, 9:] = True, False   # prompt 2, response 7, padding 3
    loss_mask[1, :] = True
    ids[~valid] = 0
    labels, trained = _hand_targets(ids, loss_mask, valid)

    # trained targets: row 1 misses in blocks 0 and 2 and hits in block 1, row 0 the reverse
    hit = (np.arange(length)[None] // block + np.arange(2)[:, None]) % 2 == 0
    hit[~trained] = True
    logits = np.zeros((2, 2 * length, VOCAB))
    for r in range(2):
        for p in range(length):
            guess = labels[r, p] if hit[r, p] else (labels[r, p] % (MASK_ID - 1)) + 1
            logits[r, length + p, guess] = 5.0
            logits[r, p, guess] = 5.0
    batch = dict(input_ids=jnp.asarray(ids, jnp.int32), loss_mask=jnp.asarray(loss_mask),
                 valid=jnp.asarray(valid))
    _, m = mars_loss(_fixed_logits_model(logits), batch, block_size=block, mask_token_id=MASK_ID)

    expected = []
    for j in range(block):
        cols = [p for p in range(length) if p % block == j]
        n_trained = sum(trained[r, p] for r in range(2) for p in cols)
        n_hit = sum(trained[r, p] and hit[r, p] for r in range(2) for p in cols)
        expected.append(n_hit / n_trained)
    assert 0 < min(expected) and max(expected) < 1
    np.testing.assert_allclose(np.asarray(m["masked_acc_by_pos"]), expected, atol=1e-6)


# ---- tokenized rows ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_block_padding_is_eos_and_right_padding_is_the_pad_token():
    """docs/method.md: sequences are padded with EOS to a multiple of B (trained), then right-padded.
    Qwen2.5-Instruct's pad token is not its EOS; the fixture's is, which hid a swap."""
    tok = make_tokenizer()
    tok.pad_token = IM_END
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert eos != pad
    rows = tokenize_examples([{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}], tok,
                             max_length=12, block_size=4)
    assert rows.input_ids[0].tolist() == [5, 6, 7, 8, 9, eos, eos, eos, pad, pad, pad, pad]
    assert rows.loss_mask[0].tolist() == [False] * 3 + [True] * 5 + [False] * 4
    assert rows.valid[0].tolist() == [True] * 8 + [False] * 4


def test_a_tokenizer_without_a_pad_token_pads_with_eos():
    tok = make_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    eos = tok.eos_token_id
    rows = tokenize_examples([{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}], tok,
                             max_length=12, block_size=4)
    assert rows.input_ids[0].tolist() == [5, 6, 7, 8, 9] + [eos] * 7
    assert rows.valid[0].tolist() == [True] * 8 + [False] * 4


def test_only_rows_longer_than_max_length_count_as_truncated(tok):
    exact = {"prompt_ids": [5, 6, 7, 8], "response_ids": [9, 10, 11, 12]}       # 8 tokens: fits
    longer = {"prompt_ids": [5, 6, 7, 8], "response_ids": [9, 10, 11, 12, 13]}  # 9 tokens: cut
    rows = tokenize_examples([exact, longer], tok, max_length=8, block_size=4)
    assert rows.truncated == 1 and rows.dropped == 0
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]] * 2
    assert rows.valid.all()
    assert tokenize_examples([exact], tok, max_length=8, block_size=4).truncated == 0


def test_a_row_whose_only_trained_token_is_its_first_is_dropped(tok):
    """Targets are positions 1..n-1: a trained token at position 0 has no predecessor and
    trains nothing, so that row is dropped (and counted), not kept as a batch slot."""
    rows = tokenize_examples([{"prompt_ids": [], "response_ids": [7]},
                              {"prompt_ids": [5], "response_ids": [7]}], tok, max_length=4, block_size=1)
    assert rows.dropped == 1
    assert rows.input_ids.tolist() == [[5, 7, tok.pad_token_id, tok.pad_token_id]]
    assert rows.loss_mask.tolist() == [[False, True, False, False]]


def test_token_ids_must_lie_in_the_vocabulary(tok, tmp_path):
    vocab = len(tok)
    for bad in (vocab, -1):
        with pytest.raises(DataError, match=rf"token id {bad} .*outside the tokenizer's vocabulary"):
            tokenize_examples([{"prompt_ids": [5], "response_ids": [bad]}], tok, max_length=8, block_size=4)
    edge = tokenize_examples([{"prompt_ids": [0], "response_ids": [vocab - 1]}], tok, max_length=8,
                             block_size=4)
    assert edge.input_ids[0, :2].tolist() == [0, vocab - 1]
    # JSON true is an int in Python, but not a token id
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"prompt_ids": [5], "response_ids": [True, 6]}) + "\n")
    with pytest.raises(DataError, match=r"ids.jsonl:1: expected"):
        load_examples(path)


# ---- the dataset: stats and finite runs on several hosts -------------------------------------

def _id_pairs(n):
    """n distinct rows of 5 tokens (prompt 3, response 2): 5 trained tokens each at block 4."""
    return [{"prompt_ids": [20 + i, 6, 7], "response_ids": [8, 9]} for i in range(n)]


def test_stats_count_trained_tokens_and_full_global_batches(tok):
    it = make_dataset(_id_pairs(6), tok, max_length=8, block_size=4, global_batch_size=4, seed=0)
    # by hand: per row 2 response tokens + 3 EOS block padding; 6 rows fill one batch of 4
    assert it.stats.sequences == 6
    assert it.stats.trained_tokens == 6 * (2 + 3)
    assert it.stats.steps_per_epoch == 1


def test_a_finite_run_ends_on_the_same_step_on_every_host(tok):
    """14 rows x 1 epoch / global batch 4 = 3 full global batches; with 2 hosts (batch 2 each)
    both hosts stop after 3 (a host that runs a 4th step waits forever for the other)."""
    kw = dict(max_length=8, block_size=4, global_batch_size=4, seed=3, num_epochs=1)
    single = list(make_dataset(_id_pairs(14), tok, **kw))
    hosts = [list(make_dataset(_id_pairs(14), tok, process_index=h, process_count=2, **kw))
             for h in range(2)]
    assert len(single) == 3 and [len(h) for h in hosts] == [3, 3]
    for step in range(3):
        joined = np.concatenate([hosts[0][step]["input_ids"], hosts[1][step]["input_ids"]])
        np.testing.assert_array_equal(joined, single[step]["input_ids"])


# ---- loading a folder ----------------------------------------------------------------------

def test_a_folder_is_read_in_sorted_path_order_without_hidden_files_or_a_bom(tmp_path):
    (tmp_path / "z.txt").write_text("zed\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("x = 1\n")
    (tmp_path / ".hidden").mkdir()                   # e.g. .git, .venv, .github
    (tmp_path / ".hidden" / "secret.py").write_text("leak = 1\n")
    (tmp_path / ".dot.txt").write_text("leak\n")
    (tmp_path / "bom.md").write_bytes("\ufeffbody\n".encode("utf-8"))
    # os.walk lists a folder's files before its subfolders; sorted paths put a/x.py first
    assert load_examples(str(tmp_path)) == [{"text": "x = 1\n"}, {"text": "body\n"}, {"text": "zed\n"}]
    assert load_examples(str(tmp_path / "bom.md")) == [{"text": "body\n"}]


def test_a_broken_jsonl_file_in_a_folder_is_an_error_not_skipped(tmp_path):
    """Only files that are not UTF-8 text are skipped in a folder; a JSONL record that is not
    JSON is a data error, as it is for the file on its own."""
    (tmp_path / "a.txt").write_text("fine\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(str(tmp_path))


# ---- corpus prompts ------------------------------------------------------------------------

ODD_METHOD = '''\
class K:
    def kept(self):
        """Doc."""
        return 1

    def odd(self):
        """Doc."""
        s = """
col0
"""
        return s
'''


def test_a_function_with_a_line_left_of_its_indent_is_skipped_not_mangled():
    records = corpus.function_prompts(corpus.SourceFile("m.py", ODD_METHOD))
    assert [r["id"] for r in records] == ["stdlib/m.py:K.kept:2"]
    # what is kept is the source, dedented by the method's indent and nothing else
    lines = ODD_METHOD.splitlines(keepends=True)
    assert ["    " + ln for ln in (records[0]["prompt"] + records[0]["reference"]).splitlines(keepends=True)] \
        == lines[1:4]


# ---- the BPE tokenizer -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_bpe(tmp_path_factory):
    from prove_jax.data.tokenizer import save_tokenizer, train_bpe
    bpe, _, _ = train_bpe(stdlib_text(("textwrap",)).splitlines(keepends=True), vocab_size=300)
    out = tmp_path_factory.mktemp("bpe") / "tok"
    save_tokenizer(bpe, str(out))
    return bpe, out


def test_bpe_settings_that_cannot_train_are_errors():
    from prove_jax.data.tokenizer import SPECIAL_TOKENS, TokenizerBuildError, train_bpe
    floor = len(SPECIAL_TOKENS) + 256   # 4 special tokens + 256 bytes: no room for a merge
    with pytest.raises(TokenizerBuildError, match=f"must exceed {floor}"):
        train_bpe(["abc abc"], vocab_size=floor)
    with pytest.raises(TokenizerBuildError, match="no training text"):
        train_bpe([], vocab_size=300)


def test_the_pipeline_normalizes_to_nfc_as_qwen2():
    from prove_jax.data.tokenizer import qwen2_pipeline
    text = "\ufb01le caf\u0065\u0301 \u212b \u2460"   # ligature, e + combining accent, angstrom, circled 1
    assert qwen2_pipeline().normalizer.normalize_str(text) == unicodedata.normalize("NFC", text)


def test_verification_catches_a_wrong_pad_token_and_disagreeing_ids(saved_bpe, tmp_path):
    from prove_jax.data.tokenizer import TokenizerBuildError, qwen2_pipeline, verify_tokenizer_dir
    bpe, out = saved_bpe
    text = "\ufb01x = 'a b'\n"
    verify_tokenizer_dir(str(out), bpe, [text])    # the real folder passes
    # the same ids and vocabulary size, two byte tokens swapped: same lengths, other ids
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    swapped = qwen2_pipeline(vocab, merges)
    assert len(swapped.encode("a").ids) == len(bpe.encode("a").ids) == 1
    with pytest.raises(TokenizerBuildError, match="disagree"):
        verify_tokenizer_dir(str(out), swapped, ["a"])
    # a saved folder whose pad token is not EOS
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg_path = bad / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = "<|im_end|>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(TokenizerBuildError, match="wrong eos/pad/mask"):
        verify_tokenizer_dir(str(bad), bpe)


# ---- the mask token --------------------------------------------------------------------------

def test_a_grown_vocabulary_holds_the_mask_id_at_the_next_multiple_of_64():
    """The new id lands exactly on a multiple of 64 (a 320-token tokenizer): the rows must grow
    to the smallest multiple of 64 above it (384), not stay at 320 with the id outside."""
    from prove_jax.models.config import ModelConfig
    from prove_jax.checkpoints.vocab import ensure_mask_token
    tok = make_tokenizer(320)
    assert len(tok) == 320
    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    _, new_cfg, grown = ensure_mask_token(tok, cfg)
    assert grown and new_cfg.mask_token_id == 320
    assert new_cfg.vocab_size == min(v for v in range(64, 10_000, 64) if v > 320) == 384


def test_growing_embeddings_refuses_any_other_config_change():
    from prove_jax.models.config import ModelConfig
    from prove_jax.models.params import create_model
    from prove_jax.checkpoints.vocab import VocabError, grow_embeddings
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0)
    model = create_model(cfg, seed=0)
    with pytest.raises(VocabError, match="may only change vocab_size and mask_token_id"):
        grow_embeddings(model, cfg.replace(vocab_size=320, mask_token_id=300, rope_theta=1e6))

