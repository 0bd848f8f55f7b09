"""DeepEP-style benchmark of ubep_torch on this machine, side by side with a naive gloo EP.

    python benchmarks/bench_buffer.py [--ranks 2 --tokens 128 --hidden 7168 --topk 8 --experts 16]

For each implementation it prints the median time per dispatch and per combine (slowest rank), the
bytes one rank receives per dispatch and the resulting GB/s, and the ratio to the naive EP, which
moves the same rows with ``torch.distributed.all_to_all_single`` over gloo (counts first, then rows).
The physical reference is the bandwidth of a plain tensor copy of the same size, measured on every rank
at the same time (so it sees the same memory contention as the exchange).
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
from ubep_torch.testing import RankPool  # noqa: E402


def _timeit(fn, iters, warmup=2):
    out = []
    for i in range(warmup + iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i >= warmup:
            out.append(dt)
    return out


def _naive_ep(x, topk_idx, E, R):
    """Dispatch + combine with all_to_all_single over gloo (what an EP without a UGAS does)."""
    T = x.shape[0]
    El = E // R
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    valid = topk_idx >= 0
    in_rank[torch.arange(T).unsqueeze(1).expand_as(topk_idx)[valid], (topk_idx[valid] // El)] = True
    dest_rows = [in_rank[:, d].nonzero().squeeze(1) for d in range(R)]
    send_counts = torch.tensor([r.numel() for r in dest_rows], dtype=torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    send = x.index_select(0, torch.cat(dest_rows))
    recv = torch.empty(int(recv_counts.sum()), x.shape[1], dtype=x.dtype)
    dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist())
    back = torch.empty_like(send)
    dist.all_to_all_single(back, recv, send_counts.tolist(), recv_counts.tolist())
    out = torch.zeros(T, x.shape[1], dtype=torch.float32)
    out.index_add_(0, torch.cat(dest_rows), back.float())
    return recv, out.to(x.dtype)


def bench_rank(ctx, T, H, K, E, iters, sync):
    torch.manual_seed(ctx.rank)
    R = ctx.world_size
    x = torch.randn(T, H).bfloat16()
    w, topk = torch.randn(T, E).softmax(-1).topk(K, dim=-1)
    topk = topk.to(torch.int64)
    nvl = Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, R, E)
    buf = Buffer(ctx.group, nvl, rdma, low_latency_mode=True, sync=sync)
    res = {}

    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)
    state = {}

    def disp():
        state["d"] = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                                  topk_idx=topk, topk_weights=w)

    def comb():
        buf.combine(state["d"][0], state["d"][4])
    dts, cts = [], []
    for _ in range(iters + 2):
        dts += _timeit(disp, 1, 0)
        cts += _timeit(comb, 1, 0)
    res["normal"] = (statistics.median(dts[2:]), statistics.median(cts[2:]), state["d"][0].numel() * 2)

    def lld():
        state["l"] = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)

    def llc():
        buf.low_latency_combine(state["l"][0], topk, w, state["l"][2])
    dts, cts = [], []
    for _ in range(iters + 2):
        dts += _timeit(lld, 1, 0)
        cts += _timeit(llc, 1, 0)
    res["low_latency"] = (statistics.median(dts[2:]), statistics.median(cts[2:]), int(state["l"][1].sum()) * H * 2)

    def naive():
        state["n"] = _naive_ep(x, topk, E, R)
    nts = _timeit(naive, iters)
    res["naive_gloo"] = (statistics.median(nts), 0.0, state["n"][0].numel() * 2)

    nbytes = res["normal"][2]
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    cts = _timeit(lambda: dst.copy_(src), iters * 3)
    res["copy"] = (statistics.median(cts), 0.0, nbytes)
    buf.destroy()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sync", default="tff", choices=["tff", "dc", "sp", "sw"])
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    with RankPool(a.ranks, env={"PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}) as pool:
        per_rank = pool.run(bench_rank, a.tokens, a.hidden, a.topk, a.experts, a.iters, a.sync, timeout_s=600)
    res = {k: (max(r[k][0] for r in per_rank), max(r[k][1] for r in per_rank), per_rank[0][k][2])
           for k in per_rank[0]}
    print(f"ubep_torch benchmark: {a.ranks} ranks, {a.tokens} tokens/rank, hidden {a.hidden}, top-{a.topk}, "
          f"{a.experts} experts, bf16, sync={a.sync} (median of {a.iters}, slowest rank)")
    copy_t, _, copy_b = res["copy"]
    copy_bw = copy_b / copy_t / 1e9
    naive_t = res["naive_gloo"][0]
    print(f"{'path':<22}{'dispatch ms':>12}{'combine ms':>12}{'round trip':>12}{'recv MB':>9}"
          f"{'disp GB/s':>11}{'vs naive':>10}{'vs copy':>9}")
    for name in ("normal", "low_latency"):
        d, c, b = res[name]
        bw = b / d / 1e9
        print(f"{'ubep ' + name:<22}{d * 1e3:>12.3f}{c * 1e3:>12.3f}{(d + c) * 1e3:>12.3f}{b / 1e6:>9.2f}"
              f"{bw:>11.2f}{naive_t / (d + c):>9.1f}x{bw / copy_bw:>9.2f}")
    nb = res["naive_gloo"][2]
    print(f"{'naive gloo all_to_all':<22}{'':>12}{'':>12}{naive_t * 1e3:>12.3f}{nb / 1e6:>9.2f}{'':>11}{'1.0x':>10}")
    print(f"{'plain tensor copy':<22}{copy_t * 1e3:>12.3f}{'':>12}{'':>12}{copy_b / 1e6:>9.2f}{copy_bw:>11.2f}"
          f"{'':>10}{1.0:>9.2f}")


if __name__ == "__main__":
    main()
