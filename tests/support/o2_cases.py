"""Calls of the ops of torch's lower-precision autocast list with fp32 Parameters, as models make them (the rows of
O2's policy registered for exact upcasts: tests/amp/test_o2_policy.py)."""
import torch
import torch.nn.functional as F
from torch import nn


def matmul_cases(x, g):
    """(name, fn) of torch's lower-precision ops with fp32 Parameters, on the half activation ``x`` [4, 6, 8]."""
    def param(*shape):
        return nn.Parameter(torch.randn(*shape, generator=g))

    lw, lb, mw, bw = param(5, 8), param(5), param(8, 5), param(4, 8, 5)
    cw1, cw2, cw3 = param(5, 6, 3), param(5, 4, 3, 3), param(5, 1, 2, 3, 3)
    ct1, ct2, ct3, pw = param(6, 5, 3), param(4, 5, 3, 3), param(1, 5, 2, 2, 2), param(6)
    return [
        ("linear", lambda: F.linear(x, lw, lb)),
        ("matmul", lambda: torch.matmul(x, mw)),
        ("mm", lambda: torch.mm(x[0], mw)),
        ("addmm", lambda: torch.addmm(lb, x[0], mw)),
        ("bmm", lambda: torch.bmm(x, bw)),
        ("baddbmm", lambda: torch.baddbmm(lb, x, bw)),
        ("addbmm", lambda: torch.addbmm(lb, x, bw)),
        ("conv1d", lambda: F.conv1d(x, cw1, lb)),
        ("conv2d", lambda: F.conv2d(x[None], cw2, lb)),
        ("conv3d", lambda: F.conv3d(x[None, None], cw3, lb)),
        ("conv_transpose1d", lambda: F.conv_transpose1d(x, ct1, lb)),
        ("conv_transpose2d", lambda: F.conv_transpose2d(x[None], ct2, lb)),
        ("conv_transpose3d", lambda: F.conv_transpose3d(x[None, None], ct3, lb)),
        ("prelu", lambda: F.prelu(x, pw)),
    ]
