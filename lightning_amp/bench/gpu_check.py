"""``make gpu-check``: build with the CUDA kernels, run the GPU checks part by part, report a verdict per target.

    python -m lightning_amp.bench.gpu_check [--part suite,sync,...] [--out DIR] [--timeout S]
    python -m lightning_amp.bench.gpu_check --report-only --out DIR   # re-render DIR/part-*.json

Run from a source checkout (it needs ``tests/``, ``benchmarks/`` and ``examples/``). Parts, each a
subprocess with its own timeout (default :data:`PART_TIMEOUT_S`), its output in ``DIR/part-<name>.json``:

- ``build``: always first; installs the package (``pip install --no-build-isolation --no-deps --no-index
  -e .``, as on an offline GPU machine) unless the compiled extension already loads with CUDA kernels;
- ``suite``: the whole test suite with ``LIGHTNING_AMP_REQUIRE_EXT=1`` (pytest-xdist workers where it is
  installed; ``GPU_CHECK_SUITE_WORKERS=0`` runs it serially);
- ``sync``: the CUDA sync-debug tests (``tests/precision/test_precision_sync.py -m cuda``);
- ``optim``: ``benchmarks/bench_optim.py --device cuda`` (AdamW, scale, l2norm, copy);
- ``wgrad``: ``benchmarks/bench_wgrad.py --device cuda``;
- ``bench``: ``lightning-amp bench --accelerator cuda`` on BERT-base (seq 128, batch 256, 300 steps) at
  32-true (TF32), bf16-mixed, bf16-true, O1, O2, O3 with the example's optimizer;
- ``bench-fused``: the same at O1, O2, O3 with ``--optimizer fused-adam``;
- ``o2-forward``: O2 + FusedAdam on the same BERT-base with the shipped op policy (``norm_policy="half"``)
  and torch's autocast lists (``norm_policy="fp32"``), alternating, each run a fresh process
  (:mod:`lightning_amp.bench.gpu_o2_forward`).

The report (``gpu-check.md``, ``gpu-check.json``) is written from every ``part-*.json`` in DIR, so
parts run by separate calls into one folder (or copied into one) make one report. Exit status: 1 when
a verdict is FAIL, else 0. Without a CUDA GPU nothing is measured: it says so, runs its own plumbing
test (``tests/bench/test_gpu_check.py``) on the CPU, writes a report of NOT RUN verdicts and exits with that
test's status (0 when the plumbing works).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

import torch

from lightning_amp.bench.gpu_report import part_path, verdict_lines, write_report
from lightning_amp.bench.gpu_targets import FAIL, part_status

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("build", "suite", "sync", "optim", "wgrad", "bench", "bench-fused", "o2-forward")
PART_TIMEOUT_S = 480
MIN_PART_S = 60
BENCH_LEVELS = "32-true,bf16-mixed,bf16-true,O1,O2,O3"
FUSED_LEVELS = "O1,O2,O3"
OPTIM_OPS = "adamw,scale,l2norm,copy"
_CHECK_EXT = ("import json, lightning_amp.ops as o; e = o.extension_error(); "
              "print(json.dumps({'backend': o.backend('cuda'), 'extension_error': None if e is None else str(e)}))")


class _TimedOut(Exception):
    pass


class _PartRun:
    """Runs a part's commands in ``ROOT`` against one deadline, appending their output to one log."""

    def __init__(self, log_path: Path, env: dict, timeout_s: float) -> None:
        self.log_path, self.env = log_path, env
        self.deadline = time.monotonic() + timeout_s
        self.commands: list = []
        self.rc = 0

    def __call__(self, argv: list) -> str:
        """Run ``argv``; return its output. The first non-zero exit status becomes the part's ``rc``."""
        self.commands.append(shlex.join(argv))
        with tempfile.TemporaryFile() as output:
            process = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            try:
                rc = process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the command's own process group: it and its workers
                process.wait()
                rc = None
            output.seek(0)
            text = output.read().decode(errors="replace")
        with open(self.log_path, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n{text}\n")
        if rc is None:
            raise _TimedOut()
        if rc != 0 and self.rc == 0:
            self.rc = rc
        return text


def parse_junit(path: Path) -> Optional[dict]:
    """Counts of a pytest junit XML (tests, failures, errors, skipped, time) and the failed tests' names."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["time"] = sum(float(s.get("time", 0)) for s in suites)
    counts["failed_names"] = [f"{case.get('classname')}::{case.get('name')}" for s in suites
                              for case in s.iter("testcase") if case.find("failure") is not None
                              or case.find("error") is not None]
    return counts


def _load_json(path: Path):
    """The JSON in ``path``, or None where it is absent or cut short (a tool killed while writing it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def bench_json_records(path: Path) -> list:
    """The run records of a ``bench.json``: a list of records, or a dict holding one (with run metadata)."""
    data = _load_json(path)
    if isinstance(data, dict):
        data = next((v for k in ("records", "runs", "results") if isinstance(v := data.get(k), list)), [])
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def _json_rows(path: Path) -> list:
    rows = _load_json(path)
    return rows if isinstance(rows, list) else []


def _suite_workers() -> int:
    configured = os.environ.get("GPU_CHECK_SUITE_WORKERS")
    if configured is not None:
        return int(configured)
    return min(8, (os.cpu_count() or 2) // 2) if importlib.util.find_spec("xdist") else 0


def _pytest(args: list, xml: Path) -> list:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "--junitxml", str(xml)]


def _bench(raw: Path, name: str, levels: str, *extra) -> list:
    return [sys.executable, "-m", "lightning_amp.cli", "bench", "--accelerator", "cuda", "--models", "bert",
            "--levels", levels, *extra, "--out", str(raw / name)]


def _part_build(run, raw):
    info = json.loads(run([sys.executable, "-c", _CHECK_EXT]).strip().splitlines()[-1])
    if info["backend"] != "cuda-ext":
        run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "-e", "."])
        info = json.loads(run([sys.executable, "-c", _CHECK_EXT]).strip().splitlines()[-1])
    return info


def _part_suite(run, raw):
    workers = _suite_workers()
    run(_pytest(["tests"] + (["-n", str(workers)] if workers else []), raw / "suite.xml"))
    return {"junit": parse_junit(raw / "suite.xml"), "workers": workers}


def _part_sync(run, raw):
    run(_pytest(["tests/precision/test_precision_sync.py", "-m", "cuda"], raw / "sync.xml"))
    return {"junit": parse_junit(raw / "sync.xml")}


def _part_optim(run, raw):
    run([sys.executable, "benchmarks/bench_optim.py", "--device", "cuda", "--ops", OPTIM_OPS,
         "--json", str(raw / "optim.json")])
    return {"rows": _json_rows(raw / "optim.json")}


def _part_wgrad(run, raw):
    run([sys.executable, "benchmarks/bench_wgrad.py", "--device", "cuda", "--repeat", "20",
         "--json", str(raw / "wgrad.json")])
    return {"rows": _json_rows(raw / "wgrad.json")}


def _part_bench(run, raw):
    run(_bench(raw, "bench", BENCH_LEVELS))
    return {"records": bench_json_records(raw / "bench" / "bench.json")}


def _part_bench_fused(run, raw):
    run(_bench(raw, "bench-fused", FUSED_LEVELS, "--optimizer", "fused-adam"))
    return {"records": bench_json_records(raw / "bench-fused" / "bench.json")}


def _o2_forward_records(raw):
    return {"records": _json_rows(raw / "o2-forward.json")}


def _part_o2_forward(run, raw):
    run([sys.executable, "-m", "lightning_amp.bench.gpu_o2_forward", "--json", str(raw / "o2-forward.json")])
    return _o2_forward_records(raw)


_COLLECT = {"build": _part_build, "suite": _part_suite, "sync": _part_sync, "optim": _part_optim,
            "wgrad": _part_wgrad, "bench": _part_bench, "bench-fused": _part_bench_fused,
            "o2-forward": _part_o2_forward}
#: where a timed-out part still has figures: the files its tools rewrite as they go
_PARTIAL = {"optim": lambda raw: {"rows": _json_rows(raw / "optim.json")},
            "wgrad": lambda raw: {"rows": _json_rows(raw / "wgrad.json")},
            "o2-forward": _o2_forward_records}


@functools.lru_cache(maxsize=None)
def environment() -> dict:
    """The device, versions and commit the parts run with (the device name read in a child process, so
    this process never holds a CUDA context while the parts measure)."""
    def output(argv):
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    device = output([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"]).splitlines()
    return {"device": device[-1] if device else "unknown", "torch": torch.__version__, "cuda": torch.version.cuda,
            "commit": output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]) or "unknown",
            "python": platform.python_version(), "host": platform.node()}


def child_env(require_ext: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if require_ext:
        env["LIGHTNING_AMP_REQUIRE_EXT"] = "1"
    else:
        env.pop("LIGHTNING_AMP_REQUIRE_EXT", None)
    return env


def run_part(name: str, out: Path, raw: Path, timeout_s: float) -> dict:
    """Run part ``name``, write ``out/part-<name>.json`` and return it."""
    started = datetime.datetime.now(datetime.timezone.utc)
    run = _PartRun(raw / f"{name}.log", child_env(require_ext=name != "build"), timeout_s)
    t0 = time.monotonic()
    timed_out, data = False, {}
    try:
        data = _COLLECT[name](run, raw)
    except _TimedOut:
        timed_out = True
        data = _PARTIAL[name](raw) if name in _PARTIAL else {}
    log = run.log_path.read_text(errors="replace") if run.log_path.exists() else ""
    part = {"part": name, "started": f"{started:%Y-%m-%d %H:%M:%S}", "seconds": time.monotonic() - t0,
            "timeout_s": timeout_s, "rc": None if timed_out else run.rc, "timed_out": timed_out,
            "commands": run.commands, "env": environment(), "log_tail": log[-20000:], "data": data}
    with open(part_path(str(out), name), "w") as f:
        json.dump(part, f, indent=1, default=str)
    return part


def run_plumbing_test() -> int:
    """The CPU test of the report builder and of this no-GPU path; returns pytest's exit status."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/bench/test_gpu_check.py"]
    print("gpu-check: checking its own plumbing on the CPU:", shlex.join(argv), flush=True)
    return subprocess.run(argv, cwd=ROOT, env=child_env(require_ext=False)).returncode


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _parse_parts(text: Optional[str]) -> list:
    chosen = [p.strip() for p in (text or "").split(",") if p.strip()] or list(PARTS)
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise ValueError(f"part must be among {','.join(PARTS)}, got {','.join(unknown)}")
    return ["build"] + [p for p in PARTS[1:] if p in chosen]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_amp.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--part", default=None,
                        help=f"comma-separated, from {','.join(PARTS)} (default: all; build always runs first)")
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or "gpu-check-out",
                        help="folder for part-*.json and the report (default: $GPU_CHECK_OUT or gpu-check-out)")
    parser.add_argument("--timeout", type=float, default=PART_TIMEOUT_S, help="seconds per part (default: 480)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for this whole invocation (e.g. a device call's limit less a margin): each "
                             "part's timeout is cut to what is left, and a part with under a minute left is skipped")
    parser.add_argument("--report-only", action="store_true", help="only re-render the report from OUT/part-*.json")
    args = parser.parse_args(argv)
    try:
        parts = _parse_parts(args.part)
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        verdicts = write_report(str(out))
    elif not cuda_available():
        print(f"gpu-check: no CUDA GPU on this machine (torch {torch.__version__}, CUDA build: "
              f"{torch.version.cuda or 'none'}): nothing measured, every verdict NOT RUN.", flush=True)
        rc = run_plumbing_test()
        write_report(str(out), note="No CUDA GPU on the machine that wrote this report: nothing was measured here.")
        print(f"gpu-check: plumbing test {'passed' if rc == 0 else 'FAILED'}; report in {out}/gpu-check.md")
        return rc
    else:
        if not (ROOT / "tests").is_dir() or not (ROOT / "benchmarks").is_dir():
            parser.error(f"needs a source checkout (tests/, benchmarks/, examples/) at {ROOT}")
        deadline = None if args.budget is None else time.monotonic() + args.budget
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as raw:
            for name in parts:
                left = args.timeout if deadline is None else min(args.timeout, deadline - time.monotonic())
                if deadline is not None and left < MIN_PART_S:
                    print(f"== part {name}: skipped, {max(0.0, left):.0f} s of the budget left", flush=True)
                    continue
                part = run_part(name, out, Path(raw), left)
                print(f"== part {name}: {part_status(part)} in {part['seconds']:.0f} s", flush=True)
                print("\n".join(part["log_tail"].splitlines()[-25:]), flush=True)
        verdicts = write_report(str(out))
    print(verdict_lines(verdicts))
    print(f"report: {out}/gpu-check.md, {out}/gpu-check.json")
    return 1 if any(v.status == FAIL for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
