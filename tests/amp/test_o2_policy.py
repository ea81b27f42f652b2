"""O2's compiled autocast policy (csrc/o2_policy.cpp, lightning_amp/amp/o2/policy.py), no Lightning.

Three claims: (1) outside O2's forward every registered kernel is torch's own (same values, same
dtypes, other threads untouched, nothing left after the last release); (2) inside it, O2's rules
(norms in the input's dtype with half weights, embeddings and Parameters half, losses fp32, the rest as
it comes); (3) the table of ops and torch's policy for each matches the torch that is installed.
CUDA's lists are exercised on the CPU through the "cuda-lists-on-cpu" mode.
"""
import gc
from contextlib import nullcontext
import os
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp.amp.o2 import policy as o2_policy
from support.o2_cases import matmul_cases

BF16, F16 = torch.bfloat16, torch.float16
pytestmark = pytest.mark.skipif(not o2_policy.available(), reason="needs the compiled extension")


def _nothing_held():
    gc.collect()  # a Fabric plugin holds the policy until it is collected (Fabric has no end of run)
    assert o2_policy.installs() == 0


@pytest.fixture
def held():
    _nothing_held()
    hold = o2_policy.hold()
    yield hold
    hold.release()
    assert o2_policy.installs() == 0


@pytest.fixture
def cuda_lists_on_cpu():
    _nothing_held()
    hold = o2_policy.hold("cuda-lists-on-cpu")
    yield hold
    hold.release()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _cases(dtype):
    """(name, fn) pairs: each op the CPU key registers, called the way models call it, on fresh random
    half activations and fp32 Parameters."""
    g = _gen(1)
    x = torch.randn(4, 6, 8, generator=g).to(dtype)
    w, b = nn.Parameter(torch.randn(8, generator=g)), nn.Parameter(torch.randn(8, generator=g))
    gw, gb = nn.Parameter(torch.randn(6, generator=g)), nn.Parameter(torch.randn(6, generator=g))
    table = nn.Parameter(torch.randn(10, 8, generator=g))
    ids = torch.randint(0, 10, (4, 6), generator=g)
    fp32_activation = torch.randn(4, 6, 8, generator=g)
    mean, var = torch.randn(6, generator=g), torch.rand(6, generator=g) + 0.5
    return matmul_cases(x, g) + [
        ("layer_norm", lambda: F.layer_norm(x, (8,), w, b)),
        ("native_layer_norm", lambda: torch.native_layer_norm(x, (8,), w, b, 1e-5)[0]),
        ("rms_norm", lambda: F.rms_norm(x, (8,), w)),
        ("group_norm", lambda: F.group_norm(x, 3, gw, gb)),
        ("batch_norm (fp32 stats)", lambda: F.batch_norm(x, mean.clone(), var.clone(), gw, gb, training=True)),
        ("embedding", lambda: F.embedding(ids, table)),
        ("sparse embedding", lambda: F.embedding(ids, table, sparse=True)),
        ("mul param", lambda: x * w),
        ("add param", lambda: w + x),
        ("sub param", lambda: x - w),
        ("div param", lambda: x / (w.abs() + 1)),  # an expression of a Parameter: torch promotes it
        ("where param", lambda: torch.where(x > 0, x, w)),
        ("cat param", lambda: torch.cat([x, w.expand(4, 1, 8)], 1)),
        ("stack param", lambda: torch.stack([x[0, 0], w])),
        ("add fp32 activation", lambda: x + fp32_activation),
        ("mul 0-dim param", lambda: x * nn.Parameter(torch.tensor(1.5))),
    ]


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_outside_o2_forward_every_kernel_is_torchs(dtype):
    """With the kernels registered but O2's forward not entered: the same values and dtypes as torch's
    own autocast, forward and backward (what a bf16-mixed user in the same process sees)."""
    def run():
        out = {}
        with torch.autocast("cpu", dtype=dtype):
            for name, fn in _cases(dtype):
                y = fn()
                out[name] = (y.dtype, y.detach().clone())
        return out

    _nothing_held()
    plain = run()
    hold = o2_policy.hold()
    try:
        assert not o2_policy.active()
        registered = run()
    finally:
        hold.release()
    for name in plain:
        assert registered[name][0] == plain[name][0], name
        assert torch.equal(registered[name][1], plain[name][1]), name
    assert plain["mul param"][0] == torch.float32  # what O2 changes: promotion by an fp32 Parameter


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_inside_o2_forward_matmuls_and_convolutions_are_torchs(dtype, held):
    """The lower-precision rows (registered for the exact upcasts of tests/amp/test_o2_stream.py): inside O2's
    forward, with fp32 Parameters and no upcast among the inputs, each op's values, dtype and grads are torch's
    autocast's bit for bit."""
    def run(o2):
        g = _gen(4)
        x = torch.randn(4, 6, 8, generator=g).to(dtype)
        cases = matmul_cases(x, g)
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False), (o2_policy.forward() if o2 else nullcontext()):
            ys = [fn() for _, fn in cases]
        sum(y.float().square().sum() for y in ys).backward()
        params = [c.cell_contents for _, fn in cases for c in fn.__closure__ if isinstance(c.cell_contents, nn.Parameter)]
        return [y.detach() for y in ys] + [p.grad for p in dict.fromkeys(params)]

    o2, plain = run(True), run(False)
    assert len(o2) == len(plain) > 20
    for a, b in zip(o2, plain):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_inside_o2_forward_the_rules_hold(dtype, held):
    g = _gen(2)
    x = torch.randn(4, 6, 8, generator=g).to(dtype)
    w, b = nn.Parameter(torch.randn(8, generator=g)), nn.Parameter(torch.randn(8, generator=g))
    table = nn.Parameter(torch.randn(10, 8, generator=g))
    sparse_table = nn.Parameter(table.detach().clone())
    ids = torch.randint(0, 10, (4, 6), generator=g)
    fp32_activation = torch.randn(4, 6, 8, generator=g, requires_grad=True)
    for _ in range(9):  # more ops than O2 follows back to Parameters: an activation
        fp32_activation = fp32_activation * 1.0
    with torch.autocast("cpu", dtype=dtype), o2_policy.forward():
        assert o2_policy.active()
        norm = F.layer_norm(x, (8,), w, b)
        rms = F.rms_norm(x, (8,), w)
        deliberate = F.layer_norm(x.float(), (8,), w, b)  # a model that upcasts on purpose keeps fp32
        emb = F.embedding(ids, table)
        sparse = F.embedding(ids, sparse_table, sparse=True)
        scaled = x * w  # computed in fp32 from the exact Parameter, rounded once
        promoted = x + fp32_activation  # a full-size fp32 activation: type promotion, as torch
        frozen = x * w.detach()  # broadcasts into the stream: follows it
        mean, var = torch.zeros(8, dtype=dtype), torch.ones(8, dtype=dtype)
        half_bn = F.batch_norm(x.transpose(1, 2), mean, var, w, b, training=True)
        kept_bn = F.batch_norm(x.transpose(1, 2), torch.zeros(8), torch.ones(8), w, b, training=True)
    assert not o2_policy.active()
    with torch.no_grad():
        assert torch.equal(norm, F.layer_norm(x, (8,), w.to(dtype), b.to(dtype)))
        assert torch.equal(rms, F.rms_norm(x, (8,), w.to(dtype)))
        assert deliberate.dtype == torch.float32 and torch.equal(deliberate, F.layer_norm(x.float(), (8,), w, b))
        assert torch.equal(emb, F.embedding(ids, table.to(dtype)))
        assert torch.equal(sparse, emb)  # the result is cast, not the table: a sparse grad stays sparse
        assert scaled.dtype == frozen.dtype == dtype and torch.equal(scaled, (x.float() * w).to(dtype))
        assert torch.equal(frozen, scaled) and promoted.dtype == torch.float32
        ref_bn = F.batch_norm(x.transpose(1, 2), torch.zeros(8, dtype=dtype), torch.ones(8, dtype=dtype),
                              w.to(dtype), b.to(dtype), training=True)
        assert torch.equal(half_bn, ref_bn) and kept_bn.dtype == dtype
    (norm.float().sum() + scaled.float().square().sum() + emb.float().sum()).backward()
    sparse.float().sum().backward()
    assert w.grad.dtype == b.grad.dtype == table.grad.dtype == torch.float32  # grads land on the fp32 leaves
    assert sparse_table.grad.is_sparse and torch.equal(sparse_table.grad.to_dense(), table.grad)
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cuda_lists_run_half_inside_o2_forward_and_fp32_outside(dtype, cuda_lists_on_cpu):
    """CUDA's autocast upcasts norms, softmax, pow, sum, ...: outside O2's forward the kernels do exactly
    that (bf16-mixed on a GPU), inside it they run on the half activations (bf16-true's computation);
    a cross-entropy loss is fp32 inside."""
    g = _gen(3)
    x = torch.randn(4, 6, 8, generator=g).to(dtype)
    w, b = nn.Parameter(torch.randn(8, generator=g)), nn.Parameter(torch.randn(8, generator=g))
    target = torch.randint(0, 8, (4,), generator=g)
    ops = {
        "layer_norm": lambda: F.layer_norm(x, (8,), w, b),
        "softmax": lambda: x.softmax(-1),
        "log_softmax": lambda: F.log_softmax(x, -1),
        "pow": lambda: x.pow(3.0),
        "exp": lambda: x.exp(),
        "rsqrt": lambda: (x.abs() + 1).rsqrt(),
        "sum": lambda: x.sum(-1),
        "cumsum": lambda: x.cumsum(-1),
        "vector_norm": lambda: torch.linalg.vector_norm(x, dim=-1),
        "upsample": lambda: F.interpolate(x, scale_factor=2.0, mode="nearest"),
    }
    with torch.autocast("cpu", dtype=dtype):
        outside = {name: fn() for name, fn in ops.items()}
        loss_outside = F.cross_entropy(x[:, 0], target)
        explicit = x.softmax(-1, dtype=torch.float32)
        with o2_policy.forward():
            inside = {name: fn() for name, fn in ops.items()}
            loss_inside = F.cross_entropy(x[:, 0], target)
            explicit_inside = x.softmax(-1, dtype=torch.float32)
    for name in ops:
        assert outside[name].dtype == torch.float32, name
        assert inside[name].dtype == dtype, name
    assert torch.equal(outside["layer_norm"], F.layer_norm(x.float(), (8,), w, b))
    assert torch.equal(inside["layer_norm"], F.layer_norm(x, (8,), w.to(dtype), b.to(dtype)))
    assert torch.equal(inside["softmax"], x.softmax(-1)) and torch.equal(outside["softmax"], x.float().softmax(-1))
    # torch lets cross_entropy decompose on CUDA, into log_softmax with the logits' own dtype as an explicit
    # dtype= (kept by autocast: half log-probabilities) and nll_loss (fp32); O2 runs the whole loss in fp32.
    assert loss_outside.dtype == loss_inside.dtype == torch.float32
    assert torch.equal(loss_outside, F.nll_loss(F.log_softmax(x[:, 0], -1).float(), target))
    assert torch.equal(loss_inside, F.nll_loss(F.log_softmax(x[:, 0].float(), -1), target))
    assert explicit.dtype == explicit_inside.dtype == torch.float32  # an explicit dtype= is kept


@pytest.mark.parametrize("mode", ["torch", "cuda-lists-on-cpu"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_group_norm_native_layer_norm_and_parameters_in_elementwise_ops_inside_o2_forward(dtype, mode):
    """docs/o2-design.md's rules for the ops no other test calls inside O2's forward: ``group_norm`` and
    ``native_layer_norm`` run in their input's dtype with half copies of their fp32 weight and bias (CUDA's
    list would upcast them: checked outside); add/sub/mul/div of a half tensor and an fp32 Parameter, on
    either side, are half, computed in fp32 and rounded once (type promotion would make them fp32); an input
    the model made fp32 keeps its norm fp32. Each result equals its reference bit for bit."""
    _nothing_held()
    g = _gen(4)
    x = torch.randn(4, 6, 8, generator=g).to(dtype)
    w, b = nn.Parameter(torch.randn(8, generator=g)), nn.Parameter(torch.randn(8, generator=g))
    gw, gb = nn.Parameter(torch.randn(6, generator=g)), nn.Parameter(torch.randn(6, generator=g))
    divisor = nn.Parameter(torch.rand(8, generator=g) + 0.5)
    elementwise = {
        "add": (lambda p: x + p, lambda p: p + x), "sub": (lambda p: x - p, lambda p: p - x),
        "mul": (lambda p: x * p, lambda p: p * x), "div": (lambda p: x / divisor, lambda p: p / (x.abs() + 1)),
    }
    hold = o2_policy.hold(mode)
    try:
        with torch.autocast("cpu", dtype=dtype):
            outside = F.group_norm(x, 3, gw, gb)
            with o2_policy.forward():
                group = F.group_norm(x, 3, gw, gb)
                native = torch.native_layer_norm(x, (8,), w, b, 1e-5)
                fp32_group = F.group_norm(x.float(), 3, gw, gb)
                ops = {name: (left(w), right(w)) for name, (left, right) in elementwise.items()}
    finally:
        hold.release()
    with torch.no_grad():
        half_w, half_b, half_gw, half_gb = (t.to(dtype) for t in (w, b, gw, gb))
        assert group.dtype == dtype and torch.equal(group, F.group_norm(x, 3, half_gw, half_gb))
        reference = torch.native_layer_norm(x, (8,), half_w, half_b, 1e-5)
        assert native[0].dtype == dtype
        for got, expected in zip(native, reference):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        assert fp32_group.dtype == torch.float32 and torch.equal(fp32_group, F.group_norm(x.float(), 3, gw, gb))
        xf = x.float()
        expected_ops = {name: tuple(t.to(dtype) for t in pair) for name, pair in {
            "add": (xf + w, w + xf), "sub": (xf - w, w - xf), "mul": (xf * w, w * xf),
            "div": (xf / divisor, w / (x.abs() + 1).float())}.items()}
        for name, results in ops.items():
            for got, expected in zip(results, expected_ops[name]):
                assert got.dtype == dtype and torch.equal(got, expected), name
    if mode == "cuda-lists-on-cpu":  # what O2 changes there: CUDA's autocast upcasts group_norm
        assert outside.dtype == torch.float32


def test_other_threads_are_untouched_while_o2_forward_is_entered(held):
    """A bf16-mixed forward on another thread, running while this thread is inside O2's forward, gets
    torch's autocast (fp32 promotion by a Parameter), then this thread still gets O2's."""
    w = nn.Parameter(torch.randn(8))
    x = torch.randn(8).to(BF16)
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def other():
        entered.wait(10)
        with torch.autocast("cpu", dtype=BF16):
            seen["other"] = ((x * w).dtype, o2_policy.active())
        checked.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.autocast("cpu", dtype=BF16), o2_policy.forward():
        entered.set()
        assert checked.wait(10)
        seen["mine"] = (x * w).dtype
    thread.join()
    assert seen == {"other": (torch.float32, False), "mine": BF16}


def test_a_shared_region_follows_the_threads_that_join_it(held):
    """Activation checkpointing recomputes forward on the autograd thread (CUDA): a thread that joins
    the region gets O2's rules until the region ends, whoever ends it."""
    shared = o2_policy.SharedForward()
    states = []

    def worker(step):
        if step == "join":
            shared.join()
        states.append(o2_policy.active())

    shared.enter()
    assert o2_policy.active()  # the entering thread joined
    for step in ("join", "check"):
        thread = threading.Thread(target=worker, args=(step,))
        thread.start()
        thread.join()
    shared.exit()
    assert not o2_policy.active()
    assert states == [True, False]  # a thread that never joined stays out


def test_the_last_release_leaves_torch_as_it_was_and_bad_modes_are_refused():
    _nothing_held()
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mul.Tensor", "AutocastCPU")
    first, second = o2_policy.hold(), o2_policy.hold()
    assert o2_policy.installs() == 2
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::mul.Tensor", "AutocastCPU")
    first.release()
    first.release()  # idempotent
    assert o2_policy.installs() == 1 and not first.held and second.held
    with pytest.raises(ValueError, match="installed in mode"):
        o2_policy.hold("cuda-lists-on-cpu")
    second.release()
    assert o2_policy.installs() == 0
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mul.Tensor", "AutocastCPU")
    with pytest.raises(ValueError, match="`mode` must be one of"):
        o2_policy.hold("cuda")


def _torch_lists():
    """{op name: policy} of torch's CUDA autocast lists (lower precision and fp32), read from the autocast header of
    the installed torch."""
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "autocast_mode.h")
    if not os.path.exists(header):
        pytest.skip("torch's headers are not installed")
    text = open(header).read()
    lists = {}
    for macro, policy in (("AT_FORALL_LOWER_PRECISION_FP", "lower_precision_fp"), ("AT_FORALL_FP32", "fp32"),
                          ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype")):
        body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body):
            lists[f"aten::{name}" + (f".{overload}" if overload else "")] = policy
    return lists


def test_the_table_matches_the_installed_torch():
    """Each kernel's torch policy on AutocastCUDA is torch's (its header lists; a fallthrough where torch
    registers none), and the CPU key is only given ops torch leaves alone there (their torch policy on
    the CPU is the fallthrough the kernel reproduces). Fails when a torch release moves an op."""
    _nothing_held()
    lists = _torch_lists()
    rows = o2_policy.table()
    assert len(rows) == len({name for name, *_ in rows}) > 40
    for name, rule, cuda_policy, on_cpu, cpu_policy in rows:
        cuda_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
        if cuda_policy == "fallthrough":
            assert not cuda_kernel and name not in lists, name
        else:
            assert cuda_kernel and lists.get(name) == cuda_policy, (name, lists.get(name), cuda_policy)
        if on_cpu:  # the kernel on the CPU key reproduces torch's own there
            cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")
            assert cpu_kernel == (cpu_policy != "fallthrough"), (name, cpu_policy)
            if cpu_policy == "lower_precision_fp":  # matmuls and convolutions: half on both keys (exact upcasts)
                assert rule == "half_inputs" and cuda_policy == "lower_precision_fp", name
            elif cpu_policy != "fallthrough":  # torch's CPU list: cat and stack run in the widest dtype
                assert cpu_policy == "promote" and name in ("aten::cat", "aten::stack"), name
    losses = [name for name, *_ in rows if "loss" in name or "nll" in name]
    assert [(name, rule) for name, rule, *_ in rows if name in losses] == [("aten::cross_entropy_loss", "to_fp32")]
    assert {name for name, rule, *_ in rows if rule.startswith("stream_")} == {
        "aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor", "aten::where.self",
        "aten::cat", "aten::stack"}
    assert {name for name, rule, *_ in rows if rule == "half_inputs"} == {
        f"aten::{op}" for op in ("linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "addbmm", "conv1d", "conv2d",
                                 "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
                                 "prelu")}
    names = {name for name, *_ in rows}
    for upcast_on_purpose in ("aten::nll_loss", "aten::mse_loss", "aten::cosine_similarity", "aten::logsumexp"):
        assert upcast_on_purpose in lists and upcast_on_purpose not in names  # torch's fp32 kernel stays


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_torchs_policy_outside_and_half_inside(held):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 6, 8, device="cuda", generator=g).half()
    w = nn.Parameter(torch.randn(8, device="cuda", generator=g))
    hold_free = {}
    hold = held
    hold.release()
    with torch.autocast("cuda", dtype=torch.float16):
        hold_free["ln"] = F.layer_norm(x, (8,), w)
        hold_free["sm"] = x.softmax(-1)
    again = o2_policy.hold()
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            ln, sm = F.layer_norm(x, (8,), w), x.softmax(-1)
            with o2_policy.forward():
                ln_o2, sm_o2, scaled = F.layer_norm(x, (8,), w), x.softmax(-1), x * w
    finally:
        again.release()
    assert torch.equal(ln, hold_free["ln"]) and torch.equal(sm, hold_free["sm"]) and ln.dtype == torch.float32
    assert ln_o2.dtype == sm_o2.dtype == scaled.dtype == torch.float16
    assert torch.equal(ln_o2, F.layer_norm(x, (8,), w.half()))



_HOLD = """
import warnings
from lightning_amp.amp.o2 import policy as o2_policy
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with o2_policy.held():
        pass
print(len(caught))
"""


@pytest.mark.slow
def test_holding_the_policy_shows_the_user_no_warning():
    """Registering kernels over torch's own may make torch warn (once per process: hence a fresh one); the policy
    filters that warning by its text (docs/architecture.md's inventory: torch 2.13 to 2.15 emit none), so a user
    of O2 sees no warning from it on any torch in range."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _HOLD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == 0 and "Overriding" not in proc.stderr, (proc.stdout, proc.stderr[-2000:])
