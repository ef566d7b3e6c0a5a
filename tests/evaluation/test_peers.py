"""evaluation/peers.py, the transformers baselines, against a plain greedy loop of transformers
forwards: a saved generation config does not change greedy, the vocabulary check, assisted
generation's constant draft schedule, and the settings that reach `generate`."""

from __future__ import annotations

import math

import pytest


MAX_NEW = 20


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """A tiny random HF Qwen2 whose saved generation_config.json asks for what a greedy
    baseline must not do: a repetition penalty and a minimum length."""
    import torch
    from tests.hf_models import make_hf_qwen2
    from prove_jax.evaluation import peers
    path = tmp_path_factory.mktemp("hf") / "target"
    model = make_hf_qwen2(path, seed=0)
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.min_new_tokens = MAX_NEW
    model.generation_config.save_pretrained(str(path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield str(path), peers.load_hf_model(str(path))
    torch.set_num_threads(threads)


def _greedy_by_hand(model, prompt, max_new, eos):
    """Full forwards over the whole sequence, argmax, stop before EOS."""
    import torch
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(torch.argmax(model(torch.tensor([ids])).logits[0, -1]))
            if nxt == eos:
                break
            out.append(nxt)
            ids.append(nxt)
    return out


PEER_PROMPTS = [[5, 9, 14, 3], [200, 17, 45, 99, 8, 120, 33], [7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9]]


def test_the_models_saved_generation_config_does_not_change_the_baseline(hf_target):
    from prove_jax.evaluation import peers
    _, model = hf_target
    assert model.generation_config.repetition_penalty == 3.0  # it was loaded
    free = [_greedy_by_hand(model, p, MAX_NEW, eos=-1) for p in PEER_PROMPTS]
    # a token greedy emits first at position 4 or later: the run must stop right before it
    eos = next(t for i, t in enumerate(free[0]) if i >= 4 and t not in free[0][:i])
    run = peers.hf_greedy(model, PEER_PROMPTS, MAX_NEW, eos_token_id=eos, warmup=False)
    assert run.outputs == [_greedy_by_hand(model, p, MAX_NEW, eos) for p in PEER_PROMPTS]
    assert len(run.outputs[0]) == free[0].index(eos)


def test_a_token_id_equal_to_the_vocab_size_is_outside_it(hf_target):
    from prove_jax.evaluation import peers
    _, model = hf_target
    with pytest.raises(peers.PeerError, match="outside the vocabulary"):
        peers.hf_greedy(model, [[3, model.config.vocab_size]], 4, eos_token_id=1, warmup=False)


def test_assisted_with_a_perfect_draft_drafts_a_constant_number_of_tokens(hf_target):
    """num_assistant_tokens=n with the constant schedule: every target forward checks n drafted
    tokens and, all right, commits n + 1, so MAX_NEW tokens take ceil(MAX_NEW / (n + 1))
    forwards (the heuristic schedule, growing by 2 after each full acceptance, takes fewer)."""
    from prove_jax.evaluation import peers
    path, model = hf_target
    draft = peers.load_hf_model(path)
    draft.generation_config.num_assistant_tokens_schedule = "heuristic"  # as a saved config may ask
    free = [_greedy_by_hand(model, p, MAX_NEW, eos=-1) for p in PEER_PROMPTS]
    eos = next(t for t in range(2, 256) if not any(t in o for o in free))  # never emitted
    run = peers.hf_assisted(model, draft, PEER_PROMPTS, MAX_NEW, eos_token_id=eos,
                            num_assistant_tokens=4, assistant_confidence_threshold=0.0, warmup=False)
    assert run.outputs == free
    assert run.target_forwards == [math.ceil(MAX_NEW / 5)] * len(PEER_PROMPTS)


def test_prompt_lookup_and_dtype_settings_reach_transformers(hf_target, monkeypatch):
    import torch
    from prove_jax.evaluation import peers
    path, model = hf_target
    seen = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: seen.append(kw["generation_config"]) or real(**kw))
    peers.hf_prompt_lookup(model, PEER_PROMPTS[:1], 4, eos_token_id=1, prompt_lookup_num_tokens=6,
                           max_matching_ngram_size=3, warmup=False)
    assert [(c.prompt_lookup_num_tokens, c.max_matching_ngram_size, c.do_sample) for c in seen] == [(6, 3, False)]
    half = peers.load_hf_model(path, dtype="bfloat16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
