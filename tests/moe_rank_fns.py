"""Rank-side functions for the autograd and MoE-layer tests (run on every rank by ``RankPool.run``).

Also holds :class:`GatherBuffer`, a plain-torch reference of the Buffer's semantics built on
``all_gather_object``: slow and obviously correct, it lets the autograd rules be checked independently of
the UGAS data path, and the real Buffer be checked against it.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from ubep_torch import functional as F
from ubep_torch import nn as unn


# ----------------------------------------------------------------------------- reference buffer
class GatherBuffer:
    """DeepEP normal/low-latency semantics (plus the expert-major layout) in plain torch."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.low_latency_mode = True

    def _gather(self, obj):
        out = [None] * self.group_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts, *args, **kwargs):
        e_local = num_experts // self.group_size
        t = topk_idx.shape[0]
        dest = torch.where(topk_idx >= 0, topk_idx // e_local, torch.full_like(topk_idx, -1))
        in_rank = torch.zeros(t, self.group_size, dtype=torch.bool)
        for r in range(self.group_size):
            in_rank[:, r] = (dest == r).any(dim=1)
        per_expert = torch.zeros(num_experts, dtype=torch.int32)
        valid = topk_idx[topk_idx >= 0]
        per_expert.index_add_(0, valid, torch.ones_like(valid, dtype=torch.int32))
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, layout="rank_major", **kwargs):
        cached = handle is not None
        if cached:
            layout, topk_idx, num_experts, rows = handle
        else:
            num_experts = int(num_tokens_per_expert.numel())
            topk_weights = topk_weights if topk_weights is not None else torch.zeros(topk_idx.shape)
        everything = self._gather((x, topk_idx, topk_weights if not cached else None))
        e_local = num_experts // self.group_size
        lo = self.rank * e_local
        if not cached:
            rows = []  # (src rank, src token, local expert or -1 for a rank-major row)
            if layout == "rank_major":
                for s, (_, idx, _) in enumerate(everything):
                    for t in range(idx.shape[0]):
                        if ((idx[t] >= lo) & (idx[t] < lo + e_local)).any():
                            rows.append((s, t, -1))
            else:
                for e in range(e_local):
                    start = len(rows)
                    for s, (_, idx, _) in enumerate(everything):
                        for t in range(idx.shape[0]):
                            if (idx[t] == lo + e).any():
                                rows.append((s, t, e))
                    while (len(rows) - start) % expert_alignment:
                        rows.append((-1, -1, -1))
        hidden = x.shape[1]
        recv_x = torch.zeros(len(rows), hidden, dtype=x.dtype)
        for i, (s, t, _) in enumerate(rows):
            if s >= 0:
                recv_x[i] = everything[s][0][t]
        new_handle = (layout, topk_idx, num_experts, rows)
        if cached:
            return recv_x, None, None, None, None, None
        if layout == "rank_major":
            k = topk_idx.shape[1]
            recv_idx = torch.full((len(rows), k), -1, dtype=torch.int64)
            recv_w = torch.zeros(len(rows), k, dtype=torch.float32)
            for i, (s, t, _) in enumerate(rows):
                idx, w = everything[s][1][t], everything[s][2][t]
                mine = (idx >= lo) & (idx < lo + e_local)
                recv_idx[i] = torch.where(mine, idx - lo, torch.full_like(idx, -1))
                recv_w[i] = torch.where(mine, w.float(), torch.zeros_like(w.float()))
            counts = [int(((recv_idx == e).any(dim=1)).sum()) for e in range(e_local)]
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        else:
            recv_idx = torch.tensor([e for (_, _, e) in rows], dtype=torch.int64)
            recv_w = torch.zeros(len(rows), dtype=torch.float32)
            for i, (s, t, e) in enumerate(rows):
                if s >= 0:
                    idx, w = everything[s][1][t], everything[s][2][t]
                    recv_w[i] = w[idx == lo + e].float().sum()
            counts = [int((recv_idx == e).sum()) for e in range(e_local)]
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        return recv_x, recv_idx, recv_w, counts, new_handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, **kwargs):
        _layout, topk_idx, _, rows = handle
        everything = self._gather((x, rows, topk_weights))
        t = topk_idx.shape[0]
        out = torch.zeros(t, x.shape[1], dtype=x.dtype)
        out_w = None if topk_weights is None else torch.zeros(t, topk_weights.shape[1], dtype=topk_weights.dtype)
        for y, rws, w in everything:
            for i, (s, tok, _) in enumerate(rws):
                if s == self.rank:
                    out[tok] += y[i]
                    if out_w is not None:
                        out_w[tok] += w[i]
        return out, out_w, None

    def low_latency_dispatch(self, x, topk_idx, n, num_experts, use_fp8=False, return_recv_hook=False,
                             **kwargs):
        everything = self._gather((x, topk_idx))
        e_local = num_experts // self.group_size
        lo = self.rank * e_local
        recv = torch.zeros(e_local, self.group_size * n, x.shape[1], dtype=x.dtype)
        src_info = torch.zeros(e_local, self.group_size * n, dtype=torch.int32)
        layout_range = torch.zeros(e_local, self.group_size, dtype=torch.int64)
        count = torch.zeros(e_local, dtype=torch.int32)
        for e in range(e_local):
            pos = 0
            for s, (xs, idx) in enumerate(everything):
                begin = pos
                for t in range(idx.shape[0]):
                    if (idx[t] == lo + e).any():
                        recv[e, pos] = xs[t]
                        src_info[e, pos] = t
                        pos += 1
                layout_range[e, s] = (begin << 32) | (pos - begin)
            count[e] = pos
        handle = (src_info, layout_range, n, x.shape[1], num_experts)
        hook = (lambda: None) if return_recv_hook else None
        return recv, count, handle, None, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kwargs):
        src_info, layout_range, _n, _, num_experts = handle
        everything = self._gather((x, src_info, layout_range))
        e_local = num_experts // self.group_size
        out = torch.zeros(topk_idx.shape[0], x.shape[-1], dtype=x.dtype)
        for r, (y, info, rng) in enumerate(everything):
            for e in range(e_local):
                begin, cnt = int(rng[e, self.rank]) >> 32, int(rng[e, self.rank]) & 0xFFFFFFFF
                for j in range(begin, begin + cnt):
                    t = int(info[e, j])
                    slot = (topk_idx[t] == r * e_local + e)
                    w = topk_weights[t][slot].sum()
                    out[t] += (w.double() * y[e, j].double()).to(x.dtype)
        return out, None, None


def make_buffer(ctx, kind: str):
    """A cached Buffer of ``kind`` ("ref" = :class:`GatherBuffer`, "ubep" = :class:`ubep_torch.Buffer`)."""
    key = f"buffer:{kind}"
    if key not in ctx.cache:
        if kind == "ref":
            ctx.cache[key] = GatherBuffer(ctx.group)
        else:
            from ubep_torch.buffer import Buffer
            ctx.cache[key] = Buffer(ctx.group, num_nvl_bytes=1 << 22, num_rdma_bytes=1 << 22,
                                    low_latency_mode=True, num_qps_per_rank=1)
    return ctx.cache[key]


# ----------------------------------------------------------------------------- shared routing fixtures
def routing(seed: int, t: int, k: int, num_experts: int, drop_slot: bool = True):
    """Distinct experts per token (some rows with a ``-1`` slot) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    if drop_slot and t > 1:
        idx[1, -1] = -1
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    return idx, w


def dense_moe_reference(x, idx, w, experts):
    """``out[t] = sum_k w[t, k] * experts[idx[t, k]](x[t])`` in plain torch (the single-process truth)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                out[t] = out[t] + w[t, k] * experts[e](x[t])
    return out


# ----------------------------------------------------------------------------- autograd checks
def rank_gradcheck(ctx, kind: str, layout: str, seed: int = 0):
    """gradcheck of dispatch -> per-expert linear map weighted by recv weights -> combine, in float64.

    The map is fixed per expert (``A_e``); the function of ``(x, topk_weights)`` is the MoE output, so the
    check covers both the dispatch/combine pair and the weight path. Every rank runs the same sequence of
    collective calls (gradcheck's perturbations are deterministic and equal in number on every rank).
    """
    buf = make_buffer(ctx, kind)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h = 2 * world, 2, 3, 4
    e_local = e_total // world
    idx, w = routing(100 * seed + r, t, k, e_total)
    x = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + r))
    a = torch.randn(e_total, h, h, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    a_local = a[r * e_local:(r + 1) * e_local]

    def moe(x_, w_):
        recv_x, recv_idx, recv_w, handle = F.dispatch(buf, x_, idx, w_, e_total, layout=layout)
        if layout == "rank_major":
            y = torch.zeros_like(recv_x)
            for e in range(e_local):
                y = y + (recv_idx == e).any(1, keepdim=True) * (recv_w * (recv_idx == e)).sum(1, keepdim=True) \
                    * (recv_x @ a_local[e])
        else:
            y = torch.zeros_like(recv_x)
            for e in range(e_local):
                y = y + (recv_idx == e)[:, None] * recv_w[:, None] * (recv_x @ a_local[e])
        return F.combine(buf, y, handle)

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ok = torch.autograd.gradcheck(moe, (xr, wr), eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=False)
    out = moe(x, w)
    ref = dense_moe_reference(x, idx, w, [lambda v, m=m: v @ m for m in a])
    return bool(ok), float((out - ref).abs().max())


def rank_dispatch_roundtrip(ctx, kind: str, layout: str, dtype_name: str):
    """combine(dispatch(x)) / (number of destination ranks or experts) == x; grads are exact too."""
    buf = make_buffer(ctx, kind)
    dtype = getattr(torch, dtype_name)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h = 2 * world, 2, 5, 8
    e_local = e_total // world
    idx, w = routing(11 + r, t, k, e_total)
    w = w.float()
    x = (torch.arange(t * h, dtype=torch.float32).reshape(t, h) / 7 + r).to(dtype).requires_grad_()
    wr = w.clone().requires_grad_()
    recv_x, _recv_idx, recv_w, handle = F.dispatch(buf, x, idx, wr, e_total, layout=layout)
    out = F.combine(buf, recv_x, handle)
    dest = idx.clamp(min=0) // e_local
    if layout == "rank_major":
        mult = torch.stack([((dest == d) & (idx >= 0)).any(1) for d in range(world)], 1).sum(1)
    else:
        mult = (idx >= 0).sum(1)
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    ok_fwd = torch.allclose(out.float(), x.float() * mult[:, None].float(), rtol=rtol)
    (out.float().sum() + (recv_w * 2).sum()).backward()
    ok_gx = torch.allclose(x.grad.float(), mult[:, None].float().expand(t, h))
    ok_gw = torch.equal(wr.grad, torch.where(idx >= 0, 2.0, 0.0))
    return ok_fwd, ok_gx, ok_gw, out.dtype == dtype, recv_x.dtype == dtype


def rank_low_latency_grads(ctx, kind: str, dtype_name: str):
    """Low-latency dispatch -> per-expert map -> weighted combine matches a dense reference, grads too."""
    buf = make_buffer(ctx, kind)
    dtype = getattr(torch, dtype_name)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h, n = 2 * world, 2, 3, 8, 4
    e_local = e_total // world
    idx, w = routing(21 + r, t, k, e_total)
    w = w.to(dtype)
    x = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(5 + r)).to(dtype)
    a = torch.randn(e_total, h, h, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).to(dtype)
    a_local = a[r * e_local:(r + 1) * e_local]

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    recv_x, _recv_count, handle = F.low_latency_dispatch(buf, xr, idx, n, e_total)
    y = torch.bmm(recv_x, a_local)
    out = F.low_latency_combine(buf, y, idx, wr, handle)
    g_out = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1 + r)).to(dtype)
    (out * g_out).sum().backward()

    # The truth: float64 dense math on the very same (possibly bf16-rounded) inputs; errors are relative
    # to the largest magnitude of each reference tensor.
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = dense_moe_reference(xd, idx, wd, [lambda v, m=m: v @ m.double() for m in a])
    (ref * g_out.double()).sum().backward()

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30))

    with torch.no_grad():
        return rel(out, ref), rel(xr.grad, xd.grad), rel(wr.grad, wd.grad)


def rank_inplace_on_outputs(ctx, kind: str) -> dict:
    """In-place ops on what the differentiable calls return, as on any torch result (they were views of the
    Buffer's reused output memory, which autograd refused to modify in place): each case's gradient of x
    against the same math written out of place."""
    buf = make_buffer(ctx, kind)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h, n = 2 * world, 2, 5, 8, 8
    idx, w = routing(31 + r, t, k, e_total)
    w = w.float()
    x0 = torch.randn(t, h, generator=torch.Generator().manual_seed(3 + r))
    res = {}

    def grad_of(fn):
        x = x0.clone().requires_grad_()
        fn(x).sum().backward()
        return x.grad

    def normal(x, inplace):
        recv_x, _, _, handle = F.dispatch(buf, x, idx, w, e_total)
        recv_x = recv_x.mul_(2.0) if inplace else recv_x * 2.0
        out = F.combine(buf, recv_x, handle)
        if inplace:
            out += x
            return out
        return out + x

    def low_latency(x, inplace):
        recv_x, _, handle = F.low_latency_dispatch(buf, x.bfloat16(), idx, n, e_total)   # (bf16 rows)
        recv_x = recv_x.mul_(3.0) if inplace else recv_x * 3.0
        out = F.low_latency_combine(buf, recv_x, idx, w, handle)
        if inplace:
            out.mul_(2.0)
            return out
        return out * 2.0

    torch.manual_seed(0)
    layer = unn.MoE(h, 12, e_total, k, buffer=buf)      # no shared expert: its output is combine's

    def moe(x, inplace):
        y = layer(x)
        if inplace:
            y += x                                       # an in-place residual
            return y
        return y + x

    for name, fn in (("normal", normal), ("low_latency", low_latency), ("moe", moe)):
        try:
            got = grad_of(lambda x, fn=fn: fn(x, True))
            res[name] = torch.allclose(got, grad_of(lambda x, fn=fn: fn(x, False)), rtol=1e-5, atol=1e-6)
        except RuntimeError as e:
            res[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return res


# ----------------------------------------------------------------------------- MoE layer checks
def moe_config(router: str, shared: bool):
    return {"hidden": 16, "ffn_hidden": 24, "num_experts": 4, "top_k": 2, "router": router,
                "shared_expert_hidden": 12 if shared else None, "aux_loss_coef": 0.01}


def rank_moe_layer(ctx, kind: str, router: str, shared: bool, layout: str, dtype_name: str = "float64"):
    """Run the EP layer on this rank's tokens; return outputs, aux loss and gradients for comparison."""
    dtype = getattr(torch, dtype_name)
    buf = make_buffer(ctx, kind)
    cfg = moe_config(router, shared)
    torch.manual_seed(0)
    dense = unn.MoE(**cfg).to(dtype)
    layer = unn.MoE(**cfg, buffer=buf, layout=layout).to(dtype)
    layer.load_dense_state_dict(dense.state_dict())
    x = torch.randn(6, cfg["hidden"], generator=torch.Generator().manual_seed(40 + ctx.rank),
                    dtype=torch.float64).to(dtype).requires_grad_()
    out = layer(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(60 + ctx.rank), dtype=torch.float64)
    loss = (out * g.to(dtype)).sum() + layer.aux_loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    return out.detach(), layer.aux_loss.detach(), x.grad.detach(), grads


def rank_repeated_expert(ctx, kind: str, layout: str, wdtype_name: str):
    """Tokens that list an expert in two slots (DeepEP routing does not forbid it in normal mode): the MoE
    output and the gradients of x and of every slot's weight equal the dense reference's, where both
    slots count. Returns (output error, grad x error, grad w error), each relative to the reference."""
    buf = make_buffer(ctx, kind)
    r, world = ctx.rank, ctx.world_size
    e_total, t, h = 2 * world, 4, 8
    e_local = e_total // world
    idx = torch.tensor([[1, 1, 0], [e_total - 1, 2, e_total - 1], [3, -1, 3], [0, 2, 1]])
    wdtype = getattr(torch, wdtype_name)
    w0 = (torch.rand(t, 3, generator=torch.Generator().manual_seed(5 + r), dtype=torch.float64) + 0.1).to(wdtype)
    x0 = torch.randn(t, h, generator=torch.Generator().manual_seed(9 + r))
    a = torch.randn(e_total, h, h, generator=torch.Generator().manual_seed(3)) / h ** 0.5
    a_local = a[r * e_local:(r + 1) * e_local]
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    recv_x, recv_idx, recv_w, handle = F.dispatch(buf, x, idx, w, e_total, layout=layout)
    y = torch.zeros_like(recv_x)
    for e in range(e_local):
        if layout == "rank_major":
            y = y + (recv_w * (recv_idx == e)).sum(1, keepdim=True).to(y.dtype) * (recv_x @ a_local[e])
        else:
            y = y + ((recv_idx == e) * recv_w).to(y.dtype)[:, None] * (recv_x @ a_local[e])
    out = F.combine(buf, y, handle)
    out.square().sum().backward()
    xd, wd = x0.double().requires_grad_(), w0.double().requires_grad_()
    ref = dense_moe_reference(xd, idx, wd, [lambda v, m=m: v @ m.double() for m in a])
    ref.square().sum().backward()

    def rel(got, want):
        return float((got.double() - want).abs().max() / want.abs().max())
    return rel(out.detach(), ref.detach()), rel(x.grad, xd.grad), rel(w.grad, wd.grad)


def rank_empty_receiver(ctx, kind: str, layout: str):
    """Every token of every rank goes to the last rank's experts: the other ranks receive nothing."""
    buf = make_buffer(ctx, kind)
    world = ctx.world_size
    e_total = 2 * world
    idx = torch.tensor([[e_total - 1, e_total - 2]] * 3)
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(ctx.rank)).requires_grad_()
    w = torch.full((3, 2), 0.5, dtype=torch.float64, requires_grad=True)
    recv_x, _recv_idx, recv_w, handle = F.dispatch(buf, x, idx, w, e_total, layout=layout)
    y = recv_x * (recv_w.sum(-1, keepdim=True) if layout == "rank_major" else recv_w[:, None])
    out = F.combine(buf, y, handle)
    out.sum().backward()
    with torch.no_grad():
        return recv_x.shape[0], float((out - x).abs().max()), float((x.grad - 1).abs().max()), \
            float((w.grad - x.sum(-1, keepdim=True)).abs().max())


def rank_double_backward(ctx, kind: str, mode: str):
    """A second derivative through dispatch/combine (``create_graph=True``, then a backward through the
    gradient) raises instead of silently leaving out the terms through the exchanges; the first
    derivative is still right. Returns (first derivative right, error text or None)."""
    buf = make_buffer(ctx, kind)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h, n = 2 * world, 2, 3, 4, 4
    idx, w = routing(31 + r, t, k, e_total)
    x = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + r)).requires_grad_()
    if mode == "normal":
        recv_x, _, _, handle = F.dispatch(buf, x, idx, w, e_total)
        out = F.combine(buf, recv_x ** 2, handle)
        m = torch.stack([((idx >= 0) & (idx.clamp(min=0) // (e_total // world) == d)).any(1)
                         for d in range(world)], 1).sum(1, keepdim=True).double()
        want = 2 * x.detach() * m
    else:
        xb = x.bfloat16()
        recv_x, _, handle = F.low_latency_dispatch(buf, xb, idx, n, e_total)
        out = F.low_latency_combine(buf, (recv_x.float() ** 2).bfloat16(), idx, w.float(), handle).double()
        want = 2 * xb.detach().double() * (w * (idx >= 0)).sum(1, keepdim=True)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    first_ok = bool(torch.allclose(g.detach(), want, rtol=2e-2, atol=2e-2))
    try:
        (g ** 2).sum().backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    return first_ok, err


def rank_sync_after_reload(ctx, kind: str):
    """``data_parallel_sync`` after the PyTorch idioms that put new Parameter objects into a layer
    (``load_state_dict(..., assign=True)``, meta device then ``to_empty()``) gives the gradients it gives
    the layer they were loaded from; and a dense MoE (no Buffer) in data-parallel training has its experts
    all-reduced like any replicated parameter. Returns (reloaded layers' gradients equal, dense experts'
    gradients equal on every rank, dense experts' gradients differ before the sync)."""
    buf = make_buffer(ctx, kind)
    cfg = moe_config("softmax", False)
    x = torch.randn(6, cfg["hidden"], generator=torch.Generator().manual_seed(80 + ctx.rank))

    def grads(layer):
        layer.zero_grad()
        (layer(x) ** 2).sum().backward()
        unn.data_parallel_sync(layer)
        return [p.grad.clone() for p in layer.parameters()]
    torch.manual_seed(0)
    a = unn.MoE(**cfg, buffer=buf)
    ref = grads(a)
    b = unn.MoE(**cfg, buffer=buf)
    b.load_state_dict(a.state_dict(), assign=True)
    with torch.device("meta"):
        c = unn.MoE(**cfg, buffer=buf)
    c.to_empty(device="cpu")
    c.load_state_dict(a.state_dict())
    same = all(torch.allclose(g, r, rtol=1e-5, atol=1e-6) for layer in (b, c) for g, r in zip(grads(layer), ref))
    torch.manual_seed(1)
    dense = unn.MoE(**cfg)
    dense.zero_grad()
    (dense(x) ** 2).sum().backward()
    before = dense.experts.w_gate.grad.clone()
    dense.zero_grad()
    (dense(x) ** 2).sum().backward()
    unn.data_parallel_sync(dense)
    after = dense.experts.w_gate.grad.clone()
    gathered, gathered_before = [torch.empty_like(after) for _ in range(ctx.world_size)], \
        [torch.empty_like(before) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, after)
    dist.all_gather(gathered_before, before)
    return same, all(torch.equal(g, gathered[0]) for g in gathered), \
        not all(torch.equal(g, gathered_before[0]) for g in gathered_before)


def _ep_and_dp_groups(me: int, dp_ranks: str) -> tuple:
    """This rank's expert-parallel and data-parallel groups of four ranks (see ``rank_ep_inside_dp``); every
    rank creates every group, in the same order."""
    pairs = [[0, 1], [2, 3]] if dp_ranks == "strided" else [[0, 2], [1, 3]]
    others = [[0, 2], [1, 3]] if dp_ranks == "strided" else [[0, 1], [2, 3]]
    ep_groups = [dist.new_group(p) for p in pairs]
    dp_groups = [dist.new_group(p) for p in others]
    return (next(g for g, p in zip(ep_groups, pairs) if me in p),
            next(g for g, p in zip(dp_groups, others) if me in p))


def rank_dp_bad_module_with_replicas(ctx, dp_ranks: str) -> tuple:
    """``data_parallel_sync(module, ep_group, dp_group)`` with a bad module on rank 0 only (groups as in
    ``rank_ep_inside_dp``): every rank raises (the other replicas' ranks waited in the dp_group agreement
    before), and the world group still works after; then models whose expert parameters differ on rank 3
    only. Returns (error type, names rank 0, second case's error type, all-reduce)."""
    me = ctx.rank
    ep, dp = _ep_and_dp_groups(me, dp_ranks)
    model = torch.nn.Linear(4, 3)
    model(torch.ones(2, 4)).sum().backward()
    try:
        unn.data_parallel_sync(None if me == 0 else model, ep, dp)
        out = ("ok", False)
    except (TypeError, ValueError) as e:
        out = (type(e).__name__, "module" in str(e) if me == 0 else "rank(s) [0]" in str(e))
    # an expert parameter of another size on rank 3 only: found by its dp_group agreement alone (the ranks
    # of the other dp_group went on to average their expert-parallel group's gradients, and waited)
    odd = torch.nn.Linear(4, 5 if me == 3 else 3)
    odd.weight.expert_parallel = odd.bias.expert_parallel = True
    odd(torch.ones(2, 4)).sum().backward()
    try:
        unn.data_parallel_sync(odd, ep, dp)
        out += ("ok",)
    except (TypeError, ValueError) as e:
        out += (type(e).__name__,)
    t = torch.ones(1)
    dist.all_reduce(t)
    return out + (float(t),)


def rank_ep_inside_dp(ctx, dp_ranks: str):
    """Four ranks, two replicas of a model whose MoE layer is expert parallel over two ranks: expert-parallel
    groups [0, 1] and [2, 3] with data-parallel groups [0, 2] and [1, 3] (``dp_ranks="strided"``), or
    expert-parallel groups [0, 2] and [1, 3] with data-parallel groups [0, 1] and [2, 3] (``"adjacent"``).
    After ``data_parallel_sync(layer, ep_group, dp_group)`` every gradient must be the dense model's
    gradient of the mean loss over all four ranks (each rank's experts: their slice). Returns the largest
    difference, and whether the calls with other groups were refused."""
    from ubep_torch.buffer import Buffer
    me = ctx.rank
    ep, dp = _ep_and_dp_groups(me, dp_ranks)
    buf = Buffer(ep, num_nvl_bytes=1 << 22)
    cfg = moe_config("softmax", True)
    torch.manual_seed(0)
    dense = unn.MoE(**cfg).double()
    layer = unn.MoE(**cfg, buffer=buf).double()
    layer.load_dense_state_dict(dense.state_dict())
    xs = [torch.randn(5, cfg["hidden"], generator=torch.Generator().manual_seed(90 + r), dtype=torch.float64)
          for r in range(4)]
    out = layer(xs[me])
    ((out ** 2).sum() + layer.aux_loss).backward()
    # a group other than the layer's Buffer's is refused on every rank, gradients untouched (former bug: the
    # expert gradients came out wrong without an error)
    refused = []
    for wrong in ((), (dp,)):
        try:
            unn.data_parallel_sync(layer, *wrong)
            refused.append("no error")
        except ValueError as e:
            refused.append("Buffer's group" in str(e))
    unn.data_parallel_sync(layer, ep, dp)
    for x in xs:       # the mean over the ranks of each rank's loss, on its own batch
        y = dense(x)
        (((y ** 2).sum() + dense.aux_loss) / 4).backward()
    lo, hi = layer.expert_offset, layer.expert_offset + layer.num_local_experts
    want = {n: p.grad[lo:hi] if n.startswith("experts.") else p.grad for n, p in dense.named_parameters()}
    worst = max(float((p.grad - want[n]).abs().max()) for n, p in layer.named_parameters())
    buf.destroy()
    return worst, refused


def rank_deepcopy_of_expert_parallel_model(ctx) -> tuple:
    """``copy.deepcopy`` of a model with an expert-parallel MoE (an EMA or evaluation copy) shares the Buffer and
    copies the parameters (former bug: TypeError "cannot pickle 'mmap.mmap' object"); pickling the Buffer
    itself is a TypeError that says why. Returns (shares the Buffer, own parameters, same output, pickle
    error says why)."""
    import copy
    import pickle

    from ubep_torch.buffer import Buffer
    buf = make_buffer(ctx, "ubep")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), unn.MoE(16, 24, 4, 2, buffer=buf)).double()
    ema = copy.deepcopy(model)
    x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(ctx.rank))
    with torch.no_grad():
        same = torch.equal(model(x), ema(x))
    own = all(a is not b and torch.equal(a, b) for a, b in zip(model.parameters(), ema.parameters()))
    # also between steps, when aux_loss belongs to the last forward's graph (former bug: RuntimeError "Only
    # Tensors created explicitly by the user support the deepcopy protocol")
    model(x).sum().backward()
    later = copy.deepcopy(model)
    own = own and later[1].buffer is buf and not later[1].aux_loss.requires_grad and all(
        a is not b and torch.equal(a, b) for a, b in zip(model.parameters(), later.parameters()))
    try:
        pickle.dumps(buf)
        why = False
    except TypeError as e:
        why = "cannot be pickled" in str(e)
    return ema[1].buffer is buf and isinstance(buf, Buffer), own, same, why


def rank_moe_bad_batch(ctx, layout: str, steps: int = 3, how: str = "hidden"):
    """Training steps of an expert-parallel MoE layer; rank 1's first batch has the wrong hidden size
    (``how="interrupt"``: a KeyboardInterrupt arrives in its router), and every rank goes on to its next step
    after any error. Returns per step the error's type and whether it was cancelled, or "ok", then (calls,
    attempts, broken) of the Buffer."""
    from ubep_torch.buffer import Buffer
    buf = Buffer(ctx.group, num_nvl_bytes=1 << 22, timeout_s=20.0)
    cfg = moe_config("softmax", False)
    torch.manual_seed(0)
    layer = unn.MoE(**cfg, buffer=buf, layout=layout).double()
    out = []
    for step in range(steps):
        first = step == 0 and ctx.rank == 1
        hidden = cfg["hidden"] + (1 if first and how == "hidden" else 0)
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(10 * step + ctx.rank),
                        dtype=torch.float64)
        if first and how == "interrupt":
            def interrupted(*args):
                raise KeyboardInterrupt
            layer.router.forward = interrupted
        try:
            (layer(x).sum() + layer.aux_loss).backward()
            out.append("ok")
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001
            out.append((type(e).__name__, getattr(e, "cancelled", None)))
        layer.router.__dict__.pop("forward", None)
    out.append((buf._calls, buf._seq, buf._broken))
    buf.destroy()
    return out


def rank_dp_sync_unused_branches(ctx) -> list:
    """Rank r's loss uses only branch r % 2 of a two-branch model (a batch that takes one path), and rank 0
    also holds a branch no rank uses. After ``data_parallel_sync`` every rank must hold the mean over ranks
    of every used branch's gradient (zeros counted for the ranks that did not use it), and no gradient for
    the unused branch. Returns the largest error and whether the unused branch got a gradient."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList([torch.nn.Linear(4, 3, bias=False) for _ in range(4)])
    x = torch.arange(8.0).view(2, 4) + ctx.rank
    model[ctx.rank % 2](x).square().sum().backward()
    # branch 3: used by rank 1 only, and frozen on rank 0 (which must then keep no gradient for it)
    if ctx.rank == 0:
        model[3].weight.requires_grad_(False)
    else:
        model[3](x).sum().backward()
    # every rank's gradients, computed here on the same weights for the reference
    want = [torch.zeros(3, 4), torch.zeros(3, 4)]
    for r in range(ctx.world_size):
        xr = torch.arange(8.0).view(2, 4) + r
        w = model[r % 2].weight.detach().clone().requires_grad_(True)
        (xr @ w.t()).square().sum().backward()
        want[r % 2] += w.grad / ctx.world_size
    unn.data_parallel_sync(model, ctx.group)
    err = max(float((model[i].weight.grad - want[i]).abs().max()) for i in range(2))
    return [err, model[2].weight.grad is not None or (ctx.rank == 0 and model[3].weight.grad is not None)]


def rank_dp_sync_mismatched_models(ctx) -> list:
    """``data_parallel_sync`` of models that differ between ranks (a parameter's size, then its dtype) and of
    sparse gradients: ValueError or TypeError on every rank, before any gradient is sent, and the group still
    works. Returns each case's error type and a final all-reduce's result."""
    import torch.distributed as dist
    out = []
    cases = {"size": lambda: torch.nn.Linear(4, 3 if ctx.rank == 0 else 5),
             "dtype": lambda: torch.nn.Linear(4, 3).to(torch.float64 if ctx.rank == 0 else torch.float32),
             "sparse": lambda: torch.nn.Embedding(10, 4, sparse=True)}
    for name, make in cases.items():
        model = make()
        if name == "sparse":
            model(torch.tensor([1, 2])).sum().backward()
        else:
            model(torch.ones(2, 4, dtype=model.weight.dtype)).sum().backward()
        try:
            unn.data_parallel_sync(model, ctx.group)
            out.append((name, "ok"))
        except (ValueError, TypeError) as e:
            out.append((name, type(e).__name__, "differ" in str(e) or "sparse" in str(e)))
    # a bad module on one rank only: that rank raises its error, the others a ValueError naming it (they
    # waited in the all-reduce for gloo's 30-minute timeout before)
    good = torch.nn.Linear(4, 3)
    good(torch.ones(2, 4)).sum().backward()
    meta = torch.nn.Linear(4, 3, device="meta")
    for name, bad in (("none", None), ("meta", meta)):
        try:
            unn.data_parallel_sync(bad if ctx.rank == 1 else good, ctx.group)
            out.append((name, "ok"))
        except (ValueError, TypeError) as e:
            out.append((name, type(e).__name__, "rank(s) [1]" in str(e) if ctx.rank == 0 else "module" in str(e)
                        or "host memory" in str(e)))
    # a dp_group on one rank only (here the world group again): the ranks would make different numbers of
    # agreements (gloo aborted the processes on mismatched sizes)
    try:
        unn.data_parallel_sync(good, ctx.group, ctx.group if ctx.rank == 0 else None)
        out.append(("dp", "ok"))
    except ValueError as e:
        out.append(("dp", "ValueError", "dp_groups of different sizes" in str(e)))
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.group)
    out.append(float(t))
    return out


def rank_routing_reused_before_backward(ctx, kind: str) -> dict:
    """A caller that writes a new routing into its ``topk_idx`` tensor after the forward calls (a decode loop
    reusing its tensors, say) gets the gradients of the routing the forward used (former bug: backward read
    the caller's tensor again, so the expert-major and low-latency weight gradients, and the low-latency x
    gradient, came back for the new routing, with no error). Also, a low-latency combine given a routing
    changed since its dispatch is refused (it compared the tensor with itself)."""
    buf = make_buffer(ctx, kind)
    r, world = ctx.rank, ctx.world_size
    e_total, k, t, h, n = 2 * world, 2, 4, 8, 4
    e_local = e_total // world
    idx0, w0 = routing(41 + r, t, k, e_total, drop_slot=False)
    x0 = torch.randn(t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(43 + r))
    scale = (torch.arange(e_local) + 1 + r * e_local).double()      # a different factor per expert

    def normal(reuse: bool):
        x, w, idx = x0.clone().requires_grad_(), w0.clone().requires_grad_(), idx0.clone()
        rx, ri, rw, handle = F.dispatch(buf, x, idx, w, e_total, layout="expert_major")
        out = F.combine(buf, rx * (rw * scale[ri.clamp(min=0)])[:, None], handle)
        if reuse:
            idx.copy_(idx.flip(1))
        out.sum().backward()
        return x.grad, w.grad

    def low_latency(reuse: bool):
        x, w, idx = x0.bfloat16().requires_grad_(), w0.float().requires_grad_(), idx0.clone()
        rx, _count, handle = F.low_latency_dispatch(buf, x, idx, n, e_total)
        out = F.low_latency_combine(buf, rx * scale.bfloat16()[:, None, None], idx, w, handle)
        if reuse:
            idx.copy_(idx.flip(1))
        out.float().sum().backward()
        return x.grad, w.grad

    def rank_major_ids(edit: bool):
        # the received ids changed in place by the caller after the forward (former bug: backward read them
        # again to mask the slots of other ranks' experts, and the weights' gradients changed)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        rx, ri, rw, handle = F.dispatch(buf, x, idx0.clone(), w, e_total)
        col = ri.clamp_(min=0) if edit else ri.clamp(min=0)
        out = F.combine(buf, (rx[:, None, :] * (rw * scale[col])[:, :, None]).sum(1), handle)
        out.sum().backward()
        return x.grad, w.grad

    res = {}
    for name, fn in (("normal", normal), ("low_latency", low_latency), ("rank_major_ids", rank_major_ids)):
        (gx, gw), (gx2, gw2) = fn(False), fn(True)
        res[name] = bool(torch.equal(gx, gx2) and torch.equal(gw, gw2))
    # a combine given a routing written over since its dispatch
    idx = idx0.clone()
    rx, _count, handle = F.low_latency_dispatch(buf, x0.bfloat16(), idx, n, e_total)
    idx.copy_(idx.flip(1))
    try:
        F.low_latency_combine(buf, rx, idx, w0.float(), handle)
        res["changed routing refused"] = False
    except ValueError as e:
        res["changed routing refused"] = "differs from the one dispatched" in str(e)
    F.low_latency_combine(buf, rx, idx0, w0.float(), handle)      # the Buffer stays usable
    # y of another dtype than the Buffer's low-latency rows: named as y
    if kind == "ubep":
        rx, _count, handle = F.low_latency_dispatch(buf, x0.bfloat16(), idx0, n, e_total)
        try:
            F.low_latency_combine(buf, rx.float(), idx0, w0.float(), handle)
            res["float y named"] = False
        except TypeError as e:
            res["float y named"] = "y must be bfloat16" in str(e)
        F.low_latency_combine(buf, rx, idx0, w0.float(), handle)
    return res
