"""Fabric(strategy="tp_fused") on 2 real CPU processes (gloo): the litgpt-style loop of
examples/fabric_tiny_gpt.py at TP=2 against one process (fp32 and the bf16 levels), exact resume, checkpoints
moving between TP=2 and one process, an overflow on one rank skipped on both; and the refusals of
combinations that cannot work (tp_fused with other precision plugins, DeepSpeed with ours)."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy as TrainerDDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as TrainerDeepSpeedStrategy

import lightning_amp  # noqa: F401  (registers "tp_fused")
from lightning_amp import AmpO2Precision
from lightning_amp.amp.o2 import policy as o2_policy
from lightning_amp.fabric import FabricAmpO2Precision, TensorParallelStrategy
from lightning_amp.parallel.attention import ParallelMultiheadAttention
from support.processes import free_port, run_two_ranks

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import fabric_tiny_gpt as gpt  # noqa: E402

STEPS = 4
FP32 = ["--precision", "32-true", "--steps", str(STEPS), "--optimizer", "sgd", "--lr", "0.1"]
TP2 = ["--strategy", "tp_fused", "--devices", "2"]
LEVELS = ("O1", "O2", "O3")


def _launch(out: Path, runs: list) -> dict:
    """Both ranks of support/scripts/fabric_tp.py, started as torchrun would; {name: (rank0, rank1) results}."""
    run_two_ranks("fabric_tp", out, json.dumps(runs))
    return {name: tuple(torch.load(out / f"{name}.rank{r}.pt") for r in (0, 1)) for name, _ in runs}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _initial_weights() -> dict:
    L.seed_everything(0, verbose=False)
    return gpt.TinyGPT().state_dict()


@pytest.mark.slow
def test_tp2_matches_one_process_resumes_exactly_and_moves_checkpoints(tmp_path):
    """fp32: TP=2 ends within 1e-5 of one process (measured 6e-8) after 4 steps of 2 micro-batches with
    no_backward_sync and clipping; every rank holds half of each split layer. fabric.save at TP=2 writes the
    full model under the original keys; resuming it at TP=2 equals the uninterrupted run bitwise; a
    one-process checkpoint resumes at TP=2 and a TP=2 one in a plain process, both within 1e-5.
    bf16 O1/O2/O3 at TP=2 stay within the bf16 rounding of one process at the same level; an overflow on
    rank 1 only (O2) is skipped on both ranks."""
    one_ckpt, tp_ckpt = tmp_path / "one.pt", tmp_path / "tp.pt"
    one = gpt.main([*FP32, "--save", str(one_ckpt), "--save-at", "2"])
    levels = {lv: gpt.main([*FP32[2:], "--precision", lv, *(["--inject-inf-at", "1"] if lv == "O2" else [])])
              for lv in LEVELS}
    runs = [
        ["tp", [*FP32, *TP2, "--save", str(tp_ckpt), "--save-at", "2"]],
        ["tp_resumed", [*FP32, *TP2, "--resume", str(tp_ckpt)]],
        ["tp_from_one", [*FP32, *TP2, "--resume", str(one_ckpt)]],
        ["dp", [*FP32, *TP2, "--tp", "1"]],
        *[[lv, [*FP32[2:], "--precision", lv, *TP2, *(["--inject-inf-at", "1"] if lv == "O2" else [])]] for lv in LEVELS],
    ]
    got = _launch(tmp_path, runs)

    tp0, tp1 = got["tp"]
    name = "blocks.0.attn.q_proj.weight"
    assert tp0["local_shapes"][name] == (16, 32) and one["local_shapes"][name] == (32, 32)  # really split
    assert tp0["local_shapes"]["blocks.0.mlp.fc2.weight"] == (32, 64)
    initial = _initial_weights()
    moved = min((one["weights"][k] - v).abs().max().item() for k, v in initial.items())
    assert moved > 1e-4  # every tensor trained: a missed or doubled shard update would show
    assert _max_diff(tp0["weights"], one["weights"]) < 1e-5
    assert _max_diff(tp0["weights"], tp1["weights"]) == 0.0
    dp0, dp1 = got["dp"]  # TP=1 x DP=2: each rank half the rows; main_grad averaged once per step
    assert dp0["local_shapes"] == one["local_shapes"]
    assert _max_diff(dp0["weights"], one["weights"]) < 1e-5 and _max_diff(dp0["weights"], dp1["weights"]) == 0.0

    saved_tp, saved_one = (torch.load(p, weights_only=False) for p in (tp_ckpt, one_ckpt))
    assert saved_tp["model"].keys() == saved_one["model"].keys()
    for key, value in saved_one["model"].items():
        assert saved_tp["model"][key].shape == value.shape and saved_tp["model"][key].dtype == torch.float32
        assert (saved_tp["model"][key] - value).abs().max() < 1e-5, key
    for index, state in saved_one["optimizer"]["state"].items():  # SGD momentum, gathered to full size
        assert (saved_tp["optimizer"]["state"][index]["momentum_buffer"] - state["momentum_buffer"]).abs().max() < 1e-5

    for r in (0, 1):
        resumed = got["tp_resumed"][r]["weights"]
        assert all(torch.equal(resumed[k], tp0["weights"][k]) for k in resumed), "TP=2 resume is not exact"
    assert _max_diff(got["tp_from_one"][0]["weights"], one["weights"]) < 1e-5
    plain_from_tp = gpt.main([*FP32, "--resume", str(tp_ckpt)])
    assert _max_diff(plain_from_tp["weights"], one["weights"]) < 1e-5

    # bf16: per tensor, TP=2 vs one process at the same level within 5% (O1, O2; measured 1.3%) or 10% (O3, bf16
    # params: a 1-ulp difference; measured 5.7%) of how far the tensor moved; a shard that missed or doubled an
    # update would be ~100% off
    for lv in LEVELS:
        rank0, rank1 = got[lv]
        assert rank0["skipped"] == rank1["skipped"] == levels[lv]["skipped"] == (1 if lv == "O2" else 0), lv
        assert _max_diff(rank0["weights"], rank1["weights"]) == 0.0, lv
        if lv == "O2":  # the overflow report names the split layers' params (the plugin converted after the plan)
            assert "blocks.0.attn.q_proj.weight" in rank0["nonfinite"] and "head.weight" in rank1["nonfinite"]
        for key, start in initial.items():
            moved = (levels[lv]["weights"][key] - start).abs().max().item()
            err = (rank0["weights"][key] - levels[lv]["weights"][key]).abs().max().item()
            assert err < (0.1 if lv == "O3" else 0.05) * moved, (lv, key, err, moved)


# ---- refusals (one process, no launch) ------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="64-true"),
     r"strategy='tp_fused'.*DoublePrecision\(precision='64-true'\).*Use Fabric's precision='32-true'.*AmpPrecision"),
    (dict(plugins=[AmpO2Precision()]), r"AmpO2Precision is a Lightning Trainer plugin; L\.Fabric takes .*FabricAmpO2Precision"),
])
def test_tp_fused_refuses_other_precision_plugins_when_fabric_is_built(kwargs, message):
    with pytest.raises(TypeError, match=message):
        L.Fabric(accelerator="cpu", devices=1, strategy="tp_fused", **kwargs)
    for ok in (dict(precision="bf16-true"), dict(precision="bf16-mixed"), dict(plugins=[FabricAmpO2Precision()])):
        assert isinstance(L.Fabric(accelerator="cpu", devices=1, strategy="tp_fused", **ok).strategy, TensorParallelStrategy)


def test_trainer_tp_fused_refuses_other_precision_plugins_when_the_trainer_is_built():
    with pytest.raises(TypeError, match=r"strategy='tp_fused'.*DoublePrecision\(precision='64-true'\).*a lightning-amp plugin"):
        L.Trainer(accelerator="cpu", devices=1, strategy="tp_fused", precision="64-true", logger=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="tp_fused", plugins=[AmpO2Precision()], logger=False)
    assert isinstance(trainer.precision_plugin, AmpO2Precision)


def test_tp_fused_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="tensor_parallel_size must be 'auto' or a positive int"):
        TensorParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        TensorParallelStrategy(sequence_parallel="yes")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the world size 2"):
        L.Fabric(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(tensor_parallel_size=3))


class _FabricDeepSpeed(FabricDeepSpeedStrategy):
    """Lightning's Fabric DeepSpeedStrategy class without deepspeed installed: construction and environment as
    DDP's (one process, no process group), so that Fabric reaches the precision plugin."""

    def __init__(self) -> None:
        FabricDDPStrategy.__init__(self)

    def setup_environment(self) -> None:
        pass


class _TrainerDeepSpeed(TrainerDeepSpeedStrategy):
    """The same for the Trainer's DeepSpeedStrategy: Lightning calls the plugin's convert_module first in setup."""

    def __init__(self) -> None:
        TrainerDDPStrategy.__init__(self)

    def setup_environment(self) -> None:
        self.accelerator.setup_device(self.root_device)

    def _init_config_if_needed(self) -> None:
        pass


def test_deepspeed_with_our_fabric_plugin_is_refused_when_fabric_is_built():
    """Fabric hands its precision plugin no strategy: the plugin checks the one Fabric's connector made
    (plugin_kinds.py), before ``fabric.setup`` can cast anything."""
    plugin = FabricAmpO2Precision()
    with pytest.raises(TypeError, match=r"FabricAmpO2Precision\(opt_level='O2'.*cannot run under DeepSpeed \(_FabricDeepSpeed\).*"
                                        r"strategy='deepspeed', precision='bf16-mixed'"):
        L.Fabric(accelerator="cpu", devices=1, strategy=_FabricDeepSpeed(), plugins=[plugin])
    assert not plugin.amp.holds_policy and o2_policy.installs() == 0


def test_deepspeed_with_our_trainer_plugin_is_refused_before_anything_is_cast():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=_TrainerDeepSpeed(), plugins=[AmpO2Precision()],
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    model = BoringModel()
    with pytest.raises(TypeError, match=r"AmpO2Precision\(opt_level='O2'.*cannot run under DeepSpeed \(_TrainerDeepSpeed\).*"
                                        r"'tp_fused' or ModelParallelStrategy"):
        trainer.fit(model)
    assert not trainer.precision_plugin.amp.holds_policy and o2_policy.installs() == 0
    assert model.layer.weight.dtype == torch.float32


class _SelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def _mha_groups(model: torch.nn.Module) -> list:
    """Weight decay on matrices only: the groups a split param must stay in."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.5},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def test_fabric_tp_fused_rebinds_an_optimizer_over_split_params_and_refuses_a_second_model(monkeypatch):
    """nn.MultiheadAttention's fused in_proj_weight/in_proj_bias become q/k/v projections: an optimizer built before
    ``fabric.setup(model, optimizer)`` gets the parts in the original param's group, so three SGD steps with weight
    decay on matrices only equal the plain module's (fp32, 1e-6, measured 3e-8; a bias put into the decayed group: 0.29).
    A second model is refused saying what to do instead."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # the one-process group below: not a port later tests reuse
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tp_fused")
    fabric.launch()
    try:
        torch.manual_seed(0)
        plain = _SelfAttention()
        with torch.no_grad():
            plain.attn.in_proj_bias.normal_()
        mha = copy.deepcopy(plain)
        expected = torch.optim.SGD(_mha_groups(plain), lr=0.1)
        model, optimizer = fabric.setup(mha, torch.optim.SGD(_mha_groups(mha), lr=0.1))
        assert [len(g["params"]) for g in optimizer.param_groups] == [4, 4]  # q/k/v and out_proj weights; biases
        for x in torch.randn(3, 2, 5, 8):
            for module, opt, backward in ((model, optimizer, fabric.backward), (plain, expected, torch.Tensor.backward)):
                backward(module(x).square().mean())
                opt.step()
                opt.zero_grad()
        full = fabric.strategy.get_module_state_dict(model.module)
        assert full.keys() == plain.state_dict().keys()
        assert all(torch.allclose(full[k], v, rtol=0, atol=1e-6) for k, v in plain.state_dict().items())
        with pytest.raises(ValueError, match="one model per Fabric"):
            fabric.setup(torch.nn.Linear(4, 4))
    finally:
        torch.distributed.destroy_process_group()


def test_fabric_tp_fused_refuses_an_optimizer_over_params_a_layer_cannot_map_back(monkeypatch):
    """A converted layer that does not name the parts of a param it split (no ``replacement_params``): the error
    names the param and says to build the optimizer after ``fabric.setup_module``."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.delattr(ParallelMultiheadAttention, "replacement_params")
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="tp_fused")
    fabric.launch()
    try:
        mha = _SelfAttention()
        with pytest.raises(ValueError, match=r"holds 'attn\.in_proj_weight'.*fabric\.setup_module\(model\)"):
            fabric.setup(mha, torch.optim.SGD(mha.parameters(), lr=0.1))
    finally:
        torch.distributed.destroy_process_group()
