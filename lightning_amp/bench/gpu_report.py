"""``make gpu-check``'s report: ``gpu-check.md`` and ``gpu-check.json`` from the ``part-*.json`` in a folder.

The report holds one verdict line per target (:mod:`lightning_amp.bench.gpu_targets`), the status of
each part, and the measured tables (training runs, optimizer rows, wgrad rows). Parts from several
device calls can be copied into one folder and reported together (``--report-only``).
"""
from __future__ import annotations

import datetime
import glob
import json
import math
import os
from dataclasses import asdict

from lightning_amp.bench.gpu_targets import FAIL, NOT_RUN, PASS, bench_records, evaluate, part_status
from lightning_amp.bench.report import markdown_table

REPORT_MD, REPORT_JSON = "gpu-check.md", "gpu-check.json"
LOG_TAIL_CHARS = 3000


def part_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"part-{name}.json")


def load_parts(folder: str) -> dict:
    """Part name -> part JSON for every ``part-*.json`` in ``folder``. A file that cannot be read, or does
    not hold a part (a JSON object), stands for its part as ``{"part": name, "unreadable": why}``: that
    part ran (or began to) and its figures are lost, so its targets FAIL rather than read NOT RUN."""
    parts = {}
    for path in sorted(glob.glob(os.path.join(folder, "part-*.json"))):
        name = os.path.basename(path)[len("part-"):-len(".json")]
        try:
            with open(path) as f:
                part = json.load(f)
        except (OSError, ValueError) as error:
            part = {"part": name, "unreadable": f"{os.path.basename(path)}: {type(error).__name__}: {error}"}
        if not isinstance(part, dict):
            part = {"part": name, "unreadable": f"{os.path.basename(path)} holds a {type(part).__name__}, not a part"}
        parts[part.get("part") or name] = part
    return parts


def _environments(parts: dict) -> list:
    seen = []
    for part in parts.values():
        env = part.get("env") or {}
        line = ", ".join(f"{key} {env[key]}" for key in ("device", "torch", "cuda", "commit", "python") if env.get(key))
        if line and line not in seen:
            seen.append(line)
    return seen


def _optim_table(rows: list) -> str:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)
    lines = ["| list | op | mode | ours ms | ours GB/s | torch impl | torch ms | torch GB/s | ours/torch |",
             "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        ratio = r["ours_ms"] / r["torch_ms"] if r.get("torch_ms") else None
        lines.append(f"| {r.get('list')} | {r.get('op')} | {r.get('mode')} | {fmt(r.get('ours_ms'), '.3f')} | "
                     f"{fmt(r.get('ours_gbs'), '.0f')} | {r.get('torch_impl')} | {fmt(r.get('torch_ms'), '.3f')} | "
                     f"{fmt(r.get('torch_gbs'), '.0f')} | {fmt(ratio, '.2f')} |")
    return "\n".join(lines) + "\n"


def _wgrad_table(rows: list) -> str:
    lines = ["| tokens x in -> out | fused ms | bf16 GEMM ms | fused/GEMM | unfused ms | fp32 ms | fused TFLOP/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} x {r['n_in']} -> {r['n_out']} | {r['fused_ms']:.3f} | {r['gemm_ms']:.3f} | "
                     f"{r['fused_over_gemm']:.3f} | {r['unfused_ms']:.3f} | {r['fp32_ms']:.3f} | "
                     f"{r['fused_gflops'] / 1e3:.0f} |")
    return "\n".join(lines) + "\n"


def _o2_forward_table(records: list) -> str:
    lines = ["| O2 forward | ms/step | peak MiB | final loss | error |", "|---|---:|---:|---:|---|"]
    for r in records:
        cells = [r.get("o2_forward", "?")] + [f"{r[k]:.{d}f}" if isinstance(r.get(k), (int, float)) else "-"
                                              for k, d in (("step_time_ms", 2), ("peak_mem_mb", 0), ("final_loss", 4))]
        lines.append("| " + " | ".join(cells + [r.get("error") or ""]) + " |")
    return "\n".join(lines) + "\n"


def render_markdown(parts: dict, verdicts: list, note: str = "") -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    counts = {s: sum(v.status == s for v in verdicts) for s in (PASS, FAIL, NOT_RUN)}
    out = [f"# lightning-amp GPU check, report of {now:%Y-%m-%d %H:%M} UTC\n"]
    if note:
        out.append(note + "\n")
    out += [f"- {line}" for line in _environments(parts)] or ["- no part ran"]
    out.append(f"\n**{counts[PASS]} PASS, {counts[FAIL]} FAIL, {counts[NOT_RUN]} NOT RUN**\n")
    out += ["## Verdicts\n", "| verdict | target | measured | limit | figures |", "|---|---|---:|---:|---|"]
    out += [f"| {v.status} | {v.what} | {v.measured} | {v.limit} | {v.detail} |" for v in verdicts]
    out += ["\n## Parts\n", "| part | status | seconds | started (UTC) | commands |", "|---|---|---:|---|---|"]
    for name, part in parts.items():
        commands = "; ".join(f"`{c}`" for c in part.get("commands") or [])
        out.append(f"| {name} | {part_status(part)} | {part.get('seconds') or 0:.0f} | {part.get('started', '-')} | "
                   f"{commands} |")
    records = bench_records(parts)
    if records:
        out += ["\n## Training runs (`lightning-amp bench`)\n", markdown_table(records)]
    forwards = ((parts.get("o2-forward") or {}).get("data") or {}).get("records")
    if forwards:
        out += ["\n## O2's forward with and without autocast (`lightning_amp.bench.gpu_o2_forward`)\n",
                _o2_forward_table(forwards)]
    optim = ((parts.get("optim") or {}).get("data") or {}).get("rows")
    if optim:
        out += ["\n## Optimizers and multi-tensor ops (`benchmarks/bench_optim.py`)\n", _optim_table(optim)]
    wgrad = ((parts.get("wgrad") or {}).get("data") or {}).get("rows")
    if wgrad:
        out += ["\n## Weight-gradient GEMM (`benchmarks/bench_wgrad.py`)\n", _wgrad_table(wgrad)]
    broken = [(name, part) for name, part in parts.items() if part_status(part) != "ok"]
    for name, part in broken:
        out += [f"\n## Log tail of part {name} ({part_status(part)})\n", "```",
                (part.get("log_tail") or "")[-LOG_TAIL_CHARS:], "```"]
    return "\n".join(out) + "\n"


def write_report(folder: str, note: str = "") -> list:
    """Evaluate the parts in ``folder`` and write the report there; returns the verdicts."""
    parts = load_parts(folder)
    verdicts = evaluate(parts)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, REPORT_MD), "w") as md:
        md.write(render_markdown(parts, verdicts, note))
    summary = {"generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "note": note, "environments": _environments(parts),
               "verdicts": [dict(asdict(v), value=v.value if v.value is not None and math.isfinite(v.value) else None)
                            for v in verdicts],
               "parts": {name: {"status": part_status(p), "seconds": p.get("seconds"), "rc": p.get("rc"),
                                "commands": p.get("commands")} for name, p in parts.items()}}
    with open(os.path.join(folder, REPORT_JSON), "w") as js:
        json.dump(summary, js, indent=1, allow_nan=False, default=str)
    return verdicts


def verdict_lines(verdicts: list) -> str:
    """The verdicts as aligned text lines (printed last, so a device call's output tail shows them)."""
    return "\n".join(f"{v.status:<8} {v.key:<32} {v.measured:>9} (target {v.limit}) {v.detail}" for v in verdicts)
