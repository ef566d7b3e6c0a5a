"""HF directories that transformers loads in a particular way: the converter must read them the
same way (transformers is the oracle), and its outputs must be usable like any other files."""

import json
import os
import stat

import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

from tests.hf_models import make_hf_qwen2, our_logits, random_tokens, reload_hf, torch_logits
from prove_jax.checkpoints import convert
from prove_jax.checkpoints.checkpoint import load_model
from prove_jax.models.config import ConfigError


def _converted_error(hf_dir, ckpt) -> float:
    """Max |logit| difference between transformers' load of hf_dir and our conversion of it."""
    convert.hf_to_flax(str(hf_dir), str(ckpt))
    tokens = random_tokens(length=32)
    return np.abs(our_logits(load_model(str(ckpt)), tokens) - torch_logits(reload_hf(hf_dir), tokens)).max()


def test_official_qwen25_window_settings_are_full_attention(tmp_path):
    # Qwen2.5 configs carry sliding_window and max_window_layers below the layer count, with
    # use_sliding_window false: transformers attends to everything, and so do we.
    make_hf_qwen2(tmp_path / "hf", seed=1, use_sliding_window=False, sliding_window=8, max_window_layers=1)
    assert _converted_error(tmp_path / "hf", tmp_path / "ckpt") <= 1e-4


def test_single_file_wins_over_a_stale_index_as_in_transformers(tmp_path):
    """save_pretrained re-saving a sharded model unsharded leaves the old index behind."""
    hf = make_hf_qwen2(tmp_path / "hf", seed=2)
    hf.save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(-1.5)  # the weights the stale shards do not hold
    hf.save_pretrained(str(tmp_path / "hf"))
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    assert _converted_error(tmp_path / "hf", tmp_path / "ckpt") <= 1e-4


def test_tied_checkpoint_holding_only_lm_head_converts(tmp_path):
    """safetensors' save_model keeps one name per shared tensor, the first in sort order:
    lm_head.weight for a tied Qwen2, with no model.embed_tokens.weight."""
    hf = make_hf_qwen2(tmp_path / "hf", seed=3, tie_word_embeddings=True)
    os.remove(tmp_path / "hf" / "model.safetensors")
    safetensors.torch.save_model(hf, str(tmp_path / "hf" / "model.safetensors"))
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
        keys = set(json.loads(f.read(int.from_bytes(f.read(8), "little"))))
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" not in keys
    assert _converted_error(tmp_path / "hf", tmp_path / "ckpt") <= 1e-4


def test_generation_config_ids_we_lack_survive_the_round_trip(tmp_path):
    """Qwen2.5-Instruct names its pad token only in generation_config.json."""
    make_hf_qwen2(tmp_path / "hf", seed=4, pad_token_id=None)
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(
        {"pad_token_id": 7, "eos_token_id": [1, 2], "temperature": 0.7, "top_p": 0.8}))
    convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    convert.flax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    gen = transformers.GenerationConfig.from_pretrained(str(tmp_path / "back"))
    assert (gen.pad_token_id, gen.eos_token_id, gen.temperature, gen.top_p) == (7, [1, 2], 0.7, 0.8)
    # and the checkpoint knows it: decoding pads with it instead of falling back to eos
    assert load_model(str(tmp_path / "ckpt")).cfg.pad_token_id == 7
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": ["2"]}))
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id must be an id or "
                                          r"a list of ids, got \['2'\]"):
        convert.read_hf_config(str(tmp_path / "hf"))


def test_outputs_get_the_umask_permissions_and_follow_a_symlinked_target(tmp_path):
    make_hf_qwen2(tmp_path / "hf", seed=5)
    old = os.umask(0o022)
    try:
        convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
        convert.flax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
        (tmp_path / "disk").mkdir()
        (tmp_path / "link").symlink_to(tmp_path / "disk" / "ckpt")
        convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "link"))
    finally:
        os.umask(old)
    for d in ("ckpt", "back", "disk/ckpt"):
        assert stat.S_IMODE(os.stat(tmp_path / d).st_mode) == 0o755, d
    assert stat.S_IMODE(os.stat(tmp_path / "back" / "config.json").st_mode) == 0o644
    assert (tmp_path / "link").is_symlink() and os.path.isdir(tmp_path / "disk" / "ckpt" / "params")
    assert sorted(os.listdir(tmp_path)) == ["back", "ckpt", "disk", "hf", "link"]  # no temp left over
    load_model(str(tmp_path / "link"))


def test_tied_config_with_a_different_head_in_the_file_converts_untied_as_in_transformers(tmp_path, capsys):
    """transformers 5 keeps a file's lm_head.weight that differs from the embedding (it warns and
    does not tie) even under tie_word_embeddings: true; dropping it gave other logits. An equal
    copy is still dropped and the model stays tied."""
    hf = make_hf_qwen2(tmp_path / "hf", seed=6, tie_word_embeddings=True)
    state = {k: v.detach().clone().contiguous() for k, v in hf.state_dict().items()}
    safetensors.torch.save_file(state, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert convert.read_hf_config(str(tmp_path / "hf")).tie_word_embeddings  # an equal copy
    head = torch.randn_like(state["model.embed_tokens.weight"])
    safetensors.torch.save_file(state | {"lm_head.weight": head}, str(tmp_path / "hf" / "model.safetensors"),
                                metadata={"format": "pt"})
    assert _converted_error(tmp_path / "hf", tmp_path / "ckpt") <= 1e-4
    assert "converting untied" in capsys.readouterr().err
    model = load_model(str(tmp_path / "ckpt"))
    assert not model.cfg.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]), head.numpy())
