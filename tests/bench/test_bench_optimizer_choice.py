"""``lightning-amp bench --optimizer fused-adam``: the example's torch Adam/AdamW becomes FusedAdam, same groups."""
import pytest
import torch

from lightning_amp import FusedAdam
from lightning_amp.bench import RunSpec, load_example
from lightning_amp.bench.optimizers import use_optimizer
from lightning_amp.cli import build_parser


def test_fused_adam_replaces_the_examples_adamw_with_its_groups_and_scheduler():
    example = load_example("bert").build_example(size="tiny", seed=0)
    before = example.module.configure_optimizers()["optimizer"]
    use_optimizer(example.module, "fused-adam")
    config = example.module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, FusedAdam) and optimizer.defaults["adam_w_mode"]
    assert scheduler.optimizer is optimizer
    for ours, theirs in zip(optimizer.param_groups, before.param_groups, strict=True):
        assert [id(p) for p in ours["params"]] == [id(p) for p in theirs["params"]]
        for key in ("lr", "weight_decay", "betas", "eps"):
            assert ours[key] == theirs[key], key
    assert torch.optim.AdamW is type(before)  # the swap is undone after configure_optimizers


def test_fused_adam_keeps_torch_defaults_where_the_example_gives_none():
    module = torch.nn.Linear(2, 2)
    module.configure_optimizers = lambda: (torch.optim.AdamW(module.parameters()), torch.optim.Adam(module.parameters()))
    use_optimizer(module, "fused-adam")
    adamw, adam = module.configure_optimizers()
    assert adamw.defaults["weight_decay"] == 1e-2 and adamw.defaults["adam_w_mode"]
    assert adam.defaults["weight_decay"] == 0.0 and not adam.defaults["adam_w_mode"]


def test_unknown_optimizer_choice_is_refused():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        RunSpec(model="bert", level="O2", optimizer="adam")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        use_optimizer(torch.nn.Linear(1, 1), "fused")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--optimizer", "lamb"])
    assert build_parser().parse_args(["bench", "--optimizer", "fused-adam"]).optimizer == "fused-adam"
