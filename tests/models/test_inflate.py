"""Inflation (`prove_jax.models.inflate`): a model embedded in a larger shape computes what it computed.

Oracle: transformers. The inflated weights, exported with our flax-to-hf, must give torch the
logits torch gives for the source weights, and our decoder on the inflated model must
reproduce transformers' greedy `generate` of the source model.
"""

import numpy as np
import pytest

from prove_jax import assets
from prove_jax.evaluation.model_pair import load_pair
from prove_jax.checkpoints import convert
from prove_jax.checkpoints.checkpoint import load_model, save_model
from prove_jax.models.config import ConfigError, ModelConfig, preset
from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule
from prove_jax.models.inflate import inflate, inflated_config
from tests.hf_models import hf_greedy, make_hf_qwen2
from tests.models.test_parity import our_logits, reload_hf, torch_logits

# Source: TINY (hidden 64, 4 heads over 2 kv heads, head_dim 16, 2 layers, MLP 128).
# Target: wider everywhere, 3 query heads per kv head, an extra kv head and two extra layers.
SHAPE = ModelConfig(vocab_size=1, hidden_size=80, intermediate_size=160, num_layers=4, num_heads=9,
                    num_kv_heads=3, head_dim=16)


@pytest.mark.parametrize("tied,head_dim", [(False, 32), (True, 16)])
def test_inflated_weights_give_torch_the_source_logits(tmp_path, tied, head_dim):
    hf = make_hf_qwen2(tmp_path / "hf", seed=4 + tied, tie_word_embeddings=tied, eos_token_id=5)
    convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    small = load_model(str(tmp_path / "ckpt"))
    # The HF model has no <|mask|>; for lossless decoding any id works (its drafts just miss).
    small.cfg = small.cfg.replace(mask_token_id=255)
    big = inflate(small, SHAPE.replace(head_dim=head_dim))
    assert (big.cfg.hidden_size, big.cfg.intermediate_size, big.cfg.num_layers, big.cfg.num_heads,
            big.cfg.num_kv_heads, big.cfg.head_dim, big.cfg.vocab_size) == (80, 160, 4, 9, 3, head_dim, 256)
    assert big.cfg.rope_theta == pytest.approx(small.cfg.rope_theta ** (head_dim / 16))
    save_model(str(tmp_path / "big"), big)
    convert.flax_to_hf(str(tmp_path / "big"), str(tmp_path / "big_hf"))

    tokens = np.random.RandomState(0).randint(0, 256, (2, 24)).astype(np.int32)
    ref = torch_logits(hf, tokens)
    assert np.abs(torch_logits(reload_hf(tmp_path / "big_hf"), tokens) - ref).max() <= 1e-4
    assert np.abs(our_logits(big, tokens) - ref).max() <= 1e-4

    # Our decoder on the inflated model reproduces transformers' greedy decode of the source,
    # in AR and lossless.
    prompts = [[7, 30, 2, 99, 14], [200, 3]]
    refs = hf_greedy(hf, prompts, 12, eos_id=5)
    for options in (DecodeOptions("ar"), DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))):
        assert Decoder(big, [5], options).generate(prompts, 12).output_ids == refs


def test_inflate_refuses_a_smaller_or_incompatible_shape():
    src = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="hidden_size 32 < 64"):
        inflated_config(src, src.replace(hidden_size=32))
    with pytest.raises(ConfigError, match="head_dim 8 < 16"):
        inflated_config(src, src.replace(head_dim=8))
    with pytest.raises(ConfigError, match="head_dim 17 is odd"):
        inflated_config(src, src.replace(head_dim=17))
    with pytest.raises(ConfigError, match="query heads per kv head 1 < 2"):
        inflated_config(src, src.replace(num_heads=4, num_kv_heads=4))
    cfg = inflated_config(src, SHAPE)
    assert cfg.rms_norm_eps == pytest.approx(src.rms_norm_eps * 64 / 80)
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta) == (64, 16, src.rope_theta)
    assert inflated_config(src, SHAPE.replace(head_dim=64)).rope_theta == pytest.approx(src.rope_theta ** 4)


def test_benchmark_loads_the_demo_proposer_inflated_to_a_preset():
    pair = load_pair(assets.DEMO_PROPOSER, inflate_to="qwen2.5-0.5b")
    small = load_model(assets.DEMO_PROPOSER, dtype="float32", param_dtype="float32")
    shape = preset("qwen2.5-0.5b")
    got = pair.proposer.cfg
    assert (got.hidden_size, got.num_layers, got.num_heads, got.intermediate_size) == \
        (shape.hidden_size, shape.num_layers, shape.num_heads, shape.intermediate_size)
    assert got.vocab_size == small.cfg.vocab_size  # the demo tokenizer still applies
    tokens = np.array([[5, 100, 2000, 37, 9]], np.int32)
    np.testing.assert_allclose(our_logits(pair.proposer, tokens), our_logits(small, tokens), atol=1e-4)
    with pytest.raises(ConfigError, match="unknown preset"):
        load_pair(assets.DEMO_PROPOSER, inflate_to="qwen9-huge")


def test_inflating_a_bfloat16_model_keeps_every_weight_bfloat16():
    """The scaled norms and q weights were promoted to float32 (bfloat16 x a float32 factor)."""
    import jax.numpy as jnp
    from prove_jax.models.params import create_model, flat_params
    src = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, param_dtype="bfloat16")
    big = inflate(create_model(src, seed=0), SHAPE)
    assert {str(v.dtype) for v in flat_params(big).values()} == {"bfloat16"}
    assert big.cfg.param_dtype == "bfloat16" and jnp.dtype(big.embed[...].dtype) == jnp.bfloat16


def test_inflated_model_takes_the_shape_context_length():
    """Long-context timing (`prove-jax benchmark --inflate P --prompt-tokens N`) needs the
    preset's context, not the small source's."""
    src = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, max_position_embeddings=2048)
    assert inflated_config(src, preset("qwen2.5-0.5b")).max_position_embeddings == 32768
