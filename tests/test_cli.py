"""`lightning-amp bench`: argument checking, the quick run's JSON and chart, the report's arithmetic."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_amp import cli
from lightning_amp.bench import RunSpec, compare, draw_chart, markdown_table
from lightning_amp.bench.chart import LEVEL_COLOURS
from lightning_amp.bench.memory import PeakMemory
from lightning_amp.bench.report import JSON_KEYS


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--models", "feedforward,resnet"], "unknown model resnet"),
        (["bench", "--levels", "O1,O4"], "unknown level O4"),
        (["bench", "--size", "huge"], "invalid choice: 'huge'"),
        (["bench", "--steps", "0"], "must be >= 1"),
        (["bench", "--steps", "-3"], "must be >= 1"),
        (["bench", "--steps", "ten"], "expected an integer"),
        (["bench", "--dtype", "float64"], "invalid choice: 'float64'"),
        (["bench", "--models", ""], "unknown model"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_nonzero_with_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: lightning-amp" in err
    assert message in err


def test_console_script_rejects_bad_arguments():
    script = Path(sys.executable).with_name("lightning-amp")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_amp.cli"]
    result = subprocess.run(command + ["bench", "--models", "nope"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "usage:" in result.stderr and "unknown model nope" in result.stderr


def test_run_spec_refuses_bad_values():
    for kwargs, name in ((dict(model="resnet", level="O2"), "model"), (dict(model="bert", level="O5"), "level"),
                         (dict(model="bert", level="O2", size="xl"), "size"), (dict(model="bert", level="O2", steps=0), "steps"),
                         (dict(model="bert", level="O2", dtype="int8"), "dtype"), (dict(model="bert", level="O2", threads=0), "threads")):
        with pytest.raises(ValueError, match=name):
            RunSpec(**kwargs)


def _png_pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def _has_colour(pixels: np.ndarray, hex_colour: str) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return bool((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum() > 200)


def test_quick_bench_writes_valid_json_table_and_chart(tmp_path, capsys):
    out = tmp_path / "bench-out"
    assert cli.main(["bench", "--quick", "--accelerator", "cpu", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "bert" in printed

    records = json.loads((out / "bench.json").read_text())
    pairs = [(r["model"], r["level"]) for r in records]
    assert pairs == [(m, lv) for m in ("feedforward", "unet", "bert") for lv in ("fp32", "O1", "O2", "O3")]
    for record in records:
        assert set(JSON_KEYS) <= set(record), record
        assert "error" not in record, record
        assert record["device"] == "cpu" and record["steps"] == 3 and len(record["loss_curve"]) == 4
        assert record["dtype"] == ("float32" if record["level"] == "fp32" else "bfloat16")
        for key in ("step_time_ms", "samples_per_s", "peak_mem_mb", "final_loss"):
            assert math.isfinite(record[key]) and record[key] > 0, (key, record)
        assert record["samples_per_s"] == pytest.approx(record["batch_size"] / (record["step_time_ms"] / 1000))
        assert record["final_loss"] == pytest.approx(sum(record["loss_curve"][-5:]) / len(record["loss_curve"][-5:]))
    for model in ("feedforward", "unet", "bert"):
        first_losses = {r["level"]: r["loss_curve"][0] for r in records if r["model"] == model}
        for level in ("O1", "O2", "O3"):  # same weights and batch: the first loss differs only by rounding
            assert first_losses[level] == pytest.approx(first_losses["fp32"], rel=0.03), (model, first_losses)

    pixels = _png_pixels(out / "bench.png")
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 1200  # 3 model columns, 2 rows of bars
    for level in ("fp32", "O1", "O2", "O3"):
        assert _has_colour(pixels, LEVEL_COLOURS[level]), f"no {level} bars in the chart"
    table = (out / "bench.md").read_text()
    assert table.count("\n| ") == 13  # header + 12 rows


def _record(model, level, step_ms, mem, loss, batch=8):
    return {"model": model, "level": level, "dtype": "bfloat16", "device": "cpu", "steps": 5, "step_time_ms": step_ms,
            "samples_per_s": batch / step_ms * 1000, "peak_mem_mb": mem, "final_loss": loss, "loss_curve": [loss]}


def test_comparison_against_fp32_and_o0_baselines():
    records = [
        _record("bert", "fp32", 250.0, 1000.0, 0.50), _record("bert", "O2", 100.0, 650.0, 0.505),
        _record("unet", "O0", 90.0, 300.0, 1.2), _record("unet", "O1", 60.0, 330.0, 1.14),
        _record("feedforward", "O2", 5.0, 40.0, 0.3),
        {**_record("bert", "O3", 1.0, 1.0, 1.0), "error": "RuntimeError: boom"},
    ]
    by_key = {(c.record["model"], c.record["level"]): c for c in compare(records)}
    o2 = by_key["bert", "O2"]
    assert o2.speedup == pytest.approx(2.5) and o2.memory_ratio == pytest.approx(0.65)
    assert o2.loss_difference == pytest.approx(0.01)
    o1 = by_key["unet", "O1"]
    assert o1.speedup == pytest.approx(1.5) and o1.memory_ratio == pytest.approx(1.1)
    assert o1.loss_difference == pytest.approx(-0.05)
    assert by_key["feedforward", "O2"].speedup is None  # no baseline run
    assert by_key["bert", "O3"].speedup is None
    table = markdown_table(records)
    assert "2.50x" in table and "+1.00%" in table and "failed" in table


def test_chart_draws_two_bars_per_successful_run(tmp_path):
    records = [_record("bert", lv, t, m, 0.5) for lv, t, m in (("fp32", 300, 900), ("O1", 200, 950), ("O2", 120, 600))]
    records.append({**_record("unet", "fp32", 50, 100, 1.0)})
    records.append({**_record("unet", "O2", 1, 1, 1.0), "error": "boom"})
    path = tmp_path / "chart.png"
    assert draw_chart(records, str(path)) == 8
    pixels = _png_pixels(path)
    assert pixels.shape[1] > pixels.shape[0] and pixels[..., :3].std() > 0.05
    assert _has_colour(pixels, LEVEL_COLOURS["O2"]) and not _has_colour(pixels, LEVEL_COLOURS["O3"])
    with pytest.raises(ValueError, match="no successful run"):
        draw_chart([records[-1]], str(tmp_path / "empty.png"))


def test_peak_memory_sees_a_large_allocation():
    probe = PeakMemory("cpu")
    probe.start()
    block = torch.rand(64, 1024, 1024)  # 256 MiB, touched
    assert float(block[-1, -1, -1]) >= 0
    del block
    assert probe.peak_mib() > 200
    probe.start()
    assert probe.peak_mib() < 100  # the high-water mark was reset
    with pytest.raises(ValueError, match="device_type"):
        PeakMemory("tpu")


def test_info_reports_versions_and_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "cpu backend:" in out and "amx_bf16=" in out


def test_bench_json_is_strict_even_when_a_loss_diverged(tmp_path):
    from lightning_amp.bench import write_json

    record = {"model": "bert", "level": "O3", "final_loss": float("nan"), "loss_curve": [1.0, float("inf")]}
    path = tmp_path / "bench.json"
    write_json([record], str(path))
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))
    assert loaded[0]["final_loss"] is None and loaded[0]["loss_curve"] == [1.0, None]
