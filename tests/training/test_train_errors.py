"""Config loading and bad input: every shipped config takes the standard overrides; unknown
keys, missing or empty data and over-long sequences give one clear message. Every error class
of the package is a ProveJaxError, which the train CLI prints as one line."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from prove_jax.training.config import TrainConfigError, load_config, valid_keys
from prove_jax.training.batches import make_data_iterator
from prove_jax.training.run_tokenizer import resolve_tokenizer
from tests.tokenizers_fixture import make_tokenizer
from tests.train_helpers import write_config
from train.train import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_standard_overrides_work_on_every_config(path, tmp_path):
    cfg = load_config(path, [f"data={tmp_path}/x.txt", "steps=7", f"run_dir={tmp_path}/r",
                             "objective=ar", "block_size=8", "seed=3", "optimizer.lr=2e-4"])
    assert (cfg.data, cfg.steps, cfg.run_dir) == (f"{tmp_path}/x.txt", 7, f"{tmp_path}/r")
    assert (cfg.objective, cfg.block_size, cfg.seed, cfg.optimizer.lr) == ("ar", 8, 3, 2e-4)
    assert load_config(path, ["objective=mars"]).objective == "mars"


def test_config_values_and_stdlib_expansion():
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"), ["mesh=[1,2,4]"])
    assert cfg.mesh == [1, 2, 4] and os.path.isdir(cfg.data) and "${" not in cfg.data
    cfg = load_config(os.path.join(REPO, "configs", "proposer_qwen2.5_32b_v5p.yaml"))
    assert (cfg.block_size, cfg.max_length, cfg.global_batch_size, cfg.optimizer.lr) == (16, 512, 384, 5e-6)
    assert cfg.optimizer.warmup_ratio == 0.03 and cfg.model.dtype == "bfloat16"


def test_unknown_key_lists_valid_keys(tmp_path, capsys):
    cfg_path = write_config(tmp_path)
    assert main(["--config", cfg_path, "stepz=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown config key 'stepz'; valid keys:") and "\n" not in err
    for key in ("steps", "data", "run_dir", "objective", "block_size", "seed", "optimizer.lr"):
        assert key in err
    with pytest.raises(TrainConfigError, match="unknown config key 'optimizer.learning_rate'"):
        load_config(cfg_path, ["optimizer.learning_rate=1"])
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("steps: 3\nbatch: 4\n")
    assert main(["--config", str(bad_yaml)]) == 2
    assert "unknown config key 'batch'" in capsys.readouterr().err
    assert main(["--config", cfg_path, "objective=diffusion"]) == 2
    assert "error: objective must be 'mars'" in capsys.readouterr().err
    assert "optimizer.grad_accum" in valid_keys()


def test_values_of_the_wrong_type_are_named(tmp_path, capsys):
    cfg_path = write_config(tmp_path)
    assert main(["--config", cfg_path, "steps=abc"]) == 2
    assert capsys.readouterr().err.strip() == "error: steps must be int, got 'abc'"
    for override, message in [("optimizer.lr=fast", "optimizer.lr must be float, got 'fast'"),
                              ("model.scan_layers=3", "model.scan_layers must be bool, got 3"),
                              ("steps=true", "steps must be int, got True"),
                              ("mesh=4", "mesh must be list, got 4"),
                              ("optimizer.clip_norm=big", "optimizer.clip_norm must be float or null")]:
        with pytest.raises(TrainConfigError, match=message.replace("(", r"\(")):
            load_config(cfg_path, [override])
    assert load_config(cfg_path, ["optimizer.clip_norm=null", "optimizer.lr=1"]).optimizer.lr == 1.0
    with pytest.raises(TrainConfigError, match=r"global_batch_size must be int, got \[4\]"):
        load_config(write_config(tmp_path, "typed", global_batch_size=[4]))


def test_both_config_kinds_read_a_value_by_the_same_rule(tmp_path):
    """The training YAML and the model's config.json take the same value alike: an integral float
    is an int, an int is a float, a bool is never a number, null only where the field allows it."""
    from prove_jax.models.config import ConfigError, ModelConfig
    from tests.train_helpers import TINY_MODEL
    cfg_path = write_config(tmp_path)
    cfg = load_config(cfg_path, ["steps=2.0", "optimizer.lr=1", "optimizer.grad_accum=1e0"])
    assert (cfg.steps, cfg.optimizer.lr, cfg.optimizer.grad_accum) == (2, 1.0, 1)
    assert [type(v) for v in (cfg.steps, cfg.optimizer.lr, cfg.optimizer.grad_accum)] == [int, float, int]
    model = ModelConfig.from_json_dict(dict(TINY_MODEL, hidden_size=float(TINY_MODEL["hidden_size"]),
                                            rope_theta=10000, eos_token_ids=[0]))
    assert (type(model.hidden_size), type(model.rope_theta), model.eos_token_ids) == (int, float, (0,))
    for train_override, model_key, value, wanted in [
            ("steps=2.5", "hidden_size", 2.5, "int"),
            ("steps=true", "hidden_size", True, "int"),
            ("optimizer.lr=false", "rope_theta", False, "float"),
            ("steps=null", "num_layers", None, "int"),
            ("optimizer.clip_norm=big", "pad_token_id", "big", None)]:
        with pytest.raises(TrainConfigError, match=r" must be (int|float)( or null)?, got "):
            load_config(cfg_path, [train_override])
        with pytest.raises(ConfigError) as e:
            ModelConfig.from_json_dict(dict(TINY_MODEL, **{model_key: value}))
        assert f"{model_key} must be {wanted or 'int or null'}, got {value!r}" in str(e.value)
    with pytest.raises(ConfigError, match=r"eos_token_ids must be a list of ints, got \[True\]"):
        ModelConfig.from_json_dict(dict(TINY_MODEL, eos_token_ids=[True]))


def test_a_train_step_that_cannot_fit_is_refused_before_the_run_dir_is_written(tmp_path, capsys, monkeypatch):
    from prove_jax import memory
    monkeypatch.setattr(memory, "free_device_memory", lambda device: 1024)
    cfg_path = write_config(tmp_path)
    assert main(["--config", cfg_path]) == 2
    err = capsys.readouterr().err
    assert "compiled the train step" in err
    assert re.search(r"error: a train step of 8 x 32 tokens \(model and optimizer state, gradients, "
                     r"activations\) needs \d+\.\d\d GiB, but the host has 0\.00 GiB free: lower "
                     r"global_batch_size or max_length", err), err
    assert not os.path.exists(os.path.join(tmp_path, "run"))


def test_missing_and_empty_data(tmp_path, capsys, monkeypatch):
    from prove_jax.training import run_setup

    def compiled(*args, **kwargs):  # data errors are found before the step compiles
        raise AssertionError("the train step compiled before the data was checked")
    monkeypatch.setattr(run_setup, "compile_step", compiled)
    cfg_path = write_config(tmp_path)
    assert main(["--config", cfg_path, f"data={tmp_path}/nope.jsonl", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error: data not found" in err and "nope.jsonl" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["--config", cfg_path, f"data={empty}", "--no-progress"]) == 2
    assert "error: empty dataset" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "def f(): pass"}) + "\n" + json.dumps({"nope": 1}) + "\n")
    assert main(["--config", cfg_path, f"data={bad}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "bad.jsonl:2" in errors[0] and "AssertionError" not in err, err
    assert not os.path.exists(tmp_path / "run")  # nothing written into the run dir


def test_truncated_sequences_are_counted_in_the_log(tmp_path):
    data = tmp_path / "pairs.jsonl"
    long = "def f(x):\n    return x + 1\n" * 20
    data.write_text("\n".join(json.dumps({"prompt": "write f", "response": r})
                              for r in (long, "pass", long, "return 1")) + "\n")
    cfg = load_config(write_config(tmp_path), [f"data={data}", "global_batch_size=2"])
    tokenizer, _ = resolve_tokenizer(cfg)
    messages = []
    make_data_iterator(cfg, tokenizer, messages.append)
    assert "warning: 2 sequence(s) longer than max_length=32 were truncated" in messages, messages


def test_bad_optimizer_values_an_impossible_mesh_and_a_file_as_run_dir_are_named(tmp_path, capsys):
    """Values optax would accept and then train badly with, and a mesh wider than the machine,
    are one error line each (the mesh one was a ValueError traceback), before anything is written."""
    cfg_path = write_config(tmp_path)
    for override, message in [
        ("optimizer.lr=-1", "optimizer.lr must be a positive number, got -1"),
        ("optimizer.lr=nan", "optimizer.lr must be a positive number, got nan"),
        ("optimizer.warmup_ratio=1.5", "optimizer.warmup_ratio must be in [0, 1], got 1.5"),
        ("optimizer.b2=1", "optimizer.b2 must be in [0, 1), got 1"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay must be >= 0"),
        ("optimizer.eps=0", "optimizer.eps must be a positive number"),
        ("optimizer.clip_norm=0", "optimizer.clip_norm must be a positive number or null"),
        ("mesh=[64,1,1]", "mesh shape (64, 1, 1) needs 64 devices, 8 available: set mesh="),
    ]:
        run_dir = tmp_path / "run"
        assert main(["--config", cfg_path, f"run_dir={run_dir}", override]) == 2, override
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (override, err)
        assert not run_dir.exists()
    load_config(cfg_path, ["optimizer.clip_norm=null", "optimizer.lr=3e-4"])  # valid values pass
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run")
    assert main(["--config", cfg_path, f"run_dir={a_file}"]) == 2  # was a FileExistsError traceback
    assert "is a file; it must be a directory" in capsys.readouterr().err
    assert a_file.read_text() == "not a run"


def test_values_that_used_to_fail_mid_run_are_config_errors(tmp_path, capsys):
    """Each was found only after BPE training, compiling or writing the run dir (or was a
    traceback): now one error line from the config check, with nothing written."""
    cfg_path = write_config(tmp_path)
    run_dir = tmp_path / "run"
    for override, message in [
        ("block_size=5", "max_length=32 must be a multiple of block_size=5"),
        ("seed=-1", "seed must be in [0, 2**32), got -1"),
        ("tokenizer.bpe_vocab_size=0", "tokenizer.bpe_vocab_size must be positive (or null: no BPE), got 0"),
        ("ar_weight=nan", "ar_weight must be a finite number >= 0, got nan"),
        ("ar_weight=-1", "ar_weight must be a finite number >= 0, got -1"),
        ("model.dtype=float8", "model.dtype must be one of float32, bfloat16, float16 or null"),
        ("model.config={hidden_sise: 8}", "unknown model.config keys ['hidden_sise']"),
        # the model's position buffers end at its context (evaluate refused it already)
        ("max_length=512", "max_length=512 is longer than the model's context, "
                           "max_position_embeddings=256"),
        # a new BPE's ids mean nothing to pretrained weights
        (("model.checkpoint=/nowhere", "tokenizer.bpe_vocab_size=64"),
         "tokenizer.bpe_vocab_size trains a new vocabulary, but model.checkpoint weights read "
         "token ids as their own"),
    ]:
        overrides = [override] if isinstance(override, str) else list(override)
        assert main(["--config", cfg_path, f"run_dir={run_dir}", *overrides]) == 2, override
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (override, err)
        assert not run_dir.exists()
    # a tokenizer directory without a chat template (our BPEs carry one): refused before compiling
    plain = make_tokenizer(300)
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "plain_tok"))
    assert main(["--config", cfg_path, f"run_dir={run_dir}", "chat=true",
                 f"tokenizer.path={tmp_path / 'plain_tok'}"]) == 2
    err = capsys.readouterr().err
    assert "has no chat template; use a tokenizer with one or set chat=false" in err, err
    assert "compiled the train step" not in err and not run_dir.exists()
    # a BPE larger than the model's embedding: refused before the BPE is trained
    assert main(["--config", cfg_path, f"run_dir={run_dir}", "tokenizer.path=null",
                 "tokenizer.bpe_vocab_size=4096"]) == 2
    assert "tokenizer.bpe_vocab_size=4096 is larger than the model's vocab_size=320" in \
        capsys.readouterr().err
    assert not run_dir.exists()
    # --dry-run of the commit head objective without the proposer's shapes (was a ValueError
    # traceback, then refused: there was no commit-head dry run)
    assert main(["--config", cfg_path, "objective=commit_head", "mesh=[1,1,1]", "--dry-run",
                 "--chip", "v5e"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no proposer=PATH given: set proposer_shape_preset") and "\n" not in err, err


def test_yaml_numbers_without_a_dot_are_numbers(tmp_path):
    """PyYAML reads `1e-4` (YAML 1.1) as a string; the command line already took it as a float."""
    cfg_path = tmp_path / "plain.yaml"
    text = open(write_config(tmp_path)).read()
    assert "lr: 0.003" in text and "steps: 8" in text
    text = text.replace("lr: 0.003", "lr: 1e-4").replace("steps: 8", "steps: 1e1") + "ar_weight: 5e-1\n"
    cfg_path.write_text(text)
    cfg = load_config(str(cfg_path))
    assert (cfg.optimizer.lr, cfg.ar_weight, cfg.steps) == (1e-4, 0.5, 10)
    assert load_config(str(cfg_path), ["optimizer.lr=1e-4"]).optimizer.lr == cfg.optimizer.lr
    # a number given to a text field is the text it was written as, in the file and on the command
    # line: a path is that path, and a name is checked against the names it may be
    assert load_config(str(cfg_path), ["run_dir=2024"]).run_dir.endswith("2024")
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text(re.sub(r"(?m)^run_dir: .*$", "run_dir: 2024", text) + "objective: 1\n")
    assert "run_dir: 2024\n" in numbered.read_text()
    with pytest.raises(TrainConfigError, match="objective must be 'mars', 'ar' or 'commit_head', got '1'"):
        load_config(str(numbered))
    assert load_config(str(numbered), ["objective=mars"]).run_dir.endswith("2024")
    cfg_path.write_text(text.replace("lr: 1e-4", "lr: fast"))
    with pytest.raises(TrainConfigError, match="optimizer.lr must be float, got 'fast'"):
        load_config(str(cfg_path))
    # only fields that take numbers read such text as a number: a bool field is told what was written
    with pytest.raises(TrainConfigError, match="model.scan_layers must be bool, got '1e3'"):
        load_config(str(cfg_path), ["model.scan_layers=1e3"])
    cfg_path.write_text(text + "mesh: 1e3\n")
    with pytest.raises(TrainConfigError, match="mesh must be list, got '1e3'"):
        load_config(str(cfg_path))
    # the inline model config too (PyYAML hands it '1e6'), and a bad value is named before any run
    from prove_jax.training.model_source import source_model_config
    from tests.train_helpers import TINY_MODEL
    theta = write_config(tmp_path, "theta", model={"config": dict(TINY_MODEL, rope_theta="1e6")})
    assert source_model_config(load_config(theta)).rope_theta == 1e6
    with pytest.raises(TrainConfigError, match="model.config rope_theta must be float, got 'big'"):
        load_config(write_config(tmp_path, "big", model={"config": dict(TINY_MODEL, rope_theta="big")}))


def test_a_leftover_run_tokenizer_is_replaced_until_a_checkpoint_exists(tmp_path):
    """RUN_DIR/tokenizer from a launch that never saved a step must not override a corrected
    tokenizer config; once a step is saved it is the run's tokenizer and wins."""
    from prove_jax.training.run_tokenizer import save_run_tokenizer
    cfg = load_config(write_config(tmp_path))
    own = os.path.join(cfg.run_dir, "tokenizer")
    make_tokenizer(280).save_pretrained(own)  # an earlier launch's, since corrected
    tokenizer, where = resolve_tokenizer(cfg)
    assert where == cfg.tokenizer.path and len(tokenizer) == len(make_tokenizer(300))
    save_run_tokenizer(tokenizer, cfg.run_dir)
    os.makedirs(os.path.join(cfg.run_dir, "checkpoints", "4"))
    resumed, where = resolve_tokenizer(cfg)
    assert where == own and len(resumed) == len(tokenizer)


def test_ctrl_c_says_how_to_resume(tmp_path, capsys, monkeypatch):
    from prove_jax.training import loop as trainer

    def interrupted(cfg, show_bar=True, profile=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(trainer, "train", interrupted)
    cfg_path = write_config(tmp_path)
    assert main(["--config", cfg_path]) == 130
    err = capsys.readouterr().err
    assert "interrupted; rerun the same command to resume" in err and "Traceback" not in err
    monkeypatch.setattr("prove_jax.training.commit_head_training.train_commit_head", interrupted)
    assert main(["--config", cfg_path, "objective=commit_head"]) == 130
    err = capsys.readouterr().err  # it has no checkpoints to resume from
    assert "interrupted; the commit head keeps no checkpoints: rerun the same command" in err


def test_a_real_ctrl_c_mid_run_exits_130_not_by_a_crash(tmp_path):
    """SIGINT to a real training process while steps run on XLA's threads: the message, then
    exit 130. The interpreter's teardown used to crash after the message (SIGSEGV, exit -11).

    The run starts with SIGINT at its default action, as a command typed at a terminal does. A
    suite started in the background of a non-interactive shell (`... &`) inherits SIGINT
    ignored, and Python then never installs its KeyboardInterrupt handler: the run would rightly
    go on to its end, exit 0 (as `nohup` intends)."""
    import signal
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg_path = write_config(tmp_path, steps=2000, save_every=50)
    # SIGINT back to its default, then exec the run in the same process (a preexec_fn would
    # fork this multithreaded JAX process)
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.executable, [sys.executable, '-m', 'train.train'] + sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", default_sigint, "--config", cfg_path, "--no-progress"],
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": root})
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "compiled the train step" in line:
            time.sleep(1.0)  # inside the step loop
            proc.send_signal(signal.SIGINT)
            break
    err = "".join(seen) + proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err[-3000:]
    assert "interrupted; rerun the same command to resume" in err and "Fatal Python error" not in err


def test_bad_meshes_paths_and_overrides_after_an_option_are_config_errors(tmp_path, capsys):
    """Mesh entries that are not whole sizes, an empty run_dir or data, a run_dir below a file
    or inside the data folder: one error line each from the config check, before any compile
    (they were tracebacks, or trained into the working directory / into the data)."""
    cfg_path = write_config(tmp_path)
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("not a folder")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    for override, message in [
        ("mesh=[1,a,1]", "mesh must be [data, fsdp, tensor], each a whole number >= 1 or -1"),
        ("mesh=[1,null,1]", "got [1, None, 1]"),
        ("mesh=[1,.nan,1]", "got [1, nan, 1]"),
        ("mesh=[1,1e400,1]", "got [1, '1e400', 1]"),
        ("mesh=[1.5,1,1]", "got [1.5, 1, 1]"),
        ("mesh=[0,1,1]", "got [0, 1, 1]"),
        ("mesh=[1,true,1]", "got [1, True, 1]"),
        ("mesh=[1,1]", "got [1, 1]"),
        ("run_dir=", "run_dir must be a path, got ''"),
        ("run_dir= ", "run_dir must be a path, got ' '"),
        ("data=", "data must be a path, got ''"),
        (f"run_dir={a_file}/sub", f"run_dir {a_file}/sub cannot be created: {a_file} is a file"),
        (f"run_dir={a_file}/sub/deeper", f"{a_file} is a file, not a directory"),
        (f"data={folder}", "is inside the data folder"),
    ]:
        extra = [f"run_dir={folder}/run"] if override.startswith("data=") and "corpus" in override else []
        assert main(["--config", cfg_path, *extra, override]) == 2, override
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (override, err)
    assert load_config(cfg_path, ["mesh=[1.0,-1,1]"]).mesh == [1, -1, 1]
    assert sorted(os.listdir(folder)) == ["a.txt"] and a_file.read_text() == "not a folder"
    # overrides after an option flag are still overrides (argparse refused them)
    assert main(["--config", cfg_path, "steps=2", "--no-progress", "mesh=[1,a,1]"]) == 2
    assert "error: mesh must be" in capsys.readouterr().err


def test_a_tokenizer_that_disagrees_with_the_pretrained_weights_is_refused(tmp_path, capsys):
    """tokenizer.path with model.checkpoint trained silently with other ids than the weights'
    own tokenizer: now refused before compiling; a tokenizer with the same ids passes."""
    from prove_jax.checkpoints.checkpoint import save_model
    from prove_jax.models.config import ModelConfig
    from prove_jax.models.params import create_model
    from prove_jax.training.model_source import source_model_config
    from prove_jax.training.run_tokenizer import check_tokenizer_matches_weights
    from tests.train_helpers import TINY_MODEL, write_tokenizer
    cfg_path = write_config(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    save_model(ckpt, create_model(ModelConfig(**TINY_MODEL), seed=0),
               tokenizer_dir=write_tokenizer(tmp_path))
    other = str(tmp_path / "other_tok")
    make_tokenizer(300, modules=("textwrap",)).save_pretrained(other)
    run_dir = tmp_path / "run"
    assert main(["--config", cfg_path, f"run_dir={run_dir}", "model.config=null",
                 f"model.checkpoint={ckpt}", f"tokenizer.path={other}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: the model's tokenizer") and "is not the one in" in err, err
    assert "leave tokenizer.path unset" in err and not run_dir.exists()
    same = load_config(cfg_path, ["model.config=null", f"model.checkpoint={ckpt}"])
    tokenizer, where = resolve_tokenizer(same)  # tokenizer.path: a copy of the model's own
    assert where != ckpt
    check_tokenizer_matches_weights(same, tokenizer, where, source_model_config(same))


# Exception classes of the package that are not user-facing errors, each with the reason.
INTERNAL_EXCEPTIONS = {
    # raised by fieldtypes.conform and always caught by the config readers, which re-raise it as
    # TrainConfigError / ConfigError naming the field
    "prove_jax.fieldtypes.AnnotationMismatch",
    # not an error: `train` raises it after saving on SIGTERM; the train CLI exits PREEMPTED (75)
    "prove_jax.training.preemption.Preempted",
}


def _package_exception_classes() -> dict[str, type]:
    """Every exception class defined in a module of prove_jax, by its dotted name."""
    import importlib
    import inspect
    import pkgutil

    import prove_jax
    found = {}
    for info in pkgutil.walk_packages(prove_jax.__path__, "prove_jax."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_error_class_of_the_package_is_a_prove_jax_error():
    """The CLIs catch ProveJaxError alone: an error class outside it would be a traceback."""
    from prove_jax.errors import ProveJaxError
    classes = _package_exception_classes()
    errors = {name for name in classes if name.rsplit(".", 1)[1].endswith("Error")}
    for name in ("prove_jax.training.config.TrainConfigError", "prove_jax.data.pipeline.DataError",
                 "prove_jax.checkpoints.checkpoint.CheckpointError", "prove_jax.models.config.ConfigError",
                 "prove_jax.decoding.options.DecodeError"):
        assert name in errors, sorted(errors)  # the walk reaches every sub-package
    assert INTERNAL_EXCEPTIONS <= set(classes), "an internal exception was renamed or removed"
    outside = sorted(name for name, cls in classes.items()
                     if name not in INTERNAL_EXCEPTIONS and not issubclass(cls, ProveJaxError))
    assert outside == [], f"not ProveJaxError subclasses: {outside}"


def test_a_prove_jax_error_from_deep_inside_is_one_error_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """Any ProveJaxError, not only the classes the CLI knows by name, raised inside a run."""
    from prove_jax.errors import ProveJaxError
    from prove_jax.training import run_setup

    class DeepError(ProveJaxError):  # a subclass of the base alone, no builtin beside it
        pass

    def fails(cfg):
        raise DeepError("the weights at /nowhere are on fire; use others")
    monkeypatch.setattr(run_setup, "run_model_config", fails)
    assert main(["--config", write_config(tmp_path), "--no-progress"]) == 2
    assert capsys.readouterr().err == "error: the weights at /nowhere are on fire; use others\n"
    assert not os.path.exists(os.path.join(tmp_path, "run"))
