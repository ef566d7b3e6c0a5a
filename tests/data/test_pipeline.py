"""data/pipeline.py: tokenized rows (EOS block padding, right padding, truncation and drop
counts, the vocabulary check), the dataset's stats and finite runs on several hosts, and what
is read from a folder of data. The expected rows are written out by hand from docs/method.md
section 2 and the module's docstrings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prove_jax.data.pipeline import DataError, load_examples, make_dataset, tokenize_examples
from tests.tokenizers_fixture import IM_END, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_block_padding_is_eos_and_right_padding_is_the_pad_token():
    """docs/method.md: sequences are padded with EOS to a multiple of B (trained), then right-padded.
    The tokenizer's pad token is set apart from its EOS (as Qwen2.5-Instruct's is), so the two
    cannot stand in for each other."""
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


def test_a_row_trained_only_on_its_eos_block_padding_is_kept():
    """data.py: the EOS padding up to a block multiple is trained, so a pair with an empty
    response still teaches "EOS after this prompt"; at a block multiple there is no padding and
    the row trains nothing (dropped)."""
    from prove_jax.data.pipeline import tokenize_examples
    from tests.tokenizers_fixture import make_tokenizer
    tok = make_tokenizer(300)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows = tokenize_examples([{"prompt_ids": [5, 6, 7], "response_ids": []},
                              {"prompt_ids": [5, 6, 7, 8], "response_ids": []}], tok,
                             max_length=8, block_size=4)
    assert rows.dropped == 1 and rows.input_ids.shape == (1, 8)
    assert rows.input_ids[0].tolist() == [5, 6, 7, eos] + [pad] * 4
    assert rows.loss_mask[0].tolist() == [False] * 3 + [True] + [False] * 4
    assert rows.valid[0].tolist() == [True] * 4 + [False] * 4


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
