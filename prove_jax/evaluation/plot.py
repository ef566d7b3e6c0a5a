"""The speed / quality trade-off figure of the decoding benchmark (as in the MARS/ProVe papers).

One point per benchmark record: speedup over our AR (y) against agreement with AR and, when
HumanEval was scored, against pass@1 (x). Colour = mode, marker = batch size.
"""

from __future__ import annotations

import os
import uuid
from typing import Sequence

MODE_COLOURS = {"ar": "black", "lossless": "tab:green", "threshold": "tab:orange",
                "verify": "tab:blue", "hf_greedy": "tab:gray", "hf_assisted": "tab:purple",
                "hf_prompt_lookup": "tab:brown"}
BATCH_MARKERS = ("o", "s", "^", "D", "v", "P")


def trade_off_figure(records: Sequence[dict], path: str, title: str = "") -> None:
    """Write the PNG atomically (temp file + rename)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("agreement_with_ar", "token agreement with AR")]
    if any(r.get("pass_at_1") is not None for r in records):
        panels.append(("pass_at_1", "HumanEval pass@1"))
    batches = sorted({r["batch_size"] for r in records})
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], panels):
        for r in records:
            if r.get(key) is None or r.get("speedup_vs_ar") is None:
                continue
            marker = BATCH_MARKERS[batches.index(r["batch_size"]) % len(BATCH_MARKERS)]
            ax.scatter(r[key], r["speedup_vs_ar"], color=MODE_COLOURS.get(r["mode"], "tab:red"),
                       marker=marker, s=40, alpha=0.85)
            if r["batch_size"] == batches[0] and r["setting"] != "-":
                ax.annotate(r["setting"], (r[key], r["speedup_vs_ar"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        ax.axhline(1.0, color="black", lw=0.6, ls="--")
        xs = [r[key] for r in records if r.get(key) is not None]
        ax.set_xlim(-0.02, 1.02 if key == "agreement_with_ar" else max(0.2, 1.2 * max(xs, default=0)))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("throughput / our AR (same batch size)")
        ax.grid(alpha=0.3)
    modes = [m for m in MODE_COLOURS if any(r["mode"] == m for r in records)]
    handles = [plt.Line2D([], [], color=MODE_COLOURS[m], marker="o", ls="", label=m) for m in modes]
    handles += [plt.Line2D([], [], color="black", marker=BATCH_MARKERS[i % len(BATCH_MARKERS)], ls="",
                           label=f"batch {b}") for i, b in enumerate(batches)]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex[:12]}.png")  # savefig creates it: umask permissions
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
