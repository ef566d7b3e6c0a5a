"""The models a benchmark run shares: loaded once (`decoding.loading.load_models`), then one
`Decoder` per setting over the same weights."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from prove_jax.decoding import DecodeOptions, Decoder
from prove_jax.decoding.loading import LoadedModels, load_models
from prove_jax.evaluation.progress import log
from prove_jax.evaluation.sweep import BenchError
from prove_jax.models.commit_head import HEAD_DIR
from prove_jax.models.config import preset
from prove_jax.models.inflate import inflate


@dataclasses.dataclass(kw_only=True)
class ModelPair(LoadedModels):
    """The loaded proposer (+ verifier, + commit head) shared by every Decoder of a run, and the
    checkpoints they came from."""
    proposer_path: str
    verifier_path: str | None
    source_params: int | None = None
    """The proposer's parameters before `inflate_to` (None when it runs as stored)."""

    def decoder(self, options: DecodeOptions) -> Decoder:
        return Decoder(self.proposer, self.eos_ids, options,
                       verifier=self.verifier if options.mode == "verify" else None,
                       commit_head=(self.commit_head if options.verify.commit_rule == "head"
                                    else None),
                       pad_id=self.pad_id)


def has_commit_head(verifier_path: str | None) -> bool:
    return verifier_path is not None and os.path.isdir(os.path.join(verifier_path, HEAD_DIR))


def load_pair(model_path: str, verifier_path: str | None = None, dtype: str = "float32",
              with_head: bool = False, inflate_to: str | None = None,
              progress: Callable[[str], None] = log) -> ModelPair:
    """Load checkpoints once (bfloat16 storage is restored as `dtype`). `inflate_to`, a preset
    name: run the proposer embedded in that shape (`prove_jax.models.inflate`), same outputs."""
    models = load_models(model_path, verifier_path, with_head=with_head, dtype=dtype)
    if not models.eos_ids:
        raise BenchError(f"{model_path}: no EOS token id in the config or tokenizer")
    proposer, source_params = models.proposer, None
    if inflate_to is not None:
        shape = preset(inflate_to)
        source_params = proposer.cfg.num_params
        progress(f"  inflating the proposer ({source_params / 1e6:.1f}M parameters) to the "
                 f"{inflate_to} shape ...")
        proposer = inflate(proposer, shape)
    return ModelPair(**(vars(models) | {"proposer": proposer}), proposer_path=model_path,
                     verifier_path=verifier_path, source_params=source_params)
