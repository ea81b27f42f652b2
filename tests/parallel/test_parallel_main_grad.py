"""MainGradBuffer on 2 real gloo ranks (DP=2): fp32 main_grad views, hooks, bucketed/overlapped all-reduce,
params used twice or not at all, accumulation, and the TP-aware grad norm."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_amp.parallel import ColumnParallelLinear, MainGradBuffer, RowParallelLinear, clip_grad_norm_, tp_grad_norm
from lightning_amp.parallel import comm
from lightning_amp.parallel.main_grad import mark_sequence_parallel
from support.processes import free_port

pytestmark = pytest.mark.slow  # its one test spawns 2 ranks (12 s measured, benchmarks/RESULTS.md)


class Net(nn.Module):
    def __init__(self, dtype, tp_group):
        super().__init__()
        torch.manual_seed(0)
        self.col = ColumnParallelLinear(6, 10, group=tp_group, gradient_accumulation_fusion=True, dtype=dtype)
        self.shared = nn.Linear(10, 10, dtype=dtype)  # applied twice per forward
        self.norm = nn.LayerNorm(10, dtype=dtype)
        self.unused = nn.Linear(3, 3, dtype=dtype)  # never touched: must not crash
        self.out = nn.Linear(10, 5, dtype=dtype)

    def forward(self, x):
        h = torch.tanh(self.col(x))
        h = self.shared(torch.relu(self.shared(h)))
        return self.out(self.norm(h))


def _reference_grads(x_all, net):
    """Mean over ranks of each rank's grads, computed in fp64 on the full batch split."""
    ref = Net(torch.float64, net.col.group)
    with torch.no_grad():
        for p_ref, p in zip(ref.parameters(), net.parameters()):
            p_ref.copy_(p.double())
    for x in x_all:
        ref(x.double()).square().mean().mul(1.0 / len(x_all)).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]


def _worker(rank, dtype, overlap, bucket_numel):
    tp_group = [dist.new_group([r]) for r in range(2)][rank]  # TP size 1, DP over the world
    net = Net(dtype, tp_group)
    buffer = MainGradBuffer(net.parameters(), dp_group=None, tp_group=None, bucket_numel=bucket_numel, overlap=overlap)
    assert len(buffer.buckets) > 1
    for p in net.parameters():
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape
        assert p.main_grad.untyped_storage().data_ptr() == buffer.buffer.untyped_storage().data_ptr()
    g = torch.Generator().manual_seed(42)
    micro = [[torch.randn(4, 6, generator=g) for _ in range(2)] for _ in range(2)]  # [micro][rank]
    # two micro-batches: the first accumulates locally (no sync), the second syncs
    buffer.sync_enabled = False
    net(micro[0][rank].to(dtype)).square().mean().mul(0.5).backward()
    buffer.sync_enabled = True
    net(micro[1][rank].to(dtype)).square().mean().mul(0.5).backward()
    assert all(p.grad is None for p in net.parameters()), "hooks must move grads into main_grad"
    buffer.finish_sync()
    buffer.expose_grads()
    expected = _reference_grads([m[r] for m in micro for r in range(2)], net)
    # per rank: 0.5 * (two micro-batch losses); DP averages over 2 ranks -> mean of the 4 losses
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for (name, p), e in zip(net.named_parameters(), expected):
        err = (p.grad.double() - e).abs().max().item()
        assert err <= tol * (e.abs().max().item() + 1e-3), f"{name}: err {err} scale {e.abs().max().item()} got {p.grad.abs().max().item()}"
        if p.dtype == torch.float32:
            assert p.grad.data_ptr() == p.main_grad.data_ptr()
    assert torch.count_nonzero(net.unused.weight.grad) == 0
    # full-model norm and clipping (TP size 1: the plain norm)
    params = list(net.parameters())
    norm = tp_grad_norm(params, tp_group)
    torch.testing.assert_close(norm, torch.linalg.vector_norm(torch.cat([p.grad.float().reshape(-1) for p in params])))
    clip_grad_norm_(params, norm.item() / 2, tp_group)
    torch.testing.assert_close(tp_grad_norm(params, tp_group), norm / 2, rtol=1e-3, atol=1e-6)
    buffer.zero()
    assert all(p.grad is None for p in params) and torch.count_nonzero(buffer.buffer) == 0
    buffer.remove_hooks()




def _all_checks(rank, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        _worker(rank, torch.float32, True, 64)  # small buckets, all-reduce overlapped with backward
        _worker(rank, torch.bfloat16, False, 100)  # half params, reduction after backward
        _sequence_parallel_block(rank)
        _grads_after_their_bucket_was_launched(rank)
        _sequence_parallel_params_overlap(rank)
        torch.manual_seed(0)
        a, b = nn.Linear(4, 6), nn.Linear(6, 4)
        col, row = ColumnParallelLinear.from_linear(a, None, gather_output=False), RowParallelLinear.from_linear(b, None, input_is_parallel=True)
        x = torch.randn(5, 4)
        b(torch.relu(a(x))).sum().backward()
        row(torch.relu(col(x))).sum().backward()  # no main_grad attached: plain weight.grad
        full = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in (a.weight, a.bias, b.weight, b.bias)]))
        got = tp_grad_norm([col.weight, col.bias, row.weight, row.bias])
        torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


def _sequence_parallel_block(rank):
    """LayerNorm -> column(SP) -> gelu -> row(SP) on sequence shards; LayerNorm and row-bias grads are partial
    per rank and must be all-reduced over TP by the buffer to equal the full-sequence reference."""
    torch.manual_seed(3)
    norm, a, b = nn.LayerNorm(8), nn.Linear(8, 12), nn.Linear(12, 8)
    x = torch.randn(2, 6, 8)
    ref_params = [t.detach().double().requires_grad_(True) for t in (norm.weight, norm.bias, a.weight, a.bias, b.weight, b.bias)]
    nw, nb, aw, ab, bw, bb = ref_params
    h = nn.functional.layer_norm(x.double(), (8,), nw, nb)
    y = nn.functional.linear(nn.functional.gelu(nn.functional.linear(h, aw, ab)), bw, bb)
    y.square().sum().backward()
    sp = dict(sequence_parallel=True, sequence_dim=1)
    col = ColumnParallelLinear.from_linear(a, None, gather_output=False, **sp)
    row = RowParallelLinear.from_linear(b, None, input_is_parallel=True, **sp)
    mark_sequence_parallel(norm)
    solo = [dist.new_group([r]) for r in range(2)][rank]
    params = list(norm.parameters()) + list(col.parameters()) + list(row.parameters())
    buffer = MainGradBuffer(params, dp_group=solo, tp_group=None)
    local = comm.scatter_to_sequence_parallel_region(x, None, 1)
    row(nn.functional.gelu(col(norm(local)))).square().sum().backward()
    buffer.finish_sync()
    full = {"norm.weight": nw.grad, "norm.bias": nb.grad, "row.bias": bb.grad,
            "col.weight": aw.grad.chunk(2, 0)[rank], "col.bias": ab.grad.chunk(2, 0)[rank], "row.weight": bw.grad.chunk(2, 1)[rank]}
    got = {"norm.weight": norm.weight, "norm.bias": norm.bias, "row.bias": row.bias,
           "col.weight": col.weight, "col.bias": col.bias, "row.weight": row.weight}
    for name, p in got.items():
        torch.testing.assert_close(p.main_grad.double(), full[name], rtol=1e-5, atol=1e-5, msg=name)
    buffer.remove_hooks()


def _grads_after_their_bucket_was_launched(rank):
    """Two backward() calls before one reduction (e.g. two losses): the first launches every bucket's
    all-reduce during backward, so every grad of the second must go to the side buffer, never into a
    buffer slice that is being reduced. Result: the DP mean of both losses' grads, exactly."""
    solo = [dist.new_group([r]) for r in range(2)][rank]  # TP size 1, DP over the world
    net = Net(torch.float32, solo)
    buffer = MainGradBuffer(net.parameters(), dp_group=None, tp_group=None, bucket_numel=1, overlap=True)
    g = torch.Generator().manual_seed(7)
    xs = [[torch.randn(4, 6, generator=g) for _ in range(2)] for _ in range(2)]  # [loss][rank]
    for x in xs:
        net(x[rank]).square().mean().backward()
        launched = sum(w is not None for w in buffer._works)
        assert launched == len(buffer.buckets) - 2, "overlap: every used param's bucket launched during backward"
    assert buffer._has_late  # the side buffer took the second backward's grads
    buffer.finish_sync()
    buffer.expose_grads()
    expected = _reference_grads([x[r] for x in xs for r in range(2)], net)
    for (name, p), e in zip(net.named_parameters(), expected):
        # per rank the sum of 2 losses, averaged over 2 ranks: twice the mean of the 4 losses
        torch.testing.assert_close(p.grad.double(), 2 * e, rtol=1e-5, atol=1e-6, msg=name)
    buffer.remove_hooks()


def _sequence_parallel_params_overlap(rank):
    """Sequence-parallel params keep the overlapped DP all-reduce; their TP sum is taken after it. The 2 ranks
    act as both the DP and the TP group of a replicated LayerNorm: grad = TP-sum of the DP-mean = sum over ranks."""
    torch.manual_seed(0)
    norm = mark_sequence_parallel(nn.LayerNorm(8))
    buffer = MainGradBuffer(norm.parameters(), dp_group=None, tp_group=None, bucket_numel=1, overlap=True)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(5, 8, generator=g) for _ in range(2)]
    norm(xs[rank]).pow(3).sum().backward()
    assert all(w is not None for w in buffer._works), "sequence-parallel params must not turn the overlap off"
    buffer.finish_sync()
    ref = nn.LayerNorm(8).double()
    for x in xs:
        ref(x.double()).pow(3).sum().backward()
    torch.testing.assert_close(norm.weight.main_grad.double(), ref.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.bias.main_grad.double(), ref.bias.grad, rtol=1e-5, atol=1e-6)
    buffer.remove_hooks()


def test_main_grad_buffer_and_tp_grad_norm():
    """fp32 + overlap + small buckets; bf16 without overlap; then the TP norm (shards summed, replicated once)."""
    mp.spawn(_all_checks, args=(free_port(),), nprocs=2)
