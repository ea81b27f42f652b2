"""``make gpu-check``: one command that builds for the GPU present, checks it, measures it, and reports a verdict per target.

    python -m gpu_check [--part smoke,bench,...] [--out DIR] [--budget SECONDS]
    python -m gpu_check --report-only --out DIR   # re-render DIR/part-*.json

Run in a source checkout's root (it needs ``tests/``, ``benchmarks/`` and ``examples/``); each part's
commands run there with the root on ``PYTHONPATH`` (:func:`child_env`), so that ``gpu_check`` imports in
them. The parts run in this order (:data:`PLAN`), each a subprocess with a timeout, its log in
``DIR/logs/<part>.log``:

1. ``build``: always first: ``setup.py build_ext --inplace`` for the present GPU's compute capability only
   (``TORCH_CUDA_ARCH_LIST``) with ``MAX_JOBS`` = the machine's cores, in parallel with or without ninja
   (:mod:`gpu_check.build`), timed;
2. ``smoke``: CUDA correctness (:mod:`gpu_check.smoke`, about a minute);
3. ``bench``: the headline BERT-base benchmark with its ratios (:mod:`gpu_check.headline`);
4. ``optim``, 5. ``wgrad``: ``benchmarks/bench_optim.py`` and ``benchmarks/bench_wgrad.py`` on the GPU;
6. ``cuda-tests``: ``pytest -m cuda tests``; 7. ``suite``: ``pytest -m "not cuda" tests`` with what time is
   left (pytest-xdist workers where installed), the tests it did not reach counted
   (:mod:`gpu_check.pytest_log`).

Budget: ``--budget`` (``make``'s ``GPU_CHECK_BUDGET``) caps the whole invocation. Each part's timeout is
its cap (:attr:`Part.cap_s`) or what is left of the budget, whichever is less; a part with less left than
it needs (:attr:`Part.need_s`) is NOT RUN with that reason, as is every part after a failed build. The
report (``gpu-check.md``, ``gpu-check.json``) is rewritten when each part starts and ends, so a run
killed at its limit leaves every part finished before; SIGTERM ends the running part (recorded as
interrupted, with its log tail) and marks the rest NOT RUN. A part that crashes or times out is
reported with its log tail, and its targets FAIL. Exit status: 1 when a verdict is FAIL, else 0.
Without a CUDA GPU nothing is measured: it says so, runs its own plumbing test
(``tests/bench/test_gpu_check.py``) on the CPU, writes a report of NOT RUN verdicts and exits with that
test's status (0 when the plumbing works).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from gpu_check import build
from gpu_check.pytest_log import LOG_ENV, read_outcomes
from gpu_check.report import log_path, part_path, verdict_lines, write_report
from gpu_check.targets import FAIL, part_status

ROOT = Path(__file__).resolve().parents[1]
OPTIM_OPS = "adamw,lamb,adadelta,scale,finite,l2norm,copy"
#: seconds a single test may take in the test parts (where pytest-timeout is installed)
TEST_TIMEOUT_S = 180
_CHECK_EXT = ("import json, lightning_amp.ops as o; e = o.extension_error(); "
              "print(json.dumps({'backend': o.backend('cuda'), 'extension_error': None if e is None else str(e)}))")
_PROBE = ("import json, torch; print(json.dumps({'device': torch.cuda.get_device_name(), "
          "'capability': '%d.%d' % torch.cuda.get_device_capability(), 'count': torch.cuda.device_count()}))")


class _TimedOut(Exception):
    pass


class _Interrupted(BaseException):
    """SIGTERM (a remote call's limit): end the running part, report, and stop."""


class _PartRun:
    """Runs a part's commands in ``ROOT`` against one deadline, appending their output to one log."""

    def __init__(self, log: Path, env: dict, timeout_s: float) -> None:
        self.log, self.env = log, env
        self.deadline = time.monotonic() + timeout_s
        self.commands: list = []
        self.rc = 0

    def __call__(self, argv: list, env: Optional[dict] = None) -> str:
        """Run ``argv`` (``env`` added to the part's environment); return its output. The first non-zero
        exit status becomes the part's ``rc``; past the deadline the command's process group is killed."""
        shown = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self.commands.append((shown + " " if shown else "") + shlex.join(argv))
        start = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "a") as log:
            log.write(f"$ {self.commands[-1]}\n")
            log.flush()
            process = subprocess.Popen(argv, cwd=ROOT, env=dict(self.env, **(env or {})), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            try:
                left = self.deadline - time.monotonic()
                rc = process.wait(timeout=None if math.isinf(left) else max(1.0, left))
            except BaseException as stop:  # the deadline, or SIGTERM while waiting
                os.killpg(process.pid, signal.SIGKILL)  # the command's own process group: it and its workers
                process.wait()
                log.write(f"\n[gpu-check: killed, {'timeout' if isinstance(stop, subprocess.TimeoutExpired) else 'interrupted'}]\n")
                raise _TimedOut() if isinstance(stop, subprocess.TimeoutExpired) else stop
        if rc != 0 and self.rc == 0:
            self.rc = rc
        with open(self.log, errors="replace") as log:
            log.seek(start)
            return log.read()


def _load_json(path: Path):
    """The JSON in ``path``, or None where it is absent or cut short (a tool killed while writing it)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _json_rows(path: Path) -> list:
    rows = _load_json(path)
    return rows if isinstance(rows, list) else []


def _json_dict(path: Path) -> dict:
    data = _load_json(path)
    return data if isinstance(data, dict) else {}


def _test_workers() -> int:
    configured = os.environ.get("GPU_CHECK_SUITE_WORKERS")
    if configured is not None:
        return int(configured)
    return min(8, (os.cpu_count() or 2) // 2) if importlib.util.find_spec("xdist") else 0


def device_probe() -> dict:
    """The GPU's name, compute capability ("9.0") and count, read in a child process so that this one
    never holds a CUDA context while the parts measure; {} where it cannot be read."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return {}


# -- the parts --------------------------------------------------------------------------------------
# Each takes (run, raw): ``run`` a _PartRun, ``raw`` the folder for its files; returns the part's data.


def _part_build(run, raw):
    arch = environment().get("capability")
    env = {"MAX_JOBS": str(os.cpu_count() or 1)}
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    t0 = time.monotonic()
    run([sys.executable, "-m", "gpu_check.build"], env=env)  # gpu_check's module: lightning_amp not imported
    seconds = time.monotonic() - t0
    info = json.loads(run([sys.executable, "-c", _CHECK_EXT]).strip().splitlines()[-1])
    return dict(info, build_seconds=seconds, arch=arch, max_jobs=int(env["MAX_JOBS"]),
                ninja=build.ninja_available())


def _part_smoke(run, raw):
    run([sys.executable, "-m", "gpu_check.smoke", "--json", str(raw / "smoke.json")])
    return _json_dict(raw / "smoke.json")


def _part_bench(run, raw):
    run([sys.executable, "-m", "gpu_check.headline", "--json", str(raw / "bench.json")])
    return _json_dict(raw / "bench.json")


def _part_optim(run, raw):
    run([sys.executable, "benchmarks/bench_optim.py", "--device", "cuda", "--lists", "few-large", "--ops", OPTIM_OPS,
         "--json", str(raw / "optim.json")])
    return {"rows": _json_rows(raw / "optim.json")}


def _part_wgrad(run, raw):
    run([sys.executable, "benchmarks/bench_wgrad.py", "--device", "cuda", "--repeat", "20",
         "--json", str(raw / "wgrad.json")])
    return {"rows": _json_rows(raw / "wgrad.json")}


def _pytest_collect(name: str, marker: str):
    def collect(run, raw):
        log, workers = raw / f"{name}.jsonl", _test_workers()
        if log.exists():
            log.unlink()
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check.pytest_log",
                "-m", marker, "tests"] + (["-n", str(workers)] if workers else [])
        if importlib.util.find_spec("pytest_timeout"):
            argv.append(f"--timeout={TEST_TIMEOUT_S}")
        run(argv, env={LOG_ENV: str(log)})
        return {"tests": read_outcomes(log), "workers": workers}
    return collect


@dataclass(frozen=True)
class Part:
    """A part of the check: ``collect(run, raw) -> data``; started only with ``need_s`` seconds of the
    budget left, stopped after ``cap_s`` (None: no cap of its own). ``partial(raw)`` reads what a part
    stopped at its timeout had already written (None: nothing)."""

    name: str
    collect: Callable
    need_s: float
    cap_s: Optional[float]
    partial: Optional[Callable] = None


def _test_part(name: str, marker: str, need_s: float, cap_s: Optional[float]) -> Part:
    """A part running ``pytest -m marker tests``; stopped at its timeout, it keeps the outcomes reached."""
    return Part(name, _pytest_collect(name, marker), need_s, cap_s,
                partial=lambda raw: {"tests": read_outcomes(raw / f"{name}.jsonl"), "workers": _test_workers()})


PLAN = (
    Part("build", _part_build, need_s=30, cap_s=360),
    Part("smoke", _part_smoke, need_s=45, cap_s=150, partial=lambda raw: _json_dict(raw / "smoke.json")),
    Part("bench", _part_bench, need_s=90, cap_s=240, partial=lambda raw: _json_dict(raw / "bench.json")),
    Part("optim", _part_optim, need_s=20, cap_s=150, partial=lambda raw: {"rows": _json_rows(raw / "optim.json")}),
    Part("wgrad", _part_wgrad, need_s=15, cap_s=60, partial=lambda raw: {"rows": _json_rows(raw / "wgrad.json")}),
    _test_part("cuda-tests", "cuda", need_s=30, cap_s=180),
    _test_part("suite", "not cuda", need_s=30, cap_s=None),
)
PARTS = tuple(p.name for p in PLAN)


@functools.lru_cache(maxsize=None)
def environment() -> dict:
    """The device, versions and commit the parts run with."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    probe = device_probe()
    return {"device": probe.get("device", "unknown"), "capability": probe.get("capability"), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": commit or "unknown", "python": platform.python_version(),
            "host": platform.node(), "cores": os.cpu_count()}


def child_env(require_ext: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if require_ext:
        env["LIGHTNING_AMP_REQUIRE_EXT"] = "1"
    else:
        env.pop("LIGHTNING_AMP_REQUIRE_EXT", None)
    return env


def _now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S}"


def _save(out: Path, part: dict) -> dict:
    with open(part_path(str(out), part["part"]), "w") as f:
        json.dump(part, f, indent=1, default=str)
    return part


def run_part(part: Part, out: Path, raw: Path, timeout_s: float) -> dict:
    """Run ``part``, write ``out/part-<name>.json`` and return it; its log goes to ``out/logs/<name>.log``
    as it runs. Re-raises :class:`_Interrupted` after recording the part as interrupted."""
    started = _now()
    log = log_path(str(out), part.name)
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    Path(log).write_text("")
    run = _PartRun(Path(log), child_env(require_ext=part.name != "build"), timeout_s)
    t0 = time.monotonic()
    stopped, data = None, {}
    try:
        data = part.collect(run, raw)
    except _TimedOut:
        stopped = "timed_out"
    except _Interrupted:
        stopped = "interrupted"
    except Exception as error:  # noqa: BLE001 - e.g. a command's output that cannot be read: the part failed
        with open(log, "a") as f:
            f.write(f"\n[gpu-check: reading the part's output failed: {type(error).__name__}: {error}]\n")
        run.rc = run.rc or 1
        data = part.partial(raw) if part.partial else {}
    if stopped:
        data = part.partial(raw) if part.partial else {}
    text = Path(log).read_text(errors="replace")
    record = _save(out, {"part": part.name, "started": started, "seconds": time.monotonic() - t0,
                         "timeout_s": timeout_s, "rc": None if stopped else run.rc,
                         "timed_out": stopped == "timed_out", "interrupted": stopped == "interrupted",
                         "commands": run.commands, "env": environment(), "log_tail": text[-20000:], "data": data})
    if stopped == "interrupted":
        raise _Interrupted()
    return record


def not_run(out: Path, name: str, reason: str) -> dict:
    """Record part ``name`` as NOT RUN with ``reason``."""
    return _save(out, {"part": name, "not_run": reason, "env": environment()})


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
        raise ValueError(f"PART must be a comma-separated list from {','.join(PARTS)}; unknown: {','.join(unknown)}")
    return ["build"] + [p for p in PARTS[1:] if p in chosen]


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def run_parts(names: list, out: Path, raw: Path, budget: Optional[float], note: str) -> None:
    """Run the parts ``names`` in :data:`PLAN`'s order within ``budget`` seconds (None: each to its cap),
    rewriting the report when each starts and ends."""
    start = time.monotonic()
    plan = {p.name: p for p in PLAN}
    blocked = None
    for name in names:
        part = plan[name]
        left = None if budget is None else budget - (time.monotonic() - start)
        timeout = min([x for x in (part.cap_s, left) if x is not None], default=math.inf)
        if blocked:
            record = not_run(out, name, blocked)
        elif left is not None and left < part.need_s:
            record = not_run(out, name, f"needs at least {part.need_s:.0f} s, {max(0.0, left):.0f} s of the "
                                        f"{budget:.0f} s budget left")
        else:
            _save(out, {"part": name, "running": True, "started": _now(), "timeout_s": timeout, "env": environment()})
            write_report(str(out), note=note, running=name)  # what a kill during this part leaves
            try:
                record = run_part(part, out, raw, timeout)
            except _Interrupted:
                blocked = "the check was interrupted (SIGTERM) before this part"
                print(f"== part {name}: interrupted", flush=True)
                write_report(str(out), note=note)
                continue
            if name == "build" and (record.get("data") or {}).get("backend") != "cuda-ext":
                blocked = f"the build part did not give the CUDA extension ({part_status(record)})"
        print(f"== part {name}: {part_status(record)}" + (f" in {record['seconds']:.0f} s" if "seconds" in record
                                                          else ""), flush=True)
        if record.get("log_tail"):
            print("\n".join(record["log_tail"].splitlines()[-15:]), flush=True)
        write_report(str(out), note=note)


def _raise_interrupted(signum, frame):
    raise _Interrupted()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--part", default=None,
                        help=f"comma-separated, from {','.join(PARTS)} (default: all; build always runs first)")
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or "gpu-check-out",
                        help="folder for part-*.json, logs/ and the report (default: $GPU_CHECK_OUT or gpu-check-out)")
    parser.add_argument("--budget", type=positive_seconds, default=None,
                        help="seconds for this whole invocation, build included (default: no budget, each part to "
                             "its own cap); a part that cannot fit is reported NOT RUN")
    parser.add_argument("--report-only", action="store_true", help="only re-render the report from OUT/part-*.json")
    args = parser.parse_args(argv)
    try:
        parts = _parse_parts(args.part)
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out).resolve()  # the parts' commands run in ROOT
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
        if not all((ROOT / d).is_dir() for d in ("tests", "benchmarks", "examples")):
            parser.error(f"needs a source checkout (tests/, benchmarks/, examples/) at {ROOT}")
        for stale in out.glob("part-*.json"):
            stale.unlink()  # one invocation, one report
        raw = out / "raw"
        raw.mkdir(exist_ok=True)
        for name in PARTS:
            if name not in parts:
                not_run(out, name, f"not asked for (PART={args.part})")
        note = (f"`make gpu-check`, parts {','.join(parts)}, budget "
                f"{'none' if args.budget is None else f'{args.budget:.0f} s'}; started {_now()} UTC.")
        previous = signal.signal(signal.SIGTERM, _raise_interrupted)
        try:
            run_parts(parts, out, raw, args.budget, note)
        except _Interrupted:  # between two parts: the report below still says what finished
            print("gpu-check: interrupted (SIGTERM)", flush=True)
        finally:
            signal.signal(signal.SIGTERM, previous)
        verdicts = write_report(str(out), note=note)
    print(verdict_lines(verdicts))
    print(f"report: {out}/gpu-check.md, {out}/gpu-check.json")
    return 1 if any(v.status == FAIL for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
