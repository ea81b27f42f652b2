"""Keywords of apex's fused optimizers that lightning-amp's optimizers do not have.

A script ported from apex may still pass them. Each one either maps onto what lightning-amp does
(a ``FutureWarning`` says what to write instead) or, where no value of ours means the same, raises
``TypeError`` naming the replacement:

=========================  ================  ====================================================
keyword                    optimizers        handling
=========================  ================  ====================================================
``set_grad_none``          Adam, LAMB, SGD   mapped: the default of ``zero_grad(set_to_none=...)``
``capturable=False``       Adam              mapped: no effect (apex's default)
``capturable=True``        Adam              TypeError: ``torch.optim.AdamW(fused=True, capturable=True)``
``amsgrad=False``          LAMB              mapped: no effect (apex's LAMB had no AMSGrad either)
``amsgrad=True``           LAMB              TypeError: ``FusedAdam(amsgrad=True)`` (apex raised too)
``wd_after_momentum``      SGD               False mapped (torch's order); True: TypeError
``materialize_master_grads``  SGD            mapped: no effect (O2's grads are fp32 already)
=========================  ================  ====================================================

Values must be True or False (ValueError otherwise); any other unknown keyword is a TypeError as
Python's own.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Sequence

_NO_EFFECT = {
    ("capturable", False): "apex's default; lightning_amp.FusedAdam never captures CUDA graphs",
    ("amsgrad", False): "apex's FusedLAMB had no AMSGrad variant either",
    ("wd_after_momentum", False): "weight decay is added to the grad before momentum, as apex's default and "
                                  "torch.optim.SGD do",
    ("materialize_master_grads", False): "under O2 the grads already live on the fp32 params",
    ("materialize_master_grads", True): "under O2 the grads already live on the fp32 params",
}

_REFUSED = {
    ("capturable", True): "apex's CUDA-graph capturable mode is not supported; use "
                          "torch.optim.AdamW(..., fused=True, capturable=True), which lightning-amp's plugins "
                          "step with in-kernel unscaling as they do FusedAdam",
    ("amsgrad", True): "LAMB has no AMSGrad variant (apex's FusedLAMB raised too); use "
                       "lightning_amp.FusedAdam(..., amsgrad=True)",
    ("wd_after_momentum", True): "lightning_amp.FusedSGD adds weight decay before momentum, as torch.optim.SGD "
                                 "does; drop the keyword and retune weight_decay, or decay the weights yourself "
                                 "after optimizer.step()",
}


def take_apex_keywords(optimizer: str, given: Mapping[str, Any], accepted: Sequence[str]) -> Optional[bool]:
    """Handle the apex-only keywords ``given`` to ``optimizer`` (its class name), of which it knows
    ``accepted``: warn about each mapped one, raise for the rest (see the module docstring).

    Returns ``set_grad_none``'s value (the default of ``zero_grad``'s ``set_to_none``), or None when
    it was not given.
    """
    for key in given:
        if key not in accepted:
            raise TypeError(f"{optimizer}.__init__() got an unexpected keyword argument {key!r}")
    set_grad_none = None
    for key, value in given.items():
        if not isinstance(value, bool):
            raise ValueError(f"{optimizer}: `{key}` must be True or False (apex's keyword); got {value!r}")
        if key == "set_grad_none":
            set_grad_none = value
            _deprecated(optimizer, key, value, f"call optimizer.zero_grad(set_to_none={value}) instead; until "
                                               f"then this optimizer's zero_grad() defaults to set_to_none={value}")
        elif (key, value) in _NO_EFFECT:
            _deprecated(optimizer, key, value, f"it has no effect ({_NO_EFFECT[key, value]}): drop it")
        else:
            raise TypeError(f"{optimizer}({key}={value}): {_REFUSED[key, value]}.")
    return set_grad_none


def _deprecated(optimizer: str, key: str, value: bool, advice: str) -> None:
    warnings.warn(f"lightning_amp.{optimizer}: `{key}={value}` is a keyword of apex's optimizer, kept for ported "
                  f"scripts and deprecated: {advice}.", FutureWarning, stacklevel=4)
