"""Data pipeline: loading, tokenized rows and masks, per-host sharding, exact resume."""

import json
import logging

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec as P

from prove_jax.data.pipeline import (DataError, iterator_restore_args, iterator_save_args,
                                     load_examples, make_dataset, to_global_batch,
                                     tokenize_examples)
from prove_jax.models.sharding import make_mesh
from tests.tokenizers_fixture import make_tokenizer, stdlib_text


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _pairs(n):
    """Distinct prompt/response pairs (every row of the dataset is unique)."""
    return [{"prompt": f"def f{i}(x):", "response": f" return x + {i}"} for i in range(n)]


def _row_keys(batch):
    return [row.tobytes() for row in np.asarray(batch["input_ids"])]


# ---- loading ---------------------------------------------------------------------------------

def test_load_text_folder_and_jsonl(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.py").write_text("x = 2\n")
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")  # not a text suffix: ignored
    (tmp_path / "empty.md").write_text("  \n")         # empty document: skipped
    (tmp_path / "config.json").write_text("{}")         # .json in a folder is config: ignored
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    assert load_examples(str(tmp_path)) == [{"text": "one\n"}, {"text": "x = 2\n"}]
    with pytest.raises(DataError, match="latin1.txt: not UTF-8"):
        load_examples(str(tmp_path / "latin1.txt"))
    assert load_examples(str(tmp_path / "a.txt")) == [{"text": "one\n"}]
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "response": "r"}, {"text": "t"}])
    assert load_examples(path) == [{"prompt": "p", "response": "r"}, {"text": "t"}]


def test_load_errors(tmp_path):
    with pytest.raises(DataError, match="data path not found: .*nope.jsonl"):
        load_examples(str(tmp_path / "nope.jsonl"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="empty dataset"):
        load_examples(str(tmp_path / "empty.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"prompt": "p", "response": \n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: not valid JSON"):
        load_examples(str(bad))
    bad.write_text('{"text": "ok"}\n{"question": "q"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected .*\['question'\]"):
        load_examples(str(bad))
    bad.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    with pytest.raises(DataError, match=r"bad.jsonl:1: not valid JSON .*one object per line, not one JSON array"):
        load_examples(str(bad))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    (folder / "gone.txt").symlink_to(tmp_path / "deleted.txt")  # dangling: skipped, not fatal
    assert load_examples(str(folder)) == [{"text": "some text"}]


# ---- tokenized rows --------------------------------------------------------------------------

def test_pair_row_layout(tok):
    prompt, response = "def add(a, b):", " return a + b"
    p, r = _ids(tok, prompt), _ids(tok, response)
    eos, block, max_len = tok.eos_token_id, 4, 32
    rows = tokenize_examples([{"prompt": prompt, "response": response}], tok, max_length=max_len,
                             block_size=block)
    n = len(p) + len(r) + 1
    padded = -(-n // block) * block
    assert n % block, "pick texts so that EOS block padding is exercised"
    expected_ids = p + r + [eos] + [eos] * (padded - n) + [tok.pad_token_id] * (max_len - padded)
    np.testing.assert_array_equal(rows.input_ids[0], expected_ids)
    np.testing.assert_array_equal(rows.loss_mask[0], [0] * len(p) + [1] * (padded - len(p))
                                  + [0] * (max_len - padded))
    np.testing.assert_array_equal(rows.valid[0], [1] * padded + [0] * (max_len - padded))
    assert rows.truncated == 0 and rows.dropped == 0


def test_token_id_records_are_trained_as_given(tok, tmp_path):
    """{"prompt_ids", "response_ids"} (the distill CLI's output): no EOS added, prompt untrained."""
    path = _write_jsonl(tmp_path / "ids.jsonl", [{"id": "a", "prompt_ids": [5, 6, 7], "response_ids": [8, 9]},
                                                 {"prompt_ids": [5], "response_ids": [9, tok.eos_token_id]}])
    examples = load_examples(path)
    assert examples == [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]},
                        {"prompt_ids": [5], "response_ids": [9, tok.eos_token_id]}]
    rows = tokenize_examples(examples, tok, max_length=8, block_size=4)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    np.testing.assert_array_equal(rows.input_ids[0], [5, 6, 7, 8, 9, eos, eos, eos])  # block padding only
    np.testing.assert_array_equal(rows.loss_mask[0], [0, 0, 0, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(rows.input_ids[1], [5, 9, eos, eos, pad, pad, pad, pad])
    np.testing.assert_array_equal(rows.loss_mask[1], [0, 1, 1, 1, 0, 0, 0, 0])
    rows = tokenize_examples([{"prompt_ids": [5] * 6, "response_ids": [9] * 6}], tok, max_length=8,
                             block_size=4)
    assert rows.truncated == 1 and rows.input_ids.shape == (1, 8)
    with pytest.raises(DataError, match=r"token id 99999 .* outside the tokenizer's vocabulary"):
        tokenize_examples([{"prompt_ids": [5], "response_ids": [99999]}], tok, max_length=8, block_size=4)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [1, "x"], "response_ids": [2]}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: expected .*prompt_ids"):
        load_examples(bad)


def test_chat_template_prompt(tok):
    rows = tokenize_examples([{"prompt": "hi", "response": "ok"}], tok, max_length=32, block_size=4,
                             chat=True)
    n_prompt = int((~rows.loss_mask[0] & rows.valid[0]).sum())
    assert tok.decode(rows.input_ids[0, :n_prompt]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert rows.loss_mask[0, n_prompt]


@pytest.mark.parametrize("pack", [True, False])
def test_text_rows_pack_or_split(tok, pack):
    docs = [stdlib_text(("fnmatch",))[:700], "x = 1\n", stdlib_text(("textwrap",))[:500]]
    eos, max_len, block = tok.eos_token_id, 64, 8
    rows = tokenize_examples([{"text": d} for d in docs], tok, max_length=max_len, block_size=block,
                             pack=pack)
    doc_ids = [_ids(tok, d) + [eos] for d in docs]
    assert rows.truncated == 0
    assert (rows.loss_mask == rows.valid).all()  # every real token trained
    chunks = []
    for ids, valid in zip(rows.input_ids, rows.valid):
        real = ids[valid].tolist()
        assert len(real) % block == 0
        chunks.append(real)
    if pack:  # one stream cut into full rows; only the last row is EOS-padded
        stream = [t for d in doc_ids for t in d]
        assert all(len(c) == max_len for c in chunks[:-1])
        joined = [t for c in chunks for t in c]
        assert joined[:len(stream)] == stream and set(joined[len(stream):]) <= {eos}
    else:  # each document split on its own
        expected = []
        for d in doc_ids:
            for i in range(0, len(d), max_len):
                c = d[i:i + max_len]
                expected.append(c + [eos] * ((-len(c)) % block))
        assert chunks == expected


def test_truncation_is_counted_and_warned(tok, caplog):
    long = {"prompt": "def f(x):", "response": " return x" * 40}
    examples = [long, {"prompt": "a", "response": "b"}, {"prompt": "x = 1\n" * 40, "response": "y"}]
    with caplog.at_level(logging.WARNING, logger="prove_jax.data.pipeline"):
        it = make_dataset(examples, tok, max_length=16, block_size=4, global_batch_size=1, seed=0)
    assert it.stats.truncated == 2 and it.stats.dropped == 1 and it.stats.sequences == 2
    assert "2 sequences longer than max_length 16 were truncated" in caplog.text
    rows = tokenize_examples(examples, tok, max_length=16, block_size=4)
    assert rows.valid[0].all() and rows.loss_mask[0].sum() == 16 - len(_ids(tok, "def f(x):"))


def test_a_document_longer_than_the_tokenizer_limit_is_cut_without_transformers_warning(capfd, caplog):
    """A text file is one document, often longer than model_max_length; transformers warned it
    'will result in indexing errors' though the pipeline cuts it into rows."""
    short_limit = make_tokenizer(300)
    short_limit.model_max_length = 64
    with caplog.at_level(logging.WARNING):
        it = make_dataset([{"text": "x = 1\n" * 200}], short_limit, max_length=16, block_size=4,
                          global_batch_size=1, seed=0)
    assert it.stats.sequences * 16 >= 1000  # all ~1000 tokens, in rows of 16
    logged = caplog.text + capfd.readouterr().err
    assert "indexing errors" not in logged, logged


def test_bad_settings(tok):
    with pytest.raises(DataError, match="max_length 30 is not a multiple of block_size 4"):
        make_dataset(_pairs(4), tok, max_length=30, block_size=4, global_batch_size=2, seed=0)
    with pytest.raises(DataError, match="global_batch_size 3 must be a positive multiple of the process count 2"):
        make_dataset(_pairs(4), tok, max_length=32, block_size=4, global_batch_size=3, seed=0,
                     process_index=0, process_count=2)
    with pytest.raises(DataError, match="do not fill one global batch"):
        make_dataset(_pairs(3), tok, max_length=32, block_size=4, global_batch_size=4, seed=0, num_epochs=1)
    with pytest.raises(DataError, match="data path not found"):
        make_dataset("/no/such/data.jsonl", tok, max_length=32, block_size=4, global_batch_size=2, seed=0)


# ---- batching, sharding, resume ----------------------------------------------------------------

def _take(it, n):
    return [next(it) for _ in range(n)]


def _dataset(tok, **kw):
    args = dict(max_length=32, block_size=4, global_batch_size=4, seed=7)
    return make_dataset(_pairs(12), tok, **(args | kw))


def test_batches_are_deterministic_and_seeded(tok):
    a, b, c = _take(_dataset(tok), 5), _take(_dataset(tok), 5), _take(_dataset(tok, seed=8), 5)
    assert a[0]["input_ids"].shape == (4, 32) and a[0]["input_ids"].dtype == np.int32
    assert a[0]["loss_mask"].dtype == bool and a[0]["valid"].dtype == bool
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert [_row_keys(x) for x in a] != [_row_keys(x) for x in c]
    # one epoch = 12 distinct rows; the next epoch is reshuffled, not repeated
    epoch0 = [k for x in a[:3] for k in _row_keys(x)]
    epoch1 = [k for x in _take(_dataset(tok), 6)[3:] for k in _row_keys(x)]
    assert len(set(epoch0)) == 12 and set(epoch0) == set(epoch1) and epoch0 != epoch1
    unshuffled = [k for x in _take(_dataset(tok, shuffle=False), 3) for k in _row_keys(x)]
    assert unshuffled == [r.tobytes() for r in tokenize_examples(_pairs(12), tok, max_length=32,
                                                                 block_size=4).input_ids]


@pytest.mark.parametrize("hosts", [2, 4])
def test_host_shards_are_disjoint_cover_and_form_the_global_batch(tok, hosts):
    # 12 rows x 2 epochs / global batch 4 = exactly 6 steps, on every host
    single = list(_dataset(tok, num_epochs=2))
    per_host = [list(_dataset(tok, num_epochs=2, process_index=h, process_count=hosts))
                for h in range(hosts)]
    assert len(single) == 6 and all(len(batches) == 6 for batches in per_host)
    for step in range(6):
        host_keys = [_row_keys(per_host[h][step]) for h in range(hosts)]
        assert all(len(k) == 4 // hosts for k in host_keys)
        assert [k for ks in host_keys for k in ks] == _row_keys(single[step])
    for epoch in range(2):  # within an epoch the hosts' rows are disjoint and cover the data
        rows = [k for h in range(hosts) for step in range(3 * epoch, 3 * epoch + 3)
                for k in _row_keys(per_host[h][step])]
        assert len(rows) == len(set(rows)) == 12


def test_get_state_set_state_resume(tok):
    it = _dataset(tok)
    _take(it, 4)  # crosses the epoch boundary on the way
    state = it.get_state()
    expected = _take(it, 5)
    fresh = _dataset(tok)
    fresh.set_state(state)
    for x, y in zip(_take(fresh, 5), expected):
        assert _row_keys(x) == _row_keys(y)


def test_orbax_checkpoint_of_the_iterator(tok, tmp_path):
    it = _dataset(tok, process_index=1, process_count=2)
    _take(it, 3)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.save(3, args=ocp.args.Composite(data=iterator_save_args(it)))
        mngr.wait_until_finished()
    expected = _take(it, 4)
    fresh = _dataset(tok, process_index=1, process_count=2)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.restore(mngr.latest_step(), args=ocp.args.Composite(data=iterator_restore_args(fresh)))
    for x, y in zip(_take(fresh, 4), expected):
        assert _row_keys(x) == _row_keys(y)


def test_to_global_batch_shards_over_data_axes(tok):
    mesh = make_mesh((2, 2, 2))
    host = next(_dataset(tok, global_batch_size=8))
    glob = to_global_batch(host, mesh)
    for k, v in host.items():
        assert glob[k].shape == v.shape and glob[k].dtype == v.dtype
        assert glob[k].sharding.spec == P(("data", "fsdp"))
        np.testing.assert_array_equal(np.asarray(glob[k]), v)
    # each of the 4 batch shards holds 2 rows, replicated over the tensor axis
    shard_rows = {tuple(s.index[0].indices(8)) for s in glob["input_ids"].addressable_shards}
    assert shard_rows == {(0, 2, 1), (2, 4, 1), (4, 6, 1), (6, 8, 1)}
    assert jax.process_count() == 1


def test_jsonl_lines_end_at_newline_only_and_a_bom_or_path_object_is_fine(tmp_path):
    """U+2028 / U+0085 inside a string (json.dumps(ensure_ascii=False) leaves them raw) are text,
    not line breaks; a BOM is not text; a pathlib.Path is a path."""
    path = tmp_path / "d.jsonl"
    path.write_text("\ufeff" + json.dumps({"text": "a\u2028b\x85c"}, ensure_ascii=False) + "\r\n"
                    + json.dumps({"prompt": "p", "response": "r"}) + "\n", encoding="utf-8")
    assert load_examples(path) == [{"text": "a\u2028b\x85c"}, {"prompt": "p", "response": "r"}]


def test_special_token_text_in_the_data_is_text(tok):
    """Code corpora spell "<|endoftext|>" and "<|mask|>" as strings: they must not become an
    EOS inside a document or a mask token in MARS's clean stream."""
    specials = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")}
    assert None not in specials and len(specials) == 2
    text = 'EOS = "<|endoftext|>"; START = "<|im_start|>"\n'
    rows = tokenize_examples([{"text": text}], tok, max_length=64, block_size=4)
    ids = rows.input_ids[0][rows.valid[0]].tolist()
    body = ids[:ids.index(tok.eos_token_id)]  # up to the EOS we append (then block padding)
    assert tok.decode(body) == text and not specials & set(body), ids
