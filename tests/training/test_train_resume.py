"""Resumption: a run stopped halfway and resumed equals an uninterrupted run, bit for bit in
float32; a damaged latest checkpoint falls back to the previous one and says so."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from prove_jax.checkpoints import abandoned_reads, checkpoint
from prove_jax.training.loop import train
from tests.train_helpers import tiny_config


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["loss_masked"], r["loss_clean"]) for r in map(json.loads, f)]


def _params(state):
    return jax.tree.map(np.asarray, state["params"])


def _assert_same_params(a, b, atol=1e-6):
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    assert max(diffs) <= atol, max(diffs)


def test_resume_is_exact_and_corrupt_latest_falls_back(tmp_path):
    full = train(tiny_config(tmp_path, "full"), show_bar=False)
    assert full.final_step == 8 and full.start_step == 0

    cfg = tiny_config(tmp_path, "halves")
    first = train(cfg, show_bar=False, stop_after=4)
    assert first.final_step == 4 and first.model_dir is None  # stopped early: no export yet
    # as if saved by a 2-process run: grain names each host's data state by the process count,
    # and a relaunch on another count took every checkpoint for damaged (moved to corrupt/);
    # the state is the global batch index, the same in each host's file
    data_dir = os.path.join(first.run_dir, "checkpoints", "4", "data")
    state = open(os.path.join(data_dir, "process_0-of-1.json")).read()
    os.remove(os.path.join(data_dir, "process_0-of-1.json"))
    for i in range(2):
        with open(os.path.join(data_dir, f"process_{i}-of-2.json"), "w") as f:
            f.write(state)
    messages = []
    second = train(cfg, show_bar=False, log=messages.append)
    assert second.start_step == 4 and second.final_step == 8
    assert not os.path.exists(os.path.join(first.run_dir, "corrupt"))
    assert any("saved by 2 process(es), this launch has 1" in m for m in messages), messages

    # same data order and same numbers: every step's losses, then the final weights
    a, b = _losses(full.run_dir), _losses(second.run_dir)
    assert [s for s, *_ in a] == list(range(1, 9)) == [s for s, *_ in b]
    np.testing.assert_allclose(np.array(b)[:, 1:], np.array(a)[:, 1:], rtol=1e-6, atol=0)
    _assert_same_params(_params(second.state), _params(full.state))

    # the exported model is a loadable prove_jax checkpoint that records the mask token
    model = checkpoint.load_model(second.model_dir)
    assert model.cfg.mask_token_id is not None
    tok = checkpoint.load_tokenizer(second.model_dir)
    assert tok.convert_tokens_to_ids("<|mask|>") == model.cfg.mask_token_id
    _assert_same_params(checkpoint.params_pure_dict(model), _params(full.state))

    # damage the newest checkpoint (step 8): its array data disappears
    step8 = os.path.join(second.run_dir, "checkpoints", "8", "state")
    for root, _, files in os.walk(step8):
        for name in files:
            if not name.startswith("_"):
                os.remove(os.path.join(root, name))
    messages = []
    third = train(cfg, show_bar=False, log=messages.append)
    text = "\n".join(messages)
    assert "checkpoint step 8" in text and "falling back to step 4" in text, text
    warning = next(m for m in messages if "cannot be restored" in m)
    assert "tensorstore_spec" not in text and len(warning) < 600, text  # the reason, not a spec dump
    assert third.start_step == 4 and third.final_step == 8
    assert os.path.isdir(os.path.join(second.run_dir, "corrupt", "8"))
    _assert_same_params(_params(third.state), _params(full.state))
    # metrics.jsonl was rewound to the restored step, so it holds each step once
    assert [s for s, *_ in _losses(third.run_dir)] == list(range(1, 9))


def test_config_change_is_refused_not_treated_as_damage(tmp_path, monkeypatch):
    """Resuming with a config whose train state differs (no clipping stage in the optimizer)
    or whose `steps` ends before the checkpoints is an error that leaves the run as it was;
    the original config then resumes."""
    from prove_jax.training.run_checkpoint import RunCheckpointError
    from prove_jax.training.config import TrainConfigError
    from prove_jax.training.loop import TrainError
    cfg = tiny_config(tmp_path, "cc", steps=4, save_every=2)
    train(cfg, show_bar=False)
    run_dir = cfg.run_dir
    saved_config = open(os.path.join(run_dir, "train_config.json")).read()
    # settings that make the relaunch another run are named (operational ones may change),
    # before anything is compiled or written
    with pytest.raises(TrainConfigError, match=r"run_dir .*cc holds a run made with other settings "
                       r"\(block_size: 4 -> 8, objective: 'mars' -> 'ar', seed: 0 -> 1\); relaunch "
                       r"with its settings to resume it, or set a new run_dir to start over"):
        train(tiny_config(tmp_path, "cc", ["optimizer.clip_norm=null", "objective=ar", "seed=1",
                                           "block_size=8", "log_every=2", "keep=5"],
                          steps=6, save_every=2), show_bar=False)
    # without train_config.json (an older run dir) the train state itself is compared
    os.rename(os.path.join(run_dir, "train_config.json"), os.path.join(run_dir, "saved.json"))
    with pytest.raises(RunCheckpointError, match=r"checkpoint step 4 .* holds a different train "
                       r"state.*only in the checkpoint: opt_state\.1\."):
        train(tiny_config(tmp_path, "cc", ["optimizer.clip_norm=null"], steps=6, save_every=2),
              show_bar=False)
    os.rename(os.path.join(run_dir, "saved.json"), os.path.join(run_dir, "train_config.json"))
    with pytest.raises(TrainError, match="has a checkpoint at step 4, past steps=2: set steps to at least 4"):
        train(tiny_config(tmp_path, "cc", steps=2, save_every=2), show_bar=False)
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2", "4"]
    assert not os.path.exists(os.path.join(run_dir, "corrupt"))
    assert open(os.path.join(run_dir, "train_config.json")).read() == saved_config
    # a resumed run reads only its own checkpoint: the initial weights' source (its model
    # config included) need not be there any more
    from prove_jax.training import model_source

    def gone(cfg):
        raise FileNotFoundError("the initial weights were read on resume")
    monkeypatch.setattr(model_source, "source_model_config", gone)
    messages = []  # the optimizer's hyperparameters may be retuned, said in the log
    again = train(tiny_config(tmp_path, "cc", ["optimizer.lr=5e-4"], steps=4, save_every=2),
                  show_bar=False, log=messages.append)
    assert again.start_step == again.final_step == 4
    assert "resumed with retuned optimizer settings: optimizer.lr: 0.003 -> 0.0005" in messages, messages
    # a longer run reshapes the schedule (warmup and cosine span `steps`): said in one line
    messages.clear()
    longer = train(tiny_config(tmp_path, "cc", ["optimizer.lr=5e-4"], steps=6, save_every=2),
                   show_bar=False, log=messages.append)
    assert longer.start_step == 4 and longer.final_step == 6
    note = [m for m in messages if m.startswith("steps changed 4 -> 6")]
    assert len(note) == 1 and "now span 6 steps" in note[0], messages


def test_an_export_cut_short_is_redone_on_relaunch(tmp_path, monkeypatch):
    """RUN_DIR/model from an earlier save (export_every_save) must not pass for the final model
    when the final export was interrupted after the last checkpoint."""
    from prove_jax.training import export
    cfg = tiny_config(tmp_path, "ex", steps=4, save_every=2, export_every_save=True)
    real_export = export.export_model
    calls = []

    def export_then_die(path, *args):
        calls.append(path)
        if len(calls) > 1:  # the final export: the job is killed before it finishes
            raise KeyboardInterrupt
        return real_export(path, *args)

    monkeypatch.setattr(export, "export_model", export_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, show_bar=False)
    assert os.path.isfile(os.path.join(cfg.run_dir, "model", "config.json"))  # step 2's export
    monkeypatch.setattr(export, "export_model", real_export)
    result = train(cfg, show_bar=False)
    assert result.start_step == result.final_step == 4 and result.model_dir is not None
    _assert_same_params(checkpoint.params_pure_dict(checkpoint.load_model(result.model_dir)),
                        _params(result.state), atol=0)
    assert json.load(open(os.path.join(result.model_dir, "export.json"))) == {"step": 4}


def test_a_diverged_state_is_never_checkpointed(tmp_path):
    """With save_every not a multiple of log_every the loss used to be checked only at logged
    steps, so a NaN state was saved (and a relaunch resumed from it)."""
    from prove_jax.training.loop import TrainError
    cfg = tiny_config(tmp_path, "nan", ["optimizer.lr=1e30", "optimizer.clip_norm=null"], steps=6,
                      log_every=5, save_every=2)
    with pytest.raises(TrainError, match="at step 2; stopping"):
        train(cfg, show_bar=False)
    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    assert not os.path.isdir(ckpt_dir) or os.listdir(ckpt_dir) == []


def test_reads_abandoned_by_a_failed_restore_stay_quiet(monkeypatch):
    """A failed orbax restore leaves tensorstore reads running; when they finish they log
    asyncio's 'Future exception was never retrieved' (the same error with a spec dump) and
    call into orbax's closed event loop ('Exception ignored ... Event loop is closed'), after
    the one-line warning. Both are dropped for the failed path, and nothing else is."""
    import logging
    import sys
    import types
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(abandoned_reads, "QUIETED", abandoned_reads.QuietedPaths())
    abandoned_reads.QUIETED.add("/runs/a/checkpoints/8")
    for exc in (RuntimeError("Event loop is closed"), RuntimeError("something else")):
        sys.unraisablehook(types.SimpleNamespace(exc_value=exc, exc_type=RuntimeError))
    assert [str(u.exc_value) for u in seen] == ["something else"]

    def logged(error_text):
        record = logging.LogRecord("asyncio", logging.ERROR, __file__, 1,
                                   "Future exception was never retrieved\nfuture: <Future>", (),
                                   (ValueError, ValueError(error_text), None))
        return logging.getLogger("asyncio").filter(record)
    assert not logged('NOT_FOUND: ... at local file "/runs/a/checkpoints/8/state/" [tensorstore_spec=...]')
    assert logged('NOT_FOUND: ... at local file "/runs/b/checkpoints/8/state/"')  # another path


def test_a_closed_loop_error_before_the_failed_restore_returns_stays_quiet(monkeypatch):
    """Orbax closes its event loop when a restore fails, and an abandoned read can call into it
    before the exception reaches the caller (a pytest warning, now and then, in
    the corrupt-checkpoint test above). `restore_attempt` holds such errors while the restore
    runs: dropped if it raises, passed on in order if it returns; other errors pass at once."""
    import sys
    import types
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(abandoned_reads, "QUIETED", abandoned_reads.QuietedPaths())

    def unraisable(text):
        sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError(text), exc_type=RuntimeError))
    with abandoned_reads.restore_attempt("/runs/a/checkpoints/4"):
        unraisable("Event loop is closed")
        unraisable("something else")
        assert [str(u.exc_value) for u in seen] == ["something else"]
    assert [str(u.exc_value) for u in seen] == ["something else", "Event loop is closed"]
    assert sys.unraisablehook == seen.append and not abandoned_reads.QUIETED.paths

    seen.clear()
    with pytest.raises(ValueError, match="damaged"):
        with abandoned_reads.restore_attempt("/runs/a/checkpoints/8"):
            unraisable("Event loop is closed")
            raise ValueError("damaged")
    unraisable("Event loop is closed")  # a late one, after the failure was reported
    unraisable("something else")
    assert [str(u.exc_value) for u in seen] == ["something else"]
    assert abandoned_reads.QUIETED.paths == {os.path.abspath("/runs/a/checkpoints/8")}
