"""The triangle multiplicative update on a pair tensor sharded by rows across the GPUs of a
``torch.distributed`` process group (one GPU per process, NVIDIA GPUs through NCCL).

Each rank holds rows ``[r0, r1)`` of the first pair index of x (``x[..., r0:r1, :, :]``) and
receives the same rows of the update; ``rows(n, group)`` says which rows (as even as possible,
the first ranks one more). The exchanges the contraction needs run inside the call, through a
NCCL communicator of trimul's own that the group's ranks join on their first call (its unique id
travels through the group)::

    import torch.distributed as dist
    from trimul import distributed as tmd

    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    r0, r1 = tmd.rows(n)
    y_rows = tmd.triangle_multiplicative_update(
        x[..., r0:r1, :, :], "outgoing", mask=mask[..., r0:r1, :], **weights
    )

Every rank of the group must make the same calls, with the same shapes and weights' shapes, in
the same order (the exchanges pair up call by call), as for any collective. The call enqueues
its work on the current stream and returns; nothing waits for it.

Gradients: where x or a weight requires grad, the backward recomputes the rank's rows with
PyTorch operations in float32, exchanging rows through the group's collectives; x's gradient is
whole for the rank's rows, each weight's is the rank's share (sum it over the group, as
data-parallel training does). The same tensors must require grad on every rank, and every rank
must run the backward (its exchanges pair up as the forward's do); a backward with
``create_graph=True`` raises. On the CPU, with a group that takes CPU tensors (gloo), the call runs
that formula (for trying a sharded model without GPUs).

What this path does not do yet: a native sharded backward, CUDA-graph capture, ``torch.compile``
(it runs outside the graph) and AMD GPUs (RCCL is not wired).

Deadlines: a rank that stops once the exchanges run leaves the others waiting on the GPU, and
``wait(timeout)`` is the deadline for that. A rank that never joins trimul's communicator, or
cannot be reached at the first exchange (NCCL 2.22 and later connect there), leaves the others
waiting in NCCL; with
``TRIMUL_NCCL_TIMEOUT_S`` set (seconds) the communicator is NCCL's non-blocking kind and that
is an error after the timeout, at a price: each call takes longer (about 0.3 to 0.75 ms at
N = 1024 on two H200s, nothing measurable at 4096).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Optional

from . import _args, _trimul

__all__ = ["triangle_multiplicative_update", "rows", "wait", "release"]

# One rank object per (process group, device): the communicator its ranks joined and a workspace
# per shape, shared by every layer.
_ranks: dict = {}
# The problems each rank object has planned a workspace for (calls of a new problem first make
# sure every rank is ready).
_planned: dict = {}
# The tests' switch: new rank objects fill y and their intermediates with NaN before each forward.
_poison = False


def rows(n: int, group=None) -> tuple[int, int]:
    """The rows ``(r0, r1)`` of the first pair index this rank holds of a pair tensor of ``n``
    rows, in ``group`` (default: the world)."""
    dist = _dist()
    world, me = _membership(dist, group)
    return tuple(_trimul.row_split(int(n), world)[me])


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
    group=None,
):
    """``trimul.triangle_multiplicative_update`` on this rank's rows of a row-sharded pair tensor.

    ``x`` is ``[..., r1 - r0, N, C]``: this rank's rows of the first pair index (``rows(N)``),
    every column; ``mask`` ``[..., r1 - r0, N]`` the same rows of the mask, of any dtype. The
    weights are the whole layer's, the same on every rank. Returns this rank's rows of the update
    (no residual), shaped like ``x``, in ``x``'s dtype (bfloat16 with ``precision="bfloat16"``).

    ``group`` is a ``torch.distributed`` process group (default: the world), one CUDA device per
    rank: x's (or the CPU, through PyTorch operations). A group of one rank runs
    ``trimul.triangle_multiplicative_update`` on the whole tensor. Gradients: see the module.
    """
    weights = dict(
        zip(
            _args.AF3_WEIGHTS,
            (
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
            ),
        )
    )
    dist = _dist()
    world, me = _membership(dist, group)
    if world == 1:
        from . import triangle_multiplicative_update as whole

        return whole(x, direction, mask, **weights, eps=eps, precision=precision)
    return _sharded(dist, group, world, me, x, direction, mask, weights, eps, precision)


def wait(timeout: float = 300.0, group=None, device=None) -> None:
    """Waits, at most ``timeout`` seconds, for this rank's last sharded call in ``group`` on
    ``device`` (default: the current CUDA device) to finish on the GPU. A peer that failed or
    stopped would leave the exchanges waiting forever (and ``torch.cuda.synchronize`` with them):
    here an NCCL error or the deadline aborts trimul's communicator and raises ``RuntimeError``;
    that group's later calls then raise too (``release`` it and start again). Returns at once
    where this rank has made no sharded call."""
    rank = _ranks.get(_key(_dist(), group, _device_index(device)))
    if rank is not None:
        rank.wait(float(timeout))


def release(group=None, timeout: float = 300.0) -> None:
    """Waits for this rank's sharded calls in ``group`` (on every device), then frees their
    workspaces and trimul's communicator, even where the wait fails (its first error is raised
    after); the next call joins a new one (every rank must release together). Prepared weights
    are kept (``trimul.clear_cache`` forgets them)."""
    dist = _dist()
    g = _group_key(dist, group)
    first_error = None
    for key in [k for k in _ranks if k[0] is g]:
        rank = _ranks.pop(key)
        _planned.pop(key, None)
        try:
            rank.release(float(timeout))
        except Exception as e:  # noqa: BLE001 - every device released, then the first error raised
            first_error = first_error or e
    if first_error is not None:
        raise first_error


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise RuntimeError(f"trimul.distributed needs PyTorch with torch.distributed ({e})") from None
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "trimul.distributed needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    return dist


def _membership(dist, group) -> tuple[int, int]:
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    if me < 0:
        raise ValueError("this process is not a member of the process group given")
    return world, me


def _group_key(dist, group):
    return dist.group.WORLD if group is None else group


def _key(dist, group, index: int) -> tuple:
    return (_group_key(dist, group), index)


def _device_index(device) -> int:
    import torch

    if isinstance(device, int):
        return device
    if device is None or torch.device(device).index is None:
        return torch.cuda.current_device()
    return torch.device(device).index


def _sharded(dist, group, world: int, me: int, x, direction, mask, weights: dict, eps, precision):
    import torch

    from . import _torch

    _args.check_direction(direction)
    eps = _args.check_eps(eps)
    mode = _args.DEFAULT if precision is None else _args.parse_precision(precision)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor on a CUDA device or the CPU, got {type(x).__name__}")
    on_gpu = x.device.type == "cuda"
    if not on_gpu and x.device.type != "cpu":
        raise ValueError(f"x is on {x.device}; the sharded call runs on CUDA devices (one per rank) or the CPU")
    if on_gpu and torch.version.hip is not None:
        raise NotImplementedError(
            "the sharded forward runs on NVIDIA GPUs through NCCL; RCCL (AMD) is not wired yet: "
            "use trimul.triangle_multiplicative_update on each GPU's whole tensor"
        )
    if on_gpu:
        _args.refuse_f32_on_gpu(mode, precision)
    elif dist is not None and dist.get_backend(group) == "nccl":
        raise ValueError(
            "x is on the CPU and the group's backend is NCCL, which exchanges CUDA tensors only: the "
            "sharded call on the CPU needs a group that takes CPU tensors (gloo, or 'cpu:gloo,cuda:nccl')"
        )
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor like x, got {type(mask).__name__}")
    w = [weights[n] for n in _args.AF3_WEIGHTS]
    if _torch._forward_ad._current_level >= 0 and _torch._has_tangent([x, mask, *w]):
        raise NotImplementedError("the sharded forward has no forward-mode derivative (jvp)")
    if x.dtype not in _torch._DTYPE_CODE:
        raise TypeError(f"x has dtype {x.dtype}; trimul takes float32, bfloat16 or float16")
    original_shape = x.shape
    x4 = x if x.dim() == 4 else x.reshape(_args.fold_leading(tuple(x.shape), 4))
    b, r, n, c = (int(d) for d in x4.shape)
    m3 = None
    if mask is not None:
        m3 = mask if mask.dim() == 3 else mask.reshape(_args.fold_leading(tuple(mask.shape), 3))
        _torch._check_tensor("mask", m3, x4)
        if tuple(m3.shape) != (b, r, n):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected x's without its channel dim")
    for name, t in weights.items():
        if t is not None:
            _torch._check_tensor(name, t, x4)
    # The whole pair tensor's shapes: the weights' checks are the one-GPU call's.
    _args.check_af3_shapes((b, n, n, c), None, weights)
    splits = _trimul.row_split(n, world)
    r0, r1 = splits[me]
    if r != r1 - r0:
        raise ValueError(
            f"x has {r} rows of the first pair index on rank {me} of {world}; with N = {n} this rank holds "
            f"rows {r0}..{r1} ({r1 - r0} rows): pass x[..., {r0}:{r1}, :, :] (see trimul.distributed.rows)"
        )
    if mode == _args.BFLOAT16:
        x4 = x4.to(torch.bfloat16)
        w = [None if t is None else t.to(torch.bfloat16) for t in w]
    if m3 is not None:
        m3 = m3.to(torch.float32)
        if mode == _args.BFLOAT16:
            m3 = m3.to(torch.bfloat16).to(torch.float32)
        m3 = _torch._contiguous(m3)
    x4 = _torch._contiguous(x4)
    contraction = functools.partial(_contract_rows, dist, group, splits, me)
    if on_gpu:
        run = functools.partial(_forward_on_gpu, dist, group, world, me, direction, eps)
    else:
        run = functools.partial(_forward_on_cpu, direction, eps, contraction)
    if torch.is_grad_enabled() and (x4.requires_grad or any(t is not None and t.requires_grad for t in w)):
        y = _autograd()[2].apply(run, contraction, direction, eps, x4, m3, *w)
    else:
        y = run(x4, m3, w)
    return y if y.shape == original_shape else y.view(original_shape)


def _forward_on_cpu(direction: str, eps: float, contraction, x4, m3, w: list):
    """This rank's rows of y on the CPU: the formula with PyTorch operations in float32, the
    contraction exchanging rows through the group (`_contract_rows`)."""
    import torch

    from . import reference

    with torch.no_grad():
        w32 = [None if t is None else t.to(torch.float32) for t in w]
        return reference.af3(x4.to(torch.float32), m3, w32, direction, eps, contraction).to(x4.dtype)


def _forward_on_gpu(dist, group, world: int, me: int, direction: str, eps: float, x4, m3, w: list):
    """This rank's rows of y from trimul's sharded forward, on the current stream: the join of
    trimul's communicator on the group's first call here, a workspace per problem."""
    import torch

    from . import _torch

    b, _, n, c = (int(d) for d in x4.shape)
    index = x4.get_device()
    with torch.cuda.device(index):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the sharded forward cannot be captured in a CUDA graph yet (its first call waits)")
        stream = torch.cuda.current_stream(index).cuda_stream
        key = _key(dist, group, index)
        rank = _ranks.get(key)
        problem = (b, n, c, w[2].shape[0] // 2, direction, m3 is not None, _torch._DTYPE_CODE[x4.dtype], eps)
        # Weights being trained are prepared in every call, as the one-GPU call prepares them
        # (their values can change without a version bump: FSDP2, writes through .data).
        trained = any(t is not None and t.requires_grad for t in w)
        prepare = _torch._fresh_entry if trained else _torch.prepared_entry
        if rank is not None and problem in _planned.get(key, ()):
            entry = prepare(x4, w, direction, eps, index, stream)
        else:
            # The group's first call here, or this problem's: every rank says whether it got this
            # far (its weights prepared) before any rank joins or plans the problem's workspace
            # (both wait on the host for every rank: one that raised here would leave the others
            # waiting forever). Through the group, whose collectives have PyTorch's timeouts.
            try:
                entry, failed = prepare(x4, w, direction, eps, index, stream), None
            except Exception as e:  # noqa: BLE001 - raised below, after the others have heard
                entry, failed = None, e
            if rank is None:
                rank = _join(dist, group, world, me, index, failed)
            else:
                _gather_states(dist, group, world, failed)
        y = torch.empty_like(x4)
        args = (entry.layer, *_torch._io_args(x4, m3, y), b, n, _torch._DTYPE_CODE[x4.dtype], stream)
        try:
            rank.forward(*args)
        except (RuntimeError, ValueError) as e:
            if not (str(e).startswith("out of memory") or "could not plan its workspace" in str(e)):
                raise
            # A new problem's workspace did not fit on some rank, and every rank failed together
            # (they agree on the budget first). It is allocated outside PyTorch's caching
            # allocator: every rank hands the cached blocks back to the driver and plans once
            # more, together, within what is then free.
            torch.cuda.empty_cache()
            rank.forward(*args)
        _planned.setdefault(key, set()).add(problem)
    return y


def _gather_rows(dist, group, v, splits: list):
    """Every rank's rows of `v` (`[B, rows, ...]`, this rank's `splits[me]`) in row order,
    `[B, N, ...]`: one all-gather, each rank's block padded to the largest."""
    import torch

    widest = max(r1 - r0 for r0, r1 in splits)
    padded = v.new_zeros((v.shape[0], widest, *v.shape[2:]))
    padded[:, : v.shape[1]] = v
    parts = [torch.empty_like(padded) for _ in splits]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:, : r1 - r0] for p, (r0, r1) in zip(parts, splits)], dim=1)


def _contract_rows(dist, group, splits: list, me: int, a, b, direction: str):
    """t's rows of this rank from its rows of a and b (`[B, rows, N, H]`), as `reference.af3`
    takes a contraction. Outgoing, `t[i, j] = Σ_k a[i, k]·b[j, k]` needs every rank's rows of
    b (gathered); incoming, `t[i, j] = Σ_k a[k, i]·b[k, j]` sums over the rows the ranks split
    (each rank's partial sum, added up by an all-reduce). Both differentiable."""
    import torch

    if direction == "outgoing":
        return torch.einsum("bikh,bjkh->bijh", a, _autograd()[0].apply(b, dist, group, splits, me))
    partial = torch.einsum("bkih,bkjh->bijh", a, b)
    return _autograd()[1].apply(partial, dist, group, splits, me)


def _gather_states(dist, group, world: int, failed: Optional[BaseException], unique_id=None) -> list:
    """Every rank's (state, unique id): state None where that rank is ready, else its error's
    text. Raises this rank's own error `failed` once everyone has heard of it, and a
    RuntimeError naming the others' where only they failed."""
    state = None if failed is None else f"{type(failed).__name__}: {failed}"
    everyone = [None] * world
    # On the group's own device kind (the current CUDA device for NCCL; the CPU for gloo).
    dist.all_gather_object(everyone, (state, unique_id), group=group)
    if failed is not None:
        raise failed
    others = [f"rank {r}: {s}" for r, (s, _) in enumerate(everyone) if s is not None]
    if others:
        raise RuntimeError(f"the sharded call did not start: {'; '.join(others)}")
    return everyone


def _join_timeout() -> Optional[float]:
    """The join's deadline in seconds from ``TRIMUL_NCCL_TIMEOUT_S``, or None (unset or empty:
    NCCL's blocking communicator, no deadline)."""
    text = os.environ.get("TRIMUL_NCCL_TIMEOUT_S", "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"TRIMUL_NCCL_TIMEOUT_S={text!r}: give the join's deadline as a positive number of seconds")
    return seconds


def _join(dist, group, world: int, me: int, index: int, failed: Optional[BaseException]):
    """This process's rank object of `group` on device `index`, joined now. One gather through
    the group carries every rank's state (`failed`: what went wrong here) and, from group rank 0,
    a fresh NCCL unique id; if any rank failed, every rank raises (this one its own error)
    instead of some waiting in the join for ranks that will not come."""
    unique_id, timeout = None, None
    if failed is None:
        try:
            timeout = _join_timeout()
            if me == 0:
                unique_id = bytes(_trimul.nccl_unique_id())
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised here below
            failed = e
    everyone = _gather_states(dist, group, world, failed, unique_id)
    joined = _trimul.CudaShardedRank(everyone[0][1], world, me, index, timeout)
    rank = _ranks[_key(dist, group, index)] = joined
    rank.set_poison(_poison)
    return rank


@functools.cache
def _autograd():
    """The three autograd functions of the sharded call, made on first use (importing this
    module needs no PyTorch; `_dist` says so when it is missing)."""
    import torch

    class GatherRows(torch.autograd.Function):
        """`_gather_rows`; its backward sums every rank's gradient of the gathered tensor and
        keeps this rank's rows."""

        @staticmethod
        def forward(ctx, v, dist, group, splits, me):
            ctx.dist, ctx.group, ctx.rows = dist, group, splits[me]
            return _gather_rows(dist, group, v, splits)

        @staticmethod
        def backward(ctx, grad):
            total = grad.contiguous().clone()
            ctx.dist.all_reduce(total, group=ctx.group)
            r0, r1 = ctx.rows
            return total[:, r0:r1].contiguous(), None, None, None, None

    class SumToRows(torch.autograd.Function):
        """This rank's rows of the sum over ranks of `partial` (`[B, N, ...]`); its backward
        gathers every rank's gradient of its rows (each rank's partial reaches every row)."""

        @staticmethod
        def forward(ctx, partial, dist, group, splits, me):
            ctx.dist, ctx.group, ctx.splits = dist, group, splits
            total = partial.contiguous().clone()
            dist.all_reduce(total, group=group)
            r0, r1 = splits[me]
            return total[:, r0:r1].contiguous()

        @staticmethod
        def backward(ctx, grad):
            return _gather_rows(ctx.dist, ctx.group, grad.contiguous(), ctx.splits), None, None, None, None

    class ShardedUpdate(torch.autograd.Function):
        """The sharded call where gradients are recorded: `run` (trimul's sharded forward on the
        GPU, the formula on the CPU) without a graph, and a backward that recomputes this rank's
        rows with the formula in float32 (`_torch._recomputed_backward`), its contraction
        exchanging rows through the group, and differentiates it. The weights' gradients are
        this rank's share (the sum over its positions); x's is whole for its rows."""

        @staticmethod
        def forward(ctx, run, contraction, direction, eps, x, mask, *w):
            ctx.contraction, ctx.direction, ctx.eps = contraction, direction, eps
            ctx.save_for_backward(x, mask, *w)
            return run(x, mask, list(w))

        @staticmethod
        def backward(ctx, grad):
            from . import _torch

            if torch.is_grad_enabled():
                # The recompute's gradients carry no graph of their own: a graph of them would
                # silently leave out their dependence on x and the weights (every rank raises
                # here alike, before any exchange).
                raise NotImplementedError(
                    "the sharded call's gradients cannot be differentiated again: backward with "
                    "create_graph=True is not supported"
                )

            x, mask, *w = ctx.saved_tensors
            # `need` as the op's arguments number them: x 0, the weights _WEIGHT_SLOTS. x's
            # gradient is always computed: then a and b require grad on every rank whatever
            # else does, so every rank's backward runs the same exchanges.
            need = [False] * 16
            need[0] = True
            for i, slot in enumerate(_torch._WEIGHT_SLOTS):
                need[slot] = ctx.needs_input_grad[6 + i]
            grads = _torch._recomputed_backward(x, mask, w, ctx.direction, ctx.eps, grad, need, ctx.contraction)
            out = [None] * (6 + len(w))
            if ctx.needs_input_grad[4]:
                out[4] = grads[0].to(x.dtype)
            for i, (slot, t) in enumerate(zip(_torch._WEIGHT_SLOTS, w)):
                if slot in grads:
                    out[6 + i] = grads[slot].to(t.dtype)
            return tuple(out)

    return GatherRows, SumToRows, ShardedUpdate
