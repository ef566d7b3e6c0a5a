"""The package's shape: no module imports upward, `import prove_jax.models` loads no decoding,
training or evaluation, `import prove_jax` loads no jax, and the package installs and runs as
`prove-jax` from outside the repository (the shipped demo pair travels as package data)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests import prewarmed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "prove_jax")

# Lowest first; a module may import its own layer and any below it.
LAYERS = {"base": 0, "models": 1, "checkpoints": 2, "data": 2, "decoding": 3, "training": 4,
          "serving": 4, "evaluation": 5, "cli": 6}
BASE_MODULES = {"errors", "files", "storage", "distributed", "memory", "fieldtypes", "assets", "aot", "hlo_cost", "profiling", "timing"}
SUBCOMMANDS = ("generate", "train", "convert", "benchmark", "demo", "corpus", "distill", "evaluate",
               "humaneval", "task")


def layer_of(module: str) -> str:
    """The layer of a prove_jax module name ('prove_jax.decoding.engine' -> 'decoding')."""
    parts = module.split(".")
    if len(parts) == 1:
        return "base"  # the package itself
    if parts[1] == "__main__":
        return "cli"
    if parts[1] in BASE_MODULES:
        return "base"
    if parts[1] in LAYERS:
        return parts[1]
    raise AssertionError(f"{module}: not in any layer; add it to LAYERS or BASE_MODULES in {__file__}")


def package_modules() -> dict[str, str]:
    """{module name: path} of every module under prove_jax/."""
    modules = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, name), REPO)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                modules[".".join(rel)] = os.path.join(root, name)
    return modules


def imported_modules(module: str, path: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, prove_jax module) for every import in the file, at any depth (function-level too);
    `from A import B` counts as module A.B when that is one of the `known` modules."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found += [(node.lineno, f"{target}.{a.name}" if f"{target}.{a.name}" in known else target)
                      for a in node.names]
    return [(line, name) for line, name in found if name == "prove_jax" or name.startswith("prove_jax.")]


def test_no_module_imports_upward():
    modules = package_modules()
    assert "prove_jax.models.qwen2" in modules and "prove_jax.cli.main" in modules  # the walk sees them
    upward = []
    for module, path in sorted(modules.items()):
        mine = layer_of(module)
        for line, target in imported_modules(module, path, set(modules)):
            theirs = layer_of(target)
            if LAYERS[theirs] > LAYERS[mine]:
                upward.append(f"{os.path.relpath(path, REPO)}:{line}: {module} ({mine}) imports "
                              f"{target} ({theirs})")
    assert not upward, "upward imports (layer order: base < models < checkpoints, data < decoding " \
                       "< training, serving < evaluation < cli):\n" + "\n".join(upward)


def test_the_import_walk_catches_an_upward_import(tmp_path):
    """The check itself: a function-level, a relative and a `from prove_jax import` import are seen."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from prove_jax.decoding import Decoder\n"
                   "from ..training import loop\nfrom prove_jax import evaluation, files, __version__\n")
    found = imported_modules("prove_jax.models.m", str(src), set(package_modules()))
    assert [(line, layer_of(name)) for line, name in found] == [
        (3, "training"), (4, "evaluation"), (4, "base"), (4, "base"), (2, "decoding")]
    assert [name for _, name in found][2:4] == ["prove_jax.files", "prove_jax"]


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=120, **kwargs)


def test_importing_models_loads_nothing_above_them():
    r = _python("import json, sys, prove_jax.models, prove_jax.models.qwen2\n"
                "print(json.dumps(sorted(m for m in sys.modules if m.startswith('prove_jax'))))")
    assert r.returncode == 0, r.stderr
    loaded = json.loads(r.stdout)
    assert "prove_jax.models.qwen2" in loaded
    above = [m for m in loaded if layer_of(m) not in ("base", "models")]
    assert not above, f"import prove_jax.models loaded {above}"


def test_importing_the_package_and_asking_for_help_load_no_jax():
    """A notebook's `import prove_jax` and `prove-jax --help` answer in well under a second."""
    r = _python("import sys, prove_jax\nassert 'jax' not in sys.modules, 'jax'\nprint(prove_jax.__version__)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "prove_jax", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and all(f"  {c} " in r.stdout for c in SUBCOMMANDS), r.stdout
    imported = {line.rpartition("|")[2].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "prove_jax.cli.main" in imported and "jax" not in imported


def _source_copy(dest: str) -> None:
    """The files a clone has (tracked, plus new files git does not ignore), copied to dest."""
    r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, cwd=REPO, timeout=60)
    if r.returncode == 0:
        for rel in r.stdout.decode().split("\0"):
            src = os.path.join(REPO, rel)
            if rel and os.path.isfile(src):  # a tracked file deleted in the work tree is not copied
                os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
                shutil.copy2(src, os.path.join(dest, rel))
    else:  # not a git checkout (an unpacked archive): the tree less what builds and runs leave
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache"))


def test_installed_package_runs_from_outside_the_repository(tmp_path):
    """`pip install .` gives a `prove-jax` that lists its commands and decodes with the shipped pair
    from another directory, with the package (and its demo models) read from the install."""
    repo_entries = sorted(os.listdir(REPO))
    src, target, work = tmp_path / "src", tmp_path / "site", tmp_path / "work"
    _source_copy(str(src))
    work.mkdir()
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(src)], capture_output=True, text=True, timeout=300,
                       cwd=str(work))
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(REPO)) == repo_entries  # nothing built into the repository
    demo = target / "prove_jax" / "demo_models"
    shipped = os.path.join(PACKAGE, "demo_models")
    assert sorted(os.path.relpath(os.path.join(d, f), demo) for d, _, fs in os.walk(demo) for f in fs) == \
        sorted(os.path.relpath(os.path.join(d, f), shipped) for d, _, fs in os.walk(shipped) for f in fs)

    env = dict(os.environ, PYTHONPATH=str(target))
    where = subprocess.run([sys.executable, "-c", "import prove_jax; print(prove_jax.__file__)"],
                           capture_output=True, text=True, cwd=str(work), env=env, timeout=60)
    assert where.stdout.startswith(str(target)), where.stdout + where.stderr  # not the repository's copy
    command = str(target / "bin" / "prove-jax")
    r = subprocess.run([command, "--help"], capture_output=True, text=True, cwd=str(work), env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all(f"  {c} " in r.stdout for c in SUBCOMMANDS), r.stdout

    prompts = [{"id": "a", "prompt": "def add(a, b):\n"}, {"id": "b", "prompt": "import os\n\n\ndef main():\n"}]
    (work / "P.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    r = subprocess.run([command, "generate", "--input", "P.jsonl", "--output", "O.jsonl", "--mode", "lossless",
                        "--max-new-tokens", "8"], capture_output=True, text=True, cwd=str(work), env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (work / "O.jsonl").read_text().splitlines()]
    assert [x["id"] for x in records] == ["a", "b"]
    assert all(len(x["output_ids"]) == 8 and x["text"] and x["stats"]["generated_tokens"] == 8 for x in records)


SHIMS = {"infer.generate": "generate", "infer.benchmark": "benchmark", "infer.demo": "demo", "train.train": "train"}


@pytest.fixture(scope="module")
def shim_help(tmp_path_factory):
    """{shim: (exit code, stdout, stderr)} of `python -m SHIM --help` from the repository root,
    the launches sharing one interpreter's jax and flax import (tests/prewarmed.py)."""
    return prewarmed.run_each({s: ["-m", s, "--help"] for s in SHIMS}, REPO, dict(os.environ),
                              tmp_path_factory.mktemp("logs"))


@pytest.mark.parametrize("shim, command", list(SHIMS.items()))
def test_repository_entry_points_are_the_commands(shim, command, shim_help):
    """`python -m infer.generate` etc. from the repository root run the `prove-jax` command itself."""
    code, stdout, stderr = shim_help[shim]
    assert code == 0, stderr
    assert stdout.startswith(f"usage: prove-jax {command} ")
