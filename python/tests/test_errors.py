"""Bad input is a Python exception with a message naming what is wrong, never a crash or a
silent wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import af3_weights, cuda_available, pair

from trimul import triangle_multiplicative_update as tmu
from trimul._args import AF3_WEIGHTS


def setup(device="cpu", c=16, h=8, n=6):
    return pair((1, n, n, c), salt=40, device=device), af3_weights(c, h, True, salt=41, device=device)


@pytest.mark.parametrize(
    "change, exc, message",
    [
        (lambda x, w: (x[..., :5, :], w), ValueError, "must be \\[..., N, N, C\\]"),
        (lambda x, w: (x[:, :0, :0], w), ValueError, "at least 1"),
        (lambda x, w: (x, {**w, "p_in_weight": w["p_in_weight"][:-1]}), ValueError, "p_in_weight has shape"),
        (
            lambda x, w: (x, {**w, "g_in_weight": w["g_in_weight"][:, :-1]}),
            ValueError,
            "g_in_weight has shape",
        ),
        (
            lambda x, w: (x, {**w, "p_out_weight": w["p_out_weight"].t()}),
            ValueError,
            "p_out_weight has shape",
        ),
        (lambda x, w: (x, {**w, "g_out_bias": w["g_out_bias"][:-1]}), ValueError, "g_out_bias has shape"),
        (
            lambda x, w: (x, {**w, "norm_out_weight": w["norm_in_weight"]}),
            ValueError,
            "norm_out_weight has shape",
        ),
        (
            lambda x, w: (x, {k: v for k, v in w.items() if k != "g_out_weight"}),
            ValueError,
            "g_out_weight is required",
        ),
        (lambda x, w: (x.double(), w), TypeError, "float64"),
        (lambda x, w: (x.int(), w), TypeError, "dtype"),
        (
            lambda x, w: (x, {**w, "p_in_weight": w["p_in_weight"].double()}),
            TypeError,
            "p_in_weight has dtype",
        ),
        (
            lambda x, w: (x, {**w, "p_in_weight": w["p_in_weight"].numpy()}),
            TypeError,
            "must be a torch.Tensor",
        ),
    ],
)
def test_bad_arguments(change, exc, message):
    x, w = change(*setup())
    with pytest.raises(exc, match=message):
        tmu(x, "outgoing", None, **w)


def test_bad_direction_eps_and_mask():
    x, w = setup()
    with pytest.raises(ValueError, match="direction"):
        tmu(x, "sideways", **w)
    with pytest.raises(ValueError, match="eps"):
        tmu(x, eps=-1.0, **w)
    with pytest.raises(ValueError, match="eps"):
        tmu(x, eps=float("nan"), **w)
    with pytest.raises(ValueError, match="mask has shape"):
        tmu(x, mask=torch.ones(1, 6, 5), **w)
    with pytest.raises(TypeError, match="mask must be a torch.Tensor"):
        tmu(x, mask=[[1.0]], **w)


def test_numpy_bad_arguments():
    x, w = setup()
    wn = {k: v.numpy() for k, v in w.items()}
    with pytest.raises(TypeError, match="dtype"):
        tmu(x.numpy().astype(np.int32), **wn)
    with pytest.raises(ValueError, match="p_in_weight has shape"):
        tmu(x.numpy(), **{**wn, "p_in_weight": wn["p_in_weight"][:-1]})
    with pytest.raises(ValueError, match="bfloat16"):
        tmu(x.numpy(), precision="bfloat16", **wn)
    with pytest.raises(TypeError, match="numpy"):
        tmu([[1.0]], **wn)


@pytest.mark.skipif(not cuda_available(), reason="no CUDA device")
def test_tensors_on_different_devices():
    x, w = setup("cuda")
    with pytest.raises(ValueError, match="p_out_weight is on cpu but x is on cuda"):
        tmu(x, **{**w, "p_out_weight": w["p_out_weight"].cpu()})
    with pytest.raises(ValueError, match="mask is on cpu"):
        tmu(x, mask=torch.ones(1, 6, 6), **w)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="cuda:1"):
            tmu(x, **{**w, "g_in_weight": w["g_in_weight"].to("cuda:1")})


def test_weights_on_cpu_with_x_on_meta_device_is_an_error():
    x, w = setup()
    with pytest.raises(ValueError, match="every tensor must be on x's device"):
        tmu(x.to("meta"), **w)


def test_the_registered_op_checks_what_it_is_given():
    """torch.ops.trimul.triangle_multiplicative_update is public: a malformed call is an error
    naming the problem, never a read or write past a tensor (before, x [1, 512, 64, 16] crashed
    the interpreter through it)."""
    x, w = setup(c=16)
    args = [w.get(k) for k in AF3_WEIGHTS]
    op = torch.ops.trimul.triangle_multiplicative_update
    with pytest.raises(ValueError, match=r"\[\.\.\., N, N, C\]"):
        op(torch.randn(1, 512, 64, 16), None, *args, "outgoing", 1e-5)
    with pytest.raises(ValueError, match="mask has shape"):
        op(x, torch.ones(1, 6, 5), *args, "outgoing", 1e-5)
    with pytest.raises(ValueError, match="p_in_weight has shape"):
        op(x, None, args[0], args[1], args[2][:-1], *args[3:], "outgoing", 1e-5)
    with pytest.raises(ValueError, match="direction"):
        op(x, None, *args, "sideways", 1e-5)
    with pytest.raises(ValueError, match="B, N, N, C"):
        op(x[0], None, *args, "outgoing", 1e-5)
    # A bool mask through the op is converted, not read as f32.
    mask = torch.rand(1, 6, 6) > 0.5
    assert torch.equal(op(x, mask, *args, "outgoing", 1e-5), tmu(x, "outgoing", mask.float(), **w))


def test_numpy_arrays_at_unaligned_addresses_are_copied_not_misread():
    x, w = setup()
    buf = np.zeros(x.numel() * 4 + 1, np.uint8)
    xa = buf[1:].view(np.float32).reshape(x.shape)  # starts 1 byte off any float's alignment
    assert xa.ctypes.data % 4 == 1
    xa[...] = x.numpy()
    wn = {k: v.numpy() for k, v in w.items()}
    np.testing.assert_array_equal(tmu(xa, **wn), tmu(x.numpy(), **wn))


def test_native_backward_checks_its_gradient_entries():
    """The compiled backward refuses a malformed call, naming the entry, before writing anything."""
    from trimul import _trimul
    from trimul._torch import _entries

    c, h, n = 8, 4, 3
    w = af3_weights(c, h, False, salt=42)
    layer = _trimul.HostLayer("af3", c, h, "outgoing", 1e-5, _entries([w.get(k) for k in AF3_WEIGHTS]), "cpu")
    x, dy = pair((1, n, n, c), salt=43), pair((1, n, n, c), salt=44)
    dx = torch.full_like(x, 7.0)
    io = (x.data_ptr(), x.numel(), 0, 0, dy.data_ptr(), dy.numel(), 1, n)
    whole = (dx.data_ptr(), dx.numel(), 0)
    with pytest.raises(ValueError, match="16 gradient entries given, expected 17"):
        layer.backward(*io, [whole] + [None] * 15)
    with pytest.raises(ValueError, match="gradient entry of x has 71 elements, expected 72"):
        layer.backward(*io, [(dx.data_ptr(), 71, 0)] + [None] * 16)
    with pytest.raises(ValueError, match="the gradient entry of x must be a non-null, aligned f32 tensor"):
        layer.backward(*io, [(dx.data_ptr(), dx.numel(), 1)] + [None] * 16)
    bias = torch.empty(h)
    with pytest.raises(ValueError, match="left_proj.bias was given, but the layer has no such bias"):
        layer.backward(*io, [whole, None, None, None, (bias.data_ptr(), h, 0)] + [None] * 12)
    assert bool((dx == 7.0).all()), "nothing written by a refused call"
    layer.backward(*io, [whole] + [None] * 16)
    assert not bool((dx == 7.0).any())


def test_backward_op_called_directly_checks_its_arguments():
    """torch.ops.trimul.triangle_multiplicative_update_backward is public: devices, shapes and the
    weight count are checked before the library reads anything."""
    op = torch.ops.trimul.triangle_multiplicative_update_backward
    c, h, n = 8, 4, 3
    w = af3_weights(c, h, False, salt=45)
    ws = [w.get(k) for k in AF3_WEIGHTS]
    x, g = pair((1, n, n, c), salt=46), pair((1, n, n, c), salt=47)
    grads = op(g, x, None, ws, "outgoing", 1e-5)
    assert [t.shape for t in grads] == [x.shape] + [t.shape for t in ws if t is not None]
    with pytest.raises(ValueError, match="grad has shape"):
        op(g.reshape(1, n * n * c), x, None, ws, "outgoing", 1e-5)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., N, N, C\]"):
        op(g[:, :, :2], x[:, :, :2], None, ws, "outgoing", 1e-5)
    with pytest.raises(ValueError, match="11 weights given, expected 12"):
        op(g, x, None, ws[:11], "outgoing", 1e-5)
    with pytest.raises(ValueError, match="mask"):
        op(g, x, torch.ones(1, n, n + 1), ws, "outgoing", 1e-5)
    if cuda_available():
        with pytest.raises(ValueError, match="p_in_weight is on cuda"):
            op(g, x, None, [t if k != "p_in_weight" else t.cuda() for k, t in zip(AF3_WEIGHTS, ws)], "outgoing", 1e-5)
        with pytest.raises(ValueError, match="grad is on cuda"):
            op(g.cuda(), x, None, ws, "outgoing", 1e-5)


def test_native_backward_names_dy():
    from trimul import _trimul
    from trimul._torch import _entries

    c, h, n = 8, 4, 3
    w = af3_weights(c, h, False, salt=48)
    layer = _trimul.HostLayer("af3", c, h, "outgoing", 1e-5, _entries([w.get(k) for k in AF3_WEIGHTS]), "cpu")
    x = pair((1, n, n, c), salt=49)
    with pytest.raises(ValueError, match="dy has 71 elements"):
        layer.backward(x.data_ptr(), x.numel(), 0, 0, x.data_ptr(), 71, 1, n, [None] * 17)
    with pytest.raises(ValueError, match="x and dy must be non-null"):
        layer.backward(x.data_ptr(), x.numel(), 0, 0, 0, x.numel(), 1, n, [None] * 17)
