"""O-level table, dtype resolution and override validation (lightning_amp.amp.levels)."""
import dataclasses

import pytest
import torch

from lightning_amp.amp.levels import LEVEL_DEFAULTS, AmpProperties, resolve_dtype, resolve_properties

# apex's table, written out independently of the module's records; O2 forwards under autocast (with its
# own op policy) where apex cast the model: lightning-amp's design (docs/o2-design.md)
APEX_TABLE = {
    #       cast_model autocast keep_bn master  loss_scale  outputs
    "O0": (False, False, False, False, 1.0, None),
    "O1": (False, True, False, False, "dynamic", None),
    "O2": (True, True, True, True, "dynamic", torch.float32),
    "O3": (True, False, False, False, 1.0, None),
}
# lightning-amp's two O2 options: (half_buffers, norm_policy)
O2_OPTIONS = {"O0": (False, None), "O1": (False, None), "O2": (False, "half"), "O3": (True, None)}


@pytest.mark.parametrize("level", sorted(APEX_TABLE))
def test_level_defaults_follow_apex_table_with_fp16(level):
    props = resolve_properties(level, dtype="float16")
    cast_model, autocast, keep_bn, master, scale, outputs = APEX_TABLE[level]
    assert props.opt_level == level
    assert props.cast_model is cast_model
    assert props.autocast is autocast
    assert props.keep_batchnorm_fp32 is keep_bn
    assert props.master_weights is master
    assert props.loss_scale == scale
    assert props.cast_model_outputs == outputs
    assert props.dtype == (torch.float32 if level == "O0" else torch.float16)
    assert (props.half_buffers, props.norm_policy) == O2_OPTIONS[level]


@pytest.mark.parametrize("level", sorted(APEX_TABLE))
def test_bf16_turns_default_scaling_off_but_keeps_explicit_scales(level):
    assert resolve_properties(level, dtype="bfloat16").loss_scale == 1.0
    assert resolve_properties(level, dtype="bf16", loss_scale=128).loss_scale == 128.0
    assert resolve_properties(level, dtype=torch.bfloat16, loss_scale="dynamic").loss_scale == "dynamic"


def test_level_records_are_frozen():
    for props in LEVEL_DEFAULTS.values():
        with pytest.raises(dataclasses.FrozenInstanceError):
            props.loss_scale = 3.0
    resolved = resolve_properties("O2", dtype="fp16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.master_weights = False
    with pytest.raises(TypeError):
        LEVEL_DEFAULTS["O5"] = resolved  # the table itself is read-only


def test_resolution_does_not_mutate_level_defaults():
    before = dict(LEVEL_DEFAULTS)
    resolve_properties("O2", dtype="bf16", keep_batchnorm_fp32=False, master_weights=False, loss_scale=4.0)
    assert dict(LEVEL_DEFAULTS) == before
    assert LEVEL_DEFAULTS["O2"].keep_batchnorm_fp32 and LEVEL_DEFAULTS["O2"].loss_scale == "dynamic"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("half", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("BF16", torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
    ],
)
def test_resolve_dtype_names(spec, expected):
    assert resolve_dtype(spec, "cpu") is expected
    assert resolve_dtype(spec, "cuda") is expected


def test_auto_dtype_is_bf16_on_cpu_and_follows_cuda_support():
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    assert resolve_dtype("auto", "cuda") is (torch.bfloat16 if cuda_bf16 else torch.float16)
    assert resolve_properties("O1", device_type="cpu").dtype is torch.bfloat16


@pytest.mark.parametrize("native, emulated, want", [(True, True, torch.bfloat16), (False, True, torch.float16),
                                                    (False, False, torch.float16)])
def test_auto_dtype_takes_bf16_only_where_the_gpu_has_it_natively(monkeypatch, native, emulated, want):
    """A V100 or T4 emulates bf16 (slowly): torch's is_bf16_supported() says yes by default there, and "auto" must
    take float16 (stubbed torch.cuda: the answer of a GPU of each kind)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or (including_emulation and emulated))
    assert resolve_dtype("auto", "cuda") is want


@pytest.mark.parametrize("bad", ["float32", "int8", "", torch.float32, torch.int32, 16, None])
def test_resolve_dtype_rejects_everything_else(bad):
    with pytest.raises(ValueError, match="`dtype`.*bfloat16"):
        resolve_dtype(bad, "cpu")
    if bad not in ("float32", torch.float32):  # fp32 is a valid request only for O0
        with pytest.raises(ValueError, match="`dtype`"):
            resolve_properties("O0", dtype=bad)
    with pytest.raises(ValueError, match="`dtype`"):
        resolve_properties("O2", dtype=bad)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "auto", "float32", torch.float32, torch.float16])
def test_o0_is_always_fp32(spec):
    assert resolve_properties("O0", dtype=spec).dtype is torch.float32


def test_overrides_replace_level_defaults():
    props = resolve_properties(
        "O2", dtype="fp16", loss_scale=128.0, keep_batchnorm_fp32=False, master_weights=False,
        cast_model_outputs=torch.float16,
    )
    assert (props.loss_scale, props.keep_batchnorm_fp32, props.master_weights) == (128.0, False, False)
    assert props.cast_model_outputs is torch.float16
    o3 = resolve_properties("O3", dtype="fp16", keep_batchnorm_fp32=True, master_weights=True)
    assert o3.keep_batchnorm_fp32 and o3.master_weights and o3.cast_model
    assert resolve_properties("O1", dtype="fp16", master_weights=False).master_weights is False
    assert resolve_properties("O0", cast_model_outputs="float64").cast_model_outputs is torch.float64
    assert isinstance(resolve_properties("O1", loss_scale=7).loss_scale, float)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_apex_argparse_strings_mean_what_they_meant_in_apex(level):
    """apex's examples pass ``--loss-scale 128.0 --keep-batchnorm-fp32 True`` through argparse as strings."""
    assert resolve_properties(level, dtype="fp16", loss_scale="128.0").loss_scale == 128.0
    assert resolve_properties(level, dtype="fp16", loss_scale=" 1e3 ").loss_scale == 1000.0
    assert resolve_properties(level, dtype="fp16", loss_scale="dynamic").loss_scale == "dynamic"
    if level in ("O2", "O3"):
        for text, value in (("True", True), ("False", False)):
            props = resolve_properties(level, dtype="fp16", keep_batchnorm_fp32=text, master_weights=text)
            assert props.keep_batchnorm_fp32 is value and props.master_weights is value
    else:  # the model is not cast: the string contradicts the level as True/False do
        with pytest.raises(ValueError, match="`keep_batchnorm_fp32` must be None"):
            resolve_properties(level, dtype="fp16", keep_batchnorm_fp32="True")
        assert resolve_properties(level, dtype="fp16", master_weights="False").master_weights is False


def test_lowercase_level_is_accepted():
    assert resolve_properties("o2", dtype="fp16") == resolve_properties("O2", dtype="fp16")


@pytest.mark.parametrize("bad", ["O4", "O", "", "00", "01", 1, None, "fp16"])
def test_unknown_opt_level(bad):
    with pytest.raises(ValueError, match="`opt_level`.*O0, O1, O2, O3"):
        resolve_properties(bad)


def test_zero_instead_of_letter_o_gets_a_hint():
    with pytest.raises(ValueError, match="letter O"):
        resolve_properties("02")


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, -128, float("inf"), float("nan"), "static", "Dynamic", True, [1.0],
                                 "0", "-128.0", "inf", "nan", "128.0x", ""])
def test_bad_loss_scale(bad):
    with pytest.raises(ValueError, match="`loss_scale`.*dynamic.*positive"):
        resolve_properties("O2", dtype="fp16", loss_scale=bad)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_master_weights_contradicts_uncast_levels(level):
    with pytest.raises(ValueError, match="`master_weights=True`.*" + level):
        resolve_properties(level, dtype="fp16", master_weights=True)


@pytest.mark.parametrize("level", ["O0", "O1"])
@pytest.mark.parametrize("value", [True, False])
def test_keep_batchnorm_fp32_contradicts_uncast_levels(level, value):
    with pytest.raises(ValueError, match="`keep_batchnorm_fp32` must be None.*" + level):
        resolve_properties(level, dtype="fp16", keep_batchnorm_fp32=value)


@pytest.mark.parametrize("name", ["keep_batchnorm_fp32", "master_weights"])
@pytest.mark.parametrize("bad", [1, 0, "yes", "true", "FALSE", "1", ""])
def test_boolean_overrides_must_be_bool(name, bad):
    with pytest.raises(ValueError, match=f"`{name}`.*True, False or None"):
        resolve_properties("O2", dtype="fp16", **{name: bad})


@pytest.mark.parametrize("bad", [torch.int64, "int8", 32, "fp8"])
def test_bad_cast_model_outputs(bad):
    with pytest.raises(ValueError, match="`cast_model_outputs`"):
        resolve_properties("O2", dtype="fp16", cast_model_outputs=bad)


def test_helper_properties():
    o1 = resolve_properties("O1", dtype="fp16")
    assert o1.dynamic_loss_scale and o1.scaling_enabled
    o2_bf16 = resolve_properties("O2", dtype="bf16")
    assert not o2_bf16.dynamic_loss_scale and not o2_bf16.scaling_enabled
    static = resolve_properties("O3", dtype="fp16", loss_scale=128.0)
    assert not static.dynamic_loss_scale and static.scaling_enabled
    assert isinstance(static, AmpProperties)


def test_o2_options_half_buffers_and_norm_policy():
    o2 = resolve_properties("O2", dtype="bf16", half_buffers=True, norm_policy=" FP32 ")
    assert o2.half_buffers and o2.norm_policy == "fp32"
    assert resolve_properties("O2", dtype="bf16", master_weights=False).half_buffers  # the whole model is half
    assert resolve_properties("O3", dtype="bf16", half_buffers=True).half_buffers


@pytest.mark.parametrize("level, kwargs, match", [
    ("O0", {"half_buffers": True}, "`half_buffers` must be None with opt_level O0"),
    ("O1", {"half_buffers": False}, "`half_buffers` must be None with opt_level O1"),
    ("O3", {"half_buffers": False}, "`half_buffers=False` needs fp32 master weights.*O3"),
    ("O2", {"half_buffers": False, "master_weights": False}, "`half_buffers=False` needs fp32 master weights"),
    ("O2", {"half_buffers": "yes"}, "`half_buffers` must be True, False or None"),
    ("O1", {"norm_policy": "half"}, "`norm_policy` applies to opt_level O2 only.*O1"),
    ("O3", {"norm_policy": "fp32"}, "`norm_policy` applies to opt_level O2 only.*O3"),
    ("O2", {"norm_policy": "bf16"}, '`norm_policy` must be "half".*"fp32".*None; got \'bf16\''),
    ("O2", {"norm_policy": True}, "`norm_policy` must be"),
    ("O2", {"norm_policy": "fp32", "keep_batchnorm_fp32": False}, "`keep_batchnorm_fp32=False` with `norm_policy"),
])
def test_o2_options_refuse_bad_values_and_contradictions(level, kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_properties(level, dtype="bf16", **kwargs)


def test_fp32_params_is_what_apexs_master_weights_keyword_sets():
    """``fp32_params`` names the layout (the module's own params stay fp32); ``master_weights`` is apex's keyword
    for it and, read from the record, a deprecated alias."""
    assert resolve_properties("O2", dtype="fp16").fp32_params is True
    assert resolve_properties("O2", dtype="fp16", master_weights=False).fp32_params is False
    props = resolve_properties("O2", dtype="fp16")
    with pytest.warns(DeprecationWarning, match="use AmpProperties.fp32_params"):
        assert props.master_weights is True
