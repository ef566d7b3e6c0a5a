"""decoding/requests.py: --chat wraps a prompt in the Qwen chat layout, written out by hand."""

from __future__ import annotations

from prove_jax.decoding import requests


def test_chat_prompts_end_with_the_assistant_turn_opened(demo_tok):
    """--chat wraps a text prompt as one user turn and opens the assistant's turn, so the model
    answers instead of continuing the user's message (the Qwen layout, written out by hand)."""
    text = "def add(a, b):"
    want = demo_tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    got = requests.encode_prompts([{"id": "q", "prompt": text}], demo_tok, chat=True)
    assert got == [want]
    plain = requests.encode_prompts([{"id": "q", "prompt": text}], demo_tok)
    assert plain == [demo_tok.encode(text, add_special_tokens=False)]
