"""The GPU targets of issue 19 as verdicts over the outputs of ``make gpu-check``'s parts.

Each part writes ``part-<name>.json`` (see :mod:`lightning_amp.bench.gpu_check`): its exit status, time,
log tail and ``data`` (junit counts, ``bench_optim``/``bench_wgrad`` rows, ``lightning-amp bench``
records). :func:`evaluate` turns the parts present into one :class:`Verdict` per target: ``PASS`` or
``FAIL`` with the measured figure, or ``NOT RUN`` when the part that measures it is absent. A part that
ran but lacks the figure (it crashed, timed out, a run failed, or its file cannot be read) gives
``FAIL``, and so does a figure that is not a finite number (a time or a size that is not positive, a
ratio that overflows) and a test suite in which no test passed. Ratios are taken within one part's run
(or two bench parts of the same device), never across devices. The thresholds are those of the table
in docs/benchmarks.md, which ``tests/bench/test_gpu_check.py`` holds against :data:`TARGETS`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"
#: the bench_optim list the bandwidth-bound targets are judged on (4 tensors of 4M elements on cuda)
OPTIM_LIST = "few-large"
O2_FUSED = ("O2", True)
#: O2's half op policy must save >= 2% of the step against torch's autocast lists, else norm_policy="fp32" may
#: become O2's default
O2_FORWARD_LIMIT = 0.98


class NotRun(Exception):
    """The part that measures this target did not run."""


class Missing(Exception):
    """The part ran, but the figure is not in its output."""


@dataclass(frozen=True)
class Target:
    """One target: ``measure(parts) -> (value, detail)``; it passes when ``value <op> threshold``.
    ``source`` names the part(s) that measure it (the "from" column of docs/benchmarks.md's table)."""

    key: str
    what: str
    op: str  # "<=" or ">="
    threshold: float
    unit: str  # "x" (ratio), "%" (fraction shown as percent) or "ok" (1.0 yes / 0.0 no)
    measure: Callable[[dict], tuple]
    source: str

    def limit(self) -> str:
        if self.unit == "ok":
            return "yes"
        return f"{self.op} {100 * self.threshold:g}%" if self.unit == "%" else f"{self.op} {self.threshold:g}x"


@dataclass(frozen=True)
class Verdict:
    key: str
    what: str
    status: str
    value: Optional[float]
    measured: str
    limit: str
    detail: str


def _show(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if unit == "%" else f"{value:.3f}{unit}"


def _part(parts: dict, name: str) -> dict:
    if name not in parts:
        raise NotRun(f"part {name} not run")
    return parts[name]


def part_status(part: dict) -> str:
    """"ok", "unreadable (why)", "timed out after N s", "crashed (signal N)" or "failed (exit N)"."""
    if part.get("unreadable"):
        return f"unreadable ({part['unreadable']})"
    if part.get("timed_out"):
        return f"timed out after {part.get('timeout_s', '?')} s"
    rc = part.get("rc")
    if rc == 0:
        return "ok"
    if isinstance(rc, int) and rc < 0:
        return f"crashed (signal {-rc})"
    return f"failed (exit {rc})"


def _broken(part: dict, what: str) -> Missing:
    return Missing(f"{what} missing; part {part.get('part', '?')} {part_status(part)}")


def _figure(value, what: str, positive: bool = True) -> float:
    """``value`` when it is a finite number (and > 0 where ``positive``: times, sizes, bandwidths), else
    :class:`Missing` naming it: an infinite time would make any speed-up pass, a negative one any ratio."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        raise Missing(f"{what} is {value!r}, not a finite{' positive' if positive else ''} number")
    return float(value)


# -- the figures ------------------------------------------------------------------------------------


def _build(parts):
    part = _part(parts, "build")
    backend = (part.get("data") or {}).get("backend")
    if backend is None:
        raise _broken(part, "backend")
    error = (part.get("data") or {}).get("extension_error")
    return (1.0 if backend == "cuda-ext" else 0.0), f"backend {backend}" + (f"; {error}" if error else "")


def _junit(parts, name):
    part = _part(parts, name)
    junit = (part.get("data") or {}).get("junit")
    if not junit:
        raise _broken(part, "junit report")
    failed = junit.get("failures", 0) + junit.get("errors", 0)
    passed = junit.get("tests", 0) - failed - junit.get("skipped", 0)
    detail = (f"{passed} passed, {junit.get('skipped', 0)} skipped, {failed} failed/errors in "
              f"{junit.get('time', 0):.0f} s; exit {part.get('rc')}")
    if junit.get("failed_names"):
        detail += "; failed: " + ", ".join(junit["failed_names"][:8])
    return junit, passed, failed, detail


def _suite(parts):
    junit, passed, failed, detail = _junit(parts, "suite")
    clean = failed == 0 and passed > 0 and parts["suite"].get("rc") == 0
    return (1.0 if clean else 0.0), detail


def _sync(parts):
    junit, passed, failed, detail = _junit(parts, "sync")
    clean = failed == 0 and passed > 0 and junit.get("skipped", 0) == 0 and parts["sync"].get("rc") == 0
    return (1.0 if clean else 0.0), detail


def bench_records(parts: dict) -> list:
    """The records of the bench parts (``bench`` first, then ``bench-fused``), each with ``part`` added."""
    records = []
    for name in ("bench", "bench-fused"):
        for record in ((parts.get(name) or {}).get("data") or {}).get("records") or []:
            records.append(dict(record, part=name))
    return records


def _is_fused(record: dict) -> bool:
    return str(record.get("optimizer") or "").startswith("FusedAdam")


def _run(parts, levels, fused: bool) -> dict:
    part_name = "bench-fused" if fused else "bench"
    part = _part(parts, part_name)
    for record in bench_records(parts):
        if record["part"] == part_name and record.get("level") in levels and _is_fused(record) == fused:
            if record.get("error"):
                raise Missing(f"{record.get('level')} run failed: {record['error']}")
            return record
    raise _broken(part, f"{'/'.join(levels)} run" + (" with FusedAdam" if fused else ""))


def _o2_against(parts, levels):
    o2 = _run(parts, ("O2",), fused=True)
    base = _run(parts, levels, fused=False)
    if o2.get("device_name") != base.get("device_name"):
        raise Missing(f"O2+FusedAdam ran on {o2.get('device_name')}, {base['level']} on {base.get('device_name')}")
    return o2, base


def _o2_step_vs(levels, speedup: bool):
    def measure(parts):
        o2, base = _o2_against(parts, levels)
        o2_ms = _figure(o2.get("step_time_ms"), "O2+FusedAdam step_time_ms")
        base_ms = _figure(base.get("step_time_ms"), f"{base['level']} step_time_ms")
        return (base_ms / o2_ms if speedup else o2_ms / base_ms,
                f"O2+FusedAdam {o2_ms:.1f} ms, {base['level']} {base_ms:.1f} ms per step")
    return measure


def _o2_memory(parts):
    o2, base = _o2_against(parts, ("32-true", "fp32"))
    o2_mb = _figure(o2.get("peak_mem_mb"), "O2+FusedAdam peak_mem_mb")
    base_mb = _figure(base.get("peak_mem_mb"), f"{base['level']} peak_mem_mb")
    return o2_mb / base_mb, f"O2+FusedAdam {o2_mb:.0f} MiB, {base['level']} {base_mb:.0f} MiB peak"


def _o2_loss(parts):
    o2, base = _o2_against(parts, ("32-true", "fp32"))
    if o2.get("final_loss") is None or base.get("final_loss") is None:
        raise Missing("a final loss is missing (diverged?)")
    steps = min(o2.get("steps") or 0, base.get("steps") or 0)
    if steps < 300:
        raise Missing(f"only {steps} timed steps (the target is after 300)")
    o2_loss = _figure(o2["final_loss"], "O2+FusedAdam final_loss", positive=False)
    base_loss = _figure(base["final_loss"], f"{base['level']} final_loss", positive=False)
    difference = abs(o2_loss - base_loss) / abs(base_loss)
    detail = f"O2+FusedAdam {o2_loss:.4f}, {base['level']} {base_loss:.4f} after {steps} steps"
    if base.get("learned") is False:
        detail += f" ({base['level']} did not learn)"
    return difference, detail


def _o2_forward_steps(parts) -> dict:
    """Step times (ms) of the ``o2-forward`` part's runs that succeeded, by forward ("half", "fp32")."""
    part = _part(parts, "o2-forward")
    records = [r for r in (part.get("data") or {}).get("records") or [] if not r.get("error")]
    devices = {r.get("device_name") for r in records}
    if len(devices) > 1:
        raise Missing(f"o2-forward runs on several devices: {sorted(map(str, devices))}")
    steps = {f: [_figure(r["step_time_ms"], f"o2-forward {f} step_time_ms") for r in records
                 if r.get("o2_forward") == f] for f in ("half", "fp32")}
    if not steps["half"] or not steps["fp32"]:
        raise _broken(part, "O2 runs with norm_policy half and fp32")
    return steps


def _o2_forward(parts):
    steps = _o2_forward_steps(parts)
    half, fp32 = statistics.median(steps["half"]), statistics.median(steps["fp32"])
    ratio = half / fp32
    decision = (f"the fp32 lists cost {fp32 / half - 1:.1%}: keep norm_policy='half'" if ratio <= O2_FORWARD_LIMIT
                else f"the fp32 lists cost {fp32 / half - 1:.1%} (< 2%): norm_policy='fp32' may become the default")
    return ratio, (f"half op policy {half:.1f} ms, torch's autocast lists {fp32:.1f} ms per step (medians of "
                   f"{len(steps['half'])} + {len(steps['fp32'])} runs); {decision}")


def _optim_rows(parts):
    part = _part(parts, "optim")
    rows = (part.get("data") or {}).get("rows") or []
    return part, rows


def _optim_row(parts, op, mode):
    part, rows = _optim_rows(parts)
    for row in rows:
        if row.get("list") == OPTIM_LIST and row.get("op") == op and row.get("mode") == mode:
            return row
    raise _broken(part, f"{OPTIM_LIST} {op} {mode} row")


def copy_bandwidth(parts) -> float:
    """Device copy bandwidth (GB/s, bytes read + written): the best ``copy`` row of the few-large list."""
    part, rows = _optim_rows(parts)
    copies = [_figure(row.get("ours_gbs"), f"{OPTIM_LIST} copy {row.get('mode')} ours_gbs") for row in rows
              if row.get("list") == OPTIM_LIST and row.get("op") == "copy"]
    if not copies:
        raise _broken(part, f"{OPTIM_LIST} copy row")
    return max(copies)


def _vs_torch(op, mode):
    def measure(parts):
        row = _optim_row(parts, op, mode)
        if row.get("torch_ms") is None:
            raise Missing(f"{op} {mode}: no torch figure")
        ours = _figure(row.get("ours_ms"), f"{op} {mode} ours_ms")
        torch_ms = _figure(row["torch_ms"], f"{op} {mode} torch_ms")
        return ours / torch_ms, f"ours {ours:.3f} ms, torch ({row.get('torch_impl')}) {torch_ms:.3f} ms"
    return measure


def _of_bandwidth(op, mode):
    def measure(parts):
        row, copy = _optim_row(parts, op, mode), copy_bandwidth(parts)
        ours = _figure(row.get("ours_gbs"), f"{op} {mode} ours_gbs")
        return ours / copy, f"{ours:.0f} GB/s of {copy:.0f} GB/s copy bandwidth"
    return measure


def _wgrad(shape):
    def measure(parts):
        part = _part(parts, "wgrad")
        for row in (part.get("data") or {}).get("rows") or []:
            if (row.get("tokens"), row.get("n_in"), row.get("n_out")) == shape:
                fused = _figure(row.get("fused_ms"), "wgrad fused_ms")
                gemm = _figure(row.get("gemm_ms"), "wgrad gemm_ms")
                return fused / gemm, f"fused {fused:.3f} ms, bf16 GEMM {gemm:.3f} ms"
        raise _broken(part, "row of shape {} x {} -> {}".format(*shape))
    return measure


WGRAD_SHAPES = ((4096, 1024, 4096), (4096, 4096, 1024), (2048, 1024, 3072))  # bench_wgrad.SHAPES


def _targets() -> list:
    bench = "bench, bench-fused"
    t = [
        Target("build", "CUDA extension built and loaded (backend cuda-ext)", ">=", 1.0, "ok", _build, "build"),
        Target("suite", "whole suite, LIGHTNING_AMP_REQUIRE_EXT=1: 0 failed, no crash, > 0 passed", ">=", 1.0, "ok",
               _suite, "suite"),
        Target("no_host_sync", "no host sync in O1/O2/O3 steps (set_sync_debug_mode('error')): all pass, none skipped",
               ">=", 1.0, "ok", _sync, "sync"),
        Target("o2_vs_bf16_true", "O2+FusedAdam step time / bf16-true", "<=", 1.03, "x",
               _o2_step_vs(("bf16-true",), speedup=False), bench),
        Target("o2_speedup_vs_tf32", "O2+FusedAdam speed-up over TF32 (32-true)", ">=", 2.15, "x",
               _o2_step_vs(("32-true", "fp32"), speedup=True), bench),
        Target("o2_speedup_vs_bf16_mixed", "O2+FusedAdam speed-up over bf16-mixed", ">=", 1.4, "x",
               _o2_step_vs(("bf16-mixed",), speedup=True), bench),
        Target("o2_memory_vs_tf32", "O2+FusedAdam peak memory / TF32", "<=", 0.6, "x", _o2_memory, bench),
        Target("o2_loss_vs_tf32", "O2+FusedAdam final loss vs TF32 after 300 steps", "<=", 0.02, "%", _o2_loss, bench),
        Target("o2_half_ops_vs_fp32_ops",
               "O2's half op policy: step <= 0.98x O2 with torch's autocast lists (norm_policy='fp32')", "<=",
               O2_FORWARD_LIMIT, "x", _o2_forward, "o2-forward"),
    ]
    for mode, torch_name in (("fp32", "torch fused AdamW"), ("master", "torch fused AdamW on fp32 masters + copies"),
                             ("bf16", "torch fused AdamW")):
        t.append(Target(f"fused_adam_{mode}_vs_torch", f"FusedAdam {mode} step / {torch_name}", "<=", 1.0, "x",
                        _vs_torch("adamw", mode), "optim"))
        t.append(Target(f"fused_adam_{mode}_bandwidth", f"FusedAdam {mode} share of copy bandwidth", ">=", 0.85, "%",
                        _of_bandwidth("adamw", mode), "optim"))
    for mode in ("fp32", "bf16"):
        t.append(Target(f"scale_{mode}_bandwidth", f"multi_tensor_scale {mode} share of copy bandwidth", ">=", 0.85,
                        "%", _of_bandwidth("scale", mode), "optim"))
        t.append(Target(f"l2norm_{mode}_vs_foreach_norm", f"multi_tensor_l2norm {mode} / torch._foreach_norm", "<=",
                        1.0, "x", _vs_torch("l2norm", mode), "optim"))
    for shape in WGRAD_SHAPES:
        t.append(Target("wgrad_{}x{}x{}".format(*shape),
                        "wgrad into fp32 main_grad / plain bf16 GEMM, {} x {} -> {}".format(*shape), "<=", 1.03, "x",
                        _wgrad(shape), "wgrad"))
    return t


TARGETS = _targets()


def judge(target: Target, parts: dict) -> Verdict:
    """The verdict of one target over ``parts`` (part name -> part JSON)."""
    try:
        value, detail = target.measure(parts)
    except NotRun as reason:
        return Verdict(target.key, target.what, NOT_RUN, None, "-", target.limit(), str(reason))
    except (Missing, KeyError, TypeError, ZeroDivisionError) as reason:
        return Verdict(target.key, target.what, FAIL, None, "-", target.limit(), f"{type(reason).__name__}: {reason}"
                       if not isinstance(reason, Missing) else str(reason))
    ok = math.isfinite(value) and (value <= target.threshold if target.op == "<=" else value >= target.threshold)
    measured = ("yes" if value >= 1.0 else "no") if target.unit == "ok" else _show(value, target.unit)
    return Verdict(target.key, target.what, PASS if ok else FAIL, value, measured, target.limit(), detail)


def evaluate(parts: dict) -> list:
    """One :class:`Verdict` per target in :data:`TARGETS`, in order."""
    return [judge(target, parts) for target in TARGETS]
