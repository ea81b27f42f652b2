"""The suite's lanes (docs/architecture.md, Tests): ``make test`` (its two lanes ``test-fast`` and ``test-slow``) leaves
the tests marked ``post_suite`` out, ``make test-post`` runs exactly those, and CI (``.ci/run``) runs that lane right
after the suite through ``.ci/post-suite``, which skips it only when nothing it reads has changed.

The Makefile's ``-m`` expressions are evaluated by pytest's own mark-expression engine (what ``-m`` runs) on each
combination of the marks that pick a lane, so a recipe that stops leaving the post-suite tests out fails here."""
import itertools
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression  # the engine of pytest's -m

ROOT = Path(__file__).resolve().parents[1]
LANE_MARKS = ("slow", "post_suite", "cuda")
#: the tests the post-suite lane holds: (module, a test of it that is marked post_suite)
POST_SUITE = {
    "tests/test_docs.py": "test_python_block_runs_as_written",
    "tests/test_packaging.py": "test_unpacked_sdist_builds_at_first_import_and_caches",
    "tests/test_examples.py": "test_bert_example_runs_tensor_parallel_on_two_processes",
}


def _recipes() -> dict:
    """{make target: its recipe's first line} of the Makefile."""
    found, target = {}, None
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([\w-]+):", line)
        if rule:
            target = rule.group(1)
        elif line.startswith("\t") and target and target not in found:
            found[target] = line.strip()
    return found


def _selects(target: str) -> set:
    """The combinations of :data:`LANE_MARKS` whose tests ``make <target>`` runs (its ``-m`` expression)."""
    recipe = _recipes()[target]
    words = shlex.split(recipe.replace("$(PYTEST)", "pytest").replace("$(PYTEST_ARGS)", ""))
    assert words[:1] == ["pytest"] and words[-1] == "tests", recipe  # the whole tests/ folder, filtered by -m only
    expression = Expression.compile(words[words.index("-m") + 1]) if "-m" in words else None
    combinations = [frozenset(c) for n in range(len(LANE_MARKS) + 1) for c in itertools.combinations(LANE_MARKS, n)]
    return {marks for marks in combinations
            if expression is None or expression.evaluate(lambda name, /, **kwargs: name in marks)}


def test_make_test_leaves_the_post_suite_lane_out_and_its_two_lanes_split_it():
    suite, fast, slow, post = (_selects(t) for t in ("test", "test-fast", "test-slow", "test-post"))
    assert suite and not [marks for marks in suite if "post_suite" in marks], suite
    assert post and all("post_suite" in marks for marks in post), post
    assert len(suite | post) == 2 ** len(LANE_MARKS), (suite, post)  # together: every test
    assert fast | slow == suite and not fast & slow, (fast, slow)
    assert all("slow" not in marks for marks in fast) and all("slow" in marks for marks in slow)


def test_the_post_suite_lane_holds_the_users_runs():
    for module, name in POST_SUITE.items():
        text = (ROOT / module).read_text()
        marked = re.search(rf"@pytest\.mark\.post_suite\n(?:@[^\n]+\n)*def {name}\(", text)
        assert marked, f"{module}::{name} is not marked post_suite"
    declared = re.search(r"^markers = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S).group(1)
    assert re.search(r'"post_suite: ', declared), "the post_suite marker is not declared in pyproject.toml"


def test_ci_runs_the_post_suite_lane_after_the_suite():
    steps = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert "bash .ci/post-suite" in steps, steps
    assert steps.index("make test-slow") < steps.index("bash .ci/post-suite"), steps
    script = (ROOT / ".ci/post-suite").read_text()
    assert re.search(r"^make test-post\b", script, re.M), "the post-suite script does not run make test-post"


# ---- .ci/post-suite's cache, run on a copy of the tree with a stand-in make and Python -----------------------

FAKE_MAKE = """#!/bin/sh
echo "$@" >> "$MAKE_CALLS"
echo "== 3 passed in 1.00s =="
exit "${FAKE_MAKE_RC:-0}"
"""
FAKE_PYTHON = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "Python 3.11.7"; else echo "torch==${FAKE_TORCH:-2.13.0}"; fi
"""


@pytest.fixture
def tree(tmp_path):
    """A git copy of this tree's files that .ci/post-suite hashes, with a stand-in ``.venv/bin/python``."""
    copy = tmp_path / "tree"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        # .ci/torch-lane-tests runs the suite in a copy of the tree's files without .git; make test (the checkout) runs it
        pytest.skip(f"needs the git work tree the post-suite key lists ({ROOT} is not one)")
    files = listed.stdout.split("\n")
    for name in filter(None, files):
        source, target = ROOT / name, copy / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
            target.chmod(source.stat().st_mode)
    for path, text in ((copy / ".venv/bin/python", FAKE_PYTHON), (tmp_path / "bin/make", FAKE_MAKE)):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (copy / ".gitignore").write_text((copy / ".gitignore").read_text() + "\n.venv/\n")
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    subprocess.run(["git", "add", "-A"], cwd=copy, check=True)
    return copy


def _post_suite(tree: Path, **env) -> tuple:
    """Run the copy's .ci/post-suite; (exit status, the make calls it made)."""
    calls = tree.parent / "make-calls"
    calls.write_text("")
    keep = {k: v for k, v in os.environ.items() if not re.match(r"(LIGHTNING_AMP_|ATEN_|CI$|PYTEST_ARGS$)", k)}
    done = subprocess.run(["bash", ".ci/post-suite"], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={**keep, "PATH": f"{tree.parent / 'bin'}:{os.environ['PATH']}", "MAKE_CALLS": str(calls),
                               "LIGHTNING_AMP_CI_CACHE": str(tree.parent / "cache"), **env})
    return done.returncode, calls.read_text().split("\n")[:-1]


@pytest.mark.slow
def test_the_post_suite_cache_runs_the_lane_again_whenever_an_input_changes(tree):
    assert _post_suite(tree) == (0, ["test-post"])
    assert _post_suite(tree) == (0, [])  # unchanged: skipped
    for change in ("tests/test_docs.py", "tests/support/processes.py", "lightning_amp/amp/runtime.py",
                   "csrc/bindings.cpp", "docs/opt-levels.md", "examples/bert_sentiment.py", "Makefile"):
        with open(tree / change, "a") as file:
            file.write("\n")
        assert _post_suite(tree) == (0, ["test-post"]), change
        assert _post_suite(tree) == (0, []), change
    (tree / "docs" / "new-page.md").write_text("```python\nprint(1)\n```\n")  # a new file, untracked
    assert _post_suite(tree) == (0, ["test-post"])
    assert _post_suite(tree, FAKE_TORCH="2.13.1") == (0, ["test-post"])  # another package in .venv
    assert _post_suite(tree, ATEN_CPU_CAPABILITY="avx2") == (0, ["test-post"])  # another ISA cap
    assert _post_suite(tree, FAKE_TORCH="2.13.1") == (0, [])
    (tree / "README.md").write_text("changed")
    assert _post_suite(tree, FAKE_MAKE_RC="2") == (2, ["test-post"])  # a failed run leaves no stamp
    assert _post_suite(tree) == (0, ["test-post"])
