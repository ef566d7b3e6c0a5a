"""Training the commit head (models/commit_head.py) with the proposer and verifier frozen.

The head predicts, for each proposed token, whether the block up to it still equals the
proposer's own greedy AR continuation. Labels are free (docs/method.md 3d): one proposer forward
over [context, block] gives its greedy token at every block position. Each data row gives one
context, cut at a random trained position. `prove-jax train objective=commit_head` runs it
(docs/training.md); the output is the verifier checkpoint with a `commit_head/` folder.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from prove_jax import distributed
from prove_jax.checkpoints import checkpoint
from prove_jax.checkpoints.checkpoint import CheckpointError
from prove_jax.checkpoints.commit_head_io import save_commit_head
from prove_jax.checkpoints.vocab import check_shared_vocabulary
from prove_jax.models.attention import causal_mask
from prove_jax.models.commit_head import CommitHead, predicted_length
from prove_jax.models.compute import DEFAULT_COMPUTE, ComputeOptions
from prove_jax.models.params import abstract_model, abstract_sharded
from prove_jax.models.sharding import shardings_of
from prove_jax.models.tokens import greedy_tokens, readable_tokens
from prove_jax.training.batches import make_data_iterator
from prove_jax.training.compiled_step import compile_checked
from prove_jax.training.config import TrainConfigError
from prove_jax.training.export import export_model
from prove_jax.training.host_log import log_main
from prove_jax.training.mesh import config_mesh
from prove_jax.training.metrics import Goodput, MetricsFile
from prove_jax.training.optimizer import lr_schedule
from prove_jax.training.step import abstract_batch, batch_shardings, gradient_update
from prove_jax.training.step_loop import Steps, run_steps


# ---- labels ----------------------------------------------------------------------------------

def _layout(context, context_valid, extra: int):
    """Positions and attention mask of [context, `extra` tokens after it]. `context_valid`
    [B, C] marks left padding (real contexts are right-aligned, last token at C - 1); a padding
    query sees itself only, so its unused output stays finite."""
    b, c = context.shape
    n = c + extra
    if context_valid is None:
        return jnp.broadcast_to(jnp.arange(n), (b, n)), causal_mask(b, n)
    pad = c - jnp.sum(context_valid, axis=1)
    pos = jnp.maximum(jnp.arange(n)[None] - pad[:, None], 0)
    keys = jnp.concatenate([context_valid, jnp.ones((b, extra), bool)], axis=1)
    return pos, causal_mask(b, n, keys) | jnp.eye(n, dtype=bool)[None]


def propose_and_label(proposer, context, block_size: int, mask_id: int, context_valid=None,
                      compute: ComputeOptions = DEFAULT_COMPUTE):
    """Proposer block after each context row and its AR-matching labels.

    context [B, C] (left-padded where `context_valid` [B, C] is False) -> (block D [B, K],
    labels [B, K-1]: D_1..D_{i+1} all equal the proposer's greedy AR continuation).
    """
    b, c = context.shape
    k = block_size
    x = jnp.concatenate([context, jnp.full((b, k - 1), mask_id, context.dtype)], axis=1)
    pos, mask = _layout(context, context_valid, k - 1)
    h, _ = proposer.hidden_states(x, pos, mask, compute=compute)
    # [B, K]
    block = greedy_tokens(proposer.logits(h[:, c - 1:], compute)).astype(context.dtype)
    y = jnp.concatenate([context, block], axis=1)
    pos, mask = _layout(context, context_valid, k)
    h, _ = proposer.hidden_states(y, pos, mask, compute=compute)
    greedy = greedy_tokens(proposer.logits(h[:, c: c + k - 1], compute))  # after D_0..D_{K-2}
    match = greedy == block[:, 1:]
    return block, jnp.cumprod(match.astype(jnp.int32), axis=-1).astype(jnp.float32)


def verifier_inputs(verifier, context, block, context_valid=None,
                    compute: ComputeOptions = DEFAULT_COMPUTE):
    """Verifier hidden [B, K-1, D] and logits at D_0..D_{K-2}, which judge D_1..D_{K-1}."""
    b, c = context.shape
    k = block.shape[1]
    y = jnp.concatenate([context, block], axis=1)
    pos, mask = _layout(context, context_valid, k)
    h, _ = verifier.hidden_states(y, pos, mask, compute=compute)
    h = h[:, c: c + k - 1]
    return h, verifier.logits(h, compute)


def cut_points(loss_mask, valid, context_len: int):
    """[B, T] -> bool [B, T]: where a training context ids[:p] may end, at a trained position p
    in [1, context_len] (inside a response, where a verifier judges blocks when decoding)."""
    pos = jnp.arange(loss_mask.shape[1])[None]
    return loss_mask & valid & (pos >= 1) & (pos <= context_len)


def sample_contexts(ids, loss_mask, valid, context_len: int, key):
    """One random cut point per row (see `cut_points`), its context right-aligned in
    [B, context_len]: (context, context_valid, row has a cut point)."""
    ok = cut_points(loss_mask, valid, context_len)
    score = jnp.where(ok, jax.random.uniform(key, ok.shape), -1.0)
    cut = jnp.argmax(score, axis=1)  # 0 (an empty context) for a row without a cut point
    src = jnp.arange(context_len)[None] - (context_len - cut)[:, None]  # left padding: src < 0
    context = jnp.take_along_axis(ids, jnp.maximum(src, 0), axis=1)
    return context, src >= 0, jnp.any(ok, axis=1)


# ---- training --------------------------------------------------------------------------------

class HeadExamples(NamedTuple):
    """One training batch for the head: the verifier's state at D_0..D_{K-2} (`hidden`
    [B, K-1, D], `verifier_logits` [B, K-1, V]) judging the next tokens D_1..D_{K-1}
    (`next_tokens` [B, K-1]), as decoding feeds it (decoding/mode_steps.py); `labels` [B, K-1] (1
    while D_1..D_{i+1} all match the proposer's greedy AR); `used` [B]: the row had a context
    (see `sample_contexts`)."""
    hidden: jax.Array
    verifier_logits: jax.Array
    next_tokens: jax.Array
    labels: jax.Array
    used: jax.Array


def head_examples(proposer, verifier, ids, loss_mask, valid, key, *, context_len: int,
                  block_size: int, mask_id: int,
                  compute: ComputeOptions = DEFAULT_COMPUTE) -> HeadExamples:
    """A random context per data row, the proposer's block after it and the labels: what the head
    learns from. Labels are free: they come from the frozen proposer itself."""
    ctx, ctx_valid, used = sample_contexts(ids, loss_mask, valid, context_len, key)
    block, labels = propose_and_label(proposer, ctx, block_size, mask_id, ctx_valid, compute)
    # as decoding does (mode_steps.verify_step): a token past the verifier's rows is read as 0 and
    # never committed, so a prefix through it is no target either
    verifier_block, readable = readable_tokens(block, verifier.cfg.vocab_size)
    labels = labels * jnp.cumprod(readable[:, 1:], axis=-1).astype(labels.dtype)
    hidden, verifier_logits = verifier_inputs(verifier, ctx, verifier_block, ctx_valid, compute)
    return HeadExamples(hidden, verifier_logits, verifier_block[:, 1:], labels, used)


def head_loss(head: CommitHead, ex: HeadExamples):
    """Binary cross-entropy of the head's accept logits against the labels, over the rows with
    a context. Returns (loss, accept logits [B, K-1])."""
    logits = head(ex.hidden, ex.verifier_logits, ex.next_tokens)
    weight = ex.used.astype(jnp.float32)[:, None] * jnp.ones_like(ex.labels)
    bce = optax.sigmoid_binary_cross_entropy(logits, ex.labels)
    return jnp.sum(bce * weight) / jnp.maximum(jnp.sum(weight), 1.0), logits


class HeadLayout(NamedTuple):
    """The commit-head train step's inputs without their values: graph definitions, and
    ShapeDtypeStructs with shardings of `state` ({"head", "opt_state", "step"}, replicated: a few
    KB) and `frozen` ({"proposer", "verifier"} parameters, sharded by the logical-axis rules, as
    `checkpoint.load_model(path, mesh)` reads them). All a compile or a dry run needs."""
    proposer_def: nnx.GraphDef
    verifier_def: nnx.GraphDef
    head_def: nnx.GraphDef
    state: dict
    frozen: dict


FROZEN_DTYPE = "float32"  # both frozen models run in float32: labels and features at full precision


def frozen_config(model_cfg):
    return model_cfg.replace(dtype=FROZEN_DTYPE, param_dtype=FROZEN_DTYPE)


def head_layout(proposer_cfg, verifier_cfg, tx: optax.GradientTransformation, mesh,
                seed: int = 0) -> HeadLayout:
    """The `HeadLayout` of a proposer/verifier pair on `mesh` (a real or an abstract one)."""
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    frozen, defs = {}, {}
    for name, cfg in (("proposer", proposer_cfg), ("verifier", verifier_cfg)):
        defs[name], frozen[name] = abstract_sharded(abstract_model(frozen_config(cfg)), mesh)
    head_def, head = nnx.split(
        nnx.eval_shape(lambda: CommitHead(verifier_cfg.hidden_size, rngs=nnx.Rngs(seed))))
    head = nnx.to_pure_dict(head)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                         {"head": head, "opt_state": jax.eval_shape(tx.init, head),
                          "step": jax.ShapeDtypeStruct((), jnp.int32)})
    return HeadLayout(defs["proposer"], defs["verifier"], head_def, state, frozen)


@dataclasses.dataclass(frozen=True)
class HeadStepSettings:
    """The head step's static settings (part of its compiled program)."""
    seed: int  # with the step's number, the key of its random contexts
    context_len: int  # the longest context: max_length - block_size
    block_size: int
    mask_id: int  # the proposer's `<|mask|>`
    compute: ComputeOptions  # the forwards', resolved on the host (the trace reads fields only)


def head_metrics(head: CommitHead, ex: HeadExamples, loss, logits) -> dict:
    """Over the rows with a context: the loss, exact-length accuracy, mean AR-match length and
    mean predicted length."""
    true_len = 1 + jnp.sum(ex.labels, axis=-1)
    pred_len = predicted_length(jax.nn.sigmoid(logits) >= head.threshold)
    rows = ex.used.astype(jnp.float32)

    def mean(x):
        return jnp.sum(x * rows) / jnp.maximum(jnp.sum(rows), 1.0)
    return {"loss": loss, "length_accuracy": mean(pred_len == true_len),
            "ar_match_length": mean(true_len), "predicted_length": mean(pred_len)}


def head_step(proposer_def, verifier_def, head_def, settings: HeadStepSettings,
              tx: optax.GradientTransformation, frozen: dict, state: dict,
              batch: dict) -> tuple[dict, dict]:
    """(frozen, state, batch) -> (state, metrics): one `gradient_update` of the head (the train
    step's recipe), the proposer and verifier frozen; with `frozen` bound, the train loop's
    (state, batch) step (step_loop.py). The step's random contexts come from (seed, the step's
    number, 1 for the first), so a re-sharded run draws the same ones."""
    proposer = nnx.merge(proposer_def, frozen["proposer"])
    verifier = nnx.merge(verifier_def, frozen["verifier"])
    key = jax.random.fold_in(jax.random.key(settings.seed), state["step"] + 1)
    ex = head_examples(proposer, verifier, batch["input_ids"], batch["loss_mask"], batch["valid"],
                       key, context_len=settings.context_len, block_size=settings.block_size,
                       mask_id=settings.mask_id, compute=settings.compute)

    def loss_of(params, ex):
        head = nnx.merge(head_def, params)
        loss, logits = head_loss(head, ex)
        return loss, head_metrics(head, ex, loss, logits)

    head, opt_state, _, metrics = gradient_update(loss_of, tx, state["head"], state["opt_state"],
                                                  ex)
    return {"head": head, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def jit_head_step(cfg, layout: HeadLayout, tx: optax.GradientTransformation, mesh, mask_id: int,
                  platform: str | None = None):
    """The train config's `head_step`, jitted with explicit shardings; the head's state (the
    second argument) is donated (updated in place). Its forwards' compute options are resolved
    here, on the host, for `platform` (None: this process's backend; the dry run's "tpu")."""
    settings = HeadStepSettings(seed=cfg.seed, context_len=cfg.max_length - cfg.block_size,
                                block_size=cfg.block_size, mask_id=mask_id,
                                compute=DEFAULT_COMPUTE.resolve(platform))
    step = functools.partial(head_step, layout.proposer_def, layout.verifier_def, layout.head_def,
                             settings, tx)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(step, in_shardings=(shardings_of(layout.frozen), shardings_of(layout.state),
                                       batch_shardings(mesh)),
                   out_shardings=(shardings_of(layout.state), replicated), donate_argnums=(1,))


def _require_contexts(cfg, step: int, batch: dict) -> None:
    """A batch without a single usable context would train on nothing (loss 0): say why.
    Checked on the global batch, so every host comes to the same answer."""
    context_len = cfg.max_length - cfg.block_size
    if not bool(_any_cut_point(batch["loss_mask"], batch["valid"], context_len)):
        raise TrainConfigError(
            f"commit head step {step}: no row of the batch has a trained (response) token within "
            f"its first max_length - block_size = {context_len} tokens, so no context to propose "
            f"a block after; prompts are longer than that: raise max_length (now {cfg.max_length})")


@functools.partial(jax.jit, static_argnums=2)
def _any_cut_point(loss_mask, valid, context_len: int) -> jax.Array:
    return jnp.any(cut_points(loss_mask, valid, context_len))


def head_optimizer(cfg) -> optax.GradientTransformation:
    """Adam on the train config's schedule: first update at lr / warmup, any steps /
    warmup_ratio."""
    return optax.adam(lr_schedule(cfg.optimizer, cfg.steps))


def compile_head_step(layout: HeadLayout, tx, mesh, cfg, mask_id: int, log):
    """The commit-head step compiled for the run's shapes before any weight is read, refused
    with the sizes when the devices cannot hold it (two frozen float32 models, their forwards)."""
    args = (layout.frozen, layout.state,
            abstract_batch(mesh, cfg.global_batch_size, cfg.max_length))
    return compile_checked(
        jit_head_step(cfg, layout, tx, mesh, mask_id), args, mesh, name="commit-head step", log=log,
        what=(f"a commit-head step of {cfg.global_batch_size} x {cfg.max_length} tokens (the "
              f"frozen proposer and verifier in {FROZEN_DTYPE}, their forwards, the head)"),
        advice="lower global_batch_size or max_length, or use more devices (fsdp, tensor)")


def _check_inputs(cfg):
    """(proposer config, verifier config, `<|mask|>` id, tokenizer, its directory): everything
    that can be wrong with the inputs, found before minutes of reading weights."""
    proposer_cfg = checkpoint.load_config(cfg.proposer)
    verifier_cfg = checkpoint.load_config(cfg.model.checkpoint)
    mask_id = proposer_cfg.mask_token_id
    if mask_id is None:
        raise CheckpointError(f"proposer {cfg.proposer} has no <|mask|> token: "
                              f"train it with objective=mars")
    tok_dir = cfg.tokenizer.path or cfg.model.checkpoint
    tokenizer = checkpoint.load_tokenizer(tok_dir)
    if tokenizer is None:
        raise CheckpointError(f"no tokenizer in {tok_dir}: set tokenizer.path")
    check_shared_vocabulary(tokenizer, tok_dir, [
        (name, path, model_cfg.vocab_size,
         None if os.path.abspath(path) == os.path.abspath(tok_dir)
         else checkpoint.load_tokenizer(path))
        for name, path, model_cfg in (("proposer", cfg.proposer, proposer_cfg),
                                      ("verifier", cfg.model.checkpoint, verifier_cfg))])
    return proposer_cfg, verifier_cfg, mask_id, tokenizer, tok_dir


class HeadProgress:
    """A head run's logged records: the step's scalars, to RUN_DIR/metrics.jsonl (a head run
    never resumes: its first record replaces an earlier run's; one that fails before any step
    leaves that file as it was) and, when shown, as a line on stderr (process 0)."""

    def __init__(self, run_dir: str, steps: int, show: bool):
        self.file = MetricsFile(run_dir)
        self.steps = steps
        self.show = show and distributed.is_main_process()

    def record(self, step: int, metrics: dict) -> dict:
        rec = {"step": step} | {name: float(value) for name, value in metrics.items()}
        self.file.append(rec)
        if self.show:
            print(f"commit head step {step}/{self.steps}: loss {rec['loss']:.4f}, "
                  f"exact length {rec['length_accuracy']:.2f}, "
                  f"AR-match length {rec['ar_match_length']:.2f}, "
                  f"predicted {rec['predicted_length']:.2f}", file=sys.stderr, flush=True)
        return rec


def train_commit_head(cfg, show_bar: bool = True) -> dict:
    """Train only the head from a TrainConfig with objective=commit_head, model.checkpoint =
    verifier, proposer = MARS proposer checkpoint. The step is compiled and its memory checked
    before the frozen models are read straight into their shardings (a 32B proposer is 128 GB
    in float32); the small head and its optimizer state are replicated."""
    if not cfg.proposer:
        raise TrainConfigError("objective=commit_head needs proposer=PATH "
                               "(the MARS proposer checkpoint)")
    if not cfg.model.checkpoint:
        raise TrainConfigError("objective=commit_head needs model.checkpoint=PATH (the verifier)")
    mesh = config_mesh(cfg)
    proposer_cfg, verifier_cfg, mask_id, tokenizer, tok_dir = _check_inputs(cfg)
    data = make_data_iterator(cfg, tokenizer, log_main, mesh)  # the rows its devices hold
    tx = head_optimizer(cfg)
    layout = head_layout(proposer_cfg, verifier_cfg, tx, mesh, cfg.seed)
    step = compile_head_step(layout, tx, mesh, cfg, mask_id, log_main)

    frozen = {name: nnx.to_pure_dict(nnx.state(checkpoint.load_model(
                  path, mesh=mesh, dtype=FROZEN_DTYPE, param_dtype=FROZEN_DTYPE)))
              for name, path in (("proposer", cfg.proposer), ("verifier", cfg.model.checkpoint))}
    head = CommitHead(verifier_cfg.hidden_size, rngs=nnx.Rngs(cfg.seed))
    params = nnx.to_pure_dict(nnx.state(head))
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.device_put({"head": params, "opt_state": tx.init(params),
                            "step": jnp.zeros((), jnp.int32)}, everywhere)

    # a head run never resumes and saves nothing but the final export
    progress = HeadProgress(cfg.run_dir, cfg.steps, show_bar)
    steps = Steps(functools.partial(step, frozen), data, mesh, progress.record,
                  log_every=cfg.log_every, log_first=False,
                  check_batch=functools.partial(_require_contexts, cfg))
    state, records, _ = run_steps(steps, state, 0, cfg.steps, Goodput(), log_main)
    out = os.path.join(cfg.run_dir, "model")
    export_model(out, layout.verifier_def, frozen["verifier"], frozen_config(verifier_cfg), tok_dir)
    save_commit_head(out, nnx.merge(layout.head_def, state["head"]))
    log_main(f"exported verifier + commit head to {out}")
    return {"records": records, "model_dir": out, "final_step": cfg.steps}
