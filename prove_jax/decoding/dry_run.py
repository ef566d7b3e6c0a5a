"""--dry-run for decoding: the whole decode program compiled for a TPU slice from this CPU.

What is compiled is what `prove-jax generate` runs, through the same `Decoder.lower`: prefill,
the `while_loop` with queue refill, and in verify mode the verifier. The weights are abstract
(`ShapeDtypeStruct`s placed by the sharding rules on the slice's devices, which libtpu
describes without a chip attached), so a 32B proposer is never allocated. The mesh is the one
`generate` would pick on that slice (`sharding.inference_tensor_size`: tensor parallel over the
proposer's kv heads as far as the weights need, data over the rest). XLA's compile then reports
per-chip memory and holds the collectives its partitioner chose (`prove_jax.aot`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from prove_jax import aot
from prove_jax.decoding.adaptive import ADAPTIVE_TABLES, adapt_for_batch
from prove_jax.decoding.engine import Decoder
from prove_jax.decoding.options import PREFILL_CHUNK_ACCELERATOR, DecodeError, DecodeOptions
from prove_jax.models import sharding
from prove_jax.models.config import ModelConfig
from prove_jax.models.params import abstract_model
from prove_jax.models.qwen2 import Qwen2, stack_layers

AXES = sharding.MESH_AXES
DEFAULT_NEW_TOKENS = 512
DOES_NOT_FIT_ADVICE = "a smaller batch, a shorter context, or a larger slice"


@dataclasses.dataclass
class DecodeDryRun:
    """One compile of the decode program for a TPU slice, and what XLA reported."""
    chip: str
    chips: int
    topology: str
    mesh: dict
    options: DecodeOptions
    batch: int
    prompt_tokens: int
    new_tokens: int
    proposer_params: int
    verifier_params: int
    weight_bytes: int
    """Per chip: the proposer's and the verifier's weights as placed (from shard shapes)."""
    hbm_bytes: int
    stats: aot.CompiledStats | None = None
    does_not_fit: str = ""
    """XLA's refusal (the program needs more memory than a chip has), when it refused."""
    rows: int = 0
    """Rows the program decodes: the batch rounded up to whole shards (`Decoder.rows`)."""

    @property
    def context(self) -> int:
        return self.prompt_tokens + self.new_tokens

    @property
    def fits(self) -> bool:
        return self.stats is not None and self.stats.peak_bytes <= self.hbm_bytes

    def describe(self) -> str:
        o = self.options
        gib = aot.GIB
        layout = f"K={o.block_size}" + (
            f", {o.lossless.max_groups} groups"
            if o.mode == "lossless" and o.lossless.max_groups else ""
        )
        rows = [
            f"decode dry run: {o.mode} ({layout}), proposer {self.proposer_params / 1e9:.1f}B"
            + (f" + verifier {self.verifier_params / 1e9:.1f}B" if self.verifier_params else "")
            + f", batch {self.batch}"
            + (f" ({self.rows} rows)" if self.rows not in (0, self.batch) else "")
            + f", {self.prompt_tokens} prompt + {self.new_tokens} new tokens, "
            f"layers {'scanned' if o.memory.scan_layers else 'unrolled'}, "
            f"attention {o.compute.attention}",
            f"on {self.topology} ({self.chips} x {self.chip}, {self.hbm_bytes / gib:g} GiB each), "
            f"mesh {self.mesh}; weights {self.weight_bytes / gib:.2f} GiB per chip",
        ]
        if self.stats is None:
            rows.append(f"DOES NOT FIT: {self.does_not_fit}")
            return "\n".join(rows)
        s = self.stats
        rows += [
            f"compiled in {s.compile_seconds:.1f} s; XLA's per-chip memory: arguments "
            f"{s.argument_bytes / gib:.2f} GiB, temporaries {s.temp_bytes / gib:.2f} GiB, peak "
            f"{s.peak_bytes / gib:.2f} GiB of {self.hbm_bytes / gib:g} "
            f"({100 * s.peak_bytes / self.hbm_bytes:.0f}%): "
            f"{'FITS' if self.fits else 'DOES NOT FIT'}",
            "collectives (count, result bytes): "
            + (
                ", ".join(
                    f"{kind} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)"
                    for kind, v in s.collectives.items()
                    if v["count"]
                )
                or "none"
            ),
        ]
        return "\n".join(rows)

    def record(self) -> dict:
        """A JSON-ready row."""
        o = self.options
        out = dict(
            chip=self.chip,
            chips=self.chips,
            topology=self.topology,
            mesh=self.mesh,
            mode=o.mode,
            block_size=o.block_size,
            groups=o.lossless.max_groups,
            scan_layers=o.memory.scan_layers,
            attention=o.compute.attention,
            batch=self.batch,
            rows=self.rows,
            prompt_tokens=self.prompt_tokens,
            new_tokens=self.new_tokens,
            context=self.context,
            proposer_params=self.proposer_params,
            verifier_params=self.verifier_params,
            weight_bytes=self.weight_bytes,
            hbm_bytes=self.hbm_bytes,
            fits=self.fits,
            does_not_fit=self.does_not_fit,
        )
        if self.stats is not None:
            out.update(dataclasses.asdict(self.stats), peak_bytes=self.stats.peak_bytes)
        return out


def slice_options(options: DecodeOptions) -> DecodeOptions:
    """`options` as a TPU runs them: compiled for the platform, accelerator matmuls and prefill
    chunks (the defaults would be this CPU's)."""
    return dataclasses.replace(
        options,
        compute=options.compute.resolve("tpu"),
        memory=dataclasses.replace(
            options.memory,
            prefill_chunk=options.memory.prefill_chunk or PREFILL_CHUNK_ACCELERATOR),
    ).validate()


def mesh_shape(configs: list[ModelConfig], dtype: str, chips: int, hbm_bytes: int,
               kv_bytes: int = 0) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of the inference mesh `generate` picks for these models on the slice
    (with `kv_bytes`: for a KV cache that large, `sharding.kv_cache_bytes`)."""
    weight_bytes = sum(c.num_params for c in configs) * jnp.dtype(dtype).itemsize
    try:
        tensor = sharding.inference_tensor_size(
            configs[0].num_kv_heads, chips, weight_bytes, hbm_bytes, kv_bytes=kv_bytes
        )
    except sharding.MeshError as e:
        raise DecodeError(str(e)) from None
    return chips // tensor, 1, tensor


def abstract_on_mesh(cfg: ModelConfig, mesh, scan_layers: bool):
    """The model with `ShapeDtypeStruct` weights placed on `mesh` by the sharding rules (stacked
    for a scanned program, as the Decoder would stack them)."""
    model = (nnx.eval_shape(lambda: stack_layers(Qwen2(cfg, nnx.Rngs(0)))) if scan_layers
             else abstract_model(cfg))
    graphdef, state = nnx.split(model)
    placed = sharding.state_shardings(state, mesh)
    state = jax.tree.map(
        lambda v, s: v.replace(
            jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype, sharding=s)
        ),
        state,
        placed,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return nnx.merge(graphdef, state)


def _bytes_per_chip(model, mesh) -> int:
    state = nnx.state(model)
    total = 0
    for leaf in jax.tree.leaves(state):
        shard = sharding.shard_shape(leaf.shape, leaf.sharding.spec, dict(mesh.shape))
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


@dataclasses.dataclass(frozen=True)
class SliceRun:
    """One decode setting on a TPU slice, as the dry run and the step report compile it: the
    models (configs only: the weights are abstract), the options, the slice (`chips` `chip`s),
    and the request shape (`batch` rows, each a prompt of `context - new_tokens` tokens and
    `new_tokens` to generate), in `dtype`."""

    proposer: ModelConfig
    options: DecodeOptions
    chip: str
    chips: int
    batch: int
    context: int
    new_tokens: int = DEFAULT_NEW_TOKENS
    verifier: ModelConfig | None = None
    dtype: str = "bfloat16"


def dry_run_decode(run: SliceRun, prompt_lengths: list[int] | None = None) -> DecodeDryRun:
    """Compile the decode program of `run` (needs libtpu). With `prompt_lengths`, its `batch`
    rows serve a queue of prompts of those lengths instead (each below `context`). A program
    XLA refuses for lack of memory comes back as a report with `does_not_fit` set."""
    report, decoder, prompt = _on_slice(run)
    batch = run.batch
    prompts = (
        [prompt] * batch if prompt_lengths is None else [prompt[:1] * n for n in prompt_lengths]
    )
    lowered = decoder.lower(prompts, run.new_tokens, batch_size=batch)
    report.rows = decoder.rows(batch, batch)
    report.options = adapt_for_batch(report.options, report.rows, table=ADAPTIVE_TABLES["tpu"])
    try:
        report.stats = aot.compile_stats(lowered, report.topology, what="the decode program",
                                         advice=DOES_NOT_FIT_ADVICE)
    except aot.DoesNotFit as e:
        report.does_not_fit = str(e)
    return report


def _on_slice(run: SliceRun):
    """(a report without compile stats, the Decoder `generate` would build on the slice with
    abstract weights, one prompt of `context - new_tokens` tokens), after checking the request."""
    proposer, options, verifier, dtype = run.proposer, run.options, run.verifier, run.dtype
    chip, chips, batch, context, new_tokens = (run.chip, run.chips, run.batch, run.context,
                                               run.new_tokens)
    if not aot.libtpu_available():
        raise DecodeError('the decode dry run compiles for a TPU slice and needs libtpu: '
                          'pip install "libtpu==0.0.42.*" (docs/environment.md)')
    if not 0 < new_tokens < context:
        raise DecodeError(
            f"new tokens ({new_tokens}) must be between 0 and the context ({context})"
        )
    if batch < 1:
        raise DecodeError(f"batch must be >= 1, got {batch}")
    options = slice_options(options)
    if options.mode == "verify" and verifier is None:
        raise DecodeError("mode 'verify' needs a verifier config")
    proposer = proposer.replace(dtype=dtype, param_dtype=dtype)
    configs = [proposer] + (
        [verifier.replace(dtype=dtype, param_dtype=dtype)] if options.mode == "verify" else []
    )
    hbm = aot.chip_hbm_bytes(chip)
    try:
        axis_sizes = mesh_shape(
            configs, dtype, chips, hbm, sharding.kv_cache_bytes(configs, batch, context, dtype)
        )
        mesh, topology = aot.topology_mesh(chip, axis_sizes, AXES)
    except ValueError as e:  # a chip count the generation does not come in, an unknown chip
        raise DecodeError(str(e)) from None
    models = [abstract_on_mesh(c, mesh, options.memory.scan_layers) for c in configs]
    decoder = Decoder(models[0], list(proposer.eos_token_ids) or [0], options,
                      verifier=models[1] if len(models) > 1 else None, mesh=mesh,
                      pad_id=proposer.pad_token_id or 0, adaptive_table=ADAPTIVE_TABLES["tpu"])
    prompt = [min(3, proposer.vocab_size - 1)] * (context - new_tokens)
    report = DecodeDryRun(
        chip=chip,
        chips=chips,
        topology=topology,
        mesh=dict(zip(AXES, axis_sizes)),
        options=options,
        batch=batch,
        prompt_tokens=len(prompt),
        new_tokens=new_tokens,
        proposer_params=proposer.num_params,
        verifier_params=configs[1].num_params if len(configs) > 1 else 0,
        weight_bytes=sum(_bytes_per_chip(m, mesh) for m in models),
        hbm_bytes=hbm,
    )
    return report, decoder, prompt
