"""``make gpu-check``'s plumbing on the CPU: verdicts at each target's limit (the limits of the table in
docs/benchmarks.md), missing, broken and unreadable parts, figures that are not finite, suites in which
nothing passed, the report files, part timeouts, junit parsing, and the no-GPU path of the command."""
import copy
import importlib.util
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


from lightning_amp.bench import gpu_check
from lightning_amp.bench.gpu_report import load_parts, write_report
from lightning_amp.bench.gpu_targets import FAIL, NOT_RUN, PASS, TARGETS, evaluate
from lightning_amp.bench.report import JSON_KEYS

ROOT = Path(__file__).resolve().parents[2]
GPU = "NVIDIA H100 80GB HBM3"
MODES = ("fp32", "master", "bf16")


def _record(level, step_ms, peak_mb, loss, optimizer="AdamW(fused=None, foreach=None)", device=GPU):
    return {"model": "bert", "level": level, "dtype": "bfloat16", "device": "cuda", "steps": 300,
            "step_time_ms": step_ms, "samples_per_s": 256e3 / step_ms, "peak_mem_mb": peak_mb,
            "peak_mem_method": "cuda_max_memory_allocated", "final_loss": loss, "chance_loss": 0.69, "learned": True,
            "optimizer": optimizer, "loss_curve": [], "device_name": device}


def _part(name, data, rc=0, timed_out=False):
    return {"part": name, "rc": rc, "timed_out": timed_out, "timeout_s": 480, "seconds": 1.0, "commands": [name],
            "env": {"device": GPU, "torch": "2.11.0+cu130"}, "log_tail": "", "data": data}


def _junit(tests, failures=0, skipped=0):
    return {"junit": {"tests": tests, "failures": failures, "errors": 0, "skipped": skipped, "time": 3.0,
                      "failed_names": []}}


def _optim_row(op, mode, ours_ms, ours_gbs, torch_ms=None, lst="few-large"):
    return {"list": lst, "op": op, "mode": mode, "bytes": 1, "ours_ms": ours_ms, "ours_gbs": ours_gbs,
            "torch_impl": "fused" if torch_ms else "-", "torch_ms": torch_ms, "torch_gbs": None, "ratio": None}


def good_parts():
    """Every part present, every figure comfortably inside its target."""
    optim = [_optim_row("copy", "fp32", 0.1, 3000.0), _optim_row("copy", "bf16", 0.1, 2900.0)]
    optim += [_optim_row("adamw", m, 0.9, 2800.0, torch_ms=1.0) for m in MODES]
    optim += [_optim_row("scale", m, 0.1, 2800.0) for m in ("fp32", "bf16")]
    optim += [_optim_row("l2norm", m, 0.9, 2800.0, torch_ms=1.0) for m in ("fp32", "bf16")]
    optim.append(_optim_row("adamw", "fp32", 5.0, 10.0, torch_ms=1.0, lst="many-small"))  # not judged
    wgrad = [dict(tokens=t, n_in=i, n_out=o, fused_ms=1.0, gemm_ms=1.0, unfused_ms=2.0, fp32_ms=3.0,
                  fused_over_gemm=1.0, fused_gflops=7e5) for t, i, o in ((4096, 1024, 4096), (4096, 4096, 1024),
                                                                          (2048, 1024, 3072))]
    return {
        "build": _part("build", {"backend": "cuda-ext", "extension_error": None}),
        "suite": _part("suite", _junit(900, skipped=3)),
        "sync": _part("sync", _junit(4)),
        "optim": _part("optim", {"rows": optim}),
        "wgrad": _part("wgrad", {"rows": wgrad}),
        "bench": _part("bench", {"records": [_record("32-true", 160.0, 20000.0, 0.300),
                                             _record("bf16-mixed", 104.0, 14000.0, 0.301),
                                             _record("bf16-true", 70.0, 11000.0, 0.310),
                                             _record("O2", 72.0, 11900.0, 0.302)]}),
        "bench-fused": _part("bench-fused", {"records": [_record("O2", 70.0, 11500.0, 0.302, optimizer="FusedAdam")]}),
        "o2-forward": _part("o2-forward", {"records": [
            dict(_record("O2", ms, 11500.0, 0.302, optimizer="FusedAdam"), o2_forward=forward)
            for forward, ms in (("half", 70.0), ("fp32", 75.0), ("half", 70.5), ("fp32", 75.5))]}),
    }


def _records(parts, name):
    return parts[name]["data"]["records"]


def _set_step(parts, name, level, value):
    next(r for r in _records(parts, name) if r["level"] == level)["step_time_ms"] = value


def _set_field(parts, name, level, key, value):
    next(r for r in _records(parts, name) if r["level"] == level)[key] = value


def _set_optim(parts, op, mode, **fields):
    next(r for r in parts["optim"]["data"]["rows"]
         if (r["list"], r["op"], r["mode"]) == ("few-large", op, mode)).update(fields)


def _setter(key):
    """parts, value -> parts whose figure for target ``key`` is ``value`` (the other figures as they were)."""
    if key == "o2_vs_bf16_true":
        return lambda p, v: _set_step(p, "bench-fused", "O2", 70.0 * v)
    if key == "o2_speedup_vs_tf32":
        return lambda p, v: _set_step(p, "bench", "32-true", 70.0 * v)
    if key == "o2_speedup_vs_bf16_mixed":
        return lambda p, v: _set_step(p, "bench", "bf16-mixed", 70.0 * v)
    if key == "o2_memory_vs_tf32":
        return lambda p, v: _set_field(p, "bench-fused", "O2", "peak_mem_mb", 20000.0 * v)
    if key == "o2_loss_vs_tf32":
        return lambda p, v: _set_field(p, "bench-fused", "O2", "final_loss", 0.300 * (1 + v))
    if key == "o2_half_ops_vs_fp32_ops":  # medians: fp32 75.25 ms, half 70.25 ms -> move both half runs
        return lambda p, v: [r.update(step_time_ms=75.25 * v) for r in _records(p, "o2-forward")
                             if r["o2_forward"] == "half"]
    if key.endswith("_bandwidth"):  # fused_adam_<mode>_bandwidth, scale_<mode>_bandwidth; copy is 3000 GB/s
        op, mode = ("adamw", key.split("_")[2]) if key.startswith("fused_adam") else ("scale", key.split("_")[1])
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
    assert len(_docs_limits()) == len([t for t in TARGETS if t.unit != "ok"]) == 19  # every ratio has its number


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
    _setter(target.key)(parts, bad)
    verdict = _verdict(parts, target.key)
    assert verdict.status == FAIL, verdict
    assert "not a finite" in verdict.detail, verdict


@pytest.mark.parametrize("speedup", ["o2_speedup_vs_tf32", "o2_speedup_vs_bf16_mixed"])
def test_a_ratio_that_overflows_fails(speedup):
    parts = good_parts()
    _set_step(parts, "bench-fused", "O2", 1e-320)  # finite and positive, and 160 ms over it is inf
    verdict = _verdict(parts, speedup)
    assert verdict.status == FAIL and math.isinf(verdict.value), verdict


def test_a_json_infinity_in_a_part_file_fails(tmp_path):
    parts = good_parts()
    _set_step(parts, "bench", "32-true", math.inf)
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))  # writes Infinity, which json reads back
    assert _verdict(load_parts(str(tmp_path)), "o2_speedup_vs_tf32").status == FAIL


@pytest.mark.parametrize("part", ["suite", "sync"])
@pytest.mark.parametrize("counts", [dict(tests=0), dict(tests=5, skipped=5), dict(tests=3, failures=1, skipped=2)],
                         ids=["no-test", "all-skipped", "none-passed"])
def test_a_suite_in_which_no_test_passed_fails(part, counts):
    parts = good_parts()
    parts[part] = _part(part, _junit(**counts))
    verdict = _verdict(parts, "suite" if part == "suite" else "no_host_sync")
    assert verdict.status == FAIL and "0 passed" in verdict.detail, verdict


@pytest.mark.parametrize("content", ["{not json", "", "[1, 2]", "\xff\xfe"])
def test_an_unreadable_part_file_fails_its_targets(tmp_path, content):
    parts = good_parts()
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))
    (tmp_path / "part-optim.json").write_bytes(content.encode("latin-1"))
    verdicts = {v.key: v for v in evaluate(load_parts(str(tmp_path)))}
    optim = [v for k, v in verdicts.items() if k.startswith(("fused_adam", "scale", "l2norm"))]
    assert len(optim) == 10 and all(v.status == FAIL and "part optim unreadable (part-optim.json" in v.detail
                                    for v in optim), optim
    assert {v.status for k, v in verdicts.items() if v not in optim} == {PASS}
    (tmp_path / "part-suite.json").write_text('{"part": "suite", "rc": 0, "data": {"junit": ')  # cut short
    assert _verdict(load_parts(str(tmp_path)), "suite").status == FAIL


def test_build_suite_and_sync_verdicts_fail_on_what_they_name():
    parts = good_parts()
    parts["build"]["data"] = {"backend": "torch", "extension_error": "undefined symbol: _ZN3c10"}
    parts["suite"] = _part("suite", _junit(900, failures=1), rc=1)
    parts["sync"] = _part("sync", _junit(4, skipped=4))
    verdicts = {v.key: v for v in evaluate(parts)}
    assert verdicts["build"].status == FAIL and "undefined symbol" in verdicts["build"].detail
    assert verdicts["suite"].status == FAIL and "1 failed" in verdicts["suite"].detail
    assert verdicts["no_host_sync"].status == FAIL  # skipped on a GPU machine is no proof

    parts["suite"] = _part("suite", {"junit": None}, rc=-11)  # killed by SIGSEGV before writing its report
    assert _verdict(parts, "suite").status == FAIL and "signal 11" in _verdict(parts, "suite").detail
    parts["suite"] = _part("suite", _junit(900), rc=2)  # all passed, yet pytest exited with an error
    assert _verdict(parts, "suite").status == FAIL


@pytest.mark.parametrize("missing", ["build", "suite", "sync", "optim", "wgrad", "bench", "bench-fused", "o2-forward"])
def test_a_missing_part_gives_not_run_for_its_targets_only(missing):
    parts = good_parts()
    del parts[missing]
    verdicts = evaluate(parts)
    not_run = {v.key for v in verdicts if v.status == NOT_RUN}
    assert not_run, missing
    assert all(f"part {missing} not run" in v.detail for v in verdicts if v.status == NOT_RUN)
    assert {v.status for v in verdicts if v.key not in not_run} == {PASS}


def test_empty_folder_gives_all_not_run():
    assert {v.status for v in evaluate({})} == {NOT_RUN}


def test_a_part_that_ran_without_the_figure_fails():
    parts = good_parts()
    parts["optim"] = _part("optim", {"rows": []}, rc=None, timed_out=True)
    verdict = _verdict(parts, "fused_adam_fp32_vs_torch")
    assert verdict.status == FAIL and "timed out after 480 s" in verdict.detail

    parts = good_parts()
    _records(parts, "bench-fused")[0].update(error="RuntimeError: CUDA error: an illegal memory access",
                                             step_time_ms=None)
    verdict = _verdict(parts, "o2_vs_bf16_true")
    assert verdict.status == FAIL and "illegal memory access" in verdict.detail

    parts = good_parts()
    _records(parts, "bench-fused")[0]["device_name"] = "NVIDIA H200"
    assert _verdict(parts, "o2_speedup_vs_tf32").status == FAIL  # a ratio across two devices is no figure

    parts = good_parts()
    for name in ("bench", "bench-fused"):
        for record in _records(parts, name):
            record["steps"] = 50
    verdict = _verdict(parts, "o2_loss_vs_tf32")
    assert verdict.status == FAIL and "only 50 timed steps" in verdict.detail


def test_the_bench_parts_run_the_levels_the_targets_compare():
    assert {"32-true", "bf16-mixed", "bf16-true"} <= set(gpu_check.BENCH_LEVELS.split(","))
    assert "O2" in gpu_check.FUSED_LEVELS.split(",")


def test_the_bench_fields_read_are_in_bench_json():
    read = {"level", "optimizer", "step_time_ms", "peak_mem_mb", "final_loss", "steps", "learned"}
    assert read <= set(JSON_KEYS)


def test_report_files_hold_a_verdict_line_per_target(tmp_path):
    parts = good_parts()
    parts["wgrad"]["data"]["rows"][0]["fused_ms"] = 1.5
    for name, part in parts.items():
        (tmp_path / f"part-{name}.json").write_text(json.dumps(part))
    (tmp_path / "part-broken.json").write_text("{not json")  # listed as unreadable; no target reads it
    verdicts = write_report(str(tmp_path))
    assert set(load_parts(str(tmp_path))) == set(parts) | {"broken"}
    md = (tmp_path / "gpu-check.md").read_text()
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert len(report["verdicts"]) == len(TARGETS) == len(verdicts)
    assert [v["status"] for v in report["verdicts"]].count(FAIL) == 1
    assert "**21 PASS, 1 FAIL, 0 NOT RUN**" in md
    for target in TARGETS:
        assert sum(line.startswith("| ") and f"| {target.what} |" in line for line in md.splitlines()) == 1
    assert "| FAIL | wgrad into fp32 main_grad / plain bf16 GEMM, 4096 x 1024 -> 4096 | 1.500x | <= 1.03x |" in md
    assert "| broken | unreadable (part-broken.json: JSONDecodeError" in md
    assert "FusedAdam" in md and "copy" in md  # the bench and optimizer tables are in it
    assert "| fp32 | 75.50 | 11500 | 0.3020 |  |" in md  # and the O2 forward runs


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
                             "--ops", gpu_check.OPTIM_OPS, "--repeats", "1", "--json", str(out)]) == 0
    verdicts = evaluate({"optim": _part("optim", {"rows": json.loads(out.read_text())})})
    judged = [v for v in verdicts if v.key.startswith(("fused_adam", "scale", "l2norm"))]
    assert len(judged) == 10
    assert all(v.status in (PASS, FAIL) and v.value is not None for v in judged), judged


def test_parse_junit_counts_a_real_pytest_run(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='probe')\n"
        "def test_skipped(): pass\n")
    xml = tmp_path / "probe.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_probe.py"),
                    "--junitxml", str(xml)], cwd=tmp_path, capture_output=True)
    junit = gpu_check.parse_junit(xml)
    assert (junit["tests"], junit["failures"], junit["errors"], junit["skipped"]) == (3, 1, 0, 1)
    assert junit["failed_names"] == ["test_probe::test_bad"]
    assert gpu_check.parse_junit(tmp_path / "absent.xml") is None


def test_bench_json_records_are_read_from_a_list_or_a_dict_with_metadata(tmp_path):
    records = [_record("O2", 70.0, 1.0, 0.3)]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "dict.json").write_text(json.dumps({"meta": {"commit": "abc"}, "records": records}))
    assert gpu_check.bench_json_records(tmp_path / "list.json") == records
    assert gpu_check.bench_json_records(tmp_path / "dict.json") == records
    assert gpu_check.bench_json_records(tmp_path / "absent.json") == []
    (tmp_path / "cut.json").write_text(json.dumps(records)[:40])  # its writer killed mid-file
    assert gpu_check.bench_json_records(tmp_path / "cut.json") == []


def test_a_part_past_its_timeout_is_killed_and_keeps_its_partial_rows(tmp_path, monkeypatch):
    rows = good_parts()["optim"]["data"]["rows"]

    def slow_optim(run, raw):
        (raw / "optim.json").write_text(json.dumps(rows[:3]))  # as bench_optim rewrites it after each row
        run([sys.executable, "-c", "import time; time.sleep(120)"])
        raise AssertionError("not reached")

    monkeypatch.setitem(gpu_check._COLLECT, "optim", slow_optim)
    t0 = time.monotonic()
    part = gpu_check.run_part("optim", tmp_path, tmp_path, timeout_s=2.0)
    assert time.monotonic() - t0 < 30
    assert part["timed_out"] and part["rc"] is None and len(part["data"]["rows"]) == 3
    saved = json.loads((tmp_path / "part-optim.json").read_text())
    assert saved["commands"] and saved["timed_out"]
    verdicts = {v.key: v for v in evaluate({"optim": saved})}
    assert verdicts["fused_adam_fp32_vs_torch"].status == PASS  # measured before the timeout
    assert verdicts["scale_fp32_bandwidth"].status == FAIL and "timed out" in verdicts["scale_fp32_bandwidth"].detail


def test_a_failing_command_sets_the_part_exit_status(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_check._COLLECT, "wgrad", lambda run, raw: {
        "rows": [], "out": run([sys.executable, "-c", "print('hello'); raise SystemExit(3)"])})
    part = gpu_check.run_part("wgrad", tmp_path, tmp_path, timeout_s=60)
    assert part["rc"] == 3 and not part["timed_out"] and "hello" in part["log_tail"]


@pytest.mark.parametrize("plumbing_rc", [0, 1])
def test_without_a_gpu_it_says_so_runs_its_plumbing_test_and_exits_with_its_status(tmp_path, monkeypatch, capsys,
                                                                                   plumbing_rc):
    calls = []
    monkeypatch.setattr(gpu_check, "cuda_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_plumbing_test", lambda: calls.append(1) or plumbing_rc)
    monkeypatch.setattr(gpu_check, "run_part", lambda *a, **k: pytest.fail("measured without a GPU"))
    assert gpu_check.main(["--out", str(tmp_path)]) == plumbing_rc
    assert calls == [1]
    assert "no CUDA GPU on this machine" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert {v["status"] for v in report["verdicts"]} == {NOT_RUN}
    assert "No CUDA GPU" in (tmp_path / "gpu-check.md").read_text()


def test_report_only_combines_parts_from_separate_calls(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "run_part", lambda *a, **k: pytest.fail("--report-only measured"))
    parts = good_parts()
    for name in ("optim", "bench", "bench-fused"):
        (tmp_path / f"part-{name}.json").write_text(json.dumps(parts[name]))
    assert gpu_check.main(["--report-only", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    statuses = {v["key"]: v["status"] for v in report["verdicts"]}
    assert statuses["o2_vs_bf16_true"] == PASS and statuses["suite"] == NOT_RUN
    bad = copy.deepcopy(parts["bench-fused"])
    bad["data"]["records"][0]["step_time_ms"] = 90.0
    (tmp_path / "part-bench-fused.json").write_text(json.dumps(bad))
    assert gpu_check.main(["--report-only", "--out", str(tmp_path)]) == 1  # a FAIL verdict


def test_unknown_part_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--part", "suite,bnech"])
    assert exit_info.value.code == 2
    assert "bnech" in capsys.readouterr().err
    assert gpu_check._parse_parts("wgrad,suite") == ["build", "suite", "wgrad"]


def test_the_budget_cuts_part_timeouts_and_skips_parts_it_cannot_fit(tmp_path, monkeypatch, capsys):
    clock, calls = [0.0], []

    def fake_part(name, out, raw, timeout_s):
        calls.append((name, timeout_s))
        clock[0] += 50.0
        return {"part": name, "rc": 0, "timed_out": False, "seconds": 50.0, "log_tail": ""}

    monkeypatch.setattr(gpu_check, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu_check, "run_part", fake_part)
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    assert gpu_check.main(["--out", str(tmp_path), "--part", "optim,wgrad", "--budget", "100"]) == 0
    assert calls == [("build", 100.0)]  # 50 s left after it: under a minute, so optim and wgrad are skipped
    out = capsys.readouterr().out
    assert "== part optim: skipped, 50 s of the budget left" in out and "part wgrad: skipped" in out
    calls.clear()
    assert gpu_check.main(["--out", str(tmp_path), "--part", "wgrad", "--timeout", "30"]) == 0
    assert calls == [("build", 30.0), ("wgrad", 30.0)]  # no budget: each part gets --timeout


def test_o2_forward_verdict_uses_medians_names_the_decision_and_needs_both_forwards():
    parts = good_parts()
    verdict = _verdict(parts, "o2_half_ops_vs_fp32_ops")
    assert verdict.status == PASS and verdict.value == pytest.approx(70.25 / 75.25)
    assert "keep norm_policy='half'" in verdict.detail
    for record in _records(parts, "o2-forward"):
        record["step_time_ms"] = 74.0 if record["o2_forward"] == "half" else 75.0  # the fp32 lists cost 1.4%
    verdict = _verdict(parts, "o2_half_ops_vs_fp32_ops")
    assert verdict.status == FAIL and "norm_policy='fp32' may become the default" in verdict.detail
    parts["o2-forward"]["data"]["records"] = [r for r in _records(parts, "o2-forward") if r["o2_forward"] == "half"]
    assert _verdict(parts, "o2_half_ops_vs_fp32_ops").status == FAIL  # one forward alone is no figure
    parts = good_parts()
    _records(parts, "o2-forward")[1]["device_name"] = "NVIDIA H200"
    assert _verdict(parts, "o2_half_ops_vs_fp32_ops").status == FAIL


def test_the_o2_forward_bench_switches_o2s_norm_policy(monkeypatch):
    import lightning_amp
    from lightning_amp import precision
    from lightning_amp.bench.gpu_o2_forward import use_forward

    monkeypatch.setattr(precision.AmpO2Plugin, "__init__", precision.AmpO2Plugin.__init__)  # restored after the test
    assert lightning_amp.AmpO2Plugin().properties.norm_policy == "half"  # the shipped forward
    use_forward("fp32")
    assert lightning_amp.AmpO2Plugin().properties.norm_policy == "fp32"
    assert lightning_amp.AmpO2Plugin(norm_policy="half").properties.norm_policy == "half"  # an explicit choice stays
    with pytest.raises(ValueError, match="forward must be one of"):
        use_forward("cast")
