"""The learned commit head: a small MLP on the verifier that predicts how much of the
proposer's block to commit (trained by `prove_jax.training.commit_head_training`).

For each proposed token D_{i+1} it reads the verifier's hidden state at D_i plus three cheap
verifier statistics (log p_V(D_{i+1}), whether D_{i+1} is the verifier's top-1, the entropy)
and predicts whether D_{i+1} still equals the proposer's own greedy AR token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from prove_jax.models.tokens import greedy_tokens

HEAD_DIR = "commit_head"  # the head's folder inside a verifier checkpoint


class CommitHead(nnx.Module):
    def __init__(self, hidden_size: int, width: int = 64, threshold: float = 0.5, *,
                 rngs: nnx.Rngs):
        self.hidden_size, self.width, self.threshold = hidden_size, width, threshold
        self.in_proj = nnx.Linear(hidden_size + 3, width, rngs=rngs)
        self.out_proj = nnx.Linear(width, 1, rngs=rngs)

    @staticmethod
    def features(hidden, vlogits, nxt):
        """[B, J, D + 3] from verifier hidden [B,J,D], logits [B,J,V] and next tokens [B,J]."""
        logp = jax.nn.log_softmax(vlogits.astype(jnp.float32), axis=-1)
        lp_next = jnp.take_along_axis(logp, nxt[..., None], axis=-1)
        top1 = (greedy_tokens(logp) == nxt)[..., None].astype(jnp.float32)
        entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1, keepdims=True)
        return jnp.concatenate([hidden.astype(jnp.float32), lp_next, top1, entropy], axis=-1)

    def __call__(self, hidden, vlogits, nxt) -> jax.Array:
        """Accept logits [B, J]."""
        h = jax.nn.gelu(self.in_proj(self.features(hidden, vlogits, nxt)))
        return self.out_proj(h)[..., 0]

    def accept(self, hidden, vlogits, nxt, threshold: float | None = None) -> jax.Array:
        """Commit D_{i+1} while the head's probability >= threshold (default: its own)."""
        t = self.threshold if threshold is None else threshold
        return jax.nn.sigmoid(self(hidden, vlogits, nxt)) >= t


def predicted_length(accept) -> jax.Array:
    return 1 + jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1)
