"""The plugins from LightningCLI (issue 25, item 5): short names resolve to one class each, level names
are case-insensitive, a bad value is a usage error (exit 2), not a traceback; the Fabric plugins'
former names still import, with a FutureWarning."""
import warnings

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_amp
import lightning_amp.fabric
from lightning_amp import fabric


def _cli(*args):
    """LightningCLI over BoringModel with ``args``, not run; the Trainer's precision plugin."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = LightningCLI(BoringModel, run=False, args=["--trainer.accelerator", "cpu", *args])
    return cli.trainer.precision_plugin


@pytest.mark.parametrize("name, cls", [("AmpPrecision", lightning_amp.AmpPrecision),
                                       ("AmpO2Precision", lightning_amp.AmpO2Precision),
                                       ("lightning_amp.AmpO1Precision", lightning_amp.AmpO1Precision),
                                       ("lightning_amp.AmpO1Plugin", lightning_amp.AmpO1Plugin),
                                       ("AmpO2Plugin", lightning_amp.AmpO2Plugin)])
def test_trainer_plugins_resolve_by_short_name(name, cls):
    """Short names are the class names; a former name (``AmpO2Plugin``, a subclass that adds nothing) still resolves,
    by its short name too, as it did before the classes were named ``...Precision``."""
    plugin = _cli("--trainer.plugins", name)
    assert type(plugin) is cls and plugin.properties.opt_level == (cls.fixed_opt_level or "O1")  # O1: the default


@pytest.mark.parametrize("level", ["O2", "o2"])
def test_level_names_are_case_insensitive(level):
    plugin = _cli("--trainer.plugins", "AmpPrecision", "--trainer.plugins.opt_level", level,
                  "--trainer.plugins.dtype", "float16", "--trainer.plugins.loss_scale", "128.0",
                  "--trainer.plugins.keep_batchnorm_fp32", "false", "--trainer.plugins.cast_model_outputs", "float32")
    props = plugin.properties
    assert (props.opt_level, props.dtype, props.loss_scale) == ("O2", torch.float16, 128.0)
    assert props.keep_batchnorm_fp32 is False and props.cast_model_outputs == torch.float32


@pytest.mark.parametrize("key, value, allowed", [
    ("opt_level", "O7", "'O0', 'O1', 'O2', 'O3', 'o0'"),
    ("opt_level", "02", "'O0', 'O1', 'O2', 'O3'"),
    ("dtype", "flaot16", "'auto', 'float16'"),
    ("loss_scale", "dinamic", "'dynamic'"),
    ("cast_model_outputs", "int8", "'float16'"),
])
def test_a_bad_value_is_a_usage_error_naming_the_allowed_values(key, value, allowed, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli("--trainer.plugins", "AmpPrecision", f"--trainer.plugins.{key}", value)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and f'Parser key "{key}"' in err and allowed in err


def test_level_subclasses_refuse_an_opt_level_at_parse_time(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _cli("--trainer.plugins", "AmpO2Precision", "--trainer.plugins.opt_level", "O1")
    assert exit_info.value.code == 2 and "'opt_level' is not accepted" in capsys.readouterr().err


def test_yaml_config(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  plugins:\n    - class_path: AmpO2Precision\n      init_args:\n        dtype: float16\n"
                      "        loss_scale: dynamic\n        init_scale: 1024.0\n")
    plugin = _cli("--config", str(config))
    assert type(plugin) is lightning_amp.AmpO2Precision and plugin.properties.loss_scale == "dynamic"
    assert plugin.loss_scale == 1024.0


@pytest.mark.parametrize("old, new", [("AmpPrecision", "FabricAmpPrecision"), ("AmpO0Precision", "FabricAmpO0Precision"),
                                      ("AmpO1Precision", "FabricAmpO1Precision"),
                                      ("AmpO2Precision", "FabricAmpO2Precision"),
                                      ("AmpO3Precision", "FabricAmpO3Precision")])
def test_former_fabric_names_are_deprecated_aliases(old, new):
    for module in (lightning_amp.fabric, lightning_amp.fabric.precision):
        with pytest.warns(FutureWarning, match=rf"lightning_amp\.fabric\.{old} is deprecated: use "
                                               rf"lightning_amp\.fabric\.{new}"):
            cls = getattr(module, old)
        assert cls is getattr(fabric, new) and cls.__name__ == new
    with pytest.warns(FutureWarning):
        exec(f"from lightning_amp.fabric import {old}", {})
    assert old not in fabric.__all__ and new in fabric.__all__


def test_unknown_fabric_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="module 'lightning_amp.fabric' has no attribute 'AmpO4Precision'"):
        fabric.AmpO4Precision  # noqa: B018
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ImportError):
            exec("from lightning_amp.fabric import Nope", {})
