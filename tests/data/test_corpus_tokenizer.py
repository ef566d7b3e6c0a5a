"""The stdlib corpus (file list, split, prompts, files on disk) and the Qwen2-style BPE tokenizer."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import runpy
import unicodedata

import pytest

from prove_jax.cli import corpus as corpus_cli
from prove_jax.data import corpus
from prove_jax.data.tokenizer import (EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, MASK_TOKEN,
                                      QWEN2_SPLIT_REGEX, SPECIAL_TOKENS, TokenizerBuildError,
                                      build_tokenizer, train_bpe)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_BYTES = 2_500_000   # a hash-ordered sample of the stdlib: enough for a 2048-token BPE
SMALL_VOCAB = 2048


# ----------------------------------------------------------------------------------------------
# Corpus

def test_file_list_is_sorted_and_excludes_tests_and_generated_files():
    root = corpus.stdlib_root()
    files = corpus.list_source_files()
    assert files == sorted(files) and len(files) > 300
    assert {"os.py", "json/decoder.py", "asyncio/tasks.py"} <= set(files)
    # These exist on disk (so the exclusion is real) but must not be in the corpus.
    excluded = [p for p in ("test/test_os.py", "lib2to3/tests/test_parser.py",
                            "idlelib/idle_test/test_config.py", "unittest/test/test_case.py",
                            "pydoc_data/topics.py") if os.path.exists(os.path.join(root, p))]
    assert len(excluded) >= 3
    assert not set(excluded) & set(files)
    for path in files:
        parts = path.split("/")
        assert not {"test", "tests", "idle_test", "site-packages", "__pycache__"} & set(parts[:-1])
        assert not parts[-1].startswith("_sysconfigdata")


def test_split_is_a_stable_hash_of_the_path():
    # Hand-computed: the first 8 bytes of sha256(path), big-endian, over 2**64.
    for path in ("os.py", "json/decoder.py"):
        expected = int(hashlib.sha256(path.encode()).hexdigest()[:16], 16) / 2 ** 64
        assert corpus.path_hash_fraction(path) == expected
    split = corpus.build_corpus(heldout_fraction=0.05)
    assert all(corpus.path_hash_fraction(sf.path) < 0.05 for sf in split.heldout)
    assert all(corpus.path_hash_fraction(sf.path) >= 0.05 for sf in split.train)
    n = len(split.train) + len(split.heldout)
    assert 0.02 * n < len(split.heldout) < 0.10 * n
    assert sum(len(sf.text.encode()) for sf in split.train) > 8_000_000   # ~11 MB in 3.11

    small = corpus.build_corpus(heldout_fraction=0.05, max_bytes=SMALL_BYTES)
    train_bytes, heldout_bytes = (sum(len(sf.text.encode()) for sf in side)
                                  for side in (small.train, small.heldout))
    assert train_bytes + heldout_bytes <= SMALL_BYTES
    # each side gets its share of the cap (the held-out files' low hashes must not crowd out training)
    assert 0.9 * 0.95 * SMALL_BYTES < train_bytes and 0 < heldout_bytes <= 0.05 * SMALL_BYTES
    # A capped corpus holds out a subset of the full held-out files: no leakage into training.
    assert {sf.path for sf in small.heldout} <= {sf.path for sf in split.heldout}
    assert {sf.path for sf in small.train} <= {sf.path for sf in split.train}
    assert [sf.path for sf in small.train] == sorted(sf.path for sf in small.train)


SOURCE = '''\
import os


def plain(x):
    """Add one."""
    return x + 1


@staticmethod
def decorated(a, b):
    """Two lines
    of docs."""
    c = a * b
    return c


def undocumented(x):
    return x


def only_doc():
    """Nothing after."""


class Box:
    def size(self):
        \'\'\'Size of the box.\'\'\'
        if self:
            return 1
        return 0
'''


def test_function_prompts_cut_signature_and_docstring_from_body():
    records = corpus.function_prompts(corpus.SourceFile("pkg/mod.py", SOURCE))
    assert [r["id"] for r in records] == ["stdlib/pkg/mod.py:plain:4",
                                         "stdlib/pkg/mod.py:decorated:10",
                                         "stdlib/pkg/mod.py:Box.size:26"]
    assert records[0]["prompt"] == 'def plain(x):\n    """Add one."""\n'
    assert records[0]["reference"] == "    return x + 1\n"
    assert records[1]["prompt"] == ('@staticmethod\ndef decorated(a, b):\n    """Two lines\n'
                                    '    of docs."""\n')
    assert records[1]["reference"] == "    c = a * b\n    return c\n"
    # Methods are dedented to column 0, like a HumanEval prompt.
    assert records[2]["prompt"] == "def size(self):\n    '''Size of the box.'''\n"
    assert records[2]["reference"] == "    if self:\n        return 1\n    return 0\n"


def test_heldout_prompts_are_real_functions_from_heldout_files():
    split = corpus.build_corpus()
    prompts = corpus.heldout_prompts(split.heldout)
    assert len(prompts) > 50
    heldout_paths = {sf.path for sf in split.heldout}
    assert len({r["id"] for r in prompts}) == len(prompts)
    for r in prompts:
        assert r["id"].split(":")[0].removeprefix("stdlib/") in heldout_paths
        tree = ast.parse(r["prompt"] + r["reference"])      # a whole function again
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        assert r["prompt"].rstrip().endswith(('"""', "'''"))
    limited = corpus.heldout_prompts(split.heldout, limit=20)
    assert len(limited) == 20 and len({r["id"].split(":")[0] for r in limited}) > 5


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_cli_writes_corpus_files_and_manifest(tmp_path, capsys):
    out = tmp_path / "corpus"
    assert corpus_cli.main(["--out", str(out), "--max-bytes", str(SMALL_BYTES)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    for split in ("train", "heldout"):
        lines = (out / f"{split}.jsonl").read_text().splitlines()
        records = [json.loads(ln) for ln in lines]
        assert len(records) == manifest[split]["files"]
        assert [r["path"] for r in records] == manifest[split]["paths"]
        assert sum(len(r["text"].encode()) for r in records) == manifest[split]["bytes"]
        assert _sha(out / f"{split}.jsonl") == manifest[split]["sha256"]
        # Texts are the files on disk, byte for byte.
        root = manifest["root"]
        with open(os.path.join(root, records[0]["path"]), encoding="utf-8") as f:
            assert records[0]["text"] == f.read()
    assert not set(manifest["train"]["paths"]) & set(manifest["heldout"]["paths"])
    prompts = (out / "heldout_prompts.jsonl").read_text().splitlines()
    assert len(prompts) == manifest["heldout_prompts"]["records"] > 0
    assert list(corpus.iter_texts(str(out / "heldout.jsonl")))[0] == json.loads(
        (out / "heldout.jsonl").read_text().splitlines()[0])["text"]
    # Deterministic: a second run writes identical files.
    out2 = tmp_path / "again"
    assert corpus_cli.main(["--out", str(out2), "--max-bytes", str(SMALL_BYTES)]) == 0
    assert _sha(out2 / "train.jsonl") == _sha(out / "train.jsonl")
    assert _sha(out2 / "heldout_prompts.jsonl") == _sha(out / "heldout_prompts.jsonl")
    # An earlier corpus is replaced whole; any other non-empty directory is refused untouched.
    assert corpus_cli.main(["--out", str(out2), "--max-bytes", str(SMALL_BYTES), "--max-prompts", "1"]) == 0
    assert len((out2 / "heldout_prompts.jsonl").read_text().splitlines()) == 1
    precious = tmp_path / "src"
    precious.mkdir()
    (precious / "keep.py").write_text("x = 1\n")
    capsys.readouterr()
    assert corpus_cli.main(["--out", str(precious), "--max-bytes", str(SMALL_BYTES)]) == 2
    assert "is not a corpus written by this tool" in capsys.readouterr().err
    assert os.listdir(precious) == ["keep.py"]


@pytest.mark.parametrize("argv, needle", [
    (["--heldout-fraction", "1.5"], "heldout_fraction"),
    (["--max-bytes", "0"], "max_bytes"),
    (["--root", "/nonexistent/dir"], "not a directory"),
    (["--max-bytes", "100"], "split is empty"),
    (["--max-prompts", "-1"], "max_prompts must be >= 0"),
])
def test_cli_bad_input_is_one_clear_error(tmp_path, capsys, argv, needle):
    out = tmp_path / "c"
    assert corpus_cli.main(["--out", str(out)] + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and needle in err[-1]
    assert not out.exists()          # nothing half-written


def test_iter_texts_names_a_bad_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(corpus.CorpusError, match="bad.jsonl:2"):
        list(corpus.iter_texts(str(bad)))


# ----------------------------------------------------------------------------------------------
# Tokenizer

@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    corpus.write_corpus(str(out), max_bytes=SMALL_BYTES)
    return out


@pytest.fixture(scope="module")
def trained(small_corpus, tmp_path_factory):
    """(tokenizer dir, TokenizerInfo, held-out texts) trained through the script's main()."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    script = runpy.run_path(os.path.join(REPO, "scripts", "train_tokenizer.py"), run_name="test")
    assert script["main"](["--corpus", str(small_corpus), "--out", str(out),
                           "--vocab-size", str(SMALL_VOCAB)]) == 0
    heldout = list(corpus.iter_texts(str(small_corpus / "heldout.jsonl")))
    return out, heldout


def test_split_regex_is_qwen2s_own():
    from transformers.models.qwen2 import tokenization_qwen2
    assert QWEN2_SPLIT_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX


def test_tokenizer_loads_offline_as_qwen2_with_special_tokens(trained):
    from transformers import AutoTokenizer, Qwen2Tokenizer
    out, _ = trained
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert isinstance(tok, Qwen2Tokenizer)
    assert len(tok) == SMALL_VOCAB
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert ids == {EOS_TOKEN: 0, IM_START_TOKEN: 1, IM_END_TOKEN: 2, MASK_TOKEN: 3}
    assert tok.eos_token_id == tok.pad_token_id == ids[EOS_TOKEN]
    assert tok.mask_token_id == ids[MASK_TOKEN] < SMALL_VOCAB
    # Each special token is one id, also inside text, and never merged with its neighbours.
    for t, i in ids.items():
        assert tok.encode(t) == [i]
        enc = tok.encode(f"x = 1{t}def")
        assert enc.count(i) == 1 and tok.decode(enc) == f"x = 1{t}def"
    assert MASK_TOKEN not in tok.decode(tok.encode(f"a{MASK_TOKEN}b"), skip_special_tokens=True)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The project's checkpoint loader finds it too.
    from prove_jax.checkpoints.checkpoint import load_tokenizer
    assert load_tokenizer(str(out)).encode("import os\n") == tok.encode("import os\n")


def test_heldout_source_round_trips_and_libraries_agree(trained):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    out, heldout = trained
    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert len(heldout) >= 5
    total_chars = total_tokens = 0
    for text in heldout:
        ids = hf.encode(text)
        # transformers rebuilds Qwen2's pipeline from vocab + merges; it must match the file.
        assert ids == raw.encode(text).ids
        assert hf.decode(ids) == unicodedata.normalize("NFC", text)
        if unicodedata.is_normalized("NFC", text):
            assert hf.decode(ids) == text
        total_chars += len(text)
        total_tokens += len(ids)
    assert total_chars / total_tokens > 2.5   # a real BPE compresses source code
    # Bytes outside the training text (emoji, control chars) still round-trip.
    odd = "x = '\u00e9\U0001F600\t\x07'  # \u4e2d\u6587\n"
    assert hf.decode(hf.encode(odd)) == odd


def test_tokenizer_errors(small_corpus, tmp_path, capsys):
    with pytest.raises(TokenizerBuildError, match="vocab_size must exceed"):
        train_bpe(["abc"], vocab_size=100)
    with pytest.raises(TokenizerBuildError, match="corpus too small"):
        build_tokenizer(["tiny text"], str(tmp_path / "t"), vocab_size=1000)
    assert not (tmp_path / "t").exists()
    script = runpy.run_path(os.path.join(REPO, "scripts", "train_tokenizer.py"), run_name="test")
    assert script["main"](["--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error:") and "train.jsonl" in err
    # --out is replaced whole: a directory that is not a tokenizer folder is refused before training
    precious = tmp_path / "src"
    precious.mkdir()
    (precious / "keep.py").write_text("x = 1\n")
    with pytest.raises(TokenizerBuildError, match="is not a tokenizer folder"):
        build_tokenizer(["tiny text"], str(precious), vocab_size=1000)  # not "corpus too small"
    assert os.listdir(precious) == ["keep.py"]


def test_function_prompts_and_records_survive_unusual_line_breaks(tmp_path):
    """ast numbers lines at \\n/\\r only; str.splitlines also breaks at U+2028 and form feeds,
    which shifted every later function. Corpus JSONL written with ensure_ascii=False keeps
    such characters raw, and a byte that is not UTF-8 is named with its line."""
    odd = 'S = "a\u2028b"\n\x0c\n' + SOURCE
    assert corpus.function_prompts(corpus.SourceFile("pkg/mod.py", odd)) == [
        dict(r, id=r["id"].rsplit(":", 1)[0] + f":{int(r['id'].rsplit(':', 1)[1]) + 2}")
        for r in corpus.function_prompts(corpus.SourceFile("pkg/mod.py", SOURCE))]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"text": "one\u2028two\x85three"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert list(corpus.iter_texts(str(path))) == ["one\u2028two\x85three"]
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(corpus.CorpusError, match=r"train.jsonl:2: not UTF-8"):
        list(corpus.iter_texts(str(path)))
