"""``amp/loss_scale`` and ``amp/skipped_steps`` appear in the Trainer's logged metrics by default (by design, issue
35) and ``log_metrics=False`` turns them off; a non-bool is a TypeError naming the argument."""
import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from lightning_amp import AmpO2Precision, AmpPrecision
from lightning_amp.fabric import FabricAmpO1Precision, FabricAmpPrecision
from support.trainer import quiet_lightning

AMP_METRICS = {"amp/loss_scale", "amp/skipped_steps"}


def _logged(plugin, tmp_path):
    trainer = L.Trainer(accelerator="cpu", max_steps=2, log_every_n_steps=1, logger=CSVLogger(tmp_path),
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        limit_val_batches=0, plugins=[plugin])
    with quiet_lightning():
        trainer.fit(BoringModel())
    return set(trainer.logged_metrics)


@pytest.mark.parametrize("log_metrics", [None, True, False])
def test_amp_metrics_logged_unless_turned_off(log_metrics, tmp_path):
    kwargs = {} if log_metrics is None else {"log_metrics": log_metrics}
    plugin = AmpO2Precision(dtype="float16", **kwargs)
    logged = _logged(plugin, tmp_path)
    if log_metrics is False:
        assert not logged & AMP_METRICS, logged
    else:
        assert AMP_METRICS <= logged, logged


@pytest.mark.parametrize("cls", [AmpPrecision, AmpO2Precision, FabricAmpPrecision, FabricAmpO1Precision])
@pytest.mark.parametrize("value", ["no", 0, None])
def test_a_non_bool_log_metrics_is_a_type_error_naming_it(cls, value):
    with pytest.raises(TypeError, match=r"`log_metrics` must be True or False; got"):
        cls(log_metrics=value)
