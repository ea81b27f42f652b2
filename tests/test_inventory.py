"""docs/architecture.md's inventory of torch's, Lightning's and torchmetrics' internals names, per row, the test that
fails the day a release changes what the row leans on: every such test exists, and every row names one."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _section():
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    start = text.index("## torch and Lightning internals")
    return text[start:text.index("\n## ", start + 1)]


def test_every_test_the_inventory_names_exists():
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", _section())
    assert len(named) >= 40
    missing = [f"{path}::{name}" for path, name in named
               if not re.search(rf"^def {name}\(", open(os.path.join(ROOT, path)).read(), re.M)]
    assert not missing, missing


def test_every_row_names_a_test_or_a_ci_check():
    rows = [line for line in _section().splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 30
    untested = [row[:80] for row in rows if "tests/" not in row.split("|")[-2] and ".ci/" not in row.split("|")[-2]]
    assert not untested, untested
