"""A pytest plugin that records each test's outcome the moment it is known, for ``make gpu-check``'s test parts.

    GPU_CHECK_PYTEST_LOG=FILE python -m pytest -p gpu_check.pytest_log [-n 8] tests

FILE gets one JSON line per event, flushed at once, so a run killed at its time limit still tells what
it reached: ``{"collected": [ids]}`` once the tests are collected (after ``-m``/``-k`` deselection; under
pytest-xdist the first worker's list, as every worker collects the same), then per test report
``{"id", "when", "outcome"}`` (the call's report, and a setup or teardown report that did not pass; a failure
adds ``"reason"``, its one-line cause: the exception's message, or xdist's "worker 'gw3' crashed while running
..." for a test that killed its process).
Under pytest-xdist only the controlling process writes. :func:`read_outcomes` turns FILE into counts:
collected, passed, failed, skipped and not reached (collected but without a final outcome).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import pytest

from gpu_check.targets import count_outcomes

LOG_ENV = "GPU_CHECK_PYTEST_LOG"
OUTCOMES = ("passed", "failed", "skipped")


_CONFIG: list = []  # this process's pytest config, kept by pytest_configure


def pytest_configure(config) -> None:
    _CONFIG[:] = [config]


def _write(entry: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if not path or not _CONFIG or hasattr(_CONFIG[0], "workerinput"):  # an xdist worker: the controller writes
        return
    with open(path, "a") as log:
        log.write(json.dumps(entry) + "\n")
        log.flush()


def pytest_collection_finish(session) -> None:
    if not getattr(session.config.option, "numprocesses", None):  # without xdist this process collected
        _write({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    config = node.config
    if not getattr(config, "_gpu_check_collected", False):
        config._gpu_check_collected = True
        _write({"collected": list(ids)})


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":
        entry = {"id": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.failed:
            entry["reason"] = failure_reason(report)
        _write(entry)


def failure_reason(report) -> str:
    """One line (at most 300 characters) saying why ``report`` failed."""
    message = getattr(getattr(report.longrepr, "reprcrash", None), "message", "") or ""
    if message.strip():  # an exception: the first line of its message
        return message.strip().splitlines()[0][:300]
    lines = [line for line in str(report.longrepr or "").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""  # a text report (xdist's crashed worker): its last line


def read_outcomes(path: Path) -> Optional[dict]:
    """Counts of a FILE written by this plugin, or None where it is absent or holds no collection.

    ``{"collected", "passed", "failed", "skipped", "not_reached", "failed_names", "outcomes", "reasons"}``:
    ``outcomes`` maps each collected test id to its final outcome ("failed" if any of its reports
    failed, else "skipped" if one skipped, else "passed"; "not reached" when none came); ``reasons`` maps
    each failed test id to the cause its first failing report gave."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    collected, reports, reasons = None, {}, {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by the kill
        if "collected" in entry and collected is None:
            collected = entry["collected"]
        elif entry.get("outcome") in OUTCOMES:
            reports.setdefault(entry["id"], set()).add(entry["outcome"])
            if entry["outcome"] == "failed":
                reasons.setdefault(entry["id"], entry.get("reason", ""))
    if collected is None:
        return None
    outcomes = {}
    for test in collected + [t for t in reports if t not in set(collected)]:
        seen = reports.get(test, set())
        outcomes[test] = next((o for o in ("failed", "skipped", "passed") if o in seen), "not reached")
    counts = count_outcomes(outcomes)
    not_reached = counts.pop("not reached")
    return dict(counts, collected=len(collected), not_reached=not_reached,
                failed_names=[t for t, v in outcomes.items() if v == "failed"], outcomes=outcomes, reasons=reasons)
