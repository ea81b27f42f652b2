"""torch.compile(fullgraph=True) of a training step through the TP layers: Column -> GELU -> Row with the
weight gradients fused into fp32 ``main_grad`` (the wgrad GEMM, beta = 1) and a FusedAdam step, against the
same eager step, in one process and on 2 gloo ranks (TP = 2, with and without sequence parallelism)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_amp import ops
from lightning_amp.optimizers import FusedAdam
from lightning_amp.parallel import MainGradBuffer, comm
from lightning_amp.parallel.groups import build_groups
from lightning_amp.parallel.layers import ColumnParallelLinear, RowParallelLinear
from support.bounds import two_orders_apart
from support.processes import run_on_two_ranks

needs_ext = pytest.mark.skipif(ops._ext_for("cpu") is None,
                               reason=f"compiled extension not loaded: {ops.extension_error()}")
needs_backward_tracing = pytest.mark.skipif(not hasattr(torch._dynamo.config, "trace_autograd_ops"),
                                            reason="this torch's dynamo does not trace Tensor.backward()")

HIDDEN, FFN, SEQ_DIM = 8, 16, 1


def _mlp(group=None, sequence_parallel=False):
    torch.manual_seed(0)  # the same full weights on every rank and for both copies
    ref = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN))
    common = dict(sequence_parallel=sequence_parallel, sequence_dim=SEQ_DIM)
    model = nn.Sequential(ColumnParallelLinear.from_linear(ref[0], group, gather_output=False, **common), nn.GELU(),
                          RowParallelLinear.from_linear(ref[1], group, input_is_parallel=True, **common))
    weights = [model[0].weight, model[2].weight]
    flat = torch.zeros(sum(w.numel() for w in weights))  # one buffer, as the strategy's MainGradBuffer lays it out
    offset = 0
    for w in weights:
        w.main_grad = flat[offset:offset + w.numel()].view(w.shape)
        offset += w.numel()
    return model, weights, flat


def _step(model, weights, flat, opt, x, group, sequence_parallel):
    flat.zero_()
    if sequence_parallel:
        x = comm.scatter_to_sequence_parallel_region(x, group, SEQ_DIM)
    out = model(x)
    if sequence_parallel:
        out = comm.gather_from_sequence_parallel_region(out, group, SEQ_DIM, tensor_parallel_output_grad=False)
    loss = out.square().mean()
    loss.backward()
    for w in weights:  # the optimizer steps the weights with their fp32 main_grad
        w.grad = w.main_grad
    opt.step()
    return loss.detach()


def _compiled_matches_eager(backend, group=None, sequence_parallel=False, steps=4):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runs = [_mlp(group, sequence_parallel) for _ in range(2)]
    opts = [FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.1) for model, _, _ in runs]
    seed = torch.tensor([torch.seed() % 2**31])  # fresh inputs each run ...
    if dist.is_initialized():  # ... the same on every rank
        dist.broadcast(seed, 0)
    gen = torch.Generator().manual_seed(int(seed))
    batches = [torch.randn(2, 4, HIDDEN, generator=gen) for _ in range(steps)]
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        compiled = torch.compile(_step, fullgraph=True, backend=backend)
        for i, x in enumerate(batches):
            # the first step creates FusedAdam's state eagerly in both copies; the others are compiled in the second
            fns = (_step, _step if i == 0 else compiled)
            losses = []
            for fn, (model, weights, flat), opt in zip(fns, runs, opts):
                losses.append(fn(model, weights, flat, opt, x, group, sequence_parallel))
                opt.zero_grad()
            # aot_eager runs the eager kernels in the eager order; inductor fuses the elementwise ops (GELU, the
            # loss), whose fp32 rounding differs by a few ulp, which Adam's normalised update turns into ~1e-8
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            (ref, ref_weights, ref_flat), (ours, weights, flat) = runs
            torch.testing.assert_close(flat, ref_flat, rtol=1e-5, atol=1e-6)
            assert flat.abs().max() > 0  # the fused GEMM did accumulate into main_grad
            for p, q in zip(ours.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
                for key, value in opts[0].state[q].items():
                    torch.testing.assert_close(opts[1].state[p][key], value, rtol=1e-5, atol=1e-6)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@needs_ext
@needs_backward_tracing
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_tp_mlp_training_step_compiles_fullgraph_like_eager(backend):
    _compiled_matches_eager(backend)


def _two_rank_cases(rank):
    group = build_groups(2).tp_group  # a TP group of its own, not the default one
    for sequence_parallel in (False, True):
        try:
            _compiled_matches_eager("aot_eager", group, sequence_parallel)
        except AssertionError as err:
            raise AssertionError(f"rank {rank}, sequence_parallel={sequence_parallel}: {err}") from err


@pytest.mark.slow
@needs_ext
@needs_backward_tracing
def test_fused_tp_mlp_training_step_compiles_fullgraph_like_eager_on_two_ranks():
    # one spawn for both cases (process start-up dominates); with sequence parallelism the column layer's
    # all-gather and reduce-scatter and the row layer's reduce-scatter are traced too
    run_on_two_ranks(_two_rank_cases)


def _abs_products(model, batches, dtype):
    """For each param of ``model`` (Linear, GELU, Linear), ``sum |a_i b_i|`` over the terms its weight gradient
    sums over ``batches``: ``|G|^T |X|`` of each micro-batch for a weight, ``sum |G|`` for a bias, where X is the
    layer's input and G the grad of its output, taken from a float64 copy (``dtype`` bfloat16: X and G as the
    bf16 forward rounds them, to within 2**-8)."""
    ref = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)).double()
    with torch.no_grad():
        for mine, theirs in zip((ref[0], ref[2]), (model[0], model[2])):
            mine.weight.copy_(theirs.weight)
            mine.bias.copy_(theirs.bias)
    seen = {}
    for layer in (ref[0], ref[2]):
        layer.register_forward_hook(lambda mod, inp, out: seen.__setitem__((mod, "x"), inp[0].detach()))
        layer.register_full_backward_hook(lambda mod, gin, gout: seen.__setitem__((mod, "g"), gout[0].detach()))
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
    for x in batches:
        ref(x.double()).square().sum().backward()
        for i, layer in enumerate((ref[0], ref[2])):
            xs, gs = seen[layer, "x"].abs().flatten(0, -2), seen[layer, "g"].abs().flatten(0, -2)
            sums[2 * i] += gs.t() @ xs
            sums[2 * i + 1] += gs.sum(0)
    margin = 1 + 2.0 ** -7 if dtype == torch.bfloat16 else 1.0  # |X| and |G| rounded to bf16 on the way
    return [s * margin for s in sums]


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_forward_hands_the_main_grad_buffer_an_fp32_gradient(dtype):
    """The compiled model's weight gradients reach the fp32 main_grad buffer as eager's do, over two micro-batches.
    Not bitwise: the compiled backward adds its GEMM result to main_grad where eager's GEMM accumulates into it
    (beta = 1), and the BLAS orders those fp32 sums by the CPU's vector width (77 of 280 elements 1 ulp apart on
    an AVX2-only EPYC, equal on an AVX-512 Xeon); within twice the rounding bound of sums of that many products."""
    torch._dynamo.reset()
    runs = []
    for _ in range(2):
        model, _, _ = _mlp()
        for w in (model[0].weight, model[2].weight):
            del w.main_grad  # the buffer attaches its own
        runs.append((model, MainGradBuffer(model.parameters())))
    (ref, ref_buffer), (ours, buffer) = runs
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 4, HIDDEN)  # fresh inputs each run
    for _ in range(2):  # accumulation over two micro-batches; backward runs eagerly, so the buffer's hooks run
        for fn in (ref, compiled):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                out = fn(x)
            out.float().square().sum().backward()
    terms = 2 * x[..., 0].numel()  # products summed per element: the tokens of both micro-batches
    for p, q, abs_sum in zip(ours.parameters(), ref.parameters(), _abs_products(ref, [x, x], dtype)):
        bound = two_orders_apart(abs_sum, terms).float()
        assert ((p.main_grad - q.main_grad).abs() <= bound).all(), (p.main_grad - q.main_grad).abs().max()
        assert (q.main_grad.abs() > 100 * bound).any()  # the bound lies far below the gradient itself
    for p in ours.parameters():
        assert p.grad is None and p.grad_added_to_main_grad is False
