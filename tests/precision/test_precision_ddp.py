"""AmpO2Precision under Trainer(strategy="ddp", devices=2, accelerator="cpu") with gloo, real processes.

(Also: ``find_unused_parameters`` and ``static_graph``, against ``bf16-mixed``; support/scripts/ddp_graph.py.)

Rank 1 alone sees an inf gradient at one step (written after DDP's all-reduce): both ranks must skip
that step, back the scale off and stay bitwise identical. Gradient accumulation (2 micro-batches)
happens on the fp32 Parameters, and the grads of the no_sync micro-batch must still be averaged across
ranks (by DDP itself now): the 2-rank run must match a 1-process run that sees both ranks' samples in each batch.
"""
import pytest
import torch

from support.processes import run_script
from support.scripts import ddp_graph, precision_ddp

pytestmark = pytest.mark.slow  # each test starts 2 ranks (11-12 s measured, benchmarks/RESULTS.md)


def test_ddp_inf_on_one_rank_skips_everywhere_and_accumulates_in_fp32(tmp_path, flag_timing):
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_dir.mkdir()
    single_dir.mkdir()
    run_script("precision_ddp", ddp_dir, 2)
    precision_ddp.main(str(single_dir), 1)  # the 1-process reference runs in this process
    rank0 = torch.load(ddp_dir / "rank0.pt")
    rank1 = torch.load(ddp_dir / "rank1.pt")
    single = torch.load(single_dir / "rank0.pt")

    for result in (rank0, rank1, single):
        assert result["skipped"] == 1
        assert result["scale"] == 2.0**9  # init 2**10, one backoff
    for a, b in zip(rank0["masters"], rank1["masters"]):
        assert torch.equal(a, b)
    assert all(m.dtype == torch.float32 for m in rank0["masters"])
    # one set of params: the optimizer steps the module's own fp32 Parameters
    assert all(torch.equal(m, h) for m, h in zip(rank0["masters"], rank0["halves"]))
    for a, b in zip(rank0["masters"], single["masters"]):
        assert torch.allclose(a, b, atol=2e-3, rtol=0), (a - b).abs().max()


def test_o2_trains_like_bf16_mixed_under_ddp_with_unused_parameters_and_a_static_graph(tmp_path):
    """``find_unused_parameters=True`` and ``static_graph=True``: DDP's hooks fire on O2's fp32
    Parameters (autocast's casts keep them in the graph), an unused branch gets no grad and stays put,
    both ranks hold the same weights, and O2's losses and weights follow bf16-mixed's."""
    run_script("ddp_graph", tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    for graph in ("find_unused_parameters", "static_graph"):
        o2, mixed = ranks[0][(graph, "O2")], ranks[0][(graph, "bf16-mixed")]
        for a, b in zip(o2["params"], ranks[1][(graph, "O2")]["params"]):
            assert torch.equal(a, b), graph  # the ranks agree
        assert o2["dtypes"] == {torch.float32}
        assert o2["unused_grad"] is None and not o2["unused_moved"], graph
        assert mixed["losses"][0] - mixed["losses"][-1] > 0.1, mixed["losses"]
        assert max(abs(a - b) for a, b in zip(o2["losses"], mixed["losses"])) < 0.02, (o2["losses"], mixed["losses"])
        start = _branchy_start()
        for got, ref, init in zip(o2["params"], mixed["params"], start):
            assert (got - ref).norm() < 0.1 * (ref - init).norm(), graph  # well within how far training moved them


def _branchy_start():
    return [p.detach() for p in ddp_graph.Branchy().body.parameters()]
