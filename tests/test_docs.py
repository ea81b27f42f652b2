"""Every ```python block of README.md and docs/*.md runs as written, each in a fresh process.

A block runs with a temporary folder as its working directory and the repository importable, under a
time limit. A block whose first line is a comment ``# needs: <reason>`` (a CUDA GPU, apex, 2 processes)
is skipped with that reason. Bash blocks are checked for shell syntax (``bash -n``): a usage line such
as ``[--size tiny|small|base]`` pasted into a command is a pipe to bash.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)
NEEDS = re.compile(r"#\s*needs:\s*(.+)")
TIME_LIMIT_S = 120


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


def needs(code: str):
    """The reason in a ``# needs: ...`` first line, or None."""
    first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
    match = NEEDS.fullmatch(first.strip())
    return match.group(1).strip() if match else None


def test_the_pages_have_blocks():
    assert len(blocks("python")) >= 15 and len(blocks("bash")) >= 5


@pytest.mark.parametrize("code", blocks("python"))
def test_python_block_runs_as_written(code, tmp_path):
    reason = needs(code)
    if reason:
        pytest.skip(f"needs: {reason}")
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=TIME_LIMIT_S)
    assert result.returncode == 0, f"block failed:\n{code}\n--- stderr ---\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("code", blocks("bash"))
def test_bash_block_is_valid_shell(code):
    result = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for line in code.splitlines():
        command = line.split("#")[0]
        assert not re.search(r"\[--[\w-]+ [^\]]*\|", command), f"a usage pattern pasted as a command: {line}"


def test_needs_marker_syntax():
    assert needs("# needs: a CUDA GPU\nimport torch\n") == "a CUDA GPU"
    assert needs("\n#needs: apex\n") == "apex"
    assert needs("import torch  # needs: nothing\n") is None
    assert needs("# a comment\n# needs: apex\n") is None


def test_publish_bench_replaces_the_table_between_the_markers(tmp_path):
    import importlib.util

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
