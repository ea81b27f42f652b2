"""tp_fused refuses a column/row pair with anything but elementwise operations between them (a norm, a
BatchNorm, a view mixing the split dimension), with a ValueError naming the modules, before any change."""
import copy
import os
import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_amp  # noqa: F401  (registers "tp_fused")
from lightning_amp.parallel import apply_plan
from lightning_amp.parallel.plan import build_plan
from lightning_amp.trainer.strategy import TensorParallelStrategy
from support.processes import free_port


class BatchNormMLP(pl.LightningModule):
    """fc1 -> BatchNorm1d -> ReLU -> fc2: named like an MLP, but BatchNorm keeps one statistic per feature."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ViewMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):  # swaps the two halves of the features: a shard would get the wrong half
        return self.fc2(self.fc1(x).view(-1, 2, 16).flip(1).reshape(-1, 32))


class UntraceableNormMLP(nn.Module):
    """Data-dependent control flow (torch.fx cannot trace it): checked by structure."""

    def __init__(self, norm_width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)
        self.norm = nn.LayerNorm(norm_width)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.norm(self.fc2(h)) if self.norm.normalized_shape[-1] == 8 else self.fc2(self.norm(h))


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 32), nn.Linear(8, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.down_proj(self.drop(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x).float()))


def _refused(model, plan="auto"):
    before = copy.deepcopy(model.state_dict())
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError) as info:
        build_plan(model, plan, 2)
    assert [type(m) for m in model.modules()] == kinds  # nothing was changed
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(info.value)


def test_norms_and_views_between_column_and_row_are_refused_naming_the_modules():
    message = _refused(BatchNormMLP())
    assert "fc1, fc2" in message and "bn (BatchNorm1d)" in message and "nothing was changed" in message
    assert "view" in _refused(nn.Sequential(ViewMLP()))
    with pytest.warns(UserWarning, match="by structure only"):  # fx cannot trace it (see below)
        assert "0.norm (LayerNorm)" in _refused(nn.Sequential(UntraceableNormMLP(32)))
    assert "bn (BatchNorm1d)" in _refused(BatchNormMLP(), plan={"fc1": "column", "fc2": "row"})


def test_elementwise_paths_stay_converted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # traced: no fallback, no warning
        assert [u.family for u in build_plan(GatedMLP(), "auto", 2).units] == ["named MLP"]
    with pytest.warns(UserWarning, match="fx cannot trace the model") as record:
        assert [u.family for u in build_plan(UntraceableNormMLP(8), "auto", 2).units] == ["named MLP"]
    assert len(record) == 1


def test_a_parent_fx_cannot_trace_is_checked_by_structure_with_a_warning_naming_why():
    with pytest.warns(UserWarning) as record:
        message = _refused(nn.Sequential(UntraceableNormMLP(32)))
    assert "0.norm (LayerNorm)" in message  # the structural check still refuses the norm over the split width
    (warning,) = [str(w.message) for w in record]
    assert "torch.fx cannot trace 0 (UntraceableNormMLP): TraceError:" in warning
    assert "control flow" in warning  # fx's own reason
    assert "between 0.fc1 and 0.fc2 is checked by structure only" in warning
    kinds = {r.name: r.kind for r in apply_plan(nn.Sequential(GatedMLP()))}
    assert kinds == {"0.gate_proj": "column", "0.up_proj": "column", "0.down_proj": "row"}


@pytest.mark.slow
def test_batchnorm_mlp_on_two_ranks_raises_the_value_error(tmp_path):
    """Before the check both ranks crashed in forward: 'running_mean should contain 16 elements not 32'."""
    os.environ["MASTER_PORT"] = str(free_port())
    data = TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=TensorParallelStrategy(start_method="spawn"),
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(Exception, match=r"bn \(BatchNorm1d\) acts on the split dimension"):
        trainer.fit(BatchNormMLP(), DataLoader(data, batch_size=8))
