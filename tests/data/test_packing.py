"""Packing with document boundaries (data `pack_documents`): several documents per row, each
trained exactly as if it had a row of its own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prove_jax.data.pipeline import make_dataset, tokenize_examples
from prove_jax.models.attention import causal_mask
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import create_model
from prove_jax.training.config import TrainConfigError
from prove_jax.training.objectives import (ar_loss, mars_attention_mask, mars_inputs, mars_loss,
                                           packed_causal_mask, sequence_mean, token_nll)
from tests.tokenizers_fixture import make_tokenizer
from tests.train_helpers import tiny_config

MASK_ID = 319
TINY = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10_000.0, mask_token_id=MASK_ID)
BLOCK = 4
LENGTH = 64


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=3)


def _examples(kind):
    """Two documents of different lengths (so per-document and per-token averages differ)."""
    if kind == "text":
        return [{"text": "def add(a, b):\n    return a + b\n"},
                {"text": "import os\nprint(os.getcwd())\n"}]
    return [{"prompt": "def add(a, b):", "response": " return a + b"},
            {"prompt": "x = [", "response": "i * i for i in range(3)]"}]


def _as_batch(rows, keys=("input_ids", "loss_mask", "valid")):
    return {k: jnp.asarray(getattr(rows, k)) for k in keys}


PACKED_KEYS = ("input_ids", "loss_mask", "valid", "segment_ids", "positions")


def _packed_and_alone(tok, kind, block):
    examples = _examples(kind)
    packed = tokenize_examples(examples, tok, max_length=LENGTH, block_size=block, pack_documents=True)
    alone = [tokenize_examples([ex], tok, max_length=LENGTH, block_size=block, pack=False)
             for ex in examples]
    assert packed.input_ids.shape == (1, LENGTH) and packed.documents == 2
    assert all(r.input_ids.shape == (1, LENGTH) for r in alone)
    stacked = {k: jnp.asarray(np.concatenate([getattr(r, k) for r in alone]))
               for k in ("input_ids", "loss_mask", "valid")}
    return packed, alone, stacked


def _segment_of(packed, alone_row):
    """Indices of the packed row's segment that holds the same document as `alone_row`."""
    want = alone_row.input_ids[0][alone_row.valid[0]]
    for s in range(1, packed.segment_ids.max() + 1):
        idx = np.flatnonzero(packed.segment_ids[0] == s)
        if np.array_equal(packed.input_ids[0, idx], want):
            return idx
    raise AssertionError("document not found in the packed row")


def _loss(objective, model, batch):
    if objective == "mars":
        return jax.jit(lambda b: mars_loss(model, b, block_size=BLOCK, mask_token_id=MASK_ID))(batch)
    return jax.jit(lambda b: ar_loss(model, b))(batch)


def _logits(objective, model, batch):
    """Logits [B, streams x L, V] as the loss sees them."""
    if objective == "mars":
        inp = mars_inputs(batch, BLOCK, MASK_ID)
        return np.asarray(model(inp["tokens"], inp["positions"], inp["attn_mask"])[0])
    b, length = batch["input_ids"].shape
    if "segment_ids" in batch:
        return np.asarray(model(batch["input_ids"], batch["positions"],
                                packed_causal_mask(batch["segment_ids"]))[0])
    return np.asarray(model(batch["input_ids"], jnp.broadcast_to(jnp.arange(length), (b, length)),
                            causal_mask(b, length, batch["valid"]))[0])


# ---- the losses of packed documents -------------------------------------------------------------

@pytest.mark.parametrize("kind", ["text", "pairs"])
@pytest.mark.parametrize("objective", ["mars", "ar"])
def test_two_documents_packed_in_one_row_give_each_ones_own_losses(tok, model, objective, kind):
    """Oracle: each document alone in its row, through the unpacked path. Checked: no document
    sees the other (either stream), positions and blocks restart, the first document's last
    token is not trained on the second's first, and the mean is per document."""
    block = BLOCK if objective == "mars" else 1  # as the train loop pads (loop.data_block_size)
    packed, alone, stacked = _packed_and_alone(tok, kind, block)
    loss_p, m_p = _loss(objective, model, _as_batch(packed, PACKED_KEYS))
    loss_a, m_a = _loss(objective, model, stacked)
    for key in m_a:
        np.testing.assert_allclose(np.asarray(m_p[key]), np.asarray(m_a[key]), rtol=2e-5, atol=2e-6,
                                   err_msg=key)
    assert float(m_p["sequences"]) == 2 and float(m_p["tokens"]) == float(m_a["tokens"])

    # the same numbers token by token, in every stream
    logits_p = _logits(objective, model, _as_batch(packed, PACKED_KEYS))
    logits_a = _logits(objective, model, stacked)
    streams = 2 if objective == "mars" else 1
    for r, row in enumerate(alone):
        idx = _segment_of(packed, row)
        n = len(idx)
        for s in range(streams):
            np.testing.assert_allclose(logits_p[0, s * LENGTH + idx], logits_a[r, s * LENGTH:s * LENGTH + n],
                                       atol=2e-5, rtol=1e-5, err_msg=f"document {r}, stream {s}")



def test_losses_average_per_document_then_over_documents():
    """The loss is averaged per document, then over documents (not per row, token-weighted)."""
    values = jnp.asarray([[1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 9.0, 9.0],
                          [5.0, 5.0, 5.0, 7.0, 9.0, 9.0, 9.0, 9.0]])
    weights = jnp.asarray([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]], jnp.float32)
    segments = jnp.asarray([[1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 2, 3, 3, 0, 0]])
    # documents: (1, 1) -> 1, (3, 3, 3, 3) -> 3, (5, 5, 5) -> 5, (7) -> 7; the third has no target
    assert float(sequence_mean(values, weights, segments)) == pytest.approx((1 + 3 + 5 + 7) / 4)
    assert float(sequence_mean(values, weights)) == pytest.approx((14 / 6 + 22 / 4) / 2)  # per row


@pytest.mark.parametrize("objective", ["mars", "ar"])
def test_a_document_never_sees_another(tok, model, objective):
    """Rewriting the first document's tokens leaves the second's logits exactly as they were,
    in both streams; rewriting its own tokens changes them (the check can fail)."""
    block = BLOCK if objective == "mars" else 1
    packed, _, _ = _packed_and_alone(tok, "text", block)
    batch = _as_batch(packed, PACKED_KEYS)
    seg = packed.segment_ids[0]
    first, second = np.flatnonzero(seg == 1), np.flatnonzero(seg == 2)
    assert first.max() < second.min()
    streams = 2 if objective == "mars" else 1
    cols = np.concatenate([s * LENGTH + second for s in range(streams)])
    base = _logits(objective, model, batch)[0, cols]

    ids = np.array(packed.input_ids)
    ids[0, first] = (ids[0, first] + 7) % 300
    other = _logits(objective, model, dict(batch, input_ids=jnp.asarray(ids)))[0, cols]
    np.testing.assert_array_equal(other, base)

    ids = np.array(packed.input_ids)
    ids[0, second[:2]] = (ids[0, second[:2]] + 7) % 300
    own = _logits(objective, model, dict(batch, input_ids=jnp.asarray(ids)))[0, cols]
    assert np.abs(own - base).max() > 1e-4


def test_mars_blocks_and_positions_restart_at_each_document(tok):
    """The packed mask, read at one document's rows and columns, is that document's own mask
    (docs/method.md's four rules, blocks from its start); every entry across documents is False."""
    packed, alone, _ = _packed_and_alone(tok, "pairs", BLOCK)
    seg, pos = packed.segment_ids[0], packed.positions[0]
    mask = np.asarray(mars_attention_mask(LENGTH, BLOCK, segment_ids=jnp.asarray(packed.segment_ids),
                                          positions=jnp.asarray(packed.positions)))[0]
    covered = np.zeros_like(mask)
    for s in (1, 2):
        idx = np.flatnonzero(seg == s)
        n = len(idx)
        assert n % BLOCK == 0 and idx[0] % BLOCK == 0  # each padded to whole blocks on its own
        np.testing.assert_array_equal(pos[idx], np.arange(n))
        both = np.concatenate([idx, LENGTH + idx])
        own = np.asarray(mars_attention_mask(n, BLOCK))[0]
        np.testing.assert_array_equal(mask[np.ix_(both, both)], own)
        covered[np.ix_(both, both)] = True
    assert not mask[~covered].any()
    assert (seg[~packed.valid[0]] == 0).all() and not packed.loss_mask[0][~packed.valid[0]].any()


# ---- the rows ---------------------------------------------------------------------------------

def test_prompt_response_pairs_pack_with_their_masks(tok):
    """Each pair keeps its unpacked layout (prompt untrained; response, EOS and block fill
    trained) inside its segment, and the pairs share rows."""
    pairs = [{"prompt": f"def f{i}(x):", "response": f" return x * {i}" + " + 1" * (i % 4)}
             for i in range(12)]
    packed = tokenize_examples(pairs, tok, max_length=LENGTH, block_size=BLOCK, pack_documents=True)
    assert packed.documents == 12 and len(packed.input_ids) <= 12 // 2
    found = 0
    for pair in pairs:
        alone = tokenize_examples([pair], tok, max_length=LENGTH, block_size=BLOCK)
        n = int(alone.valid[0].sum())
        for r, s in zip(*np.nonzero(packed.positions == 0)):
            idx = np.flatnonzero(packed.segment_ids[r] == packed.segment_ids[r, s])
            if packed.segment_ids[r, s] and len(idx) == n and np.array_equal(packed.input_ids[r, idx],
                                                                           alone.input_ids[0, :n]):
                np.testing.assert_array_equal(packed.loss_mask[r, idx], alone.loss_mask[0, :n])
                found += 1
                break
    assert found == 12


def test_long_documents_split_into_pieces_that_pack_as_documents(tok):
    text = "x = 1\n" * 60  # ~120 tokens: pieces of LENGTH, the last one shorter
    short = tokenize_examples([{"text": text}, {"text": "y = 2\n"}], tok, max_length=LENGTH, block_size=BLOCK,
                              pack_documents=True)
    unpacked = tokenize_examples([{"text": text}, {"text": "y = 2\n"}], tok, max_length=LENGTH,
                                 block_size=BLOCK, pack=False)
    assert short.documents == unpacked.documents == len(unpacked.input_ids)
    assert len(short.input_ids) < len(unpacked.input_ids)  # the short pieces share a row
    assert short.loss_mask.sum() == unpacked.loss_mask.sum() and short.filled == unpacked.filled
    assert all(len(row) <= LENGTH for row in short.input_ids)


def test_padding_fraction_is_reported(tok, tmp_path):
    pairs = [{"prompt": f"def f{i}(x):", "response": f" return x + {i}"} for i in range(16)]
    kw = dict(max_length=LENGTH, block_size=BLOCK, global_batch_size=2, seed=0)
    plain = make_dataset(pairs, tok, **kw).stats
    packed = make_dataset(pairs, tok, pack_documents=True, **kw).stats
    rows = tokenize_examples(pairs, tok, max_length=LENGTH, block_size=BLOCK)
    assert plain.padding_fraction == pytest.approx(1 - rows.valid.mean())
    assert plain.fill_fraction == pytest.approx(rows.filled / rows.valid.size) and rows.filled > 0
    assert plain.documents == plain.sequences == 16 and packed.documents == 16
    assert packed.padding_fraction < plain.padding_fraction / 2 and packed.sequences < 16 / 2
    assert packed.trained_tokens == plain.trained_tokens

    from prove_jax.training.batches import make_data_iterator
    lines = []
    cfg = tiny_config(tmp_path, overrides=["pack_documents=true"])
    make_data_iterator(cfg, tok, lines.append)
    assert "documents packed" in lines[0] and "% padding" in lines[0], lines


def test_packing_off_keeps_todays_rows_and_batch(tok):
    """pack_documents=False: the rows and batches of before, no packed keys (the unpacked program)."""
    examples = _examples("pairs") + _examples("text")
    today = tokenize_examples(examples, tok, max_length=LENGTH, block_size=BLOCK)
    off = tokenize_examples(examples, tok, max_length=LENGTH, block_size=BLOCK, pack_documents=False)
    for key in ("input_ids", "loss_mask", "valid"):
        np.testing.assert_array_equal(getattr(off, key), getattr(today, key))
    assert off.segment_ids is None and off.positions is None
    batch = next(make_dataset(examples, tok, max_length=LENGTH, block_size=BLOCK, global_batch_size=2,
                              seed=0))
    assert set(batch) == {"input_ids", "loss_mask", "valid"}
    packed = next(make_dataset(examples, tok, max_length=LENGTH, block_size=BLOCK, global_batch_size=1,
                               seed=0, pack_documents=True))
    assert set(packed) == set(PACKED_KEYS) and packed["segment_ids"].dtype == np.int32


def _loss_before_packing(model, batch, objective):
    """The objectives as they were before packing (commit 6a00772), written out: the reference
    the unpacked path must equal bit for bit."""
    ids, lm, valid = batch["input_ids"], batch["loss_mask"], batch["valid"]
    b, length = ids.shape
    trained = jnp.logical_and(lm, valid)
    labels = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    w = jnp.concatenate([trained[:, 1:], jnp.zeros_like(trained[:, :1])], axis=1).astype(jnp.float32)

    def seq_mean(values, weights):
        per_row_w = weights.sum(-1)
        per_row = (values * weights).sum(-1) / jnp.maximum(per_row_w, 1.0)
        has = (per_row_w > 0).astype(jnp.float32)
        return (per_row * has).sum() / jnp.maximum(has.sum(), 1.0)

    if objective == "ar":
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        logits, _ = model(ids, positions, causal_mask(b, length, valid))
        return seq_mean(token_nll(logits, labels), w)
    masked = jnp.where(lm, jnp.asarray(MASK_ID, ids.dtype), ids)
    pos = jnp.arange(length, dtype=jnp.int32)
    blk = pos // BLOCK
    causal = pos[None, :] <= pos[:, None]
    mask = jnp.concatenate([jnp.concatenate([causal, jnp.zeros_like(causal)], axis=1),
                            jnp.concatenate([blk[None, :] < blk[:, None],
                                             causal & (blk[:, None] == blk[None, :])], axis=1)], axis=0)
    mask = mask[None] & jnp.concatenate([valid, valid], axis=-1)[:, None, :]
    logits, _ = model(jnp.concatenate([ids, masked], axis=1),
                      jnp.broadcast_to(jnp.concatenate([pos, pos])[None], (b, 2 * length)), mask)
    nll = token_nll(logits, jnp.concatenate([labels, labels], axis=1))
    return seq_mean(nll[:, length:], w) + seq_mean(nll[:, :length], w)


@pytest.mark.parametrize("objective", ["mars", "ar"])
def test_losses_with_packing_off_equal_those_before_packing(tok, model, objective):
    block = BLOCK if objective == "mars" else 1
    rows = tokenize_examples(_examples("pairs") + _examples("text"), tok, max_length=LENGTH, block_size=block)
    batch = _as_batch(rows)
    got, _ = _loss(objective, model, batch)
    want = jax.jit(lambda b: _loss_before_packing(model, b, objective))(batch)
    assert float(got) == float(want)


def test_pack_documents_config(tmp_path):
    assert tiny_config(tmp_path).pack_documents is False
    assert tiny_config(tmp_path, overrides=["pack_documents=true"]).pack_documents is True
    with pytest.raises(TrainConfigError, match="commit_head cuts one context per row"):
        tiny_config(tmp_path, overrides=["objective=commit_head", "pack_documents=true"])


def test_a_packed_run_trains_and_logs_real_token_throughput(tmp_path):
    """The train loop end to end on packed pairs: the step compiled for packed batches (micro-
    batches included), its records count real tokens and the padding left."""
    import json

    from prove_jax.training.loop import train
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": f" return x + {i}"}) + "\n"
                            for i in range(40)))
    cfg = tiny_config(tmp_path, overrides=[f"data={data}", "pack_documents=true", "steps=2",
                                           "optimizer.grad_accum=2", "save_every=2", "max_length=64"])
    records = train(cfg, log=lambda _: None, show_bar=False).records
    last = records[-1]
    assert 0 < last["real_tokens"] < cfg.global_batch_size * cfg.max_length
    assert np.isfinite(last["loss"]) and last["sequences"] > cfg.global_batch_size  # several pairs a row
    row_tokens = cfg.global_batch_size * cfg.max_length
    assert last["padding_fraction"] == pytest.approx(1 - last["real_tokens"] / row_tokens)
    assert last["tokens_per_s"] == pytest.approx(last["real_tokens"] / last["step_time_s"])
