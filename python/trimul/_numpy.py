"""The NumPy path: arrays in host memory, run by the library's host API on the CPU backend (or
the backend `TRIMUL_BACKEND` names: `cuda`, or `hip`, whose host-staged path the fake-ROCm tests
drive from here)."""

from __future__ import annotations

import numpy as np

from . import _args, _trimul

_CODES = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}


def _array(t, name: str) -> np.ndarray:
    a = np.asarray(t)
    if a.dtype == np.float64:
        a = a.astype(np.float32)
    if a.dtype not in _CODES:
        raise TypeError(f"{name} has dtype {a.dtype}; trimul takes float32 or float16 arrays (float64 is converted)")
    return _contiguous(a)


def _contiguous(a: np.ndarray, dtype=None) -> np.ndarray:
    """C-contiguous and aligned to its element type (a view of a byte buffer can be neither)."""
    return np.require(a, dtype=dtype, requirements=["C", "A"])


def _whole(a, name):
    return None if a is None else (a.ctypes.data, a.size, _CODES[a.dtype])


def _half(a, i, name):
    if a is None:
        return None
    n = a.size // 2
    return (a.ctypes.data + i * n * a.itemsize, n, _CODES[a.dtype])


def update(x, direction, mask, weights: dict, eps, precision) -> np.ndarray:
    """cuEquivariance's `triangle_multiplicative_update` for NumPy arrays (see `trimul`)."""
    direction = _args.check_direction(direction)
    eps = _args.check_eps(eps)
    mode = _args.parse_precision(precision)
    if mode == _args.BFLOAT16:
        raise ValueError("precision='bfloat16' needs torch tensors: NumPy has no bfloat16 dtype")
    xa = np.asarray(x)
    if xa.dtype not in _CODES:
        raise TypeError(f"x has dtype {xa.dtype}; trimul takes float32 or float16 arrays")
    original_shape = xa.shape
    x4 = _contiguous(xa.reshape(_args.fold_leading(xa.shape, 4)))
    m3 = None
    if mask is not None:
        m = np.asarray(mask)
        m3 = _contiguous(m.reshape(_args.fold_leading(m.shape, 3)), np.float32)
    w = {k: None if v is None else _array(v, k) for k, v in weights.items()}
    c, h = _args.check_af3_shapes(x4.shape, None if m3 is None else m3.shape, w)
    if w["norm_in_weight"] is None:
        w["norm_in_weight"] = np.ones(c, np.float32)
    if w["norm_in_bias"] is None:
        w["norm_in_bias"] = np.zeros(c, np.float32)
    if w["norm_out_weight"] is None:
        w["norm_out_weight"] = np.ones(h, np.float32)
    if w["norm_out_bias"] is None:
        w["norm_out_bias"] = np.zeros(h, np.float32)
    entries = [
        _whole(w["norm_in_weight"], "norm_in_weight"),
        _whole(w["norm_in_bias"], "norm_in_bias"),
        _half(w["p_in_weight"], 0, "p_in_weight"),
        _half(w["p_in_bias"], 0, "p_in_bias"),
        _half(w["g_in_weight"], 0, "g_in_weight"),
        _half(w["g_in_bias"], 0, "g_in_bias"),
        _half(w["p_in_weight"], 1, "p_in_weight"),
        _half(w["p_in_bias"], 1, "p_in_bias"),
        _half(w["g_in_weight"], 1, "g_in_weight"),
        _half(w["g_in_bias"], 1, "g_in_bias"),
        _whole(w["g_out_weight"], "g_out_weight"),
        _whole(w["g_out_bias"], "g_out_bias"),
        _whole(w["norm_out_weight"], "norm_out_weight"),
        _whole(w["norm_out_bias"], "norm_out_bias"),
        _whole(w["p_out_weight"], "p_out_weight"),
        _whole(w["p_out_bias"], "p_out_bias"),
    ]
    layer = _trimul.HostLayer("af3", c, h, direction, eps, entries, None)
    y = np.empty_like(x4)
    layer.forward(
        x4.ctypes.data,
        x4.size,
        0 if m3 is None else m3.ctypes.data,
        0 if m3 is None else m3.size,
        y.ctypes.data,
        y.size,
        x4.shape[0],
        x4.shape[1],
        _CODES[x4.dtype],
    )
    return y.reshape(original_shape)
