"""A `generate` job as users run it: resuming only what the same settings and requests made, one
job per output file, request fields checked by name (with the aliases other tools use),
standard input, truncation marked in the record, and the Python text API with the same
controls."""

import dataclasses
import io
import json

import pytest

from prove_jax import assets
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.cli import generate
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, SamplingParams
from prove_jax.decoding.requests import read_requests
from prove_jax.decoding.results_file import ResultsFile
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint with a 64-position buffer (prompt_ids only: it has no tokenizer)."""
    path = str(tmp_path_factory.mktemp("jobs") / "model")
    save_model(path, create_model(dataclasses.replace(CFG, max_position_embeddings=64), seed=3))
    return path


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _records(path):
    return {r["id"]: r for r in map(json.loads, open(path))}


def test_a_resume_with_other_settings_or_changed_requests_is_refused(tmp_path, ckpt, capsys):
    """Records decoded with other settings, or from a request since changed under the same id,
    are never mixed into a file; --overwrite starts over."""
    reqs = [{"id": "a", "prompt_ids": [4, 5, 6]}, {"id": "b", "prompt_ids": [7, 8], "temperature": 0.5}]
    inp, out = _write(tmp_path / "in.jsonl", reqs), str(tmp_path / "out.jsonl")
    first = ["--model", ckpt, "--input", inp, "--output", out, "--no-progress", "--mode", "lossless",
             "--temperature", "0.7", "--max-new-tokens", "6"]
    assert generate.main(first) == 0
    made = _records(out)
    assert all(len(r["request_hash"]) == 16 for r in made.values())
    capsys.readouterr()
    other = ["--model", ckpt, "--input", inp, "--output", out, "--no-progress", "--mode", "ar",
             "--max-new-tokens", "4"]
    assert generate.main(other) == 2
    err = capsys.readouterr().err
    assert "holds records decoded with max_new_tokens=6, mode='lossless', temperature=0.7" in err
    assert "this run has max_new_tokens=4, mode='ar', temperature=0.0" in err and "--overwrite" in err
    assert _records(out) == made  # untouched
    changed = _write(tmp_path / "changed.jsonl", [reqs[0], dict(reqs[1], prompt_ids=[7, 9])])
    assert generate.main(first[:2] + ["--input", changed] + first[4:]) == 2
    assert "request 'b' is not the request its record there was decoded from" in capsys.readouterr().err
    assert generate.main(other + ["--overwrite"]) == 0
    redone = _records(out)
    assert set(redone) == {"a", "b"} and json.load(open(out + ".settings.json"))["mode"] == "ar"
    assert redone["a"]["output_ids"] != made["a"]["output_ids"] or len(redone["a"]["output_ids"]) == 4
    (tmp_path / "out.jsonl.settings.json").unlink()  # as a file written before settings were kept
    assert generate.main(other) == 2
    assert "not the settings they were decoded with" in capsys.readouterr().err


def test_a_second_job_writing_the_same_output_is_refused(tmp_path, ckpt, capsys):
    inp = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt_ids": [4, 5]}])
    out = str(tmp_path / "out.jsonl")
    running = ResultsFile(out)
    running.lock()  # as a job that is still writing it
    cmd = ["--model", ckpt, "--input", inp, "--output", out, "--no-progress", "--max-new-tokens", "3"]
    assert generate.main(cmd) == 2
    assert f"--output {out} is being written by prove-jax generate (pid" in capsys.readouterr().err
    running.close()
    assert generate.main(cmd) == 0 and list(_records(out)) == [1]
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_request_fields_are_checked_by_name_and_other_tools_names_are_read(tmp_path, ckpt, capsys):
    """A typo fails its request (naming the nearest field) instead of being ignored;
    `max_tokens` is `max_new_tokens`; `logprobs` is per request."""
    inp = _write(tmp_path / "in.jsonl", [
        {"id": "typo", "prompt_ids": [4, 5], "temprature": 1.5},
        {"id": "alias", "prompt_ids": [4, 5], "max_tokens": 3},
        {"id": "lp", "prompt_ids": [4, 5], "logprobs": 2, "metadata": {"source": "x"}},
        {"id": "plain", "prompt_ids": [4, 5]},
        {"id": "both", "prompt_ids": [4, 5], "max_tokens": 3, "max_new_tokens": 4},
        {"id": "bad_lp", "prompt_ids": [4, 5], "logprobs": "many"}])
    out = str(tmp_path / "out.jsonl")
    assert generate.main(["--model", ckpt, "--input", inp, "--output", out, "--no-progress",
                          "--max-new-tokens", "5"]) == 3
    recs = _records(out)
    assert "unknown field 'temprature' (did you mean 'temperature'?)" in recs["typo"]["error"]
    assert "give 'max_new_tokens' or 'max_tokens'" in recs["both"]["error"]
    assert "logprobs must be an integer between 0 and" in recs["bad_lp"]["error"]
    assert len(recs["alias"]["output_ids"]) == 3 and len(recs["plain"]["output_ids"]) == 5
    assert recs["lp"]["output_ids"] == recs["plain"]["output_ids"]  # greedy, same prompt
    assert [len(t["top_logprobs"]) for t in recs["lp"]["logprobs"]] == [2] * 5
    assert "logprobs" not in recs["plain"] and "logprobs" not in recs["alias"]


def test_strict_names_the_first_bad_line(tmp_path, capsys):
    """A bad value on line 2 is reported before a duplicate id on line 4 (file-level checks no
    longer run first), and before any model loads."""
    inp = _write(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}, {"id": 2, "prompt": "y", "top_p": 7},
                                         {"id": 3, "prompt": "z", "color": 1}, {"id": 1, "prompt": "w"}])
    assert generate.main(["--input", inp, "--output", str(tmp_path / "o.jsonl"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert f"{inp}:2: top_p" in err and ":3:" not in err and ":4:" not in err
    with pytest.raises(DecodeError, match=r":3: unknown field 'color'"):
        read_requests(_write(tmp_path / "in2.jsonl", [{"id": 1, "prompt": "x"}, "",
                                                      {"id": 3, "prompt": "z", "color": 1}, "{bad"]))


def test_stdin_input_and_truncated_prompts_marked(tmp_path, ckpt, monkeypatch, capsys):
    """`--input -` reads the requests from standard input; a prompt --truncate cut says so, and
    by how many tokens, in its record."""
    lines = json.dumps({"id": "long", "prompt_ids": list(range(2, 72))}) + "\n" + \
        json.dumps({"id": "short", "prompt_ids": [4, 5]}) + "\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    out = str(tmp_path / "out.jsonl")
    assert generate.main(["--model", ckpt, "--input", "-", "--output", out, "--no-progress",
                          "--max-new-tokens", "6", "--truncate", "left"]) == 0
    recs = _records(out)
    assert (recs["long"]["truncated"], recs["long"]["truncated_tokens"]) == (True, 70 - (64 - 6))
    assert "truncated" not in recs["short"] and len(recs["long"]["output_ids"]) == 6


def test_a_failed_prompt_says_why(capsys):
    assert generate.main(["--prompt", "x " * 3000, "--max-new-tokens", "4", "--no-progress"]) == 3
    assert "error: the prompt has 3001 tokens" in capsys.readouterr().err


def test_text_api_has_the_clis_controls_and_the_decoder_refuses_what_it_would_ignore():
    """`TextGenerator.generate` takes text and per-request records and returns generate's
    records (oracle: the Decoder's greedy ids, decoded and cut at the stop string); a Decoder
    given stop strings or text raises instead of ignoring them."""
    from prove_jax.decoding.text import TextGenerator
    # recording steps and a logprob already: one compiled stream serves every call below
    gen = TextGenerator.load(assets.DEMO_PROPOSER, DecodeOptions("lossless", 4, record_steps=True, logprobs=1))
    tok, dec = gen.tokenizer, gen.decoder
    prompt = "def add(a, b):\n"
    ids = dec.generate([tok.encode(prompt, add_special_tokens=False)], 24).output_ids[0]
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    one = gen.generate(prompt, max_new_tokens=24, stop=[stop])
    assert one["text"] == text[: text.index(stop)] and one["finish_reason"] == "stop" and one["stop"] == stop
    assert one["stats"]["generated_tokens"] == len(one["output_ids"])
    both = gen.generate([prompt, {"prompt": prompt, "max_tokens": 5, "logprobs": 1}], max_new_tokens=24)
    assert both[0]["output_ids"] == ids and both[1]["output_ids"] == ids[:5]
    assert [len(t["top_logprobs"]) for t in both[1]["logprobs"]] == [1] * 5 and "logprobs" not in both[0]
    with pytest.raises(DecodeError, match=r"request 0: unknown field 'temprature'"):
        gen.generate({"prompt": prompt, "temprature": 1.0})
    with pytest.raises(DecodeError, match="stop strings are found on text"):
        dec.generate([[4, 5]], 4, params=SamplingParams(stop=("x",)))
    with pytest.raises(DecodeError, match="is not a list of token ids"):
        dec.generate(["def f():"], 4)
    assert isinstance(dec, Decoder)
