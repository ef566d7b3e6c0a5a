"""--dry-run: check that a config's train step fits its target chips, from this CPU.

The model, optimizer state and batch are built as ShapeDtypeStructs on an AbstractMesh of the
configured size (e.g. 256 v5p chips as (1, 64, 4)), the real jitted train step is traced and
lowered for TPU (`.trace(...).lower(lowering_platforms=("tpu",))`), which proves the shardings
are consistent, and nothing is allocated. Memory per device is then counted:

- parameters, gradients (with grad_accum > 1 also their float32 running sum) and optimizer
  state: exact, from each array's shard shape;
- activations: an estimate of what the backward pass keeps (per-layer inputs with remat, every
  intermediate without), the attention scores/probabilities of one layer, and the float32
  logits with their gradient. XLA's own temporaries and fragmentation are not counted, so the
  verdict keeps 10% of HBM free.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from prove_jax import params as params_lib
from prove_jax.config import ModelConfig, preset
from prove_jax.optim import make_optimizer
from prove_jax.sharding import MESH_AXES, logical_to_spec, shard_shape
from prove_jax.train_config import TrainConfig
from prove_jax.train_step import (abstract_batch, accumulator_dtype, build_step_fn, jit_step,
                                  make_loss_fn, state_layout)

GIB = 1024 ** 3
CHIP_HBM_GIB = {"v5p": 95, "v5e": 16, "v4": 32, "v6e": 32, "H100": 80, "H200": 141}
HEADROOM = 0.9  # fraction of HBM the estimate may use


class DryRunError(ValueError):
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

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.opt_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= HEADROOM * self.hbm_bytes

    def describe(self) -> str:
        g = lambda b: f"{b / GIB:8.2f} GiB"
        rows = [
            f"dry run: {self.model_params / 1e9:.2f}B-parameter model, mesh {self.mesh} "
            f"({self.devices} x {self.chip}, {self.hbm_bytes / GIB:.0f} GiB HBM each)",
            f"train step lowered for TPU: {'ok' if self.lowered else 'FAILED'} "
            f"({self.lower_seconds:.1f} s); per device {self.micro_batch_per_device} sequence(s) "
            f"x {self.streamed_length} positions per micro-batch",
            "per-device memory:",
            f"  parameters   {g(self.param_bytes)}",
            f"  gradients    {g(self.grad_bytes)}",
            f"  optimizer    {g(self.opt_bytes)}",
            f"  activations  {g(self.activation_bytes)}  (estimate)",
            f"  total        {g(self.total_bytes)}  of {self.hbm_bytes / GIB:.0f} GiB "
            f"({100 * self.total_bytes / self.hbm_bytes:.0f}%)",
            ("FITS" if self.fits else "DOES NOT FIT")
            + f": the estimate {'stays within' if self.fits else 'exceeds'} "
            f"{int(100 * HEADROOM)}% of {self.chip} HBM",
        ]
        return "\n".join(rows)


def chip_hbm_bytes(chip: str) -> int:
    for name, gib in CHIP_HBM_GIB.items():
        if name.lower() == chip.lower():
            return gib * GIB
    raise DryRunError(f"unknown chip {chip!r}; known: {', '.join(CHIP_HBM_GIB)}")


def _model_config_for(cfg: TrainConfig) -> ModelConfig:
    """Shapes only: the weights (often an HF dir on another machine) are never read."""
    import os

    from prove_jax.trainer import source_model_config
    src = cfg.model
    if src.shape_preset and not (src.hf_dir and os.path.isdir(src.hf_dir)) \
            and not (src.checkpoint and os.path.isdir(src.checkpoint)):
        model_cfg = preset(src.shape_preset)
        changes = {k: v for k, v in (("dtype", src.dtype), ("param_dtype", src.param_dtype)) if v}
        model_cfg = model_cfg.replace(**changes)
    else:
        model_cfg = source_model_config(cfg)
    if model_cfg.mask_token_id is None and cfg.objective == "mars":
        model_cfg = model_cfg.replace(mask_token_id=model_cfg.vocab_size - 1)  # shape-neutral
    return model_cfg


def _shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with NamedShardings."""
    return sum(math.prod(shard_shape(leaf.shape, leaf.sharding.spec, leaf.sharding.mesh.shape))
               * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def activation_bytes(m: ModelConfig, rows: int, length: int, tensor: int, remat: bool) -> int:
    """Estimated bytes kept for the backward pass of one micro-batch (`rows` sequences) on one
    device, the heads/MLP/vocab dimensions split as the sharding rules split them over a tensor
    axis of this size (whole where the rules replicate them)."""
    db = np.dtype(m.dtype if m.dtype != "bfloat16" else np.float16).itemsize
    d, dh = m.hidden_size, m.head_dim
    tok = rows * length
    mesh = AbstractMesh((tensor,), ("tensor",), axis_types=(AxisType.Auto,))

    def per_device(logical_axis: str, n: int) -> int:
        return shard_shape((n,), logical_to_spec((logical_axis,), (n,), mesh), mesh.shape)[0]
    h, k = per_device("heads", m.num_heads), per_device("kv_heads", m.num_kv_heads)
    f, v = per_device("mlp", m.intermediate_size), per_device("vocab", m.vocab_size)
    per_layer_linear = tok * db * (4 * d + 2 * h * dh + 2 * k * dh + 3 * f)
    attn = rows * h * length * length * (4 + db)  # f32 scores + probs
    per_layer = per_layer_linear + attn
    mask = rows * length * length  # bool attention mask, shared by layers
    logits = 3 * tok * v * 4  # f32 logits, softmax, grad
    kept = m.num_layers * tok * d * db + per_layer if remat else m.num_layers * per_layer
    return int(kept + mask + logits)


def dry_run(cfg: TrainConfig, chip: str | None = None) -> DryRunReport:
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
    model_cfg = _model_config_for(cfg)
    tx = make_optimizer(cfg.optimizer, cfg.steps)
    length = cfg.max_length
    with jax.sharding.use_abstract_mesh(mesh):
        layout = state_layout(params_lib.abstract_model(model_cfg, cfg.model.remat), tx, mesh)
        loss_fn = make_loss_fn(cfg.objective, block_size=cfg.block_size,
                               mask_token_id=model_cfg.mask_token_id, ar_weight=cfg.ar_weight)
        step = jit_step(build_step_fn(layout.graphdef, tx, loss_fn, cfg.optimizer.grad_accum),
                        layout, mesh)
        t0 = time.perf_counter()
        step.trace(layout.abstract, abstract_batch(mesh, cfg.global_batch_size, length)) \
            .lower(lowering_platforms=("tpu",))
        seconds = time.perf_counter() - t0
    streamed = length * (2 if cfg.objective == "mars" else 1)
    params_b = _shard_bytes(layout.abstract["params"])
    grads_b = params_b  # one micro-batch's gradients, in the parameters' dtype and sharding
    if cfg.optimizer.grad_accum > 1:  # plus their running sum across the micro-batch scan
        grads_b += _shard_bytes(jax.tree.map(
            lambda p: jax.ShapeDtypeStruct(p.shape, accumulator_dtype(p.dtype), sharding=p.sharding),
            layout.abstract["params"]))
    return DryRunReport(
        chip=chip, hbm_bytes=hbm, mesh=dict(zip(MESH_AXES, axis_sizes)),
        devices=math.prod(axis_sizes), model_params=model_cfg.num_params,
        param_bytes=params_b, grad_bytes=grads_b,
        opt_bytes=_shard_bytes(layout.abstract["opt_state"]),
        activation_bytes=activation_bytes(model_cfg, micro // dp, streamed, axis_sizes[2],
                                          cfg.model.remat),
        lowered=True, lower_seconds=seconds, micro_batch_per_device=micro // dp,
        streamed_length=streamed)
