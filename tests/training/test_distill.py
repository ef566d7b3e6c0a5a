"""Self-distillation data (`prove-jax distill`): records are the model's greedy AR."""

import json

import pytest

from prove_jax.cli import distill as distill_cli
from prove_jax.training import distill
from prove_jax.checkpoints.checkpoint import save_model
from prove_jax.data.corpus import write_corpus
from prove_jax.data.pipeline import load_examples
from prove_jax.decoding import DecodeOptions, Decoder
from prove_jax.models.params import create_model
from tests.decode_helpers import CFG, random_prompts


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("distill") / "ckpt")
    save_model(path, create_model(CFG, seed=3))
    return path


def test_records_are_greedy_continuations(tmp_path, ckpt, capsys):
    prompts = random_prompts()
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    assert distill_cli.main(["--model", ckpt, "--prompts", str(inp), "--out", str(out),
                         "--max-new-tokens", "20", "--batch-size", "3", "--max-prompt-tokens", "10"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    kept = [(f"r{i}", p) for i, p in enumerate(prompts) if len(p) <= 10]  # the 14-token one is skipped
    assert len(kept) < len(prompts) and sorted(r["id"] for r in records) == sorted(i for i, _ in kept)
    ar = Decoder(create_model(CFG, seed=3), [1], DecodeOptions("ar")).generate([p for _, p in kept], 20)
    expected = {i: (p, o) for (i, p), o in zip(kept, ar.output_ids)}
    for r in records:
        assert (r["prompt_ids"], r["response_ids"]) == expected[r["id"]]
    # the training loader reads the file as it is
    assert load_examples(str(out)) == [{"prompt_ids": r["prompt_ids"], "response_ids": r["response_ids"]}
                                       for r in records]
    assert "wrote" in capsys.readouterr().err
    # the batch over 4 data shards, the model over 2 tensor shards: the same records
    sharded = tmp_path / "sharded.jsonl"
    assert distill_cli.main(["--model", ckpt, "--prompts", str(inp), "--out", str(sharded), "--mesh", "4,1,2",
                         "--max-new-tokens", "20", "--batch-size", "3", "--max-prompt-tokens", "10"]) == 0
    assert sharded.read_text() == out.read_text()


def test_errors_leave_no_output(tmp_path, ckpt, capsys):
    out = tmp_path / "out.jsonl"
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 0, "prompt_ids": [3, 4]}) + "\n")
    cases = [(["--model", str(tmp_path / "missing"), "--prompts", str(inp)], "checkpoint not found"),
             (["--model", ckpt, "--corpus", str(tmp_path)], "train.jsonl not found"),
             (["--model", ckpt, "--prompts", str(inp), "--max-prompt-tokens", "1"], "no prompt of 1..1 tokens"),
             (["--model", ckpt, "--prompts", str(inp), "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
             # a negative count was a slice bound: all prompts but the last two
             (["--model", ckpt, "--prompts", str(inp), "--num-prompts", "-2"], "--num-prompts must be >= 1, got -2"),
             (["--model", ckpt, "--prompts", str(inp), "--mix-corpus-chars", "-5"], "must be >= 0"),
             (["--model", ckpt, "--prompts", str(inp), "--mix-corpus-chars", "10"], "takes its text from --corpus")]
    for args, expect in cases:
        assert distill_cli.main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err, err
        assert not out.exists()
    # a bad prompt is named by its request id, not by its index in the shuffled sample
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"id": f"r{i}", "prompt_ids": p}) + "\n"
                           for i, p in enumerate([[3, 4], [5, 6], [3, 10**6], [7, 8]])))
    assert distill_cli.main(["--model", ckpt, "--prompts", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "request 'r2' has token id 1000000 outside the vocabulary" in err and not out.exists(), err
    assert distill_cli.main(["--model", ckpt, "--prompts", str(inp), "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err  # was a traceback after the whole decode
    assert distill_cli.main(["--model", ckpt, "--prompts", str(inp), "--out", str(inp)]) == 2
    assert "--out" in (err := capsys.readouterr().err) and "is the input file" in err
    assert json.loads(inp.read_text()) == {"id": 0, "prompt_ids": [3, 4]}  # the prompts are intact


def test_train_split_function_prompts(tmp_path):
    write_corpus(str(tmp_path / "corpus"), max_bytes=1_500_000, max_prompts=4)
    prompts = distill.train_function_prompts(str(tmp_path / "corpus"))
    assert len(prompts) > 20
    train_paths = {json.loads(x)["path"] for x in (tmp_path / "corpus" / "train.jsonl").read_text().splitlines()}
    for p in prompts:
        assert p["id"].split(":")[0].removeprefix("stdlib/") in train_paths  # never the held-out split
        assert p["prompt"].lstrip().startswith(("def ", "async def ", "@"))
        assert p["prompt"].rstrip().endswith(('"""', "'''"))
    mixed = distill.corpus_text_sample(str(tmp_path / "corpus"), 20_000, seed=0)
    sizes = [len(r["text"]) for r in mixed]
    assert sum(sizes[:-1]) <= 20_000 < sum(sizes)  # whole files until the cap is passed
    assert all(r["text"] in {json.loads(x)["text"] for x in (tmp_path / "corpus" / "train.jsonl").read_text().splitlines()}
               for r in mixed)
    sample = distill.sample_prompts(prompts, 5, seed=1)
    assert len(sample) == 5 and sample == distill.sample_prompts(prompts, 5, seed=1)
    assert sample != distill.sample_prompts(prompts, 5, seed=2)
