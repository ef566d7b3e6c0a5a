"""The training loop: config -> mesh, tokenizer, model, data, optimizer -> steps -> checkpoints.

The model config and tokenizer are settled before any weights are read (a resumed run's from
its own checkpoint metadata and RUN_DIR/tokenizer), so the restore target is known and the step
compiles first. A resumed run reads only its own latest checkpoint, and only operational
settings may change. The trained model is exported to RUN_DIR/model (`prove-jax generate
--model`), with export.json naming its step so a relaunch redoes an export cut short.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from prove_jax.errors import ProveJaxError
from prove_jax import distributed, memory, storage
from prove_jax.profiling import StepProfile
from prove_jax.checkpoints import checkpoint
from prove_jax.data.chat import chat_problem
from prove_jax.models import params as params_lib
from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig, preset
from prove_jax.training.metrics import Goodput, MetricsLogger, train_flops_per_step
from prove_jax.training.optimizer import lr_schedule, make_optimizer
from prove_jax.training.preemption import Preempted, PreemptionWatch
from prove_jax.training.run_checkpoint import (RunCheckpointMismatch,
                                               RunCheckpoints, has_checkpoints, saved_run_meta)
from prove_jax.training.compile_cache import use_compilation_cache
from prove_jax.training.config import TrainConfig, TrainConfigError, inline_model_config, to_dict
from prove_jax.training.objectives import make_loss_fn
from prove_jax.training.step import (BATCH_SPEC, abstract_batch, build_step_fn, init_state,
                                     jit_step, state_layout)


class TrainError(ProveJaxError, RuntimeError):
    """A run that cannot start or continue, with a message naming the cause."""


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    start_step: int  # 0 for a fresh run, the restored step otherwise
    final_step: int
    records: list[dict]  # logged metrics of this launch
    model_cfg: ModelConfig
    state: dict  # final train state (params, opt_state, step)
    model_dir: str | None  # the exported model checkpoint


def log_main(msg: str) -> None:
    """A line on stderr from host 0 only (every host runs the same code)."""
    if distributed.is_main_process():
        print(msg, file=sys.stderr, flush=True)


# ---- model config and tokenizer -----------------------------------------------------------

MASTER_PARAM_DTYPE = "float32"  # trained weights' dtype when model.param_dtype is not set


def low_precision_master_warning(cfg: TrainConfig) -> str | None:
    """The warning a run with explicitly low-precision master weights logs (None: float32)."""
    chosen = cfg.model.param_dtype
    if chosen is None or chosen == "float32":
        return None
    return (f"warning: model.param_dtype={chosen}: weights and optimizer state train in {chosen}, "
            f"where updates much smaller than a weight round away (at lr {cfg.optimizer.lr:g} most "
            f"weights may never change); unset it for float32 master weights")


def with_run_dtypes(model_cfg: ModelConfig, src) -> ModelConfig:
    """`model_cfg` with this run's dtypes: `model.dtype` if set, and master weights in
    `model.param_dtype` or float32 (a bfloat16 checkpoint's storage dtype would otherwise make
    bfloat16 weights and Adam state, where small updates round away)."""
    return model_cfg.replace(param_dtype=src.param_dtype or MASTER_PARAM_DTYPE,
                             **({"dtype": src.dtype} if src.dtype else {}))


def source_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config of the initial weights, without reading any weights."""
    src = cfg.model
    if src.hf_dir is not None:
        from prove_jax.checkpoints import convert
        if not storage.isdir(src.hf_dir):
            raise TrainError(f"model.hf_dir not found: {src.hf_dir}")
        with storage.local_copy(src.hf_dir, HF_CONFIG_FILES) as local:  # its configs only
            model_cfg = convert.read_hf_config(local)
    elif src.checkpoint is not None:
        model_cfg = checkpoint.load_config(src.checkpoint)
    elif src.preset is not None:
        model_cfg = preset(src.preset)
    else:
        model_cfg = inline_model_config(src.config)
    return with_run_dtypes(model_cfg, src)


def run_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model config of this launch: a resumed run's is the one saved with its checkpoints
    (the train state restored is the run's own, so the initial weights' directory is not read
    and need not be there any more); a fresh run's is `source_model_config`'s."""
    saved = saved_run_meta(cfg.run_dir)  # None without checkpoints
    if saved is None or not isinstance(saved.get("model_config"), dict):
        return source_model_config(cfg)
    src = cfg.model
    overrides = {k: v for k, v in (("dtype", src.dtype), ("param_dtype", src.param_dtype)) if v}
    return ModelConfig.from_json_dict(saved["model_config"],
                                      where=f"the model config saved in {cfg.run_dir}").replace(**overrides)


def _training_texts(path: str):
    from prove_jax.data import pipeline as data_lib
    for ex in data_lib.load_examples(path):
        if "text" in ex:
            yield ex["text"]
        else:
            yield str(ex.get("prompt", "")) + str(ex.get("response", ""))


def resolve_tokenizer(cfg: TrainConfig) -> tuple[object, str]:
    """(tokenizer, directory it was read from). A run's own saved tokenizer wins on resume;
    without a checkpoint it is only a leftover of an earlier launch, and the configured
    tokenizer (or a freshly trained BPE) is used, so a corrected tokenizer config counts."""
    from prove_jax.data.tokenizer import build_tokenizer
    resuming = has_checkpoints(cfg.run_dir)
    own = storage.join(cfg.run_dir, "tokenizer")
    if resuming and storage.isfile(storage.join(own, "tokenizer.json")):
        return read_tokenizer_dir(own), own
    tok = cfg.tokenizer
    if tok.bpe_vocab_size:
        base = storage.join(cfg.run_dir, "tokenizer_base")
        reuse = resuming and storage.isfile(storage.join(base, "tokenizer.json"))
        if distributed.is_main_process() and not reuse:
            _require_data(cfg.data)
            log_main(f"training a {tok.bpe_vocab_size}-token byte-level BPE on {cfg.data}")
            with storage.staged_dir(base) as tmp:  # locally a rename, at a URL an upload
                build_tokenizer(_training_texts(cfg.data), tmp, vocab_size=tok.bpe_vocab_size)
        distributed.barrier("tokenizer_built")
        return read_tokenizer_dir(base), base
    where = tok.path or cfg.model.checkpoint or cfg.model.hf_dir
    if where is None:
        raise TrainConfigError("no tokenizer: set tokenizer.path (a tokenizer directory) or "
                               "tokenizer.bpe_vocab_size (train one on the data)")
    if not storage.isdir(where):
        raise TrainError(f"tokenizer directory not found: {where}")
    loaded = checkpoint.load_tokenizer(where)
    if loaded is None:
        raise TrainError(f"no tokenizer files (tokenizer.json / vocab.json) in {where}")
    return loaded, where


def read_tokenizer_dir(path: str):
    """A saved tokenizer directory (local or a URL: its files read through a local copy)."""
    from prove_jax.data.tokenizer import load_tokenizer_dir
    with storage.local_copy(path) as local:
        return load_tokenizer_dir(local)


def _fill_special_ids(model_cfg: ModelConfig, tokenizer) -> ModelConfig:
    """From-scratch configs take EOS/pad ids from the tokenizer (needed by generation)."""
    changes = {}
    if not model_cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        changes["eos_token_ids"] = (int(tokenizer.eos_token_id),)
    if model_cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
        changes["pad_token_id"] = int(tokenizer.pad_token_id)
    return model_cfg.replace(**changes)


def _save_run_tokenizer(tokenizer, run_dir: str) -> str:
    """The tokenizer as trained (with `<|mask|>`) in RUN_DIR/tokenizer: written by a fresh run
    (replacing any leftover), kept as it is by a resumed one."""
    own = storage.join(run_dir, "tokenizer")
    keep = has_checkpoints(run_dir) and storage.isfile(storage.join(own, "tokenizer.json"))
    if distributed.is_main_process() and not keep:
        with storage.staged_dir(own) as tmp:
            tokenizer.save_pretrained(tmp)
    distributed.barrier("tokenizer_saved")
    return own


# ---- weights ------------------------------------------------------------------------------

HF_CONFIG_FILES = ("config.json", "generation_config.json")  # what settles an HF model's config
CONVERTED_DIR = "converted"  # RUN_DIR/converted: model.hf_dir as our checkpoint, converted once


def load_initial_model(cfg: TrainConfig, model_cfg: ModelConfig, mesh):
    """The starting weights of a fresh run, each array read straight into its sharding: every
    host reads its own shards (model.hf_dir through its one conversion, `convert_hf_once`)."""
    src = cfg.model
    if src.hf_dir is not None:
        path = convert_hf_once(cfg, mesh)
        log_main(f"loading model.hf_dir's weights from {path}")
    elif src.checkpoint is not None:
        path = src.checkpoint
        log_main(f"loading model checkpoint {path}")
    else:
        return params_lib.create_model(model_cfg, seed=cfg.seed, mesh=mesh, remat=src.remat)
    try:
        model = checkpoint.load_model(path, mesh=mesh, dtype=src.dtype,
                                      param_dtype=model_cfg.param_dtype, remat=src.remat)
    except checkpoint.CheckpointError as e:
        if src.hf_dir is None:
            raise
        raise checkpoint.CheckpointError(f"{e}; delete {path} to convert model.hf_dir again") from None
    if model.cfg != model_cfg:  # settled from the same files before any weight was read
        raise TrainError(f"the weights in {path} are of another model than this run's config "
                         f"(was {src.hf_dir or path} changed during the launch?)")
    return model


def convert_hf_once(cfg: TrainConfig, mesh) -> str:
    """RUN_DIR/converted: model.hf_dir as a prove-jax checkpoint stored in chunks of this run's
    shards, so that every host then reads only its own shards (no host holds the whole model
    but host 0 while converting). Host 0 converts, the others wait; a relaunch reuses it while
    the HF files and the mesh are unchanged (`convert.conversion_stale`)."""
    from prove_jax.checkpoints import convert
    hf_dir, out = cfg.model.hf_dir, storage.join(cfg.run_dir, CONVERTED_DIR)

    def convert_unless_current():
        why = convert.conversion_stale(hf_dir, out, mesh)
        if why is None:
            log_main(f"reusing {out}, converted from {hf_dir} by an earlier launch")
            return
        again = f" again ({why})" if storage.exists(out) else ""
        log_main(f"converting {hf_dir} into {out}{again}, on host 0 alone; every host then reads "
                 f"its own shards from there")
        if not storage.is_url(hf_dir):
            convert.hf_to_flax(hf_dir, out, overwrite=True, progress=True, mesh=mesh, record_source=True)
            return
        # the safetensors reader takes local files: host 0 downloads the model once, converts
        # it, and records the bucket's files as the source (their generations, not a temp dir)
        with storage.local_copy(hf_dir) as local:
            convert.hf_to_flax(local, out, overwrite=True, progress=True, mesh=mesh)
        storage.write_text(storage.join(out, convert.SOURCE_RECORD),
                           json.dumps(convert.source_record(hf_dir, mesh), indent=2))

    on_main_host_first(convert_unless_current, f"convert model.hf_dir {hf_dir}")
    return out


def on_main_host_first(fn: Callable[[], None], what: str) -> None:
    """`fn()` on host 0 while the other hosts wait. When it raises there, every host stops: host 0
    with its error, the others with a line pointing at host 0's log (instead of a collective
    timing out later)."""
    error = None
    if distributed.is_main_process():
        try:
            fn()
        except BaseException as e:  # passed on below, after the other hosts heard of it
            error = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        ok = int(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            raise TrainError(f"host 0 could not {what}; its log says why")
    if error is not None:
        raise error


def _with_mask_token(cfg: TrainConfig, tokenizer, model_cfg: ModelConfig):
    """(tokenizer, model config, grown): MARS needs `<|mask|>`; AR runs leave the vocab alone."""
    if cfg.objective != "mars" and model_cfg.mask_token_id is None:
        return tokenizer, model_cfg, False
    from prove_jax.checkpoints import vocab
    return vocab.ensure_mask_token(tokenizer, model_cfg)


# ---- export -------------------------------------------------------------------------------

def export_model(path: str, graphdef, params: dict, model_cfg: ModelConfig, tokenizer_dir: str,
                 dtype: str | None = None) -> str:
    """RUN_DIR/model: a prove_jax model checkpoint that `checkpoint.load_model` reads.

    Single process: checkpoint.save_model (atomic rename). Several processes: every host writes
    its shards through orbax (itself atomic: a temp folder finalised by the primary host), then
    host 0 adds config and tokenizer files. `dtype` (the run's `export_dtype`) stores the
    weights in that dtype instead of the trained one (bfloat16: half the size, for inference).
    """
    if dtype is not None and dtype != model_cfg.param_dtype:
        params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                              else x, params)  # each shard where it lies
        model_cfg = model_cfg.replace(param_dtype=dtype)
    if jax.process_count() == 1:
        return checkpoint.save_model(path, nnx.merge(graphdef, params), model_cfg, tokenizer_dir)
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as ckptr:  # closing waits for every host's writes
        ckptr.save(storage.join(storage.absolute(path), "params"), params, force=True)
    if distributed.is_main_process():
        checkpoint.copy_tokenizer_files(tokenizer_dir, path)
        storage.write_text(storage.join(path, "config.json"),
                           json.dumps(model_cfg.to_json_dict(), indent=2))
    distributed.barrier("export_done")
    return path


EXPORT_MARKER = "export.json"  # in RUN_DIR/model: {"step": the train step the weights are from}


def exported_step(model_dir: str, dtype: str | None = None) -> int | None:
    """The step recorded with an export, None when there is none (or an older export without
    the record, or, given `dtype`, one whose weights are stored in another dtype: then it is
    redone)."""
    try:
        step = json.loads(storage.read_text(storage.join(model_dir, EXPORT_MARKER))).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    complete = storage.isfile(storage.join(model_dir, "config.json"))
    if complete and dtype is not None:
        try:
            complete = checkpoint.load_config(model_dir).param_dtype == dtype
        except checkpoint.CheckpointError:
            complete = False
    return step if isinstance(step, int) and complete else None


def export_at_step(path: str, step: int, graphdef, params: dict, model_cfg: ModelConfig,
                   tokenizer_dir: str, dtype: str | None = None) -> str:
    """export_model, then the step record; written last, so a cut-short export has none."""
    export_model(path, graphdef, params, model_cfg, tokenizer_dir, dtype)
    if distributed.is_main_process():
        storage.write_text(storage.join(path, EXPORT_MARKER), json.dumps({"step": step}))
    distributed.barrier("export_marked")
    return path


# ---- data ---------------------------------------------------------------------------------

def _require_data(path: str | None) -> None:
    if path is None:
        raise TrainConfigError("no training data: set data=PATH (text file, folder or JSONL)")
    if not storage.exists(path):
        raise TrainError(f"data not found: {path}")


def data_block_size(cfg: TrainConfig) -> int:
    """The block the data pads each row's end to with trained EOS: MARS's (its mask stream
    predicts whole blocks, the last one included). Other objectives get 1, no padding: an AR
    loss over made-up EOS-after-EOS targets would depend on block_size, and the commit head's
    contexts (cut at trained tokens) would end inside such padding."""
    return cfg.block_size if cfg.objective == "mars" else 1


def make_data_iterator(cfg: TrainConfig, tokenizer, log: Callable[[str], None], mesh=None):
    """This host's batches; given the run's `mesh`, exactly the rows of each global batch that
    its devices hold under the batch sharding (else the process's contiguous share)."""
    from prove_jax.data import pipeline as data_lib
    _require_data(cfg.data)
    rows = None if mesh is None else data_lib.host_rows(
        NamedSharding(mesh, BATCH_SPEC), cfg.global_batch_size, cfg.max_length)
    it = data_lib.make_dataset(
        cfg.data, tokenizer, max_length=cfg.max_length, block_size=data_block_size(cfg),
        global_batch_size=cfg.global_batch_size, seed=cfg.seed, shuffle=True, num_epochs=None,
        process_index=jax.process_index(), process_count=jax.process_count(), chat=cfg.chat,
        enable_thinking=cfg.enable_thinking,
        pack_documents=cfg.pack_documents, rows=rows)
    stats = getattr(it, "stats", None)
    if stats is not None:
        packed = f" ({stats.documents} documents packed)" if cfg.pack_documents else ""
        log(f"data: {stats.examples} examples -> {stats.sequences} sequences of {cfg.max_length} "
            f"tokens{packed}, {stats.trained_tokens} trained tokens, {stats.steps_per_epoch} "
            f"steps/epoch, {100 * stats.padding_fraction:.1f}% padding (+{100 * stats.fill_fraction:.1f}% "
            f"block-end EOS)")
        if stats.truncated:
            log(f"warning: {stats.truncated} sequence(s) longer than max_length={cfg.max_length} "
                f"were truncated")
        if stats.dropped:
            log(f"warning: {stats.dropped} sequence(s) dropped (no trained token within max_length)")
        if stats.steps_per_epoch == 0:
            log(f"warning: {stats.sequences} sequence(s) fill less than one global batch of "
                f"{cfg.global_batch_size}: each batch repeats them (more data, or a smaller "
                f"global_batch_size)")
    return it


def check_hosts_split_the_batch(mesh, process_of=lambda d: d.process_index) -> None:
    """Each process feeds its own rows (`data.to_global_batch`), so the batch axes (data x fsdp)
    must give every process a distinct, equal share of the rows. A mesh whose hosts differ only
    along the tensor axis would make them hold different rows for one replicated shard:
    silently wrong batches, so it is refused."""
    processes = sorted({process_of(d) for d in mesh.devices.flat})
    if len(processes) == 1:
        return
    shards = sharding.batch_shards(mesh)  # one row each below
    owned: dict[int, set] = {p: set() for p in processes}
    for device, index in NamedSharding(mesh, BATCH_SPEC).devices_indices_map((shards,)).items():
        owned[process_of(device)].add(index[0].indices(shards)[:2])
    shared = any(owned[a] & owned[b] for i, a in enumerate(processes) for b in processes[i + 1:])
    if shared or len({len(v) for v in owned.values()}) != 1:
        raise TrainConfigError(
            f"mesh {dict(mesh.shape)} does not split the batch across the {len(processes)} processes: "
            f"each host feeds its own rows, so the batch axes data x fsdp = {shards} must run across "
            f"the hosts (put the hosts on data or fsdp, the tensor axis within a host)")


def config_mesh(cfg: TrainConfig, log: Callable[[str], None] = log_main):
    """The run's device mesh (`mesh` in the config), checked against its batch and logged, or
    an error saying how to fit it here."""
    try:
        mesh = sharding.make_mesh(cfg.mesh)
    except sharding.MeshError as e:
        raise sharding.MeshError(f"{e}: set mesh=[data,fsdp,tensor] to this machine's devices "
                                 f"(--dry-run checks a pod's layout from here)") from None
    check_batch_layout(cfg, mesh)
    log(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)")
    return mesh


def check_batch_layout(cfg: TrainConfig, mesh) -> None:
    check_hosts_split_the_batch(mesh)
    rows = sharding.batch_shards(mesh)
    micro = cfg.global_batch_size // cfg.optimizer.grad_accum
    if cfg.global_batch_size % jax.process_count():
        raise TrainConfigError(f"global_batch_size={cfg.global_batch_size} must be a multiple of "
                               f"the process count {jax.process_count()}")
    if micro % rows or (cfg.global_batch_size // rows) % cfg.optimizer.grad_accum:
        raise TrainConfigError(
            f"global_batch_size={cfg.global_batch_size} must be a multiple of data x fsdp = {rows} "
            f"times optimizer.grad_accum = {cfg.optimizer.grad_accum}")


# ---- the loop -----------------------------------------------------------------------------

@jax.jit
def _all_finite(params) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def check_finite(step: int, loss: float, params) -> None:
    """Refuse to go on (or save) from a diverged state: the step's loss (computed before its
    update) and the updated weights themselves must be finite."""
    if not math.isfinite(loss):
        raise TrainError(f"loss is {loss} at step {step}; stopping (lower optimizer.lr or set "
                         f"optimizer.clip_norm)")
    if params is not None and not bool(_all_finite(params)):
        raise TrainError(f"the weights became non-finite at step {step}; stopping without saving "
                         f"them (lower optimizer.lr or set optimizer.clip_norm)")


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


def _saved_steps(run_dir: str) -> int | None:
    """`steps` of the run's train_config.json (None if unreadable)."""
    try:
        return int(json.loads(storage.read_text(storage.join(run_dir, "train_config.json")))["steps"])
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


def check_tokenizer_matches_weights(cfg: TrainConfig, tokenizer, where: str,
                                    model_cfg: ModelConfig) -> None:
    """Pretrained weights (model.checkpoint / model.hf_dir) read token ids as their own
    tokenizer assigns them: a configured tokenizer must map every token to the same id (and fit
    the embedding rows), or the embeddings are read with wrong ids."""
    src = cfg.model.checkpoint or cfg.model.hf_dir
    if src is None or storage.absolute(where) == storage.absolute(src):
        return
    from prove_jax.checkpoints import vocab
    own = checkpoint.load_tokenizer(src) if storage.isdir(src) else None
    try:
        vocab.check_shared_vocabulary(tokenizer, where, [("model", src, model_cfg.vocab_size, own)])
    except vocab.VocabError as e:
        raise TrainConfigError(f"{e}; leave tokenizer.path unset to use the model's own tokenizer") from None


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
        raise TrainError(f"{ckpts.dir} has a checkpoint at step {step}, past steps={cfg.steps}: set "
                         f"steps to at least {step} to continue this run, or use a new run_dir")
    return step, state


def compile_step(step_fn, layout, mesh, cfg: TrainConfig, log: Callable[[str], None]):
    """The jitted train step compiled once for the run's shapes, before any weight is loaded;
    refused with the sizes when the devices cannot hold it (state, gradients, activations).
    With `compilation_cache_dir` a relaunch reads it from there instead."""
    use_compilation_cache(cfg.compilation_cache_dir)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(layout.abstract, abstract_batch(
            mesh, cfg.global_batch_size, cfg.max_length, packed=cfg.pack_documents)).compile()
    log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
    memory.check_fits(compiled, memory.local_devices(mesh),
                      f"a train step of {cfg.global_batch_size} x {cfg.max_length} tokens (model and "
                      f"optimizer state, gradients, activations)", error=TrainError, with_arguments=True,
                      advice="lower global_batch_size or max_length, raise optimizer.grad_accum, set "
                             "model.remat=full (or dots), or use more devices")
    return compiled


def train(cfg: TrainConfig, log: Callable[[str], None] = log_main, show_bar: bool = True,
          stop_after: int | None = None, profile: str | None = None) -> TrainResult:
    """Run (or resume) the configured training. `stop_after` ends this launch early at that
    step (after saving), as if the job were killed there; used to test resumption. `profile`:
    a directory that gets a jax.profiler trace of a few steps after warm-up (profiling.py).

    A SIGTERM during the steps saves the step all hosts agree on and raises `Preempted`
    (training/preemption.py); the same call again continues from there."""
    goodput = Goodput()  # this launch's wall time, from here
    run_dir = storage.absolute(cfg.run_dir)
    cfg = dataclasses.replace(cfg, run_dir=run_dir)
    storage.require_bucket(run_dir)  # before orbax or gcsfs could create a mistyped one
    _require_data(cfg.data)  # before anything is written to the run dir
    resuming = has_checkpoints(run_dir)
    retuned = check_continuation(run_dir, cfg) if resuming else []
    saved_steps = _saved_steps(run_dir) if resuming else None
    model_cfg = run_model_config(cfg)  # bad model keys/dtypes fail before BPE training
    if cfg.max_length > model_cfg.max_position_embeddings:  # its position buffers end there
        raise TrainConfigError(f"max_length={cfg.max_length} is longer than the model's context, "
                               f"max_position_embeddings={model_cfg.max_position_embeddings}")
    mesh = config_mesh(cfg, log)
    if (warning := low_precision_master_warning(cfg)) is not None and not resuming:
        log(warning)

    bpe = cfg.tokenizer.bpe_vocab_size
    if bpe and bpe > model_cfg.vocab_size and not resuming:
        raise TrainConfigError(f"tokenizer.bpe_vocab_size={bpe} is larger than the model's "
                               f"vocab_size={model_cfg.vocab_size}")
    tokenizer, tok_where = resolve_tokenizer(cfg)
    if not resuming:
        check_tokenizer_matches_weights(cfg, tokenizer, tok_where, model_cfg)
    if cfg.chat and not getattr(tokenizer, "chat_template", None):
        raise TrainConfigError(f"chat=true but the tokenizer in {tok_where} has no chat template; "
                               f"use a tokenizer with one or set chat=false")
    if cfg.chat and (problem := chat_problem(tokenizer, cfg.enable_thinking)) is not None:
        raise TrainConfigError(f"enable_thinking={str(cfg.enable_thinking).lower()}: {problem} "
                               f"(in {tok_where}); set enable_thinking=null")
    if cfg.model.preset is not None or cfg.model.config is not None:
        model_cfg = _fill_special_ids(model_cfg, tokenizer)
    tokenizer, train_cfg, grown = _with_mask_token(cfg, tokenizer, model_cfg)
    if len(tokenizer) > train_cfg.vocab_size:
        raise TrainError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                         f"{train_cfg.vocab_size} embedding rows; use the model's own tokenizer")
    # the data is read and checked before the step compiles and before the run dir is written
    data_iter = make_data_iterator(cfg, tokenizer, log, mesh)
    tx = make_optimizer(cfg.optimizer, cfg.steps)
    layout = state_layout(params_lib.abstract_model(train_cfg, cfg.model.remat, cfg.model.scan_layers),
                          tx, mesh)
    loss_fn = make_loss_fn(cfg.objective, block_size=cfg.block_size,
                           mask_token_id=train_cfg.mask_token_id, ar_weight=cfg.ar_weight)
    with goodput.timing("compile"):
        step_fn = compile_step(jit_step(build_step_fn(layout.graphdef, tx, loss_fn, cfg.optimizer.grad_accum),
                                        layout, mesh), layout, mesh, cfg, log)

    tok_dir = _save_run_tokenizer(tokenizer, run_dir)  # the run dir is written from here on
    ckpts = RunCheckpoints(run_dir, keep=cfg.keep, async_save=cfg.async_save, log=log)
    try:
        with goodput.timing("checkpoint"):
            restored = restore_run(ckpts, layout, data_iter, cfg)
    except BaseException:
        ckpts.close()
        raise
    # written once the checkpoints are known to fit, so it names the config they were made with
    if distributed.is_main_process():
        storage.write_text(storage.join(run_dir, "train_config.json"), json.dumps(to_dict(cfg), indent=2))
    if restored is not None:
        start, state = restored
        log(f"resumed from {ckpts.dir}/{start}")
        if retuned:
            log(f"resumed with retuned optimizer settings: {', '.join(retuned)}")
        if saved_steps is not None and saved_steps != cfg.steps:
            log(schedule_change_note(cfg.optimizer, saved_steps, cfg.steps, start))
    else:
        start = 0
        from_scratch = cfg.model.preset is not None or cfg.model.config is not None
        if from_scratch:  # random init directly at the final vocab size
            model = params_lib.create_model(train_cfg, seed=cfg.seed, mesh=mesh,
                                            remat=cfg.model.remat)
        else:
            model = load_initial_model(cfg, model_cfg, mesh)
            if grown:
                from prove_jax.checkpoints import vocab
                model = vocab.grow_embeddings(model, train_cfg)
        state = init_state(model, tx, layout)
        del model

    meta = {"model_config": train_cfg.to_json_dict(), "objective": cfg.objective}
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    tokens_per_step = cfg.global_batch_size * cfg.max_length
    logger = MetricsLogger(run_dir, cfg.steps, start_step=start,
                           flops_per_step=train_flops_per_step(train_cfg, cfg.global_batch_size,
                                                               cfg.max_length, cfg.objective),
                           tokens_per_step=tokens_per_step,
                           show_bar=show_bar and distributed.is_main_process(),
                           learning_rate=lr_schedule(cfg.optimizer, cfg.steps), goodput=goodput)
    records = []
    preempted = False
    tracing = StepProfile(profile, "train_step")
    try:
        with jax.set_mesh(mesh), PreemptionWatch(start, log) as preemption:
            from prove_jax.data import pipeline as data_lib
            goodput.begin_steps()
            for step in range(start, end):
                with goodput.timing("data_wait"):
                    batch = data_lib.to_global_batch(next(data_iter), mesh, BATCH_SPEC)
                with tracing.step(sync=lambda: jax.block_until_ready(state)):  # traced: the step whole
                    state, metrics = step_fn(state, batch)
                done = step + 1
                # asked at every step on every host (JAX's manager agrees on a step it was
                # told); the last step saves and exports as usual
                preempted = preemption.reached(done) and done < end
                saving = done % cfg.save_every == 0 or done == end or preempted
                if done % cfg.log_every == 0 or done in (start + 1, end):
                    rec = logger.record(done, metrics)
                    records.append(rec)
                    check_finite(done, rec["loss"], state["params"] if saving else None)
                elif saving:  # never checkpoint a diverged state, logged step or not
                    check_finite(done, float(metrics["loss"]), state["params"])
                if saving:
                    jax.block_until_ready(state)  # the step's compute counts as a step's
                    with goodput.timing("checkpoint"):
                        ckpts.save(done, state, data_iter, meta)
                        if cfg.export_every_save and done != cfg.steps and not preempted:
                            ckpts.wait()
                            export_at_step(storage.join(run_dir, "model"), done, layout.graphdef,
                                           state["params"], train_cfg, tok_dir, cfg.export_dtype)
                if preempted:  # the kill follows the notice: the checkpoint only, then stop
                    ckpts.wait()
                    break
            goodput.end_steps()
        ckpts.wait()
    finally:
        tracing.close()
        logger.close()
        ckpts.close()
    if preempted:  # its checkpoint is on disk
        stop = Preempted(done, run_dir)
        log(str(stop))
        raise stop

    final = end if end > start else start
    model_dir = None
    exported = storage.join(run_dir, "model")
    export_dtype = cfg.export_dtype or train_cfg.param_dtype
    if final == cfg.steps and start == final and exported_step(exported, export_dtype) == final:
        model_dir = exported  # a finished run relaunched, its export complete: nothing to redo
    elif final == cfg.steps:
        model_dir = export_at_step(exported, final, layout.graphdef, state["params"], train_cfg,
                                   tok_dir, cfg.export_dtype)
        log(f"exported the trained model to {model_dir}")
    return TrainResult(run_dir=run_dir, start_step=start, final_step=final, records=records,
                       model_cfg=train_cfg, state=state, model_dir=model_dir)
