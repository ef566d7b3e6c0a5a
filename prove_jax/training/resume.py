"""Resuming: a relaunch into a run dir with checkpoints continues that run. Only operational
settings and the optimizer's hyperparameters may change; the newest usable checkpoint is
restored, or the launch is refused naming what changed."""

from __future__ import annotations

import json

from prove_jax import storage
from prove_jax.training.config import TrainConfig, TrainConfigError, to_dict
from prove_jax.training.errors import TrainError
from prove_jax.training.optimizer import lr_schedule
from prove_jax.training.run_checkpoint import RunCheckpointMismatch, RunCheckpoints


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "config":  # model.config is one value
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _setting_changes(run_dir: str, cfg: TrainConfig, shared_only: bool = False) -> dict[str, str]:
    """{key: "key: old -> new"} for every setting that differs from the run's train_config.json
    (with `shared_only`, only keys both have), sorted by key; {} without a readable file."""
    try:
        old = _flat(json.loads(storage.read_text(storage.join(run_dir, "train_config.json"))))
    except (OSError, ValueError, AttributeError):
        return {}
    new = _flat(json.loads(json.dumps(to_dict(cfg))))  # tuples -> lists, as the file has them
    keys = old.keys() & new.keys() if shared_only else old.keys() | new.keys()
    return {k: f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(keys)
            if old.get(k) != new.get(k)}


def changed_settings(run_dir: str, cfg: TrainConfig) -> list[str]:
    """`key: old -> new` for every setting that differs from the run's train_config.json."""
    return list(_setting_changes(run_dir, cfg).values())


# Settings a resumed run may change: how long it runs, how it logs and saves, how the same
# computation is laid out. Optimizer hyperparameters may change too, with a log line; any other
# change would make the relaunch no continuation of the run it resumes.
OPERATIONAL_SETTINGS = frozenset({
    "steps", "log_every", "save_every", "keep", "export_every_save", "async_save", "target_chip",
    "mesh", "optimizer.grad_accum", "model.remat", "model.scan_layers", "compilation_cache_dir",
    "model.shape_preset", "proposer_shape_preset",
    "run_dir",  # a run dir moved elsewhere
    "model.hf_dir", "model.checkpoint",  # a resumed run reads no initial weights
    "export_dtype"})  # the export only


RETUNABLE_PREFIX = "optimizer."


def saved_steps(run_dir: str) -> int | None:
    """`steps` of the run's train_config.json (None if unreadable)."""
    try:
        saved = json.loads(storage.read_text(storage.join(run_dir, "train_config.json")))
        return int(saved["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def schedule_change_note(optimizer, old_steps: int, new_steps: int, step: int) -> str:
    """The log line of a resume that changed `steps`: warmup and cosine decay span the run's
    length, so the learning rate from `step` on follows a reshaped schedule."""
    before = float(lr_schedule(optimizer, old_steps)(step))
    after = float(lr_schedule(optimizer, new_steps)(step))
    return (f"steps changed {old_steps} -> {new_steps}: the warmup and cosine schedule now span "
            f"{new_steps} steps (learning rate at step {step}: {before:.3g} -> {after:.3g})")


def check_continuation(run_dir: str, cfg: TrainConfig) -> list[str]:
    """A relaunch into a run dir with checkpoints continues that run: only operational settings
    and optimizer hyperparameters may differ from its train_config.json (settings the file does
    not have, from an older version, are not compared). Returns the retuned optimizer settings
    as "key: old -> new", for the log."""
    differ = {k: change for k, change in _setting_changes(run_dir, cfg, shared_only=True).items()
              if k not in OPERATIONAL_SETTINGS}
    retuned = [change for k, change in differ.items() if k.startswith(RETUNABLE_PREFIX)]
    changed = [change for k, change in differ.items() if not k.startswith(RETUNABLE_PREFIX)]
    if changed:
        raise TrainConfigError(
            f"run_dir {run_dir} holds a run made with other settings ({', '.join(changed)}); "
            f"relaunch with its settings to resume it, or set a new run_dir to start over "
            f"(only {', '.join(sorted(OPERATIONAL_SETTINGS))} and the optimizer's "
            f"hyperparameters may change on resume)")
    return retuned


def restore_run(ckpts: RunCheckpoints, layout, data_iter, cfg: TrainConfig):
    """(step, state) of the run's newest usable checkpoint, or None for a fresh run. A config
    whose train state no longer fits the checkpoints, or whose `steps` ends before them, is
    an error that leaves the run dir as it was."""
    try:
        restored = ckpts.restore_latest(layout.abstract, data_iter)
    except RunCheckpointMismatch as e:
        changed = changed_settings(cfg.run_dir, cfg)
        raise RunCheckpointMismatch(
            str(e) + (f"; settings changed since the last launch: {', '.join(changed)}" if changed
                      else "")) from None
    if restored is None:
        return None
    step, state, _ = restored
    if step > cfg.steps:
        raise TrainError(f"{ckpts.dir} has a checkpoint at step {step}, past steps={cfg.steps}: "
                         f"set steps to at least {step} to continue this run, or use a new "
                         f"run_dir")
    return step, state

