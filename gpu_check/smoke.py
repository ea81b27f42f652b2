"""CUDA correctness smoke, about a minute: ``make gpu-check``'s part ``smoke``.

    python -m gpu_check.smoke --json OUT [--device cuda|cpu] [--only NAME,NAME]

Each check (:data:`CHECKS`, in order) raises on a wrong result and returns a one-line detail:

- ``ops``: every compiled operator once on the device's tensors (fresh random inputs, a non-finite
  gradient for the flag-writing ones), against the same call on its pure-PyTorch fallback;
- ``o2_policy``: O2's kernels registered over autocast: off O2's per-thread switch each op's output equals
  torch's own autocast (exactly), on it the output is half;
- ``o2_stream``: one Trainer step of the headline model (``examples/bert_sentiment.py``, tiny) at O2 and at
  ``bf16-true`` under :mod:`lightning_amp.bench.stream`: every block's output half, no op promoting the half
  stream to fp32, saved activation bytes within 1.02x ``bf16-true``'s;
- ``trainer_levels``: O1/O2/O3 x (bf16, fp16 with a dynamic loss scale), a few Trainer steps on a tiny
  ``transformers`` BERT and on Lightning's demo Transformer: every step ran and every loss is finite;
- ``sync_debug``: O2 fp16 + FusedAdam steps under ``torch.cuda.set_sync_debug_mode("error")`` after two
  warm-up steps (CUDA only);
- ``tp_fused``: a ``tp_fused`` + O2 step on one device.

OUT gets ``{"device", "checks": [{"name", "ok", "seconds", "detail"}]}``, rewritten after every check. A
check that cannot run on the device (``sync_debug`` off CUDA) has ``ok`` None, which the verdict counts as
not passed. Exit status 1 when a check did not pass.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

LEVEL_DTYPES = (("O1", "bfloat16"), ("O1", "float16"), ("O2", "bfloat16"), ("O2", "float16"), ("O3", "bfloat16"),
                ("O3", "float16"))
STEPS = 4


class NotApplicable(Exception):
    """The check cannot run on this device."""


@contextlib.contextmanager
def fallback_ops():
    """The ops on their pure-PyTorch fallbacks (the extension switched off) inside the block."""
    from lightning_amp.ops import _ext

    saved, _ext._EXT = _ext._EXT, None
    try:
        yield
    finally:
        _ext._EXT = saved


def _compare(name: str, compiled: list, fallback: list, rtol: float, atol: float) -> None:
    for i, (a, b) in enumerate(zip(compiled, fallback)):
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{name} output {i}: {a.dtype}{tuple(a.shape)} vs fallback {b.dtype}{tuple(b.shape)}")
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{name} output {i} differs from the fallback: {m}")


def _both(name: str, make: Callable, call: Callable, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``call(inputs) -> outputs`` on ``make()`` with the compiled kernels and again on the fallback."""
    from lightning_amp import ops

    compiled_inputs = make()
    fallback_inputs = [[t.clone() for t in x] if isinstance(x, list) else x.clone() for x in compiled_inputs]
    device = next(t for x in compiled_inputs for t in (x if isinstance(x, list) else [x])).device
    if ops.backend(device.type) == "torch":
        raise AssertionError(f"{name}: no compiled kernels for {device.type} ({ops.extension_error()})")
    compiled = call(*compiled_inputs)
    with fallback_ops():
        fallback = call(*fallback_inputs)
    _compare(name, compiled, fallback, rtol, atol)


def check_ops(device: str) -> str:
    """Every compiled operator against its fallback on ``device``."""
    from lightning_amp import ops

    g = torch.Generator().manual_seed(0)
    shapes = ((1000,), (33, 17), (4096,))

    def rand(dtype=torch.float32, scale=1.0):
        return [(scale * torch.randn(s, generator=g)).to(device, dtype) for s in shapes]

    def flag():
        return torch.zeros((), device=device)

    def with_inf(tensors):
        tensors[1].view(-1)[3] = math.inf
        return tensors

    done = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        def scale(src, dst):
            found, each = ops.multi_tensor_scale(src, dst, 0.5, per_tensor=True)
            return dst + [found, each]
        _both(f"multi_tensor_scale {dtype}", lambda: [with_inf(rand(dtype)), rand()], scale)
        _both(f"multi_tensor_check_finite {dtype}", lambda: [with_inf(rand(dtype)), flag()],
              lambda t, f: [ops.multi_tensor_check_finite(t, f)])
        _both(f"multi_tensor_l2norm {dtype}", lambda: [rand(dtype)],
              lambda t: list(ops.multi_tensor_l2norm(t, per_tensor=True)), rtol=1e-4, atol=1e-5)
        done += ["scale", "check_finite", "l2norm"]

    def steps():
        return [torch.full((), 3.0, device=device) for _ in shapes]

    def adam(p, gr, m, v, s):
        ops.multi_tensor_adam(p, gr, m, v, s, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                              grad_scale=torch.full((), 4.0, device=device), found_inf=flag())
        return p + m + v
    _both("multi_tensor_adam", lambda: [rand(), rand(scale=4.0), rand(scale=0.1), [t.abs() for t in rand(scale=0.1)],
                                        steps()], adam)

    def sgd(p, gr, buf):
        ops.multi_tensor_sgd(p, gr, buf, lr=1e-2, momentum=0.9, weight_decay=1e-4, found_inf=flag())
        return p + buf
    _both("multi_tensor_sgd", lambda: [rand(), rand(), rand()], sgd)

    def adadelta(p, gr, sq, acc, s):
        ops.multi_tensor_adadelta(p, gr, sq, acc, s, lr=1.0, rho=0.9, eps=1e-6, weight_decay=1e-4, found_inf=flag())
        return p + sq + acc
    _both("multi_tensor_adadelta", lambda: [rand(), rand(), [t.abs() for t in rand()], [t.abs() for t in rand()],
                                            steps()], adadelta)

    def lamb(p, gr, m, v, s):
        norm, _ = ops.multi_tensor_l2norm(gr)
        ops.multi_tensor_lamb(p, gr, m, v, s, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01,
                              global_grad_norm=norm, found_inf=flag())
        return p + m + v
    _both("multi_tensor_lamb", lambda: [rand(), rand(), rand(scale=0.1), [t.abs() for t in rand(scale=0.1)], steps()],
          lamb, rtol=1e-4, atol=1e-5)
    done += ["adam", "sgd", "adadelta", "lamb"]

    for dtype in (torch.float16, torch.bfloat16):
        def wgrad(x, dy, main):
            ops.wgrad_gemm_accum_fp32(x, dy, main)
            return [main]
        _both(f"wgrad_gemm_accum_fp32 {dtype}",
              lambda: [torch.randn(64, 48, generator=g).to(device, dtype), torch.randn(64, 32, generator=g).to(device, dtype),
                       torch.randn(32, 48, generator=g).to(device)], wgrad, rtol=1e-4, atol=1e-4)

        def wgrad16(x, dy, main):
            ops.wgrad_gemm_accum_fp16(x, dy, main)
            return [main]
        _both(f"wgrad_gemm_accum_fp16 {dtype}",
              lambda: [torch.randn(64, 48, generator=g).to(device, dtype), torch.randn(64, 32, generator=g).to(device, dtype),
                       torch.randn(32, 48, generator=g).to(device, dtype)], wgrad16, rtol=1e-2, atol=1e-2)
    done += ["wgrad_fp32", "wgrad_fp16"]
    return f"{len(set(done))} operators equal to their fallbacks on {device} ({ops.backend(device)})"


def check_o2_policy(device: str) -> str:
    """O2's policy over autocast: torch's own result off the switch, half on it."""
    import torch.nn.functional as F

    from lightning_amp.amp.o2 import policy as o2_policy

    x = torch.randn(8, 64, device=device)
    weight, bias = torch.randn(64, device=device), torch.randn(64, device=device)
    ops = {"layer_norm": lambda t: F.layer_norm(t, (64,), weight, bias), "softmax": lambda t: torch.softmax(t, -1)}
    details = []
    for dtype in (torch.bfloat16, torch.float16):
        half = x.to(dtype)
        for name, op in ops.items():
            with torch.autocast(device, dtype=dtype):
                torch_own = op(half)
                with o2_policy.held():
                    off = op(half)
                    with o2_policy.forward():
                        on = op(half)
            if off.dtype != torch_own.dtype or not torch.equal(off, torch_own):
                raise AssertionError(f"{name} {dtype} off the switch: {off.dtype}, torch's autocast {torch_own.dtype}")
            if device == "cuda" and name == "layer_norm" and torch_own.dtype != torch.float32:
                raise AssertionError(f"torch's CUDA autocast ran layer_norm in {torch_own.dtype}: the check cannot "
                                     "tell O2's policy from torch's")
            if on.dtype != dtype:
                raise AssertionError(f"{name} {dtype} on the switch gave {on.dtype}, not half")
            details.append(f"{name} {str(dtype)[6:]}: torch {str(torch_own.dtype)[6:]}, O2 {str(on.dtype)[6:]}")
    if o2_policy.installs() != 0:
        raise AssertionError(f"{o2_policy.installs()} holds left after the check")
    return "; ".join(details)


def check_o2_stream(device: str) -> str:
    """The headline model's residual stream under O2: half in every block, no promotion, bf16-true's saved bytes."""
    from lightning_amp.bench.stream import stream_report

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import bert_sentiment

    _quiet()
    records = stream_report(lambda: bert_sentiment.build_example("tiny", batch_size=4).module,
                            [next(iter(bert_sentiment.build_example("tiny", batch_size=4).train_dataloader))],
                            levels=("bf16-true", "O2"), accelerator=device)
    o2, true = records["O2"], records["bf16-true"]
    ratio = o2.saved_activation_bytes / true.saved_activation_bytes
    detail = (f"{len(o2.block_dtypes)} blocks {'/'.join(sorted(set(o2.block_dtypes)))}, saved activations {ratio:.3f}x "
              f"bf16-true's, first promotion: {o2.first_promotion or 'none'}")
    if set(o2.block_dtypes) != {"bfloat16"} or o2.first_promotion is not None or ratio > 1.02:
        raise AssertionError(f"O2's stream is not half on the headline model: {detail}")
    return detail


def _quiet() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _bert_module():
    import lightning as L
    from transformers import BertConfig, BertForSequenceClassification

    class Bert(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = BertForSequenceClassification(BertConfig(
                vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=64, num_labels=2))
            self.losses = []

        def training_step(self, batch, batch_idx):
            tokens, labels = batch
            loss = self.model(input_ids=tokens, labels=labels).loss
            self.losses.append(loss.detach().float())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = [(torch.randint(0, 512, (8, 32)), torch.randint(0, 2, (8,))) for _ in range(STEPS)]
    return Bert(), data


def _demo_transformer_module():
    from lightning.pytorch.demos import LightningTransformer

    class Demo(LightningTransformer):
        def __init__(self):
            torch.manual_seed(0)
            super().__init__(vocab_size=512)
            self.losses = []

        def prepare_data(self):  # the demo would download WikiText2; the smoke trains on random tokens
            pass

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach().float())
            return loss

    data = [(torch.randint(0, 512, (4, 16)), torch.randint(0, 512, (4, 16))) for _ in range(STEPS)]
    return Demo(), data


MODELS = {"bert": _bert_module, "demo-transformer": _demo_transformer_module}


def _fit(device: str, module, data, plugin, callbacks=(), **trainer_kwargs):
    import lightning as L
    from torch.utils.data import DataLoader

    trainer = L.Trainer(accelerator=device, devices=1, max_steps=len(data), plugins=[plugin], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(module, DataLoader(data, batch_size=None))
    losses = torch.stack(module.losses).cpu() if module.losses else torch.zeros(0)
    if trainer.global_step != len(data) or len(losses) != len(data) or not torch.isfinite(losses).all():
        raise AssertionError(f"{trainer.global_step} of {len(data)} steps, losses {losses.tolist()}")
    return trainer, losses


def check_trainer_levels(device: str, levels=LEVEL_DTYPES, models=tuple(MODELS)) -> str:
    """O1-O3 x (bf16, fp16 with a dynamic scale): a few Trainer steps per model, every loss finite."""
    from lightning_amp import AmpPrecision

    _quiet()
    done = []
    for model in models:
        for level, dtype in levels:
            module, data = MODELS[model]()
            scale = {"loss_scale": "dynamic"} if dtype == "float16" else {}
            try:
                _fit(device, module, data, AmpPrecision(level, dtype=dtype, **scale))
            except Exception as error:
                raise AssertionError(f"{model} {level} {dtype}: {type(error).__name__}: {error}") from error
            done.append(f"{model} {level} {dtype}")
    return f"{len(done)} runs of {STEPS} steps, losses finite: " + ", ".join(done)


def check_sync_debug(device: str) -> str:
    """O2 fp16 + FusedAdam steps with ``set_sync_debug_mode("error")`` from the third step on."""
    import lightning as L

    from lightning_amp import AmpPrecision
    from lightning_amp.optimizers import FusedAdam

    if device != "cuda":
        raise NotApplicable("set_sync_debug_mode needs CUDA")
    _quiet()

    class Guard(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 2:
                torch.cuda.set_sync_debug_mode("error")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("default")

    module, data = _bert_module()
    module.configure_optimizers = lambda: FusedAdam(module.parameters(), lr=1e-3)
    try:
        trainer = _fit(device, module, data * 2, AmpPrecision("O2", dtype="float16", loss_scale="dynamic"),
                       callbacks=[Guard()])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return f"{trainer.global_step} steps, {trainer.global_step - 2} of them under sync debug mode 'error'"


def check_tp_fused(device: str) -> str:
    """A ``tp_fused`` + O2 (bf16) run of a few steps on one device."""
    import torch.distributed as dist

    from lightning_amp import AmpO2Precision

    _quiet()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    module, data = _demo_transformer_module()
    try:
        trainer, losses = _fit(device, module, data, AmpO2Precision(dtype="bfloat16"), strategy="tp_fused")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return f"{trainer.global_step} steps under {type(trainer.strategy).__name__}, last loss {losses[-1]:.3f}"


CHECKS = {"ops": check_ops, "o2_policy": check_o2_policy, "o2_stream": check_o2_stream,
          "trainer_levels": check_trainer_levels,
          "sync_debug": check_sync_debug, "tp_fused": check_tp_fused}


def run_checks(names, device: str, out: Path) -> list:
    """Run the checks ``names`` in :data:`CHECKS`' order on ``device``, rewriting ``out`` after each."""
    results = []
    for name in [n for n in CHECKS if n in names]:
        t0 = time.monotonic()
        try:
            ok, detail = True, CHECKS[name](device)
        except NotApplicable as reason:
            ok, detail = None, f"not run: {reason}"
        except Exception as error:  # noqa: BLE001 - a failed check is a result; the next one still runs
            traceback.print_exc()
            ok, detail = False, f"{type(error).__name__}: {error}"[:2000]
        results.append({"name": name, "ok": ok, "seconds": time.monotonic() - t0, "detail": detail})
        out.write_text(json.dumps({"device": device, "checks": results}, indent=1))
        print(f"{name:<16} {'ok' if ok else 'FAILED' if ok is False else 'not run'} "
              f"({results[-1]['seconds']:.1f} s): {detail}", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_check.smoke", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="file for the results")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated, from {','.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        parser.error(f"--only must name checks from {','.join(CHECKS)}; unknown: {','.join(unknown) or '(none given)'}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    results = run_checks(names, args.device, Path(args.json))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
