"""trimul.patch_cuequivariance: code written for cuEquivariance's function runs trimul's, with
cuEquivariance absent (stand-in modules) and installed (a package of cuEquivariance 0.13's layout
written here, since the real one needs an NVIDIA GPU to import)."""

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
    before = {name: sys.modules.get(name) for name in (*CUEQ, "a_model_module")}
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


def test_without_cuequivariance_stand_ins_give_trimuls_function(clean_modules):
    if importlib.util.find_spec("cuequivariance_torch") is not None:
        pytest.skip("cuequivariance_torch is installed here")
    names = trimul.patch_cuequivariance()
    assert names == list(CUEQ)
    # The ways models reach it: OpenFold3's check and package import, Boltz's submodule import.
    assert importlib.util.find_spec("cuequivariance_torch") is not None
    from cuequivariance_torch import triangle_multiplicative_update as from_package
    from cuequivariance_torch.primitives.triangle import triangle_multiplicative_update as from_triangle

    assert from_package is trimul.triangle_multiplicative_update
    assert from_triangle is trimul.triangle_multiplicative_update
    x, w = _inputs()
    mask = (torch.rand(1, 6, 6) > 0.3).float()
    got = from_triangle(x, direction="incoming", mask=mask, eps=1e-5, **w)
    want = trimul.triangle_multiplicative_update(x, "incoming", mask, eps=1e-5, **w)
    assert torch.equal(got, want)
    # What trimul does not stand in for is an error naming the stand-in, not a silent None.
    import cuequivariance_torch

    with pytest.raises(AttributeError, match="has triangle_multiplicative_update only"):
        cuequivariance_torch.triangle_attention  # noqa: B018 - the access is the test
    with pytest.raises(ImportError, match="triangle_attention"):
        from cuequivariance_torch.primitives.triangle import triangle_attention  # noqa: F401
    assert not hasattr(cuequivariance_torch, "triangle_attention")
    # Twice is once; undone, the modules are gone.
    assert trimul.patch_cuequivariance() == list(CUEQ)
    trimul.unpatch_cuequivariance()
    assert all(name not in sys.modules for name in CUEQ)
    assert importlib.util.find_spec("cuequivariance_torch") is None


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
    # A model module that bound the name at its import, before the patch (as OpenFold3 does).
    (root / "a_model_module.py").write_text("from cuequivariance_torch import triangle_multiplicative_update\n")


def test_with_cuequivariance_installed_only_its_trimul_is_replaced(clean_modules, tmp_path, monkeypatch):
    if importlib.util.find_spec("cuequivariance_torch") is not None:
        pytest.skip("cuequivariance_torch is installed here: this test writes its own")
    _fake_cuequivariance(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import a_model_module
    import cuequivariance_torch
    from cuequivariance_torch.primitives import triangle

    theirs = triangle.triangle_multiplicative_update
    assert a_model_module.triangle_multiplicative_update is theirs
    names = trimul.patch_cuequivariance()
    assert names == ["a_model_module", "cuequivariance_torch", "cuequivariance_torch.primitives.triangle"]
    ours = trimul.triangle_multiplicative_update
    assert cuequivariance_torch.triangle_multiplicative_update is ours
    assert triangle.triangle_multiplicative_update is ours
    assert a_model_module.triangle_multiplicative_update is ours
    assert triangle.triangle_attention(None, None, None, None) == "cuequivariance attention"
    x, w = _inputs()
    y = a_model_module.triangle_multiplicative_update(x, direction="outgoing", mask=None, **w)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    assert trimul.patch_cuequivariance() == names
    trimul.unpatch_cuequivariance()
    assert cuequivariance_torch.triangle_multiplicative_update is theirs
    assert triangle.triangle_multiplicative_update is theirs
    assert a_model_module.triangle_multiplicative_update is theirs
