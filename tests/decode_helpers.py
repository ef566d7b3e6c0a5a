"""What the decoding tests share: the small random model's config (`CFG`), its prompts, and the
requests the files that compare a run with greedy AR decode (six prompts, without EOS)."""

import os

import jax
import numpy as np
from flax import nnx

from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, mask_token_id=95, eos_token_ids=(1,))


def random_prompts(seed=0, lengths=(3, 9, 1, 14)):
    rs = np.random.RandomState(seed)
    return [rs.randint(2, 90, n).tolist() for n in lengths]


def tau_in_widest_middle_gap(values: np.ndarray) -> float:
    """A threshold between two of `values` (away from both, so float noise cannot flip a
    comparison), from the middle half so that some tokens pass and some do not."""
    v = np.sort(values)
    lo, hi = len(v) // 4, 3 * len(v) // 4
    i = lo + int(np.argmax(np.diff(v)[lo:hi]))
    return float((v[i] + v[i + 1]) / 2)


def load_or_shard(model, mesh):
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, sharding.state_shardings(state, mesh))
    return nnx.merge(graphdef, state)


PROMPTS = random_prompts(6, (20, 3, 9, 2, 17))
NEW = 24
NO_EOS = [-1]
