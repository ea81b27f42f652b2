"""Draw the docs' pictures from real runs into docs/img/ (the runs: ``benchmarks/picture_runs.py``).

    python benchmarks/draw_pictures.py [--out docs/img] [--data pictures.json]      # or: make pictures

* ``ladder-run.png`` (docs/opt-levels.md): a float16 ``opt_level="auto"`` run per optimizer step: training loss,
  learning rate, loss scale and rung; skipped steps, the move and the rollback point marked;
* ``loss-scale-run.png`` (docs/loss-scaling.md): a dynamic loss scale over a float16 O2 run (log2 axis): growth,
  back-offs, skipped steps, the steps with a large batch;
* ``tp-split-llama-block.png`` (docs/tensor-parallel.md): one block of a tiny ``transformers`` Llama under
  ``tp_fused`` at ``tensor_parallel_size=2``: the layers in forward order, the slice of each weight every rank holds
  and the collectives the ranks issued.

Every value drawn comes from the runs (nothing is typed in); each PNG's footer names the commit, the date (UTC),
torch, Lightning and the run. The runs are seeded and single-threaded: the same data on every run on one machine.
``--data FILE`` also writes the runs' data and what each picture drew from it, as JSON (``tests/test_pictures.py``
checks the one against the other). About 20-30 s on 2 cores, most of it two processes importing torch, Lightning
and transformers.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import textwrap
from pathlib import Path

import picture_runs as runs

ROOT = Path(__file__).resolve().parents[1]
#: picture -> its file name in --out, and the page that shows it (as docs/img/<name>)
PICTURES = {"ladder": "ladder-run.png", "scale": "loss-scale-run.png", "tp": "tp-split-llama-block.png"}
PAGES = {"ladder": "docs/opt-levels.md", "scale": "docs/loss-scaling.md", "tp": "docs/tensor-parallel.md"}
RUNG_COLOURS = ("#2ca02c", "#1f77b4", "#9467bd", "#8c564b")  # O2 as in the bench chart, then O1, ...
SKIP, GROW, BIG = "#d62728", "#2ca02c", "#ff7f0e"
KIND_COLOURS = {"column": "#c6dbef", "row": "#fdd0a2", "replicated": "#e0e0e0", "whole": "#f0f0f0"}
DPI = 110
COLOURS = 128


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finish(figure, facts: dict, run: str, width: float, path: Path, rect=None) -> None:
    """Write the provenance at the bottom of ``figure`` (commit, date, torch, Lightning, then ``run``), lay it out in
    ``rect`` (figure fractions; None: as placed) and save it to ``path`` as a PNG of at most :data:`COLOURS` colours
    (a palette image: a third of the bytes of an RGBA one for these line drawings)."""
    import io

    from PIL import Image

    text = (f"commit {facts['commit']}, {facts['date']}, torch {facts['torch']}, Lightning {facts['lightning']}; "
            f"drawn by benchmarks/draw_pictures.py from {run}")
    figure.text(0.01, 0.005, "\n".join(textwrap.wrap(text, int(width * 15))), ha="left", va="bottom", fontsize=7,
                color="#444444")
    if rect is not None:
        figure.tight_layout(rect=rect)
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=DPI, format="png")
    _pyplot().close(figure)
    image = Image.open(buffer).convert("RGB").quantize(colors=COLOURS, dither=Image.Dither.NONE)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)


def _log2_axis(axis) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    axis.set_yscale("log", base=2)
    axis.yaxis.set_major_locator(LogLocator(base=2))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"$2^{{{round(math.log2(value))}}}$"))


# ------------------------------------------------------------------ the ladder


def draw_ladder(data: dict, facts: dict, path: Path) -> dict:
    """Draw :func:`picture_runs.ladder_run`'s data to ``path``; returns what was drawn: ``skipped`` (steps marked),
    ``moves`` (``{"step", "from", "to", "rollback_to", "lr_restored"}`` per move, from the rows where ``changes``
    grew; ``lr_restored``: the step after the move ran at the learning rate of the step after the rollback point),
    ``rollback_points`` (the steps whose snapshot was the rollback point at some step), ``rung_per_step``."""
    plt = _pyplot()
    rows, rungs, c = data["rows"], data["rungs"], data["config"]
    steps = [r["step"] for r in rows]
    skipped = [r["step"] for r in rows if r["nonfinite"]]
    moves, changes = [], 0
    for r in rows:
        if r["changes"] > changes:
            after, back = r["step"], r["snapshot_step"]  # rows[i] is step i + 1
            moves.append({"step": after, "from": rungs[r["rung"]], "to": rungs[r["rung_after"]], "rollback_to": back,
                          "lr_restored": after < len(rows) and rows[after]["lr"] == rows[back]["lr"]})
            changes = r["changes"]
    points = sorted({r["good_snapshot"] for r in rows if r["good_snapshot"] is not None})
    width = 10.0
    figure, axes = plt.subplots(4, 1, figsize=(width, 8.6), sharex=True,
                                gridspec_kw={"height_ratios": [3, 1.2, 0.9, 1.2]})
    loss_ax, lr_ax, scale_ax, rung_ax = axes
    for index, rung in enumerate(rungs):
        mine = [r for r in rows if r["rung"] == index and not r["nonfinite"]]
        if mine:
            colour = RUNG_COLOURS[index % len(RUNG_COLOURS)]
            loss_ax.plot([r["step"] for r in mine], [r["loss"] for r in mine], ".-", color=colour, markersize=3,
                         linewidth=0.8, label=f"loss, steps on {rung}")
    loss_ax.set_yscale("log")
    top = loss_ax.get_ylim()[1]
    loss_ax.plot(skipped, [top] * len(skipped), "x", color=SKIP, markersize=7, clip_on=False,
                 label="skipped step (non-finite grads; its loss: " + ", ".join(
                     sorted({str(r["loss"]) for r in rows if r["nonfinite"]})) + ")")
    loss_ax.set_ylim(top=top)
    loss_ax.set_ylabel("training loss (log)")
    lr_ax.plot(steps, [r["lr"] for r in rows], "-", color="#555555", linewidth=1)
    lr_ax.set_ylabel("learning rate\nthe step used")
    scale_ax.step(steps, [r["scale"] for r in rows], where="mid", color="#555555", linewidth=1)
    _log2_axis(scale_ax)
    scale_ax.set_ylabel("loss scale\n(log2)")
    rung_ax.step(steps, [r["rung"] for r in rows], where="mid", color="black", linewidth=1.2)
    rung_ax.set_yticks(range(len(rungs)), rungs)
    rung_ax.set_ylim(len(rungs) - 0.5, -0.5)
    rung_ax.set_ylabel("rung the\nstep ran on")
    rung_ax.plot([p + 0.5 for p in points], [0.0] * len(points), "^", color="#555555", markersize=6, clip_on=False,
                 transform=rung_ax.get_xaxis_transform(),
                 label=f"rollback point held (a snapshot every {c['snapshot_every']} steps becomes one after "
                       f"{c['snapshot_every']} calm steps)")
    for move in moves:
        for axis in axes:
            axis.axvspan(move["rollback_to"] + 0.5, move["step"] + 0.5, color="#bbbbbb", alpha=0.35, linewidth=0)
            axis.axvline(move["step"] + 0.5, color=SKIP, linewidth=1.2)
            axis.axvline(move["rollback_to"] + 0.5, color="#555555", linewidth=1, linestyle=":")
        loss_ax.annotate("", xy=(move["rollback_to"] + 0.5, 0.72), xytext=(move["step"] + 0.5, 0.72),
                         xycoords=("data", "axes fraction"), arrowprops={"arrowstyle": "->", "color": SKIP})
        loss_ax.text(move["step"] + 1.5, 0.62, f"move after step {move['step']}:\n{move['from']} -> {move['to']}",
                     transform=loss_ax.get_xaxis_transform(), fontsize=8, color=SKIP, va="bottom")
        if move["lr_restored"]:
            lr_ax.text(move["step"] - 0.5, 0.9, f"step {move['step'] + 1} runs at step {move['rollback_to'] + 1}'s "
                       "learning rate:\nthe LR scheduler was rolled back too", transform=lr_ax.get_xaxis_transform(),
                       fontsize=7, va="top", ha="right", color=SKIP)
        loss_ax.text((move["rollback_to"] + move["step"]) / 2 + 0.5, 0.75,
                     f"rolled back to the state after step {move['rollback_to']}:\nthe updates of steps "
                     f"{move['rollback_to'] + 1}-{move['step']} undone,\ntheir batches not replayed",
                     transform=loss_ax.get_xaxis_transform(), fontsize=7, ha="center", va="bottom")
    loss_ax.legend(fontsize=7, loc="lower left")
    rung_ax.legend(fontsize=7, loc="center left")
    rung_ax.set_xlabel("optimizer step")
    rung_ax.set_xlim(0, steps[-1] + 1)
    rules = f"LadderRules(nonfinite_in_a_row={c['nonfinite_in_a_row']}, snapshot_every={c['snapshot_every']})"
    figure.suptitle(f'opt_level="auto" over a real float16 run (CPU): {rules}', fontsize=11)
    run = (f"picture_runs.ladder_run(): GainSum (fc 16->64, relu, x gain {c['gain']:g}, unnormalised sum, head) under "
           f"AmpAutoPlugin(dtype='float16'), Adam lr {c['lr']:g} x {c['decay']:g}^step (step-interval LambdaLR), "
           f"{c['steps']} steps of {c['batch']} fresh samples, seeds {c['model_seed']}/{c['data_seed']}, one thread. "
           f"The ladder's warning: {data['warnings'][0] if data['warnings'] else 'none'}")
    _finish(figure, facts, run, width, path, (0, 0.07, 1, 0.97))
    return {"skipped": skipped, "moves": moves, "rollback_points": points, "rung_per_step": [r["rung"] for r in rows]}


# ------------------------------------------------------------------ the dynamic loss scale


def draw_scale(data: dict, facts: dict, path: Path) -> dict:
    """Draw :func:`picture_runs.scale_run`'s data to ``path``; returns what was drawn: ``skipped``, ``backoffs`` and
    ``growths`` (the steps that ran at a lower / higher scale than the step before), ``big`` (the large batches)."""
    plt = _pyplot()
    rows, c, rule = data["rows"], data["config"], data["scaler"]
    steps = [r["step"] for r in rows]
    scales = [r["scale"] for r in rows]
    skipped = [r for r in rows if r["nonfinite"]]
    backoffs = [b for a, b in zip(rows, rows[1:]) if b["scale"] < a["scale"]]
    growths = [b for a, b in zip(rows, rows[1:]) if b["scale"] > a["scale"]]
    width = 10.0
    figure, (scale_ax, loss_ax) = plt.subplots(2, 1, figsize=(width, 6.4), sharex=True,
                                               gridspec_kw={"height_ratios": [2.2, 1]})
    for axis in (scale_ax, loss_ax):
        for index, step in enumerate(data["big_steps"]):
            axis.axvspan(step - 0.5, step + 0.5, color=BIG, alpha=0.25, linewidth=0,
                         label=f"a batch x{c['big_factor']:g} larger (every {c['big_every']}th)"
                         if index == 0 and axis is scale_ax else None)
    scale_ax.step(steps, scales, where="mid", color="black", linewidth=1.2, label="loss scale the step ran at")
    scale_ax.plot([r["step"] for r in skipped], [r["scale"] for r in skipped], "x", color=SKIP, markersize=7,
                  label="skipped step (inf/nan grads): the next runs at x" + f"{rule['backoff_factor']:g}")
    scale_ax.plot([r["step"] for r in growths], [r["scale"] for r in growths], "^", color=GROW, markersize=6,
                  label=f"growth x{rule['growth_factor']:g} after {rule['growth_interval']} clean steps")
    _log2_axis(scale_ax)
    scale_ax.set_ylabel("loss scale (log2)")
    scale_ax.legend(fontsize=7, loc="upper right")
    loss_ax.plot(steps, [r["loss"] for r in rows], ".-", color="#555555", markersize=2, linewidth=0.6,
                 label="training loss (summed squared error)")
    loss_ax.plot([r["step"] for r in skipped], [r["loss"] for r in skipped], "x", color=SKIP, markersize=6)
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("training loss (log)")
    loss_ax.set_xlabel("optimizer step")
    loss_ax.legend(fontsize=7, loc="upper right")
    loss_ax.set_xlim(0, steps[-1] + 1)
    figure.suptitle(f"The dynamic loss scale over a real float16 O2 run (CPU): init_scale "
                    f"2^{round(math.log2(c['init_scale']))}, growth_interval {rule['growth_interval']}: "
                    f"{len(skipped)} skipped steps, {len(backoffs)} back-offs, {len(growths)} growths", fontsize=10)
    run = (f"picture_runs.scale_run(): a 16->64->GELU->1 MLP on the summed squared error under "
           f"AmpO2Plugin(dtype='float16', loss_scale='dynamic', init_scale={c['init_scale']:g}, "
           f"growth_interval={c['growth_interval']}) (hysteresis {rule['hysteresis']}, "
           f"floor {rule['min_loss_scale']:g}), "
           f"Adam lr {c['lr']:g}, {c['steps']} steps of {c['batch']} fresh standard-normal samples, every "
           f"{c['big_every']}th batch x{c['big_factor']:g}, seeds {c['model_seed']}/{c['data_seed']}, one thread; "
           f"the plugin counted {data['skipped_steps']} skipped steps")
    _finish(figure, facts, run, width, path, (0, 0.06, 1, 0.96))
    return {"skipped": [r["step"] for r in skipped], "backoffs": [r["step"] for r in backoffs],
            "growths": [r["step"] for r in growths], "big": list(data["big_steps"])}


# ------------------------------------------------------------------ the tensor-parallel split


def _span(ranges: list) -> str:
    return ", ".join(f"{a}-{b - 1}" for a, b in ranges)


def block_rows(rank: dict, block: str) -> list:
    """The block's drawing, top to bottom, from one rank's run: ``("whole", name)`` for a leaf module the plan left
    alone, and per unit (in forward order) ``("backward", unit)`` (collectives of its columns' backward),
    ``("columns", unit)``, ``("between", unit, names)`` (the leaves run between its columns and rows),
    ``("rows", unit)``, ``("forward", unit)`` (collectives of its rows' forward)."""
    prefix = block + "."
    leaves = list(dict.fromkeys(n for n in rank["order"] if n.startswith(prefix)))
    units = [u for u in rank["units"] if all(m.startswith(prefix) for m in u["columns"] + u["rows"])]
    drawn, out = set(), []
    for name in leaves:
        if name in drawn:
            continue
        unit = next((u for u in units if name in u["columns"] + u["rows"]), None)
        if unit is None:
            out.append(("whole", name))
            drawn.add(name)
            continue
        members = unit["columns"] + unit["rows"]
        first = min(leaves.index(c) for c in unit["columns"])
        last = max(leaves.index(r) for r in unit["rows"])
        between = [n for n in leaves[first:last] if n not in members]
        out += [("backward", unit), ("columns", unit), ("between", unit, between), ("rows", unit), ("forward", unit)]
        drawn |= set(members) | set(between)
    return out


def _calls(rank: dict, phase: str, names: list) -> list:
    return [c for c in rank["calls"] if c["phase"] == phase and c["module"] in names]


def _heads(unit: dict, name: str, shard: dict) -> str:
    """The heads a q/k/v (column) or out-projection (row) shard holds, for an attention of three projections."""
    heads = unit["heads"]
    if not heads or heads["layout"] != "separate" or len(unit["columns"]) != 3:
        return ""
    size = heads["v_size"] if name in (unit["columns"][2], *unit["rows"]) else heads["head_size"]
    return "heads " + ", ".join(f"{a // size}-{b // size - 1}" if b // size - a // size > 1 else f"{a // size}"
                                for a, b in shard["ranges"])


def draw_tp(data: dict, facts: dict, path: Path) -> dict:
    """Draw the block ``TP["block"]`` of :func:`picture_runs.finish_tp_ranks`'s data to ``path``: one lane per rank,
    the block's leaf modules in forward order, each converted layer with the slice of the original weight that rank
    holds (a matrix icon: the full ``[out, in]`` weight, the held part filled), the plan's units and the collectives
    the ranks issued (forward: after the row layers; backward: at the column layers' input). Returns what was drawn:
    ``boxes`` (``{"rank", "name", "kind", "dim", "ranges"}`` per layer box) and ``collectives`` (``{"phase", "modules",
    "count", "shape"}`` per band)."""
    from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

    plt = _pyplot()
    ranks, c = data["ranks"], data["config"]
    tp, block, first = c["tp"], c["block"], ranks[0]
    layout = block_rows(first, block)
    heights = {"whole": 0.9, "backward": 0.75, "columns": 1.7, "between": 0.8, "rows": 1.7, "forward": 0.75}
    layout = [row for row in layout if row[0] not in ("backward", "forward")
              or _calls(first, row[0], row[1]["columns" if row[0] == "backward" else "rows"])]
    total = sum(heights[row[0]] + 0.25 for row in layout)
    width, bottom_in, top_in = 12.0, 1.05, 0.5
    height = bottom_in + top_in + total * 0.55
    figure = plt.figure(figsize=(width, height))
    axis = figure.add_axes((0.01, bottom_in / height, 0.98, 1 - (bottom_in + top_in) / height))
    axis.set_xlim(0, 100)
    axis.set_ylim(total, -0.6)
    axis.axis("off")
    x_per_in, y_per_in = 100 / (0.98 * width), (total + 0.6) / (height - bottom_in - top_in)
    lane = 100.0 / tp
    boxes, bands = [], []

    def short(name):
        return name[len(block) + 1:]

    def layer_box(x, y, w, h, name, kind, shard, unit, rank):
        axis.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.15",
                                      facecolor=KIND_COLOURS[kind], edgecolor="#333333", linewidth=0.8))
        dim = {"rows": "out", "columns": "in"}.get(shard["dim"], "")
        held = f"{dim} {_span(shard['ranges'])} of {shard['of']}" if shard["dim"] != "whole" else "whole weight"
        out_n = shard["of"] if shard["dim"] == "rows" else shard["shape"][0]
        in_n = shard["of"] if shard["dim"] == "columns" else shard["shape"][1]
        axis.text(x + 0.6, y + 0.3, short(name), fontsize=7.5, weight="bold", va="center")
        heads = _heads(unit, name, shard)
        axis.text(x + 0.6, y + 0.55, f"{ranks[rank]['classes_after'][name]}\n{held}\n" + (heads + "\n" if heads else "")
                  + f"W {shard['shape']} of [{out_n}, {in_n}]", fontsize=6.5, va="top", linespacing=1.3)
        side = min(0.45, 0.7 * h / y_per_in) / max(out_n, in_n)  # inches per weight row/column in the icon
        iw, ih = in_n * side * x_per_in, out_n * side * y_per_in  # the icon: x spans `in`, y spans `out`
        ix, iy = x + w - iw - 0.8, y + (h - ih) / 2
        axis.add_patch(Rectangle((ix, iy), iw, ih, facecolor="white", edgecolor="#333333", linewidth=0.6))
        for a, b in shard["ranges"]:
            if shard["dim"] == "rows":
                axis.add_patch(Rectangle((ix, iy + a * side * y_per_in), iw, (b - a) * side * y_per_in,
                                         facecolor="#555555", linewidth=0))
            elif shard["dim"] == "columns":
                axis.add_patch(Rectangle((ix + a * side * x_per_in, iy), (b - a) * side * x_per_in, ih,
                                         facecolor="#555555", linewidth=0))
            else:  # the whole weight on every rank
                axis.add_patch(Rectangle((ix, iy), iw, ih, facecolor="#555555", linewidth=0))
        boxes.append({"rank": rank, "name": name, "kind": kind, "dim": shard["dim"], "ranges": shard["ranges"]})

    def band(y, h, phase, names, rank_calls):
        shapes = sorted({str(call["shape"]) for call in rank_calls})
        ops = sorted({call["op"].replace("_", "-") for call in rank_calls})
        where = ", ".join(short(n) for n in names)
        if phase == "forward":
            text = (f"forward: {' / '.join(ops)} (sum over the {tp} ranks) of the partial outputs of {where}: "
                    f"{len(rank_calls)} call(s) of {', '.join(shapes)} per rank")
        else:
            text = (f"backward: {' / '.join(ops)} of the input gradient at {where}: {len(rank_calls)} call(s) of "
                    f"{', '.join(shapes)} per rank (each rank's columns see only part of dL/dx)")
        axis.add_patch(FancyBboxPatch((0.5, y), 99, h, boxstyle="round,pad=0,rounding_size=0.2",
                                      facecolor="#fde0dd" if phase == "forward" else "white", edgecolor=SKIP,
                                      linewidth=1, linestyle="-" if phase == "forward" else "--"))
        axis.text(50, y + h / 2, text, fontsize=7, ha="center", va="center", color="#7f0000")
        bands.append({"phase": phase, "modules": list(names), "count": len(rank_calls), "shape": shapes})

    for r in range(tp):
        axis.text(r * lane + lane / 2, -0.3, f"rank {r}", fontsize=10, ha="center", va="center", weight="bold")
    y = 0.0
    for row in layout:
        kind, h = row[0], heights[row[0]]
        if kind == "whole":
            name = row[1]
            for r in range(tp):
                x = r * lane + 1
                axis.add_patch(FancyBboxPatch((x, y), lane - 2, h, boxstyle="round,pad=0,rounding_size=0.15",
                                              facecolor=KIND_COLOURS["whole"], edgecolor="#777777", linewidth=0.8))
                axis.text(x + 0.6, y + h / 2, f"{short(name)}  ({first['classes_before'][name]}): not split, the "
                          "same on every rank", fontsize=7, va="center")
        elif kind in ("columns", "rows"):
            unit = row[1]
            names = unit[kind]
            for r in range(tp):
                w = (lane - 2 - 0.8 * (len(names) - 1)) / len(names)
                for i, name in enumerate(names):
                    shard = ranks[r]["shards"][name]
                    layer_box(r * lane + 1 + i * (w + 0.8), y, w, h, name, first["decisions"][name], shard, unit, r)
        elif kind == "between":
            unit, names = row[1], row[2]
            for r in range(tp):
                shard = ranks[r]["shards"][unit["columns"][0]]
                if unit["heads"]:
                    heads = unit["heads"]
                    q = _heads(unit, unit["columns"][0], shard).replace("heads ", "")
                    kv = _heads(unit, unit["columns"][1], ranks[r]["shards"][unit["columns"][1]]).replace("heads ", "")
                    text = (f"{unit['family']} (found by {unit['found_by']}): query heads {q} of {heads['n_head']}, "
                            f"key/value heads {kv} of {heads['n_kv']}; no communication")
                else:
                    parts = ", ".join(f"{short(n)} ({first['classes_before'][n]})" for n in names) or "nothing"
                    text = (f"{unit['family']} (found by {unit['found_by']}): {parts} on features "
                            f"{_span(shard['ranges'])} of {shard['of']}; no communication")
                axis.text(r * lane + lane / 2, y + h / 2, "\n".join(textwrap.wrap(text, 62)), fontsize=6.5,
                          ha="center", va="center", style="italic")
        else:
            names = row[1]["columns" if kind == "backward" else "rows"]
            band(y, h, kind, names, _calls(first, kind, names))
        y += h + 0.25

    legend = [Patch(facecolor=face, edgecolor=edge, label=label) for face, edge, label in (
        (KIND_COLOURS["column"], "#333333", "column-parallel: output features split"),
        (KIND_COLOURS["row"], "#333333", "row-parallel: input features split"),
        (KIND_COLOURS["whole"], "#777777", "not split"),
        ("#fde0dd", SKIP, "collective the ranks issued (dashed: in backward)"),
        ("white", "#333333", "icon: the full weight [out, in], the rank's part dark"))]
    figure.legend(handles=legend, loc="lower center", ncol=5, fontsize=7, frameon=False,
                  bbox_to_anchor=(0.5, (bottom_in - 0.4) / height))
    llama = c["llama"]
    figure.suptitle(f"tp_fused at tensor_parallel_size={tp}: block {block} of a tiny transformers Llama (hidden "
                    f"{llama['hidden_size']}, {llama['num_attention_heads']} query / {llama['num_key_value_heads']} "
                    f"key-value heads, MLP {llama['intermediate_size']}): what each rank holds", fontsize=10,
                    y=1 - 0.12 / height, va="top")
    whole = "; ".join(f"{name}: {why}" for name, why in first["whole"].items())
    worst = max(rank["max_abs_diff"] for rank in ranks)
    config = ", ".join(f"{k}={v}" for k, v in llama.items())
    run = (f"picture_runs.finish_tp_ranks(): LlamaForCausalLM(LlamaConfig({config})) "
           f"seeded {c['seed']}, the plan built (build_plan) and applied (apply_checked_plan) on {tp} gloo ranks as "
           f"tp_fused's setup does, one forward and backward of {c['tokens'][0]}x{c['tokens'][1]} tokens watched; the "
           f"ranks' logits within {worst:.1e} of one process's (largest |logit| {first['logits_scale']:.2f}); left "
           f"whole: {whole}")
    _finish(figure, facts, run, width, path)
    return {"boxes": boxes, "collectives": bands}


# ------------------------------------------------------------------ the command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "img"), help="the folder for the PNGs (default docs/img)")
    parser.add_argument("--data", help="also write the runs' data and what each picture drew from it, as JSON")
    args = parser.parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as folder, runs.tp_ranks(folder) as children:  # rank 1 imports meanwhile
        data = {"ladder": runs.ladder_run(), "scale": runs.scale_run(), "tp": runs.finish_tp_ranks(folder, children)}
    facts = runs.run_facts()
    drawn = {"ladder": draw_ladder(data["ladder"], facts, out / PICTURES["ladder"]),
             "scale": draw_scale(data["scale"], facts, out / PICTURES["scale"]),
             "tp": draw_tp(data["tp"], facts, out / PICTURES["tp"])}
    if args.data:
        Path(args.data).write_text(json.dumps({"facts": facts, "runs": data, "drawn": drawn, "pictures": PICTURES}))
    for name in PICTURES.values():
        print(f"{out / name}: {(out / name).stat().st_size // 1024} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
