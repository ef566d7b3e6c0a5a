"""decoding/loading.py: building a decoder from checkpoints: the verifier and its head from
the verifier's checkpoint, --dtype for the parameters too, EOS ids from the tokenizer when the
checkpoint has none, and the default mesh."""

from __future__ import annotations

import jax
import pytest

from prove_jax import assets
from prove_jax.checkpoints import checkpoint
from prove_jax.models.config import ModelConfig
from prove_jax.decoding import DecodeError, DecodeOptions, VerifyRule


def test_build_decoder_loads_the_verifier_and_its_head_from_the_verifier_checkpoint():
    from prove_jax.decoding.loading import build_decoder
    verifier_cfg = checkpoint.load_config(assets.DEMO_VERIFIER)
    proposer_cfg = checkpoint.load_config(assets.DEMO_PROPOSER)
    assert (verifier_cfg.num_layers, verifier_cfg.hidden_size) != (proposer_cfg.num_layers, proposer_cfg.hidden_size)
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("verify", 4),
                           verifier_path=assets.DEMO_VERIFIER)
    assert (dec.verifier_cfg.num_layers, dec.verifier_cfg.hidden_size) == (verifier_cfg.num_layers,
                                                                          verifier_cfg.hidden_size)
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="head")),
                           verifier_path=assets.DEMO_VERIFIER)
    assert dec.head_hidden_size == verifier_cfg.hidden_size


def test_build_decoder_dtype_sets_the_parameters_dtype_too():
    """--dtype is the compute and parameter dtype: the demo's bfloat16-stored weights are
    restored as float32 by default, and as bfloat16 when asked."""
    from prove_jax.decoding.loading import build_decoder
    assert checkpoint.load_config(assets.DEMO_PROPOSER).param_dtype == "bfloat16"
    for dtype in ("float32", "bfloat16"):
        dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"), dtype=dtype)
        assert {str(x.dtype) for x in jax.tree.leaves(dec.state)} == {dtype}


def test_a_checkpoint_without_eos_ids_stops_at_its_tokenizers_eos(tmp_path, demo_tok):
    from prove_jax.decoding.loading import build_decoder
    from prove_jax.models.params import create_model
    cfg = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(), pad_token_id=None)
    path = str(tmp_path / "ckpt")
    checkpoint.save_model(path, create_model(cfg, seed=0), tokenizer_dir=assets.DEMO_PROPOSER)
    dec, tok = build_decoder(path, DecodeOptions("ar"))
    assert tok is not None and list(dec.eos_ids) == [demo_tok.eos_token_id]
    assert dec.pad_id == demo_tok.eos_token_id


def test_parse_mesh_defaults_to_every_device_on_data_and_wants_three_sizes():
    from prove_jax.decoding.loading import parse_mesh
    n = len(jax.devices())
    assert n > 1  # conftest's simulated devices
    assert dict(parse_mesh(None).shape) == {"data": n, "fsdp": 1, "tensor": 1}
    for bad in ("2,4", "1,2,2,2"):
        with pytest.raises(DecodeError, match="three integers"):
            parse_mesh(bad)
