"""Keywords of apex's fused optimizers given to ours: mapped with a FutureWarning saying what to use,
or refused with a TypeError naming the replacement (issue 25, item 4)."""
import warnings

import pytest
import torch

from lightning_amp import FusedAdadelta, FusedAdam, FusedLAMB, FusedSGD


def _params():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]


def _train(optimizer_cls, steps=3, **kwargs):
    """A few steps on fresh random grads; the params after them."""
    params = _params()
    optimizer = optimizer_cls(params, lr=0.1, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedSGD])
@pytest.mark.parametrize("value", [True, False])
def test_set_grad_none_maps_to_zero_grads_default_with_a_warning(cls, value):
    params = _params()
    with pytest.warns(FutureWarning, match=rf"set_grad_none={value}.*zero_grad\(set_to_none={value}\)"):
        optimizer = cls(params, lr=0.1, set_grad_none=value)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.zero_grad()
    for p in params:
        assert (p.grad is None) if value else torch.equal(p.grad, torch.zeros_like(p))
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.zero_grad(set_to_none=not value)  # an explicit argument wins
    for p in params:
        assert (p.grad is None) if not value else torch.equal(p.grad, torch.zeros_like(p))


def test_zero_grad_default_is_torchs_without_apex_keywords():
    params = _params()
    optimizer = FusedAdam(params)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("cls, keywords", [
    (FusedAdam, {"capturable": False}),
    (FusedLAMB, {"amsgrad": False}),
    (FusedSGD, {"wd_after_momentum": False, "materialize_master_grads": True}),
    (FusedSGD, {"materialize_master_grads": False}),
])
def test_no_effect_keywords_warn_and_change_nothing(cls, keywords):
    extra = {"momentum": 0.9, "weight_decay": 0.01} if cls is FusedSGD else {}
    plain = _train(cls, **extra)
    with pytest.warns(FutureWarning, match="no effect.*drop it") as record:
        mapped = _train(cls, **extra, **keywords)
    assert len(record) == len(keywords)
    for a, b in zip(plain, mapped):
        assert torch.equal(a, b)
    assert not torch.equal(plain[0], _params()[0])  # the steps did move the params


@pytest.mark.parametrize("cls, keyword, replacement", [
    (FusedAdam, "capturable", r"torch\.optim\.AdamW\(\.\.\., fused=True, capturable=True\)"),
    (FusedLAMB, "amsgrad", r"FusedAdam\(\.\.\., amsgrad=True\)"),
    (FusedSGD, "wd_after_momentum", "weight decay before momentum"),
])
def test_keywords_with_no_equivalent_raise_naming_the_replacement(cls, keyword, replacement):
    with pytest.raises(TypeError, match=rf"{cls.__name__}\({keyword}=True\).*{replacement}"):
        cls(_params(), lr=0.1, **{keyword: True})


@pytest.mark.parametrize("cls, keyword", [(FusedAdam, "set_grad_none"), (FusedAdam, "capturable"),
                                          (FusedLAMB, "amsgrad"), (FusedSGD, "wd_after_momentum"),
                                          (FusedSGD, "materialize_master_grads")])
@pytest.mark.parametrize("bad", ["True", 1, None])
def test_bad_values_raise_naming_the_keyword_and_the_allowed_values(cls, keyword, bad):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: `{keyword}` must be True or False.*got {bad!r}"):
        cls(_params(), lr=0.1, **{keyword: bad})


@pytest.mark.parametrize("cls, keyword", [(FusedAdam, "amsgrad_typo"), (FusedAdam, "wd_after_momentum"),
                                          (FusedLAMB, "capturable"), (FusedSGD, "capturable"),
                                          (FusedAdadelta, "set_grad_none")])
def test_other_keywords_raise_as_python_does(cls, keyword):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and nothing is warned first
        with pytest.raises(TypeError, match=rf"{cls.__name__}.__init__\(\) got an unexpected keyword argument "
                                            rf"'{keyword}'"):
            cls(_params(), lr=0.1, **{keyword: False})
