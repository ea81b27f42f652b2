""".ci/torch_release_notice.py, which .ci/run starts first: one line when the package index pip asks holds a
newer torch than the ceiling lane's (.ci/torch-releases' TORCH_NEWEST), nothing when it does not, and never a
failure or a hang, whatever the index does. Each case asks a real pip, against a local index written here."""
import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, ".ci", "torch_release_notice.py")


def _script_module():
    spec = importlib.util.spec_from_file_location("torch_release_notice", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


notice_script = _script_module()
CEILING = notice_script.ceiling()
MAJOR, MINOR, _ = notice_script.release(CEILING)


def _run(index_url, timeout=30.0):
    """The script as .ci/run starts it, with pip's configuration replaced by one index: ``index_url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=index_url, PIP_DISABLE_PIP_VERSION_CHECK="1")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, SCRIPT, "--timeout", str(timeout)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    return proc, time.monotonic() - start


def _index(tmp_path, versions):
    """A PEP 503 index whose torch project lists a wheel of each version (the files need not exist to be listed)."""
    project = tmp_path / "simple" / "torch"
    project.mkdir(parents=True)
    links = "".join(f'<a href="torch-{v}-py3-none-any.whl">torch-{v}-py3-none-any.whl</a>\n' for v in versions)
    (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return (tmp_path / "simple").as_uri()


def test_the_ceiling_is_torch_releases_torch_newest():
    text = open(os.path.join(ROOT, ".ci", "torch-releases")).read()
    assert f"\nTORCH_NEWEST={CEILING}\n" in text
    assert open(os.path.join(ROOT, ".ci", "run")).read().count(".ci/torch_release_notice.py") == 1


def test_a_newer_minor_release_gets_one_notice_naming_it_and_the_ceiling(tmp_path):
    newer = f"{MAJOR}.{MINOR + 1}.0"
    proc, _ = _run(_index(tmp_path, ["2.11.0", CEILING, newer, f"{MAJOR}.{MINOR + 2}.0rc1"]))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert f"torch {newer}, newer than the ceiling lane's {CEILING}" in lines[0]  # the release candidate is no release
    assert "raise pyproject.toml's torch ceiling" in lines[0]


def test_nothing_is_printed_when_the_ceiling_is_the_newest_release(tmp_path):
    proc, _ = _run(_index(tmp_path, ["2.11.0", f"{MAJOR}.{MINOR - 1}.1", CEILING]))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_an_unreachable_index_is_one_line_and_no_failure():
    with socket.socket() as closed:  # a port nothing listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    proc, _ = _run(f"http://127.0.0.1:{port}/simple")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch release check: skipped, pip index versions torch listed no versions")
    assert f"the ceiling lane runs torch {CEILING}" in proc.stdout and proc.stdout.count("\n") == 1


def test_an_index_that_never_answers_is_given_up_after_the_timeout():
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never sends a byte
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        proc, seconds = _run(f"http://127.0.0.1:{silent.getsockname()[1]}/simple", timeout=1.5)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch release check: skipped, the package index did not answer within 1.5 s")
    assert seconds < 8  # pip's own timeout (10 s a request) never came into it


@pytest.mark.parametrize("newest,lane,expected", [("2.16.0", "2.15.0", "minor"), ("2.15.1", "2.15.0", "patch"),
                                                  ("2.16", "2.15.0", "minor"), ("2.15", "2.15.0", None),
                                                  ("2.15.0+cu132", "2.15.0", None), ("2.14.1", "2.15.0", None),
                                                  ("3.0.0", "2.15.0", "minor")])
def test_which_releases_are_newer(newest, lane, expected):
    line = notice_script.notice(newest, lane)
    if expected is None:
        assert line is None
    else:
        assert f"torch {newest}, newer than the ceiling lane's {lane}" in line and f"a newer {expected} release" in line
