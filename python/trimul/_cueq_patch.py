"""`trimul.patch_cuequivariance`: code written for cuEquivariance's triangle multiplicative update
runs trimul's instead, without editing it.

Models reach cuEquivariance's function three ways, all of which this covers:

- through the package, ``from cuequivariance_torch import triangle_multiplicative_update`` or
  ``cuequivariance_torch.triangle_multiplicative_update(...)`` (OpenFold3 binds the name when its
  module is imported, after checking ``importlib.util.find_spec("cuequivariance_torch")``);
- through its submodule, ``from cuequivariance_torch.primitives.triangle import
  triangle_multiplicative_update`` (Boltz imports it inside every call);
- through a name some module bound before the patch (the patch finds the modules in
  ``sys.modules`` whose name is bound to cuEquivariance's function, and rebinds it).

Where cuEquivariance is installed, only its triangle multiplicative update is replaced; its other
operations (triangle attention, ...) stay. Where it is not (AMD GPUs, the CPU, a machine without
it), stand-in modules of those names give trimul's function and, for any other name, an error that
says trimul stands in for the triangle multiplicative update only.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any, Callable

_PACKAGE = "cuequivariance_torch"
_TRIANGLE = "cuequivariance_torch.primitives.triangle"
_STAND_INS = (_PACKAGE, "cuequivariance_torch.primitives", _TRIANGLE)
_NAME = "triangle_multiplicative_update"

# What the patch changed, to undo it: (module, the function it had bound), and whether the
# stand-in modules are ours.
_replaced: list[tuple[types.ModuleType, Any]] = []
_stood_in = False


def patch(ours: Callable) -> list[str]:
    """See `trimul.patch_cuequivariance`."""
    global _stood_in
    try:
        package = importlib.import_module(_PACKAGE)
    except ModuleNotFoundError as e:
        if e.name != _PACKAGE:
            raise  # cuEquivariance is there but a dependency of it is not: say so, do not hide it
        _install_stand_ins(ours)
        _stood_in = True
        return list(_STAND_INS)
    if getattr(package, "__trimul_stand_in__", False):
        return list(_STAND_INS)
    originals = []
    for name in (_PACKAGE, _TRIANGLE):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        theirs = vars(module).get(_NAME)
        if theirs is not None and theirs is not ours and all(theirs is not f for f in originals):
            originals.append(theirs)
    if not originals and not _replaced:
        raise RuntimeError(
            f"{_PACKAGE} is installed ({getattr(package, '__file__', '?')}) but has no {_NAME} to replace: "
            "trimul.patch_cuequivariance knows cuEquivariance 0.13's layout"
        )
    # Every module, the package's own included, whose name is bound to cuEquivariance's function
    # (read from the module's dict: a module's __getattr__ may import or compute things).
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None) if isinstance(module, types.ModuleType) else None
        bound = namespace.get(_NAME) if namespace is not None else None
        if bound is not None and any(bound is f for f in originals):
            _replaced.append((module, bound))
            setattr(module, _NAME, ours)
    return sorted({module.__name__ for module, _ in _replaced})


def unpatch() -> None:
    """See `trimul.unpatch_cuequivariance`."""
    global _stood_in
    while _replaced:
        module, theirs = _replaced.pop()
        setattr(module, _NAME, theirs)
    if _stood_in:
        for name in _STAND_INS:
            if getattr(sys.modules.get(name), "__trimul_stand_in__", False):
                del sys.modules[name]
        _stood_in = False


def _install_stand_ins(ours: Callable) -> None:
    modules = [_stand_in(name, ours, is_package=name != _TRIANGLE) for name in _STAND_INS]
    # Parents know their children, as after a real import.
    modules[0].primitives = modules[1]
    modules[1].triangle = modules[2]
    for module in modules:
        sys.modules[module.__name__] = module


def _stand_in(name: str, ours: Callable, is_package: bool) -> types.ModuleType:
    module = types.ModuleType(
        name,
        f"trimul's stand-in for {name} (cuEquivariance is not installed): {_NAME} only, "
        "installed by trimul.patch_cuequivariance().",
    )
    # A spec, so that importlib.util.find_spec(name) finds the module (it raises on a module
    # in sys.modules without one).
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    if is_package:
        module.__path__ = []
    module.__trimul_stand_in__ = True
    setattr(module, _NAME, ours)

    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(
            f"{name}.{attr}: cuEquivariance is not installed, and trimul's stand-in for it "
            f"(trimul.patch_cuequivariance) has {_NAME} only"
        )

    module.__getattr__ = __getattr__
    return module
