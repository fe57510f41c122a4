"""trimul: the triangle multiplicative update of AlphaFold3-style models (Boltz, OpenFold3,
Protenix, Chai), on NVIDIA GPUs, AMD GPUs and the CPU.

Switching from cuEquivariance is an import change::

    from trimul import triangle_multiplicative_update   # was: from cuequivariance_torch import ...

`triangle_multiplicative_update` takes cuEquivariance 0.13's arguments and returns what it
returns; `trimul.gpumode.custom_kernel` takes GPU MODE's `trimul` task data. See the README for
what runs where and what each `precision` value computes.
"""

from __future__ import annotations

import sys as _sys
from typing import Any, Optional

from . import _args, _trimul

__version__ = _trimul.__version__
_WEIGHT_NAMES = _args.AF3_WEIGHTS

__all__ = [
    "triangle_multiplicative_update",
    "patch_cuequivariance",
    "unpatch_cuequivariance",
    "clear_cache",
    "set_launch_graphs",
    "info",
    "__version__",
]


def triangle_multiplicative_update(
    x,
    direction: str = "outgoing",
    mask=None,
    norm_in_weight=None,
    norm_in_bias=None,
    p_in_weight=None,
    p_in_bias=None,
    g_in_weight=None,
    g_in_bias=None,
    norm_out_weight=None,
    norm_out_bias=None,
    p_out_weight=None,
    p_out_bias=None,
    g_out_weight=None,
    g_out_bias=None,
    eps: float = 1e-5,
    precision: Optional[Any] = None,
):
    """The triangle multiplicative update (AF3 Algorithm 12/13), cuEquivariance's signature.

    ``x`` is ``[..., N, N, C]`` (any number of leading dims, including none), ``mask``
    ``[..., N, N]`` of any dtype (0/1 values), ``p_in_weight``/``g_in_weight`` ``[2H, C]`` with
    the ``a`` (left) rows first, ``p_out_weight`` ``[C, H]``, ``g_out_weight`` ``[C, C]``, biases
    optional. Missing LayerNorm parameters default to weight 1, bias 0, as in cuEquivariance; a
    missing projection weight is a ``ValueError`` (cuEquivariance draws one at random).

    Returns the update (no residual) with the shape of ``x``, in ``x``'s dtype (bfloat16 with
    ``precision="bfloat16"``). Torch tensors on CUDA run in-process on the current stream; CPU
    tensors and NumPy arrays on the CPU backend (or the one ``TRIMUL_BACKEND`` names).
    """
    # The weights in signature order (`AF3_WEIGHTS`'s), as the fast path and the checks take them.
    w = (
        norm_in_weight,
        norm_in_bias,
        p_in_weight,
        p_in_bias,
        g_in_weight,
        g_in_bias,
        norm_out_weight,
        norm_out_bias,
        p_out_weight,
        p_out_bias,
        g_out_weight,
        g_out_bias,
    )
    if _torch_module is not None and precision is None and _torch_module._direct(x, w):
        # Weights this stream prepared before: checked then, and still the same tensors.
        y = _torch_module.cached_call(x, mask, w, direction, eps)
        if y is not None:
            return y
    weights = dict(zip(_WEIGHT_NAMES, w))
    if _is_numpy(x):
        from . import _numpy

        return _numpy.update(x, direction, mask, weights, eps, precision)
    try:
        from . import _torch
    except ImportError as e:
        raise TypeError(f"x is a {type(x).__name__}; without PyTorch trimul takes numpy arrays ({e})") from None
    _remember(_torch)
    return _torch.update(x, direction, mask, weights, eps, precision)


# The PyTorch path once a call has imported it (the fast path above needs no import per call).
# Bound at import when PyTorch is already loaded, so the global does not change under a
# `torch.compile` trace of the first call (which would cost a recompilation).
_torch_module = None


def _remember(module) -> None:
    global _torch_module
    _torch_module = module


def _is_numpy(x) -> bool:
    try:
        import numpy as np
    except ImportError:
        return False
    return isinstance(x, np.ndarray)


def patch_cuequivariance() -> list[str]:
    """Makes code written for cuEquivariance's ``triangle_multiplicative_update`` call trimul's,
    without editing it: Boltz, OpenFold3 and other models whose kernel options call
    cuEquivariance's function then run trimul for it. Returns the names of the modules changed.

    ``cuequivariance_torch`` must be installed (``ModuleNotFoundError`` otherwise: without it, call
    ``trimul.triangle_multiplicative_update`` where the model calls it). Its function is replaced
    in the package, in ``cuequivariance_torch.primitives.triangle`` (where Boltz imports it from in
    every call) and in every module global, under any name, that is bound to it (OpenFold3 binds
    it at import); modules imported later get trimul's from the package. cuEquivariance's other
    operations, triangle attention among them, stay its own.

    ``unpatch_cuequivariance`` undoes it.
    """
    from . import _cueq_patch

    return _cueq_patch.patch(triangle_multiplicative_update)


def unpatch_cuequivariance() -> None:
    """Undoes ``patch_cuequivariance``: every global it rebound is cuEquivariance's function
    again. Modules imported after the patch keep the trimul function they bound then."""
    from . import _cueq_patch

    _cueq_patch.unpatch()


def set_launch_graphs(on: bool) -> bool:
    """Whether CUDA forwards from now on are enqueued as one CUDA-graph replay each (the default,
    unless ``TRIMUL_CUDA_GRAPHS=0``) or as their two kernel launches and cuBLASLt call; returns the
    setting it replaces.

    A replay costs a fraction of the launches' host time. The second call of each layer and shape
    captures its launches into a graph, and while it does, another thread that synchronises the
    device (``torch.cuda.synchronize()``, freeing memory with ``cudaFree``) gets an error: a
    program whose threads share a GPU that way can turn graphs off here.
    """
    was = _trimul.launch_graphs_on()
    _trimul.set_launch_graphs(bool(on))
    return was


def clear_cache() -> None:
    """Forgets every weight set prepared for PyTorch calls (they are prepared again on next use).

    Needed only after writing weights in a way PyTorch's version counter does not see (through
    ``.data``, DLPack or raw pointers); ordinary in-place updates such as optimizer steps are seen.
    """
    try:
        from . import _torch
    except ImportError:
        return
    _torch.clear_cache()
    _torch._host_cache.clear()


def info() -> str:
    """What this build has: backends compiled in, the host backend, and the CUDA device if any."""
    lines = [f"trimul {__version__}; backends compiled in: {', '.join(_trimul.compiled_backends())}"]
    try:
        lines.append(f"host arrays run on: {_trimul.host_backend()}")
    except Exception as e:  # noqa: BLE001 - report, do not fail
        lines.append(f"host arrays: {e}")
    import sys

    torch = sys.modules.get("torch")
    before = torch.cuda.current_device() if torch is not None and torch.cuda.is_initialized() else None
    try:
        lines.append(f"CUDA device 0: {_trimul.cuda_info(0)}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"CUDA: {e}")
    finally:
        if before is not None:  # opening device 0 made its context current on this thread
            torch.cuda.set_device(before)
    return "\n".join(lines)


del _args


if "torch" in _sys.modules:
    try:
        from . import _torch as _loaded_torch_path

        _remember(_loaded_torch_path)
        del _loaded_torch_path
    except ImportError:  # a PyTorch too old or broken: the first call says so
        pass
