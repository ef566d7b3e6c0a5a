"""checkpoints/convert.py against transformers: a tied checkpoint with a stored head copy and a
large norm eps round-trips, and a bfloat16 checkpoint converts bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _torch_and_ours(hf_model, ckpt, tokens):
    import torch
    from prove_jax.checkpoints.checkpoint import load_model
    from prove_jax.models.attention import causal_mask
    with torch.no_grad():
        ref = hf_model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    b, t = tokens.shape
    ours, _ = load_model(str(ckpt))(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)),
                                    causal_mask(b, t))
    return ref, np.asarray(ours)


def test_tied_checkpoint_with_a_stray_head_copy_and_a_large_norm_eps_round_trips(tmp_path):
    """transformers is the oracle. A tied Qwen2 file that also stores lm_head.weight (a copy:
    transformers ignores it and ties) converts; rms_norm_eps is read from config.json and
    written back (1e-6, the default everywhere else in the suite, would hide either)."""
    import safetensors.torch
    import transformers
    from prove_jax.checkpoints import convert
    from tests.hf_models import make_hf_qwen2
    hf = make_hf_qwen2(tmp_path / "hf", seed=6, tie_word_embeddings=True, rms_norm_eps=0.05)
    weights = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    safetensors.torch.save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 0.05
    tokens = np.random.RandomState(0).randint(0, 256, (2, 12)).astype(np.int32)
    ref, ours = _torch_and_ours(hf, tmp_path / "ckpt", tokens)
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()
    convert.flax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert back.config.rms_norm_eps == 0.05
    ref_back, _ = _torch_and_ours(back, tmp_path / "ckpt", tokens)
    assert np.abs(ref_back - ref).max() <= 1e-5


def test_a_bfloat16_hf_checkpoint_converts_to_bfloat16_bit_for_bit(tmp_path):
    """convert.hf_to_flax: the stored dtype defaults to the HF config's; the BF16 tensors torch
    wrote are read exactly (the oracle is torch's own state dict)."""
    import torch
    from prove_jax.checkpoints import convert
    from prove_jax.checkpoints.checkpoint import load_model
    from prove_jax.checkpoints.hf_weights import ours_to_hf
    from prove_jax.models.params import flat_params
    from tests.hf_models import make_hf_qwen2
    hf = make_hf_qwen2(tmp_path / "f32", seed=8).to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path / "hf"))
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert cfg.param_dtype == "bfloat16"
    flat = {k: np.asarray(v) for k, v in flat_params(load_model(str(tmp_path / "ckpt"))).items()}
    assert {str(v.dtype) for v in flat.values()} == {"bfloat16"}
    ref = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    got = dict(ours_to_hf(flat, cfg))
    assert set(got) == set(ref)
    for name, array in got.items():
        np.testing.assert_array_equal(array.astype(np.float32), ref[name], err_msg=name)
