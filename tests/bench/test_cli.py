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

from lightning_amp import cli, ops
from lightning_amp.bench import RunSpec, compare, draw_chart, markdown_table
from lightning_amp.bench.chart import LEVEL_COLOURS
from lightning_amp.bench import memory as memory_module
from lightning_amp.bench import runner
from lightning_amp.bench.memory import METHODS, PeakMemory
from lightning_amp.bench.models import chance_loss
from lightning_amp.bench.report import JSON_KEYS
from lightning_amp.bench.timing import CudaClock, StepWindow


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--models", "feedforward,resnet"], "unknown model resnet"),
        (["bench", "--levels", "O1,O4"], "unknown level O4"),
        (["bench", "--size", "huge"], "invalid choice: 'huge'"),
        (["bench", "--steps", "0"], "must be >= 1"),
        (["bench", "--steps", "-3"], "must be >= 1"),
        (["bench", "--steps", "ten"], "expected an integer"),
        (["bench", "--dtype", "float64"], "unknown dtype 'float64'; choose from auto, float16 (fp16/half), bfloat16 (bf16)"),
        (["bench", "--levels", "fp32,32-false"], "unknown level 32-false"),
        (["bench", "--accelerator", "tpu"], "invalid choice: 'tpu'"),
        (["bench", "--batch-size", "0"], "must be >= 1"),
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
    if argv[:1] == ["bench"]:
        assert err.startswith("usage: lightning-amp bench ")


@pytest.mark.parametrize(
    "argv, command, message",
    [
        (["bench", "--levle", "O2"], "bench", "unrecognized arguments: --levle O2 (did you mean --levels?)"),
        (["bench", "--quick", "--batchsize=8"], "bench",
         "unrecognized arguments: --batchsize=8 (did you mean --batch-size?)"),
        (["bench", "--frobnicate"], "bench", "unrecognized arguments: --frobnicate"),
        (["info", "--verbose"], "info", "unrecognized arguments: --verbose"),
    ],
)
def test_a_bad_flag_prints_the_commands_usage_with_a_suggestion(argv, command, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: lightning-amp {command} ") and f"lightning-amp {command}: error: {message}\n" in err
    assert "did you mean" in message or "did you mean" not in err  # no suggestion when nothing is close


def test_names_are_case_insensitive():
    args = cli.build_parser().parse_args(["bench", "--levels", "o2,FP32,Bf16-Mixed,o2", "--models", "BERT",
                                          "--dtype", "BFloat16", "--accelerator", "CPU", "--size", "Tiny",
                                          "--optimizer", "Fused-Adam"])
    assert args.levels == ["O2", "fp32", "bf16-mixed"] and args.models == ["bert"]
    assert (args.dtype, args.accelerator, args.size, args.optimizer) == ("bfloat16", "cpu", "tiny", "fused-adam")


@pytest.mark.slow
def test_console_script_rejects_bad_arguments():
    script = Path(sys.executable).with_name("lightning-amp")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_amp.cli"]
    result = subprocess.run(command + ["bench", "--models", "nope"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "usage:" in result.stderr and "unknown model nope" in result.stderr


def test_run_spec_refuses_bad_values():
    for kwargs, name in ((dict(model="resnet", level="O2"), "model"), (dict(model="bert", level="O5"), "level"),
                         (dict(model="bert", level="O2", size="xl"), "size"), (dict(model="bert", level="O2", steps=0), "steps"),
                         (dict(model="bert", level="O2", dtype="int8"), "dtype"), (dict(model="bert", level="O2", threads=0), "threads"),
                         (dict(model="bert", level="O2", accelerator="gpu"), "accelerator"),
                         (dict(model="bert", level="O2", batch_size=0), "batch_size")):
        with pytest.raises(ValueError, match=name):
            RunSpec(**kwargs)


def _png_pixels(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def _has_colour(pixels: np.ndarray, hex_colour: str) -> bool:
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255.0
    return bool((np.abs(pixels[..., :3] - rgb).max(axis=-1) < 0.02).sum() > 200)


QUICK_LEVELS = ("fp32", "bf16-mixed", "bf16-true", "O2")


@pytest.mark.slow
def test_quick_bench_writes_valid_json_table_and_chart(tmp_path, capsys):
    out = tmp_path / "bench-out"
    argv = ["bench", "--quick", "--accelerator", "cpu", "--threads", "1", "--levels", ",".join(QUICK_LEVELS),
            "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "speed-up" in printed and "vs mixed" in printed and "bert" in printed
    caveat = "quick run (3 timed steps after 1 warm-up, tiny models): the figures are indicative only"
    assert "lightning-amp bench (quick run: indicative figures):" in printed and caveat in " ".join(printed.split())

    saved = json.loads((out / "bench.json").read_text())
    run, records = saved["run"], saved["records"]
    assert run["steps"] == {"feedforward": 3, "unet": 3, "bert": 3} and run["torch"] == torch.__version__
    assert run["commit"] and run["date"].endswith("UTC") and run["command"] == "lightning-amp " + " ".join(argv)
    assert "cores" in run["device"] and {"lightning", "backend", "cpu_bf16", "duration_s"} <= set(run)
    assert run["threads"] == {"feedforward": 1, "unet": 1, "bert": 1} and run["indicative"].startswith(caveat)
    pairs = [(r["model"], r["level"]) for r in records]
    assert pairs == [(m, lv) for m in ("feedforward", "unet", "bert") for lv in QUICK_LEVELS]
    for record in records:
        assert set(JSON_KEYS) <= set(record), record
        assert "error" not in record, record
        assert record["device"] == "cpu" and record["steps"] == 3 and len(record["loss_curve"]) == 4
        assert record["dtype"] == ("float32" if record["level"] == "fp32" else "bfloat16")
        assert record["peak_mem_method"] in METHODS and record["peak_mem_clamped"] in (True, False)
        assert record["optimizer"].split("(")[0] in ("AdamW", "Adam")  # what the examples configure
        assert record["stepped_by"] == ("lightning-amp kernels" if record["level"] == "O2" else "optimizer.step()")
        assert record["threads"] == 1
        assert record["precision_plugin"] == {"fp32": "Precision", "bf16-mixed": "MixedPrecision",
                                              "bf16-true": "HalfPrecision", "O2": "AmpO2Precision"}[record["level"]]
        for key in ("step_time_ms", "samples_per_s", "peak_mem_mb", "final_loss", "chance_loss"):
            assert math.isfinite(record[key]) and record[key] > 0, (key, record)
        assert record["samples_per_s"] == pytest.approx(record["batch_size"] / (record["step_time_ms"] / 1000))
        assert record["final_loss"] == pytest.approx(sum(record["loss_curve"][-5:]) / len(record["loss_curve"][-5:]))
        assert record["learned"] is False  # 4 steps learn nothing, and the table must say so
    for model in ("feedforward", "unet", "bert"):
        first_losses = {r["level"]: r["loss_curve"][0] for r in records if r["model"] == model}
        for level in QUICK_LEVELS[1:]:  # same weights and batch: the first loss differs only by rounding
            assert first_losses[level] == pytest.approx(first_losses["fp32"], rel=0.03), (model, first_losses)

    pixels = _png_pixels(out / "bench.png")
    assert pixels.shape[0] >= 1200 and pixels.shape[1] >= 1200  # 3 model columns, 6 rows of bars
    for level in QUICK_LEVELS:
        assert _has_colour(pixels, LEVEL_COLOURS[level]), f"no {level} bars in the chart"
    table = (out / "bench.md").read_text()
    assert table.count("\n| ") == 13  # header + 12 rows
    assert "(untrained)" in table and f"command: `lightning-amp {' '.join(argv[:-1])}" in table
    assert table.startswith("lightning-amp bench (quick run: indicative figures):") and f"Note: {caveat}" in table


def _record(model, level, step_ms, mem, loss, batch=8, learned=True):
    return {"model": model, "level": level, "dtype": "bfloat16", "device": "cpu", "steps": 5, "step_time_ms": step_ms,
            "samples_per_s": batch / step_ms * 1000, "peak_mem_mb": mem, "final_loss": loss, "loss_curve": [loss],
            "chance_loss": 0.69, "learned": learned, "optimizer": "AdamW(fused=None, foreach=None)"}


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
    assert "2.50x" in table and "+1.00%" in table and "failed" in table and "AdamW" in table
    assert "(untrained)" not in table


def test_comparison_against_lightning_mixed_and_untrained_baseline():
    records = [
        _record("bert", "32-true", 300.0, 1200.0, 0.68, learned=False), _record("bert", "bf16-mixed", 200.0, 800.0, 0.69),
        _record("bert", "O2", 100.0, 600.0, 0.70), _record("bert", "bf16-true", 80.0, 500.0, 0.71),
    ]
    by_level = {c.record["level"]: c for c in compare(records)}
    o2 = by_level["O2"]
    assert o2.speedup == pytest.approx(3.0) and o2.speedup_vs_mixed == pytest.approx(2.0)
    assert o2.memory_ratio == pytest.approx(0.5) and o2.memory_vs_mixed == pytest.approx(0.75)
    assert o2.baseline_learned is False
    assert by_level["bf16-mixed"].speedup_vs_mixed == pytest.approx(1.0)
    table = markdown_table(records)
    assert "2.00x" in table and "0.75" in table and table.count("(untrained)") == 4
    assert "| 1.01 |" in table  # O2's final loss / chance loss, 0.70 / 0.69


class CountingClock:
    """A fake device clock: marks are numbers; reading the time is the one 'sync'."""

    def __init__(self) -> None:
        self.marks, self.syncs, self.now = 0, 0, 0.0

    def mark(self) -> float:
        self.marks += 1
        return self.now

    def seconds(self, start: float, end: float) -> float:
        self.syncs += 1
        return end - start


def test_step_window_marks_twice_and_syncs_once():
    clock = CountingClock()
    window = StepWindow(clock, first=2, steps=4)
    for step in range(6):
        window.on_train_batch_start(None, None, None, step)
        clock.now += 0.5 if step >= 2 else 7.0  # warm-up steps are slow and must not count
        window.on_train_batch_end(None, None, {"loss": torch.tensor(1.0 / (step + 1))}, None, step)
    assert clock.marks == 2 and clock.syncs == 0  # nothing waited for the device during training
    assert window.seconds_per_step() == pytest.approx(0.5)
    assert clock.syncs == 1
    assert window.losses() == pytest.approx([1.0 / (s + 1) for s in range(6)])
    unfinished = StepWindow(CountingClock(), first=1, steps=3)
    unfinished.on_train_batch_start(None, None, None, 0)
    unfinished.on_train_batch_end(None, None, torch.tensor(0.3), None, 0)
    with pytest.raises(RuntimeError, match="did not close: 1 steps ran, 4 needed"):
        unfinished.seconds_per_step()
    with pytest.raises(ValueError, match="steps >= 1"):
        StepWindow(clock, first=0, steps=0)


def test_cuda_clock_records_events_and_waits_only_for_the_last(monkeypatch):
    """The CUDA path by construction, on CPU: fake events count records and host waits."""
    log = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            self.t = len(log) * 10.0
            log.append("record")

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, end):  # milliseconds, as torch's
            return end.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    window = StepWindow(CudaClock(), first=1, steps=2)
    for step in range(3):
        window.on_train_batch_start(None, None, None, step)
        window.on_train_batch_end(None, None, torch.tensor(0.5), None, step)
    assert log == ["record", "record"]
    assert window.seconds_per_step() == pytest.approx(10.0 / 1000 / 2)
    assert log == ["record", "record", "sync"]


def test_step_window_in_a_real_fit():
    """Lightning calls the hooks once per optimizer step: the window closes after warmup + steps."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    clock = CountingClock()
    window = StepWindow(clock, first=2, steps=3)
    trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[window])
    trainer.fit(BoringModel())
    assert clock.marks == 2 and len(window.losses()) == 5
    window.seconds_per_step()
    assert clock.syncs == 1


def test_chance_loss_of_the_best_constant_prediction():
    labels = torch.tensor([0, 1] * 50)
    assert chance_loss([(torch.zeros(100, 3), labels)]) == pytest.approx(math.log(2))
    three = torch.tensor([0] * 50 + [1] * 25 + [2] * 25)
    assert chance_loss([(None, three[:40]), (None, three[40:])]) == pytest.approx(
        -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    target = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert chance_loss([(None, target)]) == pytest.approx(float(((target - target.mean()) ** 2).mean()))


def test_plan_runs_picks_device_sized_defaults(monkeypatch):
    cpu = {s.model: s for s in runner.plan_runs(["bert", "unet"], ["fp32"], accelerator="cpu")}
    assert cpu["bert"].size == "tiny" and cpu["bert"].batch_size is None and cpu["bert"].steps == 150
    assert cpu["bert"].warmup == 2 and cpu["bert"].threads == 1
    monkeypatch.setattr(runner, "resolve_device", lambda accelerator: "cuda")
    gpu = {s.model: s for s in runner.plan_runs(["bert", "unet"], ["fp32", "bf16-mixed"])}
    assert (gpu["bert"].size, gpu["bert"].batch_size, gpu["bert"].steps, gpu["bert"].warmup) == ("base", 256, 300, 10)
    assert gpu["unet"].size == "base" and gpu["unet"].batch_size == 64
    chosen = runner.plan_runs(["bert"], ["O2"], size="small", steps=7, warmup=0)[0]
    assert (chosen.size, chosen.batch_size, chosen.steps, chosen.warmup) == ("small", None, 7, 0)


def test_accelerator_cuda_without_a_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--accelerator", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_chart_draws_two_bars_per_successful_run(tmp_path):
    records = [_record("bert", lv, t, m, 0.5) for lv, t, m in (("fp32", 300, 900), ("O1", 200, 950), ("O2", 120, 600))]
    records.append({**_record("unet", "fp32", 50, 100, 1.0)})
    records.append({**_record("unet", "O2", 1, 1, 1.0), "error": "boom"})
    path = tmp_path / "chart.png"
    assert draw_chart(records, str(path)) == 16  # per run: 2 ratios to fp32 (no bf16-mixed run), 2 absolute
    pixels = _png_pixels(path)
    assert pixels.shape[0] > 1000 and pixels[..., :3].std() > 0.05  # six rows of panels
    assert _has_colour(pixels, LEVEL_COLOURS["O2"]) and not _has_colour(pixels, LEVEL_COLOURS["O3"])
    with pytest.raises(ValueError, match="no successful run"):
        draw_chart([records[-1]], str(tmp_path / "empty.png"))


def test_chart_labels_do_not_overlap_and_untrained_runs_are_marked():
    from lightning_amp.bench.chart import build_figure

    levels = ("fp32", "bf16-mixed", "bf16-true", "O1", "O2", "O3")
    records = [_record(model, lv, 300 - 20 * i, 900 - 50 * i, 0.5, learned=lv != "O3")
               for model in ("feedforward", "unet", "bert") for i, lv in enumerate(levels)]
    run = {"date": "2026-11-23 14:00 UTC", "commit": "abc1234", "device": "Some CPU (2 cores, 1 threads)",
           "cpu_bf16": "avx512_bf16=yes", "torch": "2.13.0", "lightning": "2.6.6", "backend": "cpu-ext",
           "steps": {"bert": 5}}
    title = "lightning-amp bench on a CPU with a long model name: ratios to fp32 and to Lightning's mixed precision"
    for models in (3, 1):  # three narrow columns of panels (the default matrix), and the narrowest figure
        figure, bars = build_figure(records[-6 * models:], title=title, run=run)
        assert bars == models * 6 * 6
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        for axis in figure.axes:
            labels = [t for t in axis.get_xticklabels() if t.get_text()]
            assert [t.get_text() for t in labels] == ["fp32", "bf16-mixed", "bf16-true", "O1", "O2", "O3*"]
            extents = [t.get_window_extent(renderer) for t in labels]
            for left, right in zip(extents, extents[1:]):
                assert not left.overlaps(right), (left, right)
        for text in [figure._suptitle, *figure.texts]:  # title and metadata lie inside the figure
            extent = text.get_window_extent(renderer)
            assert extent.x0 >= figure.bbox.x0 and extent.x1 <= figure.bbox.x1, text.get_text()
    notes = " ".join(t.get_text().replace("\n", " ") for t in figure.texts)
    assert "abc1234" in notes and "torch 2.13.0" in notes and "bert 5" in notes and "did not learn" in notes
    hatched = [p for p in figure.axes[0].patches if p.get_hatch()]
    assert len(hatched) == 1  # the O3 bar


def test_piped_table_is_full_width_markdown():
    import io

    from rich.console import Console

    from lightning_amp.bench import print_results

    records = [_record("a-model-with-a-rather-long-name", "fp32", 10.0, 100.0, 0.5),
               _record("a-model-with-a-rather-long-name", "bf16-mixed", 8.0, 90.0, 0.5)]
    stream = io.StringIO()
    print_results(records, "title", Console(file=stream, width=80))
    text = stream.getvalue()
    assert "…" not in text and "| a-model-with-a-rather-long-name | bf16-mixed |" in text
    assert "AdamW(fused=None, foreach=None)" in text


def test_peak_memory_sees_a_large_allocation():
    probe = PeakMemory("cpu")
    probe.start()
    block = torch.rand(64, 1024, 1024)  # 256 MiB, touched
    assert float(block[-1, -1, -1]) >= 0
    del block
    assert probe.peak_mib() > 200
    assert probe.method == "proc_vmhwm_reset" and probe.clamped is False
    probe.start()
    assert probe.peak_mib() < 100  # the high-water mark was reset
    with pytest.raises(ValueError, match="device_type"):
        PeakMemory("tpu")


def test_peak_memory_records_the_lifetime_fallback_and_the_clamp(monkeypatch):
    """Without /proc the probe falls back to the lifetime ru_maxrss and says so; a negative difference
    is reported as 0 and flagged."""
    monkeypatch.setattr(memory_module, "_proc_status_kib", lambda field: None)
    probe = PeakMemory("cpu")
    probe.start()
    assert probe.peak_mib() == 0.0 and probe.method == "ru_maxrss_lifetime" and probe.clamped is False
    probe.baseline_mib += 1e6  # a baseline above the lifetime peak: the difference is negative
    assert probe.peak_mib() == 0.0 and probe.clamped is True


def test_info_reports_versions_and_backend(capsys):
    import lightning

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and "cpu backend:" in out and "amx_bf16=" in out
    assert f"lightning {lightning.__version__}" in out
    if ops.backend("cpu") == "cpu-ext":
        line = next(line for line in out.splitlines() if line.startswith("cpu wgrad GEMM path"))
        assert f"bf16 {ops.wgrad_cpu_gemm(torch.bfloat16)}" in line and f"fp16 {ops.wgrad_cpu_gemm(torch.float16)}" in line
        assert ops.wgrad_cpu_gemm(torch.bfloat16) in ("onednn", "mkl", "aten")


def test_version_and_help_with_examples(capsys):
    import lightning_amp

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-amp {lightning_amp.__version__}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text
    examples = [line.split("#")[0].split() for line in help_text.split("examples:")[1].splitlines() if line.strip()]
    assert len(examples) >= 2
    for example in examples:  # each example parses as written
        cli.build_parser().parse_args(example[1:])


def test_bench_json_is_strict_even_when_a_loss_diverged(tmp_path):
    from lightning_amp.bench import write_json

    record = {"model": "bert", "level": "O3", "final_loss": float("nan"), "loss_curve": [1.0, float("inf")]}
    path = tmp_path / "bench.json"
    write_json([record], str(path), run={"commit": "abc"})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text, parse_constant=lambda name: pytest.fail(f"non-strict JSON constant {name}"))
    assert loaded["run"] == {"commit": "abc"}
    assert loaded["records"][0]["final_loss"] is None and loaded["records"][0]["loss_curve"] == [1.0, None]


def test_build_reports_the_cached_build_and_a_missing_compiler(tmp_path, monkeypatch, capsys):
    """`lightning-amp build` finds a whole build of this torch's key in the cache without compiling (exit 0),
    and without a compiler exits 1 naming it."""
    import json

    from lightning_amp.ops import _build

    monkeypatch.setenv("LIGHTNING_AMP_CACHE_DIR", str(tmp_path))
    key = _build.build_key(_build.source_dir())
    folder = tmp_path / key.name
    folder.mkdir()
    (folder / _build.LIBRARY).write_text("stands for the library")
    (folder / "build.json").write_text(json.dumps({"key": key.name}))
    assert cli.main(["build"]) == 0
    assert capsys.readouterr().out == f"already built: {folder / _build.LIBRARY} for {_build.describe(key)}\n"
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert cli.main(["build", "--force"]) == 1
    assert "lightning-amp build: no C++ compiler found (CXX='/nonexistent/c++' is not on PATH)" in capsys.readouterr().err
    assert cli.main(["info"]) == 0
    assert f"first-use build cache: {tmp_path} (LIGHTNING_AMP_CACHE_DIR)" in capsys.readouterr().out


@pytest.mark.skipif(ops.extension_module() is None, reason="O2's stream rules need the compiled extension")
def test_bench_stream_reports_each_levels_stream_and_writes_json(tmp_path, capsys):
    """``bench --stream``: no timing, one step per level of the headline model; O2's blocks are half like
    bf16-true's, bf16-mixed's are fp32 and its first promotion is named, and the JSON holds every level."""
    assert cli.main(["bench", "--stream", "--models", "bert", "--levels", "bf16-mixed,bf16-true,O2",
                     "--accelerator", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "first promotion of the half stream" in out and "wrote" in out
    report = json.loads((tmp_path / "stream.json").read_text())["models"]["bert"]
    assert set(report) == {"bf16-mixed", "bf16-true", "O2"}
    assert set(report["O2"]["block_dtypes"]) == set(report["bf16-true"]["block_dtypes"]) == {"bfloat16"}
    assert set(report["bf16-mixed"]["block_dtypes"]) == {"float32"} and report["bf16-mixed"]["first_promotion"]
    assert report["O2"]["first_promotion"] is None
    assert report["O2"]["saved_activation_bytes"] <= 1.02 * report["bf16-true"]["saved_activation_bytes"]
