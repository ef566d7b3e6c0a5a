"""decoding/results_file.py: the output file of a request job: whole records kept across a
killed run and a rerun, the record's text, and an output path that is the input file."""

from __future__ import annotations

import json
import os

import pytest

from prove_jax.decoding import DecodeError
from prove_jax.decoding import request_run
from prove_jax.decoding import results_file


def test_the_results_file_keeps_whole_records_and_lets_a_rerun_skip_them(tmp_path):
    """A killed job leaves whole lines and maybe one torn one: the rerun cuts the torn line off,
    drops failed requests' records (they are tried again) and skips the rest; --sort rewrites
    the file in input order; a line that is not a record, before the end, is refused."""
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "b", "output_ids": [1]}) + "\n" + json.dumps({"id": 7, "error": "x"})
                   + "\n" + json.dumps({"id": "a", "output_ids": [2]}) + "\n" + '{"id": "c", "outp')
    results = results_file.ResultsFile(str(out))
    assert set(results.done()) == {"a", "b"}
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["b", "a"]
    results.write({"id": "c", "output_ids": [3]})
    results.close()
    results.sort(["a", 7, "b", "c"])
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["a", "b", "c"]
    out.write_text("not json\n" + json.dumps({"id": "a"}) + "\n")
    with pytest.raises(DecodeError, match="not an output record"):
        results_file.ResultsFile(str(out)).done()


def test_output_text_leaves_out_the_eos_the_ids_keep(tmp_path, demo_tok):
    """output_ids end with the EOS that stopped the request; the text is what a reader wants,
    without special tokens."""
    eos = demo_tok.eos_token_id
    body = demo_tok.encode("x = 1", add_special_tokens=False)
    result = request_run.RequestResult(body + [eos], "stop", {"generated_tokens": len(body) + 1})
    row = results_file.output_record("a", result, demo_tok)
    assert row["output_ids"] == body + [eos]
    assert row["text"] == "x = 1" and demo_tok.eos_token not in row["text"]


def test_an_output_that_links_to_the_input_is_the_input(tmp_path):
    """A symlink (or hard link) to the request file is that file: writing the outputs there
    replaces the requests."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3]}) + "\n")
    os.symlink(inp, tmp_path / "link.jsonl")
    os.link(inp, tmp_path / "hard.jsonl")
    for name in ("link.jsonl", "hard.jsonl"):
        with pytest.raises(DecodeError, match="is the input file"):
            results_file.check_output_path(str(tmp_path / name), str(inp))
    results_file.check_output_path(str(tmp_path / "new.jsonl"), str(inp))  # a new file is fine
