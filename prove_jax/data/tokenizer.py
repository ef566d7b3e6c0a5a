"""Train the project's byte-level BPE tokenizer and save it in Hugging Face (Qwen2) format.

The pipeline is Qwen2's own (NFC, so non-NFC text decodes to its NFC form; Qwen2's `Split`
regex; `ByteLevel`), so the result loads as a `Qwen2Tokenizer` with the same ids in
`tokenizers` and transformers; only the vocabulary is small. Special tokens get ids 0-3:
`<|endoftext|>` (EOS and pad), `<|im_start|>`, `<|im_end|>`, `<|mask|>`. The folder is written
by transformers' own `save_pretrained` from `vocab=`/`merges=` (transformers 5 ignores
`vocab_file=`, silently giving a one-token tokenizer) and reloaded to check its ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, Qwen2Tokenizer

from prove_jax.errors import ProveJaxError
from prove_jax.files import atomic_dir, check_replaceable

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN)
DEFAULT_VOCAB_SIZE = 4096
# Qwen2's pre-tokenizer regex (the `Split` pattern of its tokenizer.json).
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML, as in Qwen2 instruct models, without the default system prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class TokenizerBuildError(ProveJaxError, ValueError):
    """Bad tokenizer-training input, or a saved tokenizer that does not behave as trained."""


@dataclasses.dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    mask_token_id: int
    im_start_token_id: int
    im_end_token_id: int
    train_seconds: float
    num_texts: int
    num_bytes: int


def qwen2_pipeline(vocab: dict[str, int] | None = None,
                   merges: list[tuple[str, str]] | None = None):
    """A `tokenizers.Tokenizer` with Qwen2's normalizer, pre-tokenizer and decoder."""
    if vocab is None:
        model = models.BPE()
    else:
        model = models.BPE(vocab=vocab, merges=merges or [])
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2,
              show_progress: bool = False):
    """Train the byte-level BPE; returns (tokenizers.Tokenizer, texts seen, UTF-8 bytes seen)."""
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size <= min_vocab:
        raise TokenizerBuildError(f"vocab_size must exceed {min_vocab} (4 special tokens + 256 "
                                  f"bytes), got {vocab_size}")
    counts = {"texts": 0, "bytes": 0}

    def counted(it):
        for text in it:
            counts["texts"] += 1
            counts["bytes"] += len(text.encode("utf-8"))
            yield text

    tok = qwen2_pipeline()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress)
    tok.train_from_iterator(counted(texts), trainer)
    if counts["texts"] == 0:
        raise TokenizerBuildError("no training text (empty corpus)")
    return tok, counts["texts"], counts["bytes"]


def to_transformers(tok, model_max_length: int = 32768):
    """Wrap a trained pipeline as transformers' `Qwen2Tokenizer` (built from vocab + merges)."""
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    hf = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, eos_token=EOS_TOKEN,
                        pad_token=EOS_TOKEN, unk_token=None, bos_token=None, mask_token=MASK_TOKEN,
                        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
                        model_max_length=model_max_length)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _check_replaceable(out_dir: str) -> None:
    check_replaceable(out_dir, "tokenizer.json", "a tokenizer folder", TokenizerBuildError)


def save_tokenizer(tok, out_dir: str, model_max_length: int = 32768) -> None:
    """Write the HF tokenizer folder atomically (tokenizer.json, tokenizer_config.json, ...)."""
    _check_replaceable(out_dir)
    hf = to_transformers(tok, model_max_length)
    with atomic_dir(out_dir) as tmp:
        hf.save_pretrained(tmp)


def verify_tokenizer_dir(out_dir: str, tok, sample_texts: Iterable[str] = ()) -> dict[str, int]:
    """Reload `out_dir` offline with AutoTokenizer and check it matches the trained pipeline.

    Returns the special-token ids. Raises TokenizerBuildError on any difference.
    """
    hf = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    ids = {name: hf.convert_tokens_to_ids(name) for name in SPECIAL_TOKENS}
    expected = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    if ids != expected:
        raise TokenizerBuildError(f"special token ids after reload {ids} != trained {expected}")
    if (hf.eos_token_id != ids[EOS_TOKEN] or hf.pad_token_id != ids[EOS_TOKEN]
            or hf.mask_token_id != ids[MASK_TOKEN]):
        raise TokenizerBuildError("reloaded tokenizer has wrong eos/pad/mask token ids")
    if len(hf) != tok.get_vocab_size():
        raise TokenizerBuildError(f"reloaded vocab size {len(hf)} != trained "
                                  f"{tok.get_vocab_size()}")
    for text in sample_texts:
        a, b = hf.encode(text), tok.encode(text).ids
        if a != b:
            raise TokenizerBuildError(f"transformers and tokenizers disagree on {text[:60]!r}")
    return ids


def build_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    sample_texts: Iterable[str] = (), show_progress: bool = False) -> TokenizerInfo:
    """Train, save, reload and verify; the one call the CLI and the reproduction script use."""
    _check_replaceable(out_dir)  # before training, not after
    t0 = time.perf_counter()
    tok, n_texts, n_bytes = train_bpe(texts, vocab_size, show_progress=show_progress)
    seconds = time.perf_counter() - t0
    if tok.get_vocab_size() != vocab_size:
        raise TokenizerBuildError(f"corpus too small: BPE stopped at {tok.get_vocab_size()} "
                                  f"tokens, asked for {vocab_size}")
    save_tokenizer(tok, out_dir)
    ids = verify_tokenizer_dir(out_dir, tok, sample_texts)
    return TokenizerInfo(vocab_size=tok.get_vocab_size(), eos_token_id=ids[EOS_TOKEN],
                         pad_token_id=ids[EOS_TOKEN], mask_token_id=ids[MASK_TOKEN],
                         im_start_token_id=ids[IM_START_TOKEN], im_end_token_id=ids[IM_END_TOKEN],
                         train_seconds=seconds, num_texts=n_texts, num_bytes=n_bytes)


def load_tokenizer_dir(path: str):
    """The saved tokenizer as transformers loads it (offline)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise TokenizerBuildError(f"no tokenizer.json in {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
