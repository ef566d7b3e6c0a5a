"""checkpoints/vocab.py: the mask token's row lies inside the vocabulary, grown to a multiple
of 64, and growing the embeddings changes nothing else in the config."""

from __future__ import annotations

import pytest

from tests.tokenizers_fixture import make_tokenizer


def test_a_grown_vocabulary_holds_the_mask_id_at_the_next_multiple_of_64():
    """The new id lands exactly on a multiple of 64 (a 320-token tokenizer): the rows must grow
    to the smallest multiple of 64 above it (384), not stay at 320 with the id outside."""
    from prove_jax.models.config import ModelConfig
    from prove_jax.checkpoints.vocab import ensure_mask_token
    tok = make_tokenizer(320)
    assert len(tok) == 320
    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    _, new_cfg, grown = ensure_mask_token(tok, cfg)
    assert grown and new_cfg.mask_token_id == 320
    assert new_cfg.vocab_size == min(v for v in range(64, 10_000, 64) if v > 320) == 384


def test_growing_embeddings_refuses_any_other_config_change():
    from prove_jax.models.config import ModelConfig
    from prove_jax.models.params import create_model
    from prove_jax.checkpoints.vocab import VocabError, grow_embeddings
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10_000.0)
    model = create_model(cfg, seed=0)
    with pytest.raises(VocabError, match="may only change vocab_size and mask_token_id"):
        grow_embeddings(model, cfg.replace(vocab_size=320, mask_token_id=300, rope_theta=1e6))
