"""O2's op policy against torch's autocast lists on one GPU: ``make gpu-check``'s part ``o2-forward``.

    python -m lightning_amp.bench.gpu_o2_forward --json OUT [--rounds 2] [--steps 100] [--accelerator cuda]

Trains ``lightning-amp bench``'s BERT-base run (:func:`lightning_amp.bench.worker.run`: seq 128, the GPU
batch of :data:`~lightning_amp.bench.models.MODELS`, batches on the device) at O2 with FusedAdam, each
run in a fresh process, the two forwards alternating ``rounds`` times:

- ``half``: the shipped O2 forward (``norm_policy="half"``): autocast with O2's op policy, norms,
  softmax and activations in the half dtype (:mod:`lightning_amp.amp.o2_policy`);
- ``fp32``: ``norm_policy="fp32"``: autocast with torch's lists, as ``bf16-mixed`` (on CUDA its fp32
  list runs ``layer_norm``, ``softmax``, ``sum``, ``pow``, ... in fp32).

OUT gets the worker's records, each with ``"o2_forward"`` set, rewritten after every run (a part that
times out keeps what it measured). The verdict (``o2_half_ops_vs_fp32_ops`` in
:mod:`~lightning_amp.bench.gpu_targets`) compares the medians of the two.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

FORWARDS = ("half", "fp32")


def use_forward(forward: str) -> None:
    """Make the O2 plugins built in this process default to ``norm_policy=forward`` (one of
    :data:`FORWARDS`; for the rest of the process)."""
    import lightning_amp
    from lightning_amp import precision

    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
    shipped = precision.AmpO2Plugin.__init__

    def init(self, **kwargs):
        kwargs.setdefault("norm_policy", forward)
        shipped(self, **kwargs)

    for cls in {precision.AmpO2Plugin, lightning_amp.AmpO2Plugin}:
        cls.__init__ = init


def run_one(forward: str, steps: Optional[int], accelerator: str) -> dict:
    """One O2 + FusedAdam BERT run in this process with the O2 forward ``forward`` (one of :data:`FORWARDS`)."""
    from lightning_amp.bench.runner import plan_runs
    from lightning_amp.bench.worker import run

    use_forward(forward)
    spec = plan_runs(["bert"], ["O2"], steps=steps, accelerator=accelerator, optimizer="fused-adam")[0]
    return dict(run(spec), o2_forward=forward)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_amp.bench.gpu_o2_forward",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="file for the records")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each forward, alternating (default: 2)")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run (default: 100)")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--child", choices=FORWARDS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be >= 1, got {args.rounds} and {args.steps}")
    if args.child:
        Path(args.json).write_text(json.dumps(run_one(args.child, args.steps, args.accelerator)))
        return 0
    records = []
    with tempfile.TemporaryDirectory(prefix="o2-forward-") as tmp:
        for round_ in range(args.rounds):
            for forward in FORWARDS:
                out = Path(tmp) / f"{forward}-{round_}.json"
                argv = [sys.executable, "-m", "lightning_amp.bench.gpu_o2_forward", "--child", forward, "--json",
                        str(out), "--steps", str(args.steps), "--accelerator", args.accelerator]
                done = subprocess.run(argv)
                record = json.loads(out.read_text()) if done.returncode == 0 and out.exists() else \
                    {"o2_forward": forward, "error": f"run exited with {done.returncode}"}
                records.append(record)
                Path(args.json).write_text(json.dumps(records, indent=1))
                print(f"O2 forward {forward:<8} round {round_}: "
                      f"{record.get('step_time_ms') or float('nan'):.2f} ms/step {record.get('error') or ''}", flush=True)
    return 0 if all(not r.get("error") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
