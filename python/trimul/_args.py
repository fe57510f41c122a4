"""Argument rules shared by the NumPy and PyTorch entry points: cuEquivariance's names, shapes and
precision values, checked once, with messages that name the argument."""

from __future__ import annotations

from typing import Any, Optional

DIRECTIONS = ("outgoing", "incoming")

# cuEquivariance's weight arguments in signature order.
AF3_WEIGHTS = (
    "norm_in_weight",
    "norm_in_bias",
    "p_in_weight",
    "p_in_bias",
    "g_in_weight",
    "g_in_bias",
    "norm_out_weight",
    "norm_out_bias",
    "p_out_weight",
    "p_out_bias",
    "g_out_weight",
    "g_out_bias",
)

# What trimul computes for each `precision` value (cuEquivariance's TriMulPrecision: NONE = -1,
# DEFAULT = 0, TF32 = 1, TF32x3 = 2, IEEE = 3; strings "none", "default", "ieee", "bf16",
# "bfloat16", "mxfp8"). On the GPU the intermediates (left/right, t, the gates) are f16 with f32
# accumulation and f32 LayerNorm statistics; on the CPU everything is f32.
DEFAULT = "default"
BFLOAT16 = "bfloat16"
TF32 = "tf32"
FP32 = "fp32"


def parse_precision(precision: Any) -> str:
    """One of DEFAULT, BFLOAT16, TF32, FP32, or ValueError/TypeError for what trimul cannot honour.

    - None, "none", "default", -1, 0: trimul's default.
    - 1 (TF32), 2 (TF32x3), 3 / "ieee" (IEEE): f32 range (and, but for TF32, f32 accuracy),
      which only the CPU backend computes; the GPU path refuses them rather than run its f16
      intermediates (TF32's 10-bit mantissa, but values only up to 65504) silently.
    - "bfloat16" / "bf16": x, the mask and every weight rounded to bf16 first, the result in
      bf16, as cuEquivariance does.
    - "mxfp8": refused; trimul has no fp8 path.
    """
    if precision is None:
        return DEFAULT
    if isinstance(precision, bool):
        raise TypeError(f"precision must be None, a string or an int, got {precision!r}")
    if isinstance(precision, int):  # also cuEquivariance's IntEnum members
        table = {-1: DEFAULT, 0: DEFAULT, 1: TF32, 2: FP32, 3: FP32}
        if int(precision) not in table:
            raise ValueError(
                f"precision {int(precision)} is not one of -1 (NONE), 0 (DEFAULT), 1 (TF32), 2 (TF32x3), 3 (IEEE)"
            )
        return table[int(precision)]
    if isinstance(precision, str):
        p = precision.strip().lower()
        if p in ("none", "default"):
            return DEFAULT
        if p == "ieee":
            return FP32
        if p in ("bf16", "bfloat16"):
            return BFLOAT16
        if p == "mxfp8":
            raise ValueError("precision='mxfp8': trimul has no fp8 path; use precision=None (f16 intermediates)")
        raise ValueError(f"invalid precision {precision!r}: expected None, 'default', 'none', 'ieee' or 'bfloat16'")
    raise TypeError(f"precision must be None, a string or an int, got {type(precision).__name__}")


def refuse_f32_on_gpu(mode: str, precision: Any) -> None:
    """The ValueError for a `precision` asking for f32 accuracy or range (FP32, TF32) on a GPU,
    whose path keeps f16 intermediates; nothing for the other modes."""
    if mode in (FP32, TF32):
        raise ValueError(
            f"precision={precision!r} asks for {'f32' if mode == FP32 else 'TF32 (f32 exponent range)'} "
            "accuracy, which trimul computes on the CPU only; its GPU path keeps f16 intermediates (10-bit "
            "mantissa, values up to 65504): use precision=None"
        )


def check_direction(direction: Any) -> str:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be either 'outgoing' or 'incoming', got {direction!r}")
    return direction


def check_eps(eps: Any) -> float:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a number, got {eps!r}") from None
    if not (e >= 0.0 and e < float("inf")):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return e


def shape_of(t: Any) -> tuple:
    return tuple(int(d) for d in t.shape)


def check_af3_shapes(x_shape: tuple, mask_shape: Optional[tuple], w: dict) -> tuple:
    """Checks the pair tensor, the mask and cuEquivariance's weights; returns (C, H).

    `x_shape` is `[B, N, N, C]` (leading dims already folded), `mask_shape` `[B, N, N]` or None,
    `w` the twelve weight arguments by name (None where not given). Shapes are tuples of ints
    (torch.Size is one).
    """
    x_shape = tuple(x_shape)
    if mask_shape is not None:
        mask_shape = tuple(mask_shape)
    if len(x_shape) != 4 or x_shape[1] != x_shape[2]:
        raise ValueError(f"x must be [..., N, N, C], got shape {x_shape}")
    b, n, _, c = x_shape
    if n == 0 or b == 0 or c == 0:
        raise ValueError(f"x has shape {x_shape}: B, N and C must each be at least 1")
    if mask_shape is not None and mask_shape != x_shape[:3]:
        raise ValueError(f"mask has shape {mask_shape}, expected {x_shape[:3]} (x without its channel dim)")
    for name in ("p_in_weight", "g_in_weight", "p_out_weight", "g_out_weight"):
        if w[name] is None:
            raise ValueError(
                f"{name} is required (cuEquivariance initialises missing projection weights at random; trimul does not)"
            )
    p_in = tuple(w["p_in_weight"].shape)
    if len(p_in) != 2 or p_in[0] % 2 != 0 or p_in[0] == 0 or p_in[1] != c:
        raise ValueError(f"p_in_weight has shape {p_in}, expected [2H, {c}] with H >= 1")
    h = p_in[0] // 2
    expected = _expected(c, h)
    for name, want in expected.items():
        t = w[name]
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {shape_of(t)}, expected {list(want)} (C = {c}, H = {h})")
    return c, h


_expected_cache: dict = {}


def _expected(c: int, h: int) -> dict:
    """The shape each weight argument must have for pair width C and hidden width H."""
    e = _expected_cache.get((c, h))
    if e is not None:
        return e
    e = _expected_cache[(c, h)] = {
        "norm_in_weight": (c,),
        "norm_in_bias": (c,),
        "p_in_bias": (2 * h,),
        "g_in_weight": (2 * h, c),
        "g_in_bias": (2 * h,),
        "norm_out_weight": (h,),
        "norm_out_bias": (h,),
        "p_out_weight": (c, h),
        "p_out_bias": (c,),
        "g_out_weight": (c, c),
        "g_out_bias": (c,),
    }
    return e


def fold_leading(shape: tuple, dims: int) -> tuple:
    """cuEquivariance's `ensure_dims`: pad with leading 1s, or fold leading dims into the first."""
    if len(shape) < dims:
        return (1,) * (dims - len(shape)) + tuple(shape)
    if len(shape) > dims:
        lead = 1
        for d in shape[: len(shape) - dims + 1]:
            lead *= d
        return (lead,) + tuple(shape[len(shape) - dims + 1 :])
    return tuple(shape)
