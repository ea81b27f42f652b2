"""``opt_level="auto"`` under DDP (2 gloo ranks, real processes): the ranks move together, never one alone."""
import pytest
import torch

from lightning_amp import AmpPrecision
from support.ladder_nets import GainSum, fit
from support.processes import run_script
from support.scripts import auto_ddp


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
    run_script("auto_ddp", tmp_path)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert rank1["reason"].startswith("nonfinite_in_a_row")
    assert rank0["reason"] == "a rule fired on another rank"  # rank 0's own rule is off
    for key in ("rung", "changes", "moved_at", "snapshot_step"):
        assert rank0[key] == rank1[key], key
    assert rank0["rung"] == ("O1", 128.0) and rank0["changes"] == 1 and rank0["moved_at"] == 4  # decide_every=4
    for a, b in zip(rank0["params"], rank1["params"]):
        assert torch.equal(a, b)
    # both ranks saw the same batch: the run equals one process on the working rung for the steps after the move
    manual, _ = fit(GainSum, AmpPrecision("O1", dtype="float16", loss_scale=128.0),
                    auto_ddp.STEPS - rank0["moved_at"])  # the single-process reference run
    for a, b in zip(rank0["params"], manual.parameters()):
        assert torch.equal(a, b.detach())
    return rank0, rank1
