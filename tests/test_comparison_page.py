"""docs/comparison.md cannot silently go stale.

The page compares lightning-amp with Lightning's precisions and apex amp, and backs the README's decision table
("Who should use it, and when"). Every test it names exists (a ``file::function`` is defined in that file), every
row of its feature table names one in the lightning-amp column, every row of the README's decision table has its
evidence on the page, the files of Lightning and torch it says it read exist in the installed packages, and the
cells that can be checked here (Lightning's and torch's behaviour, lightning-amp having no FP8) are checked.
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_amp.amp.levels import _auto_dtype

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "comparison.md"
CITED = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")
DOC_LINK = re.compile(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)")
READ = re.compile(r"`((?:lightning|torch)/[\w/]+\.py)`")


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _rows(section: str) -> list:
    """The cells of every body row of the first Markdown table in ``section``."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in list(table)[2:]]


def _defines(path: Path, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def {name}\(", path.read_text(), re.M) is not None


def test_every_test_the_page_names_exists():
    cited = CITED.findall(PAGE.read_text())
    assert len(cited) >= 40
    missing = [f"{path}::{name}" if name else path for path, name in cited
               if not (ROOT / path).is_file() or (name and not _defines(ROOT / path, name))]
    assert not missing, f"docs/comparison.md names tests that do not exist: {missing}"


def test_every_feature_row_names_a_test_in_the_lightning_amp_column():
    rows = _rows(_section(PAGE.read_text(), "Feature table"))
    assert len(rows) >= 20
    assert all(len(row) == 7 for row in rows), [row[0] for row in rows if len(row) != 7]
    untested = [row[0] for row in rows if not CITED.search(row[1])]
    assert not untested, f"feature rows whose lightning-amp cell names no test: {untested}"


def test_every_row_of_the_readme_decision_table_has_its_evidence_on_the_page():
    readme = _rows(_section((ROOT / "README.md").read_text(), "Who should use it, and when"))
    evidence = {row[0]: row[1] for row in _rows(_section(PAGE.read_text(), "The README's decision table, row by row"))}
    assert len(readme) >= 8
    assert [row[0] for row in readme] == list(evidence), "the page's rows are not the README's, in its order"
    for situation, shown_by in evidence.items():
        assert CITED.search(shown_by) or "lightning/" in shown_by or "benchmarks/RESULTS.md" in shown_by, situation
        for page in DOC_LINK.findall(shown_by):
            assert (ROOT / "docs" / page).is_file(), (situation, page)


def test_the_sources_the_page_read_are_those_of_the_installed_packages():
    read = READ.findall(_section(PAGE.read_text(), "What was read"))
    assert len(read) >= 6
    missing = []
    for path in read:
        package, _, rest = path.partition("/")
        location = Path(importlib.util.find_spec(package).origin).parent
        if not (location / rest).is_file():
            missing.append(path)
    assert not missing, f"files the page says it read are not in the installed packages: {missing}"


def test_the_cells_checkable_here_hold():
    # 16-mixed refuses to clip with an optimizer that unscales in its own kernel (torch's fused=True)
    fused = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        MixedPrecision("16-mixed", "cpu").clip_gradients(fused, clip_val=1.0)
    # ModelParallelStrategy (FSDP2, DTensor TP) refuses 16-mixed and transformer-engine, takes bf16-mixed
    for precision in ("16-mixed", "transformer-engine"):
        with pytest.raises(ValueError, match="does not support"):
            L.Trainer(accelerator="cpu", strategy=ModelParallelStrategy(), precision=precision, logger=False)
    L.Trainer(accelerator="cpu", strategy=ModelParallelStrategy(), precision="bf16-mixed", logger=False)
    # torch's GradScaler: dynamic only, no hysteresis, floor or ceiling
    options = set(inspect.signature(torch.amp.GradScaler).parameters)
    assert {"init_scale", "growth_interval", "backoff_factor"} <= options
    assert not options & {"hysteresis", "min_scale", "min_loss_scale", "max_scale", "max_loss_scale"}
    # is_bf16_supported() counts emulated bf16 (a V100, a T4) unless told not to; dtype="auto" tells it not to
    assert inspect.signature(torch.cuda.is_bf16_supported).parameters["including_emulation"].default is True
    assert "is_bf16_supported(including_emulation=False)" in inspect.getsource(_auto_dtype)
    # lightning-amp has no FP8: the README sends FP8 to Lightning's transformer-engine
    sources = [*(ROOT / "lightning_amp").rglob("*.py"),
               *(s for s in (ROOT / "csrc").rglob("*") if s.suffix in (".cpp", ".h", ".cu", ".cuh"))]
    assert len(sources) > 50
    assert not [str(s.relative_to(ROOT)) for s in sources if re.search(r"float8|fp8", s.read_text(), re.I)]
