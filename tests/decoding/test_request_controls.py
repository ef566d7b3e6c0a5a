"""Per-request controls: stop strings (found on the text as blocks arrive), finish reasons,
logprobs (oracle: transformers' log-softmax; lossless equals AR), and the generate CLI's
per-request sampling fields."""

import json

import numpy as np
import pytest
import torch

from prove_jax import assets
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer, save_model
from prove_jax.checkpoints.convert import hf_to_flax
from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule
from prove_jax.decoding.request_run import run_requests
from prove_jax.decoding.sampling import SamplingParams
from prove_jax.decoding.stopping import StopStrings
from tests.hf_models import make_hf_qwen2
from tests.decode_helpers import CFG, random_prompts


@pytest.fixture(scope="module")
def demo():
    """(proposer, tokenizer) of the shipped pair: a real tokenizer and text-like outputs."""
    return load_model(assets.DEMO_PROPOSER), load_tokenizer(assets.DEMO_PROPOSER)


def _block_ends(tok, ids, blocks):
    """Text length after each committed block."""
    ends, n = [], 0
    for b in blocks:
        n += b
        ends.append(len(tok.decode(ids[:n], skip_special_tokens=True)))
    return ends


def test_a_stop_string_across_two_committed_blocks_cuts_the_output_where_it_starts(demo):
    model, tok = demo
    dec = Decoder(model, [tok.eos_token_id], DecodeOptions("lossless", 4, record_steps=True))
    prompt = tok.encode("def parse(text):\n    ", add_special_tokens=False)
    free = dec.generate([prompt], 48)
    ids, blocks = free.output_ids[0], free.step_commits[0]
    text = tok.decode(ids, skip_special_tokens=True)
    # a stop string made of the last 2 characters of one block and the first 2 of the next,
    # found nowhere earlier in the text
    stop = next(text[e - 2: e + 2] for e in _block_ends(tok, ids, blocks)[:-1]
                if e >= 2 and len(text[e - 2: e + 2]) == 4 and text.find(text[e - 2: e + 2]) == e - 2)
    cut = text.index(stop)
    [result], _ = run_requests(dec, [prompt], 48, 1, progress=False, tokenizer=tok,
                               params=[SamplingParams(stop=("never there", stop))])
    assert (result.text, result.stop, result.finish_reason) == (text[:cut], stop, "stop")
    # the ids end with the token that completed the stop string
    n = len(result.output_ids)
    assert result.output_ids == ids[:n] and stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])
    # the stats count what it returns: its tokens and the forwards that committed them
    forwards = next(f for f in range(1, len(blocks) + 1) if sum(blocks[:f]) >= n)
    assert (result.stats["generated_tokens"], result.stats["proposer_forwards"]) == (n, forwards)
    plain = Decoder(model, [tok.eos_token_id], DecodeOptions("lossless", 4))  # records no steps itself
    [again], _ = run_requests(plain, [prompt], 48, 1, progress=False, tokenizer=tok,
                              params=[SamplingParams(stop=(stop,))])
    assert again.stats == result.stats and again.output_ids == result.output_ids


def test_stop_strings_are_found_alike_whatever_the_blocks(demo):
    """Feeding a completion a token at a time or in blocks of any size gives one cut (the
    first token at which any stop string appears, cut where the earliest of them starts)."""
    _, tok = demo
    ids = tok.encode("    return value + 1\n\n\ndef other():\n    pass\n", add_special_tokens=False)
    rs = np.random.RandomState(0)
    for stops in (["\n\n"], ["def", "\n\n\n"], ["+ 1", "value"], ["nowhere"]):
        one = StopStrings(tok, stops)
        for t in ids:
            one.feed([t])
        for _ in range(5):
            cuts = np.sort(rs.choice(np.arange(1, len(ids)), size=rs.randint(1, 6), replace=False))
            other = StopStrings(tok, stops)
            for block in np.split(np.asarray(ids), cuts):
                other.feed(block.tolist())
            assert (other.ids, other.text, other.stopped_by) == (one.ids, one.text, one.stopped_by), stops
    first = StopStrings(tok, ["value", "return"])
    first.feed(ids)
    assert first.text == "    " and first.stopped_by == "return"


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("lp")
    hf = make_hf_qwen2(d / "hf", seed=2, mask_token_id=255, initializer_range=0.1)
    hf_to_flax(str(d / "hf"), str(d / "ours"))
    return hf, load_model(str(d / "ours"))


def test_logprobs_are_transformers_log_softmax_and_lossless_equals_ar(hf_pair):
    hf, ours = hf_pair
    prompts = random_prompts(6, (4, 9, 2))
    ar = Decoder(ours, [], DecodeOptions("ar", logprobs=3)).generate(prompts, 12)
    for p, out, lps in zip(prompts, ar.output_ids, ar.logprobs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + out])).logits[0, len(p) - 1: -1]
        want = torch.log_softmax(logits.double(), -1).numpy()
        chosen = [lp for lp, _ in lps]
        np.testing.assert_allclose(chosen, want[np.arange(len(out)), out], atol=2e-5)
        for row, (_, top) in zip(want, lps):
            np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:3], atol=2e-5)
            assert [i for i, _ in top] == np.argsort(-row, kind="stable")[:3].tolist()
    for k, groups in ((3, None), (5, 2)):
        lossless = Decoder(ours, [], DecodeOptions("lossless", k, lossless=LosslessRule(max_groups=groups), logprobs=3)).generate(prompts, 12)
        assert lossless.output_ids == ar.output_ids
        for a, b in zip(lossless.logprobs, ar.logprobs):
            np.testing.assert_allclose([lp for lp, _ in a], [lp for lp, _ in b], atol=1e-5)
            assert [[i for i, _ in top] for _, top in a] == [[i for i, _ in top] for _, top in b]
    sampled = Decoder(ours, [], DecodeOptions("lossless", 3, logprobs=0)).generate(
        prompts, 12, params=SamplingParams(temperature=1.0))
    assert all(len(lp) == len(o) and lp[0][1] == [] for lp, o in zip(sampled.logprobs, sampled.output_ids))


def test_generate_cli_reads_sampling_fields_per_request(tmp_path, capsys):
    """Record fields override the flags; a bad field fails its request alone; seeded requests
    repeat whatever the batch size; finish_reason and logprobs are in the records."""
    from prove_jax.cli import generate
    from prove_jax.models.params import create_model
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, create_model(CFG, seed=3))
    good = random_prompts(7, (5, 3, 8, 2))
    lines = [{"id": "hot", "prompt_ids": good[0], "temperature": 1.0, "seed": 5},
             {"id": "short", "prompt_ids": good[1], "max_new_tokens": 3},
             {"id": "bad", "prompt_ids": good[2], "top_p": 0},
             {"id": "stop", "prompt_ids": good[3], "stop_token_ids": []}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def run(batch, *extra):
        out = tmp_path / f"out{batch}{len(extra)}.jsonl"
        code = generate.main(["--model", ckpt, "--mode", "lossless", "--input", str(inp), "--output", str(out),
                              "--max-new-tokens", "10", "--batch-size", str(batch), "--logprobs", "2", *extra])
        return code, {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    code, rows = run(1)
    assert code == generate.SOME_REQUESTS_FAILED
    assert "top_p must be in (0, 1]" in rows["bad"]["error"]
    greedy = Decoder(create_model(CFG, seed=3), [1], DecodeOptions("ar")).generate([good[1], good[3]], 10)
    assert rows["short"]["output_ids"] == greedy.output_ids[0][:3] and rows["short"]["finish_reason"] == "length"
    assert rows["stop"]["output_ids"] == greedy.output_ids[1]
    assert rows["hot"]["output_ids"] != Decoder(create_model(CFG, seed=3), [1], DecodeOptions("ar")).generate(
        [good[0]], 10).output_ids[0]
    entry = rows["hot"]["logprobs"][0]
    assert set(entry) == {"id", "logprob", "top_logprobs"} and len(entry["top_logprobs"]) == 2
    assert len(rows["hot"]["logprobs"]) == len(rows["hot"]["output_ids"])
    _, again = run(3)
    assert again["hot"]["output_ids"] == rows["hot"]["output_ids"]
    # the flags are the defaults the fields override: a hot job changes only the unseeded, unset rows
    _, hot = run(1, "--temperature", "1.0", "--seed", "9")
    assert hot["hot"]["output_ids"] == rows["hot"]["output_ids"] and hot["short"]["output_ids"] != rows["short"]["output_ids"]
    capsys.readouterr()
    assert generate.main(["--model", ckpt, "--input", str(inp), "--output", str(tmp_path / "x.jsonl"),
                          "--stop", "\n"]) == 2
    assert "stop strings need the checkpoint's tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [(["--top-p", "0"], "--top-p must be in (0, 1]"),
                                           (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
                                           (["--temperature", "-1"], "--temperature must be a number >= 0"),
                                           (["--logprobs", "21"], "--logprobs must be between 0 and 20"),
                                           (["--groups", "0"], "--groups must be >= 1")])
def test_generate_errors_name_the_flag(flags, message, capsys):
    from prove_jax.cli import generate
    assert generate.main(["--prompt", "x", *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err


def _byte_tokenizer():
    """A byte-level BPE with no merges: every UTF-8 byte is its own token, so a multi-byte
    character arrives over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.mark.parametrize("text,stops", [("ab€ cd", ["b€"]), ("x€€y", ["€y"]), ("añb¡c", ["ñb", "¡c"]),
                                        ("日本語です", ["語で"]), ("a€", ["€"]), ("é€", ["zz"])])
def test_stop_strings_with_multibyte_characters_are_found_at_every_split(text, stops):
    """Every way of cutting the byte tokens into committed blocks gives the one-block answer,
    token by token included."""
    tok = _byte_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8")) and tok.decode(ids) == text
    whole = StopStrings(tok, stops)
    whole.feed(ids)
    assert whole.stopped == any(s in text for s in stops)
    n = len(ids)
    for mask in range(2 ** (n - 1)):  # bit j set: a block ends after token j
        cuts = [j + 1 for j in range(n - 1) if mask >> j & 1]
        split = StopStrings(tok, stops)
        for block in np.split(np.asarray(ids), cuts):
            split.feed(block.tolist())
        assert (split.ids, split.text, split.stopped_by) == (whole.ids, whole.text, whole.stopped_by), cuts
