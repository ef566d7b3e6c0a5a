"""Tiny random-init transformers Qwen2 models, and their logits and loss: the outside oracle
for parity tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from prove_jax.models.attention import causal_mask

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
            pad_token_id=0)


def make_hf_qwen2(out_dir, seed: int = 0, bias_std: float = 0.1, **overrides) -> transformers.Qwen2ForCausalLM:
    """Random Qwen2ForCausalLM saved with save_pretrained to `out_dir` (safetensors).

    Biases are randomised too (HF initialises them to zero, which would hide a bias bug).
    """
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**(TINY | overrides))
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, bias_std)
    model.save_pretrained(str(out_dir))
    return model


def hf_greedy(model: transformers.Qwen2ForCausalLM, prompts, max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """transformers' greedy `generate` of each prompt alone, new tokens only, cut after the
    first EOS (HF pads after it; our decoder stops there)."""
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos_id, pad_token_id=0)[0, len(p):].tolist()
        refs.append(out[: out.index(eos_id) + 1] if eos_id in out else out)
    return refs


def random_tokens(batch=2, length=24, vocab=256, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, length)).astype(np.int32)


def torch_logits(hf_model, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def our_logits(model, tokens) -> np.ndarray:
    """Our model's logits for `tokens` [B, T] under the plain causal mask."""
    b, t = tokens.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), causal_mask(b, t))
    return np.asarray(logits)


def reload_hf(hf_dir):
    """The HF directory read back by transformers, with no key missing, unexpected or mismatched."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def torch_loss(hf_model, batch) -> float:
    """AR loss, averaged per sequence over trained targets, then over sequences (as training's)."""
    ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    with torch.no_grad():
        logits = hf_model(ids, attention_mask=torch.tensor(batch["valid"], dtype=torch.long)).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:],
                                            reduction="none").numpy()
    w = (batch["loss_mask"] & batch["valid"])[:, 1:].astype(np.float64)
    per_seq = (nll * w).sum(1) / np.maximum(w.sum(1), 1)
    return float(per_seq[w.sum(1) > 0].mean())
