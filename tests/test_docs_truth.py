"""What the help and docs say about features is what the code does."""

import os

from prove_jax.cli.main import usage
from prove_jax.cli import demo
from prove_jax.decoding.sampling import SamplingParams
from tests.decode_helpers import ROOT


def test_the_help_names_the_modes_the_demo_runs():
    args = demo.parse_args([])
    modes = [s.mode for s in demo.demo_settings(args, "cpu", have_head=True)]
    assert modes == ["ar", "lossless"]
    line = next(line for line in usage().splitlines() if line.strip().startswith("demo"))
    assert "AR and lossless" in line and "four" not in line


def test_method_doc_describes_the_sampling_that_exists():
    assert SamplingParams(temperature=0.7).validate().temperature == 0.7
    text = open(os.path.join(ROOT, "docs", "method.md")).read()
    section = text[text.index("### 3f."): text.index("## 4.")]
    assert "not implemented" not in section and "min(1, p_i(d_i) / q_i(d_i))" in section
