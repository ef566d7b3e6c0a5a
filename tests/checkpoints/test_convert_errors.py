"""Bad converter input: each case is one clear `error: ...` line, exit code 2, no output left.

Most cases call the CLI entry point in-process (`convert.main`, same argparse and error
handling); one runs the real `python -m prove_jax convert` subprocess end to end.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors.numpy

from tests.hf_models import make_hf_qwen2
from prove_jax.cli import convert

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    model = make_hf_qwen2(root / "single", seed=0)
    model.save_pretrained(str(root / "sharded"), max_shard_size="40KB")
    assert os.path.exists(root / "sharded" / "model.safetensors.index.json")
    return root


@pytest.fixture
def hf_dir(pristine, tmp_path):
    shutil.copytree(pristine / "single", tmp_path / "hf")
    return tmp_path / "hf"


@pytest.fixture
def sharded_dir(pristine, tmp_path):
    shutil.copytree(pristine / "sharded", tmp_path / "hf")
    return tmp_path / "hf"


def fails(capsys, out, *args, needles=()):
    """Run the CLI; assert exit 2, exactly one `error:` line containing every needle, no output."""
    code = convert.main([*args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not os.path.exists(out)
    parent = os.path.dirname(str(out))
    assert not [p for p in os.listdir(parent) if p.startswith(".tmp-")], os.listdir(parent)
    return errors[0]


def rewrite(path, edit):
    """Load a safetensors file with the reference library, edit its dict, save it back."""
    tensors = safetensors.numpy.load_file(str(path))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def test_truncated_safetensors(capsys, hf_dir, tmp_path):
    f = hf_dir / "model.safetensors"
    os.truncate(f, os.path.getsize(f) - 100)
    line = fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
                 needles=("model.safetensors", "truncated file: tensor"))
    assert "but the file has only" in line


def test_file_shorter_than_header(capsys, hf_dir, tmp_path):
    os.truncate(hf_dir / "model.safetensors", 5)
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("truncated safetensors file", "no header"))


def test_corrupt_header_json(capsys, hf_dir, tmp_path):
    with open(hf_dir / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\x00\xffnot json")
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("corrupt safetensors header", "not valid JSON"))


def test_corrupt_header_length(capsys, hf_dir, tmp_path):
    with open(hf_dir / "model.safetensors", "r+b") as f:
        f.write((2**40).to_bytes(8, "little"))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("corrupt safetensors header", "header length 1099511627776"))


def test_missing_key(capsys, hf_dir, tmp_path):
    rewrite(hf_dir / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("missing 1 weight", "model.layers.1.mlp.up_proj.weight"))


def test_unmapped_key(capsys, hf_dir, tmp_path):
    import numpy as np
    rewrite(hf_dir / "model.safetensors",
            lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", np.zeros((3, 4), np.float32)))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("unmapped weight 'model.layers.0.self_attn.extra.weight'", "(3, 4)"))


def test_integer_weights_are_refused(capsys, hf_dir, tmp_path):
    """A weight stored as integers (a quantized export's packed values) is not cast to float."""
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].astype("int32")
    rewrite(hf_dir / "model.safetensors", to_int)
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("weight model.norm.weight is stored as int32, not floating point",))


def test_wrong_shape_names_key_and_both_shapes(capsys, hf_dir, tmp_path):
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 96  # the tensors are 128 wide
    cfg_path.write_text(json.dumps(cfg))
    line = fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
                 needles=("shape mismatch for model.layers.",))
    assert ("(64, 128)" in line and "(64, 96)" in line) or ("(128, 64)" in line and "(96, 64)" in line), line


def test_duplicate_key_across_shards(capsys, sharded_dir, tmp_path):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    first, other = sorted(set(index.values()))[:2]
    stolen = next(k for k, f in index.items() if f == other)
    extra = safetensors.numpy.load_file(str(sharded_dir / other))[stolen]
    rewrite(sharded_dir / first, lambda t: t.__setitem__(stolen, extra))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(sharded_dir),
          needles=(f"duplicate tensor {stolen!r}", first, other))


def test_missing_shard_file(capsys, sharded_dir, tmp_path):
    shard = sorted(f for f in os.listdir(sharded_dir) if f.startswith("model-"))[-1]
    os.remove(sharded_dir / shard)
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(sharded_dir),
          needles=(f"lists shard {shard} which is missing",))


def test_wrong_model_type_lists_supported(capsys, hf_dir, tmp_path):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("unsupported model_type 'llama'", "supported: qwen2"))


def test_missing_dirs_and_files(capsys, hf_dir, tmp_path):
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(tmp_path / "nope"),
          needles=("HF model directory not found", "nope"))
    fails(capsys, tmp_path / "out2", "flax-to-hf", "--ckpt", str(tmp_path / "nockpt"),
          needles=("checkpoint directory not found", "nockpt"))
    os.remove(hf_dir / "model.safetensors")
    fails(capsys, tmp_path / "out3", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("no model.safetensors or model.safetensors.index.json",))
    os.remove(hf_dir / "config.json")
    fails(capsys, tmp_path / "out4", "hf-to-flax", "--hf-dir", str(hf_dir), needles=("no config.json",))


def test_checkpoint_without_params_and_existing_output(capsys, hf_dir, tmp_path):
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    # refusing to overwrite a non-empty output keeps it intact
    code = convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(hf_dir)])
    assert code == 2 and "already exists and is not empty" in capsys.readouterr().err
    assert os.path.exists(hf_dir / "model.safetensors")
    shutil.rmtree(tmp_path / "ckpt" / "params")
    fails(capsys, tmp_path / "back", "flax-to-hf", "--ckpt", str(tmp_path / "ckpt"), needles=("no params/",))


def test_cli_subprocess_exit_code_2(hf_dir, tmp_path):
    os.truncate(hf_dir / "model.safetensors", os.path.getsize(hf_dir / "model.safetensors") // 2)
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, "-m", "prove_jax", "convert", "hf-to-flax", "--hf-dir", str(hf_dir),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "truncated file" in r.stderr
    assert not os.path.exists(tmp_path / "out")


def test_directions_mixed_up_say_which_command_to_use(capsys, hf_dir, tmp_path):
    """A prove-jax checkpoint given to hf-to-flax, or an HF directory given to flax-to-hf, is named
    as what it is, with the command that converts it, instead of a missing-key complaint."""
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    fails(capsys, tmp_path / "again", "hf-to-flax", "--hf-dir", str(tmp_path / "ckpt"),
          needles=("is a prove-jax checkpoint", "flax-to-hf"))
    fails(capsys, tmp_path / "back", "flax-to-hf", "--ckpt", str(hf_dir),
          needles=("is a Hugging Face model directory", "hf-to-flax --hf-dir"))


def test_a_checkpoint_replaces_only_an_earlier_checkpoint(hf_dir, tmp_path):
    """save_params replaces its target whole: a new, empty or earlier checkpoint directory, or
    any directory with the converter's --overwrite; never another directory by mistake."""
    from prove_jax.checkpoints.checkpoint import CheckpointError, load_model, save_model
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "ckpt"), "--quiet"]) == 0
    model = load_model(str(tmp_path / "ckpt"))
    save_model(str(tmp_path / "ckpt"), model)  # an earlier checkpoint: replaced
    precious = tmp_path / "src"
    precious.mkdir()
    (precious / "keep.py").write_text("x = 1\n")
    with pytest.raises(CheckpointError, match="is not a prove-jax checkpoint"):
        save_model(str(precious), model)
    assert os.listdir(precious) == ["keep.py"]
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(precious),
                         "--overwrite", "--quiet"]) == 0  # asked for: replaced
    assert sorted(os.listdir(precious)) != ["keep.py"] and load_model(str(precious)).cfg == model.cfg


@pytest.mark.parametrize("edit, needles", [
    # the YaRN snippet of the Qwen2.5 model cards: the older "type" key, no rope_parameters
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
      "rope_parameters": None}, ("rope_type 'yarn' is not supported",)),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
     ("sliding-window attention (window 8 on layer(s) 1)", "not supported")),
    ({"hidden_act": "gelu"}, ("hidden_act 'gelu' is not supported",)),
])
def test_settings_the_model_does_not_implement_are_refused(capsys, hf_dir, tmp_path, edit, needles):
    """transformers applies these (its logits change); converting them as plain Qwen2 would
    silently give another model, so the converter names the setting instead."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(edit)
    (hf_dir / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir), needles=needles)


# ---- malformed JSON and headers: one line naming the file, never a traceback ---------------------

def _edit_json(path, edit):
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_json_that_is_not_utf8(capsys, pristine, tmp_path, name):
    hf = tmp_path / "hf"
    shutil.copytree(pristine / ("sharded" if "index" in name else "single"), hf)
    (hf / name).write_bytes(b"\xff\xfe\x00garbage")
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf),
          needles=(name, "corrupt index" if "index" in name else "is not valid JSON", "utf-8"))


@pytest.mark.parametrize("edit, needles", [
    (lambda i: i.__setitem__("weight_map", list(i["weight_map"].values())),
     ("corrupt index (weight_map must be an object", "got list")),
    (lambda i: i["weight_map"].__setitem__("lm_head.weight", None),
     ("corrupt index (tensor 'lm_head.weight' maps to None",)),
])
def test_index_of_the_wrong_shape(capsys, sharded_dir, tmp_path, edit, needles):
    _edit_json(sharded_dir / "model.safetensors.index.json", edit)
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(sharded_dir),
          needles=("model.safetensors.index.json", *needles))


def _edit_header(path, edit):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


@pytest.mark.parametrize("field, value, needle", [
    ("data_offsets", lambda e: [str(x) for x in e["data_offsets"]], "data_offsets must be two integers"),
    ("data_offsets", lambda e: e["data_offsets"][::-1], "0 <= begin <= end"),
    ("shape", lambda e: [-8, -8], "shape must be a list of non-negative integers"),
    ("dtype", lambda e: 4, "dtype must be a string"),
])
def test_header_entry_of_the_wrong_shape(capsys, hf_dir, tmp_path, field, value, needle):
    def edit(h):
        h["model.norm.weight"][field] = value(h["model.norm.weight"])
    _edit_header(hf_dir / "model.safetensors", edit)
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir),
          needles=("model.safetensors: corrupt safetensors header entry for 'model.norm.weight'", needle))


@pytest.mark.parametrize("edit, needle", [
    ({"hidden_size": None}, "HF config hidden_size must be int, got None"),
    ({"num_attention_heads": "4"}, "HF config num_attention_heads must be int, got '4'"),
    ({"eos_token_id": ["2"]}, "HF config eos_token_id must be a list of ints, got ['2']"),
    ({"pad_token_id": "0"}, "HF config pad_token_id must be int or null, got '0'"),
    ({"tie_word_embeddings": "false"}, "HF config tie_word_embeddings must be bool"),
    ({"rms_norm_eps": None}, "HF config rms_norm_eps must be float, got None"),
    ({"rope_parameters": [1]}, "HF config rope_parameters must be an object"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": "x", "layer_types": None},
     "malformed activation or sliding-window setting"),
])
def test_hf_config_values_of_the_wrong_type(capsys, hf_dir, tmp_path, edit, needle):
    """Checked as our own config.json is, so hf-to-flax never writes a checkpoint that cannot be
    loaded back (a string eos id used to be written, and refused by load_model)."""
    _edit_json(hf_dir / "config.json", lambda c: c.update(edit))
    fails(capsys, tmp_path / "out", "hf-to-flax", "--hf-dir", str(hf_dir), needles=(needle,))


def test_output_under_a_file_is_refused_before_converting(capsys, hf_dir, tmp_path):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "ckpt"
    assert convert.main(["hf-to-flax", "--hf-dir", str(hf_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot create output {out}: {tmp_path / 'afile'} is a file, not a directory\n", err
    assert sorted(os.listdir(tmp_path)) == ["afile", "hf"]


def test_dtype_help_says_what_a_float16_source_becomes():
    help_text = " ".join(convert.build_parser()._subparsers._group_actions[0]
                         .choices["hf-to-flax"].format_help().split())
    assert "float16 and other sources are stored as float32" in help_text


# ---- damaged checkpoints -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine_ckpt(pristine):
    ckpt = pristine / "ckpt"
    assert convert.main(["hf-to-flax", "--hf-dir", str(pristine / "single"), "--out", str(ckpt), "--quiet"]) == 0
    return ckpt


@pytest.fixture
def ckpt(pristine_ckpt, tmp_path):
    shutil.copytree(pristine_ckpt, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("damage, needle", [
    (lambda f: os.remove(f), "is missing"),
    (lambda f: os.truncate(f, 100), "FAILED_PRECONDITION"),
])
def test_a_damaged_chunk_names_the_parameter(capsys, ckpt, tmp_path, damage, needle):
    damage(ckpt / "params" / "layers.0.mlp.down_kernel" / "0.0")
    line = fails(capsys, tmp_path / "back", "flax-to-hf", "--ckpt", str(ckpt),
                 needles=("a damaged or incomplete checkpoint", "parameter layers.0.mlp.down_kernel: ", needle))
    assert "Encountered error while reading array index" not in line


def test_a_stored_parameter_the_config_does_not_expect_is_named(capsys, ckpt, tmp_path):
    _edit_json(ckpt / "config.json", lambda c: c.update(tie_word_embeddings=True))
    fails(capsys, tmp_path / "back", "flax-to-hf", "--ckpt", str(ckpt),
          needles=("has parameter lm_head that the config does not expect (tie_word_embeddings?)",))


def test_restore_error_reason_names_the_parameter_from_the_spec():
    from prove_jax.checkpoints.restore_errors import restore_error_reason
    spec = ("Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore "
            "details: <bound method spec of TensorStore({\n  'kvstore': {\n    'driver': 'file',\n"
            "    'path': '/ck/params/layers.0.attn.k_bias/',\n  },\n})>.")
    e = Exception(spec)
    e.__cause__ = ValueError('NOT_FOUND: chunk {0} stored at local file "/ck/params/layers.0.attn.k_bias/0" is missing')
    assert restore_error_reason(e) == ('parameter layers.0.attn.k_bias: NOT_FOUND: chunk {0} stored at local '
                                       'file "/ck/params/layers.0.attn.k_bias/0" is missing')
    tensorstore = ValueError('NOT_FOUND: x [tensorstore_spec=\'{"kvstore":{"driver":"file",'
                             '"path":"/ck/params/embed/"}}\']')
    assert restore_error_reason(tensorstore) == "parameter embed: NOT_FOUND: x"
    ocdbt = ValueError('NOT_FOUND: y [tensorstore_spec=\'{\\"kvstore\\":{\\"base\\":{\\"path\\":\\"/run/8/state/\\"},'
                       '\\"driver\\":\\"ocdbt\\",\\"path\\":\\"params.embed/\\"}}\']')
    assert restore_error_reason(ocdbt) == "parameter params.embed: NOT_FOUND: y"
    assert restore_error_reason(ValueError("NOT_FOUND: Error opening file x")) == "NOT_FOUND: Error opening file x"


def test_closed_abandoned_reads_stay_quiet(monkeypatch):
    """Orbax's read coroutines, closed after a failed restore, print "Exception ignored in:
    <coroutine ... _read_array_index_and_device_put>" with orbax's "Encountered error while
    reading array index" and a spec dump, one per chunk in flight (hundreds under load). Held
    and dropped like "Event loop is closed" while the restore runs, and after it failed for
    its path; anything else, and the same error for another path, passes."""
    import sys
    import types
    from prove_jax.checkpoints import abandoned_reads
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(abandoned_reads, "QUIETED", abandoned_reads.QuietedPaths())

    def abandoned(path):
        text = (f"Encountered error while reading array index: (slice(0, 2, 1),). See full TensorStore "
                f"details: ... 'path': '{path}/params/layers.0.attn.k_bias/', ...")
        return types.SimpleNamespace(exc_value=Exception(text), exc_type=Exception)

    with abandoned_reads.restore_attempt("/ck/a"):  # a restore that returns: passed on, in order
        sys.unraisablehook(abandoned("/ck/a"))
        assert seen == []
    assert len(seen) == 1 and sys.unraisablehook == seen.append
    seen.clear()
    with pytest.raises(ValueError, match="damaged"):
        with abandoned_reads.restore_attempt("/ck/b"):
            sys.unraisablehook(abandoned("/ck/b"))
            raise ValueError("damaged")
    sys.unraisablehook(abandoned("/ck/b"))  # late ones, after the failure was reported
    sys.unraisablehook(abandoned("/ck/other"))
    assert ["/ck/other" in str(u.exc_value) for u in seen] == [True]


def test_a_checkpoint_config_that_is_not_utf8(capsys, ckpt, tmp_path):
    (ckpt / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    fails(capsys, tmp_path / "back", "flax-to-hf", "--ckpt", str(ckpt),
          needles=(f"bad checkpoint {ckpt}", "config.json is not valid JSON", "utf-8"))
