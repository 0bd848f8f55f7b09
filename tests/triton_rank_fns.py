"""Rank-side functions of the Triton backend tests (run inside RankPool workers).

Each function runs the same calls, with the same inputs, on a ``backend="torch"`` and a
``backend="triton"`` Buffer and returns, per call, whether every output is bit-identical (compared
as raw bytes) plus what the test prints on failure.
"""
from __future__ import annotations

import time

import torch

from tests.core_rank_fns import get_buffer, make_routing


def _bytes(t) -> torch.Tensor:
    if isinstance(t, (tuple, list)):
        parts = [_bytes(x) for x in t if x is not None]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)
    if t is None:
        return torch.zeros(0, dtype=torch.uint8)
    if not isinstance(t, torch.Tensor):
        return torch.tensor(list(t) if isinstance(t, (list, tuple)) else [t], dtype=torch.int64).view(torch.uint8)
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)


def _same(a, b) -> bool:
    return torch.equal(_bytes(a), _bytes(b))


def assert_all_same(results) -> None:
    """Test side: every call of every rank reported bit-identical outputs on both backends."""
    for rank, res in enumerate(results):
        bad = [k for k, ok in res["same"].items() if not ok]
        assert not bad, f"rank {rank}: outputs differ between backends for {bad}"


def _with_specials(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x`` with about one element in eight replaced by NaN, +-inf, +-0.0, a subnormal or a huge value."""
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38])
    pick = torch.randint(0, 8 * specials.numel(), x.shape, generator=g)
    hit = pick < specials.numel()
    return torch.where(hit, specials[pick.clamp(max=specials.numel() - 1)], x)


def _normal_calls(buf, x, topk, w, E, expert_major=True):
    """dispatch (rank-major), combine with weights, cached dispatch, expert-major dispatch + combine."""
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    rx, ri, rw, cnt, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                              num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w)
    out = {"dispatch": (rx, ri, rw, torch.tensor(cnt, dtype=torch.int64))}
    y = rx[0].float() if isinstance(rx, tuple) else rx
    y = y.bfloat16() if isinstance(rx, tuple) else y
    comb, cw, _ = buf.combine(y, handle, topk_weights=rw)
    out["combine"] = (comb, cw)
    crx, *_ = buf.dispatch(x, handle=handle)
    out["cached_dispatch"] = crx
    if not expert_major:
        return out
    erx, eri, erw, ecnt, eh, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                              num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w,
                                              layout="expert_major")
    out["expert_major_dispatch"] = (erx, eri, erw, torch.tensor(ecnt, dtype=torch.int64))
    ey = erx[0].float().bfloat16() if isinstance(erx, tuple) else erx
    ecomb, _, _ = buf.combine(ey, eh)
    out["expert_major_combine"] = ecomb
    return out


def normal_equivalence(ctx, sync: str, fp8: bool = False, T: int = 6, H: int = 256, K: int = 2, E: int = 4,
                       seed: int = 0, backend: str = "triton", dtype=torch.bfloat16, special: bool = False) -> dict:
    """Normal-mode calls on torch and ``backend``; returns {call: bit-identical?} and the other backend's wall
    time. ``special``: x holds NaN, infinities, signed zeros and subnormals too."""
    bt = get_buffer(ctx, sync, backend="torch")
    bk = get_buffer(ctx, sync, backend=backend)
    topk, w = make_routing(seed, ctx.rank, T, K, E)
    g = torch.Generator().manual_seed(seed + 31 * ctx.rank)
    x = _with_specials(torch.randn(T, H, generator=g), g) if special else torch.randn(T, H, generator=g)
    x = x.to(dtype)
    if fp8:
        xf = x.float().view(T, H // 128, 128)
        sc = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
        q = (xf / sc.unsqueeze(-1)).view(T, H).to(torch.float8_e4m3fn)
        x = (q, sc.contiguous())
    # fp8 + expert_major fails on the torch path too (masked_fill on float8 in Buffer._to_expert_major)
    ref = _normal_calls(bt, x, topk, w, E, expert_major=not fp8)
    t0 = time.perf_counter()
    got = _normal_calls(bk, x, topk, w, E, expert_major=not fp8)
    return {"same": {k: _same(ref[k], got[k]) for k in ref}, "triton_s": time.perf_counter() - t0}


def steady_equivalence(ctx, sync: str = "tff", T: int = 12, H: int = 1000, K: int = 3, E: int = 8, calls: int = 5,
                       spin_ns: int = 100_000_000, lag_s: float = 0.0, change_at: int = -1,
                       sizes: tuple = (), fp8: bool = False, every_call: str = "") -> dict:
    """Calls that repeat one routing with new x and weights every time, on torch and native: dispatch with
    weights and an unweighted combine, each call's outputs compared as bytes. The native Buffer's one-step exchanges
    (``_steady_dispatch``, ``_steady_combine``) wait ``spin_ns`` for their peers on this rank; rank 1 sleeps
    ``lag_s`` before each call, and from call ``change_at`` on routes anew every call. ``sizes``: hidden sizes
    that calls take in turn (x's first columns of the last one; H by default); ``fp8``: x as fp8 rows and
    per-128 scales (two payload fields). ``every_call``: every rank routes anew in every call, ``"same rows"``
    with as many rows per rank pair as before (``_every_rank_routing``: the tokens each rank sends each rank and
    the per-expert counts change), ``"any"``
    as ``make_routing`` does (the rows per rank pair change too), ``"two in turn"`` two routings of other rows
    per rank pair, one after the other. Returns {call: bit-identical?} and the engine's
    one-step results, counted ({"dispatch 0": n, "combine 1": n, ...})."""
    import ubep_torch.buffer as B
    bt, bk = get_buffer(ctx, sync, backend="torch"), get_buffer(ctx, sync, backend="native")
    seen: dict = {}

    def counted(name, fn):
        def call(*args, **kwargs):
            status = fn(*args, **kwargs)
            seen[f"{name} {status}"] = seen.get(f"{name} {status}", 0) + 1
            return status
        return call
    eng = bk.engine
    eng.run_reorder = counted("dispatch", type(eng).run_reorder.__get__(eng))
    eng.run_combine = counted("combine", type(eng).run_combine.__get__(eng))
    spin, B._STEADY_SPIN_NS = B._STEADY_SPIN_NS, spin_ns
    same = {}
    try:
        for i in range(calls):
            anew = ctx.rank == 1 and 0 <= change_at <= i
            topk, w = make_routing(100 + i if anew or every_call else 7, ctx.rank, T, K, E)
            if every_call == "same rows":
                topk = _every_rank_routing(100 + i, ctx.rank, T, K, E, ctx.world_size)
            elif every_call == "two in turn":     # (the second: the first without token 0, one row less per rank)
                topk, w = make_routing(7, ctx.rank, T, K, E)
                if i % 2:
                    topk[0], w[0] = -1, 0.0
            w = w * (1.0 + i / 8)       # (the same experts, new weights: each call's meta items are its own)
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(50 * i + ctx.rank)).bfloat16()
            if sizes:
                x = x[:, :sizes[i % len(sizes)]].contiguous()
            if fp8:
                xf = x.float().view(T, -1, 128)
                sc = xf.abs().amax(-1).clamp(min=1e-4) / 448.0
                x = ((xf / sc.unsqueeze(-1)).view(T, -1).to(torch.float8_e4m3fn), sc.contiguous())
            outs = []
            for buf in (bt, bk):
                if ctx.rank == 1 and lag_s:
                    time.sleep(lag_s)
                ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
                rx, ri, rw, cnt, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr,
                                                          num_tokens_per_expert=ntpe, topk_idx=topk, topk_weights=w)
                comb, _, _ = buf.combine((rx[0].float() * rx[1].repeat_interleave(128, 1)).bfloat16() if fp8
                                         else rx * 2, handle)
                outs.append((rx, ri, rw, torch.tensor(cnt), handle[0], handle[3], handle[5], comb))
            same[f"call {i}"] = _same(outs[0], outs[1])
    finally:
        B._STEADY_SPIN_NS = spin
        del eng.run_reorder, eng.run_combine
    return {"same": same, "steady": seen}


def _every_rank_routing(seed: int, rank: int, T: int, K: int, E: int, R: int) -> torch.Tensor:
    """[T, K] expert ids of as many rows per rank pair in every call, other tokens and experts: T // 2 tokens
    (another half every call) name K experts of rank 0 alone; every other token names one expert of every rank
    (in a shuffled order) and K - R more of any rank, all distinct."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    E_local, rows = E // R, []
    alone = set(torch.randperm(T, generator=g)[:T // 2].tolist())
    for t in range(T):
        if t in alone:
            rows.append(torch.randperm(E_local, generator=g)[:K].tolist())
            continue
        first = [r * E_local + int(torch.randint(E_local, (1,), generator=g)) for r in range(R)]
        rest = [e for e in torch.randperm(E, generator=g).tolist() if e not in first][:K - R]
        row = first + rest
        rows.append([row[j] for j in torch.randperm(K, generator=g).tolist()])
    return torch.tensor(rows, dtype=torch.int64)


def _ll_calls(buf, x, topk, w, N, E, use_fp8, hook: bool = False, pause: float = 0.0):
    time.sleep(pause)
    rx, rc, handle, _, recv = buf.low_latency_dispatch(x, topk, N, E, use_fp8=use_fp8, return_recv_hook=hook)
    if hook:
        recv()
    # rows past recv_count[e] are unspecified (recv_x is allocated with torch.empty): compare the valid ones
    valid = [(rx[0] if use_fp8 else rx)[e, : int(rc[e])] for e in range(rc.numel())]
    scales = [rx[1][e, : int(rc[e])] for e in range(rc.numel())] if use_fp8 else []
    out = {"ll_dispatch": (valid + scales, rc, handle[0], handle[1])}
    y = rx
    if use_fp8:
        q, sc = rx
        El = q.shape[0]
        y = (q.float().view(El, q.shape[1], -1, 128) * sc.unsqueeze(-1)).view(q.shape).bfloat16()
    time.sleep(pause)
    comb, _, recv = buf.low_latency_combine(y, topk, w, handle, return_recv_hook=hook)
    if hook:
        recv()
    out["ll_combine"] = comb
    return out


def ll_one_step(ctx, use_fp8: bool = False, hook: bool = False, late: bool = False, calls: int = 4, T: int = 6,
                H: int = 1152, K: int = 3, E: int = 8, N: int = 8) -> dict:
    """Low-latency calls on the C path against the torch path, a new routing each, with the engine's one-step
    receives (``ll_dispatch_receive``, ``ll_combine_receive``) counted by what they returned. ``late``: rank 1
    sleeps before each of its calls, so that rank 0's one-step waits end with its messages missing (3) and the
    general way receives those calls. Returns {"same": {call: bit-identical?}, "steps": {"name status": n}}."""
    import ubep_torch.buffer as buffer_mod
    bt = get_buffer(ctx, "tff", backend="torch", low_latency=True, N=N, H=H, E=E)
    bk = get_buffer(ctx, "tff", backend="native", low_latency=True, N=N, H=H, E=E)
    steps: dict = {}
    spin = buffer_mod._STEADY_SPIN_NS
    if not late:      # (the one-step waits long enough for a peer that a loaded machine holds up)
        buffer_mod._STEADY_SPIN_NS = 5_000_000_000
    eng = bk.engine
    for name in ("ll_dispatch_receive", "ll_combine_receive"):
        def counted(*args, _real=getattr(eng, name), _name=name, **kwargs):
            status = _real(*args, **kwargs)
            steps[f"{_name} {status}"] = steps.get(f"{_name} {status}", 0) + 1
            return status
        setattr(eng, name, counted)
    same = {}
    try:
        for c in range(calls):
            topk, w = make_routing(c, ctx.rank, T, K, E)
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(c + 31 * ctx.rank)).bfloat16()
            ref = _ll_calls(bt, x, topk, w, N, E, use_fp8)
            got = _ll_calls(bk, x, topk, w, N, E, use_fp8, hook=hook, pause=0.05 if late and ctx.rank == 1 else 0.0)
            same.update({f"{k} {c}": _same(ref[k], got[k]) for k in ref})
    finally:
        buffer_mod._STEADY_SPIN_NS = spin
        for name in ("ll_dispatch_receive", "ll_combine_receive"):
            delattr(eng, name)
    return {"same": same, "steps": steps}


def ll_equivalence(ctx, sync: str, use_fp8: bool = False, T: int = 4, H: int = 256, K: int = 2, E: int = 4,
                   N: int = 8, seed: int = 0, backend: str = "triton", special: bool = False) -> dict:
    """Low-latency dispatch + combine on torch and ``backend``; returns {call: bit-identical?}."""
    bt = get_buffer(ctx, sync, backend="torch", low_latency=True, N=N, H=H, E=E)
    bk = get_buffer(ctx, sync, backend=backend, low_latency=True, N=N, H=H, E=E)
    topk, w = make_routing(seed, ctx.rank, T, K, E)
    g = torch.Generator().manual_seed(seed + 57 * ctx.rank)
    x = torch.randn(T, H, generator=g)
    x = (_with_specials(x, g) if special else x).bfloat16()
    ref = _ll_calls(bt, x, topk, w, N, E, use_fp8)
    t0 = time.perf_counter()
    got = _ll_calls(bk, x, topk, w, N, E, use_fp8)
    return {"same": {k: _same(ref[k], got[k]) for k in ref}, "triton_s": time.perf_counter() - t0}


def under_store_policy(ctx, policy: str, fn, *args, **kwargs) -> dict:
    """``fn(ctx, *args, **kwargs)`` with rows stored into the peers' slots by ``policy`` (``plain``,
    ``streaming`` or ``auto``), then the policy it had again; for a fixed way, adds ``sends``: how many sends
    took that way."""
    from ubep_torch import native_engine
    before = native_engine.store_policy()["policy"]
    native_engine.store_policy(policy)     # (the counts and estimates start afresh)
    try:
        out = fn(ctx, *args, **kwargs)
        if policy != "auto":
            out["sends"] = native_engine.store_policy()["sends"][policy]
    finally:
        native_engine.store_policy(before)     # (UBEP_STORES's, in a run under it)
    return out


def measured_round_trips(ctx, calls: int = 12, T: int = 64, H: int = 2048, E: int = 8, K: int = 4) -> dict:
    """Normal round trips on the C path whose sends are large enough for the store policy to measure (about
    320 KiB to the peer); returns ``store_policy()`` after them (run it ``under_store_policy("auto", ...)``)."""
    import torch.distributed as dist

    from ubep_torch import Buffer, native_engine
    with Buffer(dist.group.WORLD, 8 << 20, backend="native") as buf:
        g = torch.Generator().manual_seed(ctx.rank)
        x = torch.randn(T, H, generator=g).bfloat16()
        topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        for _ in range(calls):
            recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
            buf.combine(recv_x, handle)
    return native_engine.store_policy()


def sp_collision(ctx, T: int = 4, H: int = 256, E: int = 4) -> dict:
    """SP with tokens whose first words equal the sentinel (all-zero rows): must arrive intact."""
    bt = get_buffer(ctx, "sp", backend="torch")
    bk = get_buffer(ctx, "sp", backend="triton")
    topk, w = make_routing(3, ctx.rank, T, 2, E, drop=0.0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(5 + ctx.rank)).bfloat16()
    x[0] = 0              # every block's first word collides with the sentinel
    x[1, :4] = 0          # only the first block's first word collides
    res = {}
    for name, b in (("torch", bt), ("triton", bk)):
        ntpr, _, ntpe, itr, _ = b.get_dispatch_layout(topk, E)
        rx, *_ = b.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                            topk_idx=topk, topk_weights=w)
        res[name] = rx
    zero_rows = int((res["triton"].float().abs().sum(1) == 0).sum())
    return {"same": _same(res["torch"], res["triton"]), "zero_rows": zero_rows}


def launch_shape(ctx, sync: str = "tff") -> dict:
    """The AIV split of the Triton engine's last send launch."""
    bk = get_buffer(ctx, sync, backend="triton")
    topk, w = make_routing(1, ctx.rank, 6, 2, 4)
    x = torch.randn(6, 256).bfloat16()
    ntpr, _, ntpe, itr, _ = bk.get_dispatch_layout(topk, 4)
    bk.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk,
                topk_weights=w)
    return dict(bk.engine.last_launch)


def ll_strided_out(ctx, backend: str = "native", T: int = 6, H: int = 256, K: int = 3, E: int = 4, N: int = 8) -> dict:
    """low_latency_combine into caller-provided ``out=`` tensors that are not contiguous (a transposed view
    and a column slice), into an ``out=`` inside ``x``, and from strided ``x``: the same bits as the torch path
    with plain tensors."""
    bt = get_buffer(ctx, "tff", backend="torch", low_latency=True, N=N, H=H, E=E)
    bk = get_buffer(ctx, "tff", backend=backend, low_latency=True, N=N, H=H, E=E)
    topk, w = make_routing(9, ctx.rank, T, K, E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4 + ctx.rank)).bfloat16()
    rx, _, h, _, _ = bt.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    ref, _, _ = bt.low_latency_combine(rx, topk, w, h)
    same = {}
    parent = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
    for name, out in (("transposed", torch.zeros(H, T, dtype=torch.bfloat16).t()), ("column_slice", parent[:, H:])):
        rk, _, hk, _, _ = bk.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        got, _, _ = bk.low_latency_combine(rk, topk, w, hk, out=out)
        same[name] = got is out and torch.equal(got.contiguous().view(torch.int16), ref.view(torch.int16))
    same["beside_column_slice_untouched"] = not bool(parent[:, :H].view(torch.int16).any())
    rk, _, hk, _, _ = bk.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    strided = rk.permute(1, 0, 2).contiguous().permute(1, 0, 2)     # same values, expert dim not outermost
    got, _, _ = bk.low_latency_combine(strided, topk, w, hk)
    same["strided_x"] = torch.equal(got.view(torch.int16), ref.view(torch.int16))
    rk, _, hk, _, _ = bk.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    wide = torch.zeros(*rk.shape[:2], 2 * H, dtype=torch.bfloat16)
    wide[:, :, ::2] = rk
    got, _, _ = bk.low_latency_combine(wide[:, :, ::2], topk, w, hk)        # elements two apart
    same["element_stride_2_x"] = torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # out= inside x: the result is the one of x's values at call time
    rk, _, hk, _, _ = bk.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    got, _, _ = bk.low_latency_combine(rk, topk, w, hk, out=rk[0, :T])
    same["out_inside_x"] = torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # NaN expert outputs into a transposed out=: stored as 0xFFFF, as without out=, on every engine
    for name, b in (("torch", bt), (backend, bk)):
        rk, _, hk, _, _ = b.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        rk.fill_(float("nan"))
        got, _, _ = b.low_latency_combine(rk, topk, w, hk, out=torch.zeros(H, T, dtype=torch.bfloat16).t())
        bits = got.contiguous().view(torch.int16)[(topk >= 0).any(1)]
        same[f"nan_bits_{name}"] = bool((bits == -1).all())
    return {"same": same}


def streaming_equivalence(ctx, step: int = 3, T: int = 40, H: int = 1000, K: int = 4, E: int = 8,
                          N: int = 48) -> dict:
    """Streaming Token-Reordering against the torch path: the C engine's arrival scan is made to reveal
    at most ``step`` more rows of a source per poll (as if the source were still writing), so dispatches
    reorder every source in several runs; outputs must stay bit-identical. Returns {call: same?} and how
    many partial runs were reordered."""
    import ubep_torch.buffer as buffer_mod
    bt = get_buffer(ctx, "tff", backend="torch")
    bk = get_buffer(ctx, "tff", backend="native")
    lt = get_buffer(ctx, "tff", backend="torch", low_latency=True, N=N, H=H, E=E)
    lk = get_buffer(ctx, "tff", backend="native", low_latency=True, N=N, H=H, E=E)
    topk, w = make_routing(5, ctx.rank, T, K, E)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(11 + ctx.rank)).bfloat16()
    partial = [0]

    def throttled(real):
        def arrived_prefix(fmt, rows, flag, start):
            end = real(fmt, rows, flag, start)
            if end is not None and end > start + step:
                end = start + step
            if end is not None and end < rows.shape[0]:
                partial[0] += 1
            return end
        return arrived_prefix

    def throttled_sources(real):
        # the engine's per-poll reorder of several sources sees at most ``step`` more rows of each per poll
        def reorder_sources(fmt, outs, meta_out, src_out, min_run, own_src=None):
            one_poll = real(fmt, outs, meta_out, src_out, min_run, own_src)
            if one_poll is None:
                return None

            def throttled_poll(sources, flag, own=None):
                seen = [[p[0], min(p[1], p[3] + step), p[2], p[3], p[4]] for p in sources]
                one_poll(seen, flag, own)
                completed = []
                for p, v in zip(sources, seen):
                    if v[3] > p[3] and v[3] < p[1]:
                        partial[0] += 1
                    p[3] = v[3]
                    if p[3] == p[1]:
                        completed.append(p[4])
                return completed
            throttled_poll.copies_own = getattr(one_poll, "copies_own", False)
            return throttled_poll
        return reorder_sources

    saved = buffer_mod._STREAM_ROWS
    buffer_mod._STREAM_ROWS = 1
    for b in (bk, lk):
        b.engine.arrived_prefix = throttled(type(b.engine).arrived_prefix.__get__(b.engine))
        b.engine.reorder_sources = throttled_sources(type(b.engine).reorder_sources.__get__(b.engine))
    lk.engine.ll_dispatch_receive = lambda *args, **kwargs: None     # (the general way's streaming receive)
    try:
        ref = {**_normal_calls(bt, x, topk, w, E), **_ll_calls(lt, x, topk, w, N, E, False)}
        normal_before = partial[0]
        got = _normal_calls(bk, x, topk, w, E)
        normal_partial = partial[0] - normal_before
        got.update(_ll_calls(lk, x, topk, w, N, E, False))
    finally:
        buffer_mod._STREAM_ROWS = saved
        for b in (bk, lk):
            del b.engine.arrived_prefix
            del b.engine.reorder_sources
        del lk.engine.ll_dispatch_receive
    return {"same": {k: _same(ref[k], got[k]) for k in ref}, "partial_runs": partial[0],
            "normal_partial_runs": normal_partial}


def mixed_backends(ctx, T: int = 4, H: int = 256, E: int = 4) -> dict:
    """Rank 0 on the kernels, rank 1 on the torch path. Normal mode mixes (same rows); a low-latency Buffer is
    refused on every rank at construction, naming the row layouts (the kernels send one row per (token,
    expert), the others one per (token, rank)), instead of failing its first call. Returns what happened."""
    import torch.distributed as dist

    from ubep_torch import Buffer
    backend = "triton" if ctx.rank == 0 else "torch"
    topk = torch.tensor([[0, 3], [1, -1], [2, 3], [3, 0]])
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(ctx.rank)).bfloat16()
    buf = Buffer(dist.group.WORLD, 1 << 22, backend=backend)
    recv, *_, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
    out = buf.combine(recv, handle)[0]
    ranks = torch.tensor([len({int(e) // (E // 2) for e in row if e >= 0}) for row in topk], dtype=torch.float32)
    normal_ok = torch.allclose(out.float(), x.float() * ranks.unsqueeze(1), rtol=0.02, atol=0.02)
    buf.destroy()
    try:
        Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(T, H, 2, E), low_latency_mode=True,
               backend=backend)
        ll = "built"
    except ValueError as e:
        ll = str(e)
    return {"normal_ok": normal_ok, "ll": ll}


def count_group_per_call(ctx, T: int = 4, H: int = 256, E: int = 4, N: int = 8) -> dict:
    """The count group of the Triton engine's launches and of the cost-model reports: a normal call's
    ``Config(num_count_aivs=...)`` holds for that call only, and a report models the mapping the engine runs."""
    from ubep_torch import Buffer, Config
    from ubep_torch.cost_model import CostModel
    R = ctx.world_size
    buf = Buffer(ctx.group, 8 << 20, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 backend="triton", cost_model=CostModel(), timeout_s=60.0)
    topk, w = make_routing(2, ctx.rank, T, 2, E)
    x = torch.randn(T, H).bfloat16()
    out = {}

    def ll(tag):
        recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        out[tag] = (buf.engine.last_launch["n_count"], buf.last_report["ubep"].n_count)
        buf.low_latency_combine(recv, topk, w, handle)
    ll("ll before")
    buf.dispatch(x, topk_idx=topk, num_experts=E, config=Config(num_count_aivs=5))
    out["normal with Config(5)"] = (buf.engine.last_launch["n_count"], buf.last_report["ubep"].n_count)
    ll("ll after")
    out["mapping reported"] = buf.last_report["ubep"].mapping
    buf.engine.mapping = False          # (as UBEP_TRITON_MAPPING=0 makes it)
    buf.dispatch(x, topk_idx=topk, num_experts=E)
    out["mapping off reported"] = buf.last_report["ubep"].mapping
    buf.destroy()
    return out


def ieee_sums_under_warnings_as_errors(ctx) -> list:
    """Sums whose IEEE result is inf or NaN (inf - inf, inf * 0, a float32 overflow) through the kernels
    with warnings raised as errors, twice each: what each call returned or raised, and whether the results
    are the ones torch gives."""
    import warnings
    E, H, T = 2 * ctx.world_size, 256, 2
    topk = torch.tensor([[0, 2], [1, 3]])
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf = get_buffer(ctx, "tff", backend="triton")
        for value, y_value in ((3e38, None), (1.0, float("inf") if ctx.rank == 0 else -float("inf"))):
            x = torch.full((T, H), value).bfloat16()
            for _ in range(2):
                try:
                    rx, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
                    y = rx if y_value is None else torch.full_like(rx, y_value)
                    c = buf.combine(y, h)[0].float()
                    out.append(bool(c.isinf().all()) if y_value is None else bool(c.isnan().all()))
                except Exception as e:  # noqa: BLE001
                    out.append(f"{type(e).__name__}: {e}"[:200])
        ll = get_buffer(ctx, "tff", backend="triton", low_latency=True, N=4, H=H, E=E)
        w = torch.tensor([[0.0, 1.0], [1.0, 0.5]])
        for _ in range(2):
            try:
                rx, _, h, _, _ = ll.low_latency_dispatch(torch.full((T, H), float("inf")).bfloat16(), topk, 4, E,
                                                         use_fp8=False)
                c = ll.low_latency_combine(rx, topk, w, h)[0].float()
                out.append(bool(c[0].isnan().all()) and bool(c[1].isinf().all()))
            except Exception as e:  # noqa: BLE001
                out.append(f"{type(e).__name__}: {e}"[:200])
    return out
