"""Static per-step token layouts and their attention masks.

A step feeds each row a fixed-width row of T tokens; a layout says which token sits in each
slot (pending committed token, draft or `<|mask|>`), its position offset and which slots of
the step it may see, so the compiled step has no data-dependent shapes. Every mode keeps the
KV of committed tokens in [0, cache_len) and writes a step's slot i at cache_len + i; what lies
past the new cache_len is garbage the next step overwrites (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LosslessLayout:
    """ProVe-lossless row: [t0, d_1..d_M, group_0 masks, ..., group_{G-1} masks].

    Group g serves acceptance length j = min(`accept_of_group[g]`, the row's real drafts): its M
    masks see t0, d_1..d_j (never d_{j+1}.. nor other groups) and sit at positions p0 + j + 1 ..
    p0 + j + M, so the mask at p0+j+1+r stands for the unknown token after d_j and predicts the
    one after it: exactly what MARS trains (a mask at p predicts p+1, seeing clean tokens before
    the block). Capping at the real drafts (a step after a shifted commit has fewer, see
    `mode_steps.lossless_step`) keeps the top group on full acceptance, so the row gets a full block
    of fresh drafts again as soon as it accepts everything it was offered. The served lengths
    are per row, so positions and the intra-step mask are built per row ([B, T] and [B, T, T]).
    """
    num_drafts: int  # M = K - 1
    accept_of_group: tuple[int, ...]  # sorted, starts at 0

    @classmethod
    def build(cls, block_size: int, max_groups: int | None = None) -> "LosslessLayout":
        if block_size < 2:
            raise ValueError(f"lossless mode needs block_size >= 2, got {block_size}")
        m = block_size - 1
        g = block_size if max_groups is None else max(1, min(max_groups, block_size))
        # Group 0 must exist (a rejection at d_1 is always possible). The lowest acceptances
        # are the common ones after a rejection; full acceptance is the big win when the
        # proposer is right. Keep 0..g-2 and the full block.
        groups = tuple(range(g)) if g in (1, block_size) else tuple(range(g - 1)) + (m,)
        return cls(num_drafts=m, accept_of_group=groups)

    @property
    def num_groups(self) -> int:
        return len(self.accept_of_group)

    @property
    def width(self) -> int:
        return 1 + self.num_drafts * (1 + self.num_groups)

    def group_start(self, g):
        """Row slot of group g's first mask (g an int or an int array)."""
        return 1 + self.num_drafts * (1 + g)

    def served(self, num_valid: jax.Array) -> jax.Array:
        """Acceptance length each group serves per row, [B, G]: its static length, capped at the
        row's number of real drafts (a row can accept at most those, so the top group always
        serves full acceptance)."""
        return jnp.minimum(
            jnp.asarray(self.accept_of_group, jnp.int32)[None, :], num_valid[:, None]
        )

    def offsets(self, served: jax.Array) -> jax.Array:
        """Position of each slot relative to t0's position, [B, T], for served lengths [B, G]."""
        m = self.num_drafts
        b = served.shape[0]
        groups = served[:, :, None] + 1 + jnp.arange(m, dtype=jnp.int32)[None, None, :]  # [B, G, M]
        verify = jnp.broadcast_to(jnp.arange(m + 1, dtype=jnp.int32)[None], (b, m + 1))
        return jnp.concatenate([verify, groups.reshape(b, -1)], axis=1)

    def intra_mask(self, served: jax.Array) -> jax.Array:
        """bool [B, T, T]: may slot q attend slot k within the step. The verify slots are causal;
        group g's masks see t0, d_1..d_j (j = served[:, g]) and the earlier masks of their group."""
        m, t = self.num_drafts, self.width
        group_of = np.full(t, -1)
        rank = np.zeros(t, np.int32)
        for g in range(self.num_groups):
            s = self.group_start(g)
            group_of[s: s + m] = g
            rank[s: s + m] = np.arange(m)
        idx = np.arange(t)
        verify = group_of < 0
        static = (verify[:, None] & verify[None, :] & (idx[None, :] <= idx[:, None])) | (
            (group_of[:, None] == group_of[None, :])
            & ~verify[:, None]
            & (rank[None, :] <= rank[:, None])
        )
        j_of_slot = jnp.take(served, np.maximum(group_of, 0), axis=1)  # [B, T]
        sees_context = (~verify)[None, :, None] & verify[None, None, :] & (
            jnp.asarray(idx)[None, None, :] <= j_of_slot[:, :, None])
        return jnp.asarray(static)[None] | sees_context


def propose_layout(block_size: int):
    """Threshold / verify / AR proposer row: [pending (up to K), masks (K-1)], width 2K-1.

    A row has n_pending committed tokens whose KV is not yet written (1..K), then K-1 masks, then
    unused slots. Returns (width, fn building the per-row intra mask from n_pending).
    """
    width = block_size + block_size - 1

    def intra_mask(n_pending: jax.Array) -> jax.Array:
        """bool [B, T, T]: causal over the used slots [0, n_pending + K - 1)."""
        idx = jnp.arange(width)
        used = idx[None, :] < (n_pending[:, None] + block_size - 1)
        causal = idx[None, :, None] >= idx[None, None, :]
        return causal & used[:, None, :] & used[:, :, None] | (idx[:, None] == idx[None, :])[None]

    return width, intra_mask
