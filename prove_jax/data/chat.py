"""A prompt in a checkpoint's own chat template (its tokenizer's), with Qwen3's thinking switch.

Qwen3's template reads one variable beside the messages, `enable_thinking`: unset or true, the
assistant turn opens plainly and the model thinks first (`<think>...</think>`); false, the turn
opens with an empty thinking section and the model answers directly. A template that does not
read it renders the same either way (Jinja ignores unknown variables), so a switch given for
such a template is refused rather than silently doing nothing. Decoding (`--chat`,
`--[no-]enable-thinking`) and training (`chat`, `enable_thinking`) both encode through here.
"""

from __future__ import annotations

from collections.abc import Mapping

THINKING_SWITCH = "enable_thinking"


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates (e.g. "default", "tool_use")
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def chat_problem(tokenizer, enable_thinking: bool | None = None) -> str | None:
    """Why `tokenizer` cannot encode chat prompts with this switch (None when it can): it has no
    chat template, or a switch is set and its template has no `enable_thinking`."""
    if not _template_text(tokenizer):
        return "the tokenizer has no chat template"
    if enable_thinking is not None and THINKING_SWITCH not in _template_text(tokenizer):
        return (f"the tokenizer's chat template has no {THINKING_SWITCH} switch (Qwen3's templates "
                f"have one; this one would render the same prompt either way)")
    return None


def chat_prompt_ids(tokenizer, text: str, enable_thinking: bool | None = None) -> list[int]:
    """Token ids of one user turn and the assistant's opening, as the template renders them;
    `enable_thinking` None leaves the template's own default."""
    switch = {} if enable_thinking is None else {THINKING_SWITCH: bool(enable_thinking)}
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True, **switch)
    if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)
