"""The MARS loss (training/objectives.py) on logits chosen by hand: which positions are trained
targets (docs/method.md section 2: position p predicts token p + 1, trained when that token is a
response/text token and real) and the per-offset masked accuracy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from prove_jax.training.objectives import mars_loss


VOCAB, MASK_ID = 16, 15


def _fixed_logits_model(logits):
    """A stand-in for the model: returns the given [B, 2L, V] logits, whatever the inputs."""
    logits = jnp.asarray(logits, jnp.float32)

    def model(tokens, positions, attn_mask, compute=None):  # the model's forward signature
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
