"""Differentiable expert-parallel dispatch and combine on top of :class:`ubep_torch.Buffer`.

The Buffer itself mirrors DeepEP and, like DeepEP, knows nothing about autograd. This module adds the
autograd rules that training needs (DeepEP users write them by hand):

* normal mode: the backward of ``dispatch`` is ``combine`` of the gradients (the gradient of
  ``recv_topk_weights`` travels back to ``topk_weights``), and the backward of ``combine`` is the cached
  ``dispatch`` of the output gradient with the same handle;
* low-latency mode: the backward of ``low_latency_dispatch`` is an unweighted ``low_latency_combine``,
  and the backward of the weighted ``low_latency_combine`` is a ``low_latency_dispatch`` of the output
  gradient (scaled on the expert rank by each row's weight) plus a return trip of the per-row dot products
  that make the gradient of ``topk_weights``.

Every function here is collective: all ranks of the Buffer's group call it in the same order, and so
every backward is collective too (the ranks run the same graph, so autograd visits the nodes in the
same order on every rank). What a backward sends depends on which inputs require grad (the gradient of
``topk_weights`` takes calls of its own), so an input that requires grad on one rank must on every rank.

Shapes: ``T`` tokens on this rank, ``H`` hidden, ``K`` top-k, ``E`` experts, ``R`` ranks,
``E_local = E / R``, ``N = num_max_dispatch_tokens_per_rank``.

Weights in a dtype other than float32 (float64 for ``gradcheck``) travel as a payload of their own
through a cached dispatch/combine, so no precision is lost on the way.

The backward passes are collective calls that record no graph themselves, so they are differentiable
once: a second derivative (``create_graph=True`` then a backward through the gradients) raises an error
instead of silently leaving out the terms that go through these exchanges.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .errors import refusal
from .utils import check_count, check_host

__all__ = [
    "AutogradHandle",
    "LowLatencyAutogradHandle",
    "combine",
    "dispatch",
    "low_latency_combine",
    "low_latency_dispatch",
]

LAYOUTS = ("rank_major", "expert_major")


@dataclass
class AutogradHandle:
    """What :func:`combine` and the backward passes need to undo a :func:`dispatch`.

    Attributes:
        buffer_handle: the Buffer's own handle (reused for cached dispatch and for combine).
        layout: ``"rank_major"`` or ``"expert_major"``.
        num_experts: ``E``.
        rank, group_size: this rank and ``R``.
        topk_idx: ``[T, K]`` int64 routing of this rank's tokens (global expert ids, ``-1`` = none), a copy
            taken at the dispatch.
        recv_topk_idx: ``[N_recv, K]`` (rank-major) or ``[rows]`` (expert-major) int64 local expert ids (a
            copy of those the dispatch returned).
        num_recv_tokens_per_expert: ``E_local`` Python ints (rows per local expert in expert-major layout,
            including alignment padding; slots per local expert in rank-major layout, as DeepEP counts them).
    """

    buffer_handle: Any
    layout: str
    num_experts: int
    rank: int
    group_size: int
    topk_idx: torch.Tensor
    recv_topk_idx: torch.Tensor
    num_recv_tokens_per_expert: list[int] = field(default_factory=list)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.group_size


@dataclass
class LowLatencyAutogradHandle:
    """The Buffer's low-latency handle plus the routing of this rank's tokens.

    Attributes:
        buffer_handle: ``(src_info [E_local, R*N] int32, layout_range [E_local, R] int64, N, H, E)``.
        topk_idx: ``[T, K]`` int64 routing used by the dispatch (a copy taken then).
        num_experts: ``E``.
        rank, group_size: this rank and ``R``.
    """

    buffer_handle: Any
    topk_idx: torch.Tensor
    num_experts: int
    rank: int
    group_size: int

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.group_size

    @property
    def num_max_dispatch_tokens_per_rank(self) -> int:
        return int(self.buffer_handle[2])


# ----------------------------------------------------------------------------- helpers
def _refuses_bad_input(fn):
    """An error (bad input above all) raised before ``fn`` reached its Buffer's collective call means this
    rank will not make the call its peers may be waiting in: tell them (``Buffer._refuse``)."""
    @functools.wraps(fn)
    def wrapper(buffer, *args, **kwargs):
        check_buffer(buffer, f"ubep_torch.functional.{fn.__name__}")
        attempts = getattr(buffer, "_seq", None)    # (a call it made, or refused itself, counts one)
        try:
            return fn(buffer, *args, **kwargs)
        except BaseException as e:
            refuse = getattr(buffer, "_refuse", None)
            if refuse is not None and buffer._seq == attempts and refusal(e):
                refuse(fn.__name__)
            raise
    return wrapper


def _backward_of(name: str):
    """The backward of ``ubep_torch.functional.<name>``: the errors of the Buffer's waits inside it say so
    after their phase (its calls are the reverse exchange, which the user did not call by that name)."""
    def wrap(backward):
        @functools.wraps(backward)
        def named(ctx, *grads):
            waits_in = getattr(ctx.buffer, "_waits_in", None)     # (an object with the Buffer's API may lack it)
            if waits_in is None:
                return backward(ctx, *grads)
            with waits_in(f"in the backward of ubep_torch.functional.{name}"):
                return backward(ctx, *grads)
        return named
    return wrap


def check_buffer(buffer, where: str) -> None:
    """``buffer`` has a Buffer's ``rank`` and ``group_size`` (a ``ubep_torch.Buffer``, or an object with its
    API: these functions only call it); else TypeError naming ``where``."""
    try:
        int(buffer.rank), int(buffer.group_size)
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"{where}: buffer must be a ubep_torch.Buffer (or an object with its API), got "
                        f"{type(buffer).__name__}") from None


def _rank_and_size(buffer) -> tuple[int, int]:
    return int(buffer.rank), int(buffer.group_size)


def _check_tensors(fn: str, **args) -> None:
    for name, t in args.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ubep_torch.functional.{fn}: {name} must be a tensor, got {type(t).__name__}")
        check_host(f"functional.{fn}: {name}", t)
        if t.layout != torch.strided or t.is_nested:
            raise TypeError(f"ubep_torch.functional.{fn}: {name} must be a dense tensor, got "
                            f"{'a nested tensor' if t.is_nested else t.layout}")


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   group_size: int) -> None:
    _check_tensors("dispatch", x=x, topk_idx=topk_idx, topk_weights=topk_weights)
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"ubep_torch.functional: topk_weights must be a float tensor, got {topk_weights.dtype}")
    if x.dim() != 2:
        raise ValueError(f"ubep_torch.functional: x must be [T, H], got shape {tuple(x.shape)}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"ubep_torch.functional: topk_idx must be [T, K] with T = {x.shape[0]}, "
                         f"got {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"ubep_torch.functional: topk_weights {tuple(topk_weights.shape)} must have the "
                         f"shape of topk_idx {tuple(topk_idx.shape)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"ubep_torch.functional: topk_idx must be int64, got {topk_idx.dtype}")
    num_experts = check_count("ubep_torch.functional: num_experts", num_experts, 1)
    if num_experts % group_size != 0:
        raise ValueError(f"ubep_torch.functional: num_experts={num_experts} is not divisible by the "
                         f"group size {group_size}")


def _dense_weights(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, E]`` with ``w[t, topk_idx[t, k]] = topk_weights[t, k]`` (slots with ``-1`` are dropped)."""
    valid = topk_idx >= 0
    out = topk_weights.new_zeros(topk_idx.shape[0], num_experts)
    out.scatter_add_(1, topk_idx.clamp(min=0), torch.where(valid, topk_weights, torch.zeros_like(topk_weights)))
    return out


def _gather_slots(per_expert: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_dense_weights`: ``[T, E] -> [T, K]``, 0 where ``topk_idx`` is ``-1``."""
    g = per_expert.gather(1, topk_idx.clamp(min=0))
    return torch.where(topk_idx >= 0, g, torch.zeros_like(g))


def _expert_major_columns(rows_eid: torch.Tensor, rank: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert column of each expert-major row and the mask of real (non-padding) rows."""
    valid = rows_eid >= 0
    return (rows_eid.clamp(min=0) + rank * num_local), valid


# ----------------------------------------------------------------------------- normal mode
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer, topk_idx, num_experts, expert_alignment, layout, out):
        rank, group_size = _rank_and_size(buffer)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \
            buffer.get_dispatch_layout(topk_idx, num_experts)
        kwargs = {}
        if layout != "rank_major":
            kwargs["layout"] = layout
        exact = topk_weights.dtype != torch.float32
        recv_x, recv_topk_idx, recv_topk_weights, counts, bhandle, _ = buffer.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank, num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx, topk_weights=topk_weights.detach().float(),
            expert_alignment=expert_alignment, **kwargs)
        # (copies of the routing and of the received ids: backward reads them, and the caller may reuse its
        # tensor, or change the ids returned to it, before then)
        handle = AutogradHandle(bhandle, layout, num_experts, rank, group_size, topk_idx.detach().clone(),
                                recv_topk_idx.clone(), list(counts))
        num_local = num_experts // group_size
        if exact:
            # Carry the weights bit-exactly as a payload of their own (the Buffer's weight field is float32).
            if layout == "rank_major":
                recv_w = buffer.dispatch(topk_weights.detach().contiguous(), handle=bhandle)[0]
                recv_topk_weights = torch.where(recv_topk_idx >= 0, recv_w, torch.zeros_like(recv_w))
            else:
                dense = _dense_weights(topk_idx, topk_weights.detach(), num_experts)
                recv_dense = buffer.dispatch(dense, handle=bhandle)[0]
                cols, valid = _expert_major_columns(recv_topk_idx, rank, num_local)
                w = recv_dense.gather(1, cols[:, None])[:, 0] if recv_dense.shape[0] else recv_dense.new_zeros(0)
                recv_topk_weights = torch.where(valid, w, torch.zeros_like(w))
        else:
            recv_topk_weights = recv_topk_weights.to(topk_weights.dtype)
        if not recv_x.is_contiguous():
            recv_x = recv_x.contiguous()
        ctx.handle = handle
        ctx.buffer = buffer
        ctx.weight_dtype = topk_weights.dtype
        ctx.x_dtype = x.dtype
        out.append(handle)
        ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights

    @staticmethod
    @once_differentiable
    @_backward_of("dispatch")
    def backward(ctx, grad_recv_x, _grad_recv_topk_idx, grad_recv_topk_weights):
        handle: AutogradHandle = ctx.handle
        buffer = ctx.buffer
        bhandle = handle.buffer_handle
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_recv_x = grad_recv_x.contiguous()
        grad_x = grad_w = None
        if handle.layout == "rank_major":
            # Slots whose expert lives elsewhere were constant zeros in the forward: no gradient there.
            gw = torch.where(handle.recv_topk_idx >= 0, grad_recv_topk_weights,
                             torch.zeros_like(grad_recv_topk_weights))
            if need_w and ctx.weight_dtype == torch.float32:
                grad_x, grad_w, _ = buffer.combine(grad_recv_x, bhandle, topk_weights=gw.float().contiguous())
            else:
                grad_x = buffer.combine(grad_recv_x, bhandle)[0]
                if need_w:
                    grad_w = buffer.combine(gw.contiguous(), bhandle)[0]
        else:
            valid = handle.recv_topk_idx >= 0
            grad_recv_x = torch.where(valid[:, None], grad_recv_x, torch.zeros_like(grad_recv_x))
            grad_x = buffer.combine(grad_recv_x, bhandle)[0]
            if need_w:
                # Each row is one (token, local expert): send its weight gradient back in the column of its
                # global expert, so the unweighted sum over rows and ranks keeps the slots apart.
                cols, valid = _expert_major_columns(handle.recv_topk_idx, handle.rank, handle.num_local_experts)
                gw = torch.where(valid, grad_recv_topk_weights, torch.zeros_like(grad_recv_topk_weights))
                payload = gw.new_zeros(gw.shape[0], handle.num_experts)
                if gw.shape[0]:
                    payload.scatter_(1, cols[:, None], gw[:, None])
                per_expert = buffer.combine(payload, bhandle)[0]
                grad_w = _gather_slots(per_expert, handle.topk_idx)
        if grad_x is not None:
            grad_x = grad_x.to(ctx.x_dtype) if need_x else None
        if grad_w is not None:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, buffer, handle: AutogradHandle):
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.y_dtype = y.dtype
        combined = buffer.combine(y.contiguous(), handle.buffer_handle)[0]
        return combined

    @staticmethod
    @once_differentiable
    @_backward_of("combine")
    def backward(ctx, grad_out):
        handle: AutogradHandle = ctx.handle
        grad_y = ctx.buffer.dispatch(grad_out.contiguous(), handle=handle.buffer_handle)[0]
        if handle.layout == "expert_major":
            # Alignment padding rows belong to no token: their outputs never reach any token.
            grad_y = torch.where((handle.recv_topk_idx >= 0)[:, None], grad_y, torch.zeros_like(grad_y))
        return grad_y.to(ctx.y_dtype), None, None


@_refuses_bad_input
def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             *, expert_alignment: int = 1, layout: str = "rank_major",
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AutogradHandle]:
    """Differentiable normal-mode dispatch (DeepEP semantics).

    Args:
        buffer: a :class:`ubep_torch.Buffer` (or any object with DeepEP's normal-mode API).
        x: ``[T, H]`` float tensor (float32, bf16, float16 or float64); gradients flow back to it.
        topk_idx: ``[T, K]`` int64 global expert ids, ``-1`` for an empty slot.
        topk_weights: ``[T, K]`` float weights; gradients flow back to them.
        num_experts: ``E`` (divisible by the group size).
        expert_alignment: each per-expert count is rounded up to a multiple of this.
        layout: ``"rank_major"`` (DeepEP's layout: one row per (token, destination rank), grouped by source
            rank) or ``"expert_major"`` (one row per (token, local expert), grouped by local expert).
    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``:

        * rank-major: ``recv_x [N_recv, H]``, ``recv_topk_idx [N_recv, K]`` int64 local expert ids (``-1``
          where the expert is on another rank), ``recv_topk_weights [N_recv, K]`` (0 in those slots).
        * expert-major: ``recv_x [rows, H]``, ``recv_topk_idx [rows]`` int64 local expert id of each row
          (``-1`` for alignment padding), ``recv_topk_weights [rows]`` weight of that (token, expert)
          (the sum of its slots' weights where the token lists the expert more than once).
        * ``handle``: a :class:`AutogradHandle` for :func:`combine`; ``handle.num_recv_tokens_per_expert``
          is the Buffer's ``num_recv_tokens_per_expert_list``.

        ``recv_topk_weights`` has the dtype of ``topk_weights``.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"ubep_torch.functional.dispatch: layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int32:
        topk_idx = topk_idx.to(torch.int64)   # accepted like Buffer.dispatch does
    _check_routing(x, topk_idx, topk_weights, num_experts, int(buffer.group_size))
    out: list[AutogradHandle] = []
    recv_x, recv_topk_idx, recv_topk_weights = _Dispatch.apply(
        x, topk_weights, buffer, topk_idx, num_experts, expert_alignment, layout, out)
    return recv_x, recv_topk_idx, recv_topk_weights, out[0]


@_refuses_bad_input
def combine(buffer, y: torch.Tensor, handle: AutogradHandle) -> torch.Tensor:
    """Differentiable normal-mode combine: the plain (unweighted) sum of each token's returned rows.

    Args:
        buffer: the Buffer that made ``handle``.
        y: ``[N_recv, H]`` (rank-major) or ``[rows, H]`` (expert-major) expert outputs, row-aligned with the
            ``recv_x`` of the matching :func:`dispatch`. Apply routing weights before combining.
        handle: the :class:`AutogradHandle` returned by :func:`dispatch`.
    Returns:
        ``[T, H]`` tensor in the dtype of ``y``: for each of this rank's tokens the sum of the rows that came
        back from every rank (and, in expert-major layout, every local expert) it was sent to. Tokens sent
        nowhere get zeros.
    """
    if not isinstance(handle, AutogradHandle):
        raise TypeError("ubep_torch.functional.combine: handle must be the AutogradHandle returned by "
                        f"ubep_torch.functional.dispatch, got {type(handle).__name__}")
    _check_tensors("combine", y=y)
    return _Combine.apply(y, buffer, handle)


# ----------------------------------------------------------------------------- low-latency mode
def _ll_row_keys(bhandle, group_size: int) -> torch.Tensor:
    """``[E_local, R*N]`` int64 key ``src_rank * N + src_token`` of every valid row, ``R*N`` elsewhere."""
    src_info, layout_range, n = bhandle[0], bhandle[1], int(bhandle[2])
    num_local, slots = src_info.shape
    begin = (layout_range >> 32).long()
    count = (layout_range & 0xFFFFFFFF).long()
    pos = torch.arange(slots, dtype=torch.long)
    keys = torch.full((num_local, slots), group_size * n, dtype=torch.long)
    for r in range(group_size):
        inside = (pos[None, :] >= begin[:, r:r + 1]) & (pos[None, :] < (begin[:, r:r + 1] + count[:, r:r + 1]))
        keys = torch.where(inside, r * n + src_info.long(), keys)
    return keys


def _ll_align(t: torch.Tensor, from_handle, to_handle, group_size: int) -> torch.Tensor:
    """Move rows of ``t`` (laid out as ``from_handle`` says) to the row positions of ``to_handle``.

    Two low-latency dispatches of the same routing may place a (source rank, token) pair at different rows
    (arrival order); both handles name the source of every row, which is enough to realign.
    """
    kf, kt = _ll_row_keys(from_handle, group_size), _ll_row_keys(to_handle, group_size)
    if torch.equal(kf, kt):
        return t
    of, ot = kf.argsort(dim=1, stable=True), kt.argsort(dim=1, stable=True)
    gathered = t.gather(1, of[..., None].expand(-1, -1, t.shape[-1]))
    out = torch.zeros_like(t)
    out.scatter_(1, ot[..., None].expand(-1, -1, t.shape[-1]), gathered)
    invalid = kt >= group_size * int(to_handle[2])
    return torch.where(invalid[..., None], torch.zeros_like(out), out)


def _ll_valid_rows(bhandle) -> torch.Tensor:
    layout_range = bhandle[1]
    count = (layout_range & 0xFFFFFFFF).long().sum(dim=1)
    slots = bhandle[0].shape[1]
    return torch.arange(slots)[None, :] < count[:, None]


def _ll_dispatch_raw(buffer, x: torch.Tensor, topk_idx: torch.Tensor, n: int, num_experts: int):
    recv_x, recv_count, bhandle, _, _hook = buffer.low_latency_dispatch(
        x, topk_idx, n, num_experts, use_fp8=False, return_recv_hook=False)
    out = recv_x.clone()
    for e, c in enumerate(recv_count.tolist()):
        out[e, c:].zero_()      # past the count: zero, never stale bytes (NaN would reach weight gradients)
    return out, recv_count.clone(), bhandle


def _ll_combine_raw(buffer, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, bhandle):
    return buffer.low_latency_combine(y.contiguous(), topk_idx, topk_weights, bhandle)[0]


def _unit_weights(topk_idx: torch.Tensor) -> torch.Tensor:
    return (topk_idx >= 0).to(torch.float32)


class _LowLatencyDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buffer, topk_idx, n, num_experts, out):
        rank, group_size = _rank_and_size(buffer)
        recv_x, recv_count, bhandle = _ll_dispatch_raw(buffer, x.contiguous(), topk_idx, n, num_experts)
        # (a snapshot of the routing: the combine and both backwards read it, and the caller may reuse its
        # tensor before then)
        handle = LowLatencyAutogradHandle(bhandle, topk_idx.detach().clone(), num_experts, rank, group_size)
        out.append(handle)
        ctx.buffer, ctx.handle, ctx.x_dtype = buffer, handle, x.dtype
        ctx.mark_non_differentiable(recv_count)
        return recv_x, recv_count

    @staticmethod
    @once_differentiable
    @_backward_of("low_latency_dispatch")
    def backward(ctx, grad_recv_x, _grad_count):
        h: LowLatencyAutogradHandle = ctx.handle
        g = _ll_combine_raw(ctx.buffer, grad_recv_x.contiguous(), h.topk_idx, _unit_weights(h.topk_idx),
                            h.buffer_handle)
        return g.to(ctx.x_dtype), None, None, None, None, None


class _LowLatencyCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, buffer, handle: LowLatencyAutogradHandle):
        out = _ll_combine_raw(buffer, y, handle.topk_idx, topk_weights.detach().float(), handle.buffer_handle)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.y_dtype, ctx.w_dtype = y.dtype, topk_weights.dtype
        ctx.save_for_backward(y, topk_weights)
        return out.to(y.dtype)

    @staticmethod
    @once_differentiable
    @_backward_of("low_latency_combine")
    def backward(ctx, grad_out):
        h: LowLatencyAutogradHandle = ctx.handle
        buffer = ctx.buffer
        y, topk_weights = ctx.saved_tensors
        n, hidden, num_experts = h.num_max_dispatch_tokens_per_rank, y.shape[-1], h.num_experts
        num_local = h.num_local_experts
        # 1) the output gradient goes to every (expert, row) that contributed, like a dispatch.
        g, _, gh = _ll_dispatch_raw(buffer, grad_out.to(y.dtype).contiguous(), h.topk_idx, n, num_experts)
        g = _ll_align(g, gh, h.buffer_handle, h.group_size)
        # 2) each row's weight: the expert rank never saw the weights, so they travel too (columns of an
        #    H-wide payload, E at a time, because the Buffer is sized for H-wide rows).
        dense_w = _dense_weights(h.topk_idx, topk_weights.detach().to(y.dtype), num_experts)
        row_w = torch.zeros(num_local, g.shape[1], dtype=y.dtype)
        local_cols = torch.arange(num_local) + h.rank * num_local
        for start in range(0, num_experts, hidden):
            chunk = dense_w[:, start:start + hidden]
            payload = torch.zeros(dense_w.shape[0], hidden, dtype=y.dtype)
            payload[:, :chunk.shape[1]] = chunk
            rw, _, wh = _ll_dispatch_raw(buffer, payload, h.topk_idx, n, num_experts)
            rw = _ll_align(rw, wh, h.buffer_handle, h.group_size)
            for e in range(num_local):
                c = int(local_cols[e]) - start
                if 0 <= c < chunk.shape[1]:
                    row_w[e] = rw[e, :, c]
        valid = _ll_valid_rows(h.buffer_handle)
        grad_y = torch.where(valid[..., None], g * row_w[..., None], torch.zeros_like(g))
        grad_w = None
        if ctx.needs_input_grad[1]:
            # 3) d(out[t]) / d(w[t, k]) = <grad_out[t], y[e_k][row of t]>: computed on the expert rank, sent
            #    back in the column of the global expert (unit weights), gathered into the K slots.
            dots = torch.where(valid, (g.double() * y.double()).sum(-1), torch.zeros(()).double()).to(y.dtype)
            per_expert = torch.zeros(grad_out.shape[0], num_experts, dtype=y.dtype)
            for start in range(0, num_experts, hidden):
                width = min(hidden, num_experts - start)
                payload = torch.zeros(num_local, g.shape[1], hidden, dtype=y.dtype)
                for e in range(num_local):
                    c = int(local_cols[e]) - start
                    if 0 <= c < width:
                        payload[e, :, c] = dots[e]
                back = _ll_combine_raw(buffer, payload, h.topk_idx, _unit_weights(h.topk_idx), h.buffer_handle)
                per_expert[:, start:start + width] = back[:, :width].to(y.dtype)
            grad_w = _gather_slots(per_expert, h.topk_idx).to(ctx.w_dtype)
        return grad_y.to(ctx.y_dtype), grad_w, None, None


@_refuses_bad_input
def low_latency_dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, LowLatencyAutogradHandle]:
    """Differentiable low-latency dispatch (no fp8: gradients need the real values).

    Args:
        buffer: a :class:`ubep_torch.Buffer` made with ``low_latency_mode=True``.
        x: ``[T, H]`` bfloat16 tokens, ``T <= N`` (low-latency mode moves bf16 only, as in DeepEP).
        topk_idx: ``[T, K]`` int64 global expert ids (``-1`` = none).
        num_max_dispatch_tokens_per_rank: ``N`` (equal on all ranks).
        num_experts: ``E``.
    Returns:
        ``(recv_x [E_local, R*N, H], recv_count [E_local] int32, handle)``. Only the first ``recv_count[e]``
        rows of expert ``e`` are valid; the rows after them are zero, so a batched GEMM over the whole
        tensor gives finite (zero) contributions to weight gradients. ``recv_x`` is a private copy, safe
        to keep for backward while later low-latency calls reuse the Buffer's receive halves.
    """
    if isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int32:
        topk_idx = topk_idx.to(torch.int64)
    _check_tensors("low_latency_dispatch", x=x, topk_idx=topk_idx)
    n = check_count("ubep_torch.functional.low_latency_dispatch: num_max_dispatch_tokens_per_rank",
                    num_max_dispatch_tokens_per_rank, 1)
    e = check_count("ubep_torch.functional.low_latency_dispatch: num_experts", num_experts, 1)
    out: list[LowLatencyAutogradHandle] = []
    recv_x, recv_count = _LowLatencyDispatch.apply(x, buffer, topk_idx, n, e, out)
    return recv_x, recv_count, out[0]


@_refuses_bad_input
def low_latency_combine(buffer, y: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: LowLatencyAutogradHandle) -> torch.Tensor:
    """Differentiable weighted low-latency combine.

    Args:
        buffer: the Buffer that made ``handle``.
        y: ``[E_local, R*N, H]`` expert outputs, row-aligned with the ``recv_x`` of the dispatch (bfloat16
            for a :class:`ubep_torch.Buffer`, whose low-latency mode moves bf16 rows).
        topk_idx: ``[T, K]`` the routing given to the dispatch.
        topk_weights: ``[T, K]`` weights; gradients flow back to them.
        handle: the :class:`LowLatencyAutogradHandle` of :func:`low_latency_dispatch`.
    Returns:
        ``[T, H]`` in the dtype of ``y``: ``out[t] = sum_k w[t, k] * y[e_k][row of t]``.
    """
    if not isinstance(handle, LowLatencyAutogradHandle):
        raise TypeError("ubep_torch.functional.low_latency_combine: handle must come from "
                        "ubep_torch.functional.low_latency_dispatch")
    _check_tensors("low_latency_combine", y=y, topk_idx=topk_idx, topk_weights=topk_weights)
    from .buffer import Buffer
    if isinstance(buffer, Buffer) and y.dtype != torch.bfloat16:
        raise TypeError(f"ubep_torch.functional.low_latency_combine: y must be bfloat16 (a Buffer's low-latency "
                        f"mode moves bf16 rows, as DeepEP's does), got {y.dtype}")
    if not (topk_idx.shape == handle.topk_idx.shape and torch.equal(topk_idx.to(torch.int64), handle.topk_idx)):
        raise ValueError("ubep_torch.functional.low_latency_combine: topk_idx differs from the one dispatched")
    if not topk_weights.dtype.is_floating_point:
        raise TypeError(f"ubep_torch.functional.low_latency_combine: topk_weights must be a float tensor, got "
                        f"{topk_weights.dtype}")
    return _LowLatencyCombine.apply(y, topk_weights, buffer, handle)

