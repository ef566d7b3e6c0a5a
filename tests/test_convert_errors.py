"""Bad converter input: each case is one clear `error: ...` line, exit code 2, no output left.

Most cases call the CLI entry point in-process (`convert.main`, same argparse and error
handling); one runs the real `python -m prove_jax.convert` subprocess end to end.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import safetensors.numpy

from hf_models import make_hf_qwen2
from prove_jax import convert

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    r = subprocess.run([sys.executable, "-m", "prove_jax.convert", "hf-to-flax", "--hf-dir", str(hf_dir),
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
    from prove_jax.checkpoint import CheckpointError, load_model, save_model
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
