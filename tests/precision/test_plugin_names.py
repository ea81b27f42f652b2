"""The plugins' names (issue 41, item 4): ``...Precision`` as Lightning's, the former ``AmpO2Plugin`` names the
classes under their former names (subclasses adding nothing) and checkpoints saved under them load; the repr says what was asked (``opt_level='auto'``) and the
rung. (A plugin handed to the other Lightning: tests/fabric/test_fabric.py.)"""
import pytest

import lightning_amp
from lightning_amp import fabric

LEVELS = ("O0", "O1", "O2", "O3", "Auto")


@pytest.mark.parametrize("level", LEVELS)
def test_the_former_names_are_the_classes_named_precision_adding_nothing(level):
    cls, former = getattr(lightning_amp, f"Amp{level}Precision"), getattr(lightning_amp, f"Amp{level}Plugin")
    assert issubclass(former, cls) and former.__name__ == f"Amp{level}Plugin"
    assert [name for name in vars(former) if not name.startswith("__")] == []  # nothing of its own
    assert isinstance(former(), cls)
    assert cls.__name__ == cls.__qualname__ == f"Amp{level}Precision"
    assert getattr(fabric, f"FabricAmp{level}Precision").__name__ == f"FabricAmp{level}Precision"


def test_a_checkpoint_holding_the_state_under_a_former_name_loads():
    state = lightning_amp.AmpO2Precision(dtype="float16").state_dict()
    plugin = lightning_amp.AmpO2Precision(dtype="float16")
    plugin.on_load_checkpoint({"AmpO2Plugin": {**state, "skipped_steps": 7}})
    assert plugin.skipped_steps == 7


def test_repr_says_what_was_asked_and_the_rung():
    assert repr(lightning_amp.AmpPrecision(opt_level="auto", dtype="float16")) == \
        "AmpPrecision(opt_level='auto', dtype=torch.float16, rung='O2/128.0')"
    assert repr(fabric.FabricAmpAutoPrecision(dtype="bfloat16")) == \
        "FabricAmpAutoPrecision(opt_level='auto', dtype=torch.bfloat16, rung='O2')"
    assert repr(lightning_amp.AmpO2Precision(dtype="float16")) == \
        "AmpO2Precision(opt_level='O2', dtype=torch.float16, loss_scale='dynamic')"

