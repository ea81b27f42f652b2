"""The fused optimizers' cached step plan: reused only while the groups and grads allow it."""
import torch

from lightning_amp.optimizers import FusedAdam, FusedSGD


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.randn(shape, generator=gen).requires_grad_() for shape in ((9, 4), (4,), (3, 3))]
    return ps, [p.detach().clone().requires_grad_() for p in ps]


def test_cached_plan_follows_grads_and_groups_like_torch():
    for fused_cls, torch_cls, kwargs in ((FusedAdam, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
                                         (FusedSGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9))):
        ours, ref = _pair()
        opt, ref_opt = fused_cls(ours[:2], **kwargs), torch_cls(ref[:2], **kwargs)
        gen = torch.Generator().manual_seed(1)
        for i in range(8):
            if i == 4:  # a new group drops the plan; its params get state on their first step
                opt.add_param_group({"params": [ours[2]]})
                ref_opt.add_param_group({"params": [ref[2]]})
            for j, (p, q) in enumerate(zip(ours, ref)):
                missing = i == 2 and j == 1  # a param without grad at one step does not move
                p.grad = None if missing else torch.randn(p.shape, generator=gen)
                q.grad = None if missing else p.grad.clone()
            opt.step()
            ref_opt.step()
            assert (opt._plan is not None) == (i not in (0, 2, 4)), (fused_cls, i)  # built on full, clean steps
            for p, q in zip(ours, ref):
                # our kernel vs torch's step on the same grads: each step adds at most 2 n u (n = 16 roundings, as
                # tests/optimizers/test_optimizers.py's FP32_ROUNDINGS) of the param's and its grad's size, on any CPU
                # (FMA or not); a stale plan (a param stepped without its grad, a new group left out) moves ~lr = 1e-2
                size = max(q.abs().max(), 1.0)  # params ~1, grads N(0, 1)
                assert (p - q).abs().max() <= (i + 1) * 2 * 16 * 2.0 ** -24 * size, (fused_cls, i, (p - q).abs().max())
        before = [p.clone() for p in ours]
        opt.step(found_inf=torch.ones(()))  # the cached plan honours found_inf
        assert all(torch.equal(a, b) for a, b in zip(before, ours))


def test_kernel_step_and_fused_optimizers_share_one_plan_class():
    """KernelStep (a torch Adam stepped by the kernels) caches its lists in the same StepPlan as the fused
    optimizers: built on a step with complete state, reused while the groups keep their signature, rebuilt
    when a group changes (here: a new group)."""
    from lightning_amp.amp.kernel_step import KernelStep
    from lightning_amp.amp.step_plan import StepPlan

    ours, ref = _pair()
    opt, ref_opt = torch.optim.Adam(ours[:2], lr=1e-2), torch.optim.Adam(ref[:2], lr=1e-2)
    step = KernelStep(opt)
    assert isinstance(step.plan, StepPlan) and isinstance(FusedAdam(ours[:2]).step_plan, StepPlan)
    gen = torch.Generator().manual_seed(3)
    flag = lambda device: None  # noqa: E731  (no overflow)
    built = []
    for i in range(6):
        if i == 3:
            opt.add_param_group({"params": [ours[2]]})
            ref_opt.add_param_group({"params": [ref[2]]})
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        signature = step.plan.signature
        assert step.usable()
        built.append(step.plan.signature is not signature)
        step.step(flag)
        ref_opt.step()
        for p, q in zip(ours, ref):
            assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), (i, (p - q).abs().max())
    # step 0 builds (no state yet: the first step creates it, then drops the plan), step 1 rebuilds with
    # the state, step 2 reuses; the new group rebuilds (3: fresh state, 4: complete), step 5 reuses
    assert built == [True, True, False, True, True, False]
