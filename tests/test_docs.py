"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process.

A block runs with a temporary folder as its working directory and the repository importable, under a
time limit (its process group is killed past it: a block that starts a second rank with gloo, as the
2-process blocks of docs/scaling-out.md do, takes that rank down with it). A block that fails or
times out fails its test; it is never reported as skipped. The only skip is a block whose first line
is ``# needs: <need> [and <need>] [(comment)]`` naming a need of :data:`NEEDS` that this machine lacks
(a CUDA GPU, apex, litgpt: the last required under ``CI=true``, see tests/support/optional_deps.py); an unknown need fails. Which blocks there are is counted per page against the pages
on disk. Bash blocks are checked for shell syntax (``bash -n``): a usage line such as
``[--size tiny|small|base]`` pasted into a command is a pipe to bash.

A block that checks its result (an ``assert``) runs once per global seed of :data:`GLOBAL_SEEDS`, in one process
(``random``, ``numpy`` and torch seeded before the block runs, the block's own seeding after): what it asserts
must hold whatever was drawn before it, so a reader's run cannot fail where ours passed (the ladder's example
failed 2 runs in 5 before it seeded its own data).
"""
from __future__ import annotations

import collections
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support.optional_deps import available, require

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
NEEDS_LINE = re.compile(r"#\s*needs:\s*(.+)")
#: what a ``# needs:`` line may name, and whether this machine has it
NEEDS = {
    "a CUDA GPU": torch.cuda.is_available,
    "apex": lambda: importlib.util.find_spec("apex") is not None,
    "litgpt": lambda: available("litgpt"),  # a dev dependency: under CI=true a block needing it runs (and fails without it)
}
TIME_LIMIT_S = 120
#: the global seeds a block that asserts runs under, one after another in its process
GLOBAL_SEEDS = (0, 4, 12345)  # torch.randn(()) draws 1.54, -1.61, ... under the first two
#: runs a block (argv[1]) once per seed of argv[2:], seeding Python's, numpy's and torch's generators first
SEEDED_RUNS = """import random, sys
import numpy, torch
code = compile(open(sys.argv[1]).read(), sys.argv[1], "exec")
for seed in map(int, sys.argv[2:]):
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    exec(code, {"__name__": "__main__", "__file__": sys.argv[1]})
    print(f"--- the block held under the global seed {seed}", flush=True)
"""


def blocks(language: str) -> list:
    """(id, code) of every fenced block in ``language``; the id is page:line."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start()) + 1
                found.append(pytest.param(match.group(2), id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def needs(code: str) -> list:
    """The needs named by a ``# needs: ...`` first line (a trailing parenthesis is a comment), or []."""
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    match = NEEDS_LINE.fullmatch(first.strip())
    if not match:
        return []
    return [need.strip() for need in re.sub(r"\s*\(.*\)\s*$", "", match.group(1)).split(" and ")]


def unmet_needs(code: str) -> list:
    """The needs of ``code`` this machine lacks; a need outside :data:`NEEDS` fails the test."""
    unknown = [need for need in needs(code) if need not in NEEDS]
    if unknown:
        pytest.fail(f"unknown need {unknown} in a '# needs:' line; known: {sorted(NEEDS)}")
    return [need for need in needs(code) if not NEEDS[need]()]


def run_block(code: str, cwd: Path, timeout_s: float = TIME_LIMIT_S, global_seeds: tuple = ()) -> None:
    """Run ``code`` as a script in ``cwd`` (once per global seed of ``global_seeds``, in one process, when given);
    ``pytest.fail`` with its output unless it exits 0 in time."""
    script = cwd / "block.py"
    script.write_text(code)
    command = [sys.executable, str(script)]
    if global_seeds:
        (cwd / "seeded_runs.py").write_text(SEEDED_RUNS)
        command = [sys.executable, str(cwd / "seeded_runs.py"), str(script), *map(str, global_seeds)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    if "a CUDA GPU" not in needs(code):
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(cwd / "block.log", "w+") as log:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the block and the ranks it started
            process.wait()
            rc = None
        log.seek(0)
        output = log.read()
    if rc != 0:
        why = f"timed out after {timeout_s} s" if rc is None else f"exit status {rc}"
        pytest.fail(f"block {why}:\n{code}\n--- output ---\n{output[-3000:]}", pytrace=False)


def test_every_page_on_disk_is_read_with_each_of_its_blocks():
    on_disk = ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(ROOT / "docs") if name.endswith(".md"))
    assert [str(page.relative_to(ROOT)) for page in PAGES] == on_disk
    for language in ("python", "bash"):
        collected = collections.Counter(param.id.rpartition(":")[0] for param in blocks(language))
        fenced = collections.Counter({page: sum(line.rstrip() == f"```{language}"
                                                for line in (ROOT / page).read_text().splitlines())
                                      for page in on_disk})
        assert collected == +fenced, language  # +: pages without such a block dropped
        assert sum(collected.values()) > 0, language


@pytest.mark.slow
@pytest.mark.post_suite
@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs_as_written(code, tmp_path):
    unmet = unmet_needs(code)
    if unmet:
        pytest.skip(f"needs: {' and '.join(unmet)}")
    run_block(code, tmp_path, global_seeds=GLOBAL_SEEDS if re.search(r"^\s*assert\b", code, re.M) else ())


def _outcome(call) -> BaseException:
    """What ``call()`` raised (pytest's skip and fail included), or an AssertionError when it returned."""
    try:
        call()
    except BaseException as outcome:  # noqa: BLE001 - a Skipped must be seen here, not skip this test
        return outcome
    raise AssertionError("it returned")


def test_a_block_that_fails_or_hangs_fails_and_is_never_skipped(tmp_path):
    for code, timeout_s, why in (("raise SystemExit(3)", 60, "exit status 3"),
                                 ("import sys; sys.stdout.write('boom'); import os; os._exit(1)", 60, "exit status 1"),
                                 ("import time\ntime.sleep(600)", 2, "timed out after 2 s")):
        outcome = _outcome(lambda: run_block(code, tmp_path, timeout_s))
        assert isinstance(outcome, pytest.fail.Exception), (code, type(outcome))
        assert why in str(outcome), str(outcome)
    run_block("print('ok')", tmp_path)  # and a block that works passes


@pytest.mark.slow
@pytest.mark.post_suite
def test_a_block_that_asserts_on_unseeded_draws_fails_under_some_global_seed(tmp_path):
    """The seeded runs catch a block whose check depends on what the global generators drew (here: a
    positive draw, about one seed in two); the same block seeding itself passes under every seed."""
    unseeded = "import torch\nassert torch.randn(()).item() > 0\n"
    outcome = _outcome(lambda: run_block(unseeded, tmp_path, global_seeds=GLOBAL_SEEDS))
    assert isinstance(outcome, pytest.fail.Exception) and "AssertionError" in str(outcome)
    seeded = "import torch\ntorch.manual_seed(3)\nassert torch.randn(()).item() > 0\n"
    run_block(seeded, tmp_path, global_seeds=GLOBAL_SEEDS)


@pytest.mark.slow
@pytest.mark.post_suite
def test_a_block_that_starts_ranks_is_killed_with_them_past_its_time(tmp_path):
    code = ("import subprocess, sys, time\n"
            "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "open('rank.pid', 'w').write(str(rank.pid))\n"
            "time.sleep(600)\n")
    outcome = _outcome(lambda: run_block(code, tmp_path, timeout_s=8))
    assert isinstance(outcome, pytest.fail.Exception) and "timed out" in str(outcome)
    pid = int((tmp_path / "rank.pid").read_text())
    deadline = time.monotonic() + 5  # the killed rank is reaped by init shortly after
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"the second process {pid} outlived its block"


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_needs_lines_name_known_needs_and_skip_only_where_one_is_missing():
    assert needs("# needs: a CUDA GPU\nimport torch\n") == ["a CUDA GPU"]
    assert needs("\n#needs: apex and a CUDA GPU (apex's amp left apex in 2025)\n") == ["apex", "a CUDA GPU"]
    assert needs("import torch  # needs: nothing\n") == [] and needs("# a comment\n# needs: apex\n") == []
    assert unmet_needs("# needs: a CUDA GPU\n") == ([] if torch.cuda.is_available() else ["a CUDA GPU"])
    assert unmet_needs("print(1)\n") == []
    outcome = _outcome(lambda: unmet_needs("# needs: 2 processes\n"))
    assert isinstance(outcome, pytest.fail.Exception) and "unknown need ['2 processes']" in str(outcome)
    for param in blocks("python"):  # every marker in the pages is one the test knows
        assert set(needs(param.values[0])) <= set(NEEDS), param.id


def test_an_optional_dependency_skips_where_absent_and_fails_in_ci(monkeypatch):
    """tests/support/optional_deps.py: without CI a missing package skips; under CI=true it fails (a broken install cannot
    silently skip), and a docs block needing it runs."""
    monkeypatch.delenv("CI", raising=False)
    assert isinstance(_outcome(lambda: require("no_such_package_i35")), pytest.skip.Exception)
    assert not available("no_such_package_i35") and available("torch")
    monkeypatch.setenv("CI", "true")
    outcome = _outcome(lambda: require("no_such_package_i35"))
    assert isinstance(outcome, pytest.fail.Exception) and "CI=true" in str(outcome)
    assert available("no_such_package_i35") and unmet_needs("# needs: litgpt\n") == []
    assert require("torch") is torch


@pytest.mark.parametrize("code", blocks("bash"))
def test_bash_block_is_valid_shell(code):
    result = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for line in code.splitlines():
        command = line.split("#")[0]
        assert not re.search(r"\[--[\w-]+ [^\]]*\|", command), f"a usage pattern pasted as a command: {line}"


def test_publish_bench_replaces_the_table_between_the_markers(tmp_path):
    spec = importlib.util.spec_from_file_location("publish_bench", ROOT / "benchmarks" / "publish_bench.py")
    publish = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(publish)
    for page in publish.PAGES:  # the pages `make bench-docs` rewrites hold exactly one table slot
        publish.replace_between_markers(page.read_text(), "x", page.name)
    text = f"before\n{publish.START}\nold table\n{publish.END}\nafter\n"
    assert publish.replace_between_markers(text, "| new |\n", "page") == \
        f"before\n{publish.START}\n| new |\n{publish.END}\nafter\n"
    with pytest.raises(ValueError, match="expected one"):
        publish.replace_between_markers("no markers", "x", "page")
