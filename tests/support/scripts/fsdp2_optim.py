"""Standalone run for tests/precision/test_fsdp2.py: fused optimizers on FSDP2 params.

Usage: python -m support.scripts.fsdp2_optim OUT_DIR   (starts 2 gloo processes on CPU itself)

Every pair below trains two copies of one model, both sharded by FSDP2's ``fully_shard`` over 2
ranks, on the same data for STEPS steps: ours and torch's optimizer (FusedLAMB, which torch lacks,
against a LAMB written in torch ops on the same sharded model, whose whole-tensor norms DTensor computes,
and against FusedLAMB on an unsharded copy fed the global batch). The model has uneven shards (dim 0 of
5 over 2 ranks) and an empty one (dim 0 of 1). Rank 0 saves OUT_DIR/result.pt: per pair the largest
relative difference of the full params, whether ours kept DTensor state, the full optimizer state
that torch's distributed-checkpoint API gathered from both (``get_optimizer_state_dict``), and how many
LAMB updates of ours ran on the pure-PyTorch fallback instead of the compiled kernels.
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 10), nn.Tanh(), nn.Linear(10, 5))
    model.register_parameter("gain", nn.Parameter(torch.randn(1, 5)))  # one row: rank 1's shard is empty
    return model


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) * model.gain).square().mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + rank))


class TorchLAMB(torch.optim.Optimizer):
    """LAMB as FusedLAMB's defaults (apex semantics: global grad-norm clipping, bias correction, grad averaging,
    decoupled decay, trust ratio ``||p|| / ||u||``) in plain torch ops: on DTensor params every norm is that of
    the whole tensor by DTensor's own reductions. State as FusedLAMB's (``step`` a 0-dim fp32 tensor)."""

    def __init__(self, params, lr, weight_decay, max_grad_norm, betas=(0.9, 0.999), eps=1e-6):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, betas=betas,
                                      eps=eps))

    @staticmethod
    def _whole(t: torch.Tensor) -> float:
        return float(t.full_tensor() if hasattr(t, "full_tensor") else t)

    @torch.no_grad()
    def step(self):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        total = self._whole(sum(p.grad.square().sum() for p in params)) ** 0.5
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            clip = max(total / group["max_grad_norm"], 1.0)
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                g = p.grad / clip
                st["step"] += 1
                step = float(st["step"])
                st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_hat, v_hat = st["exp_avg"] / (1 - beta1**step), st["exp_avg_sq"] / (1 - beta2**step)
                update = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p
                p_norm, u_norm = self._whole(p.square().sum()) ** 0.5, self._whole(update.square().sum()) ** 0.5
                ratio = p_norm / u_norm if p_norm > 0 and u_norm > 0 else 1.0
                p.sub_(update, alpha=group["lr"] * ratio)


def _pairs():
    from lightning_amp.amp.kernel_step import KernelStep
    from lightning_amp.optimizers import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD

    def kernel_adamw(params):  # torch's AdamW stepped by the plugins' kernel driver (see _step)
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        optimizer.kernel = KernelStep(optimizer)
        return optimizer

    return {
        "FusedAdam(adamw)": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
                             lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), True),
        "FusedAdam(l2, amsgrad)": (lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=False, amsgrad=True),
                                   lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True), True),
        "FusedSGD": (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), True),
        "FusedAdadelta": (lambda ps: FusedAdadelta(ps, lr=1.0, weight_decay=1e-3),
                          lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=1e-3), True),
        "KernelStep(AdamW)": (kernel_adamw,
                              lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), True),
        "FusedLAMB": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05),
                      lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05), False),
        "FusedLAMB vs torch-op LAMB": (lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05),
                                       lambda ps: TorchLAMB(ps, lr=1e-2, weight_decay=0.1, max_grad_norm=0.05), True),
    }


def _step(optimizer) -> None:
    kernel = getattr(optimizer, "kernel", None)
    if kernel is None:
        optimizer.step()
    else:
        assert kernel.usable()
        kernel.step(lambda device: torch.zeros((), device=device))


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_amp import ops

    fallback = ops.optim._lamb_fallback
    counted = {"calls": 0}

    def counting_fallback(*args, **kwargs):
        counted["calls"] += 1
        return fallback(*args, **kwargs)

    ops.optim._lamb_fallback = counting_fallback
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    result = {}
    for name, (ours_cls, ref_cls, ref_sharded) in _pairs().items():
        ours, ref = _model(), _model()
        fully_shard(ours, mesh=mesh)
        if ref_sharded:
            fully_shard(ref, mesh=mesh)
        opt, ref_opt = ours_cls(list(ours.parameters())), ref_cls(list(ref.parameters()))
        fallback_calls = 0
        for step in range(STEPS):
            _loss(ours, _batch(step, rank)).backward()
            x = _batch(step, rank) if ref_sharded else torch.cat([_batch(step, r) for r in range(2)])
            _loss(ref, x).backward()
            counted["calls"] = 0
            _step(opt)
            fallback_calls += counted["calls"]
            _step(ref_opt)
            opt.zero_grad(), ref_opt.zero_grad()
        diffs = {}
        for (key, a), b in zip(ours.named_parameters(), ref.parameters()):
            a, b = a.full_tensor(), b.full_tensor() if isinstance(b, DTensor) else b
            diffs[key] = ((a - b).abs().max() / b.abs().max()).item()
        dtensor_state = all(isinstance(v, DTensor) for st in opt.state.values() for k, v in st.items() if k != "step")
        full = StateDictOptions(full_state_dict=True)
        state = get_optimizer_state_dict(ours, opt, options=full)["state"]
        ref_state = get_optimizer_state_dict(ref, ref_opt, options=full)["state"] if ref_sharded else None
        result[name] = {"diffs": diffs, "dtensor_state": dtensor_state, "state": state, "ref_state": ref_state,
                        "lamb_fallback_calls": fallback_calls}
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.barrier()  # every rank's traffic is done before either tears its gloo group down (see support.processes)
    dist.destroy_process_group()


if __name__ == "__main__":
    from support.processes import free_port

    mp.start_processes(_worker, args=(free_port(), sys.argv[1]), nprocs=2, start_method="spawn")
