"""checkpoints/checkpoint.py: the tokenizer files copied into a checkpoint carry the chat
template."""

from __future__ import annotations

from prove_jax import assets
from prove_jax.checkpoints import checkpoint


def test_tokenizer_files_carry_the_chat_template(tmp_path, demo_tok):
    copied = checkpoint.copy_tokenizer_files(assets.DEMO_PROPOSER, str(tmp_path))
    assert "chat_template.jinja" in copied
    assert checkpoint.load_tokenizer(str(tmp_path)).chat_template == demo_tok.chat_template
