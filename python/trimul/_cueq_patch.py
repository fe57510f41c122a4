"""`trimul.patch_cuequivariance`: code written for cuEquivariance's triangle multiplicative update
runs trimul's instead, without editing it.

Models reach cuEquivariance's function in three ways, all of which this covers:

- through the package, ``from cuequivariance_torch import triangle_multiplicative_update`` or
  ``cuequivariance_torch.triangle_multiplicative_update(...)`` (OpenFold3 binds the name when its
  module is imported);
- through its submodule, ``from cuequivariance_torch.primitives.triangle import
  triangle_multiplicative_update`` (Boltz imports it inside every call);
- through a module-level name, under any alias, that some module bound before the patch
  (BoltzGen binds it as ``_triangle_multiplicative_update``): the patch finds the module globals
  in ``sys.modules`` that are cuEquivariance's function, and rebinds them.

Only the triangle multiplicative update is replaced; cuEquivariance's other operations (triangle
attention, ...) stay. cuEquivariance must be installed: models that choose its kernels import
its triangle attention too, which trimul does not have, so trimul does not pretend to be it.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from typing import Any, Callable

_PACKAGE = "cuequivariance_torch"
_TRIANGLE = "cuequivariance_torch.primitives.triangle"
_NAME = "triangle_multiplicative_update"

# What the patch changed, to undo it: (module, global name, the function it was bound to).
_replaced: list[tuple[types.ModuleType, str, Any]] = []
_lock = threading.Lock()


def patch(ours: Callable) -> list[str]:
    """See `trimul.patch_cuequivariance`."""
    try:
        importlib.import_module(_PACKAGE)
    except ModuleNotFoundError as e:
        if e.name != _PACKAGE:
            raise  # cuEquivariance is there but a dependency of it is not: say so, do not hide it
        raise ModuleNotFoundError(
            f"trimul.patch_cuequivariance: {_PACKAGE} is not installed here, so no code can be calling "
            f"its {_NAME}; call trimul.triangle_multiplicative_update where the model calls it (a model's "
            "cuEquivariance kernel option also loads cuEquivariance's triangle attention, which trimul "
            "does not provide)",
            name=_PACKAGE,
        ) from e
    with _lock:
        theirs = []
        for name in (_PACKAGE, _TRIANGLE):
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError:
                continue
            f = _namespace(module).get(_NAME)
            if f is not None and f is not ours and all(f is not g for g in theirs):
                theirs.append(f)
        if not theirs and not _replaced:
            raise RuntimeError(
                f"{_PACKAGE} is installed but has no {_NAME} to replace: trimul.patch_cuequivariance "
                "knows cuEquivariance 0.13's layout"
            )
        # Every module global that is cuEquivariance's function, found before any is changed, so
        # that a module whose namespace cannot be read leaves nothing half done.
        found = [
            (module, key, value)
            for module in list(sys.modules.values())
            for key, value in list(_namespace(module).items())
            if callable(value) and any(value is g for g in theirs)
        ]
        for module, key, value in found:
            setattr(module, key, ours)
            _replaced.append((module, key, value))
        return sorted({_namespace(module).get("__name__", "?") for module, _, _ in _replaced})


def unpatch() -> None:
    """See `trimul.unpatch_cuequivariance`."""
    with _lock:
        while _replaced:
            module, key, theirs = _replaced.pop()
            setattr(module, key, theirs)


def _namespace(module) -> dict:
    """A module's globals, read without running its code: a lazily loaded module
    (`importlib.util.LazyLoader`) would load on `module.__dict__`, and a module object may define
    `__getattr__` or be no module at all (sys.modules holds whatever was put there)."""
    if not isinstance(module, types.ModuleType):
        return {}
    try:
        namespace = object.__getattribute__(module, "__dict__")
    except Exception:  # noqa: BLE001 - a namespace that cannot be read holds nothing to patch
        return {}
    return namespace if isinstance(namespace, dict) else {}
