"""Test-session setup, done before jax is imported anywhere (subprocesses inherit it too).

- 8 simulated CPU devices, so sharding tests see a real mesh.
- Compile time, not run time, dominates this suite: every test builds its own small programs
  and each fusion is an LLVM kernel. Two settings that change no result cut it:
  * `--xla_backend_optimization_level=0`: LLVM does not optimise the kernels (the HLO
    passes, which decide fusion, layout and in-place updates, still run; the in-place test
    reads their output). The tiny test models run no slower for it.
  * a persistent compilation cache in a fresh folder for this session only: identical
    programs (the same tiny model and shapes in several tests, the training step of the
    reproduction script's stages) compile once. The folder is removed at exit.
"""

import atexit
import os
import shutil
import tempfile

import pytest

from tests.xla_flags import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags(devices=8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="prove-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


@pytest.fixture(scope="session")
def demo_tok():
    """The shipped demo proposer's tokenizer (Qwen2.5's vocabulary and chat template)."""
    # imported here, not at the top: jax must not load before the environment above is set
    from prove_jax import assets
    from prove_jax.checkpoints import checkpoint
    return checkpoint.load_tokenizer(assets.DEMO_PROPOSER)


def pytest_collection_modifyitems(config, items):
    """Modules that hold a `slow` test run first, each whole and in its own order (its
    module-scoped fixtures are set up once). `-n 2 --dist worksteal` hands each worker a
    contiguous half of this list and lets an idle one take the tail of the other's queue: a
    minute-long test left at the end of the list keeps one worker busy while the other idles."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items[:] = ([i for i in items if i.module in slow_modules]
                + [i for i in items if i.module not in slow_modules])
