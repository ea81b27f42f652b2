"""The torch range in one place: ``lightning_amp._torch_support.TORCH_REQUIREMENT`` is pyproject.toml's torch
dependency, the releases CI proves (``.ci/torch-releases``) are its ends and the Makefile's torch, and a torch
outside it gets one warning naming the range at import, not a crash."""
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from lightning_amp import _torch_support

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _releases():
    text = open(os.path.join(ROOT, ".ci", "torch-releases")).read()
    return dict(re.findall(r"^(TORCH_\w+)=(\S+)$", text, re.M))


def test_the_requirement_is_pyprojects_and_ci_proves_its_ends():
    project = tomllib.loads(open(os.path.join(ROOT, "pyproject.toml")).read())["project"]
    torch_deps = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    assert torch_deps == ["torch" + _torch_support.TORCH_REQUIREMENT]
    releases = _releases()
    low, high = _torch_support._bounds()
    assert _torch_support.release(releases["TORCH_FLOOR"]) == low  # the oldest declared
    assert _torch_support.release(releases["TORCH_NEWEST"]) == (high[0], high[1] - 1)  # the newest in range
    assert all(_torch_support.tested(v) for v in releases.values())
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1) == releases["TORCH_MAIN"]


def test_the_readme_and_the_inventory_name_the_range_and_the_releases_ci_runs():
    """The prose a user reads (README's install section) and the inventory's "tested with" follow the range and
    .ci/torch-releases: no ceiling or lane left behind when a release is added."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    ranges = re.findall(r"`(>=\d+\.\d+,<\d+\.\d+)`", readme)
    assert len(ranges) >= 2 and set(ranges) == {_torch_support.TORCH_REQUIREMENT}, ranges
    inventory = open(os.path.join(ROOT, "docs", "architecture.md")).read().split("## torch and Lightning internals")[1]
    for text in (readme, inventory):
        for version in _releases().values():
            assert version in text


@pytest.mark.parametrize("version,expected", [("2.11.0", True), ("2.14.1+cu130", True), ("2.13.0+cpu", True),
                                              ("2.15.0+cu132", True), ("2.10.2", False), ("2.16.0.dev20270301", False),
                                              ("3.0.0", False), ("unknown", False)])
def test_which_releases_are_tested(version, expected):
    assert _torch_support.tested(version) is expected


_IMPORT_UNDER = """
import json, sys, warnings
import torch
torch.__version__ = sys.argv[1]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import lightning_amp
print(json.dumps([str(w.message) for w in caught if "lightning-amp is tested with torch" in str(w.message)]))
"""


def _import_under(version):
    """Import the package in a fresh process whose ``torch.__version__`` reads ``version``. Without the extension:
    the loader would refuse (and rebuild) a build made for the real torch."""
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_AMP_REQUIRE_EXT"}
    env["LIGHTNING_AMP_DISABLE_EXT"] = "1"
    return subprocess.run([sys.executable, "-c", _IMPORT_UNDER, version], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.16.0", "2.10.0"])
def test_a_torch_outside_the_range_gets_one_warning_naming_it_and_the_package_imports(version):
    proc = _import_under(version)
    assert proc.returncode == 0, proc.stderr[-2000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(messages) == 1, messages
    assert f"torch{_torch_support.TORCH_REQUIREMENT}" in messages[0] and f"torch {version}" in messages[0]


@pytest.mark.slow
def test_the_running_torch_gets_no_warning():
    import torch

    proc = _import_under(torch.__version__)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
