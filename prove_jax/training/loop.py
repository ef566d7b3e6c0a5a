"""The training loop: set-up (run_setup.py) -> the starting state -> steps -> checkpoints -> export.

A resumed run reads only its own latest checkpoint, and only operational settings may change
(resume.py). The trained model is exported to RUN_DIR/model (`prove-jax generate --model`),
with export.json naming its step so a relaunch redoes an export cut short (export.py). A
SIGTERM during the steps saves the step every host agrees on (preemption.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from prove_jax import distributed, storage
from prove_jax.checkpoints import vocab
from prove_jax.models import params as params_lib
from prove_jax.models.config import ModelConfig
from prove_jax.training.config import TrainConfig, to_dict
from prove_jax.training.errors import TrainError  # noqa: F401 (what `train` raises)
from prove_jax.training.export import export_at_step, exported_step
from prove_jax.training.host_log import log_main
from prove_jax.training.metrics import Goodput, MetricsLogger, train_flops_per_step
from prove_jax.training.model_source import load_initial_model
from prove_jax.training.optimizer import lr_schedule
from prove_jax.training.preemption import Preempted
from prove_jax.training.resume import restore_run, schedule_change_note
from prove_jax.training.run_checkpoint import RunCheckpoints
from prove_jax.training.run_setup import RunSetup, prepare_run
from prove_jax.training.run_tokenizer import save_run_tokenizer
from prove_jax.training.step import init_state
from prove_jax.training.step_loop import Steps, run_steps


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    start_step: int  # 0 for a fresh run, the restored step otherwise
    final_step: int
    records: list[dict]  # logged metrics of this launch
    model_cfg: ModelConfig
    state: dict  # final train state (params, opt_state, step)
    model_dir: str | None  # the exported model checkpoint


def train(cfg: TrainConfig, log: Callable[[str], None] = log_main, show_bar: bool = True,
          stop_after: int | None = None, profile: str | None = None) -> TrainResult:
    """Run (or resume) the configured training. `stop_after` ends this launch early at that
    step (after saving), as if the job were killed there; used to test resumption. `profile`:
    a directory that gets a jax.profiler trace of a few steps after warm-up (profiling.py).

    A SIGTERM during the steps saves the step all hosts agree on and raises `Preempted`
    (training/preemption.py); the same call again continues from there."""
    goodput = Goodput()  # this launch's wall time, from here
    run = prepare_run(cfg, log, goodput)
    cfg = run.cfg
    tok_dir = save_run_tokenizer(run.tokenizer, cfg.run_dir)  # the run dir is written from here on
    ckpts = RunCheckpoints(cfg.run_dir, keep=cfg.keep, async_save=cfg.async_save, log=log)
    try:
        with goodput.timing("checkpoint"):
            restored = restore_run(ckpts, run.layout, run.data_iter, cfg)
    except BaseException:
        ckpts.close()
        raise
    # written once the checkpoints are known to fit, so it names the config they were made with
    if distributed.is_main_process():
        storage.write_text(storage.join(cfg.run_dir, "train_config.json"),
                           json.dumps(to_dict(cfg), indent=2))
    start, state = _starting_state(run, restored, ckpts.dir, log)

    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    logger = MetricsLogger(cfg.run_dir, cfg.steps, start_step=start,
                           flops_per_step=train_flops_per_step(run.train_cfg, cfg.global_batch_size,
                                                               cfg.max_length, cfg.objective),
                           tokens_per_step=cfg.global_batch_size * cfg.max_length,
                           show_bar=show_bar and distributed.is_main_process(),
                           learning_rate=lr_schedule(cfg.optimizer, cfg.steps), goodput=goodput)
    try:
        steps = Steps(run.step_fn, run.data_iter, run.mesh, logger.record,
                      log_every=cfg.log_every, log_first=True)
        state, records, preempted_at = run_steps(steps, state, start, end, goodput, log,
                                                 saves=_Saves(run, ckpts, tok_dir), profile=profile)
    finally:
        logger.close()
        ckpts.close()
    if preempted_at is not None:  # its checkpoint is on disk
        stop = Preempted(preempted_at, cfg.run_dir)
        log(str(stop))
        raise stop
    final = end if end > start else start
    model_dir = _final_export(run, state, start, final, tok_dir, log)
    return TrainResult(run_dir=cfg.run_dir, start_step=start, final_step=final, records=records,
                       model_cfg=run.train_cfg, state=state, model_dir=model_dir)


def _starting_state(run: RunSetup, restored, ckpt_dir: str, log: Callable[[str], None]):
    """(step, train state): the restored checkpoint's (said in the log with what changed since
    its launch), or step 0's from the initial weights."""
    cfg = run.cfg
    if restored is not None:
        start, state = restored
        log(f"resumed from {ckpt_dir}/{start}")
        if run.retuned:
            log(f"resumed with retuned optimizer settings: {', '.join(run.retuned)}")
        if run.saved_steps is not None and run.saved_steps != cfg.steps:
            log(schedule_change_note(cfg.optimizer, run.saved_steps, cfg.steps, start))
        return start, state
    from_scratch = cfg.model.preset is not None or cfg.model.config is not None
    if from_scratch:  # random init directly at the final vocab size
        model = params_lib.create_model(run.train_cfg, seed=cfg.seed, mesh=run.mesh,
                                        remat=cfg.model.remat)
    else:
        model = load_initial_model(cfg, run.model_cfg, run.mesh)
        if run.grown:
            model = vocab.grow_embeddings(model, run.train_cfg)
    return 0, init_state(model, run.tx, run.layout)


class _Saves:
    """The model run's checkpoints for `step_loop.run_steps`: every save_every steps and the
    last, each exported too with export_every_save (not a preemption's: the kill follows)."""

    def __init__(self, run: RunSetup, ckpts: RunCheckpoints, tok_dir: str):
        self.run, self.ckpts, self.tok_dir = run, ckpts, tok_dir
        self.meta = {"model_config": run.train_cfg.to_json_dict(), "objective": run.cfg.objective}

    def due(self, step: int, end: int) -> bool:
        return step % self.run.cfg.save_every == 0 or step == end

    def save(self, step: int, state: dict, preempted: bool) -> None:
        run, cfg = self.run, self.run.cfg
        self.ckpts.save(step, state, run.data_iter, self.meta)
        if cfg.export_every_save and step != cfg.steps and not preempted:
            self.ckpts.wait()
            export_at_step(storage.join(cfg.run_dir, "model"), step, run.layout.graphdef,
                           state["params"], run.train_cfg, self.tok_dir, cfg.export_dtype)

    def wait(self) -> None:
        self.ckpts.wait()


def _final_export(run: RunSetup, state: dict, start: int, final: int, tok_dir: str,
                  log: Callable[[str], None]) -> str | None:
    """RUN_DIR/model once the run reached `steps` (None before): exported now, or left as it is
    when a finished run is relaunched and its export is complete."""
    cfg = run.cfg
    if final != cfg.steps:
        return None
    exported = storage.join(cfg.run_dir, "model")
    export_dtype = cfg.export_dtype or run.train_cfg.param_dtype
    if start == final and exported_step(exported, export_dtype) == final:
        return exported  # a finished run relaunched, its export complete: nothing to redo
    model_dir = export_at_step(exported, final, run.layout.graphdef, state["params"], run.train_cfg,
                               tok_dir, cfg.export_dtype)
    log(f"exported the trained model to {model_dir}")
    return model_dir
