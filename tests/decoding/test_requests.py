"""Request files for `infer.generate`: what a record may hold, and one clear error per mistake."""

import json
import os
import stat
import threading

import pytest

from prove_jax.decoding import DecodeError
from prove_jax.decoding.requests import read_requests


def _write(tmp_path, lines):
    path = tmp_path / "in.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_records_keep_their_ids_and_missing_ids_get_their_index(tmp_path):
    path = _write(tmp_path, [{"id": "a", "prompt": "def f():"}, "", {"prompt_ids": [4, 5]},
                             {"id": 7, "prompt_ids": [6]}])
    recs = read_requests(path)
    assert [r["id"] for r in recs] == ["a", 1, 7]
    assert recs[1]["prompt_ids"] == [4, 5]


@pytest.mark.parametrize("lines,message", [
    (["{nope"], r"in.jsonl:1: not valid JSON"),
    ([{"id": "a"}], r"in.jsonl:1: a record needs 'prompt' \(text\) or 'prompt_ids'"),
    ([[1, 2]], r"in.jsonl:1: a record needs"),
    ([[{"id": "a", "prompt": "x"}]], r"in.jsonl:1: a JSON array of records; JSON Lines has one record"),
    ([{"id": "a", "prompt": "x", "prompt_ids": [1]}], r"in.jsonl:1: give 'prompt' or 'prompt_ids', not both"),
    ([{"id": "a", "prompt": [1, 2]}], r"in.jsonl:1: 'prompt' must be a string"),
    ([{"id": "a", "prompt": "x"}, "", {"id": "a", "prompt": "y"}], r"in.jsonl:3: duplicate id 'a' \(first on line 1\)"),
    ([{"prompt": "x"}, {"id": 0, "prompt": "y"}],  # 0 = index of the first
     r"in.jsonl:2: duplicate id 0 \(the record on line 1 has no 'id' and got 0, its index, by default\)"),
    # the record without an id is the one to blame, not called a duplicate of its own accord
    ([{"id": 1, "prompt": "x"}, {"prompt": "y"}],
     r"in.jsonl:2: this record has no 'id', and its default id 1 \(its index\) is already used on line 1: "
     r"give every record an id"),
    # malformed prompt_ids are found with the records, named by line, before any model loads
    ([{"id": "a", "prompt_ids": [4, 5.0]}], r"in.jsonl:1: 'prompt_ids' must be a list of integers"),
    ([{"id": "a", "prompt_ids": ["4"]}], r"in.jsonl:1: 'prompt_ids' must be a list of integers"),
    ([{"id": "a", "prompt_ids": None}], r"in.jsonl:1: 'prompt_ids' must be a list of integers .*null"),
    ([{"id": "a", "prompt_ids": 4}], r"in.jsonl:1: 'prompt_ids' must be a list of integers"),
    ([{"id": "a", "prompt_ids": [True, 5]}], r"in.jsonl:1: 'prompt_ids' must be a list of integers"),
    ([{"id": "a", "prompt_ids": [4, -1]}], r"in.jsonl:1: 'prompt_ids' has a negative token id -1"),
    ([{"id": "a", "prompt_ids": [4]}, {"id": "b", "prompt_ids": []}], r"in.jsonl:2: 'prompt_ids' is empty"),
    ([{"id": ["a"], "prompt": "x"}], r"in.jsonl:1: 'id' must be a string or an integer"),
    ([{"id": True, "prompt": "x"}], r"'id' must be a string or an integer"),
    ([], r"has no records"),
])
def test_bad_request_files_name_the_line_and_the_problem(tmp_path, lines, message):
    with pytest.raises(DecodeError, match=message):
        read_requests(_write(tmp_path, lines))


def test_request_files_from_editors_read_as_the_training_data_does(tmp_path):
    """One JSONL reader for data, corpus and requests: a BOM (Notepad writes one) was 'not valid
    JSON', and a Latin-1 byte a UnicodeDecodeError traceback naming no line."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "prompt": "x = 1\u2028"},
                                                     ensure_ascii=False).encode() + b"\r\n")
    assert read_requests(str(path)) == [{"id": "a", "prompt": "x = 1\u2028"}]
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DecodeError, match=r"in.jsonl:2: not UTF-8"):
        read_requests(str(path))


def test_missing_request_file(tmp_path):
    with pytest.raises(DecodeError, match="input file not found"):
        read_requests(str(tmp_path / "absent.jsonl"))


def test_an_output_that_is_a_directory_or_the_input_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """Both used to be found only after decoding: a directory failed at the rename, and the
    request file itself was silently replaced by the outputs."""
    from prove_jax.cli import generate
    loaded = []
    monkeypatch.setattr(generate, "build_decoder", lambda *a, **k: loaded.append(a))
    path = _write(tmp_path, [{"id": "a", "prompt_ids": [4, 5]}])
    before = open(path).read()
    cases = [(str(tmp_path), "is a directory"), (str(tmp_path / "." / "in.jsonl"), "is the input file"),
             # these were found only after the whole decode, when the outputs were written
             ("", "--output is empty"),
             (str(tmp_path / "in.jsonl" / "out.jsonl"), "cannot make its directory"),
             ("/sys/out.jsonl", "--output /sys/out.jsonl cannot be written")]  # not even root may
    for output, message in cases:
        assert generate.main(["--input", path, "--output", output]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert open(path).read() == before and not loaded


def test_a_missing_output_directory_is_made_and_nothing_is_left_in_it(tmp_path):
    from prove_jax.decoding.results_file import check_output_path
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    check_output_path(str(out), None)
    assert os.listdir(out.parent) == []  # the probe is gone, no output yet


def test_outputs_go_through_symlinks_and_into_fifos_and_devices(tmp_path):
    """Records are appended through a symlink to its target (the link stays), and written into
    a FIFO or /dev/null, which stay what they are."""
    from prove_jax.decoding.results_file import ResultsFile, check_output_path

    def write_outputs(path):
        out = ResultsFile(path)
        out.write({"id": "a", "output_ids": [4, 5]})
        out.close()
    target = tmp_path / "runs" / "out.jsonl"
    target.parent.mkdir()
    target.write_text(json.dumps({"id": "earlier"}) + "\n")
    link = tmp_path / "latest.jsonl"
    os.symlink(target, link)
    check_output_path(str(link), None)
    write_outputs(str(link))
    assert os.path.islink(link) and os.readlink(link) == str(target)
    assert [json.loads(x)["id"] for x in target.read_text().splitlines()] == ["earlier", "a"]
    assert sorted(os.listdir(target.parent)) == ["out.jsonl"]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    check_output_path(str(fifo), None)
    write_outputs(str(fifo))
    reader.join(timeout=10)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and json.loads(got[0])["output_ids"] == [4, 5]

    if os.path.exists("/dev/null") and stat.S_ISCHR(os.stat("/dev/null").st_mode):
        check_output_path("/dev/null", None)
        write_outputs("/dev/null")  # written into, not renamed over
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_adaptive_and_calibrated_lossless_default_to_the_widest_table_block():
    """--adaptive without --block-size ran K=4, which capped the GPU/TPU table's batch-1 row
    (K=8, 8 groups) at K=4; --calibrate already defaulted to 8."""
    from prove_jax.cli import generate

    def block(*argv):
        args = generate.parse_args(["--input", "in.jsonl", "--output", "out.jsonl", *argv])
        generate.check_mode_options(args)
        return generate.decode_options(args).block_size
    assert block("--mode", "lossless", "--adaptive") == 8
    assert block("--mode", "lossless", "--calibrate") == 8
    assert block("--mode", "lossless") == 4
    assert block("--mode", "lossless", "--adaptive", "--block-size", "6") == 6
    assert block("--mode", "threshold") == block("--mode", "verify") == 8
    assert block("--mode", "ar") == 1


def test_chat_with_only_token_id_prompts_says_it_changes_nothing(tmp_path, capsys, monkeypatch):
    from prove_jax.cli import generate

    def build(*a, **k):
        raise DecodeError("stop before loading")
    monkeypatch.setattr(generate, "build_decoder", build)
    out = str(tmp_path / "out.jsonl")
    ids_only = _write(tmp_path, [{"id": "a", "prompt_ids": [4, 5]}])
    generate.main(["--input", ids_only, "--output", out, "--chat"])
    assert "note: --chat wraps text prompts only" in capsys.readouterr().err
    generate.main(["--input", _write(tmp_path, [{"id": "a", "prompt": "x"}]), "--output", out, "--chat"])
    assert "note: --chat" not in capsys.readouterr().err


def test_prompt_ids_must_be_ints_not_booleans():
    from prove_jax.decoding.requests import encode_prompts
    assert encode_prompts([{"id": "a", "prompt_ids": [4, 5]}], None) == [[4, 5]]
    with pytest.raises(DecodeError, match=r"request 'a': 'prompt_ids' must be a list of integers"):
        encode_prompts([{"id": "a", "prompt_ids": [True, 5]}], None)  # JSON true is not token 1


def test_chat_without_a_chat_template_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """Text prompts are encoded before any weight is read: a tokenizer without a chat template
    failed with transformers' message only after the model had loaded."""
    import shutil
    from prove_jax.cli import generate
    from prove_jax import assets

    def build(*a, **k):
        raise DecodeError("stop before loading")
    monkeypatch.setattr(generate, "build_decoder", build)
    model = tmp_path / "model"  # the demo proposer's config and tokenizer, no chat template
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(assets.DEMO_PROPOSER, name), model / name)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    text = _write(tmp_path, [{"id": "a", "prompt": "x"}])
    out = str(tmp_path / "out.jsonl")
    assert generate.main(["--model", str(model), "--input", text, "--output", out, "--chat"]) == 2
    err = capsys.readouterr().err
    assert "--chat: the checkpoint's tokenizer has no chat template" in err and "stop before" not in err
    assert generate.main(["--model", str(model), "--input", text, "--output", out]) == 2
    assert "stop before loading" in capsys.readouterr().err  # without --chat it gets that far


def test_run_requests_names_bad_requests_by_id_and_reports_what_ran():
    """Errors name the request id (not its position), and the summary's `setting` is the layout
    actually decoded: adaptive lossless chose AR on CPU, which mode alone does not say."""
    from prove_jax.decoding import DecodeOptions, Decoder, LosslessRule
    from prove_jax.decoding.request_run import run_requests
    from prove_jax.models.params import create_model
    from tests.decode_helpers import CFG
    dec = Decoder(create_model(CFG, seed=3), [1], DecodeOptions("lossless", 4, lossless=LosslessRule(adaptive=True)))
    with pytest.raises(DecodeError, match=r"request 'second' is empty"):
        run_requests(dec, [[4, 5], []], 8, 1, progress=False, ids=["first", "second"])
    _, summary = run_requests(dec, [[4, 5], [6]], 8, 2, progress=False, ids=["first", "second"])
    assert (summary["mode"], summary["setting"]) == ("lossless", "ar")
    _, summary = run_requests(dec.with_options(DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))),
                                 [[4, 5]], 8, 1, progress=False)
    assert summary["setting"] == "lossless K=4,G=2"


@pytest.mark.parametrize("extra,message", [
    (["--mode", "ar", "--block-size", "4"], "--block-size applies with --mode threshold or lossless or verify, not --mode ar"),
    (["--mode", "lossless", "--tau", "0.8"], "--tau applies with --mode threshold, not --mode lossless"),
    (["--mode", "lossless", "--verifier", "v"], "--verifier applies with --mode verify, not --mode lossless"),
    (["--mode", "ar", "--adaptive"], "--adaptive applies with --mode lossless, not --mode ar"),
    (["--mode", "threshold", "--groups", "2"], "--groups applies with --mode lossless"),
    (["--mode", "threshold", "--commit-rule", "head"], "--commit-rule applies with --mode verify"),
    (["--mode", "verify", "--tau-v", "0.3"], "--tau-v applies with --commit-rule prob, not top1"),
    (["--mode", "verify", "--commit-rule", "prob", "--head-threshold", "0.3"],
     "--head-threshold applies with --commit-rule head, not prob"),
])
def test_an_option_the_mode_does_not_read_is_refused(tmp_path, capsys, monkeypatch, extra, message):
    """They were accepted and ignored: `--mode lossless --tau 0.8` ran plain lossless."""
    from prove_jax.cli import generate
    loaded = []
    monkeypatch.setattr(generate, "build_decoder", lambda *a, **k: loaded.append(a))
    path = _write(tmp_path, [{"id": "a", "prompt_ids": [4, 5]}])
    assert generate.main(["--input", path, "--output", str(tmp_path / "out.jsonl"), *extra]) == 2
    assert message in capsys.readouterr().err and not loaded


def test_options_of_the_mode_reach_the_decoder(tmp_path, monkeypatch):
    from prove_jax.cli import generate
    seen = []

    def build(path, options, **kw):
        seen.append(options)
        raise DecodeError("stop before loading")
    monkeypatch.setattr(generate, "build_decoder", build)
    path = _write(tmp_path, [{"id": "a", "prompt_ids": [4, 5]}])
    base = ["--input", path, "--output", str(tmp_path / "out.jsonl")]
    generate.main(base + ["--mode", "verify", "--commit-rule", "prob", "--tau-v", "0.3"])
    generate.main(base + ["--mode", "threshold", "--confidence", "entropy", "--tau", "1.5"])
    generate.main(base + ["--mode", "verify"])
    assert [(o.verify.commit_rule, o.verify.tau_v) for o in (seen[0], seen[2])] == [("prob", 0.3), ("top1", 0.5)]
    assert (seen[1].threshold.confidence, seen[1].threshold.tau) == ("entropy", 1.5)
