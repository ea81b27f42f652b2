"""Column/RowParallelLinear and the comm pairs on 2 real gloo ranks vs a full nn.Linear (fp64 reference)."""


import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_amp.parallel import ParallelMultiheadAttention, TensorParallelConfig, apply_plan, comm
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from support.bounds import two_orders_apart
from support.processes import run_on_two_ranks

WORLD = 2


def _close(actual, expected, dtype, what):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    actual, expected = actual.double(), expected.double()
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item() + 1e-12
    assert err <= tol * scale, f"{what}: max abs err {err:.3e} > {tol} x {scale:.3e}"


def _check_layers(rank, dtype, fusion, sequence_parallel):
    torch.manual_seed(1234)  # identical inputs on both ranks
    batch, seq, in_f, hid = 3, 6, 10, 14  # awkward sizes; seq and hid split over 2 ranks
    x = torch.randn(batch, seq, in_f)
    grad_out = torch.randn(batch, seq, in_f)
    torch.manual_seed(7)
    lin1 = nn.Linear(in_f, hid)
    lin2 = nn.Linear(hid, in_f)
    # fp64 reference of lin2(gelu(lin1(x)))
    x64 = x.double().requires_grad_(True)
    w1, b1, w2, b2 = (t.detach().double().requires_grad_(True) for t in (lin1.weight, lin1.bias, lin2.weight, lin2.bias))
    y64 = torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x64, w1, b1)), w2, b2)
    y64.backward(grad_out.double())

    sp_dim = 1
    col = ColumnParallelLinear.from_linear(
        lin1, None, gather_output=False, sequence_parallel=sequence_parallel, sequence_dim=sp_dim,
        gradient_accumulation_fusion=fusion,
    ).to(dtype)
    row = RowParallelLinear.from_linear(
        lin2, None, input_is_parallel=True, sequence_parallel=sequence_parallel, sequence_dim=sp_dim,
        gradient_accumulation_fusion=fusion,
    ).to(dtype)
    if fusion:  # the fused wgrad path accumulates into an attached fp32 main_grad (the strategy attaches its buffer)
        for p in (col.weight, row.weight):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    if sequence_parallel:
        x_in = comm.scatter_to_sequence_parallel_region(x.to(dtype), None, sp_dim)
        x_in = x_in.detach().requires_grad_(True)
        g_in = grad_out.chunk(WORLD, sp_dim)[rank].to(dtype)
    else:
        x_in = x.to(dtype).requires_grad_(True)
        g_in = grad_out.to(dtype)
    y = row(torch.nn.functional.gelu(col(x_in)))
    y.backward(g_in)

    exp_y = y64.chunk(WORLD, sp_dim)[rank] if sequence_parallel else y64
    exp_gx = x64.grad.chunk(WORLD, sp_dim)[rank] if sequence_parallel else x64.grad
    _close(y, exp_y, dtype, "forward")
    assert y.dtype == dtype
    _close(x_in.grad, exp_gx, dtype, "grad_input")
    w1_grad = col.weight.main_grad if fusion else col.weight.grad
    w2_grad = row.weight.main_grad if fusion else row.weight.grad
    if fusion:
        assert col.weight.grad is None and row.weight.grad is None, "fusion must bypass weight.grad"
        assert w1_grad.dtype == torch.float32 and w2_grad.dtype == torch.float32
    else:
        assert not hasattr(col.weight, "main_grad")
    _close(w1_grad, w1.grad.chunk(WORLD, 0)[rank], dtype, "column wgrad")
    _close(w2_grad, w2.grad.chunk(WORLD, 1)[rank], dtype, "row wgrad")
    _close(col.bias.grad, b1.grad.chunk(WORLD, 0)[rank], dtype, "column bias grad")
    row_bias_grad = row.bias.grad.clone()
    if sequence_parallel:  # partial over this rank's tokens: replicated params need a TP all-reduce
        assert row.bias.sequence_parallel
        dist.all_reduce(row_bias_grad)
    _close(row_bias_grad, b2.grad, dtype, "row bias grad")
    # full weights gather back to the originals
    _close(col.full_weight(), lin1.weight.detach().to(dtype), dtype, "gathered column weight")
    _close(row.full_weight(), lin2.weight.detach().to(dtype), dtype, "gathered row weight")

    # a second backward accumulates into main_grad (gradient accumulation in fp32)
    if fusion:
        before = w1_grad.clone()
        x2 = x_in.detach().requires_grad_(True)
        row(torch.nn.functional.gelu(col(x2))).backward(g_in)
        _close(col.weight.main_grad, 2 * before, dtype, "accumulated main_grad")


def _check_gather_scatter_and_sync(rank):
    torch.manual_seed(5)
    lin = nn.Linear(8, 6)
    x = torch.randn(4, 8, requires_grad=True)
    # each rank's GEMM (3 of the 6 outputs; then the all-reduced halves of the input grad) sums the same products as
    # the full Linear's in the order its BLAS picks for that shape on this CPU: within twice the rounding bound of the
    # sums (8 products + bias; 6 products of the grads 2y, which differ by twice y's bound); a wrong shard or a
    # missing all-reduce is off by whole terms, far above it
    w, b = lin.weight.detach().double().abs(), lin.bias.detach().double().abs()
    y_bound = two_orders_apart(x.detach().double().abs() @ w.t() + b, 9)
    for async_comm in (True, False):
        col = ColumnParallelLinear.from_linear(lin, None, gather_output=True,
                                                config=TensorParallelConfig(async_grad_allreduce=async_comm))
        row = RowParallelLinear.from_linear(nn.Linear(6, 8), None, input_is_parallel=False)
        y = col(x)
        assert ((y - lin(x)).double().abs() <= y_bound).all()
        (gx,) = torch.autograd.grad(y.square().sum(), x)
        (gref,) = torch.autograd.grad(lin(x).square().sum(), x)
        gx_bound = two_orders_apart(2 * y.detach().double().abs() @ w, 6) + 2 * y_bound @ w
        assert ((gx - gref).double().abs() <= gx_bound).all()
        out, bias = RowParallelLinear.from_linear(nn.Linear(6, 8), None, skip_bias_add=True)(y)
        assert bias is not None and out.shape == (4, 8)
        assert row(y).shape == (4, 8)
    # comm pairs: gather/scatter are adjoint, copy/reduce are adjoint
    t = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 12, dtype=torch.float64)
    (gt,) = torch.autograd.grad(comm.gather_from_tensor_parallel_region(t), t, g)
    torch.testing.assert_close(gt, g.chunk(2, -1)[rank])
    local = torch.randn(2, 3, dtype=torch.float64) * (rank + 1)
    local.requires_grad_(True)
    red = comm.reduce_from_tensor_parallel_region(local)
    expected = local.detach() * 3 / (rank + 1)
    torch.testing.assert_close(red, expected)
    cp = comm.copy_to_tensor_parallel_region(local)
    (gc,) = torch.autograd.grad(cp, local, torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(gc, torch.full((2, 3), 2.0, dtype=torch.float64))
    s = torch.arange(8.0, dtype=torch.float64).reshape(4, 2).requires_grad_(True)
    rs = comm.reduce_scatter_to_sequence_parallel_region(s, None, 0)
    torch.testing.assert_close(rs, 2 * s.detach()[2 * rank:2 * rank + 2])
    # a bad split names the sizes
    with pytest.raises(ValueError, match="out_features=7"):
        ColumnParallelLinear.from_linear(nn.Linear(4, 7), None)
    with pytest.raises(ValueError, match="in_features=5"):
        RowParallelLinear.from_linear(nn.Linear(5, 4), None)


def _check_plan_errors(rank):
    """Unsplittable layers at TP=2: ValueError naming the paths and numbers, and the model left untouched."""
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by tensor_parallel_size=2"):
        ParallelMultiheadAttention(nn.MultiheadAttention(12, 3, batch_first=True))
    with pytest.raises(ValueError, match=r"0\.out_features=5 not divisible by tensor_parallel_size=2"):
        apply_plan(nn.Sequential(nn.Linear(4, 5)), plan={"0": "column"})
    with pytest.raises(ValueError, match="no layer of Sequential can be split across 2 ranks.*allow_replicated"):
        apply_plan(nn.Sequential(nn.Conv1d(2, 2, 1), nn.LayerNorm(3)))
    assert apply_plan(nn.Sequential(nn.Conv1d(2, 2, 1)), allow_replicated=True) == []
    layer = nn.TransformerEncoderLayer(6, 3, 8, dropout=0.0, batch_first=True)
    with pytest.raises(ValueError, match=r"self_attn\.num_heads=3 not divisible by tensor_parallel_size=2"):
        apply_plan(layer)
    assert type(layer.linear1) is nn.Linear and type(layer.self_attn) is nn.MultiheadAttention  # never half-converted


class _BertSelfAttention(nn.Module):
    """Attention written like BERT/Llama code: q/k/v/o projections and a head count read in forward."""

    def __init__(self, hidden=12, heads=4):
        super().__init__()
        self.num_attention_heads, self.head_dim = heads, hidden // heads
        self.all_head_size = hidden
        self.query, self.key, self.value, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.num_attention_heads, self.head_dim).transpose(1, 2)
                   for p in (self.query, self.key, self.value))
        ctx = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim ** 0.5, -1) @ v
        return self.o_proj(ctx.transpose(1, 2).reshape(b, s, self.all_head_size))


def _check_named_attention_plan(rank):
    """q/k/v/o naming at TP=2: heads split, head-count attributes divided, outputs and grads unchanged."""
    import copy

    torch.manual_seed(11)
    ref = _BertSelfAttention()
    tp = copy.deepcopy(ref)
    kinds = {r.name: r.kind for r in apply_plan(tp)}
    assert kinds == {"query": "column", "key": "column", "value": "column", "o_proj": "row"}
    assert tp.num_attention_heads == 2 and tp.all_head_size == 6
    x = torch.randn(2, 5, 12)
    x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref, y_tp = ref(x_ref), tp(x_tp)
    torch.testing.assert_close(y_tp, y_ref, rtol=1e-5, atol=1e-5)
    y_ref.square().sum().backward()
    y_tp.square().sum().backward()
    torch.testing.assert_close(x_tp.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tp.query.weight.grad, ref.query.weight.grad.chunk(2, 0)[rank], rtol=1e-5, atol=1e-6)


def _all_cases(rank):
    for sequence_parallel in (False, True):
        for dtype in (torch.float32, torch.bfloat16):
            for fusion in (True, False):
                try:
                    _check_layers(rank, dtype, fusion, sequence_parallel)
                except AssertionError as err:
                    raise AssertionError(f"dtype={dtype} fusion={fusion} sp={sequence_parallel}: {err}") from err
    _check_gather_scatter_and_sync(rank)
    _check_plan_errors(rank)
    _check_named_attention_plan(rank)


@pytest.mark.slow
def test_column_row_match_linear_and_comm_pairs():
    """fp32/bf16 x fused/unfused wgrad x with/without sequence parallelism, then gather/scatter/copy/reduce
    adjointness, size errors and the plan's messages for unsplittable layers (one spawn: process start-up
    dominates the cost)."""
    run_on_two_ranks(_all_cases)


def test_standalone_layers_train_with_a_plain_optimizer():
    """Default gradient_accumulation_fusion=True without a main_grad attached: weight.grad is filled, so a plain
    torch optimizer updates the weights exactly as it updates nn.Linear; with one attached, the fused path fills it."""
    torch.manual_seed(3)
    ref = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    par = nn.Sequential(ColumnParallelLinear.from_linear(ref[0], None, gather_output=False), nn.Tanh(),
                        RowParallelLinear.from_linear(ref[2], None, input_is_parallel=True))
    assert par[0].gradient_accumulation_fusion and par[2].gradient_accumulation_fusion
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, par)]
    initial = [p.detach().clone() for p in par.parameters()]
    x = torch.randn(6, 5)
    for model, opt in zip((ref, par), opts):
        model(x).square().sum().backward()
        opt.step()
    assert par[0].weight.grad is not None and not hasattr(par[0].weight, "main_grad")
    for p_ref, p_par in zip(ref.parameters(), par.parameters()):
        torch.testing.assert_close(p_par, p_ref, rtol=1e-6, atol=1e-6)
    assert all(not torch.equal(p, p0) for p, p0 in zip(par.parameters(), initial))  # every param moved
    par[0].weight.main_grad = torch.zeros(8, 5)
    par[0].weight.grad = None
    par(x).square().sum().backward()
    assert par[0].weight.grad is None and par[0].weight.main_grad.abs().sum() > 0


def test_single_process_layers_are_plain_linear():
    torch.manual_seed(3)
    lin = nn.Linear(5, 7)
    col = ColumnParallelLinear.from_linear(lin, None, config=TensorParallelConfig(gradient_accumulation_fusion=False))
    x = torch.randn(2, 5)
    torch.testing.assert_close(col(x), lin(x))
    with pytest.raises(ValueError, match="gather_output"):
        ColumnParallelLinear(4, 4, sequence_parallel=True, gather_output=True)


def test_layers_read_their_options_from_the_config_and_warn_on_the_old_keywords():
    config = TensorParallelConfig(gradient_accumulation_fusion=False, async_grad_allreduce=False)
    col = ColumnParallelLinear(5, 7, config=config)
    assert col.config is config and not col.gradient_accumulation_fusion and not col.async_grad_allreduce
    with pytest.warns(DeprecationWarning, match=r"gradient_accumulation_fusion=False.* is deprecated; pass "
                                                r"config=TensorParallelConfig\(gradient_accumulation_fusion=False\)"):
        row = RowParallelLinear.from_linear(nn.Linear(5, 4), None, gradient_accumulation_fusion=False)
    assert not row.gradient_accumulation_fusion and row.async_grad_allreduce
    with pytest.raises(TypeError, match="config must be a TensorParallelConfig"):
        ColumnParallelLinear(5, 7, config={"gradient_accumulation_fusion": False})
    with pytest.raises(TypeError, match="gradient_accumulation_fusion must be a bool"):
        TensorParallelConfig(gradient_accumulation_fusion="yes")


def test_fused_wgrad_tells_the_buffer_through_grad_added_to_main_grad():
    """Megatron's protocol: the buffer marks its params with grad_added_to_main_grad=False; the fused GEMM adds into
    main_grad, sets the flag and hands autograd a placeholder, so the buffer's hook runs, skips the add and clears
    the flag. No per-param callbacks are attached."""
    from lightning_amp.parallel import MainGradBuffer

    torch.manual_seed(5)
    ref = nn.Linear(5, 7)
    col = ColumnParallelLinear.from_linear(ref, None)
    seen = []  # registered before the buffer's hook, so it runs first
    col.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad_added_to_main_grad))
    buffer = MainGradBuffer(col.parameters())
    assert col.weight.grad_added_to_main_grad is False
    assert not any(hasattr(col.weight, name) for name in ("_main_grad_target", "_main_grad_ready"))
    x = torch.randn(3, 5)
    for _ in range(2):  # accumulates over two backwards
        col(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert seen == [True, True]  # the layer set the flag before the hooks ran (the buffer's hook clears it)
    assert col.weight.grad_added_to_main_grad is False and col.weight.grad is None
    torch.testing.assert_close(col.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(col.bias.main_grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    buffer.finish_sync()
    buffer.expose_grads()  # the exposed fp32 view is held through the next backward: the placeholder must add 0
    buffer.reclaim()  # what the strategies call before each backward
    col(x).square().sum().backward()
    ref(x).square().sum().backward()
    buffer.finish_sync()
    torch.testing.assert_close(col.weight.main_grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    buffer.remove_hooks()
    assert not hasattr(col.weight, "grad_added_to_main_grad")
