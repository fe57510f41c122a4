"""The triangle multiplicative update written with PyTorch operations.

Used as the recomputation behind the op's backward (until a native backward exists) and by the
tests as a second, independent formula. Both formulations, in the notation of SPEC.md:

af3 (AF3 Algorithm 12/13; cuEquivariance's function)::

    z = LN_C(x)
    a, b = split(sigmoid(z @ g_in.T + g_in_b) * (z @ p_in.T + p_in_b) * mask)    # [..., H] each
    t = contraction(a, b)          # outgoing: t_ij = sum_k a_ik b_jk; incoming: sum_k a_ki b_kj
    y = sigmoid(z @ g_out.T + g_out_b) * (LN_H(t) @ p_out.T + p_out_b)

gpumode (lucidrains / GPU MODE)::

    z = LN_C(x)
    left = (z @ Wlp.T) * mask * sigmoid(z @ Wlg.T); right likewise
    y = (LN_H(t) * sigmoid(z @ Wog.T)) @ Wout.T
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def contract(a: Tensor, b: Tensor, direction: str) -> Tensor:
    """`t[..., i, j, h]` from `a`, `b` `[..., N, N, H]` in `direction`."""
    if direction == "outgoing":
        return torch.einsum("...ikh,...jkh->...ijh", a, b)
    if direction == "incoming":
        return torch.einsum("...kih,...kjh->...ijh", a, b)
    raise ValueError(f"direction must be 'outgoing' or 'incoming', got {direction!r}")


def af3(
    x: Tensor,
    mask: Optional[Tensor],
    weights: Sequence[Optional[Tensor]],
    direction: str = "outgoing",
    eps: float = 1e-5,
    contraction: Callable[[Tensor, Tensor, str], Tensor] = contract,
) -> Tensor:
    """cuEquivariance's formula in the dtype of `x` (pass f32 or f64 tensors for an accurate one),
    the twelve weights in its signature's order (`AF3_WEIGHTS`: norm_in, p_in, g_in, norm_out,
    p_out, g_out, each weight then bias; a bias or a LayerNorm parameter may be None).
    `contraction(a, b, direction)` gives t from a and b (the sharded call passes one that
    exchanges a rank's rows with the other ranks)."""
    (norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight, g_in_bias) = weights[:6]
    (norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight, g_out_bias) = weights[6:]
    c = x.shape[-1]
    h = p_in_weight.shape[0] // 2
    z = F.layer_norm(x, (c,), norm_in_weight, norm_in_bias, eps)
    ab = torch.sigmoid(F.linear(z, g_in_weight, g_in_bias)) * F.linear(z, p_in_weight, p_in_bias)
    if mask is not None:
        ab = ab * mask.unsqueeze(-1).to(ab.dtype)
    t = contraction(ab[..., :h], ab[..., h:], direction)
    u = F.layer_norm(t, (h,), norm_out_weight, norm_out_bias, eps)
    return torch.sigmoid(F.linear(z, g_out_weight, g_out_bias)) * F.linear(u, p_out_weight, p_out_bias)


def gpumode(x: Tensor, mask: Optional[Tensor], weights: dict, direction: str = "outgoing", eps: float = 1e-5) -> Tensor:
    """GPU MODE's reference module (weights named as its harness names them)."""
    c = x.shape[-1]
    h = weights["left_proj.weight"].shape[0]
    z = F.layer_norm(x, (c,), weights["norm.weight"], weights["norm.bias"], eps)
    m = 1.0 if mask is None else mask.unsqueeze(-1).to(z.dtype)
    left = F.linear(z, weights["left_proj.weight"]) * m * torch.sigmoid(F.linear(z, weights["left_gate.weight"]))
    right = F.linear(z, weights["right_proj.weight"]) * m * torch.sigmoid(F.linear(z, weights["right_gate.weight"]))
    t = contract(left, right, direction)
    u = F.layer_norm(t, (h,), weights["to_out_norm.weight"], weights["to_out_norm.bias"], eps)
    return F.linear(u * torch.sigmoid(F.linear(z, weights["out_gate.weight"])), weights["to_out.weight"])
