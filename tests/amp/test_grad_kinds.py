"""Every level trains what Lightning's own precisions train: sparse grads, complex params, torchmetrics
states, outputs of any container.

Each Trainer test runs the same user code under an opt level and under the Lightning precision it
stands for (O0: ``32-true``; O1, O2: ``bf16-mixed``; O3: ``bf16-true``, or ``bf16-mixed`` for complex
params, which ``bf16-true`` casts to bf16) on CPU and compares the weights after a few steps: within
10% of how far the reference moved them (L2), O2 (half weights in forward) also within the distance
between ``bf16-true`` and ``bf16-mixed``. O0, O1 and O3 reproduce their references exactly here.
bf16's loss scale is 1.0, so those runs cannot see whether sparse and complex grads are unscaled: the
float16 runs at O1 and O2 (dynamic scale, 65536 here) are held to ``32-true`` with torch SGD, which is
not scale-invariant (Adagrad, SparseAdam and AdamW nearly are), so a grad left scaled moves its param
65536x as far. The skipping tests run with overflow flags landing at once and late (``flag_timing``).
"""
import collections
import dataclasses
import functools
import math
import re
from typing import Any, Dict

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_amp import AmpPrecision
from lightning_amp.amp import grad_kinds
from lightning_amp.amp.grad_kinds import check_and_unscale_, check_finite
from lightning_amp.amp.module_cast import cast_floating

from support.trainer import quiet_lightning

torchmetrics = pytest.importorskip("torchmetrics")

LEVELS = ["O0", "O1", "O2", "O3"]
REFERENCE = {"O0": "32-true", "O1": "bf16-mixed", "O2": "bf16-mixed", "O3": "bf16-true"}
STEPS = 4


def _trainer(precision: str, steps: int = STEPS, dtype: str = "bfloat16", **kwargs: Any) -> L.Trainer:
    """A CPU Trainer for ``steps`` steps under an opt level ("O0".."O3" in ``dtype``) or a Lightning precision."""
    if precision in LEVELS:
        kwargs["plugins"] = [AmpPrecision(precision, dtype=dtype, **kwargs.pop("amp", {}))]
    else:
        kwargs["precision"] = precision
    return L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kwargs)


def _fit(model: L.LightningModule, precision: str, steps: int = STEPS, dtype: str = "bfloat16",
         **kwargs: Any) -> L.Trainer:
    trainer = _trainer(precision, steps, dtype, **kwargs)
    with quiet_lightning():
        trainer.fit(model)
    return trainer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Tensor]:
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"state{i}/{k}": v.clone() for k, v in state.items() if isinstance(v, Tensor)})
    return out


class _Snapshots(L.Callback):
    """Params and optimizer state after every training batch."""

    def __init__(self) -> None:
        self.after = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(_snapshot(pl_module, trainer.optimizers[0]))


class _Inf(L.Callback):
    """Writes inf into one value of ``param_name``'s grad after the backward of batch ``at``."""

    def __init__(self, param_name: str, at: int) -> None:
        self.param_name, self.at = param_name, at

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.at:
            grad = dict(pl_module.named_parameters())[self.param_name].grad
            values = grad._values() if grad.is_sparse else torch.view_as_real(grad) if grad.is_complex() else grad
            values.view(-1)[-1] = math.inf


# ---- sparse grads ---------------------------------------------------------------------------------


class SparseNet(L.LightningModule):
    """A sparse embedding bag and a dense head; ``opt`` is torch SGD (momentum), Adagrad or SparseAdam."""

    def __init__(self, opt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.opt = opt
        self.emb = nn.Embedding(40, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        out = self.head(self.emb(idx).mean(1)).squeeze(-1).float()
        return ((out - y.float()) ** 2).mean()

    def configure_optimizers(self):
        if self.opt == "sparseadam":
            return torch.optim.SparseAdam(self.emb.parameters(), lr=0.05)
        if self.opt == "adagrad":
            return torch.optim.Adagrad(self.parameters(), lr=0.2)
        return torch.optim.SGD(self.parameters(), lr=1.0, momentum=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        idx, y = torch.randint(0, 40, (64, 6), generator=g), torch.randn(64, generator=g)
        return torch.utils.data.DataLoader(list(zip(idx, y)), batch_size=16)


@functools.lru_cache(maxsize=None)
def _reference(kind: str, opt: str, precision: str) -> Dict[str, Tensor]:
    model = SparseNet(opt) if kind == "sparse" else ComplexNet(opt)
    _fit(model, precision)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_trains_like_reference(model: nn.Module, ref: Dict[str, Tensor], start: Dict[str, Tensor],
                                  trained=None, floor: Dict[str, Tensor] = None) -> None:
    """Each trained param ends within 10% of how far the reference moved it (L2 norms), or within
    ``floor[name]`` where that is larger."""
    for name, p in model.named_parameters():
        if trained is not None and name not in trained:
            continue
        moved = torch.linalg.vector_norm(ref[name] - start[name])
        assert moved > 1e-3, f"{name} did not train in the reference"
        diff = torch.linalg.vector_norm(p.detach().to(ref[name].dtype) - ref[name])
        tol = max(0.1 * moved, floor[name]) if floor else 0.1 * moved
        assert diff <= tol, f"{name}: {diff} from the reference (training moved it {moved}, tolerance {tol})"


def _cells(opts):
    for level in LEVELS:
        for opt in opts:
            yield pytest.param(level, opt, id=f"{level}-{opt}")


@pytest.mark.parametrize("level,opt", list(_cells(["sgd", "adagrad", "sparseadam"])))
def test_sparse_grads_train_like_lightning(level, opt):
    model = SparseNet(opt)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _fit(model, level)
    assert model.emb.weight.layout == torch.strided
    trained = ["emb.weight"] if opt == "sparseadam" else None  # the head is not in SparseAdam
    ref, floor = _reference("sparse", opt, REFERENCE[level]), None
    if level == "O2":  # half weights in forward, fp32 updates: no further from bf16-mixed than bf16-true is
        true = _reference("sparse", opt, "bf16-true")
        floor = {n: torch.linalg.vector_norm(true[n].to(ref[n].dtype) - ref[n]) for n in ref}
    _assert_trains_like_reference(model, ref, start, trained, floor)


FP16_SCALE = 2.0**16  # AmpPrecision's init_scale


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("kind", ["sparse", "complex"])
def test_fp16_scale_is_divided_out_of_sparse_and_complex_grads(kind, level, flag_timing):
    """O3 is left out: float16 params stepped directly (torch's sparse SGD has no Half kernel on the
    CPU; AdamW's eps is 0 in float16, which the engine warns of) with a static scale of 1.0."""
    model = SparseNet("sgd") if kind == "sparse" else ComplexNet("sgd")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _fit(model, level, dtype="float16")
    plugin = trainer.precision_plugin
    assert plugin.properties.dtype == torch.float16 and plugin.skipped_steps == 0
    assert plugin.loss_scale == FP16_SCALE  # a real scale rode on every grad
    assert {p.dtype for p in model.parameters()} <= {torch.float32, torch.complex64}  # O1/O2 step fp32 params
    _assert_trains_like_reference(model, _reference(kind, "sgd", "32-true"), start)


def _skip_cells():
    for level in LEVELS:
        yield pytest.param(level, "bfloat16", id=f"{level}-bf16")
    for level in ("O1", "O2"):
        yield pytest.param(level, "float16", id=f"{level}-fp16")


@pytest.mark.parametrize("level,dtype", list(_skip_cells()))
def test_overflow_in_a_sparse_grad_skips_the_step(level, dtype, flag_timing):
    model, snaps = SparseNet("adagrad"), _Snapshots()
    trainer = _fit(model, level, dtype=dtype, callbacks=[snaps, _Inf("emb.weight", 2)])
    assert trainer.precision_plugin.skipped_steps == 1
    assert trainer.precision_plugin.last_nonfinite_params == ["emb.weight"]  # named from that step's grads
    assert trainer.precision_plugin.loss_scale == (FP16_SCALE / 2 if dtype == "float16" else 1.0)
    before, skipped, after = snaps.after[1], snaps.after[2], snaps.after[3]
    assert before.keys() == skipped.keys()
    for key in before:
        assert torch.equal(before[key], skipped[key]), f"{key} changed on the skipped step"
    assert not torch.equal(skipped["param/emb.weight"], after["param/emb.weight"]), "training did not resume"


# ---- complex params -------------------------------------------------------------------------------


class ComplexNet(L.LightningModule):
    """A real Linear feeding a complex64 gain, trained by torch AdamW (or SGD with momentum: ``opt="sgd"``)."""

    def __init__(self, opt: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.opt = opt
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.randn(8, dtype=torch.complex64))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        z = self.lin(x).to(torch.complex64) * self.gain
        return ((z - 1j).abs() ** 2).mean().float()

    def configure_optimizers(self):
        if self.opt == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.5)
        return torch.optim.AdamW(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g)), batch_size=16)


@pytest.mark.parametrize("level", LEVELS)
def test_complex_params_train_like_lightning(level):
    model = ComplexNet()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    _fit(model, level)
    assert model.gain.dtype == torch.complex64  # never cast to half
    # bf16-true casts complex params to bf16 (dropping their imaginary part): O3 is held to bf16-mixed here
    reference = "bf16-mixed" if level == "O3" else REFERENCE[level]
    _assert_trains_like_reference(model, _reference("complex", "adamw", reference), start)


@pytest.mark.parametrize("level,dtype", list(_skip_cells()))
def test_overflow_in_a_complex_grad_skips_the_step(level, dtype, flag_timing):
    model, snaps = ComplexNet(), _Snapshots()
    trainer = _fit(model, level, dtype=dtype, callbacks=[snaps, _Inf("gain", 2)])
    assert trainer.precision_plugin.skipped_steps == 1
    assert trainer.precision_plugin.last_nonfinite_params == ["gain"]  # named from that step's grads
    assert trainer.precision_plugin.loss_scale == (FP16_SCALE / 2 if dtype == "float16" else 1.0)
    before, skipped = snaps.after[1], snaps.after[2]
    for key in before:
        assert torch.equal(before[key], skipped[key]), f"{key} changed on the skipped step"
    assert not torch.equal(skipped["param/gain"], snaps.after[3]["param/gain"]), "training did not resume"


# ---- the check/unscale of each kind ---------------------------------------------------------------


def test_check_and_unscale_every_kind_against_float64():
    torch.manual_seed(0)
    dense = torch.randn(5, 3)
    cplx = torch.randn(7, dtype=torch.complex64)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3, 3, 1]]), torch.randn(4, 2), (6, 2))  # not coalesced
    grads = [dense, cplx, sparse]
    expected = [g.to_dense().to(torch.complex128 if g.is_complex() else torch.float64) * 0.25 for g in grads]
    found = torch.zeros(())
    check_and_unscale_(grads, found, torch.tensor(0.25))
    assert found.item() == 0.0
    for g, e in zip(grads, expected):
        assert torch.allclose(g.to_dense().to(e.dtype), e, rtol=1e-6, atol=0)
    for i, grad in enumerate(grads):
        bad = [g.clone() for g in grads]
        target = bad[i]._values() if bad[i].is_sparse else torch.view_as_real(bad[i]) if bad[i].is_complex() else bad[i]
        target.view(-1)[-1] = math.nan
        found = torch.zeros(())
        check_and_unscale_(bad, found, torch.tensor(1.0))
        assert found.item() == 1.0, f"non-finite value in grad {i} ({grad.layout}, {grad.dtype}) not found"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])]


GRADS_SEED = 20261129


def unscale_atol(dtype: torch.dtype) -> float:
    """The absolute part of the unscaled grad's rounding bound: the fp32 product is rounded (0.5 ulp of fp32,
    relative) and then into the grad's dtype: 0.5 ulp of it relative while the result is normal, at most half the
    subnormal spacing (``tiny * eps / 2``, absolute) where it is subnormal: float16 subnormals start below
    6.1e-5, which a grad of 1e-2 times 3/1024 reaches."""
    info = torch.finfo(dtype)
    return info.tiny * info.eps / 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("route_bf16_ours", [False, True], ids=["as-the-device-needs", "bf16-through-ours"])
def test_dense_grads_of_every_dtype_are_unscaled_against_float64(device, route_bf16_ours, monkeypatch):
    """float32, float16 and bfloat16 grads in one call (O3 with a loss scale: torch's CUDA kernel has
    no bfloat16): each unscaled to within its rounding of the fp64 product, the flag set by a
    non-finite value in any one of them, and on CUDA bf16 through ops.multi_tensor_check_finite +
    _foreach_mul_. On the CPU the bf16 route is forced too: both routes give torch's own bits."""
    if route_bf16_ours:
        monkeypatch.setattr(grad_kinds, "torch_unscale_takes", lambda t: t.dtype != torch.bfloat16)
    gen = torch.Generator().manual_seed(GRADS_SEED)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.bfloat16]
    grads = [(torch.randn(1000 + 7 * i, generator=gen) * 100).to(d).to(device) for i, d in enumerate(dtypes)]
    inv = torch.tensor(1 / 1024.0 * 3, device=device)  # not a power of two: every product rounds
    expected = [g.double() * inv.double() for g in grads]
    found = torch.zeros((), device=device)
    check_and_unscale_(grads, found, inv)
    assert found.item() == 0.0
    for g, e in zip(grads, expected):
        assert torch.allclose(g.double(), e, rtol=torch.finfo(g.dtype).eps, atol=unscale_atol(g.dtype)), g.dtype
    if device == "cpu":  # the forced route equals torch's op bit for bit
        ref = [g.clone() for g in grads]
        torch._amp_foreach_non_finite_check_and_unscale_(ref, torch.zeros(()), inv)
        check_and_unscale_(grads, torch.zeros(()), inv)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    for i in range(len(grads)):
        bad = [g.clone() for g in grads]
        bad[i][-1] = math.inf
        found = torch.zeros((), device=device)
        check_and_unscale_(bad, found, inv)
        assert found.item() == 1.0, f"inf in grad {i} ({dtypes[i]}) not found"


@pytest.mark.cuda
@CUDA
def test_torchs_cuda_unscale_still_lacks_bfloat16():
    """The reason bf16 CUDA grads take our route (docs/architecture.md, torch internals): the day torch's
    CUDA kernel takes bfloat16 this fails, and grad_kinds.torch_unscale_takes can say yes to it."""
    with pytest.raises(NotImplementedError, match="BFloat16"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(4, device="cuda", dtype=torch.bfloat16)],
                                                         torch.zeros((), device="cuda"),
                                                         torch.ones((), device="cuda"))


def test_half_sparse_grad_that_overflows_when_coalesced_is_found():
    # two finite fp16 values at one index sum to inf: what the optimizer would step with after coalescing
    grad = torch.sparse_coo_tensor(torch.tensor([[2, 2]]), torch.tensor([40000.0, 40000.0]), (4,)).half()
    found = torch.zeros(())
    check_and_unscale_([grad], found, torch.tensor(1.0))
    assert found.item() == 1.0


def test_check_finite_every_kind_reads_only():
    """The check before a step that unscales in its kernel (FusedAdam & co.): every kind's inf/nan is
    found, an fp16 sparse grad that overflows only when coalesced too, and no grad changes."""
    torch.manual_seed(0)
    grads = [torch.randn(5, 3).bfloat16(), torch.randn(7, dtype=torch.complex64),
             torch.sparse_coo_tensor(torch.tensor([[0, 3, 3, 1]]), torch.randn(4, 2), (6, 2))]
    found = torch.zeros(())
    check_finite(grads, found)
    assert found.item() == 0.0
    for i, grad in enumerate(grads):
        bad = [g.clone() for g in grads]
        target = bad[i]._values() if bad[i].is_sparse else torch.view_as_real(bad[i]) if bad[i].is_complex() else bad[i]
        target.view(-1)[-1] = math.inf
        before = [g.clone() for g in bad]
        found = torch.zeros(())
        check_finite(bad, found)
        assert found.item() == 1.0, f"non-finite value in grad {i} ({grad.layout}, {grad.dtype}) not found"
        assert all(torch.equal(a.to_dense(), b.to_dense()) for a, b in zip(bad, before))
    found = torch.zeros(())
    check_finite([torch.sparse_coo_tensor(torch.tensor([[2, 2]]), torch.tensor([40000.0, 40000.0]), (4,)).half()],
                 found)
    assert found.item() == 1.0


# ---- torchmetrics states --------------------------------------------------------------------------


class MetricNet(L.LightningModule):
    """Sums and averages integers from the batch with torchmetrics while training a Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 1)
        self.total = torchmetrics.SumMetric()
        self.mean = torchmetrics.MeanMetric()
        self.count = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        x, n = batch
        self.total.update(n.float())
        self.mean.update(n.float() + 0.25)
        self.count.update(torch.ones_like(n, dtype=torch.float32))
        self.log_dict({"total": self.total, "mean": self.mean, "count": self.count}, on_step=False, on_epoch=True)
        return self.lin(x).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        x, n = torch.randn(96, 4, generator=g), torch.randint(250, 1000, (96,), generator=g)
        return torch.utils.data.DataLoader(list(zip(x, n)), batch_size=32)


@pytest.mark.parametrize("level", LEVELS)
def test_metric_states_keep_their_dtype_and_log_exact_values(level):
    model = MetricNet()
    trainer = _fit(model, level, steps=3)
    n = torch.stack([n for _, n in model.train_dataloader().dataset]).double()
    for metric in (model.total, model.mean, model.count):
        assert all(getattr(metric, s).dtype == torch.float32 for s in metric._defaults), type(metric).__name__
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged["total"] == n.sum().item() and logged["count"] == 96.0  # integers, exact in fp32
    assert logged == _metric_reference()


@functools.lru_cache(maxsize=None)
def _metric_reference() -> Dict[str, float]:
    return {k: float(v) for k, v in _fit(MetricNet(), "32-true", steps=3).callback_metrics.items()}


# ---- outputs of any container ---------------------------------------------------------------------


class Meta:
    """A non-tensor field: must come back as the same object."""


@dataclasses.dataclass
class Out:
    logits: Tensor
    extras: Dict[str, Tensor]
    meta: Meta
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    hidden: Tensor
    ids: Tensor


class OutputNet(L.LightningModule):
    """Returns a dataclass, a frozen dataclass and a defaultdict from forward; records their dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.meta = Meta()
        self.seen = []

    def forward(self, x):
        h = self.lin(x)
        extra = collections.defaultdict(list, aux=h * 2)
        return Out(h, {"sq": h * h}, self.meta, steps=3), FrozenOut(h, torch.arange(3)), extra

    def training_step(self, batch, batch_idx):
        out, frozen, extra = self(batch[0])
        self.seen.append((out.logits.dtype, out.extras["sq"].dtype, frozen.hidden.dtype, frozen.ids.dtype,
                          extra["aux"].dtype, type(extra), out.meta is self.meta, out.steps))
        return out.logits.float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=16)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_dataclass_and_mapping_outputs_are_cast_back(level):
    model = OutputNet()
    _fit(model, level, steps=2, amp={"cast_model_outputs": torch.float32})
    f32 = torch.float32
    assert model.seen and all(s == (f32, f32, f32, torch.int64, f32, collections.defaultdict, True, 3)
                              for s in model.seen), model.seen


def test_model_output_of_a_transformers_model_is_cast_back():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).bfloat16()
    out = model(input_ids=torch.randint(0, 50, (2, 5)), labels=torch.tensor([0, 2]), output_hidden_states=True)
    cast = cast_floating(out, torch.float32)
    assert type(cast) is type(out) and list(cast.keys()) == list(out.keys())
    assert cast.logits.dtype == cast.loss.dtype == torch.float32 and cast["logits"] is cast.logits
    assert all(h.dtype == torch.float32 for h in cast.hidden_states) and isinstance(cast.hidden_states, tuple)
    assert torch.equal(cast.logits, out.logits.float()) and out.logits.dtype == torch.bfloat16  # input untouched


# ---- the kernel doors refuse these kinds -----------------------------------------------------------


def _ops_calls():
    from lightning_amp import ops

    r, z = (lambda: torch.randn(4, 8)), (lambda: torch.zeros(()))
    return {
        "multi_tensor_scale": ("src[0]", lambda t: ops.multi_tensor_scale([t], [r()], 0.5)),
        "multi_tensor_l2norm": ("tensors[1]", lambda t: ops.multi_tensor_l2norm([r(), t])),
        "multi_tensor_adam": ("grads[0]", lambda t: ops.multi_tensor_adam(
            [r()], [t], [r()], [r()], [z()], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)),
        "multi_tensor_sgd": ("grads[0]", lambda t: ops.multi_tensor_sgd(
            [r()], [t], None, lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, first_run=True)),
        "wgrad_gemm_accum_fp32": ("input", lambda t: ops.wgrad_gemm_accum_fp32(t, torch.randn(4, 5), torch.zeros(5, 8))),
    }


@pytest.mark.parametrize("kind", ["sparse", "complex"])
@pytest.mark.parametrize("op", ["multi_tensor_scale", "multi_tensor_l2norm", "multi_tensor_adam", "multi_tensor_sgd",
                                "wgrad_gemm_accum_fp32"])
def test_ops_refuse_sparse_and_complex_tensors_naming_the_argument(op, kind):
    name, call = _ops_calls()[op]
    call(torch.randn(4, 8))  # the unbroken call is valid
    bad = torch.randn(4, 8).to_sparse() if kind == "sparse" else torch.randn(4, 8, dtype=torch.complex64)
    with pytest.raises(TypeError, match=rf"{op}: .*{re.escape(name)}"):
        call(bad)


def test_kernel_step_leaves_sparse_grads_and_complex_params_to_the_optimizer():
    from lightning_amp.amp.kernel_step import KernelStep, supports

    torch.manual_seed(0)
    emb, lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    opt = torch.optim.SGD(list(lin.parameters()) + list(emb.parameters()), lr=0.1, momentum=0.9)
    kernel = KernelStep(opt)
    lin(torch.randn(2, 4)).sum().backward()
    assert kernel.usable()  # the plan is built while the embedding has no grad yet
    emb(torch.tensor([1, 2])).sum().backward()
    assert not kernel.usable() and not supports(opt)
    opt.step()  # its own step: a sparse momentum buffer
    emb.weight.grad = None
    assert not supports(opt)  # an embedding unused in some step leaves its sparse state to the optimizer too
    assert not supports(torch.optim.AdamW([nn.Parameter(torch.randn(3, dtype=torch.complex64))]))
