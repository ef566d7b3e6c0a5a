"""Predicted decode speed of the paper's pairs on TPU slices: the step-cost report's roofline
times (benchmarks/decode_step_cost.json) times the tokens per forward measured on HumanEval.

    .venv/bin/python benchmarks/predict_tpu_speed.py [--out benchmarks]

For each slice, proposer, context, batch size, mode and KV layout of decode_step_cost.json
(`cell`): a step takes at least its roofline time (the compiled step's HBM bytes over the
chip's bandwidth, or its FLOPs over its peak), and commits `tokens/forward` tokens per row, as
the shipped proposer, inflated to a real shape, measured on HumanEval prompts
(benchmarks/humaneval_traj_verifier_0.5b_shape.json: lossless K=6 G=2, verify K=8 top-1 with
the trajectory-trained verifier; AR commits 1). So

    predicted tokens/s = requests x tokens/forward / roofline step time, per slice
    predicted speedup  = tokens/forward x (AR's roofline step) / (the mode's roofline step)

against AR on the contiguous cache. Lossless and verify take the KV layout (contiguous or the
paged pool) whose step is the faster, where both were priced ("best layout"). The roofline is
a floor on step time, reached only by a step at the bandwidth limit; where a device measured
step times, the prediction is checked against them: the H200's lossless K=8 G=2 runs
(benchmarks/h200/) give what its wide step cost in AR steps (tokens per forward over speedup),
and the *H200-calibrated* column divides the tokens per forward by that instead (lossless;
verify adds to it how much longer its roofline step is than lossless's, in AR steps).

Writes tpu_speed_prediction.json and tpu_speed_prediction.md; its notes are computed from
those inputs, the "Not priced" list from which of `ASKED`'s cells have no priced row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "runs", "benchmarks")
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_decode_step_cost import load_rows  # noqa: E402  (the step-cost rows, each with its pair)

GIB = 1024 ** 3
# The cells the prediction is asked for: each proposer on its slices, at these contexts, batch
# sizes and modes (lossless and verify in their best layout).
ASKED = {"qwen2.5-32b": ("v5p-8", "v6e-8"), "qwen2.5-7b": ("v5e-4", "v6e-4")}
ASKED_CONTEXTS = (2048, 8192)
ASKED_BATCHES = (1, 16, 64)
MODES = ("ar", "lossless", "verify")
# a step moving more than this over what it must is a wasteful program (the bound
# tests/decoding/test_step_cost.py holds TPU steps to); an AR step above it flatters the speedups
WASTE_BOUND = 1.3
# the settings HumanEval measured tokens per forward at: (benchmark setting, block_size, groups)
MEASURED = {"lossless": ("K=6,G=2", 6, 2), "verify": ("K=8,top1", 8, None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-cost", default=os.path.join(HERE, "decode_step_cost.json"))
    p.add_argument("--tokens", default=os.path.join(HERE, "humaneval_traj_verifier_0.5b_shape.json"),
                   help="benchmark JSON with the measured tokens per forward")
    p.add_argument("--h200", default=os.path.join(HERE, "h200"), help="the H200's measured decode runs")
    p.add_argument("--attention", default="pallas_tpu",
                   help="the attention path whose rows are used where the step cost has several (default "
                        "pallas_tpu: what generate runs on TPU)")
    p.add_argument("--out", default=RESULTS, help=f"results directory (default {RESULTS}; the committed ones: benchmarks)")
    return p.parse_args(argv)


def measured_tokens(path: str) -> tuple[dict, dict]:
    """({mode: tokens per forward} of the benchmark's lossless K=6,G=2 and verify K=8,top1 rows,
    its meta)."""
    with open(path) as f:
        doc = json.load(f)
    out = {"ar": 1.0}
    for r in doc["records"]:
        if r["mode"] in MEASURED and MEASURED[r["mode"]][0] == r["setting"]:
            out[r["mode"]] = r["tokens_per_forward"]
    return out, doc.get("meta", {})


def h200_step_ratios(directory: str) -> tuple[dict, dict]:
    """({batch: a lossless K=8,G=2 step in AR steps} measured on the H200 (tokens per forward
    over speedup), the runs' meta)."""
    out, meta = {}, {}
    for name in ("decode_b1.json", "decode_b16.json"):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            doc = json.load(f)
        meta = doc.get("meta", meta)
        for r in doc["records"]:
            if r["mode"] == "lossless" and r["setting"] == "K=8,G=2":
                out[r["batch_size"]] = r["tokens_per_forward"] / r["speedup_vs_ar"]
    return out, meta


def cell(r: dict) -> tuple:
    """(slice, proposer, context, batch, mode, paged): what a prediction row is of."""
    return (r["accelerator"], r["proposer"], r["context"], r["batch"], r["mode"], bool(r.get("page_size")))


def step_rows(rows: list[dict], attention: str) -> tuple[dict, dict]:
    """({cell: priced row with its "step" program}, {cell: why it has none}) of the rows at the
    measured settings, `attention`'s row winning where a cell has several."""
    steps, unpriced = {}, {}
    for r in rows:
        if r["mode"] in MEASURED and (r.get("block_size"), r.get("groups")) != MEASURED[r["mode"]][1:]:
            continue  # tokens per forward measured at one setting per mode
        key = cell(r)
        if r.get("error") or r.get("does_not_fit") or not r.get("programs"):
            why = "does not fit" if r.get("does_not_fit") else "failed to compile"
            unpriced.setdefault(key, why)
            continue
        if key in steps and steps[key].get("attention") == attention and r.get("attention") != attention:
            continue  # the attention path generate runs there wins over an older row
        steps[key] = dict(r, step=next(p for p in r["programs"] if p["name"] == "step"))
    for key in steps:
        unpriced.pop(key, None)
    return steps, unpriced


def label(r: dict) -> str:
    return r["label"] if r.get("attention") in (None, *r["label"].split(", ")) else f"{r['label']}, {r['attention']}"


def predict(steps: dict, tokens: dict, ratios: dict) -> list[dict]:
    """A row per priced cell: predicted tokens/s, and the speedup where an AR row is beside it
    (None where AR's step was not priced: it does not fit), each lossless and verify row marked
    `best_layout` where its step is the fastest of its layouts."""
    rows = []
    for key, r in sorted(steps.items()):
        accelerator, proposer, context, batch, mode, paged = key
        if mode not in tokens:
            continue
        ar = steps.get((accelerator, proposer, context, batch, "ar", False))
        t, tau = r["step"]["roofline_seconds"], tokens[mode]
        row = dict(accelerator=accelerator, proposer=proposer, verifier=r.get("verifier"), context=context,
                   batch=batch, rows=r["rows"], mode=mode, label=label(r), paged=paged, mesh=r.get("mesh"),
                   weight_bytes=r.get("weight_bytes"), tokens_per_forward=tau, step_ms=t * 1e3,
                   waste=r["step"]["waste"], tokens_per_second=min(batch, r["rows"]) * tau / t, ar_step_ms=None,
                   speedup=None, ar_waste=None, speedup_vs_copy_free_ar=None)
        rows.append(row)
        if ar is None:
            continue
        t_ar = ar["step"]["roofline_seconds"]
        row.update(ar_step_ms=t_ar * 1e3, speedup=tau * t_ar / t,
                   ar_other_mesh=mode != "ar" and ar.get("mesh") != r.get("mesh"))
        # AR as a copy-free program would step: its must-move bytes (or its FLOPs) at the roofline
        a = ar["step"]
        if ar.get("hbm_bandwidth") and ar.get("peak_flops"):
            t_ar_free = max(a["min_hbm_bytes"] / ar["hbm_bandwidth"], a["flops"] / ar["peak_flops"])
            row.update(ar_waste=a["waste"], speedup_vs_copy_free_ar=tau * t_ar_free / t)
        ratio = ratios.get(batch)
        if ratio is not None and mode != "ar":
            # the measured wide-step cost in AR steps; verify's step also runs its verifier, whose share
            # of the roofline step is added to it (against lossless in the same layout)
            lossless = steps.get((accelerator, proposer, context, batch, "lossless", paged))
            extra = (t - lossless["step"]["roofline_seconds"]) / t_ar if mode == "verify" and lossless else 0.0
            row["h200_calibrated_speedup"] = tau / (ratio + max(0.0, extra))
    best = {}
    for row in rows:
        k = (row["accelerator"], row["proposer"], row["context"], row["batch"], row["mode"])
        if k not in best or row["step_ms"] < best[k]["step_ms"]:
            best[k] = row
    for row in rows:
        row["best_layout"] = best[(row["accelerator"], row["proposer"], row["context"], row["batch"],
                                   row["mode"])] is row
    return rows


def not_priced(steps: dict, unpriced: dict) -> list[str]:
    """The asked cells (`ASKED`) with no priced row, each said once: by slice, proposer,
    context and batch where all of a cell's modes miss, else by mode."""
    out = []
    for proposer, slices in ASKED.items():
        for accelerator in slices:
            for context in ASKED_CONTEXTS:
                for batch in ASKED_BATCHES:
                    missing = [m for m in MODES
                               if not any((accelerator, proposer, context, batch, m, paged) in steps
                                          for paged in (False, True))]
                    if not missing:
                        continue
                    whys = {unpriced.get((accelerator, proposer, context, batch, m, False), "not run")
                            for m in missing}
                    modes = "" if len(missing) == len(MODES) else " " + "/".join(missing)
                    out.append(f"{accelerator} {proposer} {context} slots batch {batch}{modes} "
                               f"({', '.join(sorted(whys))})")
    return out


def mesh_text(mesh: dict | None) -> str:
    return "one chip" if not mesh else " x ".join(f"{k} {v}" for k, v in mesh.items() if v > 1) or "one device"


def mesh_notes(rows: list[dict]) -> list[str]:
    """Per slice and proposer, the meshes its cells ran on where they differ (the weights and KV
    a mode carries decide the tensor size `generate` picks): mesh (weights per chip): the modes
    at their batch sizes (and contexts, in k slots)."""
    by = {}
    for r in rows:
        mesh = (mesh_text(r["mesh"]), r["weight_bytes"])
        by.setdefault((r["accelerator"], r["proposer"]), {}).setdefault(mesh, {}).setdefault(
            r["mode"], set()).add((r["batch"], r["context"]))
    out = []
    for (accelerator, proposer), meshes in sorted(by.items()):
        if len({m for m, _ in meshes}) < 2:
            continue
        parts = []
        for (mesh, weights), modes in sorted(meshes.items(), key=lambda kv: kv[0][1]):
            cells = ", ".join(f"{m} at " + "/".join(f"{b} ({c // 1024}k)" for b, c in sorted(modes[m]))
                              for m in MODES if m in modes)
            parts.append(f"{mesh} ({weights / GIB:.1f} GiB of weights a chip): {cells}")
        out.append(f"{accelerator} {proposer}: " + "; ".join(parts))
    return out


def step_in_ar_steps(rows: list[dict], mode: str, batches: tuple) -> str:
    """The range of a `mode` step (best layout) in AR steps, roofline, over `batches`, where AR's
    step moves what it must (within WASTE_BOUND)."""
    vals = [r["step_ms"] / r["ar_step_ms"] for r in rows
            if r["mode"] == mode and r["best_layout"] and r["batch"] in batches and r["ar_step_ms"]
            and (r["ar_waste"] or 0) <= WASTE_BOUND]
    return "none priced" if not vals else f"{min(vals):.2f}-{max(vals):.2f}"


def wasteful_ar(r: dict) -> bool:
    return (r.get("ar_waste") or 0) > WASTE_BOUND and r.get("speedup_vs_copy_free_ar") is not None


def fmt_speedup(r: dict | None, both: bool = False) -> str:
    """A row's speedup over AR; "no AR" where AR's step was not priced; against AR at its
    must-move bytes (marked †) where AR's own step is wasteful (`both`: the plain one too)."""
    if r is None:
        return ""
    if r["speedup"] is None:
        return "no AR"
    mark = "‡" if r.get("ar_other_mesh") else ""
    if not wasteful_ar(r) or r["mode"] == "ar":
        return f"{r['speedup']:.2f}x{mark}"
    fair = f"{r['speedup_vs_copy_free_ar']:.2f}x†{mark}"
    return f"{fair} ({r['speedup']:.2f}x against AR's program)" if both else fair


def markdown(rows: list[dict], cost_rows: list[dict], tokens: dict, tokens_meta: dict, ratios: dict,
             h200_meta: dict, steps: dict, unpriced: dict) -> list[str]:
    pairs = {}
    for r in cost_rows:
        if r.get("verifier"):
            pairs.setdefault(r["proposer"], set()).add(r["verifier"])
    pair = lambda p: f"{p} ({', '.join(sorted(pairs[p]))} verifier)" if p in pairs else p  # noqa: E731
    shape = tokens_meta.get("inflated_to", "a real")
    md = ["# Predicted decode speed on TPU slices (from the compiled step and measured tokens per forward)", "",
          f"`benchmarks/predict_tpu_speed.py`: the step-cost report's rows "
          f"([decode_step_cost.md](decode_step_cost.md)), bfloat16, each row filled to its context; tokens per "
          f"forward as HumanEval measured them with the shipped proposer inflated to the {shape} shape "
          f"(lossless K=6 G=2: {tokens.get('lossless', 0):.2f}, verify K=8 top-1: {tokens.get('verify', 0):.2f}; "
          f"[humaneval_traj_verifier_0.5b_shape.md](humaneval_traj_verifier_0.5b_shape.md)), the same for every "
          "pair. *Roofline* assumes each step takes its roofline time: the compiled step's HBM bytes over the "
          "chip's bandwidth (or FLOPs over peak). *H200-calibrated* instead prices a lossless step at what the "
          "H200 measured a K=8 G=2 step to cost in AR steps at that batch size (verify: plus how much longer its "
          "roofline step is than lossless's) "
          f"({', '.join(f'{v:.2f} at batch {k}' for k, v in sorted(ratios.items())) or 'none measured'}). "
          "*Batch b (n rows)*: the mesh rounds the rows up to its data shards; the step is priced with all n "
          "rows filled and tokens/s counts the b requests. Lossless and verify are in their best layout: the KV layout whose step is the faster (the other's "
          "speedup in brackets where both were priced). † marks a speedup against AR at the bytes it must "
          f"move, where AR's own compiled step moves over {WASTE_BOUND}x that (the notes say which and why). "
          "‡ marks a speedup over AR run on another mesh (the notes list the meshes): AR on more data shards "
          "reads more weights a chip each step, so that speedup is partly the mesh, not the mode.", "",
          "## Speedup over AR (roofline), lossless (best layout) / verify", "",
          "| proposer | slice | batch | " + " | ".join(f"{c // 1024}k contexts" for c in ASKED_CONTEXTS) + " |",
          "|---|---|---|" + "---|" * len(ASKED_CONTEXTS)]
    best = {(r["accelerator"], r["proposer"], r["context"], r["batch"], r["mode"]): r
            for r in rows if r["best_layout"]}
    for proposer, slices in ASKED.items():
        for accelerator in slices:
            for batch in ASKED_BATCHES:
                cells = []
                for context in ASKED_CONTEXTS:
                    lo, ve = (best.get((accelerator, proposer, context, batch, m)) for m in ("lossless", "verify"))
                    cells.append("-" if lo is None and ve is None
                                 else f"{fmt_speedup(lo) or '-'} / {fmt_speedup(ve) or '-'}")
                md.append(f"| {pair(proposer)} | {accelerator} | {batch} | " + " | ".join(cells) + " |")
    groups = {}
    for r in rows:
        groups.setdefault((r["proposer"], r["context"]), []).append(r)
    for (proposer, context), group in sorted(groups.items()):
        md += ["", f"## {pair(proposer)}, rows filled to {context} slots", "",
               "| slice | batch | mode | KV (best layout) | tokens/forward | step ms (roofline) | ratio to must | "
               "slice tokens/s (roofline, the batch's requests) | speedup vs AR (roofline) | speedup (H200-calibrated) |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            if not r["best_layout"]:
                continue
            other = [o for o in group if o is not r and o["mode"] == r["mode"] and o["batch"] == r["batch"]
                     and o["accelerator"] == r["accelerator"]]
            layout = "paged" if r["paged"] else "contiguous"
            layout += "".join(f" ({'paged' if o['paged'] else 'contiguous'} {fmt_speedup(o)})" for o in other)
            cal = r.get("h200_calibrated_speedup")
            md.append(f"| {r['accelerator']} | {r['batch']} ({r['rows']} rows) | {r['label']} | {layout} | "
                      f"{r['tokens_per_forward']:.2f} | {r['step_ms']:.2f} | {r['waste']:.2f} | "
                      f"{r['tokens_per_second']:.0f} | {fmt_speedup(r, both=True)} | "
                      f"{'' if cal is None else f'{cal:.2f}x'} |")
    missing = not_priced(steps, unpriced)
    ar_waste = []
    for (accelerator, proposer, context, batch, mode, paged), r in sorted(steps.items()):
        if mode == "ar" and r["step"]["waste"] > WASTE_BOUND:
            top = r["step"].get("largest") or [[0, "", "", "?", "?"]]
            ar_waste.append(f"{accelerator} {proposer} {context // 1024}k batch {batch}: ratio "
                            f"{r['step']['waste']:.2f}, {top[0][0] / GIB:.1f} GiB {top[0][3]} {top[0][4].split('{')[0].lstrip('(')}")
    attention = next((r["attention"] for r in steps.values() if r.get("attention") == "pallas_tpu"), "pallas_tpu")
    other_path = [r for r in rows if r["best_layout"] and attention not in r["label"]]
    shares = {(r["proposer"], r["verifier"]): r["verifier_params"] / r["proposer_params"]
              for r in steps.values() if r.get("verifier") and r.get("verifier_params")}
    meshes = mesh_notes(rows)
    worst = max((r for r in rows if r["best_layout"]), key=lambda r: r["waste"], default=None)
    h200_shape = f"the {h200_meta.get('inflated_to', '?')} shape in {h200_meta.get('compute_dtype', '?')}"
    md += ["", "How far to trust it.",
           "- The roofline column is an upper bound on speed: no step runs faster than its bytes allow, and",
           "  a real step adds launch and synchronisation time, the chunk loop's host round trips and",
           "  whatever the HLO walk does not count (`hlo_cost` prices a Pallas kernel at the cost estimate",
           "  it states, and elementwise FLOPs not at all). Where the step's ratio to what it must move is",
           "  above 1, the compiled program still moves more than it must, and the speedup is the one of",
           "  that program" + (f" (the largest ratio of a row above: {worst['waste']:.2f}, {worst['accelerator']} "
                               f"{worst['proposer']} {worst['label']} at batch {worst['batch']}, {worst['context']} "
                               "slots)" if worst else "") + ". The steps are those `generate` runs on TPU: the",
           f"  attention through the `{attention}` path (`--attention auto`), "
           + (f"except where the step cost has only an older row of another path ({len(other_path)} rows here, "
              "their setting says which)." if other_path else "every row here."),
           "- At batch 1 to 16 a step is weight-bound: every mode reads the same weights per chip, so the",
           f"  roofline puts a lossless K=6 G=2 step at {step_in_ar_steps(rows, 'lossless', (1, 16))} AR steps "
           f"(at 64 rows: {step_in_ar_steps(rows, 'lossless', (64,))}; AR steps within {WASTE_BOUND}x of what they "
           "must move), and the speedup near the tokens per",
           f"  forward. The H200 says otherwise at {h200_shape}: its K=8 G=2 step cost "
           + (", ".join(f"{v:.2f} AR steps at batch {k}" for k, v in sorted(ratios.items())) or "nothing measured")
           + ".",
           "  A model of that size on an H200 is far from its bandwidth limit, so that ratio overstates what",
           "  a wide step costs a 7B or 32B model on a TPU; the truth lies between the two columns, and only a",
           "  TPU run can say where.",
           "- Each mode runs on the mesh `generate` picks for the weights and KV it carries (the least tensor size",
           "  that fits, `sharding.inference_tensor_size`), so modes of one slice can differ: "
           + ("; ".join(meshes) if meshes else "none here do") + ".",
           "  A mode on more data shards reads its weights once per shard each step; for bandwidth-bound steps",
           "  tensor parallelism beats data parallelism, and that difference is in the speedups above.",
           "- Where AR's own step moves more than " + f"{WASTE_BOUND}x what it must, a speedup over it is partly",
           "  AR's waste, so the tables give the speedup against AR at its must-move bytes (†) beside the one",
           "  against AR's program. Those AR steps, with their dearest instruction (bytes a step, opcode,",
           "  shape, from the step cost's `largest`): " + ("; ".join(ar_waste) or "none here") + ".",
           "- Not priced (no row in decode_step_cost.json; bench_decode_step_cost.py makes them): "
           + ("; ".join(missing) if missing else "none") + ".",
           "- Tokens per forward come from the demo proposer inflated to a real shape: it accepts what the",
           "  small trained proposer accepts, the same at every proposer size here. A real ProVe proposer",
           "  accepts more (the paper's 2.54x lossless, 2.72x with the verifier, for its 32B pair), so the",
           "  tokens per forward, and every speedup here, are this project's proposer's, not the paper's.",
           "- The verify rows use the trajectory-trained demo verifier, so they are not lossless; their",
           f"  tokens per forward were measured at batch {','.join(map(str, tokens_meta.get('batch_sizes', ['?'])))}.",
           "- Each verifier is about a tenth of its proposer or less, as the paper's 3B is of its 32B, so its",
           "  weights add little to a verify step's reads (verifier parameters per proposer parameter: "
           + ", ".join(f"{v} for {p} {share:.0%}" for (p, v), share in sorted(shares.items())) + ")."]
    return md


def main(argv=None) -> int:
    args = parse_args(argv)
    from prove_jax.evaluation.report import write_results
    cost_rows = load_rows(args.step_cost)
    tokens, tokens_meta = measured_tokens(args.tokens)
    ratios, h200_meta = h200_step_ratios(args.h200)
    steps, unpriced = step_rows(cost_rows, args.attention)
    rows = predict(steps, tokens, ratios)
    doc = dict(step_cost=os.path.relpath(args.step_cost, HERE), tokens=os.path.relpath(args.tokens, HERE),
               measured_tokens_per_forward=tokens, h200_lossless_step_in_ar_steps=ratios,
               not_priced=not_priced(steps, unpriced), rows=rows)
    write_results(args.out, "tpu_speed_prediction", doc,
                  markdown(rows, cost_rows, tokens, tokens_meta, ratios, h200_meta, steps, unpriced))
    return 0


if __name__ == "__main__":
    sys.exit(main())
