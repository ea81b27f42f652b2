"""Standalone run for tests/test_fsdp2.py (not a test module itself): fused optimizers on FSDP2 params.

Usage: python fsdp2_optim_script.py OUT_DIR   (starts 2 gloo processes on CPU itself)

Every pair below trains two copies of one model, both sharded by FSDP2's ``fully_shard`` over 2
ranks, on the same data for STEPS steps: ours and torch's optimizer (FusedLAMB, which torch lacks,
against FusedLAMB on an unsharded copy fed the global batch). The model has uneven shards (dim 0 of
5 over 2 ranks) and an empty one (dim 0 of 1). Rank 0 saves OUT_DIR/result.pt: per pair the largest
relative difference of the full params, whether ours kept DTensor state, and the full optimizer state
that torch's distributed-checkpoint API gathered from both (``get_optimizer_state_dict``).
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
        for step in range(STEPS):
            _loss(ours, _batch(step, rank)).backward()
            x = _batch(step, rank) if ref_sharded else torch.cat([_batch(step, r) for r in range(2)])
            _loss(ref, x).backward()
            _step(opt), _step(ref_opt)
            opt.zero_grad(), ref_opt.zero_grad()
        diffs = {}
        for (key, a), b in zip(ours.named_parameters(), ref.parameters()):
            a, b = a.full_tensor(), b.full_tensor() if isinstance(b, DTensor) else b
            diffs[key] = ((a - b).abs().max() / b.abs().max()).item()
        dtensor_state = all(isinstance(v, DTensor) for st in opt.state.values() for k, v in st.items() if k != "step")
        full = StateDictOptions(full_state_dict=True)
        state = get_optimizer_state_dict(ours, opt, options=full)["state"]
        ref_state = get_optimizer_state_dict(ref, ref_opt, options=full)["state"] if ref_sharded else None
        result[name] = {"diffs": diffs, "dtensor_state": dtensor_state, "state": state, "ref_state": ref_state}
    if rank == 0:
        torch.save(result, os.path.join(out_dir, "result.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    from _net import free_port  # noqa: E402  (tests/ is this script's directory)

    mp.start_processes(_worker, args=(free_port(), sys.argv[1]), nprocs=2, start_method="spawn")
