"""``make gpu-check``'s plumbing on the CPU: the order of the parts, the budget arithmetic, the report
rewritten as each part ends (a check killed mid-part keeps the parts before), verdicts at each target's
limit (the limits of the table in docs/benchmarks.md), missing, broken, not-run and unreadable parts,
figures that are not finite, test runs in which nothing passed or a sync test was skipped, bad input, and
the no-GPU path of the command."""
import copy
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gpu_check import check
from gpu_check.check import Part
from gpu_check.pytest_log import LOG_ENV, read_outcomes
from gpu_check.report import load_parts, write_report
from gpu_check.targets import FAIL, INCOMPLETE, NOT_RUN, PASS, SYNC_TESTS, TARGETS, evaluate
from lightning_amp.bench.report import JSON_KEYS

ROOT = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """This checkout first, then what the environment adds (the test dependencies of the torch-floor lane)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
GPU = "NVIDIA H100 80GB HBM3"
MODES = ("fp32", "master", "bf16")
ORDER = ("build", "smoke", "bench", "optim", "wgrad", "cuda-tests", "suite")


def _record(level, step_ms, peak_mb, loss, optimizer="AdamW(fused=None, foreach=None)", device=GPU, steps=60,
            o2_forward=None):
    return {"model": "bert", "level": level, "dtype": "bfloat16", "device": "cuda", "steps": steps,
            "step_time_ms": step_ms, "samples_per_s": 256e3 / step_ms, "peak_mem_mb": peak_mb,
            "peak_mem_method": "cuda_max_memory_allocated", "final_loss": loss, "chance_loss": 0.69, "learned": True,
            "optimizer": optimizer, "loss_curve": [], "device_name": device, "steady": True, "steady_after": 12,
            "o2_forward": o2_forward}


def _part(name, data, rc=0, timed_out=False):
    return {"part": name, "rc": rc, "timed_out": timed_out, "timeout_s": 480, "seconds": 1.0, "commands": [name],
            "env": {"device": GPU, "torch": "2.11.0+cu130"}, "log_tail": "", "data": data}


def _tests(passed=0, failed=0, skipped=0, not_reached=0, prefix="tests/x_test.py::t"):
    outcomes = {}
    for outcome, count in (("passed", passed), ("failed", failed), ("skipped", skipped), ("not reached", not_reached)):
        outcomes.update({f"{prefix}_{outcome.replace(' ', '_')}{i}": outcome for i in range(count)})
    return outcomes


def _test_part(name, outcomes, rc=0, timed_out=False):
    return _part(name, {"tests": {"outcomes": outcomes}, "workers": 8}, rc=rc, timed_out=timed_out)


def _optim_row(op, mode, ours_ms, ours_gbs, torch_ms=None, lst="few-large"):
    return {"list": lst, "op": op, "mode": mode, "bytes": 1, "ours_ms": ours_ms, "ours_gbs": ours_gbs,
            "torch_impl": "fused" if torch_ms else "-", "torch_ms": torch_ms, "torch_gbs": None, "ratio": None}


def good_parts():
    """Every part present, every figure comfortably inside its target."""
    optim = [_optim_row("copy", "fp32", 0.1, 3000.0), _optim_row("copy", "bf16", 0.1, 2900.0)]
    optim += [_optim_row("adamw", m, 0.9, 2800.0, torch_ms=1.0) for m in MODES]
    optim += [_optim_row(op, m, 0.1, 2800.0) for op in ("lamb", "adadelta", "scale", "finite") for m in ("fp32", "bf16")]
    optim += [_optim_row("l2norm", m, 0.9, 2800.0, torch_ms=1.0) for m in ("fp32", "bf16")]
    optim.append(_optim_row("adamw", "fp32", 5.0, 10.0, torch_ms=1.0, lst="many-small"))  # not judged
    wgrad = [dict(tokens=t, n_in=i, n_out=o, fused_ms=1.0, gemm_ms=1.0, unfused_ms=2.0, fp32_ms=3.0,
                  fused_over_gemm=1.0, fused_gflops=7e5) for t, i, o in ((4096, 1024, 4096), (4096, 4096, 1024),
                                                                          (2048, 1024, 3072))]
    checks = [{"name": n, "ok": True, "seconds": 1.0, "detail": "ok"} for n in ("ops", "o2_policy", "trainer_levels",
                                                                                "sync_debug", "tp_fused")]
    cuda_tests = dict(_tests(passed=4, prefix=SYNC_TESTS + "test_cuda_steps"), **_tests(passed=30, skipped=2))
    return {
        "build": _part("build", {"backend": "cuda-ext", "extension_error": None, "build_seconds": 95.0, "arch": "9.0",
                                 "max_jobs": 16, "ninja": True}),
        "smoke": _part("smoke", {"device": "cuda", "checks": checks}),
        "bench": _part("bench", {"records": [
            _record("32-true", 160.0, 20000.0, 0.300, steps=300), _record("bf16-mixed", 104.0, 14000.0, 0.301),
            _record("bf16-true", 70.0, 11000.0, 0.310),
            _record("O2", 70.0, 11500.0, 0.302, optimizer="FusedAdam", steps=300, o2_forward="half"),
            _record("O1", 100.0, 14000.0, 0.305),
            _record("O2", 75.0, 12000.0, 0.303, optimizer="FusedAdam", o2_forward="fp32")]}),
        "optim": _part("optim", {"rows": optim}),
        "wgrad": _part("wgrad", {"rows": wgrad}),
        "cuda-tests": _test_part("cuda-tests", cuda_tests),
        "suite": _test_part("suite", _tests(passed=900, skipped=3)),
    }


def _records(parts):
    return parts["bench"]["data"]["records"]


def _find(parts, level, o2_forward=None):
    return next(r for r in _records(parts) if r["level"] == level and r["o2_forward"] == o2_forward)


OPTIM_KEYS = ("fused_adam", "lamb", "adadelta", "scale", "finite", "l2norm")  # the targets judged on bench_optim


def _set_optim(parts, op, mode, **fields):
    next(r for r in parts["optim"]["data"]["rows"]
         if (r["list"], r["op"], r["mode"]) == ("few-large", op, mode)).update(fields)


def _setter(key):
    """parts, value -> parts whose figure for target ``key`` is ``value`` (the other figures as they were)."""
    if key == "o2_vs_bf16_true":
        return lambda p, v: _find(p, "O2", "half").update(step_time_ms=70.0 * v)
    if key == "o2_speedup_vs_tf32":
        return lambda p, v: _find(p, "32-true").update(step_time_ms=70.0 * v)
    if key == "o2_speedup_vs_bf16_mixed":
        return lambda p, v: _find(p, "bf16-mixed").update(step_time_ms=70.0 * v)
    if key == "o2_memory_vs_tf32":
        return lambda p, v: _find(p, "O2", "half").update(peak_mem_mb=20000.0 * v)
    if key == "o2_loss_vs_tf32":
        return lambda p, v: _find(p, "O2", "half").update(final_loss=0.300 * (1 + v))
    if key == "o2_half_ops_vs_fp32_ops":  # half 70 ms over the fp32 lists' run
        return lambda p, v: _find(p, "O2", "fp32").update(step_time_ms=70.0 / v)
    if key.endswith("_bandwidth"):  # fused_adam_<mode>_bandwidth, <op>_<mode>_bandwidth; copy is 3000 GB/s
        op, mode = ("adamw", key.split("_")[2]) if key.startswith("fused_adam") else key.split("_")[:2]
        return lambda p, v: _set_optim(p, op, mode, ours_gbs=3000.0 * v)
    if key.startswith("fused_adam") or key.startswith("l2norm"):
        op, mode = ("adamw", key.split("_")[2]) if key.startswith("fused_adam") else ("l2norm", key.split("_")[1])
        return lambda p, v: _set_optim(p, op, mode, ours_ms=1.0 * v)
    if key.startswith("wgrad_"):
        shape = tuple(int(x) for x in key[len("wgrad_"):].split("x"))
        return lambda p, v: next(r for r in p["wgrad"]["data"]["rows"]
                                 if (r["tokens"], r["n_in"], r["n_out"]) == shape).update(fused_ms=v)
    return None


def _verdict(parts, key):
    return next(v for v in evaluate(parts) if v.key == key)


def _docs_table() -> list:
    """The rows (target, limit, from) of the targets table in docs/benchmarks.md, as the page has them."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    start = lines.index("| target | limit | from |") + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(cell.strip() for cell in line.strip().strip("|").split(" | ")))
    return rows


DOCS_LIMIT = re.compile(r"(<=|>=) (\d+(?:\.\d+)?)(x|%)")


def _docs_limits() -> dict:
    """Target text -> (op, threshold) as docs/benchmarks.md states it (the "yes" rows left out)."""
    limits = {}
    for what, limit, _ in _docs_table():
        match = DOCS_LIMIT.fullmatch(limit)
        if match:
            op, number, unit = match.groups()
            limits[what] = (op, float(number) / (100 if unit == "%" else 1))
    return limits


def test_the_docs_table_and_the_targets_are_one_list():
    assert _docs_table() == [(t.what, t.limit(), t.source) for t in TARGETS]
    assert len(_docs_limits()) == len([t for t in TARGETS if t.unit != "ok"]) == 25  # every ratio has its number


def test_good_figures_pass_every_target():
    verdicts = evaluate(good_parts())
    assert [v.key for v in verdicts] == [t.key for t in TARGETS]
    assert [v.key for v in verdicts if v.status != PASS] == []


RATIO_TARGETS = [t for t in TARGETS if t.unit != "ok"]


@pytest.mark.parametrize("target", RATIO_TARGETS, ids=[t.key for t in RATIO_TARGETS])
def test_a_figure_just_past_the_docs_limit_fails_and_just_inside_passes(target):
    op, threshold = _docs_limits()[target.what]  # the published limit, not the one the code holds
    assert op == target.op
    setter = _setter(target.key)
    assert setter is not None, f"no setter for {target.key}"
    for factor in (0.999, 1.001):
        parts = good_parts()
        setter(parts, threshold * factor)
        verdict = _verdict(parts, target.key)
        assert verdict.value == pytest.approx(threshold * factor, rel=1e-9)
        inside = factor < 1 if op == "<=" else factor > 1
        assert verdict.status == (PASS if inside else FAIL), (factor, verdict)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 0.0, -1.0])
@pytest.mark.parametrize("target", RATIO_TARGETS, ids=[t.key for t in RATIO_TARGETS])
def test_a_figure_that_is_not_finite_or_not_positive_fails(target, bad):
    """An infinite step time would make any speed-up pass, a negative one any ratio."""
    if target.key == "o2_loss_vs_tf32" and bad in (0.0, -1.0):
        bad = math.inf  # a loss of 0 or below is a figure; only non-finite ones are refused there
    parts = good_parts()
    if target.key == "o2_half_ops_vs_fp32_ops":
        _find(parts, "O2", "fp32").update(step_time_ms=bad)  # the setter divides by the value
    else:
        _setter(target.key)(parts, bad)
    verdict = _verdict(parts, target.key)
    assert verdict.status == FAIL, verdict
    assert "not a finite" in verdict.detail, verdict


@pytest.mark.parametrize("speedup", ["o2_speedup_vs_tf32", "o2_speedup_vs_bf16_mixed"])
def test_a_ratio_that_overflows_fails(speedup):
    parts = good_parts()
    _find(parts, "O2", "half")["step_time_ms"] = 1e-320  # finite and positive, and 160 ms over it is inf
    verdict = _verdict(parts, speedup)
    assert verdict.status == FAIL and math.isinf(verdict.value), verdict


def test_a_json_infinity_in_a_part_file_fails(tmp_path):
    parts = good_parts()
    _find(parts, "32-true")["step_time_ms"] = math.inf
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))  # writes Infinity, which json reads back
    assert _verdict(load_parts(str(tmp_path)), "o2_speedup_vs_tf32").status == FAIL


def test_a_step_time_that_never_settled_fails_the_speed_targets():
    parts = good_parts()
    _find(parts, "bf16-mixed").update(steady=False, steps=400)
    verdict = _verdict(parts, "o2_speedup_vs_bf16_mixed")
    assert verdict.status == FAIL and "never settled in 400 steps" in verdict.detail
    assert _verdict(parts, "o2_speedup_vs_tf32").status == PASS


@pytest.mark.parametrize("part, key", [("suite", "suite"), ("cuda-tests", "cuda_tests")])
@pytest.mark.parametrize("outcomes", [{}, _tests(skipped=5), _tests(failed=1, skipped=2)],
                         ids=["no-test", "all-skipped", "none-passed"])
def test_a_test_run_in_which_no_test_passed_fails(part, key, outcomes):
    parts = good_parts()
    parts[part] = _test_part(part, outcomes, rc=1 if outcomes else 5)
    verdict = _verdict(parts, key)
    assert verdict.status == FAIL and ("0 passed" in verdict.detail or "missing" in verdict.detail), verdict


def _sync_part(**counts):
    return _test_part("cuda-tests", dict(_tests(**counts, prefix=SYNC_TESTS + "test_cuda"), **_tests(passed=30)))


def test_a_sync_run_with_a_skipped_test_fails():
    """Issue 35: a GPU verdict passed a sync run with skipped tests. Three passed and one skipped is no proof
    that no step synchronises: the skipped one may be the only one that would."""
    parts = good_parts()
    parts["cuda-tests"] = _sync_part(passed=3, skipped=1)
    verdict = _verdict(parts, "no_host_sync")
    assert verdict.status == FAIL and "skipped where none may be" in verdict.detail, verdict
    assert _verdict(parts, "cuda_tests").status == PASS  # elsewhere a skipped CUDA test is allowed


def test_the_sync_verdict_needs_its_tests_run_and_passed():
    parts = good_parts()
    parts["cuda-tests"] = _test_part("cuda-tests", _tests(passed=30))  # no sync test collected
    assert _verdict(parts, "no_host_sync").status == FAIL
    parts["cuda-tests"] = _sync_part(passed=3, failed=1)
    assert _verdict(parts, "no_host_sync").status == FAIL
    parts["cuda-tests"] = _sync_part(passed=3, not_reached=1)
    parts["cuda-tests"].update(rc=None, timed_out=True)
    assert _verdict(parts, "no_host_sync").status == INCOMPLETE


def test_tests_not_reached_make_a_stopped_run_incomplete_and_a_finished_one_fail():
    parts = good_parts()
    parts["suite"] = _test_part("suite", _tests(passed=400, skipped=2, not_reached=300), rc=None, timed_out=True)
    verdict = _verdict(parts, "suite")
    assert verdict.status == INCOMPLETE and "300 not reached of 702" in verdict.detail, verdict
    parts["suite"] = _test_part("suite", _tests(passed=400, failed=1, not_reached=300), rc=None, timed_out=True)
    assert _verdict(parts, "suite").status == FAIL  # a failure among the tests reached
    parts["suite"] = _test_part("suite", _tests(passed=400, not_reached=3), rc=0)  # ended, yet 3 without outcome
    assert _verdict(parts, "suite").status == FAIL
    parts["suite"] = _test_part("suite", _tests(passed=400), rc=3)  # pytest's internal error
    assert _verdict(parts, "suite").status == FAIL
    parts["suite"] = _test_part("suite", _tests(passed=400, failed=0), rc=-9)
    assert "signal 9" in _verdict(parts, "suite").detail
    parts["suite"] = _part("suite", {"tests": None}, rc=None, timed_out=True)  # stopped while xdist started
    verdict = _verdict(parts, "suite")
    assert verdict.status == INCOMPLETE and "before pytest had collected the tests: none reached" in verdict.detail
    parts["suite"] = _part("suite", {"tests": None}, rc=2)  # ended without a collection: broken
    assert _verdict(parts, "suite").status == FAIL


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", "\xff\xfe"])
def test_an_unreadable_part_file_fails_its_targets(tmp_path, content):
    parts = good_parts()
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))
    (tmp_path / "part-optim.json").write_bytes(content.encode("latin-1"))
    verdicts = {v.key: v for v in evaluate(load_parts(str(tmp_path)))}
    optim = [v for k, v in verdicts.items() if v.key.startswith(OPTIM_KEYS)]
    assert len(optim) == 16 and all(v.status == FAIL and "part optim unreadable (part-optim.json" in v.detail
                                    for v in optim), optim
    assert {v.status for k, v in verdicts.items() if v not in optim} == {PASS}
    (tmp_path / "part-suite.json").write_text('{"part": "suite", "rc": 0, "data": {"tests": ')  # cut short
    assert _verdict(load_parts(str(tmp_path)), "suite").status == FAIL


def test_build_and_smoke_verdicts_fail_on_what_they_name():
    parts = good_parts()
    parts["build"]["data"] = {"backend": "torch", "extension_error": "undefined symbol: _ZN3c10"}
    parts["smoke"]["data"]["checks"][1].update(ok=False, detail="layer_norm bfloat16 on the switch gave float32")
    verdicts = {v.key: v for v in evaluate(parts)}
    assert verdicts["build"].status == FAIL and "undefined symbol" in verdicts["build"].detail
    assert verdicts["smoke"].status == FAIL and "o2_policy: layer_norm" in verdicts["smoke"].detail
    parts["smoke"]["data"]["checks"][1].update(ok=None, detail="not run: needs CUDA")  # not run is not passed
    assert _verdict(parts, "smoke").status == FAIL
    parts = good_parts()
    parts["smoke"].update(rc=None, timed_out=True)  # every check it reached passed, the rest is lost
    assert _verdict(parts, "smoke").status == FAIL


@pytest.mark.parametrize("missing", ORDER)
def test_a_missing_part_gives_not_run_for_its_targets_only(missing):
    parts = good_parts()
    del parts[missing]
    verdicts = evaluate(parts)
    not_run = {v.key for v in verdicts if v.status == NOT_RUN}
    assert not_run, missing
    assert all(f"part {missing} not run" in v.detail for v in verdicts if v.status == NOT_RUN)
    assert {v.status for v in verdicts if v.key not in not_run} == {PASS}


def test_a_part_not_run_gives_not_run_with_its_reason(tmp_path):
    parts = good_parts()
    parts["wgrad"] = {"part": "wgrad", "not_run": "needs at least 15 s, 4 s of the 450 s budget left"}
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))
    verdicts = write_report(str(tmp_path))
    wgrad = [v for v in verdicts if v.key.startswith("wgrad_")]
    assert len(wgrad) == 3 and all(v.status == NOT_RUN and "4 s of the 450 s budget left" in v.detail for v in wgrad)
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["left_out"] == ["part wgrad: NOT RUN: needs at least 15 s, 4 s of the 450 s budget left"]
    assert report["build_seconds"] == 95.0
    md = (tmp_path / "gpu-check.md").read_text()
    assert "- build: 95 s for compute capability 9.0, MAX_JOBS=16, ninja yes" in md


def test_empty_folder_gives_all_not_run():
    assert {v.status for v in evaluate({})} == {NOT_RUN}


def test_a_part_that_ran_without_the_figure_fails():
    parts = good_parts()
    parts["optim"] = _part("optim", {"rows": []}, rc=None, timed_out=True)
    verdict = _verdict(parts, "fused_adam_fp32_vs_torch")
    assert verdict.status == FAIL and "timed out after 480 s" in verdict.detail

    parts = good_parts()
    _find(parts, "O2", "half").update(error="RuntimeError: CUDA error: an illegal memory access", step_time_ms=None)
    verdict = _verdict(parts, "o2_vs_bf16_true")
    assert verdict.status == FAIL and "illegal memory access" in verdict.detail

    parts = good_parts()
    _find(parts, "O2", "half")["device_name"] = "NVIDIA H200"
    assert _verdict(parts, "o2_speedup_vs_tf32").status == FAIL  # a ratio across two devices is no figure

    parts = good_parts()
    _find(parts, "32-true")["steps"] = 250
    verdict = _verdict(parts, "o2_loss_vs_tf32")
    assert verdict.status == FAIL and "only 250 steps trained" in verdict.detail

    parts = good_parts()
    parts["bench"]["data"]["records"] = [r for r in _records(parts) if r["o2_forward"] != "fp32"]
    verdict = _verdict(parts, "o2_half_ops_vs_fp32_ops")  # one forward alone is no figure
    assert verdict.status == FAIL and "norm_policy='fp32'" in verdict.detail


def test_the_headline_runs_what_the_targets_compare():
    from gpu_check.headline import LOSS_STEPS, RUNS

    runs = [(r.level, r.optimizer, r.o2_forward) for r in RUNS]
    assert runs[:5] == [("32-true", "example", "half"), ("bf16-mixed", "example", "half"),
                        ("bf16-true", "example", "half"), ("O2", "fused-adam", "half"), ("O1", "example", "half")]
    assert ("O2", "fused-adam", "fp32") in runs
    assert LOSS_STEPS == 300 and {r.level for r in RUNS if r.min_steps >= LOSS_STEPS} == {"32-true", "O2"}


def test_the_bench_fields_read_are_in_bench_json():
    read = {"level", "optimizer", "step_time_ms", "peak_mem_mb", "final_loss", "steps", "learned"}
    assert read <= set(JSON_KEYS)


def test_report_files_hold_a_verdict_line_per_target(tmp_path):
    parts = good_parts()
    parts["wgrad"]["data"]["rows"][0]["fused_ms"] = 1.5
    parts["suite"] = _test_part("suite", _tests(passed=400, not_reached=300), rc=None, timed_out=True)
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))
    (tmp_path / "part-broken.json").write_text("{not json")  # listed as unreadable; no target reads it
    verdicts = write_report(str(tmp_path))
    assert set(load_parts(str(tmp_path))) == set(parts) | {"broken"}
    md = (tmp_path / "gpu-check.md").read_text()
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert len(report["verdicts"]) == len(TARGETS) == len(verdicts)
    assert [v["status"] for v in report["verdicts"]].count(FAIL) == 1
    assert "**28 PASS, 1 FAIL, 1 INCOMPLETE, 0 NOT RUN**" in md
    for target in TARGETS:
        assert sum(line.startswith("| ") and f"| {target.what} |" in line for line in md.splitlines()) == 1
    assert "| FAIL | wgrad into fp32 main_grad / plain bf16 GEMM, 4096 x 1024 -> 4096 | 1.500x | <= 1.03x |" in md
    assert "| broken | unreadable (part-broken.json: JSONDecodeError" in md
    assert "- part suite: 300 of 700 tests not reached" in md and "- part suite: timed out after 480 s" in md
    assert "| O2 | FusedAdam | fp32 | 75.00 |" in md  # the headline runs
    assert "| tp_fused | ok |" in md and "copy" in md  # the smoke checks and the optimizer rows


def _load_script(name, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"_gpu_check_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_optim_json_rows_feed_the_optimizer_targets(tmp_path, monkeypatch):
    """The real script's --json rows (on the CPU) carry every field the optimizer targets read."""
    out = tmp_path / "optim.json"
    bench_optim = _load_script("bench_optim", monkeypatch)
    assert bench_optim.main(["--device", "cpu", "--lists", "few-large", "--modes", "fp32,bf16,master",
                             "--ops", check.OPTIM_OPS, "--repeats", "1", "--json", str(out)]) == 0
    verdicts = evaluate({"optim": _part("optim", {"rows": json.loads(out.read_text())})})
    judged = [v for v in verdicts if v.key.startswith(OPTIM_KEYS)]
    assert len(judged) == 16
    assert all(v.status in (PASS, FAIL) and v.value is not None for v in judged), judged


# not marked slow (5 s measured): the fast lane's only test of gpu_check.pytest_log (lane_durations.py)
def test_the_pytest_plugin_records_each_outcome_as_it_comes(tmp_path):
    """A real pytest run with the plugin, killed during its fourth test: the three before it are recorded,
    the fourth and fifth are not reached, the deselected one is not counted."""
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import time, pytest
        def test_ok(): pass
        def test_bad(): assert 1 == 2
        @pytest.mark.skip(reason='probe')
        def test_skipped(): pass
        def test_hangs(): time.sleep(120)
        def test_after(): pass
        @pytest.mark.cuda
        def test_deselected(): pass
        """))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: probe\n")
    log = tmp_path / "outcomes.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                                "gpu_check.pytest_log", "-m", "not cuda", "test_probe.py"], cwd=tmp_path,
                               env=dict(os.environ, **{LOG_ENV: str(log)}, PYTHONPATH=_pythonpath()),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180  # a loaded machine starts pytest slowly
        while time.monotonic() < deadline and (not log.exists() or log.read_text().count('"id"') < 3):
            time.sleep(0.1)
    finally:
        process.kill()
        process.wait()
    counts = read_outcomes(log)
    assert {k: counts[k] for k in ("collected", "passed", "failed", "skipped", "not_reached")} == \
        {"collected": 5, "passed": 1, "failed": 1, "skipped": 1, "not_reached": 2}
    assert counts["outcomes"]["test_probe.py::test_hangs"] == "not reached"
    assert counts["failed_names"] == ["test_probe.py::test_bad"]
    assert counts["reasons"] == {"test_probe.py::test_bad": "assert 1 == 2"}
    assert read_outcomes(tmp_path / "absent.jsonl") is None


def test_a_failed_tests_reason_reaches_the_report_a_crashed_workers_too():
    """A worker that died (a segfault: what 28 CUDA tests did at f667cf8) gives xdist's string report; its line
    is the reason, and the report lists every failed test with its reason."""
    from types import SimpleNamespace

    from gpu_check.pytest_log import failure_reason
    from gpu_check.report import render_markdown

    crashed = SimpleNamespace(longrepr="\nworker 'gw9' crashed while running 'tests/t.py::test_x'\n")
    assert failure_reason(crashed) == "worker 'gw9' crashed while running 'tests/t.py::test_x'"
    raised = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=SimpleNamespace(message="ValueError: shape | 2\nmore")))
    assert failure_reason(raised) == "ValueError: shape | 2"
    tests = {"reasons": {"tests/t.py::test_x": failure_reason(crashed), "tests/t.py::test_y": failure_reason(raised)}}
    text = render_markdown({"cuda-tests": _part("cuda-tests", {"tests": tests})}, [])
    assert "## Failed tests of part cuda-tests, and why" in text
    assert "| `tests/t.py::test_x` | worker 'gw9' crashed while running 'tests/t.py::test_x' |" in text
    assert "| `tests/t.py::test_y` | ValueError: shape / 2 |" in text


def _fake_plan(**collects):
    """PLAN with each part's collect replaced by ``collects[name]`` (default: returns {"name": name})."""
    return tuple(Part(p.name, collects.get(p.name, lambda run, raw, _n=p.name: {"name": _n}), p.need_s, p.cap_s,
                      p.partial) for p in check.PLAN)


@pytest.fixture
def fake_gpu(monkeypatch):
    """gpu_check.check as on a GPU machine, with no device probe (its environment is a fixed dict)."""
    monkeypatch.setattr(check, "cuda_available", lambda: True)
    monkeypatch.setattr(check, "environment", lambda: {"device": GPU, "commit": "abc1234"})
    monkeypatch.setattr(check, "PLAN", _fake_plan(build=lambda run, raw: {"backend": "cuda-ext"}))


def test_a_part_past_its_timeout_is_killed_and_keeps_its_partial_rows(tmp_path, fake_gpu):
    rows = good_parts()["optim"]["data"]["rows"]

    def slow_optim(run, raw):
        (raw / "optim.json").write_text(json.dumps(rows[:3]))  # as bench_optim rewrites it after each row
        run([sys.executable, "-c", "import time; time.sleep(120)"])
        raise AssertionError("not reached")

    part = next(p for p in check.PLAN if p.name == "optim")
    t0 = time.monotonic()
    record = check.run_part(Part("optim", slow_optim, 1, None, part.partial), tmp_path, tmp_path, timeout_s=2.0)
    assert time.monotonic() - t0 < 30
    assert record["timed_out"] and record["rc"] is None and len(record["data"]["rows"]) == 3
    saved = json.loads((tmp_path / "part-optim.json").read_text())
    assert saved["commands"] and saved["timed_out"] and "[gpu-check: killed, timeout]" in saved["log_tail"]
    verdicts = {v.key: v for v in evaluate({"optim": saved})}
    assert verdicts["fused_adam_fp32_vs_torch"].status == PASS  # measured before the timeout
    assert verdicts["scale_fp32_bandwidth"].status == FAIL and "timed out" in verdicts["scale_fp32_bandwidth"].detail


def test_a_failing_command_sets_the_part_exit_status(tmp_path, fake_gpu):
    collect = lambda run, raw: {"rows": [], "out": run([sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                                                        env={"PROBE": "1"})}  # noqa: E731
    record = check.run_part(Part("wgrad", collect, 1, None), tmp_path, tmp_path, timeout_s=60)
    assert record["rc"] == 3 and not record["timed_out"] and "hello" in record["log_tail"]
    assert record["commands"][0].startswith("PROBE=1 ") and (tmp_path / "logs" / "wgrad.log").exists()

    def unreadable(run, raw):  # a command whose output cannot be parsed: the part fails, the check goes on
        return json.loads(run([sys.executable, "-c", "print('Segmentation fault')"]))
    record = check.run_part(Part("build", unreadable, 1, None), tmp_path, tmp_path, timeout_s=60)
    assert record["rc"] == 1 and "reading the part's output failed: JSONDecodeError" in record["log_tail"]
    assert _verdict({"build": record}, "build").status == FAIL


def test_the_parts_run_in_the_issues_order(tmp_path, fake_gpu, monkeypatch):
    assert check.PARTS == ORDER
    calls = []
    monkeypatch.setattr(check, "run_part", lambda part, out, raw, timeout_s: calls.append(part.name) or
                        check._save(out, {"part": part.name, "rc": 0, "data": {"backend": "cuda-ext"}}))
    assert check.main(["--out", str(tmp_path)]) in (0, 1)
    assert calls == list(ORDER)
    calls.clear()
    check.main(["--out", str(tmp_path), "--part", "suite,wgrad,smoke"])
    assert calls == ["build", "smoke", "wgrad", "suite"]  # the plan's order, build first, whatever PART says
    report = json.loads((tmp_path / "gpu-check.json").read_text())  # one run, one report: no part of the last
    assert {name: p["status"] for name, p in report["parts"].items() if name not in calls} == \
        {name: "NOT RUN: not asked for (PART=suite,wgrad,smoke)" for name in ("bench", "optim", "cuda-tests")}


def test_the_budget_gives_each_part_its_cap_or_what_is_left_and_reports_what_cannot_fit(tmp_path, fake_gpu,
                                                                                       monkeypatch, capsys):
    clock, calls = [0.0], []
    taken = {"build": 100.0, "smoke": 60.0, "bench": 200.0}

    def fake_run_part(part, out, raw, timeout_s):
        calls.append((part.name, timeout_s))
        clock[0] += taken.get(part.name, 10.0)
        return check._save(out, {"part": part.name, "rc": 0, "seconds": taken.get(part.name, 10.0),
                                     "data": {"backend": "cuda-ext"}})

    monkeypatch.setattr(check, "run_part", fake_run_part)
    monkeypatch.setattr(check.time, "monotonic", lambda: clock[0])
    plan = {p.name: p for p in check.PLAN}
    check.main(["--out", str(tmp_path), "--budget", "400"])
    assert (plan["build"].cap_s, plan["smoke"].cap_s, plan["bench"].cap_s) == (360, 150, 240)
    # build gets its cap (360 < 400), smoke its cap (150 < 300 left), bench the 240 s left (= its cap);
    # after bench 40 s are left: optim (needs 20, cap 90) gets them, then wgrad (needs 15) the 30 s left
    assert calls == [("build", 360), ("smoke", 150), ("bench", 240), ("optim", 40), ("wgrad", 30)]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["parts"]["cuda-tests"]["status"] == "NOT RUN: needs at least 30 s, 20 s of the 400 s budget left"
    assert report["parts"]["suite"]["status"] == "NOT RUN: needs at least 30 s, 20 s of the 400 s budget left"
    assert {v["status"] for v in report["verdicts"] if v["key"] in ("suite", "cuda_tests", "no_host_sync")} == {NOT_RUN}
    assert "part suite: NOT RUN: needs at least 30 s" in capsys.readouterr().out.replace("== ", "")


def test_a_failed_build_leaves_the_other_parts_not_run_with_the_reason(tmp_path, fake_gpu, monkeypatch):
    monkeypatch.setattr(check, "PLAN", _fake_plan(build=lambda run, raw: {"backend": "torch"}))
    assert check.main(["--out", str(tmp_path), "--budget", "100"]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["parts"]["build"]["status"] == "ok"
    assert all(report["parts"][name]["status"].startswith("NOT RUN: the build part did not give the CUDA extension")
               for name in ORDER[1:])


_CHILD = """
import sys, time
from gpu_check import check
from gpu_check.check import Part
from gpu_check.targets import SYNC_TESTS
check.cuda_available = lambda: True
check.environment = lambda: {"device": "fake GPU", "commit": "abc1234"}
checks = [{"name": "ops", "ok": True, "seconds": 0.1, "detail": "fine"}]
def slow(run, raw):
    run([sys.executable, "-c", "print('bench is running', flush=True); import time; time.sleep(20)"])
collects = {"build": lambda run, raw: {"backend": "cuda-ext", "build_seconds": 1.0},
            "smoke": lambda run, raw: {"checks": checks}, "bench": slow}
check.PLAN = tuple(Part(p.name, collects.get(p.name, lambda run, raw: {}), p.need_s, p.cap_s, p.partial)
                       for p in check.PLAN)
sys.exit(check.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_check_killed_mid_part_keeps_the_verdicts_of_the_parts_before(tmp_path, how):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-c", _CHILD, "--out", str(out), "--budget", "900"], cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=_pythonpath()), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    log = out / "logs" / "bench.log"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (log.exists() and "bench is running" in log.read_text()):
            time.sleep(0.1)
        process.send_signal(how)
        output = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    report = json.loads((out / "gpu-check.json").read_text())
    statuses = {v["key"]: v["status"] for v in report["verdicts"]}
    assert statuses["build"] == PASS and statuses["smoke"] == PASS  # finished before the kill: kept
    assert statuses["o2_vs_bf16_true"] == FAIL  # the part that was running lost its figures
    md = (out / "gpu-check.md").read_text()
    assert "| PASS | CUDA extension built and loaded (backend cuda-ext) |" in md
    if how == signal.SIGKILL:  # nothing could run after the kill: the report says bench was running
        assert report["parts"]["bench"]["status"].startswith("running, or killed while running")
        assert report["running"] == "bench" and "optim" not in report["parts"]
        write_report(str(out))  # rendered again later: the running part's log tail is read from logs/bench.log
        assert "bench is running" in (out / "gpu-check.md").read_text()
    else:  # SIGTERM: bench ends as interrupted with its log tail, the rest NOT RUN with the reason
        assert process.returncode == 1 and "Traceback" not in output
        assert report["parts"]["bench"]["status"] == "interrupted (SIGTERM)"
        assert report["parts"]["suite"]["status"] == "NOT RUN: the check was interrupted (SIGTERM) before this part"
        assert "bench is running" in md and statuses["suite"] == NOT_RUN


@pytest.mark.parametrize("plumbing_rc", [0, 1])
def test_without_a_gpu_it_says_so_runs_its_plumbing_test_and_exits_with_its_status(tmp_path, monkeypatch, capsys,
                                                                                   plumbing_rc):
    calls = []
    monkeypatch.setattr(check, "cuda_available", lambda: False)
    monkeypatch.setattr(check, "run_plumbing_test", lambda: calls.append(1) or plumbing_rc)
    monkeypatch.setattr(check, "run_part", lambda *a, **k: pytest.fail("measured without a GPU"))
    assert check.main(["--out", str(tmp_path)]) == plumbing_rc
    assert calls == [1]
    assert "no CUDA GPU on this machine" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {v["status"] for v in report["verdicts"]} == {NOT_RUN}
    assert "No CUDA GPU" in (tmp_path / "gpu-check.md").read_text()


def test_report_only_rerenders_the_parts_in_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "run_part", lambda *a, **k: pytest.fail("--report-only measured"))
    parts = good_parts()
    for name in ("optim", "bench"):
        (tmp_path / f"part-{name}.json").write_text(json.dumps(parts[name]))
    assert check.main(["--report-only", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = {v["key"]: v["status"] for v in report["verdicts"]}
    assert statuses["o2_vs_bf16_true"] == PASS and statuses["suite"] == NOT_RUN
    bad = copy.deepcopy(parts["bench"])
    _find({"bench": bad}, "O2", "half")["step_time_ms"] = 90.0
    (tmp_path / "part-bench.json").write_text(json.dumps(bad))
    assert check.main(["--report-only", "--out", str(tmp_path)]) == 1  # a FAIL verdict


@pytest.mark.parametrize("argv, message", [
    (["--part", "suite,bnech"], "PART must be a comma-separated list from build,smoke,bench,optim,wgrad,cuda-tests,"
                                "suite; unknown: bnech"),
    (["--budget", "abc"], "--budget: must be a positive number of seconds, got 'abc'"),
    (["--budget", "0"], "must be a positive number of seconds, got '0'"),
    (["--budget", "-30"], "got '-30'"),
    (["--budget", "nan"], "got 'nan'"),
    (["--budget", "inf"], "got 'inf'"),
])
def test_bad_input_is_a_usage_error_naming_the_allowed_values(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(check, "run_part", lambda *a, **k: pytest.fail("ran with bad input"))
    with pytest.raises(SystemExit) as exit_info:
        check.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_make_gpu_check_refuses_bad_input_without_a_traceback(tmp_path):
    """Through make (one call: each starts torch): the budget is refused first, naming what it must be."""
    done = subprocess.run(["make", "-s", "-C", str(ROOT), "gpu-check", f"GPU_PY={sys.executable}",
                           f"GPU_CHECK_OUT={tmp_path}", "GPU_CHECK_BUDGET=ten", "PART=bnech"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert "--budget: must be a positive number of seconds, got 'ten'" in done.stderr, done.stderr
    assert not (tmp_path / "gpu-check.json").exists()


def test_the_o2_forward_bench_switches_o2s_norm_policy(monkeypatch):
    import lightning_amp
    from lightning_amp.trainer import precision
    from gpu_check.headline import use_forward

    monkeypatch.setattr(precision.AmpO2Precision, "__init__", precision.AmpO2Precision.__init__)  # restored after the test
    assert lightning_amp.AmpO2Precision().properties.norm_policy == "half"  # the shipped forward
    use_forward("fp32")
    assert lightning_amp.AmpO2Precision().properties.norm_policy == "fp32"
    assert lightning_amp.AmpO2Precision(norm_policy="half").properties.norm_policy == "half"  # an explicit choice stays
    with pytest.raises(ValueError, match="forward must be one of"):
        use_forward("cast")


def test_the_build_compiles_sources_in_parallel_processes_and_reports_a_failed_one(tmp_path):
    """gpu_check.build's no-ninja path on a two-source C extension: built and importable, lightning_amp never
    imported (it is what gpu-check's build rebuilds); a source that does not compile fails the build naming it."""
    (tmp_path / "a.c").write_text("int probe_value(void) { return 41; }\n")
    (tmp_path / "b.c").write_text(textwrap.dedent("""
        #include <Python.h>
        int probe_value(void);
        static PyObject *value(PyObject *self, PyObject *args) { return PyLong_FromLong(probe_value() + 1); }
        static PyMethodDef methods[] = {{"value", value, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
        static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "probe", "", -1, methods};
        PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&module); }
        """))
    (tmp_path / "setup.py").write_text("from setuptools import Extension, setup\n"
                                       "setup(name='probe', ext_modules=[Extension('probe', SOURCES)])\n")
    script = ("import sys, runpy\nfrom gpu_check import build\n"
              "assert build.compile_in_parallel(2)\nsys.argv = ['setup.py', 'build_ext', '--inplace']\n"
              "runpy.run_path('setup.py', run_name='__main__')\nassert 'lightning_amp' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    setup = (tmp_path / "setup.py").read_text()
    (tmp_path / "setup.py").write_text("SOURCES = ['a.c', 'b.c']\n" + setup)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = subprocess.run([sys.executable, "-c", "import probe; print(probe.value())"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "42", loaded.stderr
    (tmp_path / "bad.c").write_text("int broken(void) { return }\n")
    (tmp_path / "setup.py").write_text("SOURCES = ['a.c', 'bad.c', 'b.c']\n" + setup)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0 and "compiling bad.o failed" in done.stderr, done.stderr[-2000:]


def test_the_build_part_builds_for_the_present_gpu_only_with_a_job_per_core(tmp_path, monkeypatch):
    monkeypatch.setattr(check, "environment", lambda: {"capability": "9.0"})
    calls = []

    def run(argv, env=None):
        calls.append((argv, env))
        return '{"backend": "cuda-ext", "extension_error": null}\n'

    data = check._part_build(run, tmp_path)
    (build_argv, build_env), (check_argv, _) = calls
    assert build_argv == [sys.executable, "-m", "gpu_check.build"]  # gpu_check's: lightning_amp not imported
    assert build_env == {"TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": str(os.cpu_count())}
    assert "backend('cuda')" in check_argv[-1]
    assert data["backend"] == "cuda-ext" and data["arch"] == "9.0" and data["build_seconds"] >= 0
