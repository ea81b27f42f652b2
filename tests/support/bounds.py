"""Rounding-error bounds that tests derive their tolerances from, instead of a number that passed once.

A floating-point sum of ``n`` terms computed in any order (the CPU's vector width, a BLAS's blocking, a
compiler's fusion) lies within ``gamma_n * sum |term_i|`` of the exact sum, ``gamma_n = n u / (1 - n u)``
with ``u`` the unit roundoff (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.5 and
Lemma 3.1); a product of two numbers adds one more ``u``. Two implementations of the same sum that both obey
the bound therefore lie within twice it of each other, on any CPU. A real bug (a term lost or counted twice,
a product rounded to 16 bits) moves the result by a sizeable fraction of ``sum |term_i|``, orders of
magnitude above ``gamma_n`` for the small ``n`` of the tests.
"""
import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the distance from 1 to the next number of ``dtype`` (2**-24 for fp32)."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``n u / (1 - n u)``: the relative bound of ``n`` roundings in a row."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma({n}) is not a bound in {dtype}"
    return nu / (1 - nu)


def two_orders_apart(abs_sum: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise: how far two computations of the same sums of ``n`` products may lie apart, where
    ``abs_sum`` holds ``sum |a_i b_i|`` of each element (any float dtype; computed in float64 by the caller)."""
    return 2 * gamma(n + 1, dtype) * abs_sum
