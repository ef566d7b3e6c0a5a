"""Training objectives: plain next-token (AR) loss and the MARS masked-block loss.

MARS (docs/method.md section 2) runs one forward over [clean stream, masked stream] (2L
positions, both with position ids 0..L-1) and keeps the AR label shift over the whole 2L
sequence: masked offset j of a block learns distance j + 2, so the last offset learns B + 1,
trained as in the reference. The two positions whose shifted label crosses a stream boundary
carry zero weight. Batches come from data/pipeline.py (`input_ids`, `loss_mask`, `valid`, [B, L]).

A packed batch (data `pack_documents`) also has `segment_ids` and `positions` [B, L]: several
documents per row. Then no token attends across documents in either stream, positions and
MARS blocks restart at each document, no target crosses one, and losses average per document.
A batch without them runs exactly the unpacked program.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from prove_jax.errors import ProveJaxError
from prove_jax.models.attention import causal_mask
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions

OBJECTIVES = ("ar", "mars")


class ObjectiveError(ProveJaxError, ValueError):
    """An objective that cannot be built from the given settings."""


def _check_block(length: int, block_size: int) -> None:
    if block_size <= 0:
        raise ObjectiveError(f"block_size must be positive, got {block_size}")
    if length % block_size:
        raise ObjectiveError(f"sequence length {length} is not a multiple of block_size "
                             f"{block_size}")


def same_document(segment_ids: jax.Array) -> jax.Array:
    """bool [B, L, L]: query and key lie in one document (segment id > 0; 0 is padding)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, L, L] causal mask of packed rows: each token sees its own document's earlier tokens."""
    length = segment_ids.shape[1]
    return jnp.tril(jnp.ones((length, length), bool))[None] & same_document(segment_ids)


def mars_attention_mask(length: int, block_size: int, valid: jax.Array | None = None, *,
                        segment_ids: jax.Array | None = None,
                        positions: jax.Array | None = None) -> jax.Array:
    """Boolean [B or 1, 2L, 2L] mask (query rows, key columns; True = may attend).

    Rows/columns 0..L-1 are the clean stream, L..2L-1 the masked stream. `valid` [B, L] hides
    right-padding keys in both streams. Packed rows give `segment_ids` and `positions` [B, L]
    instead: every rule also needs one document, and blocks count from each document's start.
    """
    _check_block(length, block_size)
    if segment_ids is not None:
        return _packed_mars_mask(length, block_size, segment_ids, positions)
    pos = jnp.arange(length)
    blk = pos // block_size
    causal = pos[None, :] <= pos[:, None]                # [Lq, Lk]
    same_block = blk[:, None] == blk[None, :]
    earlier_block = blk[None, :] < blk[:, None]
    # clean -> masked: never
    clean_rows = jnp.concatenate([causal, jnp.zeros_like(causal)], axis=1)
    masked_rows = jnp.concatenate([earlier_block, causal & same_block], axis=1)
    mask = jnp.concatenate([clean_rows, masked_rows], axis=0)[None]  # [1, 2L, 2L]
    if valid is not None:
        key_valid = jnp.concatenate([valid, valid], axis=-1).astype(bool)  # [B, 2L]
        mask = mask & key_valid[:, None, :]
    return mask


def _packed_mars_mask(length: int, block_size: int, segment_ids: jax.Array,
                      positions: jax.Array) -> jax.Array:
    """`mars_attention_mask` of packed rows: [B, 2L, 2L]."""
    if positions is None:
        raise ObjectiveError("packed rows need positions beside segment_ids")
    idx = jnp.arange(length)
    causal = (idx[None, :] <= idx[:, None])[None]             # [1, Lq, Lk]
    same_doc = same_document(segment_ids)                     # [B, Lq, Lk]
    blk = positions // block_size                             # [B, L]: blocks restart per document
    same_block = blk[:, :, None] == blk[:, None, :]
    earlier_block = blk[:, None, :] < blk[:, :, None]
    clean_rows = jnp.concatenate([causal & same_doc, jnp.zeros_like(same_doc)], axis=2)
    masked_rows = jnp.concatenate([earlier_block & same_doc, causal & same_block & same_doc],
                                  axis=2)
    return jnp.concatenate([clean_rows, masked_rows], axis=1)


def next_token_targets(batch) -> tuple[jax.Array, jax.Array]:
    """labels [B, L] = input_ids shifted left by one; weights f32 [B, L] (1 = trained target).
    In packed rows a document's last token has no target (the next token is another's)."""
    ids = batch["input_ids"]
    trained = jnp.logical_and(batch["loss_mask"], batch["valid"])
    labels = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)
    weights = jnp.concatenate([trained[:, 1:], jnp.zeros_like(trained[:, :1])], axis=1)
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
        same = jnp.concatenate([seg[:, 1:] == seg[:, :-1], jnp.zeros_like(seg[:, :1], bool)],
                               axis=1)
        weights = weights & same
    return labels, weights.astype(jnp.float32)


def mars_inputs(batch, block_size: int, mask_token_id: int) -> dict[str, jax.Array]:
    """The two-stream model inputs and targets for one batch.

    Returns tokens, positions int32 [B, 2L], attn_mask bool [B, 2L, 2L], labels int32 [B, 2L]
    and weights f32 [B, 2L]; stream position p (either half) targets input_ids[p + 1]. Packed
    rows take their positions from the batch (restarting per document) in both halves.
    """
    ids = batch["input_ids"]
    b, length = ids.shape
    _check_block(length, block_size)
    masked_ids = jnp.where(batch["loss_mask"], jnp.asarray(mask_token_id, ids.dtype), ids)
    tokens = jnp.concatenate([ids, masked_ids], axis=1)
    if "segment_ids" in batch:
        pos = batch["positions"].astype(jnp.int32)
        positions = jnp.concatenate([pos, pos], axis=1)
        attn_mask = mars_attention_mask(length, block_size, segment_ids=batch["segment_ids"],
                                        positions=pos)
    else:
        pos = jnp.arange(length, dtype=jnp.int32)
        positions = jnp.broadcast_to(jnp.concatenate([pos, pos])[None], (b, 2 * length))
        attn_mask = jnp.broadcast_to(mars_attention_mask(length, block_size, batch["valid"]),
                                     (b, 2 * length, 2 * length))
    labels, weights = next_token_targets(batch)
    return dict(tokens=tokens, positions=positions, attn_mask=attn_mask,
                labels=jnp.concatenate([labels, labels], axis=1).astype(jnp.int32),
                weights=jnp.concatenate([weights, weights], axis=1))


def token_nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, T] from logits [B, T, V], in float32."""
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return log_z - target


def sequence_mean(values: jax.Array, weights: jax.Array,
                  segment_ids: jax.Array | None = None) -> jax.Array:
    """Mean over each row's weighted tokens, then over the rows that have any ([B, T] -> []).
    With `segment_ids` [B, T] (packed rows) each document of a row is one sequence."""
    if segment_ids is not None:
        return _document_mean(values, weights, segment_ids)
    per_row_w = weights.sum(-1)
    per_row = (values * weights).sum(-1) / jnp.maximum(per_row_w, 1.0)
    has_tokens = (per_row_w > 0).astype(jnp.float32)
    return (per_row * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)


def _per_document(x: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Sums of x [B, T] per (row, segment id): flat [B * (T + 1)], segment 0 (padding) included."""
    b, t = x.shape
    ids = (segment_ids + (t + 1) * jnp.arange(b)[:, None]).reshape(-1)
    return jax.ops.segment_sum(x.reshape(-1), ids, b * (t + 1))


def _document_mean(values, weights, segment_ids):
    per_doc_w = _per_document(weights, segment_ids)
    per_doc = _per_document(values * weights, segment_ids) / jnp.maximum(per_doc_w, 1.0)
    has_tokens = (per_doc_w > 0).astype(jnp.float32)
    return (per_doc * has_tokens).sum() / jnp.maximum(has_tokens.sum(), 1.0)


def _sequences(weights: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Sequences (rows, or documents of packed rows) with any trained target."""
    if segment_ids is not None:
        return (_per_document(weights, segment_ids) > 0).sum().astype(jnp.float32)
    return (weights.sum(-1) > 0).sum().astype(jnp.float32)


def _real_tokens(batch) -> jax.Array:
    """Tokens of the data in the batch, row padding left out: what throughput counts."""
    return batch["valid"].sum().astype(jnp.float32)


def mars_loss(model, batch, *, block_size: int, mask_token_id: int, ar_weight: float = 1.0,
              compute: ComputeOptions = DEFAULT_COMPUTE) -> tuple[jax.Array, dict[str, jax.Array]]:
    """CE(masked stream) + ar_weight * CE(clean stream), one forward of the 2L sequence.

    metrics: loss, loss_masked, loss_clean, masked_acc_by_pos f32 [block_size] (top-1 accuracy
    of the masked stream at each in-block offset j, which predicts distance j + 2), tokens
    (trained targets per stream), sequences (rows, or packed documents, with any trained
    target), real_tokens (the batch's tokens without row padding).
    """
    inp = mars_inputs(batch, block_size, mask_token_id)
    length = batch["input_ids"].shape[1]
    seg = batch.get("segment_ids")
    # [B, 2L, V] f32
    logits, _ = model(inp["tokens"], inp["positions"], inp["attn_mask"], compute=compute)
    nll = token_nll(logits, inp["labels"])
    w = inp["weights"]
    loss_clean = sequence_mean(nll[:, :length], w[:, :length], seg)
    loss_masked = sequence_mean(nll[:, length:], w[:, length:], seg)
    loss = loss_masked + ar_weight * loss_clean

    b = logits.shape[0]
    correct = (jnp.argmax(logits[:, length:], axis=-1) == inp["labels"][:, length:])
    hit = correct.astype(jnp.float32) * w[:, length:]
    if seg is None:
        by_pos_w = w[:, length:].reshape(b, length // block_size, block_size)
        by_pos_hit = hit.reshape(by_pos_w.shape)
        acc_by_pos = by_pos_hit.sum((0, 1)) / jnp.maximum(by_pos_w.sum((0, 1)), 1.0)
    else:  # offsets within each document's own blocks
        offset = jax.nn.one_hot(inp["positions"][:, :length] % block_size, block_size)  # [B, L, K]
        acc_by_pos = (jnp.einsum("bl,blk->k", hit, offset)
                      / jnp.maximum(jnp.einsum("bl,blk->k", w[:, length:], offset), 1.0))
    metrics = dict(loss=loss, loss_masked=loss_masked, loss_clean=loss_clean,
                   masked_acc_by_pos=acc_by_pos, tokens=w[:, :length].sum(),
                   sequences=_sequences(w[:, :length], seg), real_tokens=_real_tokens(batch))
    return loss, metrics


def ar_loss(model, batch, *, compute: ComputeOptions = DEFAULT_COMPUTE
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Plain causal next-token loss with the same per-sequence averaging as mars_loss."""
    ids = batch["input_ids"]
    b, length = ids.shape
    seg = batch.get("segment_ids")
    if seg is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32)[None], (b, length))
        mask = causal_mask(b, length, batch["valid"])
    else:
        positions, mask = batch["positions"].astype(jnp.int32), packed_causal_mask(seg)
    logits, _ = model(ids, positions, mask, compute=compute)
    labels, w = next_token_targets(batch)
    loss = sequence_mean(token_nll(logits, labels), w, seg)
    return loss, dict(loss=loss, loss_clean=loss, tokens=w.sum(), sequences=_sequences(w, seg),
                      real_tokens=_real_tokens(batch))


LOSS_FNS: dict[str, Callable] = {"ar": ar_loss, "mars": mars_loss}


def make_loss_fn(objective: str, *, block_size: int | None = None, mask_token_id: int | None = None,
                 ar_weight: float = 1.0, compute: ComputeOptions | None = None) -> Callable:
    """`loss_fn(model, batch) -> (loss, metrics)` for objective 'ar' or 'mars'; the train step
    (step.build_step_fn) differentiates it. 'ar' ignores the MARS settings; 'mars' needs
    block_size and mask_token_id. `compute`: how the forward is computed, resolved on the host
    (`ComputeOptions.resolve`) by the train step, so that its trace reads fields only; None:
    the defaults.
    """
    bound = {} if compute is None else {"compute": compute}
    if objective == "commit_head":  # trained by training/commit_head_training.py, not this step
        raise ObjectiveError("objective=commit_head trains only the verifier's small head "
                             "(prove_jax/training/commit_head_training.py), not through the train "
                             "step")
    if objective not in LOSS_FNS:
        raise ObjectiveError(f"unknown objective {objective!r}; "
                             f"valid objectives: {', '.join(OBJECTIVES)}")
    if objective == "ar":
        return functools.partial(ar_loss, **bound) if bound else ar_loss
    if block_size is None or block_size <= 0:
        raise ObjectiveError(f"objective 'mars' needs a positive block_size, got {block_size}")
    if mask_token_id is None:
        raise ObjectiveError("objective 'mars' needs mask_token_id (add <|mask|> with "
                             "prove_jax.checkpoints.vocab.ensure_mask_token)")
    return functools.partial(mars_loss, block_size=int(block_size),
                             mask_token_id=int(mask_token_id), ar_weight=float(ar_weight), **bound)
