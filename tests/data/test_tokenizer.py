"""data/tokenizer.py: the byte-level BPE trainer's settings, the Qwen2 pipeline's NFC
normalisation (checked against `unicodedata`), and the verification of a saved tokenizer
folder."""

from __future__ import annotations

import json
import shutil
import unicodedata

import pytest

from tests.tokenizers_fixture import stdlib_text


@pytest.fixture(scope="module")
def saved_bpe(tmp_path_factory):
    from prove_jax.data.tokenizer import save_tokenizer, train_bpe
    bpe, _, _ = train_bpe(stdlib_text(("textwrap",)).splitlines(keepends=True), vocab_size=300)
    out = tmp_path_factory.mktemp("bpe") / "tok"
    save_tokenizer(bpe, str(out))
    return bpe, out


def test_bpe_settings_that_cannot_train_are_errors():
    from prove_jax.data.tokenizer import SPECIAL_TOKENS, TokenizerBuildError, train_bpe
    floor = len(SPECIAL_TOKENS) + 256   # 4 special tokens + 256 bytes: no room for a merge
    with pytest.raises(TokenizerBuildError, match=f"must exceed {floor}"):
        train_bpe(["abc abc"], vocab_size=floor)
    with pytest.raises(TokenizerBuildError, match="no training text"):
        train_bpe([], vocab_size=300)


def test_the_pipeline_normalizes_to_nfc_as_qwen2():
    from prove_jax.data.tokenizer import qwen2_pipeline
    text = "\ufb01le caf\u0065\u0301 \u212b \u2460"   # ligature, e + combining accent, angstrom, circled 1
    assert qwen2_pipeline().normalizer.normalize_str(text) == unicodedata.normalize("NFC", text)


def test_verification_catches_a_wrong_pad_token_and_disagreeing_ids(saved_bpe, tmp_path):
    from prove_jax.data.tokenizer import TokenizerBuildError, qwen2_pipeline, verify_tokenizer_dir
    bpe, out = saved_bpe
    text = "\ufb01x = 'a b'\n"
    verify_tokenizer_dir(str(out), bpe, [text])    # the real folder passes
    # the same ids and vocabulary size, two byte tokens swapped: same lengths, other ids
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    swapped = qwen2_pipeline(vocab, merges)
    assert len(swapped.encode("a").ids) == len(bpe.encode("a").ids) == 1
    with pytest.raises(TokenizerBuildError, match="disagree"):
        verify_tokenizer_dir(str(out), swapped, ["a"])
    # a saved folder whose pad token is not EOS
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg_path = bad / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["pad_token"] = "<|im_end|>"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(TokenizerBuildError, match="wrong eos/pad/mask"):
        verify_tokenizer_dir(str(bad), bpe)
