"""The GPU targets of issue 19 as verdicts over the outputs of ``make gpu-check``'s parts.

Each part writes ``part-<name>.json`` (see :mod:`gpu_check.check`): its exit status, time,
log tail and ``data`` (smoke checks, headline records, ``bench_optim``/``bench_wgrad`` rows, test
outcomes), or ``not_run`` with the reason it did not run. :func:`evaluate` turns the parts into one
:class:`Verdict` per target: ``PASS`` or ``FAIL`` with the measured figure, ``NOT RUN`` (with the reason)
when the part that measures it did not run, or ``INCOMPLETE`` when a test part ran out of time with no
test failed and some tests not reached. A part that ran but lacks the figure (it crashed, timed out, was
killed while running, a run failed, or its file cannot be read) gives ``FAIL``, and so does a figure
that is not a finite number (a time or a size that is not positive, a ratio that overflows), a step time
that never settled, a test run in which no test passed, and a sync-debug run with a skipped test.
Ratios are taken within one part's run, never across devices. The thresholds are those of the table in
docs/benchmarks.md, which ``tests/bench/test_gpu_check.py`` holds against :data:`TARGETS`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

PASS, FAIL, NOT_RUN, INCOMPLETE = "PASS", "FAIL", "NOT RUN", "INCOMPLETE"
STATUSES = (PASS, FAIL, INCOMPLETE, NOT_RUN)
#: the test file whose CUDA tests are the no-host-sync verdict
SYNC_TESTS = "tests/precision/test_precision_sync.py::"
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


class Incomplete(Exception):
    """A test part ran out of time: no test failed, some were not reached."""


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
    if parts[name].get("not_run"):
        raise NotRun(f"part {name} not run: {parts[name]['not_run']}")
    return parts[name]


def part_status(part: dict) -> str:
    """"ok", "NOT RUN: why", "unreadable (why)", "running, or killed while running", "interrupted",
    "timed out after N s", "crashed (signal N)" or "failed (exit N)"."""
    if part.get("not_run"):
        return f"NOT RUN: {part['not_run']}"
    if part.get("unreadable"):
        return f"unreadable ({part['unreadable']})"
    if part.get("running"):
        return f"running, or killed while running (started {part.get('started', '?')} UTC)"
    if part.get("interrupted"):
        return "interrupted (SIGTERM)"
    if part.get("timed_out"):
        timeout = part.get("timeout_s")
        return f"timed out after {timeout:.0f} s" if isinstance(timeout, (int, float)) else "timed out"
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


def count_outcomes(outcomes: dict) -> dict:
    """passed / failed / skipped / not reached counts of a map test id -> outcome."""
    return {o: sum(v == o for v in outcomes.values()) for o in ("passed", "failed", "skipped", "not reached")}


def judge_tests(part: dict, outcomes: dict, skipped_allowed: bool) -> tuple:
    """(1.0 or 0.0, detail) of a test run's ``outcomes`` (test id -> "passed", "failed", "skipped" or
    "not reached"); raises :class:`Incomplete` when the run was stopped with tests not reached and none
    failed. 0.0 (FAIL): a test failed, pytest crashed (an exit status other than 0 and 1 when it was not
    stopped), no test was collected or passed, a test was skipped where ``skipped_allowed`` is false, or
    tests were left without an outcome by a run that was not stopped."""
    counts = count_outcomes(outcomes)
    stopped = part.get("timed_out") or part.get("interrupted")
    detail = (f"{counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed, "
              f"{counts['not reached']} not reached of {len(outcomes)}; {part_status(part)}")
    failed = [t for t, v in outcomes.items() if v == "failed"]
    if failed:
        detail += "; failed: " + ", ".join(failed[:8]) + (f" and {len(failed) - 8} more" if len(failed) > 8 else "")
    skipped = [t for t, v in outcomes.items() if v == "skipped"]
    if skipped and not skipped_allowed:
        detail += "; skipped where none may be: " + ", ".join(skipped[:4])
    if counts["failed"] or (skipped and not skipped_allowed) or not outcomes:
        return 0.0, detail
    if not stopped and part.get("rc") not in (0, 1):
        return 0.0, detail
    if counts["not reached"]:
        if stopped:
            raise Incomplete(detail)
        return 0.0, detail
    return (1.0 if counts["passed"] > 0 else 0.0), detail


def _test_outcomes(parts, name) -> tuple:
    part = _part(parts, name)
    tests = (part.get("data") or {}).get("tests")
    if not tests or not isinstance(tests.get("outcomes"), dict):
        if (part.get("timed_out") or part.get("interrupted")) and not part.get("unreadable"):
            raise Incomplete(f"{part_status(part)} before pytest had collected the tests: none reached")
        raise _broken(part, "test outcomes")
    return part, tests["outcomes"]


def _tests(name):
    def measure(parts):
        part, outcomes = _test_outcomes(parts, name)
        return judge_tests(part, outcomes, skipped_allowed=True)
    return measure


def _sync(parts):
    part, outcomes = _test_outcomes(parts, "cuda-tests")
    sync = {t: v for t, v in outcomes.items() if t.startswith(SYNC_TESTS)}
    if not sync:
        raise _broken(part, f"{SYNC_TESTS}* test")
    return judge_tests(part, sync, skipped_allowed=False)


def _smoke(parts):
    part = _part(parts, "smoke")
    checks = (part.get("data") or {}).get("checks")
    if not checks:
        raise _broken(part, "smoke checks")
    failed = [c for c in checks if not c.get("ok")]
    detail = f"{len(checks) - len(failed)} of {len(checks)} checks passed; {part_status(part)}"
    if failed:
        detail += "; failed: " + "; ".join(f"{c.get('name')}: {c.get('detail')}" for c in failed[:6])
    complete = part.get("rc") == 0 and not part.get("timed_out") and not part.get("interrupted")
    return (1.0 if complete and not failed else 0.0), detail


def bench_records(parts: dict) -> list:
    """The records of the headline part ``bench`` (one per run, in run order)."""
    return list(((parts.get("bench") or {}).get("data") or {}).get("records") or [])


def _is_fused(record: dict) -> bool:
    return str(record.get("optimizer") or "").startswith("FusedAdam")


def _run(parts, levels, fused: bool, o2_forward: str = "half") -> dict:
    """The headline record of a level in ``levels`` (with FusedAdam or not; O2's runs with the given
    forward); Missing where it failed or its step time never settled."""
    part = _part(parts, "bench")
    for record in bench_records(parts):
        if record.get("level") in levels and _is_fused(record) == fused and \
                (record.get("o2_forward") or "half") == o2_forward:
            name = record.get("level") + (" with torch's autocast lists" if o2_forward == "fp32" else "")
            if record.get("error"):
                raise Missing(f"{name} run failed: {record['error']}")
            if record.get("steady") is False:
                raise Missing(f"{name} step time never settled in {record.get('steps')} steps")
            return record
    raise _broken(part, f"{'/'.join(levels)} run" + (" with FusedAdam" if fused else "")
                  + (" and norm_policy='fp32'" if o2_forward == "fp32" else ""))


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
        raise Missing(f"only {steps} steps trained (the target is after 300)")
    o2_loss = _figure(o2["final_loss"], "O2+FusedAdam final_loss", positive=False)
    base_loss = _figure(base["final_loss"], f"{base['level']} final_loss", positive=False)
    difference = abs(o2_loss - base_loss) / abs(base_loss)
    detail = f"O2+FusedAdam {o2_loss:.4f}, {base['level']} {base_loss:.4f} after {steps} steps"
    if base.get("learned") is False:
        detail += f" ({base['level']} did not learn)"
    return difference, detail


def _o2_forward(parts):
    half, fp32 = _run(parts, ("O2",), fused=True), _run(parts, ("O2",), fused=True, o2_forward="fp32")
    half_ms = _figure(half.get("step_time_ms"), "O2+FusedAdam step_time_ms")
    fp32_ms = _figure(fp32.get("step_time_ms"), "O2+FusedAdam norm_policy='fp32' step_time_ms")
    ratio = half_ms / fp32_ms
    decision = (f"the fp32 lists cost {fp32_ms / half_ms - 1:.1%}: keep norm_policy='half'"
                if ratio <= O2_FORWARD_LIMIT else
                f"the fp32 lists cost {fp32_ms / half_ms - 1:.1%} (< 2%): norm_policy='fp32' may become the default")
    return ratio, f"half op policy {half_ms:.1f} ms, torch's autocast lists {fp32_ms:.1f} ms per step; {decision}"


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
    bench = "bench"
    t = [
        Target("build", "CUDA extension built and loaded (backend cuda-ext)", ">=", 1.0, "ok", _build, "build"),
        Target("smoke", "CUDA smoke: compiled ops = fallbacks, O2's policy, O1-O3 Trainer steps, sync-debug step, "
               "tp_fused step", ">=", 1.0, "ok", _smoke, "smoke"),
        Target("no_host_sync", "no host sync in O1/O2/O3 steps (set_sync_debug_mode('error')): all pass, none skipped",
               ">=", 1.0, "ok", _sync, "cuda-tests"),
        Target("cuda_tests", "-m cuda tests, LIGHTNING_AMP_REQUIRE_EXT=1: 0 failed, no crash, > 0 passed, all reached",
               ">=", 1.0, "ok", _tests("cuda-tests"), "cuda-tests"),
        Target("suite", "the other tests (-m 'not cuda'), LIGHTNING_AMP_REQUIRE_EXT=1: 0 failed, no crash, > 0 passed, "
               "all reached", ">=", 1.0, "ok", _tests("suite"), "suite"),
        Target("o2_vs_bf16_true", "O2+FusedAdam step time / bf16-true", "<=", 1.03, "x",
               _o2_step_vs(("bf16-true",), speedup=False), bench),
        Target("o2_speedup_vs_tf32", "O2+FusedAdam speed-up over TF32 (32-true)", ">=", 2.15, "x",
               _o2_step_vs(("32-true", "fp32"), speedup=True), bench),
        Target("o2_speedup_vs_bf16_mixed", "O2+FusedAdam speed-up over bf16-mixed", ">=", 1.20, "x",
               _o2_step_vs(("bf16-mixed",), speedup=True), bench),
        Target("o2_memory_vs_tf32", "O2+FusedAdam peak memory / TF32", "<=", 0.6, "x", _o2_memory, bench),
        Target("o2_loss_vs_tf32", "O2+FusedAdam final loss vs TF32 after 300 steps", "<=", 0.02, "%", _o2_loss, bench),
        Target("o2_half_ops_vs_fp32_ops",
               "O2's half op policy: step <= 0.98x O2 with torch's autocast lists (norm_policy='fp32')", "<=",
               O2_FORWARD_LIMIT, "x", _o2_forward, bench),
    ]
    for mode, torch_name in (("fp32", "torch fused AdamW"), ("master", "torch fused AdamW on fp32 masters + copies"),
                             ("bf16", "torch fused AdamW")):
        t.append(Target(f"fused_adam_{mode}_vs_torch", f"FusedAdam {mode} step / {torch_name}", "<=", 1.0, "x",
                        _vs_torch("adamw", mode), "optim"))
        t.append(Target(f"fused_adam_{mode}_bandwidth", f"FusedAdam {mode} share of copy bandwidth", ">=", 0.85, "%",
                        _of_bandwidth("adamw", mode), "optim"))
    for mode in ("fp32", "bf16"):
        # our own kernels, where torch has none: 16-byte loads and stores, at the copy's bandwidth
        for op, name in (("lamb", "FusedLAMB"), ("adadelta", "FusedAdadelta"), ("scale", "multi_tensor_scale"),
                         ("finite", "multi_tensor_check_finite")):
            t.append(Target(f"{op}_{mode}_bandwidth", f"{name} {mode} share of copy bandwidth", ">=", 0.85, "%",
                            _of_bandwidth(op, mode), "optim"))
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
    except Incomplete as reason:
        return Verdict(target.key, target.what, INCOMPLETE, None, "-", target.limit(), str(reason))
    except (Missing, KeyError, TypeError, ZeroDivisionError) as reason:
        return Verdict(target.key, target.what, FAIL, None, "-", target.limit(), f"{type(reason).__name__}: {reason}"
                       if not isinstance(reason, Missing) else str(reason))
    ok = math.isfinite(value) and (value <= target.threshold if target.op == "<=" else value >= target.threshold)
    measured = ("yes" if value >= 1.0 else "no") if target.unit == "ok" else _show(value, target.unit)
    return Verdict(target.key, target.what, PASS if ok else FAIL, value, measured, target.limit(), detail)


def evaluate(parts: dict) -> list:
    """One :class:`Verdict` per target in :data:`TARGETS`, in order."""
    return [judge(target, parts) for target in TARGETS]
