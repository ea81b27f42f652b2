"""O2's half stream by construction (csrc/o2_policy.cpp's stream rules, docs/o2-design.md), no Lightning.

Inside O2's forward a half activation meeting an fp32 tensor that is no activation of the stream (a Parameter,
a view or expression of one, a buffer, a mask, a per-row statistic broadcasting into the stream) gives a half
result, computed from the exact fp32 operand and rounded once; a full-size fp32 activation keeps torch's
promotion and is reported. Values are checked bit for bit against fp32 references rounded once, grads against
float64 within the bound of the roundings involved.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp import ops
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.amp.o2 import stream_watch

BF16, F16 = torch.bfloat16, torch.float16
pytestmark = pytest.mark.skipif(not o2_policy.available(), reason="needs the compiled extension")


@pytest.fixture
def held():
    hold = o2_policy.hold()
    yield hold
    hold.release()
    assert o2_policy.installs() == 0


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _o2(dtype=BF16):
    class _Both:
        def __enter__(self):
            self.autocast = torch.autocast("cpu", dtype=dtype)
            self.autocast.__enter__()
            self.forward = o2_policy.forward()
            self.forward.__enter__()

        def __exit__(self, *exc):
            self.forward.__exit__(*exc)
            self.autocast.__exit__(*exc)

    return _Both()


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_views_and_expressions_of_parameters_follow_the_stream(dtype, held):
    """The trap of issue 46: ``weight[0]`` (the headline example's segment embedding), ``cls.expand(...)``
    concatenated (ViT), ``pos[:, :T]`` (a plain GPT), an expression ``w.abs() + 1``: each meets a half activation
    and the result is half, equal to the op in fp32 on the exact Parameter rounded once."""
    g = _gen(1)
    x = torch.randn(3, 5, 8, generator=g).to(dtype).requires_grad_()
    table = nn.Parameter(torch.randn(2, 8, generator=g))
    cls = nn.Parameter(torch.randn(1, 1, 8, generator=g))
    pos = nn.Parameter(torch.randn(1, 7, 8, generator=g))
    w = nn.Parameter(torch.randn(8, generator=g))
    with _o2(dtype):
        segment = x + table[0]
        with_cls = torch.cat([cls.expand(3, -1, -1), x], dim=1)
        positioned = x + pos[:, :5]
        scaled = x * (w.abs() + 1)
        divided = (w.abs() + 1) / (x.abs() + 1)
        stacked = torch.stack([x[0], pos[0, :5]])
        chosen = torch.where(x > 0, x, pos[:, :5])
    xf = x.detach().float()
    expected = {
        "segment": (segment, xf + table[0]), "positioned": (positioned, xf + pos[:, :5]),
        "scaled": (scaled, xf * (w.abs() + 1)), "divided": (divided, (w.abs() + 1) / (x.detach().abs() + 1).float()),  # x.abs() + 1 is half
        "with_cls": (with_cls, torch.cat([cls.expand(3, -1, -1), xf], 1)),
        "stacked": (stacked, torch.stack([xf[0], pos[0, :5]])), "chosen": (chosen, torch.where(xf > 0, xf, pos[:, :5])),
    }
    for name, (got, reference) in expected.items():
        assert got.dtype == dtype, name
        assert torch.equal(got, reference.detach().to(dtype)), name
    loss = sum(t.float().square().sum() for t, _ in expected.values())
    loss.backward()
    for p in (table, cls, pos, w):
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("half_first", [True, False])
def test_grads_of_the_rounded_once_ops_match_float64(op, half_first, held):
    """StreamBinary's backward: the half operand's grad in its dtype, the fp32 operand's reduced over the
    broadcast dimensions in fp32; both within a few bf16 roundings of float64's (the bound: 4 u_bf16 relative
    to the largest grad), for an fp32 operand that broadcasts (a Parameter of one row) and one that does not."""
    g = _gen(2)
    fns = {"add": lambda a, b: torch.add(a, b, alpha=0.5), "sub": lambda a, b: torch.sub(a, b, alpha=2.0),
           "mul": torch.mul, "div": torch.div}
    fn = fns[op]
    for shape in ((8,), (4, 6, 8)):
        x64 = torch.randn(4, 6, 8, generator=g, dtype=torch.float64).add_(3.0)  # away from 0: a divisor
        x = x64.to(BF16).requires_grad_()
        w = nn.Parameter(torch.randn(shape, generator=g).add_(3.0))
        out_grad = torch.randn(4, 6, 8, generator=g).to(BF16)
        with _o2():
            out = fn(x, w) if half_first else fn(w, x)
        assert out.dtype == BF16
        out.backward(out_grad)
        xr = x.detach().double().requires_grad_()
        wr = w.detach().double().requires_grad_()
        (fn(xr, wr) if half_first else fn(wr, xr)).backward(out_grad.double())
        u = torch.finfo(BF16).eps / 2
        for got, ref in ((x.grad, xr.grad), (w.grad, wr.grad)):
            assert got.shape == ref.shape
            error = (got.double() - ref).abs().max() / ref.abs().max()
            assert error <= 4 * u, (op, half_first, shape, float(error))
        assert w.grad.dtype == torch.float32 and x.grad.dtype == BF16


def test_an_fp32_table_is_not_rounded_before_the_product(held):
    """A RoPE-style table kept fp32 (a buffer: no grad) times a half activation: the product of the exact table
    rounded once, not the product of a bf16-rounded table (the former O2's error); an fp32 mask of fp32's lowest
    value added to half scores saturates at bf16's finite range (an infinity would make a fully masked row's
    softmax NaN)."""
    g = _gen(3)
    positions = torch.arange(0, 4096, 64, dtype=torch.float32)[:, None]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    cos = torch.cos(positions * inv_freq)  # [64, 8]
    x = torch.randn(2, 64, 8, generator=g).to(BF16)
    mask = torch.full((64, 64), torch.finfo(torch.float32).min).triu(1)
    scores = torch.randn(2, 64, 64, generator=g).to(BF16)
    with _o2():
        rotated = x * cos
        masked = scores + mask
    exact = (x.float() * cos).to(BF16)
    assert rotated.dtype == BF16 and torch.equal(rotated, exact)
    assert not torch.equal(exact, x * cos.to(BF16))  # the test can tell the two apart
    assert masked.dtype == BF16 and torch.isfinite(masked).all()
    assert torch.isfinite(torch.softmax(masked.float(), -1)).all()


def test_t5_layer_norm_comes_out_half(held):
    """Hugging Face T5's norm computes in fp32 and casts back only "if the weight is half"; under O2 its weight is
    the fp32 Parameter, and its output is half all the same (the per-row statistic broadcasts into the stream),
    within one bf16 rounding of bf16-true's (half weight) output."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    torch.manual_seed(0)
    norm = T5LayerNorm(16)
    with torch.no_grad():
        norm.weight.add_(torch.randn(16) * 0.1)
    x = torch.randn(3, 5, 16).to(BF16)
    with _o2():
        out = norm(x)
    half_norm = T5LayerNorm(16).to(BF16)
    half_norm.load_state_dict(norm.state_dict())
    reference = half_norm(x)
    assert out.dtype == BF16 and reference.dtype == BF16
    u = torch.finfo(BF16).eps / 2
    assert ((out.float() - reference.float()).abs() <= 3 * u * reference.float().abs() + 1e-30).all()
    assert transformers is not None


def test_t5_feed_forward_reads_its_upcast_as_the_half_activation(held):
    """Hugging Face T5's feed-forward casts its half activation to ``self.wo.weight.dtype`` (the fp32 Parameter's
    under O2) before ``wo``, which autocast casts back. Inside O2's forward ``wo`` reads the half activation itself:
    one half tensor saved where torch's casts save two, the same values and grads bit for bit; after an in-place
    write to the upcast it is read through torch's cast again."""
    def run(o2, write=False):
        torch.manual_seed(0)
        wi, wo = nn.Linear(8, 16), nn.Linear(16, 8)
        x = torch.randn(4, 8, generator=_gen(7), requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            with _o2() if o2 else torch.autocast("cpu", dtype=BF16, cache_enabled=False):
                h = F.relu(wi(x))  # relu saves its half output
                up = h.to(wo.weight.dtype)
                if write:
                    up.mul_(0.5)
                y = wo(up)
        y.float().square().sum().backward()
        half_saved = {t.data_ptr() for t in saved if t.dtype == BF16 and t.shape == h.shape}
        return len(half_saved), [y.detach(), x.grad] + [p.grad for p in (*wi.parameters(), *wo.parameters())]

    for write, saved_by_o2 in ((False, 1), (True, 2)):
        (o2_saved, o2_values), (torch_saved, torch_values) = run(True, write), run(False, write)
        assert (o2_saved, torch_saved) == (saved_by_o2, 2)
        for a, b in zip(o2_values, torch_values):
            assert torch.equal(a, b)


def test_a_full_size_fp32_activation_promotes_and_is_reported_once(held):
    """An fp32 activation of the result's full size (an explicit upcast deep in the model) keeps torch's
    promotion, as under bf16-true: O2 keeps what the model's own code makes fp32. It is reported once per
    arming, with the op and its operands; nothing is reported when the stream stays half."""
    reports = []
    module = nn.Linear(8, 8)
    ops.extension_module().o2_report_promotions(lambda op, operands: reports.append((op, operands)))
    try:
        x = torch.randn(4, 8).to(BF16)
        deep = torch.randn(4, 8, requires_grad=True)
        for _ in range(9):
            deep = deep * 1.0
        with _o2():
            half = x * module.weight[0]
            assert not reports and half.dtype == BF16
            first, second = x + deep, x * deep
    finally:
        stream_watch.disarm()
    assert first.dtype == second.dtype == torch.float32
    assert reports == [("aten::add", "BFloat16[4, 8], Float[4, 8] requires_grad")]


def test_outside_o2_forward_the_stream_ops_are_torchs(held):
    """A bf16-mixed forward in the same process (the policy registered, O2's forward not entered): promotion."""
    x = torch.randn(4, 8).to(BF16)
    w = nn.Parameter(torch.randn(8))
    with torch.autocast("cpu", dtype=BF16):
        assert (x * w[None]).dtype == torch.float32
        assert torch.cat([x, w[None]]).dtype == torch.float32
        assert torch.equal(x * w, x.float() * w)
