"""The speed / quality trade-off figure of the decoding benchmark (as in the MARS/ProVe papers).

One point per benchmark record: speedup over our AR (y) against agreement with AR (x) and, when
prompts were graded, against task accuracy with its 95% interval as an error bar (x). Colour =
mode, marker = batch size. A panel with nothing to show is left out: no accuracy panel when no
prompt was graded, nor when every record scored the same (then one line under the figure says
so, as `flat_accuracy_line` does in the markdown report).
"""

from __future__ import annotations

from typing import Sequence

from prove_jax.files import replacing

MODE_COLOURS = {
    "ar": "black",
    "lossless": "tab:green",
    "relaxed": "tab:olive",
    "threshold": "tab:orange",
    "verify": "tab:blue",
    "hf_greedy": "tab:gray",
    "hf_assisted": "tab:purple",
    "hf_prompt_lookup": "tab:brown",
}
BATCH_MARKERS = ("o", "s", "^", "D", "v", "P")


def graders_of(records: Sequence[dict]) -> list[str]:
    """The graders that graded the records' prompts, in order of first appearance."""
    return list(dict.fromkeys(g for r in records for g in (r.get("graded_by") or {})))


def flat_accuracy_line(records: Sequence[dict]) -> str:
    """One line saying every record scored the same accuracy, in place of a panel of points in
    a column (HumanEval with the 4M-parameter demo pair: 0 for every mode); '' otherwise, and
    when no prompt was graded."""
    graded = [r for r in records if r.get("accuracy") is not None]
    if not graded or len({r["correct"] for r in graded}) > 1:
        return ""
    r = graded[0]
    lo, hi = r["accuracy_ci95"]
    return (
        f"Accuracy ({', '.join(graders_of(records))}): every mode got {r['correct']} of "
        f"{r['graded']} graded prompts right ({r['accuracy']:.3f}, 95% interval "
        f"{lo:.3f}-{hi:.3f}); the plot has no accuracy panel."
    )


def figure_panels(records: Sequence[dict]) -> list[tuple[str, str]]:
    """(record key on the x axis, its label) of each panel: agreement always; accuracy where
    prompts were graded and the records differ in it (`flat_accuracy_line`)."""
    panels = [("agreement_with_ar", "token agreement with AR")]
    if any(r.get("accuracy") is not None for r in records) and not flat_accuracy_line(records):
        panels.append(
            ("accuracy", f"accuracy ({', '.join(graders_of(records))}), Wilson 95% interval")
        )
    return panels


def trade_off_figure(records: Sequence[dict], path: str, title: str = "") -> None:
    """Write the PNG atomically (temp file + rename)."""
    import matplotlib  # optional, and slow to import: only a figure needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = figure_panels(records)
    flat = flat_accuracy_line(records)
    batches = sorted({r["batch_size"] for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], panels):
        for r in records:
            if r.get(key) is None or r.get("speedup_vs_ar") is None:
                continue
            marker = BATCH_MARKERS[batches.index(r["batch_size"]) % len(BATCH_MARKERS)]
            colour = MODE_COLOURS.get(r["mode"], "tab:red")
            if key == "accuracy":
                lo, hi = r["accuracy_ci95"]
                ax.errorbar(
                    r[key],
                    r["speedup_vs_ar"],
                    xerr=[[r[key] - lo], [hi - r[key]]],
                    color=colour,
                    marker=marker,
                    ms=6,
                    alpha=0.85,
                    elinewidth=0.8,
                    capsize=2,
                )
            else:
                ax.scatter(
                    r[key], r["speedup_vs_ar"], color=colour, marker=marker, s=40, alpha=0.85
                )
            if r["batch_size"] == batches[0] and r["setting"] != "-":
                ax.annotate(r["setting"], (r[key], r["speedup_vs_ar"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        ax.set_xlim(-0.02, 1.02)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput / our AR (same batch size)")
        ax.grid(alpha=0.3)
    modes = [m for m in MODE_COLOURS if any(r["mode"] == m for r in records)]
    handles = [plt.Line2D([], [], color=MODE_COLOURS[m], marker="o", ls="", label=m) for m in modes]
    handles += [
        plt.Line2D(
            [],
            [],
            color="black",
            marker=BATCH_MARKERS[i % len(BATCH_MARKERS)],
            ls="",
            label=f"batch {b}",
        )
        for i, b in enumerate(batches)
    ]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if flat:
        fig.subplots_adjust(bottom=max(fig.subplotpars.bottom, 0.18))
        fig.text(0.02, 0.01, flat, fontsize=7, ha="left", va="bottom", wrap=True)
    try:
        with replacing(path, suffix=".png") as tmp:  # savefig creates it: umask permissions
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
