"""The model a Trainer run hands back, at O1/O2/O3, against Lightning's own precisions.

After ``fit``/``validate``/``predict`` Lightning's precisions leave a plain ``nn.Module``: no hooks, so
``torch.jit.script`` (``to_torchscript``), ``torch.export``, deep copies and ``torch.save`` loaded
where lightning_amp is not installed all work, and a direct call gives what the checkpoint reloaded
into the plain model gives. Ours must too (:mod:`lightning_amp.amp.release`), and a second run with
the same plugin must prepare the model again. The model: tests/support/after_fit_model.py (BatchNorm, a
projection buffer, a tensor made inside forward, a torchmetrics metric).
"""
import copy
import subprocess
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ThroughputMonitor, throughput_monitor

from lightning_amp import AmpPrecision
from support.after_fit_model import AfterFitNet
from support.processes import TESTS
from support.trainer import quiet_lightning

# level -> (AmpPrecision kwargs, Lightning's counterpart)
LEVELS = {
    "O1": (dict(opt_level="O1"), "bf16-mixed"),
    "O2": (dict(opt_level="O2"), "bf16-mixed"),
    "O2-fp16": (dict(opt_level="O2", dtype="float16", loss_scale="dynamic"), "16-mixed"),
    "O3": (dict(opt_level="O3"), "bf16-true"),
    "O3-bn-fp32": (dict(opt_level="O3", keep_batchnorm_fp32=True), "bf16-true"),
}


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def _plugin(level):
    kwargs = dict(dtype="bfloat16", **LEVELS[level][0]) if "dtype" not in LEVELS[level][0] else LEVELS[level][0]
    return AmpPrecision(**kwargs)


def _trainer(precision, **kwargs):
    how = {"plugins": [precision]} if isinstance(precision, AmpPrecision) else {"precision": precision}
    options = dict(accelerator="cpu", max_steps=4, limit_val_batches=2, limit_predict_batches=2, logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, **how)
    return L.Trainer(**{**options, **kwargs})


def _model(precision):
    level = precision if isinstance(precision, str) else precision.properties.opt_level
    return AfterFitNet(fp32_gate=level not in ("O3", "bf16-true"))


def _fitted(precision):
    model = _model(precision)
    trainer = _trainer(precision)
    trainer.fit(model)
    return model, trainer


def _hooks(model):
    return {name: len(sub._forward_pre_hooks) + len(sub._forward_hooks)
            for name, sub in model.named_modules() if sub._forward_pre_hooks or sub._forward_hooks}


def _input(model):
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(3)).to(model.body[0].weight.dtype)


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O3-bn-fp32"])
def test_model_after_fit_scripts_exports_and_copies_like_lightnings(level):
    """Former O2: ``to_torchscript`` raised AttributeError ('functools.partial' object has no attribute
    '__name__': the output-cast hook), O3 with fp32 BatchNorm a RuntimeError (its hooks)."""
    reference, _ = _fitted(LEVELS[level][1])
    assert _hooks(reference) == {}
    model, _ = _fitted(_plugin(level))
    assert _hooks(model) == {}
    model.eval()
    x = _input(model)
    expected = model(x)
    for name, runnable in (("to_torchscript", model.to_torchscript()), ("jit.script", torch.jit.script(model)),
                           ("export", torch.export.export(model, (x,)).module()), ("deepcopy", copy.deepcopy(model))):
        torch.testing.assert_close(runnable(x), expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("level", ["O2", "O2-fp16", "O3", "O3-bn-fp32"])
def test_direct_call_after_fit_matches_the_checkpoint_in_a_plain_model(level, tmp_path):
    """O2 hands back its fp32 params *and* fp32 buffers, so calling the model equals calling the
    checkpoint reloaded into a plain fp32 model, bit for bit (as after ``bf16-mixed``); formerly the
    buffers stayed half and ``x @ proj`` raised a dtype error. O3 hands back the half model (as
    ``bf16-true``): it meets the fp32 reload to within the half rounding of the weights, as Lightning's does."""
    gaps = {}
    for precision in (LEVELS[level][1], _plugin(level)):
        model, trainer = _fitted(precision)
        path = tmp_path / f"{type(precision).__name__}.ckpt"
        trainer.save_checkpoint(path)
        plain = AfterFitNet.load_from_checkpoint(path).eval()
        model.eval()
        x = _input(model)
        gaps[precision if isinstance(precision, str) else level] = (model(x).float() - plain(x.float())).abs().max()
    if level.startswith("O2"):
        assert gaps[level] == 0
        assert gaps[LEVELS[level][1]] == 0
    else:  # Lightning's own gap (bf16 weights, bf16 compute) is ~4e-3 here; the outputs are O(1)
        assert gaps[level] <= 2 * gaps[LEVELS[level][1]] + 1e-3, gaps


_LOAD = """
import sys, torch
sys.modules["lightning_amp"] = None  # any unpickled reference to lightning_amp fails
sys.path.insert(0, sys.argv[1])  # tests/: support.after_fit_model, the model's module
for path in sys.argv[2:]:
    model = torch.load(path, weights_only=False).eval()
    x = torch.load(path + ".x")
    print(float((model(x) - torch.load(path + ".out")).abs().max()))
"""


@pytest.mark.slow
def test_saved_model_loads_where_lightning_amp_is_not_installed(tmp_path):
    """``torch.save(model)`` after fit, loaded by a process that cannot import lightning_amp, gives the
    same outputs. Formerly the pickle held our hooks and the metric's patched ``_apply``
    (ModuleNotFoundError on load) at O2 and O3."""
    paths = []
    for level in ("O2", "O3-bn-fp32"):
        model, _ = _fitted(_plugin(level))
        model.eval()
        x = _input(model)
        path = str(tmp_path / f"{level}.pt")
        torch.save(model, path)
        torch.save(x, path + ".x")
        torch.save(model(x).detach(), path + ".out")
        paths.append(path)
    result = subprocess.run([sys.executable, "-c", _LOAD, str(TESTS), *paths],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [float(line) for line in result.stdout.split()] == [0.0, 0.0]


def _moved_like(ours, reference, start, tol=0.1):
    """Each param of ``ours`` within ``tol`` of how far the reference's moved from ``start``."""
    for key, ref in reference.items():
        moved = (ref.detach() - start[key]).abs().max()
        assert (ours[key].detach() - ref.detach()).abs().max() <= tol * moved + 1e-6, key


def test_second_runs_with_the_same_plugin_prepare_the_model_again():
    """validate, predict and a second fit after fit, each with the same O2 plugin: the model is
    prepared again (the fp32 tensor made in forward reaches the half gate only through the
    input casts), trains like Lightning's ``bf16-mixed`` second fit, and is plain
    again after each run."""
    results = {}
    for precision in ("bf16-mixed", _plugin("O2")):
        model = _model(precision)
        start = {k: v.detach().float().clone() for k, v in model.named_parameters()}
        _trainer(precision).fit(model)
        trainer = _trainer(precision)
        val = trainer.validate(model, verbose=False)[0]["val_loss"]
        assert _hooks(model) == {}
        predictions = trainer.predict(model)
        assert _hooks(model) == {}
        trainer.fit(model)
        assert _hooks(model) == {}
        results[isinstance(precision, str)] = (dict(model.named_parameters()), val, predictions)
    (ours, our_val, our_pred), (ref, ref_val, ref_pred) = results[False], results[True]
    _moved_like(ours, ref, start)
    assert abs(our_val - ref_val) <= 0.02 * ref_val
    assert len(our_pred) == len(ref_pred) == 2 and our_pred[0].dtype == torch.float32


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_throughput_monitor_uses_the_peak_flops_of_the_compute_dtype(level, monkeypatch):
    """``ThroughputMonitor`` divides by the device's peak FLOP/s for the plugin's compute dtype. For
    plugins it does not know it took fp32's: the MFU logged under O1-O3 was against the fp32 peak (on
    an H100 SXM 15x too high, 2x with TF32 matmuls). Peaks are faked here (no GPU): what matters is the dtype asked for."""
    peaks = {torch.float32: 1e12, torch.bfloat16: 8e12}
    monkeypatch.setattr(throughput_monitor, "get_available_flops", lambda device, dtype: peaks[dtype])
    available = {}
    for precision in (LEVELS[level][1], _plugin(level)):
        monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch.shape[0])
        _trainer(precision, max_steps=1, callbacks=[monitor]).fit(_model(precision))
        available[isinstance(precision, str)] = monitor.available_flops
    assert available[False] == available[True] == 8e12
