"""Several `python SCRIPT ARGS` / `python -m MODULE ARGS` launches that each only start up and
answer (`--help`), run as children forked from one interpreter that has already imported the
third-party libraries they all load (jax, flax: seconds each time). Each child gets the
sys.path, argv and cwd its own launch would have (the script's folder or the cwd first, the
caller's environment), so how it finds prove_jax and its own modules is still its own; only
the libraries' import is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# `run_argv(argv)`: `python *argv` run in this (forked) process, as the interpreter would start
# it (the script's folder, or for -m the cwd, first on sys.path); its exit code. Shared with the
# multi-host tests' host interpreter (tests/multihost.py).
RUN_ARGV = r"""
import runpy, sys, traceback

def run_argv(argv):
    code = 0
    try:
        if argv[0] == "-m":  # python -m puts the cwd first
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT puts the script's folder first
            sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    return code
"""

RUNNER = r"""
import json, os
import flax.nnx, jax, jax.numpy, numpy  # noqa: F401
""" + RUN_ARGV + r"""
commands, out = json.loads(sys.argv[1]), sys.argv[2]
codes = {}
for name, argv in commands.items():
    log = os.path.join(out, name)
    pid = os.fork()
    if pid == 0:
        for fd, ext in ((1, ".out"), (2, ".err")):
            os.dup2(os.open(log + ext, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = run_argv(argv)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
with open(os.path.join(out, "codes.json"), "w") as f:
    json.dump(codes, f)
"""


def run_each(commands: dict[str, list[str]], cwd, env: dict[str, str], logs) -> dict[str, tuple[int, str, str]]:
    """{name: (exit code, stdout, stderr)} of `python *ARGV` for each {name: ARGV} (ARGV starts
    with a script's path or with "-m"), run from `cwd` with `env`; `logs`: an empty folder."""
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(commands), str(logs)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(logs, "codes.json")) as f:
        codes = json.load(f)

    def read(path):
        with open(path) as f:
            return f.read()
    return {n: (codes[n], read(os.path.join(logs, n + ".out")), read(os.path.join(logs, n + ".err")))
            for n in commands}
