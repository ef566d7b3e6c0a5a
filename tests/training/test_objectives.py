"""MARS / AR objectives: mask table, label alignment, loss parity with AR, no target leaks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prove_jax.models.config import ModelConfig
from prove_jax.training.objectives import (LOSS_FNS, ObjectiveError, ar_loss, make_loss_fn,
                                           mars_attention_mask, mars_inputs, mars_loss)
from prove_jax.models.params import create_model

MASK_ID = 63
TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rope_theta=10_000.0, mask_token_id=MASK_ID)

# Hand-written from docs/method.md's four rules, L=6. Rows = queries, columns = keys;
# c0..c5 clean stream, m0..m5 masked stream.
#                    c0 c1 c2 c3 c4 c5  m0 m1 m2 m3 m4 m5
MASK_L6_B2 = np.array([
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # c0
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # c1
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # c2
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],  # c3
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],  # c4
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],  # c5
    [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # m0  block 0: no clean context
    [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # m1
    [1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # m2  block 1: clean block 0
    [1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0],  # m3
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0],  # m4  block 2: clean blocks 0-1
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1],  # m5
], dtype=bool)

#                    c0 c1 c2 c3 c4 c5  m0 m1 m2 m3 m4 m5
MASK_L6_B3 = np.array([
    [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0],  # m0
    [0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0],  # m1
    [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0],  # m2
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0],  # m3
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0],  # m4
    [1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1],  # m5
], dtype=bool)


def _batch(ids, loss_mask, valid):
    return dict(input_ids=jnp.asarray(ids, jnp.int32), loss_mask=jnp.asarray(loss_mask, bool),
                valid=jnp.asarray(valid, bool))


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=1)


@pytest.fixture(scope="module")
def sft_batch():
    """Row 0: prompt 3 + response, padded; row 1: all text; row 2: prompt 5 then padding."""
    rng = np.random.default_rng(0)
    length = 12
    ids = rng.integers(1, MASK_ID, size=(3, length))
    loss_mask = np.zeros((3, length), bool)
    valid = np.zeros((3, length), bool)
    loss_mask[0, 3:8], valid[0, :8] = True, True
    loss_mask[1, :], valid[1, :] = True, True
    loss_mask[2, 5:10], valid[2, :10] = True, True
    ids[~valid] = 0
    return _batch(ids, loss_mask, valid)


@pytest.mark.parametrize("block,table", [(2, MASK_L6_B2), (3, MASK_L6_B3)])
def test_mask_equals_hand_written_table(block, table):
    mask = np.asarray(mars_attention_mask(6, block))
    assert mask.shape == (1, 12, 12)
    np.testing.assert_array_equal(mask[0], table)


def test_mask_hides_padding_keys():
    valid = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    mask = np.asarray(mars_attention_mask(6, 2, jnp.asarray(valid)))
    assert mask.shape == (2, 12, 12)
    expected0 = MASK_L6_B2.copy()
    expected0[:, [4, 5, 10, 11]] = False
    np.testing.assert_array_equal(mask[0], expected0)
    np.testing.assert_array_equal(mask[1], MASK_L6_B2)


def test_length_not_multiple_of_block_is_an_error():
    with pytest.raises(ObjectiveError, match="not a multiple of block_size 4"):
        mars_attention_mask(6, 4)


@pytest.mark.parametrize("block", [2, 3, 4])
def test_label_alignment_distances(block):
    """Masked offset j targets the token j + 2 past the last clean token it can see."""
    length = 12
    ids = np.arange(100, 100 + length)[None]
    batch = _batch(ids, np.ones_like(ids, bool), np.ones_like(ids, bool))
    inp = jax.tree.map(np.asarray, mars_inputs(batch, block, MASK_ID))
    mask, labels, weights = inp["attn_mask"][0], inp["labels"][0], inp["weights"][0]
    # every trained token in the masked stream is a mask; clean stream untouched
    np.testing.assert_array_equal(inp["tokens"][0, length:], np.full(length, MASK_ID))
    np.testing.assert_array_equal(inp["tokens"][0, :length], ids[0])
    np.testing.assert_array_equal(inp["positions"][0], np.r_[np.arange(length), np.arange(length)])
    distances = []
    for p in range(length):
        row = length + p
        if weights[row] == 0:
            continue
        target_pos = labels[row] - 100  # the ids are 100 + position
        visible_clean = np.flatnonzero(mask[row, :length])
        last_clean = visible_clean.max() if visible_clean.size else -1
        assert target_pos == p + 1
        assert target_pos - last_clean == p % block + 2
        distances.append(target_pos - last_clean)
        # the target token is invisible in both streams
        assert not mask[row, target_pos] and not mask[row, length + target_pos]
    assert sorted(set(distances)) == list(range(2, block + 2))
    # clean stream: next token, distance 1 from itself
    for p in range(length - 1):
        assert labels[p] == ids[0, p + 1] and weights[p] == 1
    # the last position of each stream has no in-sequence target
    assert weights[length - 1] == 0 and weights[2 * length - 1] == 0


def test_prompt_and_padding_carry_zero_weight(sft_batch):
    inp = jax.tree.map(np.asarray, mars_inputs(sft_batch, 4, MASK_ID))
    length = 12
    lm, valid, ids = (np.asarray(sft_batch[k]) for k in ("loss_mask", "valid", "input_ids"))
    for stream in (0, 1):
        w = inp["weights"][:, stream * length:(stream + 1) * length]
        # position p is weighted iff its target p + 1 is a trained, real token
        expected = np.zeros_like(w)
        expected[:, :-1] = lm[:, 1:] & valid[:, 1:]
        np.testing.assert_array_equal(w, expected)
    assert inp["weights"][0, [0, 1, 7, 8, 11]].sum() == 0  # prompt targets 1, 2; padding 8..11
    # prompt tokens stay real in the masked stream; response tokens become masks
    np.testing.assert_array_equal(inp["tokens"][0, length:length + 3], ids[0, :3])
    np.testing.assert_array_equal(inp["tokens"][0, length + 3:length + 8], np.full(5, MASK_ID))
    np.testing.assert_array_equal(inp["tokens"][0, length + 8:], ids[0, 8:])


def _expected_stream_loss(logits, batch, offset):
    """Independent loop: per-sequence mean NLL over trained targets, then mean over sequences."""
    ids, lm, valid = (np.asarray(batch[k]) for k in ("input_ids", "loss_mask", "valid"))
    logits = np.asarray(logits, np.float64)
    per_seq = []
    for r in range(ids.shape[0]):
        nll = []
        for p in range(ids.shape[1] - 1):
            if lm[r, p + 1] and valid[r, p + 1]:
                row = logits[r, offset + p]
                log_z = np.log(np.exp(row - row.max()).sum()) + row.max()
                nll.append(log_z - row[ids[r, p + 1]])
        if nll:
            per_seq.append(np.mean(nll))
    return np.mean(per_seq)


def test_clean_half_equals_ar_loss_and_losses_match_a_loop(model, sft_batch):
    loss, m = jax.jit(lambda b: mars_loss(model, b, block_size=4, mask_token_id=MASK_ID,
                                          ar_weight=0.5))(sft_batch)
    ar, ar_m = jax.jit(lambda b: ar_loss(model, b))(sft_batch)
    np.testing.assert_allclose(m["loss_clean"], ar, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, m["loss_masked"] + 0.5 * m["loss_clean"], rtol=1e-6)

    inp = mars_inputs(sft_batch, 4, MASK_ID)
    logits, _ = model(inp["tokens"], inp["positions"], inp["attn_mask"])
    np.testing.assert_allclose(m["loss_masked"], _expected_stream_loss(logits, sft_batch, 12), rtol=1e-5)
    np.testing.assert_allclose(m["loss_clean"], _expected_stream_loss(logits, sft_batch, 0), rtol=1e-5)
    lm, valid = np.asarray(sft_batch["loss_mask"]), np.asarray(sft_batch["valid"])
    expected_tokens = int((lm[:, 1:] & valid[:, 1:]).sum())
    assert float(m["tokens"]) == expected_tokens == float(ar_m["tokens"])

    # masked-stream top-1 accuracy by block offset, from the logits by hand
    labels, w = np.asarray(inp["labels"])[:, 12:], np.asarray(inp["weights"])[:, 12:]
    hit = np.asarray(jnp.argmax(logits[:, 12:], -1)) == labels
    for j in range(4):
        cols = np.arange(j, 12, 4)
        expected = (hit[:, cols] * w[:, cols]).sum() / max(w[:, cols].sum(), 1)
        np.testing.assert_allclose(m["masked_acc_by_pos"][j], expected, atol=1e-6)


def test_masked_stream_cannot_see_its_targets(model):
    """Perturbing token t leaves the logits at t-1 (the position that predicts it) unchanged."""
    length, block = 12, 4
    rng = np.random.default_rng(1)
    base = rng.integers(1, MASK_ID, size=length)
    rows = [base]
    for t in range(1, length):
        pert = base.copy()
        pert[t] = (pert[t] % (MASK_ID - 1)) + 1  # a different non-mask token
        rows.append(pert)
    ids = np.stack(rows)
    # first 2 tokens a prompt, so the masked stream also holds real tokens
    loss_mask = np.ones_like(ids, bool)
    loss_mask[:, :2] = False
    batch = _batch(ids, loss_mask, np.ones_like(ids, bool))
    inp = mars_inputs(batch, block, MASK_ID)
    logits = np.asarray(model(inp["tokens"], inp["positions"], inp["attn_mask"])[0])
    weights = np.asarray(inp["weights"])
    for t in range(1, length):
        for offset in (0, length):  # clean and masked stream
            assert weights[0, offset + t - 1] == (t >= 2)  # t-1 predicts t (trained unless prompt)
            np.testing.assert_allclose(logits[t, offset + t - 1], logits[0, offset + t - 1], atol=1e-6,
                                       err_msg=f"position {t - 1} (stream offset {offset}) sees its target {t}")
        # sensitivity check: the first masked position of the next block sees clean token t
        next_block_start = (t // block + 1) * block
        if next_block_start < length:
            diff = np.abs(logits[t, length + next_block_start] - logits[0, length + next_block_start]).max()
            assert diff > 1e-4, f"perturbing token {t} changed nothing downstream"


def test_mars_loss_differentiates_under_jit(model, sft_batch):
    graphdef, params = nnx.split(model)
    fn = make_loss_fn("mars", block_size=4, mask_token_id=MASK_ID)

    @jax.jit
    def grad(p, b):
        return jax.value_and_grad(lambda p: fn(nnx.merge(graphdef, p), b), has_aux=True)(p)

    (loss, metrics), grads = grad(params, sft_batch)
    assert np.isfinite(float(loss)) and metrics["masked_acc_by_pos"].shape == (4,)
    norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and max(norms) > 0


def test_make_loss_fn_errors():
    with pytest.raises(ObjectiveError, match="unknown objective 'bert'.*ar, mars"):
        make_loss_fn("bert")
    with pytest.raises(ObjectiveError, match="mask_token_id"):
        make_loss_fn("mars", block_size=4)
    with pytest.raises(ObjectiveError, match="block_size"):
        make_loss_fn("mars", mask_token_id=3)
    with pytest.raises(ObjectiveError, match="objective=commit_head trains only the verifier's small head"):
        make_loss_fn("commit_head", block_size=4, mask_token_id=3)
    assert make_loss_fn("ar") is ar_loss and set(LOSS_FNS) == {"ar", "mars"}
