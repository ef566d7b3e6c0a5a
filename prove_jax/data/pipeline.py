"""Training data: load text / JSONL, tokenize into fixed-length rows, batch per host with grain.

Each row has `loss_mask` (trained tokens: a response + EOS, all of plain text, and the EOS
padding to a multiple of `block_size`) and `valid` (real tokens and that padding). With
`pack_documents` every example (a text document, or each max_length piece of a longer one, and
each prompt/response pair) is padded to whole blocks on its own and packed into rows, which then
also carry `segment_ids` (1, 2, ... per example in the row, 0 = padding) and `positions`
(restarting at 0 for each example). Rows are tokenized once, up front, so truncation is counted
before training. Global batches are consecutive `global_batch_size` rows of one shuffled order,
and each host reads exactly the rows of them that its own devices hold (`host_rows`, from the
batch sharding: on a pod the mesh's device order need not follow the process order), so a
multi-host run sees the global batches of a single-process run with the same seed, row for
row, and the iterator state is one integer (the global batch index).
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import os
from typing import Any, Iterable, Mapping, Sequence

import grain
import grain.checkpoint as gcp
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from prove_jax import storage
from prove_jax.errors import ProveJaxError
from prove_jax.data.chat import chat_prompt_ids
from prove_jax.data.jsonl import read_jsonl

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".rs", ".go",
                 ".js", ".ts", ".java", ".sh", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".tex",
                 ".html", ".css")
JSONL_SUFFIXES = (".jsonl", ".json")

# {"prompt": str, "response": str}, {"text": str}, or pre-tokenized
# {"prompt_ids": [int], "response_ids": [int]} (trained exactly as given: no EOS is appended,
# so a response that should end the text carries its own EOS, as the distill CLI writes it).
Example = dict


class DataError(ProveJaxError, ValueError):
    """Training data that cannot be read or turned into batches."""


# ---- loading ---------------------------------------------------------------------------------

def _read_text(path: str) -> str:
    try:
        if storage.is_url(path):
            return storage.read_bytes(path).decode("utf-8-sig")
        with open(path, encoding="utf-8-sig") as f:  # -sig: a leading BOM is not text
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _parse_jsonl(path: str) -> list[Example]:
    examples = []
    source = io.BytesIO(storage.read_bytes(path)) if storage.is_url(path) else path
    for lineno, record in read_jsonl(source, DataError, name=path):
        if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(
                record.get("response"), str):
            examples.append({"prompt": record["prompt"], "response": record["response"]})
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            examples.append({"text": record["text"]})
        elif isinstance(record, dict) and _is_ids(record.get("prompt_ids")) and _is_ids(
                record.get("response_ids")):
            examples.append({"prompt_ids": record["prompt_ids"],
                             "response_ids": record["response_ids"]})
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f'{path}:{lineno}: expected a {{"prompt", "response"}} or {{"text"}} '
                            f'record of strings or a {{"prompt_ids", "response_ids"}} record of '
                            f"token id lists, got {keys}")
    return examples


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in value)


def _load_file(path: str) -> list[Example]:
    if path.endswith(JSONL_SUFFIXES):
        return _parse_jsonl(path)
    text = _read_text(path)
    return [{"text": text}] if text.strip() else []


def _load_folder(path: str) -> list[Example]:
    """Text files (TEXT_SUFFIXES) and .jsonl files under `path`, in sorted path order.

    A stray .json file in a folder is usually configuration, not data, so only .jsonl counts;
    files that are not UTF-8 (e.g. encoding test fixtures) are skipped with one warning.
    """
    files = []
    if storage.is_url(path):
        with storage.errors(path):
            found = [str(p) for p in storage.as_path(path).rglob("*") if p.is_file()]
        base = str(path).rstrip("/") + "/"
        files = [f for f in found
                 if not any(part.startswith(".") for part in f[len(base):].split("/"))
                 and f.endswith(TEXT_SUFFIXES + (".jsonl",))]
    for root, dirs, names in ([] if storage.is_url(path) else os.walk(path)):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [os.path.join(root, n) for n in names
                  if not n.startswith(".") and n.endswith(TEXT_SUFFIXES + (".jsonl",))
                  and os.path.exists(os.path.join(root, n))]  # a dangling symlink is no data
    examples, skipped = [], []
    for f in sorted(files):
        try:
            examples += _load_file(f)
        except DataError as e:
            if "not UTF-8" not in str(e):
                raise
            skipped.append(f)
    if skipped:
        log.warning("data: skipped %d file(s) that are not UTF-8 text under %s (first: %s)",
                    len(skipped), path, skipped[0])
    return examples


def load_examples(path: str) -> list[Example]:
    """Examples from a text file, a folder of text files (recursive, sorted) or JSONL.

    A file ending in .jsonl or .json is read as JSON lines; any other file is one document.
    """
    path = os.fspath(path)
    if not storage.exists(path):
        raise DataError(f"data path not found: {path}")
    if storage.isdir(path):
        examples = _load_folder(path)
    else:
        examples = _load_file(path)
    if not examples:
        raise DataError(f"empty dataset: no examples in {path}")
    return examples


# ---- tokenizing ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DataStats:
    examples: int           # records loaded
    sequences: int          # rows after packing / splitting
    truncated: int          # prompt/response rows cut at max_length
    dropped: int            # rows left with no trained target (e.g. prompt alone >= max_length)
    trained_tokens: int     # loss_mask & valid tokens over all rows
    steps_per_epoch: int    # global batches per epoch (0 when smaller than one batch)
    documents: int = 0      # separately attended sequences in the rows (= sequences unless packed)
    padding_fraction: float = 0.0  # row positions holding no token: compute spent on nothing
    fill_fraction: float = 0.0     # row positions holding block-end EOS fill (trained, not data)


@dataclasses.dataclass(frozen=True)
class TokenizedRows:
    input_ids: np.ndarray   # int32 [N, L]
    loss_mask: np.ndarray   # bool [N, L]
    valid: np.ndarray       # bool [N, L]
    truncated: int
    dropped: int
    # int32 [N, L], pack_documents only: 1.. per example, 0 = padding
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None    # int32 [N, L], pack_documents only: restart per example
    filled: int = 0                         # block-end EOS fill tokens over all rows

    @property
    def documents(self) -> int:
        if self.segment_ids is None:
            return int(self.valid.any(-1).sum())
        return int(self.segment_ids.max(-1).sum())


def _token_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if not texts:
        return []
    # split_special_tokens: a literal "<|mask|>" or "<|endoftext|>" in the data is text; special
    # ids come only from the chat template and the EOS we append. verbose=False: a whole file is
    # one document, past model_max_length, and we cut it into rows ourselves.
    return list(tokenizer(list(texts), add_special_tokens=False, split_special_tokens=True,
                          verbose=False)["input_ids"])


def _special_ids(tokenizer) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; set one (it ends responses and pads "
                        "blocks)")
    pad = tokenizer.pad_token_id
    return int(eos), int(eos if pad is None else pad)


def _pack_stream(docs: Iterable[list[int]], max_length: int, pack: bool) -> list[list[int]]:
    """Cut documents (EOS already appended) into chunks of at most max_length tokens."""
    if pack:
        stream = [t for d in docs for t in d]
        return [stream[i:i + max_length] for i in range(0, len(stream), max_length)]
    return [d[i:i + max_length] for d in docs for i in range(0, len(d), max_length)]


def _best_fit(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Indices of `lengths` per row, packed best-fit decreasing: longest first, each into the
    open row it fills most tightly. Deterministic; rows open by free space, found by bisection."""
    rows: list[list[int]] = []
    open_rows: dict[int, list[int]] = {}  # free space -> rows with exactly that much left
    spaces: list[int] = []                # sorted keys of open_rows
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        k = bisect.bisect_left(spaces, n)
        if k < len(spaces):
            space = spaces[k]
            r = open_rows[space].pop()
            if not open_rows[space]:
                del open_rows[space], spaces[k]
        else:
            r, space = len(rows), max_length
            rows.append([])
        rows[r].append(i)
        left = space - n
        if left:
            if left not in open_rows:
                bisect.insort(spaces, left)
                open_rows[left] = []
            open_rows[left].append(r)
    return rows


def tokenize_examples(examples: Sequence[Example], tokenizer, *, max_length: int, block_size: int,
                      chat: bool = False, pack: bool = True,
                      pack_documents: bool = False,
                      enable_thinking: bool | None = None) -> TokenizedRows:
    """Rows of exactly max_length tokens (see the module docstring for the masks).

    `pack` joins plain text into one stream cut at max_length (no document boundaries);
    `pack_documents` packs every example into rows with segment ids instead (`pack` is moot).
    `enable_thinking` is the chat template's thinking switch (Qwen3's; data/chat.py).
    """
    if block_size <= 0 or max_length <= 0:
        raise DataError(f"max_length ({max_length}) and block_size ({block_size}) must be positive")
    if max_length % block_size:
        raise DataError(f"max_length {max_length} is not a multiple of block_size {block_size}")
    eos, pad = _special_ids(tokenizer)
    pairs = [ex for ex in examples if "prompt" in ex]
    id_pairs = [ex for ex in examples if "prompt_ids" in ex]
    texts = [ex["text"] for ex in examples if "text" in ex]
    vocab = len(tokenizer)
    for ex in id_pairs:
        bad = [t for t in ex["prompt_ids"] + ex["response_ids"] if not 0 <= t < vocab]
        if bad:
            raise DataError(f"token id {bad[0]} in a prompt_ids/response_ids record is outside the "
                            f"tokenizer's vocabulary [0, {vocab})")

    prompt_responses: list[tuple[list[int], list[int]]] = []  # (prompt ids, trained response ids)
    if pairs:
        if chat:
            prompts = [chat_prompt_ids(tokenizer, ex["prompt"], enable_thinking) for ex in pairs]
        else:
            prompts = _token_ids(tokenizer, [ex["prompt"] for ex in pairs])
        responses = _token_ids(tokenizer, [ex["response"] for ex in pairs])
        prompt_responses += [(list(p), list(r) + [eos]) for p, r in zip(prompts, responses)]
    prompt_responses += [(list(ex["prompt_ids"]), list(ex["response_ids"])) for ex in id_pairs]

    rows: list[tuple[list[int], list[bool]]] = []  # (tokens, trained) before padding
    truncated = 0
    for p, r in prompt_responses:
        tokens, trained = p + r, [False] * len(p) + [True] * len(r)
        if len(tokens) > max_length:
            truncated += 1
            tokens, trained = tokens[:max_length], trained[:max_length]
        rows.append((tokens, trained))
    if texts:
        docs = [ids + [eos] for ids in _token_ids(tokenizer, texts)]
        rows += [(chunk, [True] * len(chunk))
                 for chunk in _pack_stream(docs, max_length, pack and not pack_documents)]

    # A row trains something only if a trained token has a predecessor (targets are 1..n-1);
    # EOS block padding (when the length is not a block multiple) always provides one.
    kept = [(t, m) for t, m in rows if any(m[1:]) or len(t) % block_size]
    dropped = len(rows) - len(kept)
    # each example padded with trained EOS up to a block boundary, as the reference pads one
    kept = [(t + [eos] * ((-len(t)) % block_size), m + [True] * ((-len(t)) % block_size), len(t))
            for t, m in kept]
    filled = sum(len(t) - length for t, _, length in kept)
    placement = (_best_fit([len(t) for t, _, _ in kept], max_length) if pack_documents
                 else [[i] for i in range(len(kept))])
    n = len(placement)
    input_ids = np.full((n, max_length), pad, np.int32)
    loss_mask = np.zeros((n, max_length), bool)
    segment_ids = np.zeros((n, max_length), np.int32)
    positions = np.zeros((n, max_length), np.int32)
    for i, pieces in enumerate(placement):
        start = 0
        for segment, j in enumerate(pieces, 1):
            tokens, trained, _ = kept[j]
            end = start + len(tokens)
            input_ids[i, start:end], loss_mask[i, start:end] = tokens, trained
            segment_ids[i, start:end], positions[i, start:end] = segment, np.arange(len(tokens))
            start = end
    valid = segment_ids > 0
    if not pack_documents:
        return TokenizedRows(input_ids, loss_mask, valid, truncated, dropped, filled=filled)
    return TokenizedRows(input_ids, loss_mask, valid, truncated, dropped, segment_ids, positions,
                         filled)


# ---- grain pipeline --------------------------------------------------------------------------

class _RowLookup:
    """A global batch's row indices -> this host's rows of it, as arrays (a picklable grain map
    function): `host` picks the positions in the batch that this host reads."""

    def __init__(self, rows: TokenizedRows, host: np.ndarray):
        self.rows = rows
        self.host = host

    def __call__(self, batch_indices: np.ndarray) -> dict[str, np.ndarray]:
        r, index = self.rows, np.asarray(batch_indices)[self.host]
        row = {"input_ids": r.input_ids[index], "loss_mask": r.loss_mask[index],
               "valid": r.valid[index]}
        if r.segment_ids is not None:
            row |= {"segment_ids": r.segment_ids[index], "positions": r.positions[index]}
        return row


def host_rows(sharding, global_batch_size: int, length: int) -> np.ndarray:
    """The rows of a [global_batch_size, length] batch that this process's devices hold under
    `sharding`, ascending: the rows this host reads, in the order
    `jax.make_array_from_process_local_data` lays its local data out (by global position)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch_size, length)).values():
        rows.update(range(*index[0].indices(global_batch_size)))
    return np.asarray(sorted(rows), np.int64)


def make_dataset(examples_or_path: str | Sequence[Example], tokenizer, *, max_length: int,
                 block_size: int, global_batch_size: int, seed: int, shuffle: bool = True,
                 num_epochs: int | None = None, process_index: int | None = None,
                 process_count: int | None = None, chat: bool = False, pack: bool = True,
                 pack_documents: bool = False, read_threads: int = 0,
                 enable_thinking: bool | None = None,
                 worker_count: int = 0, rows: Sequence[int] | None = None) -> grain.DatasetIterator:
    """This host's batch iterator: dicts of input_ids / loss_mask / valid (with
    `pack_documents` also segment_ids / positions), each [b, max_length].

    `rows`: the rows of each global batch this host reads, ascending (`host_rows` of the batch
    sharding); without them, the process's contiguous share (b = global_batch_size //
    process_count rows from process_index x b). `num_epochs=None` repeats forever; a finite count
    stops after the last full global batch (the same step on every host). The returned grain
    iterator has get_state()/set_state() (one integer: the next batch index) and works with
    `iterator_save_args` / `iterator_restore_args` inside an orbax Composite. `.stats` holds
    the DataStats of the dataset.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if global_batch_size <= 0 or global_batch_size % process_count:
        raise DataError(f"global_batch_size {global_batch_size} must be a positive multiple of the "
                        f"process count {process_count}")
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} outside 0..{process_count - 1}")
    if num_epochs is not None and num_epochs <= 0:
        raise DataError(f"num_epochs must be positive or None (forever), got {num_epochs}")
    if isinstance(examples_or_path, (str, os.PathLike)):
        examples = load_examples(examples_or_path)
    else:
        examples = list(examples_or_path)
    if not examples:
        raise DataError("empty dataset: no examples given")
    tokenized = tokenize_examples(examples, tokenizer, max_length=max_length, block_size=block_size,
                                  chat=chat, pack=pack, pack_documents=pack_documents,
                                  enable_thinking=enable_thinking)
    n = tokenized.input_ids.shape[0]
    if n == 0:
        raise DataError(f"empty dataset: all {len(examples)} examples were dropped (no trained "
                        f"tokens within max_length {max_length})")
    if tokenized.truncated or tokenized.dropped:
        log.warning("data: %d sequences longer than max_length %d were truncated; %d rows dropped "
                    "(no trained token left)", tokenized.truncated, max_length, tokenized.dropped)
    stats = DataStats(examples=len(examples), sequences=n, truncated=tokenized.truncated,
                      dropped=tokenized.dropped,
                      trained_tokens=int((tokenized.loss_mask & tokenized.valid).sum()),
                      steps_per_epoch=n // global_batch_size, documents=tokenized.documents,
                      padding_fraction=float(1.0 - tokenized.valid.mean()),
                      fill_fraction=tokenized.filled / tokenized.valid.size)

    if rows is None:
        host_batch = global_batch_size // process_count
        rows = range(process_index * host_batch, (process_index + 1) * host_batch)
    host = np.asarray(rows, np.int64)
    if (host.ndim != 1 or not host.size or np.any(np.diff(host) <= 0) or host[0] < 0
            or host[-1] >= global_batch_size):
        raise DataError(f"rows {host.tolist()} are not ascending rows of a global batch of "
                        f"{global_batch_size}")
    ds = grain.MapDataset.range(n)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    # global batches of row indices (ints: cheap), then only this host's rows are read
    ds = ds.repeat(num_epochs).batch(global_batch_size, drop_remainder=True)
    if num_epochs is not None:
        steps = n * num_epochs // global_batch_size
        if steps == 0:
            raise DataError(f"{n} sequences x {num_epochs} epochs do not fill one global batch of "
                            f"{global_batch_size}")
        ds = ds[:steps]
    ds = ds.map(_RowLookup(tokenized, host))
    iter_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                                   prefetch_buffer_size=2 * read_threads))
    if worker_count > 0:
        iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    iterator = iter(iter_ds)
    iterator.stats = stats
    return iterator


def iterator_save_args(iterator):
    """orbax args that save the iterator's state (use inside ocp.args.Composite)."""
    return gcp.CheckpointSave(iterator)


def iterator_restore_args(iterator):
    """orbax args that restore a saved state into `iterator` (built with the same settings)."""
    return gcp.CheckpointRestore(iterator)


def to_global_batch(host_batch: Mapping[str, Any], mesh,
                    batch_spec: PartitionSpec = PartitionSpec(("data", "fsdp")),
                    ) -> dict[str, jax.Array]:
    """Assemble each host's rows into global arrays sharded over the batch axes of `mesh`."""
    sharding = NamedSharding(mesh, batch_spec)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in host_batch.items()}
