"""Multi-rank demo: dispatch and combine through the simulated UGAS, normal and low-latency mode.

    torchrun --standalone --nproc-per-node 4 examples/demo.py [--tokens 128 --hidden 2048 --topk 8]

Every rank routes its tokens to top-k experts, dispatches them, runs identity experts, combines them back
and checks the result against plain torch; rank 0 prints what moved and how long it took, plus the
modeled CloudMatrix384 latency of the same call (UBEP against the CANN EP baseline).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from ubep_torch import Buffer
from ubep_torch import protocol as P
from ubep_torch.utils import int_at_least, require_torchrun


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int_at_least(1), default=128, help="tokens per rank")
    ap.add_argument("--hidden", type=int_at_least(1), default=2048)
    ap.add_argument("--topk", type=int_at_least(1), default=None,
                    help="experts per token (default: 8, or every expert when there are fewer)")
    ap.add_argument("--experts-per-rank", type=int_at_least(1), default=4)
    ap.add_argument("--sync", default="tff", choices=["tff", "dc", "sp", "sw"])
    ap.add_argument("--iters", type=int_at_least(1), default=5)
    args = ap.parse_args()

    require_torchrun("examples/demo.py")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H = args.tokens, args.hidden
    E = args.experts_per_rank * world
    K = min(8, E) if args.topk is None else args.topk
    if K > E:
        ap.error(f"--topk {K} exceeds the {E} experts ({args.experts_per_rank} per rank x {world} ranks)")
    if args.experts_per_rank > P.MAX_CTRL_COUNTS - world - 1:     # (one control message counts them)
        ap.error(f"--experts-per-rank {args.experts_per_rank}: at most {P.MAX_CTRL_COUNTS - world - 1} with "
                 f"{world} ranks")
    try:
        from ubep_torch.cost_model import CostModel, format_report
        cost_model = CostModel()
    except ImportError:  # the cost model is optional
        cost_model, format_report = None, None

    rdma = Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = Buffer(dist.group.WORLD, Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world),
                 rdma, low_latency_mode=True, sync=args.sync, cost_model=cost_model)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    scores = torch.randn(T, E, generator=g)
    topk_w, topk_idx = scores.softmax(-1).topk(K, dim=-1)
    topk_idx = topk_idx.to(torch.int64)

    # ---- normal mode
    times = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk_idx, E)
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe, topk_idx=topk_idx,
            topk_weights=topk_w)
        t1 = time.perf_counter()
        disp_report = buf.last_report
        combined, _, _ = buf.combine(recv_x, handle)
        t2 = time.perf_counter()
        times.append((t1 - t0, t2 - t1))
    comb_report = buf.last_report
    expect = x.float() * itr.sum(1, keepdim=True)
    ok_normal = torch.allclose(combined.float(), expect, rtol=2e-2, atol=2e-2)
    moved = recv_x.numel() * recv_x.element_size()

    # ---- low-latency mode
    ll_times = []
    for _ in range(args.iters):
        dist.barrier()
        t0 = time.perf_counter()
        rx, rcount, llh, _, _ = buf.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        t1 = time.perf_counter()
        out, _, _ = buf.low_latency_combine(rx, topk_idx, topk_w, llh)
        t2 = time.perf_counter()
        ll_times.append((t1 - t0, t2 - t1))
    ok_ll = torch.allclose(out.float(), x.float() * topk_w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    ll_moved = int(rcount.sum()) * H * 2

    oks = [None] * world
    dist.all_gather_object(oks, (bool(ok_normal), bool(ok_ll), moved, ll_moved))
    if rank == 0:
        best = min(a + b for a, b in times[1:] or times)
        d, c = min(times[1:] or times, key=lambda p: p[0] + p[1])
        lld, llc = min(ll_times[1:] or ll_times, key=lambda p: p[0] + p[1])
        print(f"ubep_torch demo: {world} rank{'s' if world > 1 else ''}, {T} tokens/rank, hidden {H}, top-{K}, "
              f"{E} experts, sync={args.sync}, engine {buf.backend}")
        print(f"  normal mode : dispatch {d * 1e3:7.3f} ms, combine {c * 1e3:7.3f} ms; rank 0 received "
              f"{moved / 1e6:.2f} MB ({moved / d / 1e9:.2f} GB/s); round trip {best * 1e3:.3f} ms")
        print(f"  low-latency : dispatch {lld * 1e3:7.3f} ms, combine {llc * 1e3:7.3f} ms; rank 0 received "
              f"{ll_moved / 1e6:.2f} MB")
        print(f"  results correct on every rank: normal {all(o[0] for o in oks)}, low-latency {all(o[1] for o in oks)}")
        if disp_report is not None and format_report is not None:
            print("  modeled CloudMatrix384 latency of rank 0's calls (same routing, UBEP vs CANN EP; the model "
                  "moves one row per (token, expert), as the paper's kernels do, where this Buffer's normal mode "
                  "sends one per (token, rank)):")
            for rep in (disp_report, comb_report):
                print("   ", format_report(rep).replace("\n", "\n    "))
    buf.destroy()
    dist.barrier()   # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    if not (ok_normal and ok_ll):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
