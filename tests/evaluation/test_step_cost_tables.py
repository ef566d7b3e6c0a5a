"""The step-cost report's file (benchmarks/bench_decode_step_cost.py) and the TPU speed
prediction made from it (benchmarks/predict_tpu_speed.py), on hand-made rows: each row keys
its own cell (slice, proposer, context, batch, mode, K, layout, attention), a repriced cell
replaces its row, the markdown has a table per proposer and context, and the prediction's
speedups, best layout and "Not priced" list follow from the rows given (no libtpu needed).
"""

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _script("bench_decode_step_cost")
predict = _script("predict_tpu_speed")

SETTINGS = {"ar": (1, None, 1), "lossless": (6, 2, 19), "verify": (8, None, 15)}


def row(accelerator="v5e-4", proposer="qwen2.5-7b", context=8192, batch=16, mode="ar", page=None,
        ms=10.0, fits=True, waste=1.0, rows=None):
    """A priced step row as bench_decode_step_cost writes it, its step `ms` at the roofline (1 GB
    per ms), moving `waste` times what it must."""
    k, g, width = SETTINGS[mode]
    label = {"ar": "ar", "lossless": "lossless K=6 G=2", "verify": "verify K=8"}[mode]
    label += f", paged ({page})" if page else ""
    r = dict(accelerator=accelerator, proposer=proposer, verifier="qwen2.5-0.5b" if mode == "verify" else None,
             context=context, chip=accelerator.split("-")[0], batch=batch, rows=rows or batch, mode=mode, block_size=k,
             groups=g, step_width=width, page_size=page, attention="pallas_tpu",
             label=f"{label}, pallas_tpu", mesh={"data": 1, "fsdp": 1, "tensor": 4},
             weight_bytes=4 << 30, proposer_params=7_600_000_000,
             verifier_params=500_000_000 if mode == "verify" else 0, does_not_fit="", programs=[],
             hbm_bandwidth=1e12, peak_flops=1e15)
    if fits:
        r["programs"] = [dict(name="step", hbm_bytes=int(ms * 1e9), min_hbm_bytes=int(ms * 1e9 / waste), waste=waste,
                              flops=10 ** 12, roofline_seconds=ms / 1e3, collectives={})]
    else:
        r["does_not_fit"] = "the step program does not fit a chip"
    return r


def test_a_repriced_cell_replaces_its_row_and_others_join(tmp_path):
    """`--append`/`--merge` keep one row per cell: the same cell priced again replaces its row
    where it stood; another context, proposer, layout or K is another cell. A file from before
    rows carried their pair and context gets them from its top level."""
    old = [row(mode=m) for m in ("ar", "lossless", "verify")]
    again = row(mode="lossless", ms=7.0)
    others = [row(mode="lossless", context=2048), row(mode="lossless", proposer="qwen2.5-32b"),
              row(mode="lossless", page=64), dict(row(mode="verify"), block_size=16)]
    merged = bench.merge_rows(old, [again, *others])
    assert len(merged) == len(old) + len(others)
    assert merged[1] is again and merged[0] is old[0] and merged[2] is old[2]
    assert len({bench.cell_key(r) for r in merged}) == len(merged)

    legacy = [{k: v for k, v in r.items() if k not in ("proposer", "verifier", "context")} for r in old]
    path = tmp_path / "decode_step_cost.json"
    path.write_text(json.dumps(dict(proposer="qwen2.5-32b", verifier="qwen2.5-3b", context=8192, rows=legacy)))
    loaded = bench.load_rows(str(path))
    assert [(r["proposer"], r["verifier"], r["context"]) for r in loaded] == [
        ("qwen2.5-32b", None, 8192), ("qwen2.5-32b", None, 8192), ("qwen2.5-32b", "qwen2.5-3b", 8192)]


def test_the_markdown_has_a_table_per_proposer_and_context():
    rows = [row(mode="ar", context=2048), row(mode="verify", context=2048), row(mode="ar"),
            row(accelerator="v5p-8", proposer="qwen2.5-32b", mode="ar")]
    md = "\n".join(bench.markdown(rows, "0"))
    titles = [line for line in md.splitlines() if line.startswith("## ")]
    assert titles == ["## qwen2.5-32b, rows filled to 8192 slots",
                      "## qwen2.5-7b (qwen2.5-0.5b verifier in verify), rows filled to 2048 slots",
                      "## qwen2.5-7b (qwen2.5-0.5b verifier in verify), rows filled to 8192 slots"]
    sections = md.split("\n## ")
    assert sections[2].count("| v5e-4 |") == 2 and sections[3].count("| v5e-4 |") == 1


def _predict(tmp_path, rows):
    cost = tmp_path / "decode_step_cost.json"
    cost.write_text(json.dumps(dict(rows=rows)))
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(dict(meta=dict(batch_sizes=[1]), records=[
        dict(mode="lossless", setting="K=6,G=2", tokens_per_forward=4.0),
        dict(mode="lossless", setting="K=4,G=2", tokens_per_forward=9.0),
        dict(mode="verify", setting="K=8,top1", tokens_per_forward=5.0)])))
    (tmp_path / "h200").mkdir(exist_ok=True)
    out = tmp_path / "out"
    assert predict.main(["--step-cost", str(cost), "--tokens", str(tokens), "--h200", str(tmp_path / "h200"),
                         "--out", str(out)]) == 0
    doc = json.loads((out / "tpu_speed_prediction.json").read_text())
    return doc, (out / "tpu_speed_prediction.md").read_text()


def test_the_prediction_takes_each_cells_best_layout_and_lists_what_is_missing(tmp_path):
    rows = [row(mode="ar", ms=10.0), row(mode="lossless", ms=12.0), row(mode="lossless", page=64, ms=11.0),
            row(mode="verify", ms=15.0), row(mode="verify", page=64, ms=20.0),
            row(mode="ar", batch=64, ms=20.0, waste=2.0), row(mode="lossless", batch=64, fits=False),
            row(mode="verify", batch=64, ms=25.0),
            row(mode="ar", batch=1, rows=2), row(mode="lossless", batch=1, rows=2)]
    doc, md = _predict(tmp_path, rows)
    best = {(r["batch"], r["mode"]): r for r in doc["rows"] if r["best_layout"]}
    assert best[(16, "lossless")]["paged"] and not best[(16, "verify")]["paged"]
    assert best[(16, "lossless")]["speedup"] == pytest.approx(4.0 * 10 / 11)
    assert best[(16, "verify")]["speedup"] == pytest.approx(5.0 * 10 / 15)
    assert best[(64, "verify")]["tokens_per_second"] == pytest.approx(64 * 5.0 / 0.025)
    assert (64, "lossless") not in best
    # one request on two rows (the rows rounded up to the data shards): its tokens/s is one row's
    assert best[(1, "lossless")]["tokens_per_second"] == pytest.approx(1 * 4.0 / 0.010)
    assert "| qwen2.5-7b (qwen2.5-0.5b verifier) | v5e-4 | 16 | - | 3.64x / 3.33x |" in md
    assert "| lossless K=6 G=2, paged (64), pallas_tpu | paged (contiguous 3.33x) |" in md
    missing = doc["not_priced"]
    assert "v5e-4 qwen2.5-7b 8192 slots batch 64 lossless (does not fit)" in missing
    assert "v5e-4 qwen2.5-7b 8192 slots batch 1 verify (not run)" in missing
    assert not any(m.startswith("v5e-4 qwen2.5-7b 8192 slots batch 16") for m in missing)
    assert "v5e-4 qwen2.5-7b 8192 slots batch 1 verify (not run)" in md
    assert "v5e-4 qwen2.5-7b 2048 slots batch 1 (not run)" in missing
    # an AR step at twice its must-move bytes: the speedup against AR at those bytes is said too
    assert best[(64, "verify")]["speedup_vs_copy_free_ar"] == pytest.approx(5.0 * 10 / 25)
    assert "| v5e-4 | 64 | - | - / 2.00x† |" in md and "| 2.00x† (4.00x against AR's program) |" in md
    assert "v5e-4 qwen2.5-7b 8k batch 64: ratio 2.00" in md
    assert best[(16, "verify")]["speedup_vs_copy_free_ar"] == pytest.approx(best[(16, "verify")]["speedup"])

    # the list is computed from the rows: price the 64-row lossless cell and it leaves the list
    doc, md = _predict(tmp_path, rows[:6] + [row(mode="lossless", batch=64, ms=21.0)] + rows[7:])
    assert not any("batch 64" in m and "v5e-4" in m and "8192" in m for m in doc["not_priced"])

    # where AR's step does not fit, the modes keep their tokens/s and have no speedup
    doc, md = _predict(tmp_path, rows[:5] + [row(mode="ar", batch=64, fits=False)] + rows[6:])
    (verify,) = [r for r in doc["rows"] if r["batch"] == 64]
    assert verify["speedup"] is None and verify["tokens_per_second"] == pytest.approx(64 * 5.0 / 0.025)
    assert "| v5e-4 | 64 | - | - / no AR |" in md
    assert "v5e-4 qwen2.5-7b 8192 slots batch 64 ar/lossless (does not fit)" in doc["not_priced"]
