"""A tiny real byte-level BPE tokenizer for tests, trained here on CPython stdlib source.

No model hub: the `tokenizers` library trains it in well under a second, and transformers wraps
it as a PreTrainedTokenizerFast with Qwen-style special tokens and a Qwen-style chat template.
"""

from __future__ import annotations

import functools
import inspect

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# The Qwen2.5 chat layout, without the default system prompt.
CHAT_TEMPLATE = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


def stdlib_text(modules=("json", "textwrap", "string", "fnmatch")) -> str:
    """Real Python source text from the standard library."""
    import importlib
    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in modules)


@functools.lru_cache(maxsize=None)
def _tokenizer_json(vocab_size: int, modules: tuple[str, ...] | None = None) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = stdlib_text() if modules is None else stdlib_text(modules)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    return tok.to_str()


def make_tokenizer(vocab_size: int = 300, modules: tuple[str, ...] | None = None):
    """A fresh PreTrainedTokenizerFast (eos = pad = <|endoftext|>, id 0) trained on the source
    of stdlib `modules` (default: `stdlib_text`'s). Safe to mutate."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size, modules)),
                                  eos_token=EOS, pad_token=EOS,
                                  additional_special_tokens=[IM_START, IM_END])
    tok.chat_template = CHAT_TEMPLATE
    return tok
