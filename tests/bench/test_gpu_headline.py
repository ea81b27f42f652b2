"""The headline benchmark's steady-state timing on the CPU: where step times settle, a real fit stopped
once they have (and not before the steps its loss target needs), one that never settles, and a run with
torch's autocast lists for O2's comparison."""
import math
import random

import pytest

from gpu_check import headline
from gpu_check.headline import HeadlineRun, SteadyWindow, measure, settles_at, steady_start
from lightning_amp.bench.worker import RunSpec, run


def _noisy(n, ms, spread=0.005, seed=0):
    rng = random.Random(seed)
    return [ms * (1 + rng.uniform(-spread, spread)) for _ in range(n)]


def test_the_steady_point_is_after_the_slow_first_steps():
    times = [900.0, 300.0, 120.0] + _noisy(60, 70.0)
    assert steady_start(times, window=10, tolerance=0.03) == 3
    assert steady_start(times[:32], window=10, tolerance=0.03) is None  # not yet three windows after them


def test_one_cold_step_moves_the_steady_point_past_it():
    """Means, not medians: a median ignores one slow step in a window, and the mean time would include it."""
    times = [700.0] + _noisy(60, 70.0)
    assert steady_start(times, window=10, tolerance=0.03) == 1
    assert not settles_at(times, 0, window=10, tolerance=0.03)


def test_step_times_that_keep_drifting_never_settle():
    times = [70.0 * 1.004 ** i for i in range(200)]  # 4% slower per window of 10
    assert steady_start(times, window=10, tolerance=0.03) is None
    assert steady_start(times, window=10, tolerance=0.05) == 0


def _spec(steps):
    return RunSpec(model="feedforward", level="32-true", size="tiny", steps=steps, warmup=0, accelerator="cpu",
                   threads=1)


def test_a_fit_stops_once_steady_and_not_before_its_minimum_steps():
    window = SteadyWindow("cpu", min_steps=14, window=2, tolerance=10.0)  # any three windows agree
    record = run(_spec(steps=40), window=window)
    summary = window.summary()
    assert summary["steps"] == len(record["loss_curve"]) == 14  # steady after 6 steps, then held to 14
    assert summary["steady"] and summary["steady_after"] == 0 and summary["timed_steps"] == 14
    assert summary["step_time_ms"] == pytest.approx(sum(summary["step_times_ms"]) / 14, rel=1e-3)
    assert record["step_time_ms"] == pytest.approx(summary["step_time_ms"])


def test_a_fit_that_never_settles_runs_to_its_cap_and_says_so():
    window = SteadyWindow("cpu", window=3, tolerance=1e-12)  # wall-clock times never agree that closely
    run(_spec(steps=12), window=window)
    summary = window.summary()
    assert summary["steps"] == 12 and not summary["steady"] and summary["steady_after"] is None
    assert summary["timed_steps"] == 6  # the second half


def test_the_o2_run_with_torchs_lists_reports_its_forward_and_tokens(monkeypatch):
    from lightning_amp.trainer import precision

    monkeypatch.setattr(precision.AmpO2Precision, "__init__", precision.AmpO2Precision.__init__)  # use_forward patches it
    spec = RunSpec(model="bert", level="O2", size="tiny", steps=30, warmup=0, accelerator="cpu", threads=1,
                   optimizer="fused-adam")
    record = measure(HeadlineRun("O2", "fused-adam", o2_forward="fp32", min_steps=8), spec)
    assert record["o2_forward"] == "fp32" and record["optimizer"] == "FusedAdam"
    assert 8 <= record["steps"] <= 30 and record["precision_plugin"] == "AmpO2Precision"
    assert precision.AmpO2Precision().properties.norm_policy == "fp32"  # the runs' plugins took torch's lists
    tokens = record["batch_size"] * headline.seq_len("tiny")
    assert record["tokens_per_s"] == pytest.approx(1000.0 * tokens / record["step_time_ms"])
    assert math.isfinite(record["final_loss"])


@pytest.mark.parametrize("argv", [["--json", "x.json", "--max-steps", "100"], ["--json", "x.json", "--batch-size", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        headline.main(argv)
    assert exit_info.value.code == 2 and "--max-steps must be >= 300" in capsys.readouterr().err
