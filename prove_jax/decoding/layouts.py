"""Static per-step token layouts and their attention masks.

Every decoding step feeds the model a fixed-width row of T tokens. A layout says, per slot of
that row, which token goes there (pending committed token, draft, or `<|mask|>`), its position
offset, and which other slots of the same step it may see. All layouts are static numpy tables
built once per (mode, K, groups), so the compiled step has no data-dependent shapes.

Cache convention shared by all modes: the model's KV cache holds the committed tokens
[0, cache_len); the tokens of a step are written at slots cache_len + i (i = slot in the step
row). Whatever is written past the new cache_len is garbage that the next step overwrites.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LosslessLayout:
    """ProVe-lossless row: [t0, d_1..d_M, group_0 masks, ..., group_{G-1} masks].

    Group g serves acceptance length `accept_of_group[g]` = j: its M masks see t0, d_1..d_j
    (never d_{j+1}.. nor other groups) and sit at positions p0 + j + 1 .. p0 + j + M, so the mask
    at p0+j+1+r stands for the unknown token after d_j and predicts the one after it: exactly
    what MARS trains (a mask at p predicts p+1, seeing clean tokens before the block).
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
    def width(self) -> int:
        return 1 + self.num_drafts * (1 + len(self.accept_of_group))

    def group_start(self, g: int) -> int:
        return 1 + self.num_drafts * (1 + g)

    def offsets(self) -> np.ndarray:
        """Position of each slot relative to t0's position, [T]."""
        m = self.num_drafts
        off = list(range(m + 1))
        for j in self.accept_of_group:
            off += [j + 1 + r for r in range(m)]
        return np.asarray(off, np.int32)

    def intra_mask(self) -> np.ndarray:
        """bool [T, T]: may slot q attend slot k within the step."""
        m, t = self.num_drafts, self.width
        mask = np.zeros((t, t), bool)
        mask[: m + 1, : m + 1] = np.tril(np.ones((m + 1, m + 1), bool))
        for g, j in enumerate(self.accept_of_group):
            s = self.group_start(g)
            mask[s: s + m, : j + 1] = True  # t0, d_1..d_j
            mask[s: s + m, s: s + m] = np.tril(np.ones((m, m), bool))
        return mask


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
