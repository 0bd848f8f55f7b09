"""DeepEP-style benchmark of ubep_torch on this machine, side by side with naive gloo EPs, in one run.

    python benchmarks/bench_buffer.py [--ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 16]

What is timed
-------------
Every path runs ``--iters`` calls back to back after a barrier, and a rank's time per call is its loop
time divided by the number of calls; the slowest rank counts, and the median of ``--rounds`` rounds is
printed. Back-to-back calls are what an MoE layer issues; a barrier before every single call would add
the barrier's release skew between processes (often milliseconds for gloo) to every measurement. Each
call's outputs are dropped once the next step has used them (a round trip: the dispatch's outputs after
the combine), as in an MoE forward pass, for every path alike; the combine loops reuse one dispatch's
outputs.

* ``ubep normal``: ``dispatch`` (with ``get_dispatch_layout``'s outputs) and ``combine``.
* ``ubep normal, new routing every call`` (first backend only): ``get_dispatch_layout``, ``dispatch`` and
  ``combine`` of a routing that differs from the previous call's (eight routings in turn), as in training
  and serving, where every step routes anew. The other ubep rows repeat one routing, which the Buffer
  recognises and does not lay out again; the naive EPs compute their send lists from the routing on every
  call.
* ``ubep low_latency``: ``low_latency_dispatch`` (bf16) and ``low_latency_combine``.
* Both once per ``--backends`` entry (default ``auto,torch``: the engine ``backend="auto"`` picks, which is
  the C data path where it was built, then the vectorized torch path), in the same run.
* ``naive gloo (rank rows)``: what an EP without a shared address space does for normal mode: counts with
  one ``all_to_all_single``, one row per (token, destination rank) with a second, the rows back with a
  third, summed with ``index_add_``. Same rows as normal-mode dispatch.
* ``naive gloo (expert rows)``: the same for the low-latency layout: one row per (token, expert) each way,
  and the weighted sum. Same rows as low-latency dispatch. It is also what an all-to-all EP without
  per-rank deduplication sends in any mode, so normal mode's ratio against it is printed too, on a line
  of its own (the ``rank rows`` baseline, which moves the same rows as normal mode, is the strict one).
* Physical references, measured on every rank at once: a plain tensor copy of the bytes one rank receives
  per dispatch (source and destination stay in cache), the same copy through 64 MiB buffers (memory
  bandwidth), and a store of those bytes into the peer's shared memory followed by the peer loading them
  back out (what moving bytes between two processes costs here at least).
* The normal round trip with plain copies only (``copies_only``): the rows a normal dispatch and combine
  move through shared memory (own rows gathered, the peers' rows stored into their memory and copied out,
  combine's rows stored back and summed), with ``index_select``/``copy_``/``add`` and no flags, control
  messages or waits. The UBEP data path makes these copies and more, so this shows what the protocol and
  the per-call work add. With two ranks and every token reaching both (the default) each step is one
  torch operator; with partial routing the sum is ``index_add_``, one pass per source. Where the C data
  path was built, the same steps run a second time through its own row-copy and bf16-sum loops (the
  loops a ``Buffer`` moves its rows with; in some runs faster than the torch operators, in others slower):
  the round trip no implementation that makes these copies with these loops can beat on this machine.
* Per-call work (first backend only): the ``ubep normal`` round trip of the same routing with rows of
  hidden 128 (``x``'s first 128 columns), which move next to no bytes. What it takes is the part of a call
  that does not grow with the rows: the routing checks, control messages, waits, acks and outputs. Set
  against the plain-copies round trip above, it shows how far each part is from the target.

* Where the normal round trip goes (the C path only): after the rounds, ``--iters`` times ``--rounds``
  more ``ubep normal`` round trips, with the engine's one-step exchanges timed inside them on every rank
  (``time.perf_counter``, one clock for every process of the host). For the dispatch's and the combine's
  exchange: how long a rank spends in it, how far apart the ranks enter it (the wait for the slower
  rank), and how long the last rank to leave takes after the last one entered (moving the rows); then
  the rest of the round trip, outside the exchanges: the calls' Python (checks, outputs, handles,
  control words).

The C path stores rows into a peer's slots with plain or streaming stores, whichever it measured cheaper
(``native_engine.store_policy``; ``UBEP_STORES`` fixes one): the last lines print each rank's choice and
its estimates. On a VM whose vCPUs are sometimes placed far apart, plain stores into memory another core
last read cost several times more in those minutes, and the plain-store references above (the copies, the
store to the peer) with them: the store-to-peer reference is printed round by round, to show which rounds
met that level.

Bandwidth is the bytes one rank receives per dispatch (``recv_x`` rows, its own included, as DeepEP
counts them; the mean over ranks) over the dispatch time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ubep_torch import Buffer  # noqa: E402
from ubep_torch import protocol as P  # noqa: E402
from ubep_torch.buffer import _LL_MAX_TOPK as LL_MAX_TOPK  # noqa: E402
from ubep_torch.buffer import normal_buffer_bytes  # noqa: E402
from ubep_torch.native_engine import NativeEngine  # noqa: E402
from ubep_torch.native_engine import available as native_available  # noqa: E402
from ubep_torch.native_engine import store_policy as native_store_policy  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402
from ubep_torch.ugas import SymmetricHeap  # noqa: E402
from ubep_torch.utils import int_at_least, physical_memory  # noqa: E402

SMALL_HIDDEN = 128    # hidden size of the per-call work line: rows of 256 B in bf16


def _loop(fn, iters: int) -> float:
    """Seconds per call of ``iters`` back-to-back calls, started together on every rank."""
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _rank_rows(topk_idx, R, El):
    T = topk_idx.shape[0]
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    valid = topk_idx >= 0
    in_rank[torch.arange(T).unsqueeze(1).expand_as(topk_idx)[valid], (topk_idx[valid] // El)] = True
    return [in_rank[:, d].nonzero().squeeze(1) for d in range(R)]


def _there_and_back(send, send_counts):
    """Counts, then the rows to their ranks, then the same rows back (the expert is the identity)."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    recv = torch.empty(int(recv_counts.sum()), send.shape[1], dtype=send.dtype)
    dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist())
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, send_counts.tolist(), recv_counts.tolist())
    return recv, back


def naive_rank_rows(x, topk_idx, E, R):
    """Normal-mode EP over gloo: one row per (token, destination rank), back, summed."""
    T = x.shape[0]
    dest_rows = _rank_rows(topk_idx, R, E // R)
    send_counts = torch.tensor([r.numel() for r in dest_rows], dtype=torch.int64)
    order = torch.cat(dest_rows)
    recv, back = _there_and_back(x.index_select(0, order), send_counts)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    out.index_add_(0, order, back.float())
    return recv, out.to(x.dtype)


def naive_expert_rows(x, topk_idx, weights, E, R):
    """Low-latency-layout EP over gloo: one row per (token, expert) each way, weighted sum."""
    T, K = topk_idx.shape
    El = E // R
    t_idx, k_idx = (topk_idx >= 0).nonzero(as_tuple=True)
    g = topk_idx[t_idx, k_idx]
    order = torch.argsort(g, stable=True)
    t_idx, k_idx, g = t_idx[order], k_idx[order], g[order]
    recv, back = _there_and_back(x.index_select(0, t_idx), torch.bincount(g // El, minlength=R))
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    out.index_add_(0, t_idx, back.float() * weights[t_idx, k_idx].unsqueeze(1))
    return recv, out.to(x.dtype)


def copies_only(ctx, x, dest_rows, heap, between=None, loops="torch"):
    """The rows a normal round trip moves, with plain copies and sums and nothing else: no flags, control
    messages, waits or checks. Dispatch: each rank stores the rows of its tokens for every peer into that
    peer's shared memory and gathers its own rows into a new ``recv_x`` (rank-major, as ``dispatch``), then
    copies the peers' rows out of its own memory after them. Combine (the expert is the identity): each
    rank stores the rows it got from every peer back into that peer's memory, then sums every token's rows
    in bf16. The UBEP data path makes these copies and adds the protocol to them (the timing shows what
    the protocol adds; faster copy and sum kernels than torch's would move the same rows sooner). Returns
    ``(dispatch, combine)``, to run on every rank at once (nothing waits for the peers: the rows are not
    checked). ``heap`` holds every source's rows of ``x``'s shape; ``between()``, when given, runs between
    the stores into the peers and the loads (a barrier makes the results exact).

    ``loops="torch"`` makes the copies and the sum with torch operators; ``loops="native"`` with the C data
    path's own row copy and bf16 sum (``NativeEngine.copy_rows``/``reduce_sources``, the loops that move a
    ``Buffer``'s rows), so the gap to a ``Buffer`` round trip is what the protocol and the per-call work add."""
    R, me, (T, H) = ctx.world_size, ctx.rank, x.shape
    sent = torch.tensor([r.numel() for r in dest_rows])
    counts = [torch.empty_like(sent) for _ in range(R)]
    dist.all_gather(counts, sent)
    C = [c.tolist() for c in counts]            # C[s][d]: rows rank s sends rank d

    def slot(r, s, n):                          # source s's first n rows in rank r's memory
        mem = heap.local if r == me else heap.peer(r)
        return mem[s * T * H * 2:(s * T + n) * H * 2].view(torch.bfloat16).view(n, H)

    off = [0]
    for s in range(R):
        off.append(off[-1] + C[s][me])
    whole = [d for d in range(R) if torch.equal(dest_rows[d], torch.arange(T))]
    peers = [r for r in range(R) if r != me]
    if loops == "native":
        return _native_copies(x, dest_rows, C, off, slot, between, me, peers)

    def dispatch():
        recv = torch.empty(off[-1], H, dtype=x.dtype)
        for d in peers:
            torch.index_select(x, 0, dest_rows[d], out=slot(d, me, C[me][d]))
        torch.index_select(x, 0, dest_rows[me], out=recv[off[me]:off[me + 1]])
        if between is not None:
            between()
        for s in peers:
            recv[off[s]:off[s + 1]].copy_(slot(me, s, C[s][me]))
        return recv

    def combine(recv):
        for s in peers:
            slot(s, me, C[s][me]).copy_(recv[off[s]:off[s + 1]])
        if between is not None:
            between()
        rows = [recv[off[me]:off[me + 1]] if d == me else slot(me, d, C[me][d]) for d in range(R)]
        first = whole[:2] if len(whole) >= 2 else []
        out = torch.add(rows[first[0]], rows[first[1]]) if first else torch.zeros(T, H, dtype=x.dtype)
        for d in range(R):
            if d in first:
                continue
            if d in whole:
                out.add_(rows[d])
            else:
                out.index_add_(0, dest_rows[d], rows[d])
        return out
    return dispatch, combine


def _native_copies(x, dest_rows, C, off, slot, between, me, peers):
    """``copies_only``'s steps with the C data path's loops (see there)."""
    eng = NativeEngine()
    R, (T, H) = len(C), x.shape
    fmt = P.row_format("tff", (("x", H * 2),), 0)
    span = [torch.arange(n, dtype=torch.int64) for n in range(max(off[-1], T) + 1)]
    at = [torch.arange(off[s], off[s + 1], dtype=torch.int64) for s in range(R)]
    rows = [r.to(torch.int64).contiguous() for r in dest_rows]

    def dispatch():
        recv = torch.empty(off[-1], H, dtype=x.dtype)
        for d in peers:
            eng.copy_rows(x, rows[d], slot(d, me, C[me][d]), span[C[me][d]])
        eng.copy_rows(x, rows[me], recv, at[me])
        if between is not None:
            between()
        for s in peers:
            eng.copy_rows(slot(me, s, C[s][me]), span[C[s][me]], recv, at[s])
        return recv

    def combine(recv):
        for s in peers:
            eng.copy_rows(recv, at[s], slot(s, me, C[s][me]), span[C[s][me]])
        if between is not None:
            between()
        out = torch.empty(T, H, dtype=x.dtype)
        sources = [(recv[off[me]:off[me + 1]] if d == me else slot(me, d, C[me][d]), rows[d]) for d in range(R)]
        eng.reduce_sources(fmt, sources, out)
        return out
    return dispatch, combine


def bench_rank(ctx, T, H, K, E, iters, rounds, sync, backends, nvl_tokens=0):
    torch.manual_seed(ctx.rank)
    R = ctx.world_size
    x = torch.randn(T, H).bfloat16()
    w, topk = torch.randn(T, E).softmax(-1).topk(K, dim=-1)
    topk = topk.to(torch.int64)
    nvl = normal_buffer_bytes(nvl_tokens, H * 2, R) if nvl_tokens else \
        Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    paths = {}     # backend -> (dispatch, combine, low-latency dispatch, low-latency combine)
    bufs, layouts = [], []
    for backend in backends:
        buf = Buffer(ctx.group, nvl, rdma, low_latency_mode=True, sync=sync, backend=backend)
        bufs.append(buf)
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
        layouts.append((ntpr, None, ntpe, itr))

        def disp(buf=buf, ntpr=ntpr, ntpe=ntpe, itr=itr):
            return buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                topk_idx=topk, topk_weights=w)

        def comb(d, buf=buf):
            return buf.combine(d[0], d[4])

        def lld(buf=buf):
            return buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)

        def llc(ll, buf=buf):
            return buf.low_latency_combine(ll[0], topk, w, ll[2])

        paths[buf.backend] = (disp, comb, lld, llc)

    routes = [torch.randn(T, E).softmax(-1).topk(K, dim=-1) for _ in range(8)]
    turn = [0]

    def new_routing_rt(buf=bufs[0]):
        w_i, topk_i = routes[turn[0] % len(routes)]
        turn[0] += 1
        ntpr_i, _, ntpe_i, itr_i, _ = buf.get_dispatch_layout(topk_i, E)
        d = buf.dispatch(x, num_tokens_per_rank=ntpr_i, is_token_in_rank=itr_i, num_tokens_per_expert=ntpe_i,
                         topk_idx=topk_i, topk_weights=w_i)
        return buf.combine(d[0], d[4])

    x_small = x[:, :SMALL_HIDDEN].contiguous()

    def small_rt(buf=bufs[0], ntpr=layouts[0][0], ntpe=layouts[0][2], itr=layouts[0][3]):
        d = buf.dispatch(x_small, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                         topk_idx=topk, topk_weights=w)
        return buf.combine(d[0], d[4])

    def naive_n():
        return naive_rank_rows(x, topk, E, R)

    def naive_l():
        return naive_expert_rows(x, topk, w, E, R)

    for disp, comb, lld, llc in paths.values():        # warm up every path once
        d, ll = disp(), lld()
        comb(d), llc(ll)
    naive_n(), naive_l(), new_routing_rt(), small_rt()
    recv_bytes = d[0].numel() * 2
    ll_bytes = int(ll[1].sum()) * H * 2
    del d, ll
    src = torch.empty(recv_bytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    big_src = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    big_dst = torch.empty_like(big_src)
    nbig = (64 << 20) // recv_bytes
    # (ranks receive different byte counts beyond two ranks: every rank's heap holds the largest, twice)
    most = torch.tensor([recv_bytes])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    stride = int(most)
    heap = SymmetricHeap(ctx.group, 2 * stride + 4096)
    peer = heap.peer((ctx.rank + 1) % R)
    mine = heap.local
    floor_heap = SymmetricHeap(ctx.group, R * T * H * 2)
    floors = {v: copies_only(ctx, x, _rank_rows(topk, R, E // R), floor_heap, loops=v)
              for v in (("torch", "native") if native_available() else ("torch",))}
    for floor_disp, floor_comb in floors.values():
        floor_comb(floor_disp())
    pos = {"i": 0}

    def big_copy():   # walk through 64 MiB so every copy misses the cache
        i = pos["i"] = (pos["i"] + 1) % nbig
        big_dst[i * recv_bytes:(i + 1) * recv_bytes].copy_(big_src[i * recv_bytes:(i + 1) * recv_bytes])

    def cross_copy():  # store into the peer's memory, then (after the barrier) load own memory back out
        h = pos["i"] = (pos["i"] + 1) % 2
        peer[h * stride:h * stride + recv_bytes].copy_(src)
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(mine[h * stride:h * stride + recv_bytes])
        return time.perf_counter() - t0

    keys = [f"{b}:{k}" for b in paths for k in ("disp", "comb", "rt", "lld", "llc", "llrt")]
    keys += [f"floor_{v}_{k}" for v in floors for k in ("disp", "comb", "rt")]
    res = {k: [] for k in keys + ["new_routing_rt", "small_rt", "naive_n", "naive_l", "copy", "bigcopy", "cross"]}
    for _ in range(rounds):
        for b, (disp, comb, lld, llc) in paths.items():
            res[f"{b}:disp"].append(_loop(disp, iters))
            d = disp()          # the layout every combine of the combine loop returns rows of
            res[f"{b}:comb"].append(_loop(lambda c=comb, d=d: c(d), iters))
            del d
            res[f"{b}:rt"].append(_loop(lambda d=disp, c=comb: c(d()), iters))
            res[f"{b}:lld"].append(_loop(lld, iters))
            ll = lld()
            res[f"{b}:llc"].append(_loop(lambda c=llc, ll=ll: c(ll), iters))
            del ll
            res[f"{b}:llrt"].append(_loop(lambda d=lld, c=llc: c(d()), iters))
        res["new_routing_rt"].append(_loop(new_routing_rt, iters))
        res["small_rt"].append(_loop(small_rt, iters))
        for v, (floor_disp, floor_comb) in floors.items():
            res[f"floor_{v}_disp"].append(_loop(floor_disp, iters))
            recv = floor_disp()
            res[f"floor_{v}_comb"].append(_loop(lambda r=recv, c=floor_comb: c(r), iters))
            del recv
            res[f"floor_{v}_rt"].append(_loop(lambda d=floor_disp, c=floor_comb: c(d()), iters))
        res["naive_n"].append(_loop(naive_n, max(2, iters // 2)))
        res["naive_l"].append(_loop(naive_l, max(2, iters // 2)))
        res["copy"].append(_loop(lambda: dst.copy_(src), iters * 4))
        res["bigcopy"].append(_loop(big_copy, iters * 4))
        # cross-process: the store and the load each timed around the barrier between them
        t_store = _loop(lambda: peer[:recv_bytes].copy_(src), iters * 4)
        loads = [cross_copy() for _ in range(iters)]
        res["cross"].append(t_store + statistics.median(loads))
    heap.close()
    floor_heap.close()
    disp, comb = paths[bufs[0].backend][:2]
    timeline = _exchange_times(bufs[0], disp, comb, iters * rounds)
    for buf in bufs:
        buf.destroy()
    return res, recv_bytes, ll_bytes, list(paths), native_store_policy(), timeline


def _exchange_times(buf, disp, comb, calls: int):
    """``calls`` normal round trips with the C path's one-step exchanges timed inside them: ``(start of every
    round trip and end of the last, [(kind, start, end, status)] of every exchange, calls)``, with
    ``time.perf_counter`` stamps, which every process of this host reads from the same clock. None where the
    engine has no one-step exchange."""
    eng = buf.engine
    if not (hasattr(eng, "run_reorder") and hasattr(eng, "run_combine")):
        return None
    stamps = []

    def timed(kind, step):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            status = step(*args, **kwargs)
            stamps.append((kind, t0, time.perf_counter(), status))
            return status
        return call
    comb(disp())        # (the calls before may have sent other rows: this one sends these again)
    # (instance attributes in front of the engine's methods, removed again below)
    eng.run_reorder = timed("dispatch", eng.run_reorder)
    eng.run_combine = timed("combine", eng.run_combine)
    starts = []
    try:
        dist.barrier()
        for _ in range(calls):
            starts.append(time.perf_counter())
            comb(disp())
        starts.append(time.perf_counter())
    finally:
        del eng.run_reorder, eng.run_combine
    return starts, stamps, calls


def print_exchange_times(timelines) -> None:
    """Where the normal round trip goes (see ``_exchange_times``): for each one-step exchange, how long a rank
    spent in it, how far apart the ranks entered it and how long the last rank to leave took after the last
    one entered; then the rest of the round trip, outside the exchanges."""
    if any(t is None for t in timelines):
        print("\nwhere the normal round trip goes: not timed (the engine has no one-step exchange)")
        return
    stamps = [t[1] for t in timelines]
    # (every rank makes the same calls; an exchange that was not a one-step one on some rank is left out)
    if len({len(s) for s in stamps}) != 1 or any(len({s[i][0] for s in stamps}) != 1 for i in range(len(stamps[0]))):
        print("\nwhere the normal round trip goes: not timed (the ranks' exchanges did not pair up one to one)")
        return
    calls = timelines[0][2]
    print(f"\nwhere the normal round trip goes: the C path's one-step exchanges timed inside {calls} round "
          f"trip{'s' if calls != 1 else ''}\n  (the exchange stores the rows into the peers' memory, waits for "
          f"theirs and copies or sums them out)")
    for kind in ("dispatch", "combine"):
        at = [i for i, e in enumerate(stamps[0]) if e[0] == kind and all(s[i][3] == 0 for s in stamps)]
        if not at:
            print(f"  {kind}: no call took the one-step exchange")
            continue
        spent = statistics.median(statistics.mean(s[i][2] - s[i][1] for s in stamps) for i in at)
        apart = statistics.median(max(s[i][1] for s in stamps) - min(s[i][1] for s in stamps) for i in at)
        after = statistics.median(max(s[i][2] for s in stamps) - max(s[i][1] for s in stamps) for i in at)
        print(f"  {kind}'s exchange (medians): {spent * 1e3:.3f} ms on a rank (mean over ranks); the ranks "
              f"entered it {apart * 1e3:.3f} ms apart,\n    and the last to leave left {after * 1e3:.3f} ms after "
              f"the last one entered ({len(at)} of {calls} calls one-step on every rank)")
    # each round trip's time outside its exchanges, the mean over the ranks, then the median over the round
    # trips (a call that was not one-step has its receive outside; a rare stall of a process stays out of it)
    rest, whole = [], []
    for i in range(calls):
        per_rank = []
        for t, s in zip(timelines, stamps):
            a, b = t[0][i], t[0][i + 1]
            per_rank.append((b - a, b - a - sum(e[2] - e[1] for e in s if a <= e[1] < b)))
        whole.append(statistics.mean(p[0] for p in per_rank))
        rest.append(statistics.mean(p[1] for p in per_rank))
    print(f"  the rest of the round trip, outside the exchanges (the calls' checks, outputs, handles and control "
          f"words):\n    {statistics.median(rest) * 1e3:.3f} ms of {statistics.median(whole) * 1e3:.3f} ms "
          f"(medians over the round trips of the means over the ranks)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int_at_least(1), default=2)
    ap.add_argument("--tokens", type=int_at_least(1), default=128)
    ap.add_argument("--hidden", type=int_at_least(1), default=7168)
    ap.add_argument("--topk", type=int_at_least(1), default=8)
    ap.add_argument("--experts", type=int_at_least(1), default=16)
    ap.add_argument("--iters", type=int_at_least(1), default=20)
    ap.add_argument("--rounds", type=int_at_least(1), default=5)
    ap.add_argument("--sync", default="tff", choices=["tff", "dc", "sp", "sw"])
    ap.add_argument("--nvl-tokens", type=int_at_least(0), default=0,
                    help="size the normal-mode buffer for this many rows per source (default: DeepEP's hint); "
                         "fewer than --tokens makes each normal call run several exchanges")
    ap.add_argument("--backends", default="auto,torch",
                    help="comma-separated Buffer backends to time side by side (auto = the C path where built)")
    a = ap.parse_args()
    backends = [b for b in a.backends.split(",") if b]
    if not backends:
        ap.error("--backends names no backend")
    unknown = [b for b in backends if b not in ("auto", "native", "torch", "triton")]
    if unknown:
        ap.error(f"--backends: unknown {', '.join(unknown)} (auto, native, torch, triton)")
    if a.experts // a.ranks > P.MAX_CTRL_COUNTS - a.ranks - 1:
        ap.error(f"--experts {a.experts}: at most {P.MAX_CTRL_COUNTS - a.ranks - 1} per rank with {a.ranks} ranks")
    if a.topk > LL_MAX_TOPK:
        ap.error(f"--topk {a.topk}: the low-latency rows it times take top-k up to {LL_MAX_TOPK}")
    if a.topk > a.experts:
        ap.error(f"--topk {a.topk} must not exceed --experts {a.experts}")
    if a.experts % a.ranks:
        ap.error(f"--experts {a.experts} must be a multiple of --ranks {a.ranks} (pass --experts with --ranks, "
                 f"e.g. --ranks 3 --experts 15)")
    # every rank's shared memory (its Buffer) and its low-latency recv_x ([E_local, R * N, H] bf16), the largest
    # parts of what the run allocates: refused here rather than as a rank's allocation error
    row = 2 * a.hidden
    nvl = normal_buffer_bytes(a.nvl_tokens or a.tokens, row, a.ranks)
    need = a.ranks * (nvl + Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, a.ranks, a.experts)
                      + a.experts * a.tokens * row)
    if need > physical_memory():
        ap.error(f"--ranks {a.ranks} --tokens {a.tokens} --hidden {a.hidden} need about {need} bytes, more than "
                 f"this machine's memory ({physical_memory()} bytes)")
    here = os.path.dirname(os.path.abspath(__file__))
    with RankPool(a.ranks, env={"PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}) as pool:
        per_rank = pool.run(bench_rank, a.tokens, a.hidden, a.topk, a.experts, a.iters, a.rounds, a.sync, backends,
                            a.nvl_tokens,
                            timeout_s=1800)
    # bytes a rank receives per dispatch: the mean over ranks (they differ beyond two ranks)
    recv_bytes, ll_bytes = (statistics.mean(r[i] for r in per_rank) for i in (1, 2))
    names = per_rank[0][3]
    # slowest rank of every round, then the median over rounds
    t = {k: statistics.median(max(r[0][k][i] for r in per_rank) for i in range(a.rounds)) for k in per_rank[0][0]}
    print(f"ubep_torch benchmark: {a.ranks} ranks, {a.tokens} tokens/rank, hidden {a.hidden}, top-{a.topk}, "
          f"{a.experts} experts, bf16, sync={a.sync}")
    print(f"  (back-to-back calls: {a.iters} per round, slowest rank, median of {a.rounds} rounds)")
    hdr = (f"{'path':<28}{'dispatch ms':>12}{'combine ms':>12}{'round trip':>12}{'recv MB':>9}"
           f"{'disp GB/s':>11}{'vs naive':>10}")
    print(hdr)
    first = names[0]
    for b in names:
        tag = "" if b == first else f" ({b})"
        rows = [(f"ubep normal{tag}", t[f"{b}:disp"], t[f"{b}:comb"], t[f"{b}:rt"], recv_bytes, t["naive_n"]),
                (f"ubep low_latency{tag}", t[f"{b}:lld"], t[f"{b}:llc"], t[f"{b}:llrt"], ll_bytes, t["naive_l"])]
        for name, d, c, rt, nbytes, naive in rows:
            print(f"{name:<28}{d * 1e3:>12.3f}{c * 1e3:>12.3f}{rt * 1e3:>12.3f}{nbytes / 1e6:>9.2f}"
                  f"{nbytes / d / 1e9:>11.2f}{naive / rt:>9.1f}x")
    print(f"{'ubep normal, new routing':<28}{'':>24}{t['new_routing_rt'] * 1e3:>12.3f}{'':>9}{'':>11}"
          f"{t['naive_n'] / t['new_routing_rt']:>9.1f}x   <- every call: get_dispatch_layout, dispatch, combine")
    print(f"{'naive gloo (rank rows)':<28}{'':>24}{t['naive_n'] * 1e3:>12.3f}{recv_bytes / 1e6:>9.2f}"
          f"{'':>11}{'1.0x':>10}   <- baseline of ubep normal")
    print(f"{'naive gloo (expert rows)':<28}{'':>24}{t['naive_l'] * 1e3:>12.3f}{ll_bytes / 1e6:>9.2f}"
          f"{'':>11}{'1.0x':>10}   <- baseline of ubep low_latency")
    print(f"(untagged ubep rows: the {first!r} engine, from backend={backends[0]!r})")
    # normal mode against the EP that sends one row per (token, expert), as all-to-all token dispatchers
    # without per-rank deduplication do: a second, weaker baseline, printed apart from the strict one
    print(f"ubep normal round trip vs naive gloo (expert rows): {t['naive_l'] / t[f'{first}:rt']:.1f}x")
    print(f"\nphysical references for {recv_bytes / 1e6:.2f} MB (every rank at once)   ms      GB/s   "
          f"normal dispatch / reference")
    disp_bw = recv_bytes / t[f"{first}:disp"] / 1e9
    for name, key in (("plain copy, in cache", "copy"), ("plain copy, 64 MiB buffers", "bigcopy"),
                      ("store to peer + load back", "cross")):
        bw = recv_bytes / t[key] / 1e9
        print(f"  {name:<40}{t[key] * 1e3:>8.3f}{bw:>10.2f}{disp_bw / bw:>12.2f}")
    cross = [max(r[0]["cross"][i] for r in per_rank) * 1e3 for i in range(a.rounds)]
    slow = "  <- rounds several times slower than the others met the slow cross-core level (docs/benchmarks.md)" \
        if max(cross) > 3 * min(cross) else ""
    print(f"  store to peer + load back, round by round (ms): {', '.join(f'{c:.3f}' for c in cross)}{slow}")
    print("\nnormal round trip with plain copies only: the same rows through shared memory and summed, with no "
          "flags,\n  control messages or waits")
    rt = t[f"{first}:rt"]
    for v, how in (("torch", "torch operators"), ("native", "the C data path's copy and sum loops")):
        if f"floor_{v}_rt" in t:
            f = {k: t[f"floor_{v}_{k}"] for k in ("disp", "comb", "rt")}
            print(f"  {how}: dispatch {f['disp'] * 1e3:.3f} ms, combine {f['comb'] * 1e3:.3f} ms, round trip "
                  f"{f['rt'] * 1e3:.3f} ms ({t['naive_n'] / f['rt']:.1f}x naive gloo, rank rows); ubep normal "
                  f"takes {rt / f['rt']:.2f}x as long")
    small = t["small_rt"]
    floor = f" (the C loops' plain-copies round trip: {t['floor_native_rt'] * 1e3:.3f} ms)" \
        if "floor_native_rt" in t else ""
    print(f"\nper-call work: the same normal round trip with rows of hidden {min(a.hidden, SMALL_HIDDEN)} (the "
          f"routing checks, control\n  messages, waits and outputs of every call, with next to no bytes): "
          f"{small * 1e3:.3f} ms; at hidden {a.hidden} the rows add\n  {(rt - small) * 1e3:.3f} ms to it{floor}")
    print_exchange_times([r[5] for r in per_rank])
    print("\nrows into the peers' slots (the C path's stores, native_engine.store_policy), per rank at the end:")
    for r, st in enumerate(r[4] for r in per_rank):
        if not st:
            print(f"  rank {r}: the C module is not built")
            continue
        kinds = "; ".join(f"{name} {k['in_use']} ({k['plain_ns_per_kib']:.0f} / {k['streaming_ns_per_kib']:.0f}"
                          + (f", peers' reads {k['peers_plain_read_ns_per_kib']:.0f} / "
                             f"{k['peers_streaming_read_ns_per_kib']:.0f}"
                             if not name.startswith("ll_") else "") + ")"
                          for name, k in st["kinds"].items())
        print(f"  rank {r}: policy {st['policy']}, sends plain {st['sends']['plain']}, streaming "
              f"{st['sends']['streaming']}; in use (ns per KiB plain / streaming stores, then for normal calls "
              f"what reading this rank's rows stored each way costs its peers; 0: not measured): {kinds}")

if __name__ == "__main__":
    main()
