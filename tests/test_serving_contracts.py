"""Serving and tooling contracts the rest of the suite let through: each test was written against
a plausible bug (a mutant of the code) that every other test passed, and fails on it. The
modules: request files and outputs, checkpoint loading for decoding, atomic writes, the pod dry
run's memory estimate, multi-host start-up, the CLI's Ctrl-C exit and the transformers peer
baselines. The oracles come from outside the code where there is one: the Qwen chat layout
written out by hand, `jax.distributed.initialize`'s own signature, a plain greedy loop of
transformers forwards, the checkpoint's own config and tokenizer files, the umask's file modes;
the dry run's activation estimate is checked term by term against what its docstring says is
kept (K/V per kv head, the three MLP arrays, three float32 vocab-wide arrays, one layer input
per layer with remat)."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from prove_jax import assets, distributed, files
from prove_jax.checkpoints import checkpoint, restore_errors
from prove_jax.training import dry_run as dr
from prove_jax.models.config import ModelConfig
from prove_jax.decoding import DecodeError, DecodeOptions
from prove_jax.decoding import request_run
from prove_jax.decoding import requests
from prove_jax.decoding import results_file
from prove_jax.decoding import BatchResult

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_tok():
    return checkpoint.load_tokenizer(assets.DEMO_PROPOSER)


# ---- request files and outputs --------------------------------------------------------------

def test_chat_prompts_end_with_the_assistant_turn_opened(demo_tok):
    """--chat wraps a text prompt as one user turn and opens the assistant's turn, so the model
    answers instead of continuing the user's message (the Qwen layout, written out by hand)."""
    text = "def add(a, b):"
    want = demo_tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                           add_special_tokens=False)
    got = requests.encode_prompts([{"id": "q", "prompt": text}], demo_tok, chat=True)
    assert got == [want]
    plain = requests.encode_prompts([{"id": "q", "prompt": text}], demo_tok)
    assert plain == [demo_tok.encode(text, add_special_tokens=False)]


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


class _ScriptedDecoder:
    """A stand-in decoder whose per-request counts are set by hand: request i (a prompt [i])
    gets i + 1 tokens in i + 1 proposer forwards and 2 x (i + 1) verifier forwards; each call
    takes 1.5 s to decode and 4 s to compile."""

    def __init__(self):
        self.options = DecodeOptions("verify", 4).validate()
        self.calls = []

    def check_prompts(self, prompts, max_new_tokens, names=None):
        pass

    def generate(self, prompts, max_new_tokens, batch_size=None, prompt_width=None, queue_size=None,
                 params=None):
        self.calls.append((len(prompts), batch_size, prompt_width, queue_size))
        n = [p[0] + 1 for p in prompts]
        return BatchResult(output_ids=[[7] * k for k in n], forwards=np.array(n),
                           verifier_forwards=2 * np.array(n), accept_hist=np.zeros((len(n), 5), int),
                           seconds=1.5, compile_seconds=4.0, options=self.options,
                           step_commits=None, loop_steps=0, finish_reasons=["length"] * len(n))


def test_run_requests_summary_counts_verifier_forwards_and_decode_time_only(monkeypatch):
    monkeypatch.setattr(request_run, "QUEUE_BATCHES", 2)
    dec = _ScriptedDecoder()
    prompts = [[i] * (1 + i % 3) for i in range(5)]  # lengths 1, 2, 3, 1, 2
    results, summary = request_run.run_requests(dec, prompts, 8, 2, progress=False)
    outputs, stats = [r.output_ids for r in results], [r.stats for r in results]
    # chunks of 2 x 2 requests, every one at the run's prompt width and queue size
    assert dec.calls == [(4, 2, 3, 4), (1, 2, 3, 4)]
    assert [len(o) for o in outputs] == [1, 2, 3, 4, 5]
    assert [s["verifier_forwards"] for s in stats] == [2, 4, 6, 8, 10]
    assert summary["generated_tokens"] == 15 and summary["proposer_forwards"] == 15
    assert summary["verifier_forwards"] == 30
    assert summary["decode_seconds"] == 3.0 and summary["compile_seconds"] == 8.0
    assert summary["tokens_per_second"] == pytest.approx(15 / 3.0)  # compile time not in it
    assert summary["setting"] == "verify K=4,top1"


# ---- continuous batching: each request is served once --------------------------------------

def _makespan(lengths, rows):
    """Greedy list scheduling by hand: requests in order, each to the first free row; in AR a
    request of n output tokens holds its row for n steps."""
    free = [0] * rows
    for n in lengths:
        free[free.index(min(free))] += n
    return max(free)


def test_a_full_queue_takes_the_steps_its_requests_need_and_no_more():
    """Once the last request is admitted a finished row stays idle: it must not be handed a
    request past the end of the queue (which reads as the last one again and runs it twice)."""
    from prove_jax.decoding import Decoder
    from prove_jax.models.params import create_model
    from tests.test_decoding import CFG, _prompts
    model = create_model(CFG, seed=3)
    prompts = _prompts(4, (5, 2, 8, 3))
    free = Decoder(model, [-1], DecodeOptions("ar")).generate(prompts, 12).output_ids
    eos = next(t for t in free[0][1:-2] if any(t not in o for o in free))  # ends some rows early
    want = [o[: o.index(eos) + 1] if eos in o else o for o in free]
    assert len({len(o) for o in want}) > 1
    dec = Decoder(model, [eos], DecodeOptions("ar"))
    for rows in (1, 2):  # 4 requests: a queue exactly full, no padding requests
        res = dec.generate(prompts, 12, batch_size=rows)
        assert res.output_ids == want and list(res.forwards) == [len(o) for o in want]
        assert res.loop_steps == _makespan([len(o) for o in want], rows), rows


# ---- loading a decoder ----------------------------------------------------------------------

def test_build_decoder_loads_the_verifier_and_its_head_from_the_verifier_checkpoint():
    from prove_jax.decoding.loading import build_decoder
    verifier_cfg = checkpoint.load_config(assets.DEMO_VERIFIER)
    proposer_cfg = checkpoint.load_config(assets.DEMO_PROPOSER)
    assert (verifier_cfg.num_layers, verifier_cfg.hidden_size) != (proposer_cfg.num_layers, proposer_cfg.hidden_size)
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("verify", 4),
                           verifier_path=assets.DEMO_VERIFIER)
    assert (dec.verifier_cfg.num_layers, dec.verifier_cfg.hidden_size) == (verifier_cfg.num_layers,
                                                                          verifier_cfg.hidden_size)
    dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("verify", 4, commit_rule="head"),
                           verifier_path=assets.DEMO_VERIFIER)
    assert dec.head_hidden_size == verifier_cfg.hidden_size


def test_build_decoder_dtype_sets_the_parameters_dtype_too():
    """--dtype is the compute and parameter dtype: the demo's bfloat16-stored weights are
    restored as float32 by default, and as bfloat16 when asked."""
    from prove_jax.decoding.loading import build_decoder
    assert checkpoint.load_config(assets.DEMO_PROPOSER).param_dtype == "bfloat16"
    for dtype in ("float32", "bfloat16"):
        dec, _ = build_decoder(assets.DEMO_PROPOSER, DecodeOptions("ar"), dtype=dtype)
        assert {str(x.dtype) for x in jax.tree.leaves(dec.state)} == {dtype}


def test_a_checkpoint_without_eos_ids_stops_at_its_tokenizers_eos(tmp_path, demo_tok):
    from prove_jax.decoding.loading import build_decoder
    from prove_jax.models.params import create_model
    cfg = ModelConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, eos_token_ids=(), pad_token_id=None)
    path = str(tmp_path / "ckpt")
    checkpoint.save_model(path, create_model(cfg, seed=0), tokenizer_dir=assets.DEMO_PROPOSER)
    dec, tok = build_decoder(path, DecodeOptions("ar"))
    assert tok is not None and list(dec.eos_ids) == [demo_tok.eos_token_id]
    assert dec.pad_id == demo_tok.eos_token_id


def test_parse_mesh_defaults_to_every_device_on_data_and_wants_three_sizes():
    from prove_jax.decoding.loading import parse_mesh
    n = len(jax.devices())
    assert n > 1  # conftest's simulated devices
    assert dict(parse_mesh(None).shape) == {"data": n, "fsdp": 1, "tensor": 1}
    for bad in ("2,4", "1,2,2,2"):
        with pytest.raises(DecodeError, match="three integers"):
            parse_mesh(bad)


# ---- checkpoints and atomic writes ----------------------------------------------------------

def _mode(path):
    return os.stat(path).st_mode & 0o777


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_text_gets_the_umask_mode_and_leaves_nothing_behind_on_error(tmp_path, umask_022):
    out = tmp_path / "sub" / "out.txt"  # the parent is made
    files.atomic_write_text(str(out), "one\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    assert out.read_text() == "one\n" and _mode(out) == _mode(plain) == 0o644
    with pytest.raises(UnicodeEncodeError):
        files.atomic_write_text(str(out), "two \ud800\n")  # fails mid-write
    assert out.read_text() == "one\n" and os.listdir(out.parent) == ["out.txt"]


def test_atomic_dir_mode_replacement_failure_and_symlinks(tmp_path, umask_022):
    base = tmp_path / "base"
    base.mkdir()
    final = base / "out"
    with files.atomic_dir(str(final)) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
    os.mkdir(tmp_path / "plain")
    assert _mode(final) == _mode(tmp_path / "plain") == 0o755
    with files.atomic_dir(str(final)) as tmp:  # replaces the earlier output whole
        open(os.path.join(tmp, "b"), "w").close()
    assert os.listdir(final) == ["b"] and os.listdir(base) == ["out"]
    with pytest.raises(RuntimeError):
        with files.atomic_dir(str(final)) as tmp:
            open(os.path.join(tmp, "c"), "w").close()
            raise RuntimeError("crash mid-write")
    assert os.listdir(final) == ["b"] and os.listdir(base) == ["out"]
    # a symlinked output is followed: the link stays, its target gets the new contents
    os.symlink(final, tmp_path / "link")
    with files.atomic_dir(str(tmp_path / "link")) as tmp:
        open(os.path.join(tmp, "d"), "w").close()
    assert os.path.islink(tmp_path / "link") and os.listdir(final) == ["d"]
    assert os.listdir(base) == ["out"]


def test_an_empty_directory_may_be_the_output():
    import tempfile
    with tempfile.TemporaryDirectory() as empty:
        files.check_replaceable(empty, "params", "a checkpoint", checkpoint.CheckpointError)


def test_tokenizer_files_carry_the_chat_template(tmp_path, demo_tok):
    copied = checkpoint.copy_tokenizer_files(assets.DEMO_PROPOSER, str(tmp_path))
    assert "chat_template.jinja" in copied
    assert checkpoint.load_tokenizer(str(tmp_path)).chat_template == demo_tok.chat_template


def test_restore_error_reason_is_the_first_line_without_the_spec_dump():
    e = ValueError("NOT_FOUND: Error opening file x [tensorstore_spec={...}]\nTraceback junk\nmore")
    assert restore_errors.restore_error_reason(e) == "NOT_FOUND: Error opening file x"


# ---- dry run: the activation estimate, term by term -----------------------------------------

BASE = ModelConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=8)
ROWS, LENGTH = 2, 16
TOK = ROWS * LENGTH


def _act(cfg, remat=False):
    return dr.activation_bytes(cfg, ROWS, LENGTH, tensor=1, remat=remat)


def test_kv_heads_enter_only_through_k_and_v():
    """One kv head fewer drops K and V ([tokens, head_dim] each, float32) in every layer; the
    attention scores are per query head and do not change."""
    fewer = BASE.replace(num_kv_heads=1)
    assert _act(BASE) - _act(fewer) == BASE.num_layers * TOK * 4 * 2 * BASE.head_dim


def test_mlp_keeps_gate_up_and_their_product_and_the_loss_three_float32_vocab_arrays():
    wider = BASE.replace(intermediate_size=BASE.intermediate_size + 1)
    assert _act(wider) - _act(BASE) == BASE.num_layers * TOK * 4 * 3
    more_vocab = BASE.replace(vocab_size=BASE.vocab_size + 1)
    for dtype in ("float32", "bfloat16"):  # logits, softmax, gradient are float32 either way
        assert _act(more_vocab.replace(dtype=dtype)) - _act(BASE.replace(dtype=dtype)) == 3 * TOK * 4


def test_remat_keeps_one_layer_input_per_layer_in_the_compute_dtype():
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        cfg = BASE.replace(dtype=dtype)
        deeper = cfg.replace(num_layers=cfg.num_layers + 1)
        assert _act(deeper, remat=True) - _act(cfg, remat=True) == TOK * cfg.hidden_size * nbytes
    assert _act(BASE, remat=True) < _act(BASE, remat=False)


def test_dry_run_divides_by_accumulation_and_data_shards_and_splits_over_tensor(tmp_path):
    from tests.train_helpers import tiny_config
    cfg = tiny_config(tmp_path, mesh=[1, 4, 2], global_batch_size=16,
                      overrides=["optimizer.grad_accum=2"], target_chip="v5e")
    report = dr.dry_run(cfg)
    # 16 sequences / 2 micro-batches / (data 1 x fsdp 4) = 2 per device; MARS streams 2 x 32
    assert report.micro_batch_per_device == 2 and report.streamed_length == 64
    model_cfg = dr._model_config_for(cfg)
    by_tensor = {t: dr.activation_bytes(model_cfg, 2, 64, tensor=t, remat=cfg.model.remat) for t in (2, 4)}
    assert by_tensor[2] != by_tensor[4] and report.activation_bytes == by_tensor[2]


def test_fits_keeps_ten_percent_of_hbm_free_and_chips_are_named_in_any_case():
    hbm = dr.chip_hbm_bytes("V5P")
    assert hbm == dr.chip_hbm_bytes("v5p") == 95 * dr.GIB and dr.chip_hbm_bytes("h100") == 80 * dr.GIB

    def report(total):
        return dr.DryRunReport(chip="v5p", hbm_bytes=hbm, mesh={}, devices=1, model_params=1,
                               param_bytes=total, grad_bytes=0, opt_bytes=0, activation_bytes=0,
                               lowered=True, lower_seconds=0.0, micro_batch_per_device=1,
                               streamed_length=1)
    assert report(int(0.9 * hbm)).fits and not report(int(0.95 * hbm)).fits
    assert "DOES NOT FIT" in report(int(0.95 * hbm)).describe()


# ---- multi-host start-up --------------------------------------------------------------------

@pytest.fixture
def joined(monkeypatch):
    """Calls to jax.distributed.initialize, bound to its real signature (nothing is started)."""
    sig = inspect.signature(jax.distributed.initialize)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize",
                        lambda *a, **k: calls.append(dict(sig.bind(*a, **k).arguments)))
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("MEGASCALE_COORDINATOR_ADDRESS", raising=False)
    return calls


def test_explicit_launch_arguments_reach_jax_by_name(joined):
    assert distributed.initialize("10.0.0.1:1234", 4, 3, heartbeat_timeout_s=20, init_timeout_s=90)
    assert joined == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3,
                       "heartbeat_timeout_seconds": 20, "initialization_timeout": 90}]


def test_launch_arguments_are_checked_and_one_process_is_not_a_job(joined):
    for pid in (2, -1):
        with pytest.raises(distributed.DistributedError, match="outside"):
            distributed.initialize("h:1", 2, pid)
    with pytest.raises(distributed.DistributedError, match="go together"):
        distributed.initialize("h:1", 2, None)
    assert distributed.initialize("h:1", 1, 0) is False
    assert joined == []


def test_only_a_multi_host_tpu_slice_joins_without_arguments(joined, monkeypatch):
    assert distributed.initialize() is False
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")  # a single-host TPU VM
    assert distributed.initialize() is False and joined == []
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "t1k-w-0,t1k-w-1")
    assert distributed.initialize() is True and joined == [{}]


# ---- Ctrl-C ---------------------------------------------------------------------------------

def test_ctrl_c_exits_130_with_one_line_on_stderr():
    code = ("from prove_jax.cli.runner import run_cli\n"
            "def main():\n    raise KeyboardInterrupt\n"
            "run_cli(main)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr.strip()) == (130, "", "interrupted")
    r = subprocess.run([sys.executable, "-c", "from prove_jax.cli.runner import run_cli\nrun_cli(lambda: 3)\n"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3


# ---- transformers peer baselines ------------------------------------------------------------

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
