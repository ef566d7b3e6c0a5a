"""DecodeOptions, the Decoder's request checks and the CLI's defaults: errors at their bounds,
the label a run's summary gives its setting, the adaptive table's caps, and the documented
--block-size defaults of `generate`."""

from __future__ import annotations

import json
import re

import pytest

from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, adapt_for_batch, LosslessRule, ThresholdRule, VerifyRule
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG


@pytest.fixture(scope="module")
def model():
    return create_model(CFG, seed=3)


def test_request_and_option_errors_at_their_bounds(model):
    dec = Decoder(model, [1], DecodeOptions("ar"), max_buffer=64)
    dec.check_prompts([[2] * 54], 10)  # 54 + 10 = 64 positions: exactly the buffer, allowed
    with pytest.raises(DecodeError, match="needs 65 positions, longer than the buffer limit 64"):
        dec.check_prompts([[2] * 55], 10)
    dec.check_prompts([[0, CFG.vocab_size - 1]], 4)  # the first and the last id are tokens
    for bad in (CFG.vocab_size, -1):
        with pytest.raises(DecodeError, match=rf"prompt 1 has token id {bad} outside the vocabulary "
                                              rf"\[0, {CFG.vocab_size}\)"):
            dec.check_prompts([[2, 3], [2, bad]], 4)
    with pytest.raises(DecodeError, match="max_new_tokens must be >= 1, got 0"):
        dec.generate([[2, 3]], 0)
    with pytest.raises(DecodeError, match="lossless mode needs --block-size >= 2"):
        DecodeOptions("lossless", 1).validate()
    with pytest.raises(DecodeError, match="unknown confidence 'logit'"):
        DecodeOptions("threshold", 4, threshold=ThresholdRule(confidence="logit")).validate()
    with pytest.raises(DecodeError, match="unknown commit rule 'oracle'"):
        DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="oracle")).validate()
    with pytest.raises(DecodeError, match="max groups must be >= 1, got 0"):
        DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=0)).validate()
    # a step may be exactly as wide as the buffer (lossless K=40, one group: 1 + 39 x 2 = 79)
    Decoder(model, [1], DecodeOptions("lossless", 40, lossless=LosslessRule(max_groups=1)), max_buffer=79)
    with pytest.raises(DecodeError, match="feeds 79 tokens per step"):
        Decoder(model, [1], DecodeOptions("lossless", 40, lossless=LosslessRule(max_groups=1)), max_buffer=78)
    # with_options checks the model pairing as the constructor does
    with pytest.raises(DecodeError, match="needs a verifier model"):
        dec.with_options(DecodeOptions("verify", 4))
    with pytest.raises(DecodeError, match=re.escape("needs a MARS proposer with a <|mask|> token")):
        Decoder(create_model(CFG.replace(mask_token_id=None)), [1]).with_options(DecodeOptions("threshold", 4))
    assert dec.trace_count == 0


def test_describe_options_names_what_ran():
    from prove_jax.decoding.request_run import describe_options
    d = lambda o: describe_options(o.validate())  # noqa: E731
    assert d(DecodeOptions("ar", 8)) == "ar"
    assert d(DecodeOptions("lossless", 6, lossless=LosslessRule(max_groups=2))) == "lossless K=6,G=2"
    assert d(DecodeOptions("lossless", 4)) == "lossless K=4,G=4"
    assert d(DecodeOptions("verify", 8, verify=VerifyRule(commit_rule="head"))) == "verify K=8,head"
    assert d(DecodeOptions("threshold", 8, threshold=ThresholdRule(tau=0.8))) == "threshold K=8,prob>=0.8"
    assert d(DecodeOptions("threshold", 8, threshold=ThresholdRule(confidence="margin"))) == "threshold K=8,margin>=0.8"
    # entropy passes at most tau nats
    assert d(DecodeOptions("threshold", 8, threshold=ThresholdRule(confidence="entropy"))) == "threshold K=8,entropy<=0.5"


def test_adaptive_layout_respects_the_block_size_and_group_caps():
    """The table proposes (K, groups) per batch size; --block-size and --groups cap both, and a
    row with K = 1 means AR for its batch sizes (later rows do not apply to them)."""
    opts = DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2, adaptive=True))
    table = ((1, 8, 8), (4, 3, 3), (8, 1, 1), (16, 6, 2))

    def setting(b, **kw):
        o = adapt_for_batch(opts, b, table=table, **kw)
        return (o.mode, o.block_size, o.lossless.max_groups if o.mode == "lossless" else None)
    assert [setting(b) for b in (1, 2, 4, 8, 16, 32)] == [
        ("lossless", 4, 2), ("lossless", 3, 2), ("lossless", 3, 2), ("ar", 1, None), ("lossless", 4, 2),
        ("ar", 1, None)]
    gpu = adapt_for_batch(opts, 1, platform="gpu")  # the platform table's (1, 8, 8), capped
    assert (gpu.block_size, gpu.lossless.max_groups) == (4, 2)
    uncapped = adapt_for_batch(DecodeOptions("lossless", 8, lossless=LosslessRule(adaptive=True)), 1, table=table)
    assert (uncapped.block_size, uncapped.lossless.max_groups) == (8, 8)


def test_cli_block_size_defaults_and_calibrate_decodes_adaptively(tmp_path, monkeypatch, capsys):
    """Documented defaults: K = 8, lossless 4, but --calibrate searches up to 8; --calibrate
    (like --adaptive) makes the decoder follow its per-batch table, or the table it installs
    would be ignored."""
    from prove_jax.cli import generate
    seen = []

    def build(path, options, **kw):
        seen.append(options)
        raise DecodeError("stop before loading")
    monkeypatch.setattr(generate, "build_decoder", build)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4]}) + "\n")
    base = ["--input", str(inp), "--output", str(tmp_path / "out.jsonl")]
    for extra, want in [([], ("lossless", 4, False)), (["--mode", "ar"], ("ar", 1, False)),
                        (["--mode", "threshold"], ("threshold", 8, False)),
                        (["--mode", "verify"], ("verify", 8, False)),
                        (["--mode", "lossless"], ("lossless", 4, False)),
                        # adaptive: the widest table layout (K=8) unless --block-size caps it
                        (["--mode", "lossless", "--adaptive"], ("lossless", 8, True)),
                        (["--mode", "lossless", "--adaptive", "--block-size", "4"], ("lossless", 4, True)),
                        (["--mode", "lossless", "--calibrate"], ("lossless", 8, True)),
                        (["--mode", "lossless", "--calibrate", "--block-size", "3"], ("lossless", 3, True))]:
        assert generate.main(base + extra) == 2
        assert "stop before loading" in capsys.readouterr().err
        assert (seen[-1].mode, seen[-1].block_size, seen[-1].lossless.adaptive) == want, extra
