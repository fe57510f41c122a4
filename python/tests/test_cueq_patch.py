"""trimul.patch_cuequivariance: code written for cuEquivariance's function runs trimul's, against
a package of cuEquivariance 0.13's layout written here and, where it imports, the real one (its
Python package loads without a GPU); without cuEquivariance the patch refuses."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import textwrap

import pytest
import torch
from conftest import af3_weights, pair

import trimul

CUEQ = ("cuequivariance_torch", "cuequivariance_torch.primitives", "cuequivariance_torch.primitives.triangle")


@pytest.fixture
def clean_modules():
    """Leaves sys.modules and the patch as it found them (the patch is process-wide)."""
    before = {name: sys.modules.get(name) for name in (*CUEQ, "a_model_module", "a_lazy_module")}
    yield
    trimul.unpatch_cuequivariance()
    for name, module in before.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def _inputs():
    x = pair((1, 6, 6, 16), 3)
    w = af3_weights(16, 8, False, 4)
    return x, w


def test_without_cuequivariance_the_patch_refuses_and_says_why(clean_modules):
    if importlib.util.find_spec("cuequivariance_torch") is not None:
        pytest.skip("cuequivariance_torch is installed here")
    with pytest.raises(ModuleNotFoundError, match="cuequivariance_torch is not installed here"):
        trimul.patch_cuequivariance()
    assert "cuequivariance_torch" not in sys.modules
    trimul.unpatch_cuequivariance()  # nothing to undo: no error


def _fake_cuequivariance(root) -> None:
    """A package with cuEquivariance 0.13's layout: the function in primitives.triangle, bound
    again in the package, beside an operation trimul does not replace."""
    pkg = root / "cuequivariance_torch"
    (pkg / "primitives").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from .primitives.triangle import triangle_attention, triangle_multiplicative_update\n"
    )
    (pkg / "primitives" / "__init__.py").write_text("")
    (pkg / "primitives" / "triangle.py").write_text(
        textwrap.dedent(
            """
            def triangle_multiplicative_update(x, direction="outgoing", mask=None, **kwargs):
                return "cuequivariance"

            def triangle_attention(q, k, v, bias, mask=None, scale=None):
                return "cuequivariance attention"
            """
        )
    )
    # A model module that bound the function at its import, before the patch: under its name (as
    # OpenFold3 does) and under an alias (as BoltzGen does).
    (root / "a_model_module.py").write_text(
        "from cuequivariance_torch import triangle_multiplicative_update\n"
        "from cuequivariance_torch.primitives.triangle import triangle_multiplicative_update as _tmu\n"
    )
    # A module that must not run: the patch reads namespaces without loading lazy modules.
    (root / "a_lazy_module.py").write_text("raise RuntimeError('the patch loaded a lazy module')\n")


def test_with_cuequivariance_installed_only_its_trimul_is_replaced(clean_modules, tmp_path, monkeypatch):
    if importlib.util.find_spec("cuequivariance_torch") is not None:
        pytest.skip("cuequivariance_torch is installed here: this test writes its own")
    _fake_cuequivariance(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import a_model_module
    import cuequivariance_torch
    from cuequivariance_torch.primitives import triangle

    spec = importlib.util.find_spec("a_lazy_module")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    lazy = importlib.util.module_from_spec(spec)
    sys.modules["a_lazy_module"] = lazy
    spec.loader.exec_module(lazy)  # lazily: runs on first attribute access
    theirs = triangle.triangle_multiplicative_update
    assert a_model_module.triangle_multiplicative_update is theirs and a_model_module._tmu is theirs
    names = trimul.patch_cuequivariance()
    assert names == ["a_model_module", "cuequivariance_torch", "cuequivariance_torch.primitives.triangle"]
    ours = trimul.triangle_multiplicative_update
    assert cuequivariance_torch.triangle_multiplicative_update is ours
    assert triangle.triangle_multiplicative_update is ours
    assert a_model_module.triangle_multiplicative_update is ours and a_model_module._tmu is ours
    assert triangle.triangle_attention(None, None, None, None) == "cuequivariance attention"
    x, w = _inputs()
    y = a_model_module.triangle_multiplicative_update(x, direction="outgoing", mask=None, **w)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    assert trimul.patch_cuequivariance() == names
    trimul.unpatch_cuequivariance()
    assert cuequivariance_torch.triangle_multiplicative_update is theirs
    assert triangle.triangle_multiplicative_update is theirs
    assert a_model_module.triangle_multiplicative_update is theirs and a_model_module._tmu is theirs
    assert object.__getattribute__(lazy, "__class__") is importlib.util._LazyModule  # never loaded


def test_with_the_real_cuequivariance_its_function_is_replaced_and_restored(clean_modules):
    # Runs where cuequivariance_torch imports (its Python package loads without a GPU; its
    # kernels do not run here): the layout trimul patches is the real one's.
    try:
        import cuequivariance_torch
        from cuequivariance_torch.primitives import triangle
    except ImportError as e:
        pytest.skip(f"cuequivariance_torch does not import here: {e}")
    theirs = cuequivariance_torch.triangle_multiplicative_update
    names = trimul.patch_cuequivariance()
    assert {"cuequivariance_torch", "cuequivariance_torch.primitives.triangle"} <= set(names)
    ours = trimul.triangle_multiplicative_update
    assert cuequivariance_torch.triangle_multiplicative_update is ours
    assert triangle.triangle_multiplicative_update is ours
    assert triangle.triangle_attention.__module__.startswith("cuequivariance_torch")
    x, w = _inputs()
    from cuequivariance_torch.primitives.triangle import triangle_multiplicative_update as boltz_way

    assert torch.equal(boltz_way(x, direction="outgoing", mask=None, **w), ours(x, "outgoing", None, **w))
    trimul.unpatch_cuequivariance()
    assert cuequivariance_torch.triangle_multiplicative_update is theirs
    assert triangle.triangle_multiplicative_update is theirs
