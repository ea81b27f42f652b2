"""AmpO2Plugin under Trainer(strategy="ddp", devices=2, accelerator="cpu") with gloo, real processes.

Rank 1 alone sees an inf gradient at one step (written after DDP's all-reduce): both ranks must skip
that step, back the scale off and stay bitwise identical. Gradient accumulation (2 micro-batches)
happens on the fp32 Parameters, and the grads of the no_sync micro-batch must still be averaged across
ranks (by DDP itself now): the 2-rank run must match a 1-process run that sees both ranks' samples in each batch.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).with_name("precision_ddp_script.py")


def _run(out_dir: Path, devices: int) -> None:
    env = dict(os.environ)
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["MASTER_ADDR"] = "127.0.0.1"
    # the ranks import this checkout's lightning_amp, not whichever one the environment has installed
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent)] + [p for p in [env.get("PYTHONPATH")] if p])
    with socket.socket() as sock:  # a free port for this run
        sock.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(sock.getsockname()[1])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out_dir), str(devices)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_ddp_inf_on_one_rank_skips_everywhere_and_accumulates_in_fp32(tmp_path, flag_timing):
    ddp_dir, single_dir = tmp_path / "ddp", tmp_path / "single"
    ddp_dir.mkdir()
    single_dir.mkdir()
    _run(ddp_dir, 2)
    sys.path.insert(0, str(SCRIPT.parent))
    import precision_ddp_script

    precision_ddp_script.main(str(single_dir), 1)  # the 1-process reference runs in this process
    rank0 = torch.load(ddp_dir / "rank0.pt")
    rank1 = torch.load(ddp_dir / "rank1.pt")
    single = torch.load(single_dir / "rank0.pt")

    for result in (rank0, rank1, single):
        assert result["skipped"] == 1
        assert result["scale"] == 2.0**9  # init 2**10, one backoff
    for a, b in zip(rank0["masters"], rank1["masters"]):
        assert torch.equal(a, b)
    assert all(m.dtype == torch.float32 for m in rank0["masters"])
    # one set of params: the optimizer steps the module's own fp32 Parameters
    assert all(torch.equal(m, h) for m, h in zip(rank0["masters"], rank0["halves"]))
    for a, b in zip(rank0["masters"], single["masters"]):
        assert torch.allclose(a, b, atol=2e-3, rtol=0), (a - b).abs().max()
