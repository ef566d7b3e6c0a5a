"""Qwen3 (dense) beside Qwen2: transformers' Qwen3ForCausalLM is the outside oracle.

Tiny random configs written by `save_pretrained`: logits after hf-to-flax; greedy `generate`
against our AR, lossless and commit-head verify decoding token for token, and the commit head's
labels; flax-to-hf reloaded by transformers; the published presets' parameter counts against
transformers' own models; MARS training from an HF Qwen3 directory (its first clean-stream loss
against transformers' loss); the commit head trained on a Qwen3 pair; a sharded forward;
inflation; the families and settings the converter refuses before reading any weight; and chat
prompts in the checkpoint's own template with Qwen3's thinking switch.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P

from prove_jax import assets
from prove_jax.checkpoints import convert, safetensors_io
from prove_jax.checkpoints.checkpoint import load_model, load_tokenizer, save_model
from prove_jax.checkpoints.commit_head_io import load_commit_head
from prove_jax.cli import convert as convert_cli
from prove_jax.cli import generate
from prove_jax.data import pipeline as data_lib
from prove_jax.data.chat import chat_problem
from prove_jax.decoding import DecodeError, DecodeOptions, Decoder, LosslessRule, VerifyRule
from prove_jax.decoding.requests import encode_prompts
from prove_jax.decoding.text import TextGenerator
from prove_jax.models import sharding
from prove_jax.models.attention import causal_mask
from prove_jax.models.commit_head import CommitHead
from prove_jax.models.config import PRESETS, ConfigError, ModelConfig
from prove_jax.models.inflate import inflate, inflated_config
from prove_jax.models.params import create_model, flat_params, param_logical_axes
from prove_jax.training.commit_head_training import propose_and_label, train_commit_head
from prove_jax.training.config import TrainConfigError, load_config
from prove_jax.training.loop import train
from tests.hf_models import hf_greedy, our_logits, random_tokens, torch_logits, torch_loss
from tests.tokenizers_fixture import make_tokenizer
from tests.train_helpers import first_batch, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=5, bos_token_id=0,
            pad_token_id=0, mask_token_id=250)


def make_hf_qwen3(out_dir, seed: int = 0, **overrides) -> transformers.Qwen3ForCausalLM:
    """Random Qwen3ForCausalLM saved to `out_dir`. Its RMSNorm weights are randomised too (HF
    initialises them to ones, which would hide a q/k-norm applied to the wrong axis or not at all)."""
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**(TINY | overrides))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(str(out_dir))
    return model





@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(HF Qwen3 model, its directory, our conversion of it): tied, GQA 2, head_dim 24 != 64/4."""
    root = tmp_path_factory.mktemp("qwen3")
    hf = make_hf_qwen3(root / "hf", seed=1)
    convert.hf_to_flax(str(root / "hf"), str(root / "ours"))
    return hf, root / "hf", root / "ours"


def test_tied_logits_match_transformers_and_greedy_generate_is_ar_and_lossless(pair):
    hf, _, ours_dir = pair
    ours = load_model(str(ours_dir))
    assert ours.cfg.model_type == "qwen3" and ours.cfg.head_dim == 24 and ours.cfg.tie_word_embeddings
    tokens = random_tokens()
    err = np.abs(our_logits(ours, tokens) - torch_logits(hf, tokens)).max()
    assert err <= 1e-4, err

    rs = np.random.RandomState(3)
    prompts = [rs.randint(6, 240, n).tolist() for n in (5, 11, 2, 17)]
    ref = hf_greedy(hf, prompts, 16, eos_id=5)
    ar = Decoder(ours, [5], DecodeOptions("ar")).generate(prompts, 16)
    assert ar.output_ids == ref
    lossless = Decoder(ours, [5], DecodeOptions("lossless", 4, lossless=LosslessRule(max_groups=2))).generate(prompts, 16)
    assert lossless.output_ids == ref

    # verify mode judged by a commit head on the Qwen3 verifier's states: above 1 it commits
    # only each block's exact first token, transformers' greedy text
    head = CommitHead(ours.cfg.hidden_size, rngs=nnx.Rngs(0))
    verify = DecodeOptions("verify", 4, verify=VerifyRule(commit_rule="head", head_threshold=1.1))
    assert Decoder(ours, [5], verify, verifier=ours, commit_head=head).generate(prompts, 16).output_ids == ref

    # the commit head's labels: the proposer's block after each prompt, 1 while it is still
    # transformers' greedy continuation
    k = 4
    same = [p[:5] for p in prompts if len(p) >= 5]
    block, labels = nnx.jit(lambda m, c: propose_and_label(m, c, k, m.cfg.mask_token_id))(ours, jnp.asarray(same))
    for d, lab, want in zip(np.asarray(block), np.asarray(labels), hf_greedy(hf, same, k, eos_id=-1)):
        assert d[0] == want[0]
        assert (lab == np.cumprod([d[i + 1] == want[i + 1] for i in range(k - 1)])).all()


def test_untied_gqa4_round_trip_through_transformers(tmp_path):
    """hf-to-flax then flax-to-hf (sharded files): transformers reloads it as Qwen3 with no
    missing or unexpected key and the same logits; the qwen3 config keys survive."""
    overrides = dict(tie_word_embeddings=False, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    hf = make_hf_qwen3(tmp_path / "hf", seed=2, **overrides)
    cfg = convert.hf_to_flax(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert (cfg.model_type, cfg.rope_theta, cfg.tie_word_embeddings) == ("qwen3", 1e6, False)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    tokens = random_tokens(length=40, seed=1)  # long enough that theta 1e4 vs 1e6 differs visibly
    ref = torch_logits(hf, tokens)
    ours = load_model(str(tmp_path / "ours"))
    assert not any(k.endswith("_bias") for k in flat_params(ours))
    assert np.abs(our_logits(ours, tokens) - ref).max() <= 1e-4

    files = convert.flax_to_hf(str(tmp_path / "ours"), str(tmp_path / "back"), max_shard_size=40_000)
    assert len(files) > 1
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"),
                                                                   output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back) is transformers.Qwen3ForCausalLM
    saved = json.loads((tmp_path / "back" / "config.json").read_text())
    assert saved["model_type"] == "qwen3" and saved["attention_bias"] is False
    assert np.abs(torch_logits(back.eval(), tokens) - ref).max() <= 1e-5


def test_a_qwen3_model_inflates_keeping_its_head_dim(pair, tmp_path):
    """Inflated (wider, more heads and layers, head_dim kept), the converted model gives
    transformers its source's logits; a new head_dim is refused (the q/k norm averages over it)."""
    hf, _, ours_dir = pair
    small = load_model(str(ours_dir))
    shape = ModelConfig(vocab_size=1, hidden_size=80, intermediate_size=160, num_layers=3, num_heads=6,
                        num_kv_heads=3, head_dim=24)
    save_model(str(tmp_path / "big"), inflate(small, shape))
    convert.flax_to_hf(str(tmp_path / "big"), str(tmp_path / "big_hf"))
    big = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "big_hf")).eval()
    tokens = random_tokens(seed=5)
    assert np.abs(torch_logits(big, tokens) - torch_logits(hf, tokens)).max() <= 1e-4
    with pytest.raises(ConfigError, match="head_dim 32 != 24"):
        inflated_config(small.cfg, shape.replace(head_dim=32))


def test_presets_are_transformers_models_of_the_published_sizes():
    """Each preset's HF config builds (on torch's meta device) a model with exactly the
    parameters num_params counts, of the family it names; the HF dict reads back as the preset."""
    published = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9,
                 "qwen3-14b": 14.8e9, "qwen3-32b": 32.8e9}
    for name, cfg in PRESETS.items():
        d = cfg.to_hf_dict()
        hf_cfg = transformers.AutoConfig.for_model(**d)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        assert type(model).__name__ == d["architectures"][0], name
        assert cfg.num_params == sum(p.numel() for p in model.parameters()), name
        assert ModelConfig.from_hf_dict(d) == cfg, name
        if name in published:
            assert cfg.model_type == "qwen3"
            assert abs(cfg.num_params - published[name]) / published[name] < 0.02, (name, cfg.num_params)



def test_mars_finetune_from_an_hf_qwen3_dir(tmp_path):
    """MARS from a Qwen3 directory converted on the fly: the first step's clean-stream loss is
    transformers' AR loss of the same batch, the loss falls, and the exported model is qwen3."""
    hf = make_hf_qwen3(tmp_path / "hf", seed=4, vocab_size=320, eos_token_id=0, pad_token_id=0,
                       mask_token_id=None)
    cfg = tiny_config(tmp_path, "mars", objective="mars", steps=3, save_every=3,
                      model={"hf_dir": str(tmp_path / "hf")})
    result = train(cfg, show_bar=False)
    np.testing.assert_allclose(result.records[0]["loss_clean"], torch_loss(hf, first_batch(cfg)), rtol=2e-5)
    assert result.records[-1]["loss"] < result.records[0]["loss"]
    trained = load_model(result.model_dir).cfg
    assert trained.model_type == "qwen3" and trained.mask_token_id is not None


def test_commit_head_trains_on_a_qwen3_pair(tmp_path):
    """objective=commit_head with a Qwen3 proposer and verifier: the head learns (its loss
    falls) and is exported beside the Qwen3 verifier."""
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, mask_token_id=299, eos_token_ids=(0,), pad_token_id=0,
                      model_type="qwen3")
    make_tokenizer(300).save_pretrained(str(tmp_path / "tok"))
    save_model(str(tmp_path / "p"), create_model(cfg, seed=11), tokenizer_dir=str(tmp_path / "tok"))
    save_model(str(tmp_path / "v"), create_model(cfg.replace(hidden_size=16, num_heads=2, num_kv_heads=1), seed=12),
               tokenizer_dir=str(tmp_path / "tok"))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": f" return x + {i}"}) + "\n"
                            for i in range(8)))
    run = load_config(os.path.join(REPO, "configs", "tiny.yaml"), [
        f"proposer={tmp_path / 'p'}", f"model.checkpoint={tmp_path / 'v'}", f"data={data}",
        "objective=commit_head", "max_length=32", "block_size=4", "global_batch_size=8", "log_every=1",
        f"run_dir={tmp_path / 'run'}", "tokenizer.bpe_vocab_size=null", f"tokenizer.path={tmp_path / 'tok'}",
        "steps=2", "optimizer.lr=1e-2"])
    result = train_commit_head(run, show_bar=False)
    losses = [r["loss"] for r in result["records"]]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert load_model(result["model_dir"]).cfg.model_type == "qwen3"
    assert load_commit_head(result["model_dir"]).hidden_size == 16


# ---- refused before any weight is read ---------------------------------------------------------

def _edit_config(hf_dir, **changes):
    path = hf_dir / "config.json"
    d = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in d.items() if v is not ...}))


REFUSALS = {
    "moe_family": (dict(model_type="qwen3_moe", num_experts=8), ("unsupported model_type 'qwen3_moe'",
                                                               "mixture-of-experts", "supported: qwen2, qwen3")),
    "experts_in_a_dense_family": (dict(num_experts=8), ("8 experts", "only dense MLPs")),
    # transformers writes layer_types, all full when saved without a window: dropped, the
    # window counts from max_window_layers on, as Qwen3Config derives it
    "sliding_window_layers": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=1,
                                   layer_types=...),
                              ("sliding-window attention (window 64 on layer(s) 1)",)),
    "yarn_rope_scaling": (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 32768}),
                          ("rope_type 'yarn' is not supported",)),
    "attention_bias": (dict(attention_bias=True), ("attention_bias true is not supported for qwen3",)),
    "qwen3_weights_labelled_qwen2": (dict(model_type="qwen2"), ("_norm.weight", "a qwen2 model has no such tensor")),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_families_and_settings_are_refused_before_any_weight_is_read(
        case, pair, tmp_path, capsys, monkeypatch):
    _, hf_dir, _ = pair
    shutil.copytree(hf_dir, tmp_path / "hf")
    changes, needles = REFUSALS[case]
    _edit_config(tmp_path / "hf", **changes)

    def no_weight_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the refusal")

    monkeypatch.setattr(safetensors_io, "read_tensor", no_weight_read)
    monkeypatch.setattr(safetensors_io, "iter_tensors", no_weight_read)
    code = convert_cli.main(["hf-to-flax", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not (tmp_path / "out").exists()


def test_a_qwen2_bias_in_a_qwen3_file_is_named(pair, tmp_path, capsys):
    _, hf_dir, _ = pair
    shutil.copytree(hf_dir, tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    tensors["model.layers.1.self_attn.q_proj.bias"] = np.zeros(4 * 24, np.float32)
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    assert convert_cli.main(["hf-to-flax", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    assert ("unexpected weight 'model.layers.1.self_attn.q_proj.bias'" in capsys.readouterr().err)


# ---- sharding ----------------------------------------------------------------------------------

def test_sharded_forward_matches_transformers_and_qk_norms_are_replicated(pair):
    """The converted model loaded onto a 2x2x2 mesh: the per-head norm weights [Dh] lie whole
    on every device (each device normalises whole heads), the rest as for Qwen2; the sharded
    logits are transformers'."""
    assert jax.device_count() == 8, "tests/conftest.py must set 8 simulated CPU devices"
    hf, _, ours_dir = pair
    mesh = sharding.make_mesh((2, 2, 2))
    sharded = load_model(str(ours_dir), mesh=mesh)
    assert param_logical_axes(sharded)["layers.0.attn.q_norm.weight"] == ("head_dim",)
    specs = {k: v.sharding.spec for k, v in flat_params(sharded).items()}
    assert specs["layers.0.attn.q_norm.weight"] == P() and specs["layers.1.attn.k_norm.weight"] == P()
    assert specs["layers.0.attn.q_kernel"] == P("tensor", None, "fsdp")
    tokens = random_tokens(batch=4, length=16, seed=2)
    batch = jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(("batch", "sequence"), tokens.shape, mesh))
    with jax.set_mesh(mesh):
        t = jax.device_put(jnp.asarray(tokens), batch)
        pos = jax.device_put(jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (4, 16)), batch)
        out = np.asarray(nnx.jit(lambda m, t, p: m(t, p, causal_mask(4, 16))[0])(sharded, t, pos))
    assert np.abs(out - torch_logits(hf, tokens)).max() <= 1e-4


# ---- chat: each checkpoint's own template, Qwen3's thinking switch -------------------------------

# The generation tail of Qwen3's published chat template, verbatim in what it renders: with
# enable_thinking false the assistant turn opens with an empty thinking section.
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
OPENING = "<|im_start|>user\ndef f(x):<|im_end|>\n<|im_start|>assistant\n"
NO_THINKING = OPENING + "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def chat_ckpt(pair, tmp_path_factory):
    """The pair's Qwen3 model converted with a tokenizer carrying a Qwen3-like template."""
    _, hf_dir, _ = pair
    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(hf_dir, root / "hf")
    tok = make_tokenizer(300)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    tok.save_pretrained(str(root / "hf"))
    convert.hf_to_flax(str(root / "hf"), str(root / "ckpt"))
    return root / "ckpt"


def test_chat_prompts_use_the_checkpoints_template_and_its_thinking_switch(chat_ckpt):
    tok = load_tokenizer(str(chat_ckpt))  # the template travelled through the conversion
    plain, empty = (tok.encode(s, add_special_tokens=False) for s in (OPENING, NO_THINKING))
    assert len(empty) > len(plain)
    records = [{"id": 0, "prompt": "def f(x):"}]
    for switch, want in ((None, plain), (True, plain), (False, empty)):
        assert encode_prompts(records, tok, chat=True, enable_thinking=switch) == [want], switch
        # training renders the prompt the same way, and trains only the response after it
        rows = data_lib.tokenize_examples([{"prompt": "def f(x):", "response": " return x"}], tok,
                                          max_length=64, block_size=4, chat=True, enable_thinking=switch)
        assert rows.input_ids[0][:len(want)].tolist() == want
        assert not rows.loss_mask[0][:len(want)].any() and rows.loss_mask[0][len(want)]
    # the Python text API takes the same switch, and refuses it where it would change nothing
    assert TextGenerator(None, tok, chat=True, enable_thinking=False).enable_thinking is False
    with pytest.raises(DecodeError, match="enable_thinking is the chat template's switch"):
        TextGenerator(None, tok, enable_thinking=False)
    with pytest.raises(DecodeError, match="has no enable_thinking switch"):
        TextGenerator(None, load_tokenizer(assets.DEMO_PROPOSER), chat=True, enable_thinking=True)


def test_the_servers_chat_takes_the_thinking_switch_as_vllm_does(chat_ckpt):
    """`chat_template_kwargs: {"enable_thinking": false}` renders the prompt generate's
    --no-enable-thinking does; anything else there, or the switch for a template without it, is
    a 400 naming the field."""
    from prove_jax.serving import app, protocol
    from prove_jax.decoding.sampling import GREEDY
    tok = load_tokenizer(str(chat_ckpt))
    body = {"messages": [{"role": "user", "content": "def f(x):"}]}
    for switch in (None, False, True):
        kwargs = {} if switch is None else {"chat_template_kwargs": {"enable_thinking": switch}}
        parsed = protocol.parse_request(body | kwargs, True, GREEDY, None)
        want = encode_prompts([{"id": 0, "prompt": "def f(x):"}], tok, chat=True, enable_thinking=switch)[0]
        assert app._encode(parsed, tok) == want, switch
    with pytest.raises(protocol.RequestError, match="may hold only enable_thinking") as e:
        protocol.parse_request(body | {"chat_template_kwargs": {"add_vision_id": True}}, True, GREEDY, None)
    assert e.value.param == "chat_template_kwargs"
    parsed = protocol.parse_request(body | {"chat_template_kwargs": {"enable_thinking": False}}, True, GREEDY, None)
    with pytest.raises(protocol.RequestError, match="has no enable_thinking switch"):
        app._encode(parsed, load_tokenizer(assets.DEMO_PROPOSER))


def test_a_thinking_switch_needs_chat_and_a_template_that_reads_it(chat_ckpt, tmp_path, capsys):
    """One error line before any weight is read: the switch without --chat, or for a template
    without it (the demo checkpoint's Qwen2.5-style one); the training config alike."""
    prompt = ["--prompt", "def f(x):", "--max-new-tokens", "2"]
    cases = (([str(chat_ckpt), "--no-enable-thinking"], "--no-enable-thinking needs --chat"),
             ([assets.DEMO_PROPOSER, "--chat", "--enable-thinking"], "has no enable_thinking switch"))
    for args, needle in cases:
        try:
            code = generate.main(["--model", *args, *prompt])
        except SystemExit as e:  # argparse's own error line
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, err
        errors = [line for line in err.splitlines() if "error: " in line]
        assert len(errors) == 1 and needle in errors[0] and "Traceback" not in err, err
    assert chat_problem(load_tokenizer(assets.DEMO_PROPOSER), None) is None  # no switch asked: fine
    recipe = load_config(os.path.join(REPO, "configs", "proposer_qwen3_32b_v5p.yaml"))
    assert (recipe.chat, recipe.enable_thinking, recipe.model.shape_preset) == (True, False, "qwen3-32b")
    with pytest.raises(TrainConfigError, match="set chat=true too"):
        tiny_config(tmp_path, "nochat", enable_thinking=False)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    cfg = tiny_config(tmp_path, "switch", chat=True, enable_thinking=False,
                      data=str(tmp_path / "pairs.jsonl"))
    with pytest.raises(TrainConfigError, match="has no enable_thinking switch"):
        train(cfg, show_bar=False)  # the tests' tokenizer has the Qwen2.5-style template
    assert not os.path.exists(os.path.join(cfg.run_dir, "metrics.jsonl"))
