"""Parity with transformers (torch CPU, the outside oracle): HF -> ours logits, and ours -> HF.

Each config is a random-init Qwen2ForCausalLM written by `save_pretrained`, converted with our
converter (library and CLI), and compared with torch's logits on the same tokens.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.hf_models import make_hf_qwen2, our_logits, random_tokens, reload_hf, torch_logits
from prove_jax.checkpoints import convert
from prove_jax.checkpoints.checkpoint import load_model
from prove_jax.cli import convert as convert_cli
from prove_jax.models.params import flat_params


# Together: tied and untied heads, GQA groups 1, 2 and 4, head_dim != hidden/heads, theta 1e6.
CONFIGS = {
    "untied_gqa2_theta1e6": dict(tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "tied_mha": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "untied_gqa4_head_dim24": dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2,
                                   head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "tied_mqa4_head_dim32_theta1e6": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=1,
                                          head_dim=32, num_hidden_layers=1,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}





def run_cli(capsys, *args) -> tuple[int, str]:
    """`prove-jax convert ARGS` in this process (the command's main, as the other CLI tests
    call it; tests/checkpoints/test_convert_errors.py starts it as a process): (exit code, stderr)."""
    code = convert_cli.main(list(args))
    return code, capsys.readouterr().err



@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_to_flax_logits_match_torch_and_round_trip(tmp_path, name):
    overrides = CONFIGS[name]
    hf = make_hf_qwen2(tmp_path / "hf", seed=len(name), **overrides)
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert cfg.rope_theta == overrides["rope_parameters"]["rope_theta"]
    assert cfg.head_dim == overrides.get("head_dim", 64 // overrides["num_attention_heads"])
    assert cfg.tie_word_embeddings == overrides["tie_word_embeddings"]

    tokens = random_tokens()
    ref = torch_logits(hf, tokens)
    ours = our_logits(load_model(str(tmp_path / "ckpt")), tokens)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, np.abs(ours - ref).max()

    # ours -> HF, small shards so the index path is exercised too for the untied models
    shard = 20_000 if not overrides["tie_word_embeddings"] else 10**9
    files = convert.flax_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), max_shard_size=shard)
    assert (len(files) > 1) == (not overrides["tie_word_embeddings"])
    header_keys = set()
    for f in files:
        with open(tmp_path / "back" / f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header_keys |= set(json.loads(fh.read(n))) - {"__metadata__"}
    assert ("lm_head.weight" in header_keys) == (not overrides["tie_word_embeddings"])
    back = reload_hf(tmp_path / "back")
    assert np.abs(torch_logits(back, tokens) - ref).max() <= 1e-5


def test_top_level_rope_theta_only(tmp_path):
    """An older config.json with `rope_theta` on top and no rope_parameters still converts right."""
    hf = make_hf_qwen2(tmp_path / "hf", seed=3, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    path = tmp_path / "hf" / "config.json"
    d = json.loads(path.read_text())
    d.pop("rope_parameters")
    d["rope_theta"] = 1e6
    path.write_text(json.dumps(d))
    # Qwen2.5-Instruct style: config.json names one eos, generation_config.json two
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert cfg.rope_theta == 1e6
    assert cfg.eos_token_ids == (1, 2)
    tokens = random_tokens(length=40)  # long enough that theta 1e4 vs 1e6 differs visibly
    err = np.abs(our_logits(load_model(str(tmp_path / "ckpt")), tokens) - torch_logits(hf, tokens)).max()
    assert err <= 1e-4, err


def train_briefly(hf_model, steps=40, seed=0) -> float:
    """A few Adam steps on a learnable bigram rule (next = 7 * token + 3 mod 256).

    Random-init logits are near-uniform: top-2 gaps sit below bf16 rounding, and even torch's
    own bfloat16 run agrees with its float32 run on only ~98% of argmaxes. A trained model is
    peaked like a real one, which is what the bf16 agreement bar is about.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(hf_model.parameters(), lr=3e-3)
    hf_model.train()
    for _ in range(steps):
        x = torch.randint(0, 256, (16, 33), generator=gen)
        loss = torch.nn.functional.cross_entropy(hf_model(x).logits.flatten(0, 1), ((x * 7 + 3) % 256).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    hf_model.eval()
    return loss.item()


def test_cli_bfloat16_argmax_agreement_and_cli_round_trip(tmp_path, capsys):
    hf = make_hf_qwen2(tmp_path / "hf", seed=7)
    assert train_briefly(hf) < 0.5
    hf.save_pretrained(str(tmp_path / "hf"))
    code, err = run_cli(capsys, "hf-to-flax", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "bf16"),
                        "--dtype", "bfloat16", "--compute-dtype", "bfloat16")
    assert code == 0, err
    assert "tensors" in err  # progress line
    saved = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert saved["param_dtype"] == "bfloat16" and saved["dtype"] == "bfloat16"
    model = load_model(str(tmp_path / "bf16"))
    assert flat_params(model)["embed"].dtype == jnp.bfloat16

    tokens = random_tokens(batch=4, length=64, seed=1)
    ref = torch_logits(hf, tokens).argmax(-1)
    agree = (our_logits(model, tokens).argmax(-1) == ref).mean()
    assert agree >= 0.99, agree

    # CLI flax-to-hf from the bf16 checkpoint, written as float32: reloads and stays close
    code, err = run_cli(capsys, "flax-to-hf", "--ckpt", str(tmp_path / "bf16"), "--out", str(tmp_path / "back"),
                        "--dtype", "float32")
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "back")) == ["config.json", "generation_config.json", "model.safetensors"]
    gen = json.loads((tmp_path / "back" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1
    back = reload_hf(tmp_path / "back")
    assert next(back.parameters()).dtype == torch.float32
    assert (torch_logits(back, tokens).argmax(-1) == ref).mean() >= 0.99
