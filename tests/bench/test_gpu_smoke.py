"""The CUDA smoke's checks, run on the CPU where they can: the compiled ops against their fallbacks (and
the check failing when a fallback is wrong), O2's policy, Trainer steps at O1-O3, a tp_fused step, and
the results file rewritten after each check, a failed or not-applicable check never counted as passed."""
import json

import pytest
import torch

from gpu_check import smoke
from lightning_amp.amp.o2 import policy as o2_policy


def test_every_compiled_op_equals_its_fallback_on_the_cpu():
    assert "9 operators equal to their fallbacks on cpu (cpu-ext)" == smoke.check_ops("cpu")


def test_the_ops_check_fails_when_a_fallback_is_wrong(monkeypatch):
    from lightning_amp.ops import multi_tensor

    original = multi_tensor._scale_fallback
    monkeypatch.setattr(multi_tensor, "_scale_fallback", lambda src, dst, scale, found: original(src, dst, scale * 1.001,
                                                                                                  found))
    with pytest.raises(AssertionError, match="multi_tensor_scale torch.float32 output 0 differs from the fallback"):
        smoke.check_ops("cpu")


def test_o2s_policy_check_passes_and_leaves_no_hold():
    assert "layer_norm bfloat16: torch bfloat16, O2 bfloat16" in smoke.check_o2_policy("cpu")
    assert o2_policy.installs() == 0


def test_the_headline_models_stream_is_half_under_o2():
    detail = smoke.check_o2_stream("cpu")
    assert detail.startswith("2 blocks bfloat16") and "first promotion: none" in detail
    assert o2_policy.installs() == 0


def test_trainer_steps_at_each_model_and_a_tp_fused_step():
    detail = smoke.check_trainer_levels("cpu", levels=(("O2", "float16"),))
    assert detail.startswith("2 runs of 4 steps") and "demo-transformer O2 float16" in detail
    assert "4 steps under TensorParallelStrategy" in smoke.check_tp_fused("cpu")


def test_results_are_written_after_each_check_and_only_ok_counts(tmp_path, monkeypatch):
    out = tmp_path / "smoke.json"
    seen = []

    def failing(device):
        seen.append(json.loads(out.read_text())["checks"])  # the file as the previous check left it
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(smoke, "CHECKS", {"ops": lambda device: "fine", "o2_policy": failing,
                                          "sync_debug": smoke.check_sync_debug})
    results = smoke.run_checks(["sync_debug", "o2_policy", "ops"], "cpu", out)
    assert [(r["name"], r["ok"]) for r in results] == [("ops", True), ("o2_policy", False), ("sync_debug", None)]
    assert seen == [[dict(results[0])]]
    assert "illegal memory access" in results[1]["detail"] and "needs CUDA" in results[2]["detail"]
    assert json.loads(out.read_text())["checks"] == results


def test_unknown_checks_and_a_missing_gpu_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        smoke.main(["--json", str(tmp_path / "x.json"), "--device", "cpu", "--only", "ops,opz"])
    assert exit_info.value.code == 2 and "unknown: opz" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            smoke.main(["--json", str(tmp_path / "x.json")])
        assert "torch sees no CUDA device" in capsys.readouterr().err
