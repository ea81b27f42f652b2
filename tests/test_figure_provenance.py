"""Every published figure says where it came from.

benchmarks/RESULTS.md: each section (``##``/``###`` heading and its text) that gives a figure names a
commit, or its heading says its figures are **not reproducible here**; every commit the pages name
exists in this repository. README.md and
docs/benchmarks.md: the published CPU table's first line names its date, commit, CPU and bf16
instructions, and the prose around it never describes that CPU itself (it did, and went stale: it
credited a table taken without AVX512_BF16 to an AVX512_BF16 CPU).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|GFLOP/s|TFLOP/s|GB/s|MiB|MB|x)\b")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
UNSOURCED = "not reproducible here"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
TABLE_PAGES = ("README.md", "docs/benchmarks.md")


def sections(text: str) -> list:
    """(heading, body) of every ``##``/``###`` section; the text before the first one is left out."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def _in_repository(commit: str) -> bool:
    result = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=ROOT, capture_output=True)
    return result.returncode == 0


def _git_history() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode == 0


def test_every_results_section_with_a_figure_names_a_commit_or_says_it_cannot_be_reproduced():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    checked = 0
    for heading, body in sections(text):
        block = heading + body
        if not FIGURE.search(block):
            continue
        checked += 1
        assert COMMIT.search(block) or UNSOURCED in heading, f"{heading!r}: figures without a commit"
    assert checked >= 5


@pytest.mark.skipif(not _git_history(), reason="no git history in this copy of the tree")
def test_the_commits_the_pages_name_exist():
    pages = [ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {commit for page in pages for commit in COMMIT.findall(page.read_text())}
    assert len(named) >= 10
    assert sorted(c for c in named if not _in_repository(c)) == []


def _outside_table(text: str) -> str:
    before, _, rest = text.partition(START)
    return before + rest.partition(END)[2]


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_the_published_table_names_its_run_and_the_prose_leaves_its_cpu_to_it(page):
    text = (ROOT / page).read_text()
    assert text.count(START) == 1 and text.count(END) == 1
    first = text.partition(START)[2].strip().splitlines()[0]
    assert re.match(r"lightning-amp bench: \d{4}-\d\d-\d\d \d\d:\d\d UTC, commit [0-9a-f]{7,40}, .+ "
                    r"\[avx512_bf16=(yes|no), amx_bf16=(yes|no), amx_tile=(yes|no)\]", first), first
    prose = re.sub(r"\s+", " ", _outside_table(text))
    for sentence in re.split(r"(?<=[.;:])\s", prose):
        about_table = re.search(r"results below|table below|of the results|this table|the table above", sentence)
        assert not (about_table and re.search(r"AVX|AMX|EPYC|Xeon", sentence, re.I)), (
            f"{page}: the prose describes the published table's CPU, which its first line names: {sentence!r}")


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_the_published_tables_commits_are_recorded_in_results(page):
    """The CPU table between the markers and the GPU table of the README each name a commit that
    benchmarks/RESULTS.md records (the run that made them, with its machine): a table republished
    without its run recorded, or left naming a run RESULTS.md does not know, fails here."""
    text = (ROOT / page).read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    first = text.partition(START)[2].strip().splitlines()[0]
    named = [re.search(r"commit ([0-9a-f]{7,40})", first).group(1)]
    named += re.findall(r"^\| H\d+, commit ([0-9a-f]{7,40}) \|", text, re.M)  # a GPU table's header cell
    missing = [commit for commit in named if commit not in results]
    assert not missing, f"{page}: tables of commits {missing} that benchmarks/RESULTS.md does not record"
