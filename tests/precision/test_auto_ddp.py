"""``opt_level="auto"`` under DDP (2 gloo ranks, real processes): the ranks move together, never one alone."""
import sys
from pathlib import Path

import pytest
import torch

from test_auto import _fit  # the single-process reference run
from test_precision_ddp import _run

from _ladder_nets import GainSum
from lightning_amp import AmpPrecision

SCRIPT = Path(__file__).with_name("auto_ddp_script.py")


@pytest.mark.slow
def test_ranks_move_together_on_one_ranks_verdict(tmp_path, flag_timing):
    rank0, rank1 = _run_and_check_the_ranks_moved_together(tmp_path)
    assert rank0["nbytes"] == rank1["nbytes"] > 0


@pytest.mark.slow
def test_with_snapshots_on_disk_each_rank_writes_and_restores_its_own_files(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTO_DDP_SNAPSHOT_DIR", str(tmp_path / "snaps"))  # one folder for both ranks
    rank0, rank1 = _run_and_check_the_ranks_moved_together(tmp_path)
    assert rank0["nbytes"] == rank1["nbytes"] == 0
    assert {p.name for p in (tmp_path / "snaps").iterdir()} >= {"ladder-rank0-good.pt", "ladder-rank1-good.pt"}


def _run_and_check_the_ranks_moved_together(tmp_path):
    _run(tmp_path, 2, SCRIPT)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank1["reason"].startswith("nonfinite_in_a_row")
    assert rank0["reason"] == "a rule fired on another rank"  # rank 0's own rule is off
    for key in ("rung", "changes", "moved_at", "snapshot_step"):
        assert rank0[key] == rank1[key], key
    assert rank0["rung"] == ("O1", 128.0) and rank0["changes"] == 1 and rank0["moved_at"] == 4  # decide_every=4
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)
    # both ranks saw the same batch: the run equals one process on the working rung for the steps after the move
    sys.path.insert(0, str(SCRIPT.parent))
    import auto_ddp_script

    manual, _ = _fit(GainSum, AmpPrecision("O1", dtype="float16", loss_scale=128.0),
                     auto_ddp_script.STEPS - rank0["moved_at"])
    for a, b in zip(rank0["params"], manual.parameters()):
        assert torch.equal(a, b.detach())
    return rank0, rank1
