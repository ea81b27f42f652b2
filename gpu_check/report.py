"""``make gpu-check``'s report: ``gpu-check.md`` and ``gpu-check.json`` from the ``part-*.json`` in a folder.

The report holds one verdict line per target (:mod:`gpu_check.targets`), each part's
status, wall time and command, the build's time, what was left out and why (parts not run, tests not
reached, smoke checks failed), the measured tables (smoke checks, headline runs, optimizer rows, wgrad
rows) and the log tail of every part that did not end well. A part still marked running (the check was
killed while it ran) gets its log tail from ``logs/<part>.log``.
"""
from __future__ import annotations

import datetime
import glob
import json
import math
import os
from dataclasses import asdict

from gpu_check.targets import STATUSES, bench_records, count_outcomes, evaluate, part_status

REPORT_MD, REPORT_JSON = "gpu-check.md", "gpu-check.json"
LOG_TAIL_CHARS = 3000


def part_path(folder: str, name: str) -> str:
    return os.path.join(folder, f"part-{name}.json")


def log_path(folder: str, name: str) -> str:
    """Where part ``name`` writes its log (its commands' output, as they run)."""
    return os.path.join(folder, "logs", f"{name}.log")


def _log_tail(folder: str, name: str) -> str:
    try:
        with open(log_path(folder, name), errors="replace") as log:
            return log.read()[-20000:]
    except OSError:
        return ""


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
        if part.get("running") and not part.get("log_tail"):
            part = dict(part, log_tail=_log_tail(folder, name))
        parts[part.get("part") or name] = part
    return parts


def _environments(parts: dict) -> list:
    seen = []
    for part in parts.values():
        env = part.get("env") or {}
        line = ", ".join(f"{key} {env[key]}" for key in ("device", "capability", "cores", "torch", "cuda", "commit",
                                                           "python") if env.get(key))
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


def _smoke_table(checks: list) -> str:
    lines = ["| check | result | seconds | detail |", "|---|---|---:|---|"]
    for c in checks:
        detail = str(c.get("detail") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {c.get('name')} | {'ok' if c.get('ok') else 'FAILED'} | {c.get('seconds') or 0:.1f} | "
                     f"{detail} |")
    return "\n".join(lines) + "\n"


def _ratio(numerator, denominator) -> str:
    ok = all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in (numerator, denominator))
    return f"{numerator / denominator:.2f}x" if ok else "-"


def _headline_table(records: list) -> str:
    """The headline runs with their ratios, all from the one run: speed-up over TF32 and over bf16-mixed
    (their step time over this one's), peak memory over TF32's."""
    def baseline(level):
        return next((r for r in records if r.get("level") == level and not r.get("error")), {})
    tf32, mixed = baseline("32-true"), baseline("bf16-mixed")
    lines = ["| level | optimizer | O2 forward | ms/step | tokens/s | peak MiB | steps | steady after | final loss "
             "| speed-up vs TF32 | vs bf16-mixed | memory / TF32 | error |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in records:
        def cell(key, digits):
            return f"{r[key]:.{digits}f}" if isinstance(r.get(key), (int, float)) else "-"
        steady = "never" if r.get("steady") is False else str(r.get("steady_after", "-"))
        step = r.get("step_time_ms")
        lines.append(f"| {r.get('level')} | {r.get('optimizer', '-')} | {r.get('o2_forward') or '-'} | "
                     f"{cell('step_time_ms', 2)} | {cell('tokens_per_s', 0)} | {cell('peak_mem_mb', 0)} | "
                     f"{r.get('steps', '-')} | {steady} | {cell('final_loss', 4)} | "
                     f"{_ratio(tf32.get('step_time_ms'), step)} | {_ratio(mixed.get('step_time_ms'), step)} | "
                     f"{_ratio(r.get('peak_mem_mb'), tf32.get('peak_mem_mb'))} | {r.get('error') or ''} |")
    return "\n".join(lines) + "\n"


def left_out(parts: dict) -> list:
    """What the check did not do, one line each: parts not run (with the reason), parts stopped or killed,
    tests not reached, smoke checks that failed."""
    lines = []
    for name, part in parts.items():
        status = part_status(part)
        if part.get("not_run") or part.get("running") or part.get("timed_out") or part.get("interrupted"):
            lines.append(f"part {name}: {status}")
        tests = (part.get("data") or {}).get("tests") or {}
        counts = count_outcomes(tests.get("outcomes") or {})
        if counts["not reached"]:
            lines.append(f"part {name}: {counts['not reached']} of {len(tests['outcomes'])} tests not reached")
        failed = [c for c in (part.get("data") or {}).get("checks") or [] if not c.get("ok")] if name == "smoke" else []
        lines += [f"smoke check {c.get('name')} failed: {c.get('detail')}" for c in failed]
    return lines


def render_markdown(parts: dict, verdicts: list, note: str = "", running: str = "") -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    counts = {s: sum(v.status == s for v in verdicts) for s in STATUSES}
    out = [f"# lightning-amp GPU check, report of {now:%Y-%m-%d %H:%M} UTC\n"]
    if note:
        out.append(note + "\n")
    if running:
        out.append(f"Part {running} is running; this report is rewritten when it ends.\n")
    out += [f"- {line}" for line in _environments(parts)] or ["- no part ran"]
    build = (parts.get("build") or {}).get("data") or {}
    if isinstance(build.get("build_seconds"), (int, float)):
        out.append(f"- build: {build['build_seconds']:.0f} s for compute capability {build.get('arch')}, "
                   f"MAX_JOBS={build.get('max_jobs')}, ninja {'yes' if build.get('ninja') else 'no'}")
    out.append("\n**" + ", ".join(f"{counts[s]} {s}" for s in STATUSES) + "**\n")
    out += ["## Verdicts\n", "| verdict | target | measured | limit | figures |", "|---|---|---:|---:|---|"]
    out += [f"| {v.status} | {v.what} | {v.measured} | {v.limit} | {v.detail} |" for v in verdicts]
    out += ["\n## Parts\n", "| part | status | seconds | started (UTC) | commands |", "|---|---|---:|---|---|"]
    for name, part in parts.items():
        commands = "; ".join(f"`{c}`" for c in part.get("commands") or [])
        out.append(f"| {name} | {part_status(part)} | {part.get('seconds') or 0:.0f} | {part.get('started', '-')} | "
                   f"{commands} |")
    missing = left_out(parts)
    out += ["\n## Left out\n"] + ([f"- {line}" for line in missing] or ["- nothing"])
    checks = ((parts.get("smoke") or {}).get("data") or {}).get("checks")
    if checks:
        out += ["\n## CUDA smoke (`gpu_check.smoke`)\n", _smoke_table(checks)]
    records = bench_records(parts)
    if records:
        out += ["\n## Headline: BERT-base (`gpu_check.headline`)\n", _headline_table(records)]
    optim = ((parts.get("optim") or {}).get("data") or {}).get("rows")
    if optim:
        out += ["\n## Optimizers and multi-tensor ops (`benchmarks/bench_optim.py`)\n", _optim_table(optim)]
    wgrad = ((parts.get("wgrad") or {}).get("data") or {}).get("rows")
    if wgrad:
        out += ["\n## Weight-gradient GEMM (`benchmarks/bench_wgrad.py`)\n", _wgrad_table(wgrad)]
    for name, part in parts.items():
        reasons = (((part.get("data") or {}).get("tests") or {}).get("reasons") or {})
        if reasons:
            out += [f"\n## Failed tests of part {name}, and why\n", "| test | why |", "|---|---|"]
            out += [f"| `{test}` | {why.replace('|', '/') or '-'} |" for test, why in sorted(reasons.items())]
    broken = [(name, part) for name, part in parts.items() if part_status(part) != "ok" and not part.get("not_run")]
    for name, part in broken:
        out += [f"\n## Log tail of part {name} ({part_status(part)})\n", "```",
                (part.get("log_tail") or "")[-LOG_TAIL_CHARS:], "```"]
    return "\n".join(out) + "\n"


def _write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a kill mid-write leaves the previous report."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_report(folder: str, note: str = "", running: str = "") -> list:
    """Evaluate the parts in ``folder`` and write the report there (``running``: the part now running, if
    any); returns the verdicts."""
    parts = load_parts(folder)
    verdicts = evaluate(parts)
    os.makedirs(folder, exist_ok=True)
    _write_atomically(os.path.join(folder, REPORT_MD), render_markdown(parts, verdicts, note, running))
    summary = {"generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "note": note, "running": running or None, "environments": _environments(parts),
               "build_seconds": ((parts.get("build") or {}).get("data") or {}).get("build_seconds"),
               "left_out": left_out(parts),
               "verdicts": [dict(asdict(v), value=v.value if v.value is not None and math.isfinite(v.value) else None)
                            for v in verdicts],
               "parts": {name: {"status": part_status(p), "seconds": p.get("seconds"), "rc": p.get("rc"),
                                "timeout_s": p.get("timeout_s") if math.isfinite(p.get("timeout_s") or 0) else None,
                                "commands": p.get("commands")} for name, p in parts.items()}}
    _write_atomically(os.path.join(folder, REPORT_JSON), json.dumps(summary, indent=1, allow_nan=False, default=str))
    return verdicts


def verdict_lines(verdicts: list) -> str:
    """The verdicts as aligned text lines (printed last, so a device call's output tail shows them)."""
    return "\n".join(f"{v.status:<10} {v.key:<32} {v.measured:>9} (target {v.limit}) {v.detail}" for v in verdicts)
