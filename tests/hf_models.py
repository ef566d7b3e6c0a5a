"""Tiny random-init transformers Qwen2 models: the outside oracle for parity tests."""

from __future__ import annotations

import torch
import transformers

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
