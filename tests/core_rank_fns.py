"""Rank-side functions of the core Buffer tests (run inside RankPool workers).

Each function builds its inputs from a seed shared by all ranks, runs the Buffer, computes the plain
torch reference from the all-gathered inputs and returns what the test asserts on.
"""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

import ubep_torch
from ubep_torch import Buffer
from ubep_torch.buffer import _RECENT_HANDLES
from ubep_torch.fp8 import low_latency_cast_to_fp8, per_token_cast_back
from ubep_torch.protocol import fresh


def get_buffer(ctx, sync="tff", backend="auto", low_latency=False, N=16, H=256, E=8, timeout_s=30.0):
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


def smoke(ctx, sync, T=10, H=256, K=4, E=8, seed=0, dtype=torch.bfloat16, backend="auto"):
    buf = get_buffer(ctx, sync, backend=backend)
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
    ref_i = torch.stack(ref_idx) if ref_idx else torch.zeros(0, K, dtype=torch.int64)
    ref_ww = torch.stack(ref_w) if ref_w else torch.zeros(0, K)
    assert torch.equal(recv_x, ref_x), ("recv_x mismatch", tuple(recv_x.shape), tuple(ref_x.shape))
    assert torch.equal(recv_idx, ref_i), "recv_topk_idx mismatch"
    assert torch.equal(recv_w, ref_ww), "recv_topk_weights mismatch"
    # DeepEP's handle entries with one channel: tokens sent to each rank; the channel's start within each
    # source's rows, 0 (DeepEP's receiver records it before adding the source's start)
    sent = torch.tensor([int(itr[:, d].sum()) for d in range(R)], dtype=torch.int32)
    from_src = torch.tensor([sum(1 for t in range(all_x[s].shape[0])
                                 if any(0 <= int(i) - r * El < El for i in all_topk[s][t] if int(i) >= 0))
                             for s in range(R)], dtype=torch.int32)
    assert torch.equal(handle[0][:, r], torch.cumsum(from_src, 0).to(torch.int32)), "rank_prefix_matrix"
    assert torch.equal(handle[1], sent.view(R, 1)), ("channel_prefix_matrix", handle[1].view(-1).tolist())
    assert torch.equal(handle[2], torch.zeros(R, 1, dtype=torch.int32)), \
        ("recv_channel_prefix_matrix", handle[2].view(-1).tolist())
    # DeepEP's row of source s's first token: its start from rank_prefix_matrix plus the channel's offset
    starts = [(int(handle[0][s - 1][r]) if s else 0) + int(handle[2][s][0]) for s in range(R)]
    assert starts == (torch.cumsum(from_src, 0) - from_src).tolist(), ("source starts", starts)
    comb, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    nranks = itr.sum(1, keepdim=True)
    ref_comb = (x.float() * nranks).to(dtype)
    assert torch.allclose(comb.float(), ref_comb.float(), rtol=1e-2, atol=1e-2), (comb - ref_comb).abs().max()
    # a handle kept as a plain tuple (DeepEP handles are tuples) works for combine and cached dispatch
    comb2, cw2, _ = buf.combine(recv_x, tuple(handle), topk_weights=recv_w)
    assert torch.equal(comb2, comb) and torch.equal(cw2, cw), "combine with a plain-tuple handle differs"
    again = buf.dispatch(x, handle=list(handle))[0]
    assert torch.equal(again, recv_x), "cached dispatch with a plain-tuple handle differs"
    return counts, ubep_torch.__version__


def token_in_rank_decides(ctx, sync, backend="auto", T=7, H=64, K=2, E=8):
    """As in DeepEP, ``is_token_in_rank`` decides where rows go and ``topk_idx`` what they carry: every token
    to every rank (a superset of its experts' ranks: rows with -1 ids there), then token 0 kept back from
    every rank but rank 0. Rows, ids, weights and the unweighted combine against plain-torch references.
    (Former behaviour: ValueError "is_token_in_rank does not match topk_idx".)"""
    buf = get_buffer(ctx, sync, backend=backend)
    R, r = ctx.world_size, ctx.rank
    El = E // R
    topk, w = make_routing(5, r, T, K, E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(31 + r)).bfloat16()
    all_x, all_topk, all_w = gather(x), gather(topk), gather(w)
    superset = torch.ones(T, R, dtype=torch.bool)
    subset = superset.clone()
    subset[0, 1:] = False
    for itr in (superset, subset):
        _, _, ntpe, _, _ = buf.get_dispatch_layout(topk, E)
        recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=itr.sum(0), is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
            topk_weights=w)
        keep = [t for t in range(T) if itr[t, r]]        # every rank passes the same is_token_in_rank
        ref_x = torch.cat([all_x[s][keep] for s in range(R)])
        ids = torch.cat([all_topk[s][keep] for s in range(R)])
        local = (ids >= r * El) & (ids < (r + 1) * El)
        ref_idx = torch.where(local, ids - r * El, -1)
        ref_w = torch.where(local, torch.cat([all_w[s][keep] for s in range(R)]), 0.0)
        assert torch.equal(recv_x, ref_x), "recv_x"
        assert torch.equal(recv_idx, ref_idx) and torch.equal(recv_w, ref_w), "recv_topk_idx/weights"
        assert torch.equal(handle[4], itr), "the handle keeps the is_token_in_rank given"
        combined, _, _ = buf.combine(recv_x, handle)
        assert torch.equal(combined, (x.float() * itr.sum(1, keepdim=True)).bfloat16()), "combine"
    # the cost model's report follows the rows that moved (former bug: topk_idx's ranks, whatever is_token_in_rank
    # said): every token to expert 0 (rank 0), then to every rank
    from ubep_torch.cost_model import CostModel
    buf.set_cost_model(CostModel())
    try:
        one = torch.zeros(T, 1, dtype=torch.int64)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(one, E)
        reported = []
        for mask in (itr, superset):
            _, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=mask.sum(0), is_token_in_rank=mask,
                                                 num_tokens_per_expert=ntpe, topk_idx=one)
            reported.append(buf.last_report["ubep"].bytes)
            buf.combine(torch.zeros(int(mask[:, r].sum()) * R, H).bfloat16(), handle)
            reported.append(buf.last_report["ubep"].bytes)
        assert reported[2] == R * reported[0] and reported[3] == R * reported[1], reported
    finally:
        buf.set_cost_model(None)
    return True


def debug(ctx):
    buf = get_buffer(ctx, "tff")
    r = ctx.rank
    T, H, E = 3, 256, 4
    x = (torch.arange(T).float().unsqueeze(1) + 10 * r).expand(T, H).contiguous().bfloat16()
    topk = torch.tensor([[0, 2], [1, -1], [3, 2]])
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    rx, ri, rw, cnt, h, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                         num_tokens_per_expert=ntpe, topk_idx=topk)
    return rx[:, 0].tolist(), ri.tolist(), cnt, list(h.recv_counts)


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


def ll_roundtrip(ctx, sync, T=6, H=256, K=3, E=8, N=8, seed=0, use_fp8=False, hook=False, zero_copy=False,
                 backend="auto", ue8m0=False):
    buf = get_buffer(ctx, sync, low_latency=True, N=N, H=H, E=E, backend=backend)
    R, r = ctx.world_size, ctx.rank
    topk, w = make_routing(seed, r, T, K, E)
    g = torch.Generator().manual_seed(seed + 91 * r)
    x = torch.randn(T, H, generator=g).bfloat16()
    stats = torch.zeros(E // R, dtype=torch.int32)
    recv_x, recv_count, handle, _, hk = buf.low_latency_dispatch(
        x, topk, N, E, cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0,
        return_recv_hook=hook)
    if hook:
        # the call has read x: the caller may reuse its memory before the hook (every row, its own rank's too,
        # must be x as it was at the call)
        x_at_call, x = x, x.clone()
        x_at_call.fill_(-7.0)
        # the handle is not usable before the recv hook ran: a clear error, nothing sent, nothing broken
        try:
            buf.low_latency_combine(torch.zeros(E // R, R * N, H, dtype=torch.bfloat16), topk, w, handle)
        except ValueError as e:
            assert "hook" in str(e), e
        else:
            raise AssertionError("low_latency_combine before the dispatch's recv hook did not raise")
        hk()
    all_x, all_topk = gather(x), gather(topk)
    ref = ll_reference(all_x, all_topk, r, E, N)
    src_info, layout_range = handle[0], handle[1]
    El = E // R
    scales = recv_x[1] if use_fp8 else None
    if use_fp8:   # DeepEP: the scales' last two dimensions are column-major (TMA), whatever the engine
        groups = H // 512 if ue8m0 else H // 128
        assert scales.stride() == (groups * R * N, 1, R * N if groups > 1 else 1), scales.stride()
    if ue8m0:   # UE8M0: one exponent byte per 128 channels, four per int32; the scale is 2 ** (byte - 127)
        assert scales.dtype == torch.int32 and tuple(scales.shape) == (El, R * N, H // 512), scales.shape
        scales = torch.exp2(fresh(scales).view(torch.uint8).float() - 127)   # (fresh: standard strides)
    # fp8 rows carry the bits of DeepEP's low-latency kernel quantization of the source's tokens
    sent = [low_latency_cast_to_fp8(xs, round_scale=ue8m0) for xs in all_x] if use_fp8 else None
    for e in range(El):
        assert int(recv_count[e]) == len(ref[e]), (e, int(recv_count[e]), len(ref[e]))
        for j, (s, t) in enumerate(ref[e]):
            assert int(src_info[e, j]) == t
            begin, cnt = int(layout_range[e, s]) >> 32, int(layout_range[e, s]) & 0xFFFFFFFF
            assert begin <= j < begin + cnt
            if use_fp8:
                assert torch.equal(recv_x[0][e, j].view(torch.uint8), sent[s][0][t].view(torch.uint8))
                assert torch.equal(scales[e, j], sent[s][1][t])
                deq = (recv_x[0][e, j].float().view(-1, 128) * scales[e, j].unsqueeze(1)).view(-1)
                assert torch.allclose(deq, all_x[s][t].float(), rtol=0.07, atol=0.02)
            else:
                assert torch.equal(recv_x[e, j], all_x[s][t])
    assert torch.equal(stats, recv_count)
    # identity experts, weighted combine == x * sum(w) over valid slots
    y = recv_x
    if use_fp8:
        y = (recv_x[0].float().view(El, R * N, H // 128, 128) * scales.unsqueeze(-1)).view(El, R * N, H).bfloat16()
        back = per_token_cast_back(*recv_x)     # (rows past recv_count hold anything: compared up to it)
        assert all(torch.equal(back[e, :c], y[e, :c]) for e, c in enumerate(recv_count.tolist())), \
            "per_token_cast_back differs from the plain dequantization"
    if zero_copy:
        buf.get_next_low_latency_combine_buffer(handle).copy_(y)
    out, _, hk2 = buf.low_latency_combine(y, topk, w, handle, zero_copy=zero_copy, return_recv_hook=hook)
    if hook:
        hk2()
    ref_out = x.float() * torch.where(topk >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    tol = 0.1 if use_fp8 else 0.02
    assert torch.allclose(out.float(), ref_out, rtol=tol, atol=tol), (out.float() - ref_out).abs().max()
    # DeepEP's low-latency handle is a plain tuple: a copy kept as one works like the handle itself
    again = buf.low_latency_combine(y, topk, w, tuple(handle))[0]
    assert torch.equal(again, out), "low_latency_combine with a plain-tuple handle differs"
    copied = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in handle)   # entries copied
    assert torch.equal(buf.low_latency_combine(y, topk, w, copied)[0], out), "copied plain-tuple handle"
    for i in (2, 3, 4):         # its own tensors with N, H or E edited: refused, not ignored
        edited = tuple(handle[j] + 1 if j == i else handle[j] for j in range(5))
        try:
            buf.low_latency_combine(y, topk, w, edited)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"a plain-tuple handle with entry {i} edited was taken")
    return recv_count.tolist()


def ll_zero_copy_shapes(ctx, T=4, H=128, K=2, E=8, N=16):
    """Zero-copy buffers of handles of different shapes (N and N // 2) are views of one memory, as in
    DeepEP: rows written into one handle's buffer are what its zero-copy combine reads, whichever other
    handle's buffer was fetched in between (smaller first, then larger, and the other way round)."""
    buf = get_buffer(ctx, "tff", low_latency=True, N=N, H=H, E=E)
    topk, w = make_routing(5, ctx.rank, T, K, E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(ctx.rank)).bfloat16()
    for first, second in ((N, N // 2), (N // 2, N)):
        a, _, ha, _, _ = buf.low_latency_dispatch(x, topk, first, E, use_fp8=False)
        b, _, hb, _, _ = buf.low_latency_dispatch(x, topk, second, E, use_fp8=False)
        want = buf.low_latency_combine(a * 2, topk, w, ha)[0]      # (experts: times two)
        za = buf.get_next_low_latency_combine_buffer(ha)
        zb = buf.get_next_low_latency_combine_buffer(hb)
        assert tuple(za.shape) == tuple(a.shape) and tuple(zb.shape) == tuple(b.shape)
        za.copy_(a * 2)
        got = buf.low_latency_combine(None, topk, w, ha, zero_copy=True)[0]
        assert torch.equal(got, want), f"zero-copy combine (N={first}, then N={second} fetched) differs"
        assert bool(want.abs().sum() > 0)
        buf.low_latency_combine(b, topk, w, hb)
    return True


def context_manager_and_repr(ctx, T=4, H=128, E=4):
    """``with Buffer(...)`` destroys the Buffer at the end of the block, also when the block raises; the repr
    says where the Buffer stands."""
    R = ctx.world_size
    with Buffer(ctx.group, 1 << 20, 0, timeout_s=30.0) as buf:
        assert repr(buf) == f"<ubep_torch.Buffer rank {ctx.rank} of {R}, normal 1.0 MiB, sync='tff', " \
                            f"backend={buf.backend!r}, 0 calls>", repr(buf)
        topk, w = make_routing(5, ctx.rank, T, 2, E, drop=0.0)
        x = torch.randn(T, H).bfloat16()
        d = buf.dispatch(x, topk_idx=topk, topk_weights=w, num_experts=E)
        buf.combine(d[0], d[4])
        assert repr(buf).endswith(", 2 calls>"), repr(buf)
    assert not buf.is_available() and repr(buf).endswith(", destroyed>"), repr(buf)
    try:
        with Buffer(ctx.group, 1 << 20, 0, timeout_s=30.0) as other:
            raise KeyError("inside the block")
    except KeyError:
        pass
    else:
        raise AssertionError("the exception inside the with block was swallowed")
    assert not other.is_available()


def low_latency_only_buffer(ctx, T=4, H=128, E=4):
    """A low-latency Buffer built with num_nvl_bytes=0 reserves no normal region (as in DeepEP, it serves
    low-latency calls): a normal dispatch is refused with a ValueError naming num_nvl_bytes, and the
    Buffer stays usable. Returns the segment's bytes per rank. (Built with the legacy Buffer's positional
    order, num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, and the
    newer use_fabric keyword.)"""
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(T, H, ctx.world_size, E), True, 12, True, False,
                 True, use_fabric=True, timeout_s=30.0)
    assert buf.low_latency_mode and buf.explicitly_destroy and buf.num_qps_per_rank == 12
    assert repr(buf).startswith(f"<ubep_torch.Buffer rank {ctx.rank} of {ctx.world_size}, no normal region, "
                                f"low-latency "), repr(buf)
    assert (buf.get_num_rdma_ranks(), buf.get_rdma_rank()) == (1, 0)
    topk, w = make_routing(3, ctx.rank, T, 2, E, drop=0.0)
    x = torch.randn(T, H).bfloat16()
    try:
        buf.dispatch(x, topk_idx=topk, num_experts=E)
    except ValueError as e:
        assert "num_nvl_bytes" in str(e), e
    else:
        raise AssertionError("a normal dispatch on a low-latency-only Buffer did not raise")
    d = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
    out = buf.low_latency_combine(d[0], topk, w, d[2])[0]
    assert torch.allclose(out.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    nbytes = buf._heap.segment_bytes
    buf.destroy()
    return nbytes


def dispatch_variants(ctx, sync, seed=1, backend="auto"):
    """fp8 tuple, cached dispatch, expert_alignment, num_worst_tokens, expert-major layout, bias."""
    buf = get_buffer(ctx, sync, backend=backend)
    R, r = ctx.world_size, ctx.rank
    T, H, K, E = 9, 256, 3, 8
    El = E // R
    topk, w = make_routing(seed, r, T, K, E, drop=0.2)
    topk[0] = -1                                      # a token with every slot masked
    w[0] = 0
    g = torch.Generator().manual_seed(seed + 5 * r)
    x = torch.randn(T, H, generator=g).float()
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    base = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_rank=ntpr, num_tokens_per_expert=ntpe,
                        topk_idx=topk, topk_weights=w, expert_alignment=4)
    recv_x, recv_idx, recv_w, counts, handle, _ = base
    assert all(c % 4 == 0 for c in counts)
    true_counts = [int((recv_idx == e).any(1).sum()) for e in range(El)]
    assert counts == [-(-c // 4) * 4 for c in true_counts], (counts, true_counts)
    # cached dispatch reproduces recv_x for a new payload with the same layout
    x2 = x * 3 + 1
    c_x, c_idx, c_w, c_counts, c_h, _ = buf.dispatch(x2, handle=handle)
    assert c_idx is None and c_w is None and c_counts is None and c_h is None
    assert torch.equal(c_x, recv_x * 3 + 1)
    # rows of hidden size 0 move nothing, in cached mode too (former bug: IndexError mid-call, Buffer broken)
    assert tuple(buf.dispatch(x[:, :0], handle=handle)[0].shape) == (recv_x.shape[0], 0)
    # fp8 tuple payload
    q = x.clamp(-4, 4).to(torch.float8_e4m3fn)
    sc = torch.rand(T, H // 128, generator=g)
    (rq, rsc), *_ = buf.dispatch((q, sc), handle=handle)
    fx, fidx, fw, fcounts, fh, _ = buf.dispatch((q, sc), is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                                topk_idx=topk, topk_weights=w)
    assert torch.equal(fx[0].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(fx[1], rsc)
    assert torch.equal(fidx, recv_idx)
    # scales of other layouts travel as DeepEP carries them, a payload of each row (former bug: only float32
    # [T, H/128] was taken, and an fp8 hidden size had to be a multiple of 128): packed UE8M0 words (int32),
    # per-token scales [T] (returned as [N]), three per row; an fp8 hidden size of 200
    q200 = torch.randn(T, 200, generator=g).clamp(-4, 4).to(torch.float8_e4m3fn)
    for xs, q_ in ((torch.randint(0, 1 << 30, (T, 1), generator=g, dtype=torch.int32), q),
                   (torch.rand(T, generator=g), q), (torch.rand(T, 3, generator=g), q200)):
        (sq, ss), *_ = buf.dispatch((q_, xs), handle=handle)            # cached
        (fq, fs), fi, *_ = buf.dispatch((q_, xs), is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                                        topk_weights=w)
        rows = buf.dispatch(q_.view(torch.uint8).float(), handle=handle)[0]   # the rows, through a float payload
        per_row = buf.dispatch(xs.view(T, -1).view(torch.float32), handle=handle)[0]
        for got_q, got_s in ((sq, ss), (fq, fs)):
            assert got_s.dtype == xs.dtype and got_s.dim() == xs.dim() and got_s.shape[0] == rows.shape[0]
            assert torch.equal(got_q.view(torch.uint8).float(), rows)
            assert torch.equal(got_s.view(rows.shape[0], -1).view(torch.float32), per_row)
        assert torch.equal(fi, recv_idx)
    # num_worst_tokens: fixed-size outputs, no count list, masked tail
    worst = T * R
    wx, widx, ww, wcounts, wh, _ = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                                                topk_weights=w, num_worst_tokens=worst)
    n = recv_x.shape[0]
    assert wx.shape[0] == worst and wcounts == []
    assert torch.equal(wx[:n], recv_x) and bool((widx[n:] == -1).all()) and torch.equal(widx[:n], recv_idx)
    wc, _, _ = buf.combine(wx, wh)
    assert torch.equal(buf.combine(wx, tuple(wh))[0], wc), "plain-tuple num_worst_tokens handle"
    assert torch.equal(buf.combine(wx, tuple(t.clone() for t in wh))[0], wc), "copied num_worst_tokens handle"
    # as in DeepEP, recv_src_idx (handle[3]) is sized as the outputs: a copy of the handle carries the worst
    # size however many calls later it is used (past the Buffer's recent handles, it is rebuilt from entries)
    assert wh[3].shape[0] == worst and torch.equal(wh[3][:n], handle[3]) and bool((wh[3][n:] == -1).all())
    old_copy = tuple(t.clone() for t in wh)
    for _ in range(_RECENT_HANDLES + 1):
        buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk)
    assert torch.equal(buf.dispatch(x2, handle=old_copy)[0], torch.cat([recv_x * 3 + 1, wx[n:]])), \
        "cached dispatch of an old copy of a num_worst_tokens handle"
    assert torch.equal(buf.combine(wx, old_copy)[0], wc), "old copy of a num_worst_tokens handle"
    bad = list(old_copy)
    bad[3] = bad[3].clone()
    bad[3][-1] = 0
    try:
        buf.combine(wx, tuple(bad))
        raise AssertionError("a recv_src_idx with entries past the received rows was taken")
    except ValueError as e:
        assert "must be -1" in str(e), e
    # without topk_idx, the per-expert counts come from num_tokens_per_expert
    nx, _, _, ncounts, _, _ = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_rank=ntpr,
                                           num_tokens_per_expert=ntpe, expert_alignment=4)
    assert torch.equal(nx, recv_x) and ncounts == counts, (ncounts, counts)
    # and with neither, they are unknown: an empty list (former bug: [0] * E_local, as if nothing had come)
    nx, _, _, ncounts, _, _ = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_rank=ntpr)
    assert torch.equal(nx, recv_x) and ncounts == [], ncounts
    # combine with bias and weights
    bias = torch.randn(T, H, generator=g)
    comb, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=(bias, None))
    nr = itr.sum(1, keepdim=True).float()
    assert torch.allclose(comb, x * nr + bias, atol=1e-5), (comb - x * nr - bias).abs().max()
    assert torch.allclose(wc, x * nr, atol=1e-5)
    # combined weights: each rank returns its own slots' weights, so the sum over ranks is the original
    assert torch.allclose(cw, w, atol=1e-6)
    # expert-major layout
    ex, eidx, ew, ecounts, eh, _ = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                                                topk_weights=w, layout="expert_major", expert_alignment=2)
    assert ex.shape[0] == sum(ecounts) == eidx.shape[0] == ew.shape[0]
    off = 0
    for e in range(El):
        seg = eidx[off:off + ecounts[e]]
        assert bool(((seg == e) | (seg == -1)).all())
        rows_e = (recv_idx == e).any(1).nonzero().squeeze(1)
        assert torch.equal(ex[off:off + rows_e.numel()], recv_x[rows_e])
        off += ecounts[e]
    # identity experts weighted per row, then combine == sum of local weights
    y = ex * ew.unsqueeze(1).to(ex.dtype)
    ec, _, _ = buf.combine(y, eh)
    assert torch.equal(buf.combine(y, list(eh))[0], ec), "plain-list expert-major handle"
    # a copy of its entries kept past the handles the Buffer remembers still has the expert-major order (its
    # seventh entry)
    old = tuple(t.clone() for t in eh)
    assert len(old) == 7 and torch.equal(old[6], eh.row_index)
    ref = x * torch.where(topk >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    assert torch.allclose(ec, ref, atol=1e-5), (ec - ref).abs().max()
    cx, *_ = buf.dispatch(x, handle=eh)
    assert torch.equal(cx, ex)
    for _ in range(17):
        buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk, expert_alignment=3)
    assert torch.equal(buf.combine(y, old)[0], ec), "old plain-tuple expert-major handle"
    assert torch.equal(buf.dispatch(x, handle=old)[0], ex), "cached dispatch with an old expert-major tuple"
    bad = old[:6] + (old[6] + ex.shape[0],)
    try:
        buf.combine(y, bad)
    except ValueError as e:
        assert "row_index" in str(e), e
    else:
        raise AssertionError("an expert-major tuple whose row_index is out of range was taken")
    # fp8 payload in the expert-major layout
    (eq, esc), *_ = buf.dispatch((q, sc), is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                                 topk_weights=w, layout="expert_major", expert_alignment=2)
    assert esc.shape == (ex.shape[0], H // 128)
    off = 0
    for e in range(El):
        rows_e = (recv_idx == e).any(1).nonzero().squeeze(1)
        n_e = rows_e.numel()
        assert torch.equal(eq[off:off + n_e].view(torch.uint8), fx[0][rows_e].view(torch.uint8))
        assert torch.equal(esc[off:off + n_e], fx[1][rows_e])
        assert bool((eq[off + n_e:off + ecounts[e]].view(torch.uint8) == 0).all())
        off += ecounts[e]
    return counts


def bad_inputs(ctx, sync):
    """Every bad input raises before anything reaches a peer; the Buffer stays usable afterwards."""
    buf = get_buffer(ctx, sync, low_latency=True)
    T, H, K, E = 4, 256, 2, 8
    topk, w = make_routing(3, ctx.rank, T, K, E, drop=0.0)
    x = torch.randn(T, H).bfloat16()
    ll_x, _, ll_handle, _, _ = buf.low_latency_dispatch(x, topk, 16, E, use_fp8=False)
    _, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    nbuf = get_buffer(ctx, sync)
    everywhere = torch.tensor([[0, E - 1]] * T)          # every token to the first and the last rank
    rx, _, _, _, nh, _ = nbuf.dispatch(x, topk_idx=everywhere, num_experts=E)
    def changed_layout():
        """The handle's layout_range changed in place after its dispatch (then restored)."""
        ll_handle[1][0, 0] += 1
        try:
            buf.low_latency_combine(ll_x, topk, w, ll_handle)
        finally:
            ll_handle[1][0, 0] -= 1

    cases = {
        "ll combine layout changed": (ValueError, changed_layout),
        "ll combine fewer columns": (ValueError, lambda: buf.low_latency_combine(
            ll_x, topk[:, :1], w[:, :1], ll_handle)),
        "ll combine topk differs": (ValueError, lambda: buf.low_latency_combine(
            ll_x, torch.cat([topk[:, :1] * 0 + next(e for e in range(E) if e not in topk[0].tolist()),
                             topk[:, 1:]], 1), w, ll_handle)),
        "id >= E": (ValueError, lambda: buf.get_dispatch_layout(topk + E, E)),
        "id < -1": (ValueError, lambda: buf.get_dispatch_layout(topk - 5, E)),
        "float ids": (TypeError, lambda: buf.get_dispatch_layout(topk.float(), E)),
        "E % R": (ValueError, lambda: buf.get_dispatch_layout(topk, E + 1)),
        "rows": (ValueError, lambda: buf.dispatch(x[:3], topk_idx=topk, num_experts=E)),
        "x dtype": (TypeError, lambda: buf.dispatch(x.to(torch.int32), topk_idx=topk, num_experts=E)),
        "x dim": (ValueError, lambda: buf.dispatch(x.view(-1), topk_idx=topk, num_experts=E)),
        "weights shape": (ValueError, lambda: buf.dispatch(x, topk_idx=topk, topk_weights=w[:, :1], num_experts=E)),
        "weights dtype": (TypeError, lambda: buf.dispatch(x, topk_idx=topk, topk_weights=w.half(), num_experts=E)),
        "scales shape": (ValueError, lambda: buf.dispatch((x.float().to(torch.float8_e4m3fn),
                                                           torch.ones(T + 1, 2)), topk_idx=topk, num_experts=E)),
        "scales dtype": (TypeError, lambda: buf.dispatch((x.float().to(torch.float8_e4m3fn),
                                                          torch.ones(T, 2).half()), topk_idx=topk, num_experts=E)),
        "row larger than the slots": (ValueError, lambda: buf.dispatch(
            torch.empty(1, 40 << 20, dtype=torch.bfloat16), topk_idx=torch.zeros(1, 1, dtype=torch.int64),
            num_experts=E)),
        "ll tokens > N": (ValueError, lambda: buf.low_latency_dispatch(torch.randn(17, H).bfloat16(),
                                                                       torch.zeros(17, K, dtype=torch.int64), 16, E)),
        "ll hidden too large": (ValueError, lambda: buf.low_latency_dispatch(
            torch.randn(T, 128 * 1024).bfloat16(), topk, 16, E)),
        "ll dtype": (TypeError, lambda: buf.low_latency_dispatch(x.float(), topk, 16, E)),
        "ll fp8 rows": (TypeError, lambda: buf.low_latency_dispatch(x.float().to(torch.float8_e4m3fn), topk, 16, E)),
        "ll fp8 pair": (TypeError, lambda: buf.low_latency_dispatch((x.float().to(torch.float8_e4m3fn),
                                                                      torch.ones(T, 2)), topk, 16, E)),
        "ll flag": (TypeError, lambda: buf.low_latency_dispatch(x, topk, 16, E, round_scale="yes")),
        "ll combine fp8 rows": (TypeError, lambda: buf.low_latency_combine(
            ll_x.float().to(torch.float8_e4m3fn), topk, w, ll_handle)),
        "ll duplicate expert": (ValueError, lambda: buf.low_latency_dispatch(
            x, torch.zeros(T, K, dtype=torch.int64), 16, E)),
        "bad handle": (TypeError, lambda: buf.combine(x, ("not", "a", "handle"))),
        "combine fp8 pair": (TypeError, lambda: nbuf.combine((rx.float().to(torch.float8_e4m3fn),
                                                             torch.ones(rx.shape[0], H // 128)), nh)),
        "bias dtype": (TypeError, lambda: nbuf.combine(rx, nh, bias=torch.ones(T, H, dtype=torch.int64))),
        "bias shape": (ValueError, lambda: nbuf.combine(rx, nh, bias=(None, torch.ones(T, H + 1)))),
        "foreign ll handle": (TypeError, lambda: buf.low_latency_combine(
            ll_x, topk, w, (ll_handle[0].clone().fill_(7),) + tuple(ll_handle[1:]))),
        "expert counts without topk_idx": (ValueError, lambda: buf.dispatch(
            x, is_token_in_rank=itr, num_tokens_per_expert=ntpe - T - 1)),
        "handle entries": (ValueError, lambda: buf.combine(x, tuple(torch.zeros(2, dtype=torch.int32)
                                                                    for _ in range(6)))),
        "sync mode": (ValueError, lambda: Buffer(ctx.group, 1 << 20, sync="nope")),
        "no normal region": (ValueError, lambda: ll_only.dispatch(x, topk_idx=topk, num_experts=E)),
        "worst tokens, expert-major": (ValueError, lambda: nbuf.dispatch(
            x, topk_idx=topk, num_experts=E, num_worst_tokens=4 * T, layout="expert_major")),
    }
    ll_only = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(16, H, ctx.world_size, E),
                     low_latency_mode=True, sync=sync)
    seen = {}
    for name, (exc, fn) in cases.items():
        try:
            fn()
        except exc as e:
            seen[name] = str(e)
        else:
            raise AssertionError(f"{name}: no {exc.__name__}")
    assert "no normal-mode region" in seen["no normal region"], seen["no normal region"]
    assert all("per_token_cast_back" in seen[k] for k in ("ll fp8 rows", "ll fp8 pair", "ll combine fp8 rows",
                                                          "combine fp8 pair")), seen
    assert "round_scale must be True or False" in seen["ll flag"], seen["ll flag"]
    ll_only.destroy()
    # still usable: the pending low-latency call completes, then a fresh round trip (and a combine of rows
    # with no columns, which every sync mode takes)
    assert tuple(nbuf.combine(rx[:, :0], nh)[0].shape) == (T, 0)
    torch.testing.assert_close(nbuf.combine(rx, nh)[0].float(), x.float() * min(2, ctx.world_size))
    ll_out, _, _ = buf.low_latency_combine(ll_x, topk, w, ll_handle)
    ref = (x.float().unsqueeze(1) * w.unsqueeze(2)).sum(1)      # identity experts: sum_k w_k * x
    torch.testing.assert_close(ll_out.float(), ref, rtol=2e-2, atol=2e-2)
    smoke(ctx, sync, seed=11)
    return sorted(seen)


def repeated(ctx, sync, calls=12):
    """Back-to-back calls with changing shapes: epochs keep them apart without any reset."""
    for i in range(calls):
        T = [0, 1, 7, 16, 3][i % 5] if ctx.rank == 0 else [5, 0, 2, 16, 9][i % 5]
        smoke(ctx, sync, T=T, seed=100 + i, H=[128, 256, 200][i % 3],
              dtype=[torch.bfloat16, torch.float32][i % 2])
        if i % 3 == 0:
            ll_roundtrip(ctx, sync, seed=200 + i)
    return True


def repeated_dispatch_checks(ctx, sync, backend="auto", T=9, H=256, K=3, E=8):
    """A dispatch that repeats the last one's form, with the routing the Buffer laid out last, checks its
    arguments against that call's and that layout (``Buffer._repeated_dispatch``): its outputs must be those of
    the full checks bit for bit, for new x and weights, both layouts, an expert alignment and a new routing
    laid out by ``get_dispatch_layout``; and anything that differs, a routing changed in place through numpy
    (no version bump) included, must take the full checks, which raise the same errors as ever. Returns how
    many calls took the short checks, whether each compared call did, and the errors seen."""
    buf = get_buffer(ctx, sync, backend=backend)
    topk, w = make_routing(61, ctx.rank, T, K, E)
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    short = {"dispatch": 0, "combine": 0}

    def counted(name):
        inner = getattr(type(buf), f"_repeated_{name}")

        def call(*args, **kwargs):
            plan = inner(buf, *args, **kwargs)
            short[name] += plan is not None
            return plan
        return call
    buf._repeated_dispatch, buf._repeated_combine = counted("dispatch"), counted("combine")

    def call(x, weights, full, **kw):
        if full:
            buf._dispatch_plan = buf._combine_plan = None      # (the next calls take the full checks)
        args = dict(num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                    topk_weights=weights)
        args.update(kw)
        rx, ri, rw, cnt, h, _ = buf.dispatch(x, **args)
        comb, _, _ = buf.combine(rx * 2 if h.layout == "rank_major" else rx, h)
        call.last = rx, h
        return [rx, ri, rw, torch.tensor(cnt), *h, comb]

    errors, took = {}, []
    try:
        call(torch.randn(T, H).bfloat16(), w, True)
        topk2, w2 = make_routing(62, ctx.rank, T, K, E)
        ntpr2, _, ntpe2, itr2, _ = buf.get_dispatch_layout(topk2, E)
        for i, kw in enumerate([{}, {"layout": "expert_major"}, {"expert_alignment": 4}, {"num_tokens_per_rank": None},
                                {"topk_weights": None},
                                dict(topk_idx=topk2, topk_weights=w2, num_tokens_per_rank=ntpr2, is_token_in_rank=itr2,
                                     num_tokens_per_expert=ntpe2)]):
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(i + 10 * ctx.rank)).bfloat16()
            wi = w * (1.0 + i)
            kw = {"topk_weights": wi, **kw}
            if "topk_idx" not in kw:
                call(x, w, False, **kw)     # (the form of this call, made the plan of the next)
            else:                           # (a new routing, laid out: the plan is of the last call's form)
                call(x, w, False, topk_weights=wi)
                buf.get_dispatch_layout(topk2, E)
            before = dict(short)
            fast = call(x, w, False, **kw)
            took.append((short["dispatch"] - before["dispatch"], short["combine"] - before["combine"]))
            full = call(x, w, True, **kw)
            for a, b in zip(fast, full):
                if isinstance(a, torch.Tensor):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(
                        a.view(torch.uint8) if a.is_floating_point() else a,
                        b.view(torch.uint8) if b.is_floating_point() else b), (i, kw)
        # the same call again, with one argument off: each raises as the full checks do (on every rank alike)
        x = torch.randn(T, H).bfloat16()
        bad = {
            "expert counts": dict(num_tokens_per_expert=ntpe + 1),
            "rank counts": dict(num_tokens_per_rank=ntpr.flip(0) + 1),
            "weights shape": dict(topk_weights=w[:, :1].contiguous()),
            "alignment": dict(expert_alignment=0),
            "layout": dict(layout="by_rank"),
            "no expert counts": dict(num_tokens_per_expert=None),
        }
        for name, kw in bad.items():
            call(x, w, False)
            try:
                call(x, w, False, **kw)
            except (ValueError, TypeError) as e:
                errors[name] = type(e).__name__
        for name, args in {"combine rows": lambda rx, h: (rx[:-1], h), "combine hidden": lambda rx, h: (rx[:, 1:], h),
                           "combine of a copied handle": lambda rx, h: (rx, h.__class__(tuple(h), **vars(h)))}.items():
            call(x, w, False)
            try:
                errors[name] = "ok" if buf.combine(*args(*call.last))[0].shape == x[:, 1:].shape else "ok, all columns"
            except (ValueError, TypeError) as e:
                errors[name] = type(e).__name__
            # (a combine that raised before reaching the peers leaves its dispatch to a combine that fits)
            buf.combine(*call.last)
        call(x, w, False)
        t0, k0 = (topk >= 0).nonzero()[0].tolist()
        topk.numpy()[t0, k0] = E + 3        # (in place, through numpy: the tensor's version stays)
        try:
            call(x, w, False)
        except ValueError as e:
            errors["routing changed in place"] = f"values must be in [-1, {E})" in str(e)
        topk.numpy()[t0, k0] = -1           # (a valid routing again, but not the one of the layout tensors)
        try:
            call(x, w, False)
        except ValueError as e:
            errors["counts of another routing"] = type(e).__name__
        # still usable: a full round trip of a fresh layout of the new routing
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
        call(x, w, False)
        assert call(x, w, False)[-1].float().allclose(
            x.float() * (itr.sum(1, keepdim=True).float()).clamp(max=ctx.world_size) * 2, rtol=2e-2, atol=2e-2)
    finally:
        del buf._repeated_dispatch, buf._repeated_combine
    return short, took, errors


def some_ranks_repeat_their_routing(ctx, sync, calls=8):
    """Calls in which some ranks repeat their routing while the others change theirs (a rank's control
    messages then equal its last ones on some ranks only), then every rank repeats, then none: every result
    checked against the reference (``smoke``)."""
    for i in range(calls):
        repeats = {0: ctx.rank == 0, 1: ctx.rank != 0, 2: True, 3: True}.get(i % 6, False)
        smoke(ctx, sync, seed=5 + ctx.rank if repeats else 40 + i)
    return True


def mismatch_after_agreeing_calls(ctx, case: str):
    """Rounds of dispatch and combine in which every rank repeats the same call, then one in which rank 1
    differs in ``case`` ("hidden": its rows' layout, "experts": num_experts, which no rank sees in its own
    inputs): returns what each rank's dispatch raised there (type, message)."""
    R, r = ctx.world_size, ctx.rank
    buf = Buffer(ctx.group, 8 << 20, timeout_s=20.0)
    topk = torch.arange(6).view(3, 2) % (2 * R)
    x = torch.randn(3, 64).bfloat16()
    try:
        for _ in range(3):
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=2 * R)
            buf.combine(recv_x, handle)
        bad = r == 1
        buf.dispatch(torch.randn(3, 128).bfloat16() if bad and case == "hidden" else x, topk_idx=topk,
                     num_experts=4 * R if bad and case == "experts" else 2 * R)
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None, ""


def ll_two_in_flight(ctx, sync):
    """Two low-latency dispatches in flight (hooks deferred), then combines; a third is refused, and so is a
    call into the buffer half of an earlier call whose hook has not run."""
    buf = get_buffer(ctx, sync, low_latency=True)
    r = ctx.rank
    T, H, K, E, N = 5, 256, 2, 8, 16
    t1, w1 = make_routing(7, r, T, K, E, drop=0.0)
    t2, w2 = make_routing(8, r, T, K, E, drop=0.0)
    x1, x2 = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    a = buf.low_latency_dispatch(x1, t1, N, E, use_fp8=False, return_recv_hook=True)
    b = buf.low_latency_dispatch(x2, t2, N, E, use_fp8=False, return_recv_hook=True)
    try:
        buf.low_latency_dispatch(x2, t2, N, E, use_fp8=False, return_recv_hook=True)
        raise AssertionError("a third in-flight call was accepted")
    except ValueError:
        pass
    try:      # (a hook takes no argument, and says so by its own name, not that of a function inside the call)
        a[4](1)
        raise AssertionError("a recv hook took an argument")
    except TypeError as e:
        assert str(e).startswith("low_latency_dispatch recv hook() takes 0 positional arguments"), e
    a[4]()
    b[4]()
    oa, _, _ = buf.low_latency_combine(a[0], t1, w1, a[2])
    ob, _, _ = buf.low_latency_combine(b[0], t2, w2, b[2])
    assert torch.allclose(oa.float(), x1.float() * w1.sum(1, keepdim=True), atol=0.03, rtol=0.02)
    assert torch.allclose(ob.float(), x2.float() * w2.sum(1, keepdim=True), atol=0.03, rtol=0.02)
    # one call waits for its hook, the next one completes: the call after that needs the first one's half
    a = buf.low_latency_dispatch(x1, t1, N, E, use_fp8=False, return_recv_hook=True)
    b = buf.low_latency_dispatch(x2, t2, N, E, use_fp8=False)
    try:
        buf.low_latency_dispatch(x2, t2, N, E, use_fp8=False)
        raise AssertionError("a call into the half of a call still waiting for its hook was accepted")
    except ValueError as e:
        assert "hook" in str(e), e
    a[4]()
    c = buf.low_latency_dispatch(x2, t2, N, E, use_fp8=False)
    for d, x, t, w in ((a, x1, t1, w1), (b, x2, t2, w2), (c, x2, t2, w2)):
        out, _, _ = buf.low_latency_combine(d[0], t, w, d[2])
        assert torch.allclose(out.float(), x.float() * w.sum(1, keepdim=True), atol=0.03, rtol=0.02)
    return True


def timeout_names_missing_rank(ctx):
    """Rank 0 dispatches alone while the others stay silent: it must fail within the deadline naming them."""
    buf = Buffer(ctx.group, 8 << 20, timeout_s=1.0)
    if ctx.rank == 0:
        topk = torch.zeros(2, 1, dtype=torch.int64)
        t0 = __import__("time").monotonic()
        try:
            buf.dispatch(torch.randn(2, 64), topk_idx=topk, num_experts=ctx.world_size)
        except ubep_torch.UBEPTimeoutError as e:
            elapsed = __import__("time").monotonic() - t0
            assert e.missing_ranks == list(range(1, ctx.world_size)), e.missing_ranks
            assert "dispatch" in e.phase
            try:
                buf.dispatch(torch.randn(2, 64), topk_idx=topk, num_experts=ctx.world_size)
            except ubep_torch.UBEPBrokenError:
                pass
            else:
                raise AssertionError("a broken Buffer accepted another call")
            buf.destroy()
            torch.distributed.barrier(ctx.group)
            return elapsed
        raise AssertionError("no timeout")
    torch.distributed.barrier(ctx.group)    # silent, not gone: destroying the Buffer would name this rank at once
    buf.destroy()
    return 0.0


def shm_entries(ctx, directory):
    import os
    return sorted(n for n in os.listdir(directory) if n.startswith("ubep-"))


class InjectedFailure(RuntimeError):
    pass


def _fail_at(phase: str) -> None:
    raise InjectedFailure(f"injected failure at {phase}")


def peer_failure_aborts_waits(ctx):
    """Rank 0 fails inside a call (at its first protocol wait); the others' next waits abort fast, naming
    rank 0 (not the ranks that gave up because of it)."""
    import time
    buf = Buffer(ctx.group, 8 << 20, timeout_s=20.0)
    E = 2 * ctx.world_size
    topk = torch.arange(4).remainder(E).view(4, 1).to(torch.int64)
    x = torch.randn(4, 64)
    t0 = time.monotonic()
    try:
        if ctx.rank == 0:
            buf.delay_hook = _fail_at
            buf.dispatch(x, topk_idx=topk, num_experts=E)
        else:
            _, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
            buf.combine(torch.zeros(h.num_recv, 64), h)
    except (ubep_torch.UBEPError, InjectedFailure) as e:
        elapsed = time.monotonic() - t0
        buf.destroy()
        return type(e).__name__, elapsed, getattr(e, "aborted_ranks", None)
    buf.destroy()
    return None, 0.0, None


def interrupted_call_is_named(ctx):
    """Rank 0 is interrupted (Ctrl-C: a KeyboardInterrupt, which has no message) in the first wait of its
    third call (dispatch, combine, dispatch); its Buffer's later errors name the interruption and that
    call, and the peer's call fails fast. Returns what each rank's later call (or the interrupted call,
    for the peer) raised."""
    buf = Buffer(ctx.group, 8 << 20, timeout_s=20.0)
    E = 2 * ctx.world_size
    topk = torch.arange(4).remainder(E).view(4, 1).to(torch.int64)
    x = torch.randn(4, 64)
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
    buf.combine(recv_x, h)

    def interrupt(phase):
        raise KeyboardInterrupt
    try:
        if ctx.rank == 0:
            buf.delay_hook = interrupt
            try:
                buf.dispatch(x, topk_idx=topk, num_experts=E)
            except KeyboardInterrupt:
                pass
            buf.delay_hook = None
            assert repr(buf).endswith(", broken (KeyboardInterrupt during call 3 of this Buffer)>"), repr(buf)
        buf.dispatch(x, topk_idx=topk, num_experts=E)
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None, ""


def peer_destroyed_its_buffer(ctx):
    """Rank 1 destroys its Buffer; rank 0's next call fails within about 50 ms naming rank 1, not at its
    deadline."""
    import time
    buf = Buffer(ctx.group, 8 << 20, timeout_s=30.0)
    x, topk = torch.randn(4, 64), torch.zeros(4, 1, dtype=torch.int64)
    recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=2)
    buf.combine(recv_x, h)
    torch.distributed.barrier(ctx.group)
    if ctx.rank == 1:
        buf.destroy()
    torch.distributed.barrier(ctx.group)
    if ctx.rank == 1:
        return None
    t0 = time.monotonic()
    try:
        buf.dispatch(x, topk_idx=topk, num_experts=2)
    except ubep_torch.UBEPPeerLostError as e:
        return e.dead_ranks, "destroyed its Buffer" in str(e), time.monotonic() - t0
    finally:
        buf.destroy()
    return "no error"


def worst_tokens_too_small(ctx):
    """Rank 0 passes a num_worst_tokens below what it receives: the call completes on every rank (rank 0
    cannot know before the exchange), and every rank raises a ValueError naming rank 0, so that every rank
    leaves the same step (former bug: only rank 0 raised; the others went on to their combine while rank 0
    went on to its next step, and the call-order mismatch broke the Buffer on every rank). The Buffer stays
    usable on every rank."""
    buf = get_buffer(ctx, "tff")
    E, T, H = 2 * ctx.world_size, 4, 64
    topk = torch.arange(T).remainder(E).view(T, 1).to(torch.int64)
    x = torch.randn(T, H)
    for worst in ([1] + [0] * (ctx.world_size - 1), [1] + [64] * (ctx.world_size - 1)):
        err = None
        try:
            rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E, num_worst_tokens=worst[ctx.rank])
            buf.combine(rx, h)
        except ValueError as e:
            err = str(e)
        assert err is not None and "rank 0 received" in err and "num_worst_tokens=1" in err, err
        assert f"rank {ctx.world_size - 1} received" not in err, err
        recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)    # the next step, on every rank
        out, _, _ = buf.combine(recv_x, h)
        torch.testing.assert_close(out, x)           # every token went to exactly one rank
    return True


def mismatched_hidden(ctx):
    """Ranks that disagree on the hidden size get a clear error, not garbage."""
    buf = Buffer(ctx.group, 8 << 20, timeout_s=20.0)
    E = ctx.world_size
    topk = torch.zeros(3, 1, dtype=torch.int64)
    try:
        buf.dispatch(torch.randn(3, 64 * (ctx.rank + 1)), topk_idx=topk, num_experts=E)
    except ubep_torch.UBEPError as e:
        buf.destroy()
        return type(e).__name__, str(e)
    buf.destroy()
    return None, ""


def ll_layout_mismatch(ctx, case: str):
    """Ranks whose low-latency dispatch rows differ in ``case`` ("topk" or "hidden"); returns what each
    rank's dispatch raised (type, message)."""
    R, r = ctx.world_size, ctx.rank
    H, K = (64 * (r + 1), 2) if case == "hidden" else (64, 1 + r)
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(8, 128, R, 4 * R), low_latency_mode=True,
                 timeout_s=20.0)
    topk = torch.arange(3 * K).view(3, K) % (4 * R)
    try:
        buf.low_latency_dispatch(torch.randn(3, H).bfloat16(), topk, 8, 4 * R, use_fp8=False)
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None, ""


def mismatched_call_args(ctx, low_latency: bool):
    """Ranks that disagree on num_experts (normal) or num_max_dispatch_tokens_per_rank (low-latency), which
    no rank can see in its own inputs, get a clear error naming the argument."""
    R, r = ctx.world_size, ctx.rank
    buf = Buffer(ctx.group, 8 << 20, Buffer.get_low_latency_rdma_size_hint(16, 64, R, 4 * R),
                 low_latency_mode=low_latency, timeout_s=20.0)
    topk = torch.zeros(3, 1, dtype=torch.int64)
    try:
        if low_latency:
            buf.low_latency_dispatch(torch.randn(3, 64).bfloat16(), topk, 8 * (r + 1), 2 * R, use_fp8=False)
        else:
            buf.dispatch(torch.randn(3, 64), topk_idx=topk, num_experts=2 * R * (r + 1))
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None, ""


def mismatched_operations(ctx, sync, case="skipped combine", late=None):
    """After a dispatch on every rank, rank 0 makes one call while the others make another: a combine
    against a dispatch (a rank that skipped its combine), or a normal dispatch against a low-latency one
    (with or without a recv hook), or ``clean_low_latency_buffer`` (which sends no control message) against
    a low-latency or a normal dispatch. Every rank raises at once, naming the other side's operation,
    instead of waiting for the deadline; rank ``late`` makes its call 0.5 s after the others. Returns (the
    error's type, its message, seconds, its ``mismatch`` attribute)."""
    import time
    R, r = ctx.world_size, ctx.rank
    buf = Buffer(ctx.group, 8 << 20, Buffer.get_low_latency_rdma_size_hint(8, 128, R, 2 * R), sync=sync,
                 low_latency_mode=True, timeout_s=60.0)
    x, topk = torch.randn(5, 128), torch.rand(5, 2 * R).topk(2, dim=1).indices
    d = buf.dispatch(x, topk_idx=topk, num_experts=2 * R)
    if r == late:
        time.sleep(0.5)
    start = time.monotonic()
    try:
        if r == 0:
            if case == "skipped combine":
                buf.combine(d[0], d[4])
            elif case.startswith("clean"):
                buf.clean_low_latency_buffer(8, 128, 2 * R)
            else:
                buf.dispatch(x, topk_idx=topk, num_experts=2 * R)
        elif case == "skipped combine" or case == "clean against dispatch":
            buf.dispatch(x, topk_idx=topk, num_experts=2 * R)
        else:
            hook = case == "low-latency with a hook"
            out = buf.low_latency_dispatch(x.bfloat16(), topk, 8, 2 * R, use_fp8=False, return_recv_hook=hook)
            if hook:
                out[-1]()
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e), time.monotonic() - start, getattr(e, "mismatch", None)
    finally:
        buf.destroy()
    return None, "", time.monotonic() - start, None


def mismatch_check_rereads(ctx):
    """The mismatch check of a control-message wait (``Buffer._same_call``) on hand-written flag words: a
    peer with a low-latency message of an epoch this rank has not reached is in another call, unless the
    awaited message of this call has arrived since it was polled (the peer sent it, finished this call and
    went on); a message of this call's epoch and another kind is a mismatch at once."""
    from ubep_torch import protocol as P
    R, r = ctx.world_size, ctx.rank
    buf = Buffer(ctx.group, 1 << 20, Buffer.get_low_latency_rdma_size_hint(4, 128, R, 2 * R),
                 low_latency_mode=True, timeout_s=30.0)
    seen = []
    if r == 0:
        local, normal = buf._heap.local, buf._regions[P.REGION_DISPATCH]
        ll_heads = buf._regions[P.REGION_LL_DISPATCH].ctrl_heads(local, 1)
        heads = normal.ctrl_heads(local, 0)
        flag = P.flag_word(1, P.REGION_DISPATCH)      # this rank waits for rank 1's dispatch of epoch 1
        ll_heads[1] = P.flag_word(1, P.REGION_LL_DISPATCH)     # rank 1 went on to a low-latency call
        heads[1] = flag                                         # after sending the awaited message
        seen.append(buf._same_call(normal, 0, flag, [1], all_regions=True))
        seen.append(buf._same_call(normal, 0, flag, [1], all_regions=False))
        for head in (0, P.flag_word(1, P.REGION_COMBINE)):    # not sent / sent for a combine instead
            heads[1] = head
            try:
                buf._same_call(normal, 0, flag, [1], all_regions=head == 0)
            except ubep_torch.UBEPError as e:
                seen.append(str(e))
    dist.barrier()
    buf.destroy()
    return seen


def ll_only_buffer_with_a_slow_rank(ctx, nvl):
    """Low-latency round trips on a Buffer without a (usable) normal region, one rank a little slower: the
    mismatch check of the waits must not read the low-latency region's words as the normal region's
    (their addresses overlap when the normal region has no room)."""
    import time
    R, r = ctx.world_size, ctx.rank
    N, H, E, K = 8, 128, 2 * R, 2
    buf = Buffer(ctx.group, nvl, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 timeout_s=30.0)
    g = torch.Generator().manual_seed(r)
    for i in range(6):
        x = torch.randn(N, H, generator=g).bfloat16()
        topk = torch.rand(N, E, generator=g).topk(K, dim=1).indices
        w = torch.rand(N, K, generator=g)
        if r == 1:
            time.sleep(0.005)
        recv_x, _, handle, _, hook = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False,
                                                              return_recv_hook=i % 2 == 1)
        if i % 2:
            hook()
        out = buf.low_latency_combine(recv_x, topk, w, handle)[0]
        ref = (x.float().unsqueeze(1) * w.unsqueeze(2)).sum(1)      # identity experts
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    buf.destroy()
    return i + 1


def combine_pair_exact(ctx, sync, dtype=torch.bfloat16, T=12, H=256, seed=5):
    """Every token on both ranks (each token has two rows to sum): the result has exactly the bits of a
    float32 accumulator that starts at +0.0 and adds the ranks' rows in rank order, signed zeros and
    all-zero rows (SP sentinel collisions) included."""
    buf = get_buffer(ctx, sync)
    R, r = ctx.world_size, ctx.rank
    E = 2 * R
    g = torch.Generator().manual_seed(seed + r)
    topk = torch.stack([torch.arange(0, E, 2), torch.arange(1, E, 2)], 1)[:R].reshape(1, -1)
    topk = topk.repeat(T, 1)[:, :E].to(torch.int64)            # every token picks every expert
    x = torch.randn(T, H, generator=g).to(dtype)
    x[0] = -0.0                                                 # (-0) + (-0) must come back as +0
    x[1] = 0.0                                                  # a whole row of zero bytes (SP escapes)
    x[2, ::3] = -0.0
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
    y = recv_x.clone()
    y[recv_x.shape[0] // 2:] = y[recv_x.shape[0] // 2:] * -1  # make the two ranks' rows differ
    comb, _, _ = buf.combine(y, handle)
    # reference: rows from rank s are y_s[t] where y_s is what rank s computed for our tokens
    all_y = gather((y, handle[3].clone(), torch.tensor(handle.recv_offsets)))
    acc = torch.zeros(T, H, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    rows = []
    for s in range(R):
        ys, src_idx, offs = all_y[s]
        rows.append(ys[int(offs[r]):int(offs[r + 1])].to(acc.dtype))
        assert torch.equal(src_idx[int(offs[r]):int(offs[r + 1])].to(torch.int64), torch.arange(T))
        acc = acc + rows[s]
    ref = acc.to(dtype)
    same = torch.equal(comb.view(torch.uint8), ref.view(torch.uint8))
    assert same, f"rank {r}: combine bits differ from the rank-order float32 sum ({dtype}, {sync})"
    assert not torch.signbit(comb[0]).any(), "(-0) + (-0) must give +0 as an accumulator from +0.0 does"
    # with a pair of biases, DeepEP's order: the two biases summed first, then the ranks' rows in rank order
    # (former bug: the biases were added last, which changed the float32 sums in their last bits)
    b0, b1 = (torch.randn(T, H, generator=g).mul(8).to(dtype) for _ in range(2))
    acc = b0.to(acc.dtype) + b1.to(acc.dtype)
    for s in range(R):
        acc = acc + rows[s]
    comb, _, _ = buf.combine(y, handle, bias=(b0, b1))
    assert torch.equal(comb.view(torch.uint8), acc.to(dtype).view(torch.uint8)), \
        f"rank {r}: combine with biases differs from DeepEP's order of sums ({dtype}, {sync})"
    return True


def routing_robustness(ctx, sync, T=6, H=256, K=3, E=8, N=8, seed=3):
    """Routings are taken by content, calls work under ``torch.inference_mode``, and the low-latency
    combine maps every (token, expert) of its own ``topk_idx`` to the dispatched row. Returns check names."""
    R, r = ctx.world_size, ctx.rank
    El = E // R
    topk, w = make_routing(seed, r, T, K, E)
    g = torch.Generator().manual_seed(seed + 7 * r)
    x = torch.randn(T, H, generator=g).bfloat16()
    passed = []

    def scaled_experts(recv_x):   # local expert e (global id r*El + e) multiplies its rows by (id + 1)
        scale = (torch.arange(El) + r * El + 1).to(torch.float32).view(El, 1, 1)
        return (recv_x.float() * scale).bfloat16()

    def ll_reference(tk, wk):      # sum over k of w * bf16(x * (id + 1)), masked slots skipped
        acc = torch.zeros(T, H)
        for k in range(tk.shape[1]):
            e = tk[:, k]
            y = (x.float() * (e.clamp(min=0) + 1).float().unsqueeze(1)).bfloat16().float()
            acc += torch.where((e >= 0).unsqueeze(1), y * wk[:, k:k + 1], torch.zeros(()))
        return acc.bfloat16()

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)

    def run_all(xx, tk, ww, buf):
        lay = buf.get_dispatch_layout(tk, E)
        res = []
        for _ in range(2):   # the second call takes the remembered layout
            d = buf.dispatch(xx, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                             topk_idx=tk, topk_weights=ww)
            res += [d[0], d[1], d[2], buf.combine(d[0], d[4])[0]]
        for _ in range(2):
            lr, cnt, lh, _, _ = buf.low_latency_dispatch(xx, tk, N, E, use_fp8=False)
            res += [lr[e, :int(cnt[e])] for e in range(El)]    # rows past recv_count are unspecified
            res += [buf.low_latency_combine(scaled_experts(lr), tk, ww, lh)[0]]
        return res

    # 1. inference mode, with the Buffer itself created inside it, then the same calls outside it
    with torch.inference_mode():
        buf = Buffer(ctx.group, 64 << 20, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                     sync=sync, timeout_s=30.0)
        inf = run_all(x.clone(), topk.clone(), w.clone(), buf)
        # a recv hook issued and a zero-copy buffer first handed out inside inference mode ...
        hx, _, hh, _, hook = buf.low_latency_dispatch(x.clone(), topk.clone(), N, E, use_fp8=False,
                                                      return_recv_hook=True)
        zc = buf.get_next_low_latency_combine_buffer(hh)
    hook()                               # ... completed and written outside it
    zc.copy_(scaled_experts(hx))
    zc_out = buf.low_latency_combine(None, topk, w, hh, zero_copy=True)[0]
    plain = run_all(x, topk, w, buf)
    diff = [i for i, (a, b) in enumerate(zip(inf, plain)) if not torch.equal(a, b)]
    assert not diff, f"inference-mode results differ: outputs {diff}"
    assert close(plain[-1], ll_reference(topk, w)) and torch.equal(zc_out, plain[-1])
    passed.append("inference_mode")

    # 2. a routing rewritten through numpy (no version bump) gets a fresh layout; editing a returned
    #    layout tensor does not change later answers
    t2 = torch.zeros(T, 1, dtype=torch.int64)
    buf.get_dispatch_layout(t2, E)
    t2.numpy()[:] = E - 1
    got = buf.get_dispatch_layout(t2, E)
    ref = buf.get_dispatch_layout(torch.full((T, 1), E - 1, dtype=torch.int64), E)
    assert all(torch.equal(got[i], ref[i]) for i in (0, 2, 3)), (got[0], ref[0])
    got[0].zero_()
    got[3].fill_(False)
    again = buf.get_dispatch_layout(t2, E)
    assert all(torch.equal(again[i], ref[i]) for i in (0, 2, 3))
    d = buf.dispatch(x, topk_idx=t2, num_experts=E)      # nor does editing the tensors of a handle
    d[4][4].fill_(False)
    again = buf.get_dispatch_layout(t2, E)
    assert all(torch.equal(again[i], ref[i]) for i in (0, 2, 3))
    passed.append("numpy_write")

    # 3. low-latency combine routings: the same, more slots masked, columns reordered; an expert the
    #    token was not dispatched to is refused before sending and the Buffer stays usable
    lr, _, lh, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    y = scaled_experts(lr)
    same = buf.low_latency_combine(y, topk, w, lh)[0]
    assert close(same, ll_reference(topk, w))
    masked = topk.clone()
    masked[:, -1] = -1
    assert close(buf.low_latency_combine(y, masked, w, lh)[0], ll_reference(masked, w))
    perm = list(range(K))[::-1]
    assert close(buf.low_latency_combine(y, topk[:, perm], w[:, perm], lh)[0], ll_reference(topk[:, perm], w[:, perm]))
    bad = topk.clone()
    bad[0, 0] = next(e for e in range(E) if e not in topk[0].tolist())
    try:
        buf.low_latency_combine(y, bad, w, lh)
    except ValueError as e:
        assert "did not send token 0" in str(e), str(e)
    else:
        raise AssertionError("a combine naming an expert the token was not dispatched to was accepted")
    assert torch.equal(buf.low_latency_combine(y, topk, w, lh)[0], same)
    passed.append("ll_combine_routings")

    # 4. inputs that require grad are read as data (the Buffer records no autograd graph)
    xg = x.float().requires_grad_()
    lay = buf.get_dispatch_layout(topk, E)
    d = buf.dispatch(xg, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                     topk_idx=topk, topk_weights=w.clone().requires_grad_())
    assert not d[0].requires_grad and torch.equal(d[0], buf.dispatch(x.float(), handle=d[4])[0])
    assert torch.equal(buf.dispatch(xg, handle=d[4])[0], d[0])
    assert torch.equal(buf.combine(d[0].requires_grad_(), d[4])[0], buf.combine(d[0].detach(), d[4])[0])
    lr, cnt, lh, _, _ = buf.low_latency_dispatch(x.clone().requires_grad_(), topk, N, E, use_fp8=False)
    assert not lr.requires_grad and torch.equal(buf.low_latency_combine(y, topk, w, lh)[0], same)
    passed.append("requires_grad")

    # 5. the differentiable low-latency dispatch pads with zeros past each count
    fx, fcnt, _ = ubep_torch.functional.low_latency_dispatch(buf, x, topk.to(torch.int32), N, E)
    assert all(not bool(fx[e, c:].any()) for e, c in enumerate(fcnt.tolist()))
    passed.append("functional_padding")
    buf.destroy()
    return passed


def mismatched_buffer_args(ctx):
    """Sizes and modes that differ between ranks are refused at construction on every rank (before any
    segment exists), naming the argument; a Buffer with agreeing arguments works afterwards."""
    r = ctx.rank
    cases = {"num_nvl_bytes": {"num_nvl_bytes": (1 << 20) + 4096 * r},
             "sync": {"sync": ["tff", "sw"][r % 2]},
             "low_latency_mode": {"low_latency_mode": r == 0, "num_rdma_bytes": 1 << 20}}
    out = {}
    for name, kw in cases.items():
        try:
            Buffer(ctx.group, **{"num_nvl_bytes": 1 << 20, **kw}).destroy()
            out[name] = "built"
        except ValueError as e:
            out[name] = name in str(e)
    # the sizing pair alone, halved, or beside num_nvl_bytes, on every rank (former behaviour: one of the two
    # alone was ignored and 256 MiB reserved; beside num_nvl_bytes both were ignored)
    for kw, says in (({"hidden": 512}, "num_max_tokens_per_rank"), ({"num_max_tokens_per_rank": 64}, "hidden"),
                     ({"num_nvl_bytes": 1 << 20, "num_max_tokens_per_rank": 64, "hidden": 512}, "pass one")):
        try:
            Buffer(ctx.group, **kw).destroy()
            raise AssertionError(f"Buffer(**{kw}) was built")
        except ValueError as e:
            assert says in str(e), e
    smoke(ctx, "tff", seed=21)
    return out


def normal_rounds(ctx, sync, backend="auto"):
    """A Buffer whose slots hold a few rows per source still takes calls of any size (several exchanges
    per call), and every output is bit-identical to the single exchange of a large Buffer: ranks with more
    tokens than the slots hold, with fewer, and with none, in one call."""
    R, r = ctx.world_size, ctx.rank
    H, K, E = 256, 3, 2 * R
    T = [23, 3, 0, 17][r % 4]
    small = Buffer(ctx.group, ubep_torch.buffer.normal_buffer_bytes(3, H * 4, R), sync=sync, backend=backend,
                   timeout_s=30.0)
    large = get_buffer(ctx, sync, backend=backend)
    topk, w = make_routing(5, r, T, K, E, drop=0.2)
    g = torch.Generator().manual_seed(17 + r)
    x = torch.randn(T, H, generator=g)
    bias = torch.randn(T, H, generator=g)
    q = x.clamp(-4, 4).to(torch.float8_e4m3fn)
    sc = torch.rand(T, H // 128, generator=g)

    def calls(buf):
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
        out = []
        d = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                         topk_idx=topk, topk_weights=w, expert_alignment=2)
        out += [d[0], d[1], d[2], torch.tensor(d[3])] + list(d[4])
        y = d[0] * 2 - 1
        out += [t for t in buf.combine(y, d[4], topk_weights=d[2], bias=bias)[:2]]
        out += list(buf.dispatch((q, sc), handle=d[4])[0])                        # cached, fp8 tuple
        wd = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w,
                          num_worst_tokens=23 * R + 1)
        out += [wd[0], wd[1], buf.combine(wd[0], tuple(t.clone() for t in wd[4]))[0]]
        em = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w,
                          layout="expert_major")
        out += [em[0], em[1], em[2], buf.combine(em[0] * em[2].unsqueeze(1), em[4])[0]]
        return out

    before = [dict(b._epoch) for b in (small, large)]
    got, want = calls(small), calls(large)
    exchanges = [sum(b._epoch[k] - e[k] for k in e) for b, e in zip((small, large), before)]
    assert exchanges[1] == 7 and exchanges[0] > 3 * exchanges[1], exchanges   # several per call
    small.destroy()
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"output {i}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        if a.is_floating_point():    # bits, signed zeros included
            a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(a, b), f"output {i} differs"
    # and the large Buffer's result is the reference one: every token back from every rank it went to
    ref = x * torch.where(topk >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    torch.testing.assert_close(want[-1], ref, rtol=1e-5, atol=1e-5)
    return T


def slow_reader_in_shared_region(ctx, sync, backend="auto"):
    """Normal dispatch and combine share one region: a rank still reading one call's rows when its peers
    move on to the next call (a combine after a dispatch, a dispatch after a combine, two dispatches then
    two combines) must get every row intact. Rank 1 sleeps before each of its Token-Reordering steps, so
    rank 0's next call is ready to write into rank 1's slots before rank 1 has read them."""
    import time
    R, r = ctx.world_size, ctx.rank
    T, H, K, E = 9, 256, 3, 2 * R
    buf = Buffer(ctx.group, ubep_torch.buffer.normal_buffer_bytes(T, H * 4, R), sync=sync, backend=backend,
                 timeout_s=30.0)
    ref_buf = get_buffer(ctx, sync, backend=backend)
    if r == 1:
        buf.delay_hook = lambda phase: time.sleep(0.2) if "Token-Reordering" in phase else None
    batches = []
    for seed in (11, 12):
        topk, w = make_routing(seed, r, T, K, E, drop=0.2)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(seed * 10 + r))
        batches.append((x, topk, w))

    def dispatch(b, x, topk, w):
        ntpr, _, ntpe, itr, _ = b.get_dispatch_layout(topk, E)
        return b.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                          topk_idx=topk, topk_weights=w)

    want = []
    for x, topk, w in batches:
        d = dispatch(ref_buf, x, topk, w)
        want += [d[0].clone(), ref_buf.combine(d[0] * 3, d[4])[0]]
    got = []
    for x, topk, w in batches:                 # dispatch, combine; dispatch, combine
        d = dispatch(buf, x, topk, w)
        got += [d[0].clone(), buf.combine(d[0] * 3, d[4])[0]]
    d0, d1 = (dispatch(buf, *b) for b in batches)   # dispatch, dispatch, combine, combine
    got += [d0[0], buf.combine(d0[0] * 3, d0[4])[0], d1[0], buf.combine(d1[0] * 3, d1[4])[0]]
    buf.destroy()
    for i, (a, b) in enumerate(zip(got, want + want)):
        assert torch.equal(a, b), f"output {i} differs on rank {r}"
    return len(got)


def bench_copies_only(ctx, T=12, H=64, E=8):
    """The benchmark's plain-copies round trip (with torch operators, and with the C loops where they were
    built), with barriers between its stores and loads, on partial routing (some tokens reach only some
    ranks) and on routing that reaches every rank: what it moves against the rows each rank should
    receive and the per-token sums."""
    import os
    import sys

    from ubep_torch.native_engine import available
    from ubep_torch.ugas import SymmetricHeap
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from bench_buffer import _rank_rows, copies_only

    R, me = ctx.world_size, ctx.rank
    out = []
    for loops, everywhere in itertools.product(("torch", "native") if available() else ("torch",), (False, True)):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(me + 10)).bfloat16()
        if everywhere:   # one expert on every rank
            topk = torch.arange(R).mul(E // R).expand(T, R).clone()
        else:
            topk = make_routing(7, me, T, 2, E, drop=0.3)[0]
        heap = SymmetricHeap(ctx.group, R * T * H * 2)
        disp, comb = copies_only(ctx, x, _rank_rows(topk, R, E // R), heap, between=dist.barrier, loops=loops)
        recv = disp()
        dist.barrier()   # (dispatch and combine share the slots)
        summed = comb(recv)
        heap.close()
        xs, tks = [torch.empty_like(x) for _ in range(R)], [torch.empty_like(topk) for _ in range(R)]
        dist.all_gather(xs, x)
        dist.all_gather(tks, topk)
        want = torch.cat([xs[s][_rank_rows(tks[s], R, E // R)[me]] for s in range(R)])
        ref, mag = torch.zeros(T, H), torch.zeros(T, H)
        for rows in _rank_rows(topk, R, E // R):
            ref.index_add_(0, rows, x[rows].float())
            mag.index_add_(0, rows, x[rows].float().abs())
        # every bf16 add rounds once: at most 2^-8 of the partial sum's magnitude, R - 1 times
        bound = float(((summed.float() - ref).abs() - (R * 2.0 ** -8) * mag).max())
        out.append((torch.equal(recv, want), bound))
    return out


def _stall_until_peer_destroyed(buf, peer=1, limit_s=10.0):
    """From now on, the first look of ``buf``'s waits at the peers' abort words (made every 50 ms while a
    wait lasts, after a poll that found a peer missing) stalls until rank ``peer`` has destroyed its
    Buffer."""
    from ubep_torch import buffer as B
    from ubep_torch import protocol as P
    orig, R = buf._waiter.peer_aborted, buf.group_size

    def peer_aborted(r):
        end = time.monotonic() + limit_s
        while P.abort_how(int(buf._aux_words[B._ABORT_ROW * R + peer])) != P.ABORT_DESTROYED \
                and time.monotonic() < end:
            time.sleep(0.005)
        buf._waiter.peer_aborted = orig
        return orig(r)
    buf._waiter.peer_aborted = peer_aborted


def ll_k_in_flight(ctx, sync, k, preempted=False):
    """``low_latency_buffers=k``: k low-latency dispatches in flight (hooks deferred), then their combines in
    another order, each with its own inputs; call k + 1 is refused while they wait. The size hint for k
    buffers makes room for them.

    ``preempted``: in the last combine, rank 1 starts late and rank 0 stalls (as a descheduled process
    would) between a poll that finds rank 1's count message missing and the wait's look at the abort
    words, until rank 1 has delivered, completed and destroyed its Buffer: rank 0's wait still completes."""
    T, H, K, E, N = 5, 256, 2, 8, 16
    hint = Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E, num_buffers=k)
    assert hint > (k - 1) / 2 * Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E), hint
    buf = Buffer(ctx.group, 0, hint, low_latency_mode=True, sync=sync, timeout_s=30.0, low_latency_buffers=k)
    r = ctx.rank
    calls = []
    for i in range(k):
        t, w = make_routing(20 + i, r, T, K, E, drop=0.1)
        x = torch.randn(T, H).bfloat16() + i
        calls.append((x, t, w, buf.low_latency_dispatch(x, t, N, E, use_fp8=False, return_recv_hook=True)))
    try:
        buf.low_latency_dispatch(calls[0][0], calls[0][1], N, E, use_fp8=False, return_recv_hook=True)
        raise AssertionError(f"call {k + 1} was accepted with {k} in flight")
    except ValueError as e:
        assert f"{k} halves" in str(e), e
    for _, _, _, d in reversed(calls):
        d[4]()
    for i, (x, t, w, d) in enumerate(calls[::2] + calls[1::2]):
        if preempted and i == k - 1:
            _stall_until_peer_destroyed(buf) if r == 0 else time.sleep(0.3)
        out, _, _ = buf.low_latency_combine(d[0], t, w, d[2])
        assert torch.allclose(out.float(), x.float() * w.sum(1, keepdim=True), atol=0.05, rtol=0.02)
    buf.destroy()
    return True


def ll_buffers_size_message(ctx):
    """``low_latency_buffers=3`` with ``num_rdma_bytes`` from the two-buffer size hint: the refusals of a
    dispatch and of clean_low_latency_buffer name the three-buffer size. Returns (that size, the messages)."""
    R = ctx.world_size
    N, H, K, E = 64, 1024, 2, 16 * R
    size2 = Buffer.get_low_latency_rdma_size_hint(N, H, R, E)
    size3 = Buffer.get_low_latency_rdma_size_hint(N, H, R, E, num_buffers=3)
    buf = Buffer(ctx.group, 0, size2, low_latency_mode=True, low_latency_buffers=3, timeout_s=20.0)
    x = torch.randn(N, H).bfloat16()
    idx = torch.stack([torch.randperm(E)[:K] for _ in range(N)])
    msgs = []
    for call in (lambda: buf.low_latency_dispatch(x, idx, N, E, use_fp8=False),
                 lambda: buf.clean_low_latency_buffer(N, H, E)):
        try:
            call()
            msgs.append("accepted")
        except ValueError as e:
            msgs.append(str(e))
    buf.destroy()
    return size3, msgs


def clean_of_an_fp8_sized_buffer(ctx, sync):
    """A low-latency buffer large enough for fp8 dispatch (use_fp8=True, the default) and bf16 combine of
    N=8, H=7168, E=4 but not for bf16 dispatch: the fp8 round trip works, so clean_low_latency_buffer of
    the same sizes must not refuse them (bf16 dispatch still does)."""
    N, H, E, K = 8, 7168, 4, 2
    buf = Buffer(ctx.group, 0, 1638400, low_latency_mode=True, sync=sync, timeout_s=30.0)
    try:
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.randn(N, H, generator=g).bfloat16()
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        rx, _, handle, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=True)
        y = torch.stack([per_token_cast_back(rx[0][e], rx[1][e]) for e in range(rx[0].shape[0])])
        buf.low_latency_combine(y, topk, torch.rand(N, K, generator=g), handle)
        buf.clean_low_latency_buffer(N, H, E)
        try:
            buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
            bf16 = "accepted"
        except ValueError:
            bf16 = "refused"
        buf.clean_low_latency_buffer(N, H, E)
        return bf16
    finally:
        buf.destroy()


def slot_counts(ctx, backend: str):
    """Per-expert counts count slots, as DeepEP's layout does: a token that lists an expert in several slots
    counts once per slot in ``num_tokens_per_expert`` and in the received count list (whose rows list the
    expert in each of those slots), while it still travels once to the expert's rank. Checked against
    plain torch over every rank's routing; returns this rank's count list."""
    R, me = ctx.world_size, ctx.rank
    E, T, H = 4 * R, 6, 32
    buf = Buffer(ctx.group, 1 << 22, backend=backend)
    g = torch.Generator().manual_seed(70 + me)
    topk = torch.randint(-1, E, (T, 3), generator=g)
    topk[0] = torch.tensor([2, 2, -1])
    topk[1] = torch.tensor([E - 1, E - 1, E - 1])
    x = torch.randn(T, H, generator=g).bfloat16()
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    assert torch.equal(ntpe, torch.stack([(topk == e).sum() for e in range(E)]).int()), ntpe
    every = [torch.empty_like(topk) for _ in range(R)]
    dist.all_gather(every, topk, group=ctx.group)
    recv_x, recv_idx, _, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk)
    E_local = E // R
    assert counts == [sum(int((t == me * E_local + e).sum()) for t in every) for e in range(E_local)], counts
    assert counts == [int((recv_idx == e).sum()) for e in range(E_local)], counts
    # the same counts from num_tokens_per_expert alone (no topk_idx)
    assert buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=ntpe)[3] == counts
    # one row per (token, rank) all the same: combine sums each rank's row once
    out = buf.combine(recv_x, handle)[0]
    assert torch.equal(out, (x.float() * itr.sum(1, keepdim=True).float()).bfloat16()), (out, x)
    buf.destroy()
    return counts


def same_bytes_other_rows(ctx, case: str):
    """Ranks whose rows have the same byte sizes but carry other things (bf16 against fp16 x, hidden 128
    bf16 against hidden 64 float32, top-4 without weights against top-2 with float32 weights, a combine of
    bf16 against float32 rows of the same bytes, a cached dispatch of bf16 against fp16) get the layout
    error, not each other's bytes read as their own. Returns (error type, message) or (None, "")."""
    R, r = ctx.world_size, ctx.rank
    E, T = 2 * R, 4
    buf = Buffer(ctx.group, 8 << 20, timeout_s=20.0)
    x = torch.ones(T, 128, dtype=torch.bfloat16)
    topk = torch.tensor([[0, 1]] * T)
    try:
        if case == "dtype":
            buf.dispatch(x if r == 0 else x.half(), topk_idx=topk, num_experts=E)
        elif case == "hidden":
            buf.dispatch(x if r == 0 else torch.ones(T, 64), topk_idx=topk, num_experts=E)
        elif case == "topk":
            k4 = torch.tensor([[0, 1, -1, -1]] * T)
            buf.dispatch(x, topk_idx=k4 if r == 0 else topk, num_experts=E,
                         topk_weights=None if r == 0 else torch.ones(T, 2))
        elif case == "scales":       # fp8 rows whose scales have the same bytes but another dtype
            sc = torch.ones(T, 2)
            buf.dispatch((x.float().to(torch.float8_e4m3fn), sc if r == 0 else sc.view(torch.int32)), topk_idx=topk,
                         num_experts=E)
        else:
            rx, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
            if case == "combine":
                buf.combine(rx if r == 0 else torch.ones(rx.shape[0], 64), handle)
            else:
                buf.dispatch(x if r == 0 else x.half(), handle=handle)
    except ubep_torch.UBEPError as e:
        return type(e).__name__, str(e)
    finally:
        buf.destroy()
    return None, ""


def local_buffer_tensor(ctx):
    """``get_local_buffer_tensor`` with DeepEP's arguments ``(dtype, size, offset, use_rdma_buffer)``: views
    of the normal and low-latency buffers, and bad arguments refused. Returns what each call gave."""
    import torch.distributed as dist
    rdma = Buffer.get_low_latency_rdma_size_hint(8, 128, ctx.world_size, 4)
    buf = Buffer(dist.group.WORLD, (1 << 20) + 100, rdma, low_latency_mode=True)
    # every byte of each buffer, as DeepEP's views give (former bug: the low-latency one was 4096 bytes short
    # of num_rdma_bytes, and a normal one not a multiple of 4096 was cut to one)
    assert buf.get_local_buffer_tensor().numel() == (1 << 20) + 100
    assert buf.get_local_buffer_tensor(use_rdma_buffer=True).numel() == rdma
    assert buf.get_local_buffer_tensor(torch.int32, offset=8, use_rdma_buffer=True).numel() == (rdma - 8) // 4
    out = [tuple(buf.get_local_buffer_tensor()[:1 << 20].shape),
           tuple(buf.get_local_buffer_tensor(torch.bfloat16, (4, 8), 64).shape),
           buf.get_local_buffer_tensor(torch.int32, None, 0, True).numel() > 0]
    for bad in (dict(offset=-8), dict(offset=3, dtype=torch.int32), dict(size=(1 << 40,)), dict(dtype="x"),
                dict(use_rdma_buffer="yes")):
        try:
            buf.get_local_buffer_tensor(**bad)
            out.append("accepted")
        except (TypeError, ValueError) as e:
            out.append(type(e).__name__)
    buf.destroy()
    return out


def deepep_event_idioms(ctx):
    """DeepEP's overlap idioms, which frameworks use as written: ``EventOverlap(EventHandle())`` or
    ``Buffer.capture()`` as ``previous_event``, ``async_finish=True``, ``allocate_on_comm_stream``, then
    ``current_stream_wait()`` or ``with event:``. Returns the combine's largest error, and the type of what
    the events hold (async dispatch, async combine, ``capture()``, async cached dispatch, plain combine,
    async low-latency dispatch and combine)."""
    import torch.distributed as dist

    from ubep_torch import EventHandle, EventOverlap
    buf = get_buffer(ctx, "tff")
    T, H, K, E = 6, 64, 2, 2 * ctx.world_size
    topk, w = make_routing(3, ctx.rank, T, K, E)
    x = torch.randn(T, H)
    previous = EventOverlap(EventHandle())
    ntpr, _, ntpe, itr, event = buf.get_dispatch_layout(topk, E, previous_event=previous, async_finish=True,
                                                        allocate_on_comm_stream=True)
    event.current_stream_wait()
    recv_x, _, _, _, handle, event = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                                  num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w,
                                                  previous_event=event, async_finish=True,
                                                  allocate_on_comm_stream=True)
    events = [event]
    with event:
        combined, _, event = buf.combine(recv_x, handle, previous_event=Buffer.capture(), async_finish=True)
    event.current_stream_wait()
    events += [event, Buffer.capture(), buf.dispatch(x, handle=handle, async_finish=True)[5]]
    # (as in DeepEP, an event holds an EventHandle where the call was asked to finish asynchronously)
    kinds = [type(e.event).__name__ for e in events]
    kinds.append(type(buf.combine(recv_x, handle)[2].event).__name__)
    ll = get_buffer(ctx, low_latency=True, N=8, H=128, E=E)
    xl = torch.randn(T, 128).bfloat16()
    recv, _, ll_handle, ll_event, _ = ll.low_latency_dispatch(xl, topk, 8, E, use_fp8=False, async_finish=True)
    kinds.append(type(ll_event.event).__name__)
    kinds.append(type(ll.low_latency_combine(recv, topk, w, ll_handle, async_finish=True)[1].event).__name__)
    dist.barrier()
    return float((combined - x * itr.sum(1, keepdim=True)).abs().max()), kinds


def results_sent_away(ctx, v: float, T=64, H=1024):
    """A normal dispatch and combine whose outputs (128 KiB each, so the Buffer draws them from its output
    cache) are returned from the rank: RankPool sends them to the pool's process, which keeps them."""
    buf = get_buffer(ctx, H=H)
    x = torch.full((T, H), float(v)).bfloat16()
    idx = torch.zeros(T, 1, dtype=torch.int64)          # every token to expert 0, on rank 0
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, num_experts=8)
    combined, _, _ = buf.combine(recv_x, handle)
    return recv_x, combined
