"""The <|mask|> token: inside padded rows (no resize) or grown embeddings (rows copied exactly)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from prove_jax.checkpoints.checkpoint import load_config, load_tokenizer, save_model
from prove_jax.models.config import ModelConfig
from prove_jax.models.attention import causal_mask
from prove_jax.models.params import create_model, flat_params
from prove_jax.models.sharding import make_mesh
from prove_jax.checkpoints.vocab import (MASK_TOKEN, VocabError, ensure_mask_token,
                                         grow_embeddings, save_tokenizer)
from tests.tokenizers_fixture import make_tokenizer


def _cfg(vocab_size, tied=False):
    return ModelConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)


def _logits(model, tokens):
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    return np.asarray(model(tokens, pos, causal_mask(b, t))[0])


def test_mask_token_fits_padded_rows():
    tok = make_tokenizer()  # 300 ids
    assert len(tok) == 300
    tok, cfg, grown = ensure_mask_token(tok, _cfg(320))
    assert not grown and cfg.vocab_size == 320 and cfg.mask_token_id == 300
    assert tok("a<|mask|>b", add_special_tokens=False)["input_ids"][1] == 300
    # idempotent: a second call finds the token and changes nothing
    tok, cfg2, grown2 = ensure_mask_token(tok, cfg)
    assert (cfg2, grown2, len(tok)) == (cfg, False, 301)


@pytest.mark.parametrize("tied", [False, True])
def test_grown_embeddings_copy_old_rows(tied):
    tok = make_tokenizer()
    old_cfg = _cfg(300, tied)
    model = create_model(old_cfg, seed=3)
    tok, cfg, grown = ensure_mask_token(tok, old_cfg)
    assert grown and cfg.vocab_size == 320 and cfg.mask_token_id == 300
    new = grow_embeddings(model, cfg)
    old_p, new_p = flat_params(model), flat_params(new)
    assert new_p["embed"].shape == (320, 32)
    np.testing.assert_array_equal(new_p["embed"][:300], old_p["embed"])
    np.testing.assert_allclose(new_p["embed"][300:], np.broadcast_to(old_p["embed"].mean(0), (20, 32)),
                               rtol=1e-6, atol=1e-7)
    if not tied:
        assert new_p["lm_head"].shape == (320, 32)
        np.testing.assert_array_equal(new_p["lm_head"][:300], old_p["lm_head"])
    else:
        assert "lm_head" not in new_p
    for name in old_p:
        if name not in ("embed", "lm_head"):
            np.testing.assert_array_equal(new_p[name], old_p[name])
    # the grown model runs, including on the mask token, and agrees with the old one on old ids
    tokens = np.array([[5, 17, 42, 99, 7, 250]])
    new_logits = _logits(new, tokens)
    assert new_logits.shape == (1, 6, 320)
    np.testing.assert_allclose(new_logits[..., :300], _logits(model, tokens), rtol=1e-5, atol=1e-5)
    assert np.isfinite(_logits(new, [[5, 300, 300, 7]])).all()


def test_grow_keeps_sharding():
    mesh = make_mesh((2, 2, 2))
    cfg = _cfg(300)
    model = create_model(cfg, seed=0, mesh=mesh)
    new = grow_embeddings(model, cfg.replace(vocab_size=320, mask_token_id=300))
    embed = flat_params(new)["embed"]
    assert isinstance(embed.sharding, NamedSharding) and embed.sharding.mesh == mesh
    assert embed.sharding.spec == flat_params(model)["embed"].sharding.spec
    np.testing.assert_array_equal(np.asarray(embed)[:300], np.asarray(flat_params(model)["embed"]))


def test_conflicting_mask_ids_are_errors():
    tok = make_tokenizer()
    with pytest.raises(VocabError, match="mask_token_id=310 but the tokenizer has no <\\|mask\\|>"):
        ensure_mask_token(tok, _cfg(320).replace(mask_token_id=310))
    tok, cfg, _ = ensure_mask_token(tok, _cfg(320))
    with pytest.raises(VocabError, match="maps <\\|mask\\|> to 300"):
        ensure_mask_token(tok, cfg.replace(mask_token_id=301))
    with pytest.raises(VocabError, match="cannot shrink"):
        grow_embeddings(create_model(_cfg(320)), _cfg(300))


def test_checkpoint_records_mask_token(tmp_path):
    tok = make_tokenizer()
    tok, cfg, grown = ensure_mask_token(tok, _cfg(300))
    model = grow_embeddings(create_model(_cfg(300)), cfg)
    path = str(tmp_path / "ckpt")
    save_model(path, model, cfg)
    names = save_tokenizer(tok, path)
    assert "tokenizer.json" in names
    assert load_config(path).mask_token_id == 300 and load_config(path).vocab_size == 320
    reloaded = load_tokenizer(path)
    assert reloaded.convert_tokens_to_ids(MASK_TOKEN) == 300
    # the reloaded pair is consistent: nothing to add or grow
    _, cfg2, grown2 = ensure_mask_token(reloaded, load_config(path))
    assert not grown2 and cfg2.mask_token_id == 300
