"""A benchmark report: its markdown table and notes, the machine it ran on, and the JSON and
markdown files written whole."""

from __future__ import annotations

import json
import os
import platform
from typing import Sequence

import jax

from prove_jax.decoding.layouts import LosslessLayout
from prove_jax.files import atomic_write_text
from prove_jax.models.compute import default_cpu_form


def cpu_description() -> str:
    """The CPU model (Linux), its AVX-512 support and the matmul form decode steps use on it;
    "" off CPU. Benchmark machines differ between runs, and so does what is fastest on them."""
    if jax.default_backend() != "cpu":
        return ""
    name, avx512 = platform.processor() or platform.machine(), False
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        name = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), name)
        avx512 = any(l.startswith("flags") and " avx512f" in l for l in lines)
    except OSError:
        pass
    return f"{name}, {'AVX-512' if avx512 else 'no AVX-512'}, {default_cpu_form()} matmuls"


def device_description() -> str:
    """What a benchmark ran on: the CPU description on CPU, else the accelerator's kind."""
    return cpu_description() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind


def write_results(out_dir: str, name: str, doc: dict, md_lines: Sequence[str]) -> None:
    """A benchmark's results as NAME.json and NAME.md under `out_dir`, each written whole."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    atomic_write_text(base + ".json", json.dumps(doc, indent=2) + "\n")
    atomic_write_text(base + ".md", "\n".join(md_lines) + "\n")
    print(f"wrote {base}.json and {base}.md")


def lossless_note(records: Sequence[dict]) -> str:
    """Markdown lines: each lossy row against the fastest lossless setting of its batch size
    (`add_vs_lossless`), or '' when no record has one."""
    lines = []
    for r in records:
        if r.get("vs_lossless") is None:
            continue
        per_round = ", ".join(f"{x:.2f}x" for x in r["vs_lossless_rounds"])
        by_round = f" (by round: {per_round})" if len(r["vs_lossless_rounds"]) > 1 else ""
        lines.append(f"- batch {r['batch_size']}, {r['mode']} {r['setting']}: "
                     f"{r['vs_lossless']:.2f}x lossless {r['fastest_lossless']}" + by_round)
    if not lines:
        return ""
    return ("\nAgainst the fastest lossless setting of the run at the same batch size (median "
            "passes; by round: each round's passes, which ran back to back):\n\n"
            + "\n".join(lines) + "\n")


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def accuracy_cell(r: dict) -> str:
    """'0.250 [0.102, 0.495]': accuracy and its Wilson 95% interval, or '-' where not graded."""
    if r.get("accuracy") is None:
        return "-"
    lo, hi = r["accuracy_ci95"]
    return f"{r['accuracy']:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown_table(records: Sequence[dict]) -> str:
    """One row per record, in record order; with a prefill baseline (`add_decode_only`), a
    column of the decode loop's speedup without prefill. The column follows from the baseline
    having been measured, not from its outcome: a row where the baseline was no shorter than
    the run (few new tokens) shows '-' there, and the table keeps its shape."""
    decode_only = any(r.get("prefill_seconds") is not None for r in records)
    extra = " speedup without prefill |" if decode_only else ""
    head = ("| mode | setting | batch | tokens/forward | tok/s | speedup vs ar | fastest passes |"
            + extra + " agreement (token) | exact match | accuracy [95% CI] | compile s |\n"
            + "|---" * (11 + decode_only) + "|\n")
    rows = []
    for r in records:
        setting = r["setting"]
        eff = r.get("effective_options")
        if eff:  # adaptive: what actually ran at this batch size
            groups = (LosslessLayout.build(eff["block_size"], eff["max_groups"]).num_groups
                      if eff["mode"] == "lossless" else None)
            setting += (f" (K={eff['block_size']},G={groups})" if groups is not None else
                        " (chose ar: AR's timing)" if r.get("ran_as_ar") else f" ({eff['mode']})")
        rows.append(f"| {r['mode']} | {setting} | {r['batch_size']} "
                    f"| {r['tokens_per_forward']:.2f} "
                    f"| {r['tokens_per_second']:.1f} | {_ratio(r['speedup_vs_ar'])} "
                    f"| {_ratio(r.get('speedup_fastest_vs_ar'))} "
                    + (f"| {_ratio(r.get('decode_speedup_vs_ar'))} " if decode_only else "")
                    + f"| {100 * r['agreement_with_ar']:.1f}% "
                    f"| {100 * r['exact_match_with_ar']:.0f}% "
                    f"| {accuracy_cell(r)} | {r['compile_seconds']:.1f} |")
    return head + "\n".join(rows) + "\n"
