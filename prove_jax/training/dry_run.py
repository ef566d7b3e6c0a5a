"""--dry-run: check that a config's train step fits its target chips, from this CPU.

The real jitted step is traced and lowered for TPU on an AbstractMesh of the configured size
(which proves the shardings consistent) with nothing allocated. Parameters, gradients and
optimizer state are counted exactly from their shard shapes; activations are estimated (XLA's
temporaries are not counted, hence the 10% HBM headroom). objective=commit_head counts the
frozen proposer and verifier, their forwards and the small head instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from prove_jax.errors import ProveJaxError
from prove_jax.models.config import PRESETS, ModelConfig, preset
from prove_jax.models.remat import remat_name
from prove_jax.models.sharding import MESH_AXES, logical_to_spec, shard_shape
from prove_jax import aot
from prove_jax.checkpoints.checkpoint import load_config
from prove_jax.training.commit_head_training import (FROZEN_DTYPE, frozen_config, head_layout,
                                                     head_optimizer, jit_head_step)
from prove_jax.training.config import TrainConfig
from prove_jax.training.model_source import source_model_config, with_run_dtypes
from prove_jax.training.step import abstract_batch, accumulator_dtype, configured_step

GIB = aot.GIB
CHIP_HBM_GIB = aot.CHIP_HBM_GIB
chip_hbm_bytes = aot.chip_hbm_bytes
HEADROOM = 0.9  # fraction of HBM the estimate may use


class DryRunError(ProveJaxError, ValueError):
    """A dry run that cannot be set up (unknown chip, mesh with -1, no model shapes)."""


@dataclasses.dataclass
class DryRunReport:
    chip: str
    hbm_bytes: int
    mesh: dict
    devices: int
    model_params: int
    param_bytes: int
    grad_bytes: int
    opt_bytes: int
    activation_bytes: int
    lowered: bool
    lower_seconds: float
    micro_batch_per_device: int
    streamed_length: int
    compiled: "aot.CompiledStats | None" = None  # the real compile for the slice (libtpu)
    compile_note: str = ""  # why there is no real compile
    frozen_bytes: int = 0  # commit_head: the frozen proposer and verifier
    subject: str = ""  # what is trained, for the first line (default: the model's size)
    step_name: str = "train step"
    forward: str = ""  # how the layers run: remat policy, scanned or unrolled

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.opt_bytes + self.activation_bytes
                + self.frozen_bytes)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= HEADROOM * self.hbm_bytes

    def describe(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GIB:8.2f} GiB"
        subject = self.subject or f"{self.model_params / 1e9:.2f}B-parameter model"
        rows = [
            f"dry run: {subject}, mesh {self.mesh} "
            f"({self.devices} x {self.chip}, {self.hbm_bytes / GIB:.0f} GiB HBM each)",
            f"{self.step_name} lowered for TPU: {'ok' if self.lowered else 'FAILED'} "
            f"({self.lower_seconds:.1f} s); per device {self.micro_batch_per_device} sequence(s) "
            f"x {self.streamed_length} positions per micro-batch"
            + (f"; {self.forward}" if self.forward else ""),
            "per-device memory:",
        ] + ([f"  frozen models{gib(self.frozen_bytes)}  (proposer and verifier)"]
             if self.frozen_bytes else []) + [
            f"  parameters   {gib(self.param_bytes)}"
            + ("  (the head)" if self.frozen_bytes else ""),
            f"  gradients    {gib(self.grad_bytes)}",
            f"  optimizer    {gib(self.opt_bytes)}",
            f"  activations  {gib(self.activation_bytes)}  (estimate"
            + (", forward only" if self.frozen_bytes else "") + ")",
            f"  total        {gib(self.total_bytes)}  of {self.hbm_bytes / GIB:.0f} GiB "
            f"({100 * self.total_bytes / self.hbm_bytes:.0f}%)",
            ("FITS" if self.fits else "DOES NOT FIT")
            + f": the estimate {'stays within' if self.fits else 'exceeds'} "
            f"{int(100 * HEADROOM)}% of {self.chip} HBM",
        ]
        c = self.compiled
        if c is None:
            rows.append(f"no compile for the slice: {self.compile_note}")
            return "\n".join(rows)
        rows += [
            f"compiled for {c.topology} in {c.compile_seconds:.1f} s; XLA's per-chip memory:",
            f"  arguments    {gib(c.argument_bytes)}",
            f"  temporaries  {gib(c.temp_bytes)}",
            f"  peak         {gib(c.peak_bytes)}  of {self.hbm_bytes / GIB:.0f} GiB "
            f"({100 * c.peak_bytes / self.hbm_bytes:.0f}%): "
            + ("FITS" if self.compiled_fits else "DOES NOT FIT"),
            "collectives (count, result bytes): " + ", ".join(
                f"{kind} {v['count']} ({v['bytes'] / GIB:.2f} GiB)"
                for kind, v in c.collectives.items() if v["count"]),
        ]
        return "\n".join(rows)

    @property
    def compiled_fits(self) -> bool | None:
        """The compiled program's peak within the chip's HBM (None without a compile)."""
        return None if self.compiled is None else self.compiled.peak_bytes <= self.hbm_bytes


def _model_config_for(cfg: TrainConfig) -> ModelConfig:
    """Shapes only: the weights (often an HF dir on another machine) are never read."""
    src = cfg.model
    if src.shape_preset and not (src.hf_dir and os.path.isdir(src.hf_dir)) \
            and not (src.checkpoint and os.path.isdir(src.checkpoint)):
        model_cfg = with_run_dtypes(preset(src.shape_preset), src)
    else:
        model_cfg = source_model_config(cfg)
    if model_cfg.mask_token_id is None and cfg.objective == "mars":
        model_cfg = model_cfg.replace(mask_token_id=model_cfg.vocab_size - 1)  # shape-neutral
    return model_cfg


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with NamedShardings."""
    return sum(math.prod(shard_shape(leaf.shape, leaf.sharding.spec, leaf.sharding.mesh.shape))
               * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def _layer_bytes(m: ModelConfig, rows: int, length: int, tensor: int,
                 remat: str = "none") -> tuple[int, int, int, int, int]:
    """(one decoder layer's intermediates, the bool attention mask, the vocab dimension, bytes of
    an activation element, what the remat policy keeps of one layer) for `rows` sequences of
    `length` on one device, the heads/MLP/vocab dimensions split as the sharding rules split
    them over a tensor axis of this size (whole where the rules replicate them)."""
    elem_bytes = np.dtype(m.dtype if m.dtype != "bfloat16" else np.float16).itemsize
    hidden, head_dim = m.hidden_size, m.head_dim
    tokens = rows * length
    mesh = AbstractMesh((tensor,), ("tensor",), axis_types=(AxisType.Auto,))

    def per_device(logical_axis: str, n: int) -> int:
        return shard_shape((n,), logical_to_spec((logical_axis,), (n,), mesh), mesh.shape)[0]
    heads, kv_heads = per_device("heads", m.num_heads), per_device("kv_heads", m.num_kv_heads)
    mlp, vocab = per_device("mlp", m.intermediate_size), per_device("vocab", m.vocab_size)
    per_layer_linear = tokens * elem_bytes * (4 * hidden + 2 * heads * head_dim
                                              + 2 * kv_heads * head_dim + 3 * mlp)
    attn = rows * heads * length * length * (4 + elem_bytes)  # f32 scores + probs
    attn_proj = (heads + 2 * kv_heads) * head_dim + hidden  # q, k, v, o
    kept = tokens * elem_bytes * (hidden + {  # the layer's input, and what the policy saves
        "none": 0, "full": 0, "attn_proj": attn_proj, "dots": attn_proj + 2 * mlp + hidden,
    }[remat])
    return per_layer_linear + attn, rows * length * length, vocab, elem_bytes, kept


def activation_bytes(m: ModelConfig, rows: int, length: int, tensor: int, remat: str | bool) -> int:
    """Estimated bytes kept for the backward pass of one micro-batch (`rows` sequences) on one
    device (see `_layer_bytes` for the tensor split) under remat policy `remat`
    (models/remat.py; true/false: full/none): without remat every layer's intermediates, with
    it what the policy saves of each layer plus one layer's intermediates, recomputed."""
    remat = remat_name(remat)
    per_layer, mask, vocab, elem_bytes, kept_per_layer = _layer_bytes(m, rows, length, tensor,
                                                                      remat)
    tokens = rows * length
    logits = 3 * tokens * vocab * 4  # f32 logits, softmax, grad
    kept = (m.num_layers * per_layer if remat == "none"
            else m.num_layers * kept_per_layer + per_layer)
    return int(kept + mask + logits)


def forward_activation_bytes(m: ModelConfig, rows: int, length: int, tensor: int,
                             logit_positions: int) -> int:
    """Estimated peak bytes of a forward pass with nothing kept for a backward one (a frozen
    model): one layer's intermediates at a time, the residual stream in and out, the mask, and
    float32 logits with their log-softmax at `logit_positions` per row."""
    per_layer, mask, vocab, elem_bytes, _ = _layer_bytes(m, rows, length, tensor)
    residual = 2 * rows * length * m.hidden_size * elem_bytes
    return int(per_layer + residual + mask + 2 * rows * logit_positions * vocab * 4)


def _abstract_mesh(cfg: TrainConfig, chip: str | None):
    """(chip, its HBM bytes, mesh axis sizes, AbstractMesh, data x fsdp, rows per micro-batch)
    of a dry run, or an error naming what is missing."""
    chip = chip or cfg.target_chip
    if chip is None:
        raise DryRunError(f"no target chip: set target_chip in the config or pass --chip "
                          f"({', '.join(CHIP_HBM_GIB)})")
    hbm = chip_hbm_bytes(chip)
    if any(int(s) <= 0 for s in cfg.mesh):
        raise DryRunError(f"--dry-run needs an explicit mesh size (no -1), got mesh={cfg.mesh}")
    axis_sizes = tuple(int(s) for s in cfg.mesh)
    mesh = AbstractMesh(axis_sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    dp = axis_sizes[0] * axis_sizes[1]
    micro = cfg.global_batch_size // cfg.optimizer.grad_accum
    if micro % dp:
        raise DryRunError(f"global_batch_size / grad_accum = {micro} is not a multiple of "
                          f"data x fsdp = {dp}")
    return chip, hbm, axis_sizes, mesh, dp, micro


def _lowered_train_step(cfg: TrainConfig, model_cfg: ModelConfig, mesh):
    """(train state layout, the step lowered for TPU with shardings on `mesh`)."""
    _, layout, step = configured_step(cfg, model_cfg, mesh, platform="tpu")
    batch = abstract_batch(mesh, cfg.global_batch_size, cfg.max_length, packed=cfg.pack_documents)
    return layout, step.trace(layout.abstract, batch).lower(lowering_platforms=("tpu",))


def _slice_mesh(chip: str, axis_sizes):
    """(the chip's TPU slice of this mesh size as a Mesh, its topology name, "") from libtpu, or
    (None, None, why there is none)."""
    if not aot.libtpu_available():
        return None, None, ("libtpu is not installed (pip install libtpu; see "
                            "docs/environment.md): the estimate only")
    if chip.lower() not in aot.TPU_TOPOLOGIES:
        return None, None, f"{chip} is not a TPU: the estimate only"
    try:
        mesh, name = aot.topology_mesh(chip, axis_sizes, MESH_AXES)
    except ValueError as e:
        return None, None, f"{e}: the estimate only"
    return mesh, name, ""


def dry_run(cfg: TrainConfig, chip: str | None = None, compile: bool = True) -> DryRunReport:
    """The memory report of the config's train step (objective=commit_head: of the commit
    head's, see `dry_run_commit_head`); with `compile` and libtpu, also the real compile for
    the chip's slice."""
    if cfg.objective == "commit_head":
        return dry_run_commit_head(cfg, chip)
    chip, hbm, axis_sizes, mesh, dp, micro = _abstract_mesh(cfg, chip)
    model_cfg = _model_config_for(cfg)
    length = cfg.max_length
    # with libtpu the step is lowered once, on the real slice's mesh, and compiled there
    slice_mesh, topology, note = (_slice_mesh(chip, axis_sizes) if compile
                                  else (None, None, "not asked for"))
    target = mesh if slice_mesh is None else slice_mesh
    # abstract: nothing is placed on (or runs on) the slice's devices
    with jax.sharding.use_abstract_mesh(mesh if slice_mesh is None else slice_mesh.abstract_mesh):
        t0 = time.perf_counter()
        layout, lowered = _lowered_train_step(cfg, model_cfg, target)
        seconds = time.perf_counter() - t0
        compiled = None if slice_mesh is None else aot.compile_stats(lowered, topology)
    streamed = length * (2 if cfg.objective == "mars" else 1)
    params_b = _shard_bytes(layout.abstract["params"])
    grads_b = params_b  # one micro-batch's gradients, in the parameters' dtype and sharding
    if cfg.optimizer.grad_accum > 1:  # plus their running sum across the micro-batch scan
        grads_b += _shard_bytes(jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, accumulator_dtype(p.dtype),
                                           sharding=p.sharding),
            layout.abstract["params"]))
    return DryRunReport(
        chip=chip, hbm_bytes=hbm, mesh=dict(zip(MESH_AXES, axis_sizes)),
        devices=math.prod(axis_sizes), model_params=model_cfg.num_params,
        param_bytes=params_b, grad_bytes=grads_b,
        opt_bytes=_shard_bytes(layout.abstract["opt_state"]),
        activation_bytes=activation_bytes(model_cfg, micro // dp, streamed, axis_sizes[2],
                                          cfg.model.remat),
        lowered=True, lower_seconds=seconds, micro_batch_per_device=micro // dp,
        streamed_length=streamed, compiled=compiled, compile_note=note,
        forward=(f"remat {cfg.model.remat}, "
                 f"{model_cfg.num_layers} layers "
                 f"{'scanned' if cfg.model.scan_layers else 'unrolled'}"))


def _proposer_config_for(cfg: TrainConfig) -> ModelConfig:
    """The commit head's proposer shapes: its checkpoint's config when it is on this machine,
    else `proposer_shape_preset`."""
    if cfg.proposer and os.path.isdir(cfg.proposer):
        return load_config(cfg.proposer)
    if not cfg.proposer_shape_preset:
        where = (f"the proposer checkpoint {cfg.proposer} is not on this machine" if cfg.proposer
                 else "no proposer=PATH given")
        raise DryRunError(f"{where}: set proposer_shape_preset to a preset with its shapes "
                          f"({', '.join(PRESETS)})")
    model_cfg = preset(cfg.proposer_shape_preset)
    if model_cfg.mask_token_id is None:  # shape-neutral: the trained proposer has one
        model_cfg = model_cfg.replace(mask_token_id=model_cfg.vocab_size - 1)
    return model_cfg


def dry_run_commit_head(cfg: TrainConfig, chip: str | None = None) -> DryRunReport:
    """The commit head's step (two forwards of the frozen proposer and one of the frozen
    verifier, both float32, and the small head's update), lowered for TPU on an abstract
    mesh: the frozen models are counted exactly from their shards, the forwards estimated."""
    chip, hbm, axis_sizes, mesh, dp, micro = _abstract_mesh(cfg, chip)
    proposer_cfg, verifier_cfg = _proposer_config_for(cfg), _model_config_for(cfg)
    tx = head_optimizer(cfg)
    with jax.sharding.use_abstract_mesh(mesh):
        layout = head_layout(proposer_cfg, verifier_cfg, tx, mesh, cfg.seed)
        step = jit_head_step(cfg, layout, tx, mesh, proposer_cfg.mask_token_id, platform="tpu")
        t0 = time.perf_counter()
        batch = abstract_batch(mesh, cfg.global_batch_size, cfg.max_length)
        step.trace(layout.frozen, layout.state, batch).lower(lowering_platforms=("tpu",))
        seconds = time.perf_counter() - t0
    rows, k = cfg.global_batch_size // dp, cfg.block_size
    head_b = _shard_bytes(layout.state["head"])
    # the proposer's second forward is the longer one: [context, block], max_length positions
    activations = max(forward_activation_bytes(frozen_config(proposer_cfg), rows, cfg.max_length,
                                               axis_sizes[2], k),
                      forward_activation_bytes(frozen_config(verifier_cfg), rows, cfg.max_length,
                                               axis_sizes[2], k - 1))
    return DryRunReport(
        chip=chip, hbm_bytes=hbm, mesh=dict(zip(MESH_AXES, axis_sizes)),
        devices=math.prod(axis_sizes),
        model_params=proposer_cfg.num_params + verifier_cfg.num_params,
        param_bytes=head_b, grad_bytes=head_b, opt_bytes=_shard_bytes(layout.state["opt_state"]),
        activation_bytes=activations, lowered=True, lower_seconds=seconds,
        micro_batch_per_device=rows, streamed_length=cfg.max_length,
        frozen_bytes=_shard_bytes(layout.frozen),
        subject=(f"commit head on a {proposer_cfg.num_params / 1e9:.2f}B proposer and a "
                 f"{verifier_cfg.num_params / 1e9:.2f}B verifier (frozen, {FROZEN_DTYPE})"),
        step_name="commit-head step")
