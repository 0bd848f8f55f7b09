"""Rank-side functions of the core Buffer tests (run inside RankPool workers).

Each function builds its inputs from a seed shared by all ranks, runs the Buffer, computes the plain
torch reference from the all-gathered inputs and returns what the test asserts on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import ubep_torch
from ubep_torch import Buffer


def get_buffer(ctx, sync="tff", backend="torch", low_latency=False, N=16, H=256, E=8, timeout_s=30.0):
    key = f"buf-{sync}-{backend}-{low_latency}-{N}-{H}-{E}"
    if key not in ctx.cache:
        rdma = Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E) if low_latency else 0
        ctx.cache[key] = Buffer(ctx.group, 64 << 20, rdma, low_latency_mode=low_latency, sync=sync,
                                backend=backend, timeout_s=timeout_s)
    return ctx.cache[key]


def make_routing(seed, rank, T, K, E, drop=0.1):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    scores = torch.rand(T, E, generator=g)
    topk = scores.topk(K, dim=1).indices
    mask = torch.rand(T, K, generator=g) < drop
    topk = topk.masked_fill(mask, -1)
    w = torch.rand(T, K, generator=g).masked_fill(mask, 0.0)
    return topk.to(torch.int64), w.float()


def gather(t):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, t)
    return out


def smoke(ctx, sync, T=10, H=256, K=4, E=8, seed=0, dtype=torch.bfloat16):
    buf = get_buffer(ctx, sync)
    R, r = ctx.world_size, ctx.rank
    topk, w = make_routing(seed, r, T, K, E)
    g = torch.Generator().manual_seed(seed + 77 * r)
    x = torch.randn(T, H, generator=g).to(dtype)
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
        topk_weights=w)
    # reference
    all_x, all_topk, all_w = gather(x), gather(topk), gather(w)
    El = E // R
    ref_rows, ref_idx, ref_w = [], [], []
    for s in range(R):
        for t in range(all_x[s].shape[0]):
            ids = all_topk[s][t]
            loc = ids - r * El
            ok = (ids >= 0) & (loc >= 0) & (loc < El)
            if ok.any():
                ref_rows.append(all_x[s][t])
                ref_idx.append(torch.where(ok, loc, torch.full_like(loc, -1)))
                ref_w.append(torch.where(ok, all_w[s][t], torch.zeros_like(all_w[s][t])))
    ref_x = torch.stack(ref_rows) if ref_rows else torch.zeros(0, H, dtype=dtype)
    assert torch.equal(recv_x, ref_x), ("recv_x mismatch", recv_x.shape, ref_x.shape, (recv_x.float()-ref_x.float()).abs().sum(1).tolist() if recv_x.shape==ref_x.shape else None)
    assert torch.equal(recv_idx, torch.stack(ref_idx)), "recv idx mismatch"
    assert torch.equal(recv_w, torch.stack(ref_w)), "recv w mismatch"
    comb, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    nranks = itr.sum(1, keepdim=True)
    ref_comb = (x.float() * nranks).to(dtype)
    assert torch.allclose(comb.float(), ref_comb.float(), rtol=1e-2, atol=1e-2), (comb - ref_comb).abs().max()
    return counts, ubep_torch.__version__


def debug(ctx):
    buf = get_buffer(ctx, "tff")
    r = ctx.rank
    T, H, E = 3, 256, 4
    x = (torch.arange(T).float().unsqueeze(1) + 10 * r).expand(T, H).contiguous().bfloat16()
    topk = torch.tensor([[0, 2], [1, -1], [3, 2]])
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    rx, ri, rw, cnt, h, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                         num_tokens_per_expert=ntpe, topk_idx=topk)
    return rx[:, 0].tolist(), ri.tolist(), cnt, h.recv_counts.tolist()


def ll_reference(all_x, all_topk, rank, E, N):
    """Per local expert, the rows (source rank order, then token order) a rank must receive."""
    R = len(all_x)
    El = E // R
    rows = {e: [] for e in range(El)}
    for s in range(R):
        for t in range(all_x[s].shape[0]):
            for g in all_topk[s][t].tolist():
                if g >= 0 and g // El == rank:
                    rows[g - rank * El].append((s, t))
    return rows


def ll_roundtrip(ctx, sync, T=6, H=256, K=3, E=8, N=8, seed=0, use_fp8=False, hook=False, zero_copy=False):
    buf = get_buffer(ctx, sync, low_latency=True, N=N, H=H, E=E)
    R, r = ctx.world_size, ctx.rank
    topk, w = make_routing(seed, r, T, K, E)
    g = torch.Generator().manual_seed(seed + 91 * r)
    x = torch.randn(T, H, generator=g).bfloat16()
    stats = torch.zeros(E // R, dtype=torch.int32)
    recv_x, recv_count, handle, _, hk = buf.low_latency_dispatch(
        x, topk, N, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, return_recv_hook=hook)
    if hook:
        hk()
    all_x, all_topk = gather(x), gather(topk)
    ref = ll_reference(all_x, all_topk, r, E, N)
    src_info, layout_range = handle[0], handle[1]
    El = E // R
    for e in range(El):
        assert int(recv_count[e]) == len(ref[e]), (e, int(recv_count[e]), len(ref[e]))
        for j, (s, t) in enumerate(ref[e]):
            assert int(src_info[e, j]) == t
            begin, cnt = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
            assert begin <= j < begin + cnt
            if use_fp8:
                q, sc = recv_x
                deq = (q[e, j].float().view(-1, 128) * sc[e, j].unsqueeze(1)).view(-1)
                assert torch.allclose(deq, all_x[s][t].float(), rtol=0.07, atol=0.02)
            else:
                assert torch.equal(recv_x[e, j], all_x[s][t])
    assert torch.equal(stats, recv_count)
    # identity experts, weighted combine == x * sum(w) over valid slots
    y = recv_x
    if use_fp8:
        q, sc = recv_x
        y = (q.float().view(El, R * N, H // 128, 128) * sc.unsqueeze(-1)).view(El, R * N, H).bfloat16()
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
    out, _, hk2 = buf.low_latency_combine(y, topk, w, handle, zero_copy=zero_copy, return_recv_hook=hook)
    if hook:
        hk2()
    ref_out = x.float() * torch.where(topk >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    tol = 0.1 if use_fp8 else 0.02
    assert torch.allclose(out.float(), ref_out, rtol=tol, atol=tol), (out.float() - ref_out).abs().max()
    return recv_count.tolist()
