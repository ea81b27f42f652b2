"""O1 cast-list control: registrations, decorators, restoration, BCE refusal, threads."""
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_amp import (
    float_function,
    half_function,
    promote_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)
from lightning_amp.amp.casts import (
    UnsafeHalfOpError,
    active_cast,
    cpu_has_bf16_rnn,
    cast_context,
    patch_depth,
    registered_functions,
    unregister_function,
)

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def clean_registry():
    before = {(id(m), n) for m, n, _ in registered_functions()}
    yield
    for module, name, _ in registered_functions():
        if (id(module), name) not in before:
            unregister_function(module, name)
    assert patch_depth() == 0, "a test left a cast_context open"


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def fake_module():
    mod = types.ModuleType("fake_ops")

    def scale(x, factor):
        return x * factor

    def dtypes_of(tensors, named, plain):
        return [t.dtype for t in tensors], {k: v.dtype for k, v in named.items()}, plain

    mod.scale = scale
    mod.dtypes_of = dtypes_of
    return mod


def test_float_registration_only_inside_context():
    a, b = rand(5, 7), rand(7, 3)
    original = torch.matmul
    register_float_function(torch, "matmul")
    assert torch.matmul is original  # registering patches nothing
    with torch.autocast("cpu", dtype=BF16):
        assert torch.matmul(a, b).dtype == BF16
        with cast_context(BF16, "cpu"):
            assert torch.matmul is not original
            inside = torch.matmul(a, b)
        after = torch.matmul(a, b)
    assert torch.matmul is original
    assert inside.dtype == torch.float32 and after.dtype == BF16
    torch.testing.assert_close(inside, (a.double() @ b.double()).float())


def test_half_registration_casts_floats_and_disables_autocast():
    x, w, bias = rand(4, 9), rand(6, 9), rand(6)
    register_half_function(F, "linear")
    with cast_context(BF16, "cpu"):
        y = F.linear(x, w, bias)
        y16 = None
        with torch.autocast("cpu", dtype=BF16), cast_context(torch.float16, "cpu"):
            y16 = F.linear(x, w, bias)  # autocast alone would give bf16
    assert y.dtype == BF16 and y16.dtype == torch.float16
    assert torch.equal(y, F.linear(x.to(BF16), w.to(BF16), bias.to(BF16)))
    assert F.linear(x, w, bias).dtype == torch.float32


def test_half_registration_reaches_modules_and_keeps_gradients():
    layer = nn.Linear(9, 5)
    x = rand(3, 9)
    register_half_function(F, "linear")
    with cast_context(BF16, "cpu"):
        out = layer(x)  # nn.Linear.forward looks F.linear up at call time
    assert out.dtype == BF16
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad, torch.ones(5, 1) * x.sum(0), rtol=1e-2, atol=1e-2)


def test_policies_walk_lists_tuples_dicts_and_skip_non_floats():
    mod = fake_module()
    register_half_function(mod, "dtypes_of")
    tensors = (rand(2), torch.arange(3), rand(2, dtype=torch.float64))
    named = {"a": rand(3), "i": torch.ones(2, dtype=torch.int32)}
    with cast_context(torch.float16, "cpu"):
        got = mod.dtypes_of(tensors, named=named, plain=1.5)
    assert got == ([torch.float16, torch.int64, torch.float16], {"a": torch.float16, "i": torch.int32}, 1.5)
    assert mod.dtypes_of(tensors, named=named, plain=1.5)[0] == [torch.float32, torch.int64, torch.float64]


def test_float_policy_upcasts_only_lower_precision():
    mod = fake_module()
    register_float_function(mod, "dtypes_of")
    tensors = [rand(2, dtype=BF16), rand(2, dtype=torch.float16), rand(2, dtype=torch.float64)]
    with cast_context(BF16, "cpu"):
        got, _, _ = mod.dtypes_of(tensors, {}, None)
    assert got == [torch.float32, torch.float32, torch.float64]


def test_promote_registration_uses_widest_dtype():
    a, b = rand(3, 4, dtype=BF16), rand(4, 2)
    register_promote_function(torch, "mm")
    with pytest.raises(RuntimeError):
        torch.mm(a, b)  # mixed dtypes are refused without the policy
    with cast_context(BF16, "cpu"):
        out = torch.mm(a, b)
        with torch.autocast("cpu", dtype=BF16):
            out_autocast = torch.mm(a, b)  # autocast would have made it bf16
    assert out.dtype == torch.float32 and out_autocast.dtype == torch.float32
    assert torch.equal(out, a.float() @ b)
    with torch.autocast("cpu", dtype=BF16):
        assert torch.mm(a, b).dtype == BF16


def test_restored_after_exception():
    original = torch.matmul
    register_float_function(torch, "matmul")
    with pytest.raises(KeyError):
        with cast_context(BF16, "cpu"):
            assert torch.matmul is not original
            raise KeyError("boom")
    assert torch.matmul is original and patch_depth() == 0 and active_cast() is None
    assert F.binary_cross_entropy.__module__ == "torch.nn.functional"
    assert not hasattr(F.binary_cross_entropy, "__lightning_amp_policy__")


def test_inherited_and_static_attributes_are_restored_exactly():
    class Ops:
        @staticmethod
        def double(x):
            return x * 2

    raw = vars(Ops)["double"]
    assert "matmul" not in vars(torch.Tensor)  # inherited from the C base class
    register_float_function(torch.Tensor, "matmul")
    register_half_function(Ops, "double")
    a, b, x = rand(3, 3), rand(3, 3), rand(4)
    with torch.autocast("cpu", dtype=BF16), cast_context(BF16, "cpu"):
        assert a.matmul(b).dtype == torch.float32
        assert Ops.double(x).dtype == BF16 and Ops().double(x).dtype == BF16
    assert "matmul" not in vars(torch.Tensor)
    assert vars(Ops)["double"] is raw
    assert Ops.double(x).dtype == torch.float32


def test_decorators_apply_only_inside_context():
    @float_function
    def product(a, b):
        """doc kept"""
        return a @ b

    @half_function
    def halve(x):
        return x * 0.5

    @promote_function
    def mixed_mm(a, b):
        return torch.mm(a, b)

    assert product.__name__ == "product" and product.__doc__ == "doc kept"
    a, b, x = rand(4, 5), rand(5, 2), rand(6)
    with torch.autocast("cpu", dtype=BF16):
        assert product(a, b).dtype == BF16
        with cast_context(BF16, "cpu"):
            assert product(a, b).dtype == torch.float32
    assert halve(x).dtype == torch.float32
    with cast_context(torch.float16, "cpu"):
        assert halve(x).dtype == torch.float16
        assert torch.equal(halve(x), x.half() * 0.5)
        assert mixed_mm(a.to(BF16), b).dtype == torch.float32
    with pytest.raises(RuntimeError):
        mixed_mm(a.to(BF16), b)
    with pytest.raises(TypeError, match="`fn`"):
        half_function(3)


def test_nested_contexts_use_innermost_dtype():
    mod = fake_module()
    register_half_function(mod, "scale")
    x = rand(5)
    with cast_context(torch.float16, "cpu"):
        assert mod.scale(x, 2).dtype == torch.float16
        with cast_context(BF16, "cpu"):
            assert patch_depth() == 2 and active_cast() == (BF16, "cpu")
            assert mod.scale(x, 2).dtype == BF16
        assert patch_depth() == 1
        assert mod.scale(x, 2).dtype == torch.float16
    assert patch_depth() == 0 and mod.scale(x, 2).dtype == torch.float32


def test_registration_while_open_applies_from_next_opening():
    mod = fake_module()
    x = rand(3)
    with cast_context(BF16, "cpu"):
        register_half_function(mod, "scale")
        assert mod.scale(x, 3).dtype == torch.float32
    with cast_context(BF16, "cpu"):
        assert mod.scale(x, 3).dtype == BF16


def test_bce_refused_under_fp16_only():
    probs = torch.rand(8, 3, dtype=torch.float64).clamp(0.05, 0.95).float()
    target = torch.randint(0, 2, (8, 3)).float()
    reference = F.binary_cross_entropy(probs.double(), target.double()).float()
    with cast_context(torch.float16, "cpu"):
        with pytest.raises(UnsafeHalfOpError, match="BCEWithLogitsLoss"):
            F.binary_cross_entropy(probs, target)
        with pytest.raises(UnsafeHalfOpError, match="binary_cross_entropy_with_logits"):
            nn.BCELoss()(probs, target)
        logits = torch.logit(probs)
        torch.testing.assert_close(nn.BCEWithLogitsLoss()(logits, target), reference, rtol=1e-4, atol=1e-5)
    with cast_context(BF16, "cpu"):
        torch.testing.assert_close(nn.BCELoss()(probs, target), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(F.binary_cross_entropy(probs, target), reference, rtol=1e-5, atol=1e-6)


def test_explicit_registration_lifts_bce_refusal():
    probs = torch.rand(16, dtype=torch.float64).clamp(0.05, 0.95)
    target = torch.randint(0, 2, (16,)).double()
    register_float_function(F, "binary_cross_entropy")
    with cast_context(torch.float16, "cpu"):
        loss = nn.BCELoss()(probs.half(), target.half())
    assert loss.dtype == torch.float32
    reference = F.binary_cross_entropy(probs.half().double(), target)
    torch.testing.assert_close(loss.double(), reference, rtol=1e-5, atol=1e-6)


def test_bad_registrations_and_contexts():
    with pytest.raises(ValueError, match="`name`.*no_such_fn"):
        register_half_function(torch, "no_such_fn")
    with pytest.raises(ValueError, match="`name`.*not callable"):
        register_float_function(torch, "float32")
    with pytest.raises(ValueError, match="`name`"):
        register_promote_function(torch, 3)
    with pytest.raises(ValueError, match="`dtype`"):
        with cast_context(torch.int8, "cpu"):
            pass
    with pytest.raises(ValueError, match="`device_type`"):
        with cast_context(BF16, ""):
            pass
    assert patch_depth() == 0


def test_threads_enter_and_exit_concurrently():
    mod = fake_module()
    original = mod.scale
    register_half_function(mod, "scale")
    barrier = threading.Barrier(3)
    errors = []
    x = rand(17)

    def worker(dtype, rounds=200):
        try:
            barrier.wait()
            for _ in range(rounds):
                with cast_context(dtype, "cpu"):
                    got = mod.scale(x, 3).dtype
                    if got != dtype:
                        errors.append(f"{dtype}: got {got}")
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    def outsider(rounds=400):
        barrier.wait()
        for _ in range(rounds):  # no context in this thread: always the plain function
            if mod.scale(x, 3).dtype != torch.float32:
                errors.append("outsider saw a cast")

    threads = [threading.Thread(target=worker, args=(torch.float16,)), threading.Thread(target=worker, args=(BF16,)),
               threading.Thread(target=outsider)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    assert mod.scale is original and patch_depth() == 0


def _recurrent(kind):
    torch.manual_seed(0)
    if kind == "lstm":
        return nn.LSTM(6, 8, num_layers=2, batch_first=True)
    if kind == "gru":
        return nn.GRU(6, 8, batch_first=True)
    return nn.RNN(6, 8, nonlinearity=kind, batch_first=True)


@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh", "relu"])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_rnn_runs_in_fp32_under_cpu_fp16_autocast(kind, input_dtype):
    # oneDNN has no fp16 RNN: plain autocast fp16 sends nn.LSTM there and fails on the CPU
    rnn, x = _recurrent(kind), rand(3, 5, 6, dtype=input_dtype)
    reference, _ = rnn(x.float())
    with torch.autocast("cpu", dtype=torch.float16), cast_context(torch.float16, "cpu"):
        out, _ = rnn(x)
    assert out.dtype == torch.float32 and torch.equal(out, reference)  # exactly the fp32 computation
    out.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in rnn.parameters())
    assert "lstm" not in vars(torch._VF) and "gru" not in vars(torch._VF)  # unpatched again


def test_packed_lstm_runs_in_fp32_under_cpu_fp16_autocast():
    rnn, x = _recurrent("lstm"), rand(3, 5, 6)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 4, 2]), batch_first=True)
    reference, _ = rnn(packed)
    with torch.autocast("cpu", dtype=torch.float16), cast_context(torch.float16, "cpu"):
        out, (h, c) = rnn(packed)
    assert out.data.dtype == h.dtype == torch.float32 and torch.equal(out.data, reference.data)


def test_rnn_under_bf16_is_left_to_autocast_and_registrations_win():
    rnn, x = _recurrent("lstm"), rand(3, 5, 6)
    with torch.autocast("cpu", dtype=BF16), cast_context(BF16, "cpu"):
        out = rnn(x)[0]
    if cpu_has_bf16_rnn():
        assert out.dtype == BF16  # oneDNN has a bf16 LSTM here: autocast's choice stands
    else:  # e.g. an AVX2-only CPU: autocast's bf16 LSTM would fail, fp32 runs instead, exactly
        assert out.dtype == torch.float32 and torch.equal(out, rnn(x)[0])
    register_half_function(torch._VF, "lstm")  # replaces the fp32 default, like any registration
    with torch.autocast("cpu", dtype=torch.float16), cast_context(torch.float16, "cpu"):
        assert rnn(x)[0].dtype == torch.float16
