"""Checks of the multi-tensor operators on DTensors, run by tests/ops/test_ops_dtensor.py on a 1-rank mesh in the
test's process and on 2 gloo ranks by :mod:`support.scripts.dtensor`.

Each check draws fresh random full tensors (the same on every rank), shards them ``Shard(0)`` over the
mesh (uneven: 5 rows, and 1 row, which leaves rank 1 an empty shard), calls the op with the DTensors
(through DTensor's dispatch: ``ops.local_shards`` is made to fail) and compares with the op on the full
plain tensors (the eager C++ path): the elementwise results element for element, placements kept; the
reduced outputs after DTensor's reduction (``full_tensor()``).
"""
import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._ops._math_ops import _NormPartial
from torch.distributed.tensor.placement_types import Partial

from lightning_amp import ops
from lightning_amp.optimizers import FusedAdam, FusedLAMB, FusedSGD

SHAPES = [(5, 3), (1, 4), (7,), (6, 2)]
lamp = torch.ops.lightning_amp


@contextlib.contextmanager
def no_hand_unwrapping():
    """``ops.local_shards`` refused while the block runs: the compiled path must not unwrap by hand."""
    saved = ops.optim.local_shards

    def refuse(*lists):
        raise AssertionError("local_shards called: the DTensors were unwrapped by hand")

    ops.optim.local_shards = refuse
    try:
        yield
    finally:
        ops.optim.local_shards = saved


def _full(seed, dtype=torch.float32, positive=False, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    out = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return [(t.abs() + 0.1 if positive else t).to(dtype) for t in out]


def _shard(mesh, tensors, placements=None):
    placements = placements or [Shard(0)] * mesh.ndim
    return [distribute_tensor(t.clone(), mesh, placements) for t in tensors]


def _same(dtensors, plain, name, rtol=0.0, atol=0.0, placements=None):
    placements = tuple(placements) if placements is not None else None
    for i, (d, p) in enumerate(zip(dtensors, plain)):
        assert isinstance(d, DTensor), f"{name}[{i}] is no longer a DTensor"
        if placements is not None:
            assert d.placements == placements, f"{name}[{i}]: {d.placements}"
        torch.testing.assert_close(d.full_tensor(), p, rtol=rtol, atol=atol, msg=lambda m: f"{name}[{i}]: {m}")


def check_adam(mesh, amsgrad):
    seed = 10 + amsgrad
    params, grads = _full(seed), _full(seed + 100)
    m, v = _full(seed + 200), _full(seed + 300, positive=True)
    vmax = [t * 1.5 for t in v]
    copies = [p.bfloat16() for p in params]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adam_w_mode=not amsgrad,
              grad_scale=torch.tensor(4.0), found_inf=torch.zeros(()))
    plain = [[t.clone() for t in lst] for lst in (params, grads, m, v, vmax, copies)]
    psteps = [torch.full((), 3.0) for _ in params]
    ops.multi_tensor_adam(*plain[:4], psteps, max_exp_avg_sqs=plain[4] if amsgrad else None,
                          model_copies=plain[5], **kw)
    sharded = [_shard(mesh, lst) for lst in (params, grads, m, v, vmax, copies)]
    steps = [torch.full((), 3.0) for _ in params]
    with no_hand_unwrapping():
        ops.multi_tensor_adam(*sharded[:4], steps, max_exp_avg_sqs=sharded[4] if amsgrad else None,
                              model_copies=sharded[5], **kw)
    for name, d, p in zip(("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "model_copies"),
                          sharded, plain):
        _same(d, p, name, placements=[Shard(0)] * mesh.ndim)
    assert all(s.item() == 4.0 for s in steps)
    # found_inf set: nothing changes
    before = [d.full_tensor() for d in sharded[0]]
    ops.multi_tensor_adam(*sharded[:4], steps, lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, found_inf=torch.ones(()))
    _same(sharded[0], before, "params (skipped)")
    assert all(s.item() == 4.0 for s in steps)


def check_sgd(mesh):
    params, grads, bufs = _full(20), _full(21), _full(22)
    plain = [[t.clone() for t in lst] for lst in (params, grads, bufs)]
    kw = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3, nesterov=False, grad_scale=torch.tensor(2.0))
    ops.multi_tensor_sgd(*plain, **kw)
    sharded = [_shard(mesh, lst) for lst in (params, grads, bufs)]
    with no_hand_unwrapping():
        ops.multi_tensor_sgd(*sharded, **kw)
    for name, d, p in zip(("params", "grads", "momentum_buffers"), sharded, plain):
        _same(d, p, name, placements=[Shard(0)] * mesh.ndim)


def check_adadelta(mesh):
    params, grads, sq, acc = _full(30), _full(31), _full(32, positive=True), _full(33, positive=True)
    plain = [[t.clone() for t in lst] for lst in (params, grads, sq, acc)]
    kw = dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=1e-3)
    psteps = [torch.zeros(()) for _ in params]
    ops.multi_tensor_adadelta(*plain, psteps, **kw)
    sharded = [_shard(mesh, lst) for lst in (params, grads, sq, acc)]
    with no_hand_unwrapping():
        ops.multi_tensor_adadelta(*sharded, [torch.zeros(()) for _ in params], **kw)
    for name, d, p in zip(("params", "grads", "square_avgs", "acc_deltas"), sharded, plain):
        _same(d, p, name, placements=[Shard(0)] * mesh.ndim)


def check_lamb(mesh, weight_decay):
    """With the trust ratio (weight_decay) the two passes, DTensor all-reducing the squared norms between them:
    the result is that of the whole tensors."""
    params, grads, m, v = _full(40), _full(41), _full(42), _full(43, positive=True)
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=weight_decay,
              global_grad_norm=torch.tensor(3.0), max_grad_norm=1.0)
    plain = [[t.clone() for t in lst] for lst in (params, grads, m, v)]
    ops.multi_tensor_lamb(*plain, [torch.zeros(()) for _ in params], **kw)
    sharded = [_shard(mesh, lst) for lst in (params, grads, m, v)]
    with no_hand_unwrapping():
        ops.multi_tensor_lamb(*sharded, [torch.zeros(()) for _ in params], **kw)
    # the plain one-pass kernel and the two passes differ in rounding only (fp64 norms either way)
    for name, d, p in zip(("params", "grads", "exp_avgs", "exp_avg_sqs"), sharded, plain):
        _same(d, p, name, rtol=1e-6, atol=1e-7, placements=[Shard(0)] * mesh.ndim)


def check_lamb_one_pass_refuses_sharded_trust_ratio(mesh):
    params, grads, m, v = (_shard(mesh, _full(s)) for s in (50, 51, 52, 53))
    steps = [torch.zeros(()) for _ in params]
    before = [p.full_tensor() for p in params]
    try:
        lamp.multi_tensor_lamb(params, grads, m, v, steps, [], 1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True,
                               torch.tensor(1.0), 1.0, False, None, None)
    except NotImplementedError as e:
        assert "multi_tensor_lamb_moments" in str(e)
    else:
        raise AssertionError("the one-pass LAMB kernel stepped sharded params with local trust ratios")
    _same(params, before, "params (refused)")
    assert all(s.item() == 0 for s in steps)


def check_lamb_moments_partial(mesh):
    params, grads, m, v = _full(60), _full(61), _full(62), _full(63, positive=True)
    args = (0.9, 0.999, 1e-6, 0.01, True, True, True, torch.tensor(2.0), 1.0, None, None)
    plain = [[t.clone() for t in lst] for lst in (params, grads, m, v)]
    want = lamp.multi_tensor_lamb_moments(*plain, [torch.zeros(()) for _ in params], *args)
    sharded = [_shard(mesh, lst) for lst in (params, grads, m, v)]
    got = lamp.multi_tensor_lamb_moments(*sharded, [torch.zeros(()) for _ in params], *args)
    assert isinstance(got, DTensor) and got.placements == (Partial("sum"),) * mesh.ndim, got
    torch.testing.assert_close(got.full_tensor(), want, rtol=1e-6, atol=0)  # fp32 sums of the shards, then over the ranks: another order
    _same(sharded[2], plain[2], "exp_avgs", placements=[Shard(0)] * mesh.ndim)


def check_l2norm(mesh):
    tensors = _full(70)
    want_total, want_each = ops.multi_tensor_l2norm(tensors, per_tensor=True)
    sharded = _shard(mesh, tensors)
    total, each = ops.multi_tensor_l2norm(sharded, per_tensor=True)
    for out in (total, each):
        assert isinstance(out, DTensor) and out.placements == (_NormPartial(2),) * mesh.ndim, out
    torch.testing.assert_close(total.full_tensor(), want_total, rtol=1e-6, atol=0)
    torch.testing.assert_close(each.full_tensor(), want_each, rtol=1e-6, atol=0)
    replicated = _shard(mesh, tensors, [Replicate()] * mesh.ndim)  # nothing to reduce
    total, _ = ops.multi_tensor_l2norm(replicated)
    assert total.placements == (Replicate(),) * mesh.ndim
    torch.testing.assert_close(total.to_local(), want_total, rtol=1e-6, atol=0)


def check_scale_and_check_finite(mesh):
    src = _full(80)
    src[0][4, 1] = float("inf")  # the last row: rank 1's shard on 2 ranks
    plain_dst = [torch.zeros_like(t) for t in src]
    want_found, want_flags = ops.multi_tensor_scale(src, plain_dst, 0.5, per_tensor=True)
    sharded, dst = _shard(mesh, src), _shard(mesh, [torch.zeros_like(t) for t in src])
    found, flags = ops.multi_tensor_scale(sharded, dst, 0.5, per_tensor=True)
    _same(dst, plain_dst, "dst", placements=[Shard(0)] * mesh.ndim)
    assert flags.placements == (Partial("max"),) * mesh.ndim
    torch.testing.assert_close(flags.full_tensor(), want_flags)  # whole-tensor flags after DTensor's max
    local_inf = any(not torch.isfinite(t.to_local()).all() for t in sharded)
    assert found.item() == float(local_inf)  # found_inf: this rank's flag, as without DTensors
    assert want_found.item() == 1.0
    flag = torch.zeros(())
    ops.multi_tensor_check_finite(sharded, flag)
    assert flag.item() == float(local_inf)


def check_read_only_lists_are_redistributed_written_ones_refused(mesh):
    params, grads = _full(90), _full(91)
    plain = [t.clone() for t in params]
    ops.multi_tensor_sgd(plain, [g.clone() for g in grads], None, lr=0.1)
    sharded = _shard(mesh, params)
    with no_hand_unwrapping():  # replicated grads: DTensor hands each rank its rows
        ops.multi_tensor_sgd(sharded, _shard(mesh, grads, [Replicate()] * mesh.ndim), None, lr=0.1)
    _same(sharded, plain, "params", placements=[Shard(0)] * mesh.ndim)
    bufs = _shard(mesh, _full(92), [Replicate()] * mesh.ndim)  # written: must have the params' placements
    try:
        ops.multi_tensor_sgd(sharded, _shard(mesh, grads), bufs, lr=0.1, momentum=0.9)
    except RuntimeError as e:  # DTensor wraps the strategy's ValueError
        assert "momentum_buffers[0]" in str(e) and "must have the placements of params[0]" in str(e), e
    else:
        raise AssertionError("a written list with other placements than the params was accepted")
    partial = [DTensor.from_local(t.clone(), mesh, [Partial("sum")] * mesh.ndim) for t in params]
    try:
        ops.multi_tensor_sgd(partial, [DTensor.from_local(g, mesh, [Partial("sum")] * mesh.ndim) for g in grads],
                             None, lr=0.1)
    except NotImplementedError as e:
        assert "is Partial" in str(e), e
    else:
        raise AssertionError("Partial params were stepped")


def check_elementwise_across_meshes(mesh):
    """FSDP2 over a tensor-parallel model puts some params on a 2-D mesh and others on the data-parallel one:
    the elementwise ops take each element on its own mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world = mesh.size()
    other = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    params, grads, bufs = _full(95), _full(96), _full(97)
    plain = [[t.clone() for t in lst] for lst in (params, grads, bufs)]
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    ops.multi_tensor_sgd(*plain, **kw)
    two_d = [Replicate(), Shard(0)]
    sharded = [[distribute_tensor(t.clone(), mesh, [Shard(0)]) if i < 2 else distribute_tensor(t.clone(), other, two_d)
                for i, t in enumerate(lst)] for lst in (params, grads, bufs)]
    with no_hand_unwrapping():
        ops.multi_tensor_sgd(*sharded, **kw)
    for name, d, p in zip(("params", "grads", "momentum_buffers"), sharded, plain):
        _same(d[:2], p[:2], name, placements=[Shard(0)])
        _same(d[2:], p[2:], name, placements=two_d)


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 5))
    model.register_parameter("gain", nn.Parameter(torch.randn(1, 5)))  # one row: rank 1's shard is empty
    return model


def check_fused_optimizer_on_fully_shard(mesh, name):
    """3 steps of a Fused optimizer on a ``fully_shard`` model equal those on the unsharded model (every rank
    sees the same batch, so FSDP2's averaged grads are the unsharded model's)."""
    from torch.distributed.fsdp import fully_shard

    make = {"FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
            "FusedSGD": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
            "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)}[name]
    sharded, plain = _model(), _model()
    fully_shard(sharded, mesh=mesh)
    opt, ref = make(list(sharded.parameters())), make(list(plain.parameters()))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen)
        for model, optimizer in ((sharded, opt), (plain, ref)):
            (model(x) * model.gain).square().mean().backward()
            if model is sharded:
                with no_hand_unwrapping():
                    optimizer.step()
            else:
                optimizer.step()
            optimizer.zero_grad()
    for (key, a), b in zip(sharded.named_parameters(), plain.parameters()):
        assert isinstance(a, DTensor) and a.placements == (Shard(0),), key
        torch.testing.assert_close(a.full_tensor(), b.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    for p in sharded.parameters():
        for key, value in opt.state[p].items():
            if key != "step":
                assert isinstance(value, DTensor) and value.placements == p.placements, (name, key)


def check_fused_lamb_on_the_fallback(mesh):
    """Without the compiled kernels the fallback steps the local shards and DTensor reduces its squared norms."""
    saved, ops._ext._EXT = ops._ext._EXT, None
    saved_guard = globals()["no_hand_unwrapping"]
    globals()["no_hand_unwrapping"] = contextlib.nullcontext  # the fallback unwraps by design
    try:
        check_fused_optimizer_on_fully_shard(mesh, "FusedLAMB")
    finally:
        ops._ext._EXT = saved
        globals()["no_hand_unwrapping"] = saved_guard


def check_all(mesh) -> list:
    """Run every check on ``mesh`` (all ranks together); the names of those that passed.

    Our kernels serve both sides (``_choice.forced``): a DTensor's local shards always take ours, and a check
    compares the sharding, not our kernel against torch's (which may differ from ours in the last bit)."""
    from lightning_amp.ops import _choice

    saved, _choice.forced = _choice.forced, _choice.OURS
    try:
        return _check_all(mesh)
    finally:
        _choice.forced = saved


def _check_all(mesh) -> list:
    done = []
    for name, check in [
        ("adam", lambda: check_adam(mesh, amsgrad=False)), ("adam amsgrad", lambda: check_adam(mesh, amsgrad=True)),
        ("sgd", lambda: check_sgd(mesh)), ("adadelta", lambda: check_adadelta(mesh)),
        ("lamb trust ratio", lambda: check_lamb(mesh, 0.01)), ("lamb no trust ratio", lambda: check_lamb(mesh, 0.0)),
        ("lamb one pass refused", lambda: check_lamb_one_pass_refuses_sharded_trust_ratio(mesh)),
        ("lamb moments partial", lambda: check_lamb_moments_partial(mesh)),
        ("l2norm", lambda: check_l2norm(mesh)), ("scale and check_finite", lambda: check_scale_and_check_finite(mesh)),
        ("placements", lambda: check_read_only_lists_are_redistributed_written_ones_refused(mesh)),
        ("across meshes", lambda: check_elementwise_across_meshes(mesh)),
        ("FusedAdam", lambda: check_fused_optimizer_on_fully_shard(mesh, "FusedAdam")),
        ("FusedSGD", lambda: check_fused_optimizer_on_fully_shard(mesh, "FusedSGD")),
        ("FusedLAMB", lambda: check_fused_optimizer_on_fully_shard(mesh, "FusedLAMB")),
        ("FusedLAMB fallback", lambda: check_fused_lamb_on_the_fallback(mesh)),
    ]:
        with torch.no_grad() if not name.startswith("Fused") else contextlib.nullcontext():
            check()
        done.append(name)
    return done


CHECKS = ["adam", "adam amsgrad", "sgd", "adadelta", "lamb trust ratio", "lamb no trust ratio",
          "lamb one pass refused", "lamb moments partial", "l2norm", "scale and check_finite", "placements",
          "across meshes", "FusedAdam", "FusedSGD", "FusedLAMB", "FusedLAMB fallback"]
