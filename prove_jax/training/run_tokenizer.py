"""A run's tokenizer: the configured one, a BPE trained on the data, or on resume the run's own
RUN_DIR/tokenizer; `<|mask|>` added for MARS; checked against pretrained weights' ids."""

from __future__ import annotations

from prove_jax import distributed, storage
from prove_jax.checkpoints import checkpoint, vocab
from prove_jax.data import pipeline as data_lib
from prove_jax.data.tokenizer import build_tokenizer, load_tokenizer_dir
from prove_jax.models.config import ModelConfig
from prove_jax.training.batches import require_data
from prove_jax.training.config import TrainConfig, TrainConfigError
from prove_jax.training.errors import TrainError
from prove_jax.training.host_log import log_main
from prove_jax.training.run_checkpoint import has_checkpoints


def _training_texts(path: str):
    for ex in data_lib.load_examples(path):
        if "text" in ex:
            yield ex["text"]
        else:
            yield str(ex.get("prompt", "")) + str(ex.get("response", ""))


def resolve_tokenizer(cfg: TrainConfig) -> tuple[object, str]:
    """(tokenizer, directory it was read from). A run's own saved tokenizer wins on resume;
    without a checkpoint it is only a leftover of an earlier launch, and the configured
    tokenizer (or a freshly trained BPE) is used, so a corrected tokenizer config counts."""
    resuming = has_checkpoints(cfg.run_dir)
    own = storage.join(cfg.run_dir, "tokenizer")
    if resuming and storage.isfile(storage.join(own, "tokenizer.json")):
        return read_tokenizer_dir(own), own
    tok = cfg.tokenizer
    if tok.bpe_vocab_size:
        base = storage.join(cfg.run_dir, "tokenizer_base")
        reuse = resuming and storage.isfile(storage.join(base, "tokenizer.json"))
        if distributed.is_main_process() and not reuse:
            require_data(cfg.data)
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
    with storage.local_copy(path) as local:
        return load_tokenizer_dir(local)


def fill_special_ids(model_cfg: ModelConfig, tokenizer) -> ModelConfig:
    """From-scratch configs take EOS/pad ids from the tokenizer (needed by generation)."""
    changes = {}
    if not model_cfg.eos_token_ids and tokenizer.eos_token_id is not None:
        changes["eos_token_ids"] = (int(tokenizer.eos_token_id),)
    if model_cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
        changes["pad_token_id"] = int(tokenizer.pad_token_id)
    return model_cfg.replace(**changes)


def save_run_tokenizer(tokenizer, run_dir: str) -> str:
    """The tokenizer as trained (with `<|mask|>`) in RUN_DIR/tokenizer: written by a fresh run
    (replacing any leftover), kept as it is by a resumed one."""
    own = storage.join(run_dir, "tokenizer")
    keep = has_checkpoints(run_dir) and storage.isfile(storage.join(own, "tokenizer.json"))
    if distributed.is_main_process() and not keep:
        with storage.staged_dir(own) as tmp:
            tokenizer.save_pretrained(tmp)
    distributed.barrier("tokenizer_saved")
    return own


def with_mask_token(cfg: TrainConfig, tokenizer, model_cfg: ModelConfig):
    """(tokenizer, model config, grown): MARS needs `<|mask|>`; AR runs leave the vocab alone."""
    if cfg.objective != "mars" and model_cfg.mask_token_id is None:
        return tokenizer, model_cfg, False
    return vocab.ensure_mask_token(tokenizer, model_cfg)



def check_tokenizer_matches_weights(cfg: TrainConfig, tokenizer, where: str,
                                    model_cfg: ModelConfig) -> None:
    """Pretrained weights (model.checkpoint / model.hf_dir) read token ids as their own
    tokenizer assigns them: a configured tokenizer must map every token to the same id (and fit
    the embedding rows), or the embeddings are read with wrong ids."""
    src = cfg.model.checkpoint or cfg.model.hf_dir
    if src is None or storage.absolute(where) == storage.absolute(src):
        return
    own = checkpoint.load_tokenizer(src) if storage.isdir(src) else None
    try:
        vocab.check_shared_vocabulary(tokenizer, where, [("model", src, model_cfg.vocab_size, own)])
    except vocab.VocabError as e:
        raise TrainConfigError(f"{e}; leave tokenizer.path unset to use the model's own "
                               f"tokenizer") from None


