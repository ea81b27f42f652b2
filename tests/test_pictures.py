"""The docs' pictures (``benchmarks/draw_pictures.py``, runs in ``benchmarks/picture_runs.py``) are drawn from real
runs, and the pages show them.

* Every ``img/*.png`` a page of docs/ or the README references exists; each picture the script draws is referenced by
  its page, which names the script, and is under 150 KB.
* The script, run whole into ``tmp_path`` (slow: two processes), draws its three PNGs from data that agree with the
  runs: the ladder's moves and rollback point with the plugin's own state and warning, the loss scale's back-offs and
  growths with the scaler's rule, the tensor-parallel split with the plan report of both ranks and with the plan
  computed here, in this process, on the same model.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.optional_deps import require

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 150_000
IMAGE = re.compile(r"!\[[^\]]*\]\(((?:docs/)?img/[^)\s]+\.png)\)")


@pytest.fixture
def script(monkeypatch):
    """benchmarks/draw_pictures.py as a module (it imports its sibling picture_runs.py, which imports no torch)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("draw_pictures")


def test_every_picture_a_page_shows_exists_and_the_script_s_pictures_are_shown_small(script):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    shown = {}
    for page in pages:
        for ref in IMAGE.findall(page.read_text()):
            shown.setdefault((page.parent / ref).resolve(), []).append(page.relative_to(ROOT).as_posix())
    missing = sorted(str(p.relative_to(ROOT)) for p in shown if not p.is_file())
    assert missing == [], f"pictures referenced but absent: {missing}"
    for key, name in script.PICTURES.items():
        picture = ROOT / "docs" / "img" / name
        assert script.PAGES[key] in shown.get(picture, []), f"{script.PAGES[key]} does not show img/{name}"
        assert "benchmarks/draw_pictures.py" in (ROOT / script.PAGES[key]).read_text()
        assert picture.stat().st_size < MAX_BYTES, f"{name}: {picture.stat().st_size} bytes"


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """The script run whole into a temporary folder: (its --data JSON, the folder)."""
    require("transformers")  # the tensor-parallel picture's Llama
    out = tmp_path_factory.mktemp("pictures")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "draw_pictures.py"), "--out", str(out),
                             "--data", str(out / "data.json")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "data.json").read_text()), out


@pytest.mark.slow
def test_the_script_draws_three_small_pngs_naming_their_commit(drawn, script):
    data, out = drawn
    for name in script.PICTURES.values():
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / name).stat().st_size < MAX_BYTES
    from lightning_amp.bench.meta import commit  # the footer's commit: the checkout's, "unknown" without git history

    assert data["facts"]["commit"] == commit()
    if (ROOT / ".git").exists():  # the CI lanes run the suite on a copy of the tree without its history
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", data["facts"]["commit"])


@pytest.mark.slow
def test_the_ladder_picture_shows_the_runs_move_and_rollback(drawn):
    data, _ = drawn
    run, picture = data["runs"]["ladder"], data["drawn"]["ladder"]
    rows, final, config = run["rows"], run["final"], run["config"]
    assert [r["step"] for r in rows] == [r["ladder_steps"] for r in rows] == list(range(1, config["steps"] + 1))
    moves = picture["moves"]
    assert len(moves) == final["changes"] >= 1
    last = moves[-1]
    assert (last["step"], last["rollback_to"]) == (final["moved_at"], final["snapshot_step"])
    assert run["rungs"][final["rung"]] == last["to"] and final["rung"] == rows[-1]["rung_after"] == len(moves)
    assert f"at step {last['step']}; rolled back to step {last['rollback_to']}" in run["warnings"][-1]
    for before, after in zip(rows, rows[1:]):  # a step runs on the rung the previous one left
        assert after["rung"] == before["rung_after"]
    assert picture["rung_per_step"] == [r["rung"] for r in rows]
    k = config["nonfinite_in_a_row"]
    for move in moves:
        assert move["rollback_to"] < move["step"] and move["rollback_to"] % config["snapshot_every"] == 0
        assert move["rollback_to"] in picture["rollback_points"]
        assert set(range(move["step"] - k + 1, move["step"] + 1)) <= set(picture["skipped"])  # the rule that fired
        assert move["lr_restored"]  # the step after the move ran at the rolled-back scheduler's rate
        assert rows[move["step"] - 1]["rung"] + 1 == rows[move["step"]]["rung"]
    assert picture["skipped"] == [r["step"] for r in rows if r["nonfinite"]]
    counted, moved_at = 0, {m["step"] for m in moves}
    for row in rows:  # between moves the plugin's count grows on exactly the steps drawn as skipped
        if row["step"] not in moved_at:
            assert row["skipped_total"] - counted == row["nonfinite"], row
        counted = row["skipped_total"]


@pytest.mark.slow
def test_the_loss_scale_picture_shows_back_offs_and_growths_by_the_scalers_rule(drawn):
    data, _ = drawn
    run, picture = data["runs"]["scale"], data["drawn"]["scale"]
    rows, rule = run["rows"], run["scaler"]
    scale = {r["step"]: r["scale"] for r in rows}
    skipped = set(picture["skipped"])
    assert picture["backoffs"] and picture["growths"] and len(skipped) == run["skipped_steps"]
    for step in picture["backoffs"]:
        assert step - 1 in skipped and scale[step] == scale[step - 1] * rule["backoff_factor"]
    for step in skipped - {rows[-1]["step"]}:  # hysteresis 1, the floor never reached: every overflow backs off
        assert step + 1 in picture["backoffs"]
    for step in picture["growths"]:
        assert scale[step] == scale[step - 1] * rule["growth_factor"]
        assert not skipped & set(range(step - rule["growth_interval"], step))
    assert all(math.log2(s).is_integer() for s in scale.values())


@pytest.mark.slow
def test_the_tp_picture_draws_the_plan_of_both_ranks_and_of_this_process(drawn, script):
    from torch import nn

    from lightning_amp.parallel.plan import build_plan

    data, _ = drawn
    run, picture = data["runs"]["tp"], data["drawn"]["tp"]
    block, tp = run["config"]["block"], run["config"]["tp"]
    ranks = run["ranks"]
    model = script.runs.tiny_llama()
    plan = build_plan(model, "auto", tp)  # here, without processes: the same plan the ranks applied
    modules = dict(model.named_modules())
    assert [r["rank"] for r in ranks] == list(range(tp))
    for rank in ranks:
        assert rank["decisions"] == plan.decisions and rank["whole"] == plan.whole
        converted = {layer["name"]: layer["kind"] for unit in rank["report"]["split"] for layer in unit["layers"]}
        assert converted == plan.decisions == {n: rank["decisions"][n] for n in rank["shards"]}
        assert rank["max_abs_diff"] < 1e-5 * rank["logits_scale"]
    boxes = picture["boxes"]
    in_block = sorted(n for n in plan.decisions if n.startswith(block + "."))
    assert sorted({b["name"] for b in boxes}) == in_block and len(boxes) == tp * len(in_block)
    for box in boxes:
        assert isinstance(modules[box["name"]], nn.Linear)
        assert box["kind"] == plan.decisions[box["name"]]
        assert box["dim"] == {"column": "rows", "row": "columns"}[box["kind"]]  # out features / in features split
        assert box["ranges"] == ranks[box["rank"]]["shards"][box["name"]]["ranges"]
    for name in in_block:  # the ranks' slices partition the split dimension
        held = sorted(i for box in boxes if box["name"] == name for a, b in box["ranges"] for i in range(a, b))
        assert held == list(range(ranks[0]["shards"][name]["of"]))
    columns = {n for n, kind in plan.decisions.items() if kind == "column"}
    rows = {n for n, kind in plan.decisions.items() if kind == "row"}
    for rank in ranks:
        calls = [c for c in rank["calls"] if c["module"] and c["module"].startswith(block + ".")]
        assert {c["module"] for c in calls if c["phase"] == "forward"} == rows & set(in_block)
        backward = [c["module"] for c in calls if c["phase"] == "backward"]
        # one input all-reduce per unit (its column layers share it: issue 47), not one per column layer
        assert set(backward) <= columns and len(backward) == len(
            [u for u in rank["units"] if u["columns"][0].startswith(block + ".")])
    for band in picture["collectives"]:
        assert band["count"] == sum(1 for c in ranks[0]["calls"] if c["module"] in band["modules"]
                                    and c["phase"] == band["phase"])
    assert {m for band in picture["collectives"] for m in band["modules"]} == set(in_block)
