"""What a training forward keeps for the backward pass: one rematerialisation policy per decoder
layer, named in the config (`model.remat`).

Each layer's forward runs under `jax.checkpoint` with a JAX policy that decides which of its
intermediates are saved; everything else is recomputed from the layer's input in the backward
pass. The projections are tagged with `checkpoint_name` (attention.py, qwen2.py's MLP), which is
the identity outside a checkpoint, so decoding is unchanged. Memory and compile time of each
policy at the 32B shape: benchmarks/tpu_compile.md.
"""

from __future__ import annotations

from types import MappingProxyType

import jax

from prove_jax.errors import ProveJaxError

# checkpoint_name tags of the projection outputs [B, T, ...] inside a decoder layer
ATTN_PROJ_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJ_NAMES = ("gate_proj", "up_proj", "down_proj")

REMAT_POLICIES = MappingProxyType({
    "none": "no rematerialisation: every intermediate of every layer is kept (most memory)",
    "full": "keep only each layer's input; recompute the whole layer (least memory, +1 forward)",
    "dots": "keep every projection (matmuls without batch dimensions); recompute attention "
            "scores, softmax, norms, RoPE and activations",
    "attn_proj": "keep the attention projections q, k, v, o; recompute the MLP and the rest",
})


class RematError(ProveJaxError, ValueError):
    """An unknown rematerialisation policy name."""


def remat_name(value: str | bool) -> str:
    """The policy name of a config value: a name from REMAT_POLICIES, or a bool from configs
    written before the policies existed (true = full, false = none)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):  # `model.remat=true` typed
        value = value.lower() == "true"
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in REMAT_POLICIES:
        raise RematError(f"model.remat must be one of {', '.join(REMAT_POLICIES)} (or true = full, "
                         f"false = none), got {value!r}")
    return value


def checkpoint_policy(name: str):
    """The `jax.checkpoint` policy of a named remat policy (None for full: save nothing)."""
    policies = jax.checkpoint_policies
    return {"full": None,
            "dots": policies.dots_with_no_batch_dims_saveable,
            "attn_proj": policies.save_only_these_names(*ATTN_PROJ_NAMES)}[name]


def with_remat(fn, name: str, prevent_cse: bool = True):
    """`fn` rematerialised under policy `name` ("none": `fn` itself). Inside a scan pass
    prevent_cse=False (the scan already keeps the recomputation apart; JAX's advice)."""
    name = remat_name(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=checkpoint_policy(name), prevent_cse=prevent_cse)
