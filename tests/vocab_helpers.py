"""Models whose vocabularies are padded, as Qwen2.5's are (151,665 ids in 151,936 or 152,064 rows)."""

import jax.numpy as jnp

from prove_jax.models.params import create_model, flat_params, set_flat_params


def with_rows(model, rows: int, copy_of: int = 5, scale: float = 1.0):
    """`model` with its vocabulary padded to `rows` embedding (and LM head) rows, each new row
    `scale` times row `copy_of`. At scale 1 a new id ties its original's logit and the argmax
    keeps the lower id, so the padded model decodes exactly as `model`; above 1 it outbids the
    original: the model then emits ids past `model`'s rows."""
    flat = dict(flat_params(model))
    for name in ("embed", "lm_head"):
        if name not in flat:  # tied
            continue
        w = flat[name]
        extra = jnp.broadcast_to(w[copy_of] * scale, (rows - w.shape[0], w.shape[1]))
        flat[name] = jnp.concatenate([w, extra.astype(w.dtype)])
    padded = create_model(model.cfg.replace(vocab_size=rows))
    set_flat_params(padded, flat)
    return padded
