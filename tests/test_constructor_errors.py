"""Errors that suggest the fix (issue 41, item 4): a wrong keyword to any public plugin, strategy or rules
object names the class, the keyword and the closest valid one; an apex-only option of ``amp.initialize`` names
its replacement from the migration page (whose table this file keeps equal to the code's); a bad value names the
class and the argument, its bounds written as a person writes them."""
import re
from pathlib import Path

import pytest

import lightning_amp
from lightning_amp import fabric, parallel
from lightning_amp._keywords import APEX_ONLY_OPTIONS

MIGRATION_PAGE = Path(__file__).resolve().parents[1] / "docs" / "migrating-from-apex.md"

#: every public class whose constructor checks its keywords: (class, a misspelt keyword, the keyword it means)
LEVELS = ("O0", "O1", "O2", "O3", "Auto")
CHECKED = [
    (lightning_amp.AmpPrecision, "kep_batchnorm_fp32", "keep_batchnorm_fp32"),
    (fabric.FabricAmpPrecision, "master_weight", "master_weights"),
    *((getattr(lightning_amp, f"Amp{level}Precision"), "loss_scal", "loss_scale") for level in LEVELS),
    *((getattr(lightning_amp, f"Amp{level}Plugin"), "halfbuffers", "half_buffers") for level in LEVELS),
    *((getattr(fabric, f"FabricAmp{level}Precision"), "ladders", "ladder") for level in LEVELS),
    (lightning_amp.TensorParallelStrategy, "tensor_paralel_size", "tensor_parallel_size"),
    (fabric.TensorParallelStrategy, "sequence_paralel", "sequence_parallel"),
    (parallel.TensorParallelConfig, "bucket_numl", "bucket_numel"),
    (lightning_amp.LadderRules, "nonfinte_in_a_row", "nonfinite_in_a_row"),
    (lightning_amp.LossScaler, "growth_interva", "growth_interval"),
]
#: the other public classes, and why their constructors are not checked here
NOT_CHECKED = {
    "FusedAdam": "a torch Optimizer: apex's keywords handled by optimizers/apex_keywords.py, others as Python's",
    "FusedLAMB": "as FusedAdam", "FusedSGD": "as FusedAdam", "FusedAdadelta": "as FusedAdam",
    "ColumnParallelLinear": "an nn.Module with torch's Linear arguments", "RowParallelLinear": "as ColumnParallelLinear",
    "ParallelMultiheadAttention": "as ColumnParallelLinear", "MainGradBuffer": "built by the strategy",
    "ParallelGroups": "built by the strategy", "AmpRuntime": "built by the plugins (plugin.amp)",
    "TensorParallelPlan": "made by build_plan or TensorParallelPlan.parse, which name a bad entry and its reason "
                          "(tests/parallel/test_plan_value.py); its constructor takes a mapping",
    "Style": "a frozen dataclass (Python names a wrong keyword); its dict form is checked by TensorParallelPlan.parse, "
             "naming the entry and the fields a style has",
}
PLUGINS = [lightning_amp.AmpPrecision, lightning_amp.AmpO2Precision, fabric.FabricAmpPrecision,
           fabric.FabricAmpO3Precision]


def _public_classes():
    for module in (lightning_amp, fabric, parallel):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and value.__name__ == name:
                yield value


def test_every_public_class_is_checked_or_says_why_not():
    checked = {cls for cls, _, _ in CHECKED}
    missing = {cls.__name__ for cls in _public_classes()} - {cls.__name__ for cls in checked} - set(NOT_CHECKED)
    assert not missing, f"public classes whose constructor keywords are not checked: {missing}"


@pytest.mark.parametrize("cls, typo, meant", CHECKED, ids=lambda v: getattr(v, "__qualname__", v))
def test_a_misspelt_keyword_names_the_class_and_the_keyword_meant(cls, typo, meant):
    with pytest.raises(TypeError) as info:
        cls(**{typo: 1})
    assert str(info.value) == f"{cls.__name__}() got an unexpected keyword argument {typo!r}; did you mean {meant!r}?"


def test_a_keyword_close_to_none_lists_those_the_class_takes():
    with pytest.raises(TypeError, match=r"LadderRules\(\) got an unexpected keyword argument 'zzz'; it takes "
                                        r"nonfinite_in_a_row, max_skip_rate, .*, snapshot_dir$"):
        lightning_amp.LadderRules(zzz=1)


@pytest.mark.parametrize("option", ["find_unused_parameters", "ddp_comm_hook", "model_averaging_period"])
def test_tp_fused_refuses_the_ddp_wrapper_options_it_has_no_wrapper_for(option):
    """Lightning's DDPStrategy hands unknown keywords to torch's DistributedDataParallel, and its comm-hook keywords
    configure that wrapper; tp_fused has none, so they went unnoticed (ignored). DDPStrategy's keywords for the
    processes stay accepted."""
    for cls in (lightning_amp.TensorParallelStrategy, fabric.TensorParallelStrategy):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{option}'"):
            cls(**{option: 1})
        strategy = cls(start_method="spawn", timeout=None, process_group_backend="gloo")
        assert (strategy._start_method, strategy._timeout, strategy._process_group_backend) == ("spawn", None, "gloo")


@pytest.mark.parametrize("cls", PLUGINS, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("option", sorted(APEX_ONLY_OPTIONS))
def test_an_apex_only_option_names_its_replacement(cls, option):
    with pytest.raises(TypeError) as info:
        cls(**{option: 1})
    message = str(info.value)
    assert message.startswith(f"{cls.__name__}() got an unexpected keyword argument {option!r}, an option of apex's "
                              "amp.initialize that lightning-amp does not have; ")
    assert APEX_ONLY_OPTIONS[option] in message and "docs/migrating-from-apex.md" in message


def _plain(markdown: str) -> str:
    """A table cell as its text reads: no backticks, a link as its text."""
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "").strip()


def test_the_migration_pages_table_of_apex_only_options_is_the_codes():
    text = MIGRATION_PAGE.read_text()
    section = text[text.index("Options of `amp.initialize` with no counterpart"):]
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", section.split("\n\n", 2)[1], re.M)
    assert {name: _plain(cell) for name, cell in rows} == dict(APEX_ONLY_OPTIONS)


@pytest.mark.parametrize("make, words", [
    (lambda: lightning_amp.AmpO2Precision(dtype="fp8"), ["AmpO2Precision: `dtype` must be", "got 'fp8'"]),
    (lambda: fabric.FabricAmpPrecision(opt_level="O7"), ["FabricAmpPrecision: `opt_level` must be", "'O7'"]),
    (lambda: lightning_amp.AmpPrecision(init_scale=-1.0), ["AmpPrecision: `init_scale` must be"]),
    (lambda: lightning_amp.LadderRules(nonfinite_in_a_row=-3),
     ["LadderRules: `nonfinite_in_a_row` must be an integer from 1 to 2**62, or None", "got -3"]),
    (lambda: lightning_amp.LadderRules(max_skip_rate=0.0), ["LadderRules: `max_skip_rate` must be a number in (0, 1]"]),
    (lambda: lightning_amp.LadderRules(spike_factor=1), ["LadderRules: `spike_factor` must be a finite number > 1"]),
    (lambda: lightning_amp.TensorParallelStrategy(tensor_parallel_size=0), ["TensorParallelStrategy: tensor_parallel"]),
])
def test_a_bad_value_names_the_class_and_the_argument_once(make, words):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert all(word in message for word in words), message
    owner = words[0].split(":")[0]
    assert message.count(f"{owner}:") == 1 and "4611686018427387904" not in message
