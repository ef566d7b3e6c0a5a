"""Run checkpoints: train state + data iterator position + metadata, via orbax.

RUN_DIR/checkpoints/<step>/ holds `state` (sharded arrays), `data` (the grain iterator: one
global batch index, the same in every host's file) and `meta` (JSON). A damaged step is moved
aside to RUN_DIR/corrupt/ and the previous one used; a readable step whose train state differs
from the config's is refused, naming the difference, and left in place for the original config.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from prove_jax.errors import ProveJaxError
from prove_jax import distributed, storage
from prove_jax.checkpoints.abandoned_reads import restore_attempt
from prove_jax.checkpoints.restore_errors import restore_error_reason
from prove_jax.models.params import dotted_path


class RunCheckpointError(ProveJaxError, RuntimeError):
    """No usable checkpoint where one was expected."""


class RunCheckpointMismatch(RunCheckpointError):
    """A readable checkpoint whose train state does not fit the current config."""


def leaf_shapes(tree) -> dict[str, tuple]:
    """'opt_state.1.0.mu.embed' -> shape, for every array leaf of a tree or its orbax metadata."""
    return {dotted_path(path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _listing(keys: list[str], limit: int = 3) -> str:
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def state_difference(saved: dict[str, tuple], expected: dict[str, tuple]) -> str | None:
    """What differs between a checkpoint's arrays and the current train state, or None."""
    only_saved = sorted(saved.keys() - expected.keys())
    only_expected = sorted(expected.keys() - saved.keys())
    reshaped = sorted(k for k in saved.keys() & expected.keys() if saved[k] != expected[k])
    parts = []
    if only_saved:
        parts.append(f"only in the checkpoint: {_listing(only_saved)}")
    if only_expected:
        parts.append(f"only in this config's state: {_listing(only_expected)}")
    if reshaped:
        parts.append("different shapes: " + _listing(
            [f"{k} {saved[k]} vs {expected[k]}" for k in reshaped]))
    return "; ".join(parts) or None


CHECKPOINT_DIR = "checkpoints"  # RUN_DIR/checkpoints/<step>/


def has_checkpoints(run_dir: str) -> bool:
    """Whether the run dir holds a saved step, i.e. a launch resumes rather than starts (read
    from the folder, without opening a checkpoint manager)."""
    ckpt_dir = storage.join(run_dir, CHECKPOINT_DIR)
    return storage.isdir(ckpt_dir) and any(name.isdigit() for name in storage.listdir(ckpt_dir))


def saved_run_meta(run_dir: str) -> dict | None:
    """The `meta` item (model config, objective) of the newest step that has a readable one,
    read as the JSON file it is, without a checkpoint manager; None when there is none."""
    ckpt_dir = storage.join(run_dir, CHECKPOINT_DIR)
    if not storage.isdir(ckpt_dir):
        return None
    for step in sorted((int(n) for n in storage.listdir(ckpt_dir) if n.isdigit()), reverse=True):
        try:
            meta_path = storage.join(ckpt_dir, str(step), "meta", "metadata")
            meta = json.loads(storage.read_text(meta_path))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict):
            return meta
    return None


class RunCheckpoints:
    def __init__(self, run_dir: str, keep: int = 3, async_save: bool = True,
                 log: Callable[[str], None] = print):
        self.run_dir = storage.absolute(run_dir)
        self.dir = storage.join(self.run_dir, CHECKPOINT_DIR)
        self.log = log
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: dict, data_iter, meta: dict, force: bool = True) -> None:
        """Start an (async) save; arrays are copied off-device before this returns."""
        args = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self.manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore_latest(self, abstract_state: dict, data_iter) -> tuple[int, dict, dict] | None:
        """(step, state, meta) of the newest readable checkpoint (the iterator is rewound in
        place), or None for a fresh run. `abstract_state` carries the target shardings."""
        steps = sorted(self.steps(), reverse=True)
        expected = leaf_shapes(abstract_state)
        for i, step in enumerate(steps):
            args = {"state": ocp.args.StandardRestore(abstract_state),
                    "meta": ocp.args.JsonRestore()}
            try:
                with restore_attempt(storage.join(self.dir, str(step))):
                    self._check_structure(step, expected)  # a config change raises, moves nothing
                    data_state = self._data_state(step) if data_iter is not None else None
                    restored = self.manager.restore(step, args=ocp.args.Composite(**args))
            except RunCheckpointMismatch:
                raise
            except Exception as e:  # orbax/tensorstore raise many types for a damaged folder
                older = steps[i + 1] if i + 1 < len(steps) else None
                self.log(f"warning: checkpoint step {step} in {self.dir} cannot be restored "
                         f"({restore_error_reason(e)}); "
                         + (f"falling back to step {older}" if older is not None
                            else "no older checkpoint to fall back to"))
                self._move_aside(step)
                continue
            if data_iter is not None:
                data_iter.set_state(data_state)
                if hasattr(data_iter, "start_prefetch"):  # as grain's own restore does
                    data_iter.start_prefetch()
            return step, restored["state"], restored["meta"]
        if steps:
            raise RunCheckpointError(f"no checkpoint in {self.dir} could be restored "
                                     f"(tried steps {steps}); remove the folder to start over")
        return None

    def _data_state(self, step: int) -> dict:
        """The step's data-iterator state. grain's own restore reads only the file named for the
        current process count (process_{i}-of-{N}.json); the state is global, so any host's file
        serves a relaunch on another number of hosts."""
        folder = storage.join(self.dir, str(step), "data")
        own = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        names = sorted(n for n in storage.listdir(folder)
                       if re.fullmatch(r"process_\d+-of-\d+\.json", n))
        if not names:
            raise FileNotFoundError(f"no data-iterator state in {folder}")
        if own not in names:
            self.log(f"checkpoint step {step} was saved by "
                     f"{names[0].split('-of-')[1].removesuffix('.json')} process(es), this launch "
                     f"has {jax.process_count()}: resuming the data at the same global batch")
        chosen = own if own in names else names[0]
        return json.loads(storage.read_text(storage.join(folder, chosen)))

    def _check_structure(self, step: int, expected: dict[str, tuple]) -> None:
        """Compare the step's stored array paths and shapes (its metadata file, no array data)
        with the train state this config builds. An unreadable metadata file raises whatever
        orbax raises, which the caller treats as damage."""
        path = epath.Path(storage.join(self.dir, str(step), "state"))
        saved = leaf_shapes(ocp.StandardCheckpointHandler().metadata(path).tree)
        diff = state_difference(saved, expected)
        if diff is not None:
            raise RunCheckpointMismatch(
                f"checkpoint step {step} in {self.dir} holds a different train state than this "
                f"config builds ({diff}); the model or optimizer settings changed since it was "
                f"saved: resume with the run's original config or use a new run_dir "
                f"(the checkpoints were left in place)")

    def _move_aside(self, step: int) -> None:
        """Keep a damaged step out of the manager's way (a later save reuses its number)."""
        if distributed.is_main_process():
            src = storage.join(self.dir, str(step))
            dst = storage.join(self.run_dir, "corrupt", str(step))
            if storage.is_url(src):  # no rename in an object store: the step is dropped
                storage.remove_tree(src)
                self.log(f"removed the damaged checkpoint {src}")
            elif os.path.isdir(src):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.rmtree(dst, ignore_errors=True)
                shutil.move(src, dst)
                self.log(f"moved the damaged checkpoint to {dst}")
        distributed.barrier(f"move_aside_{step}")
        self.manager.reload()

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
