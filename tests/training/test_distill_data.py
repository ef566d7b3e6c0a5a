"""Self-distillation data (training/distill.py and the `distill` CLI) on hand-made corpora whose
sizes and prompts are known: the prompt token cap, the real text mixed in, and the seeded
sample of corpus text."""

from __future__ import annotations

import json

from prove_jax.cli import distill as distill_cli
from prove_jax.training import distill
from prove_jax.checkpoints.checkpoint import load_tokenizer, save_model
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import create_model
from tests.train_helpers import write_tokenizer


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
    """A prompt of exactly --max-prompt-tokens is kept, and the real text of --mix-corpus-chars
    is written after the distilled records, not instead of them."""
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
    """Whole files are taken until the budget is passed (not merely reached), in an order the
    seed decides."""
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
