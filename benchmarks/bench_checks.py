"""A round trip with and without one of the Buffer's shortcuts, in turn in one run.

    python benchmarks/bench_checks.py [--compare checks|tries|ll_steps] [--ranks 2] [--tokens 128]
                                      [--hidden 128,7168] [--blocks 30] [--calls 50]

``--compare checks`` (the default): short against full argument checks. A dispatch of the same form as the
Buffer's last one (dtypes, sizes, arguments given), with the routing the Buffer laid out last, checks its
arguments against that call and that layout in a few comparisons (``Buffer._repeated_dispatch``); a plain
combine of one of the Buffer's recent handles does the same (``Buffer._repeated_combine``). The blocks
without it drop the Buffer's plans before each call, as after a call of another form.

``--compare tries``: the one-step exchanges of new routings whose rows per rank pair repeat (see the README's
protocol paragraph) against the general way that such calls took before (the blocks without them turn off the
Buffer's ``_fresh_tries``). With two ranks and top-8 of 16 experts nearly every token reaches both ranks, so
nearly every new routing sends as many rows per rank pair as the last (with more ranks they change, and the
tries pause). Only new routings are timed: a repeated one takes the one-step exchanges either way.

``--compare ll_steps``: low-latency round trips (``low_latency_dispatch`` then ``low_latency_combine`` of its
rows, bf16, a new routing every call) whose receives take one engine call each (``ll_dispatch_receive``,
``ll_combine_receive``) against the general way (the blocks without them turn off the Buffer's
``_ll_one_step``).

The benchmark times back-to-back round trips (``dispatch`` then ``combine``, or their low-latency pair, top-8
of 16 experts, bf16, as ``bench_buffer.py``) in blocks of ``--calls``, alternating blocks with the shortcut and
blocks without it, so that both see the same phases of a noisy machine. Per hidden size, for one routing
repeated and for a new routing every call (``get_dispatch_layout`` of eight routings in turn, as in training),
it prints the median time per round trip of each kind of block (slowest rank) and the median over the block
pairs of with / without.
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
from ubep_torch.utils import int_at_least, memory_errors_as_usage_errors  # noqa: E402

K, E = 8, 16


def _blocks(buf, x, routes: list, new_routing: bool, blocks: int, calls: int, compare: str) -> dict:
    """Seconds per round trip of every block: {False: blocks with the shortcut, True: blocks without it}."""
    turn = [0]
    layout = None if compare == "ll_steps" else buf.get_dispatch_layout(routes[0][1], E)

    def rt(without: bool):
        w, topk = routes[turn[0] % len(routes)]
        if compare == "ll_steps":
            turn[0] += 1
            buf._ll_one_step = not without
            T = x.shape[0]
            ll = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
            return buf.low_latency_combine(ll[0], topk, w, ll[2])
        ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E) if new_routing else layout
        if new_routing:
            turn[0] += 1
        full = without and compare == "checks"
        buf._fresh_tries = not (without and compare == "tries")
        if full:
            buf._dispatch_plan = buf._combine_plan = None
        d = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                         topk_idx=topk, topk_weights=w)
        if full:
            buf._combine_plan = None
        return buf.combine(d[0], d[4])

    for _ in range(20):
        rt(False)
        rt(True)
    times = {False: [], True: []}
    for b in range(2 * blocks):
        without = b % 2 == 1
        rt(without)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            rt(without)
        times[without].append((time.perf_counter() - t0) / calls)
    return times


def bench_rank(ctx, T: int, hiddens: list, blocks: int, calls: int, compare: str) -> dict:
    torch.manual_seed(ctx.rank)
    R = ctx.world_size
    routes = [torch.randn(T, E).softmax(-1).topk(K, dim=-1) for _ in range(8)]
    out = {}
    for H in hiddens:
        x = torch.randn(T, H).bfloat16()
        if compare == "ll_steps":
            buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(T, H, R, E), low_latency_mode=True)
        else:
            buf = Buffer(ctx.group, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R), 0)
        for new_routing in (False, True) if compare == "checks" else (True,):
            out[H, new_routing] = _blocks(buf, x, routes, new_routing, blocks, calls, compare)
        buf.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", choices=("checks", "tries", "ll_steps"), default="checks",
                    help="checks: short against full argument checks; tries: one-step exchanges of new routings; "
                         "ll_steps: low-latency receives in one engine call")
    ap.add_argument("--ranks", type=int_at_least(1), default=2)
    ap.add_argument("--tokens", type=int_at_least(1), default=128)
    ap.add_argument("--hidden", default="128,7168", help="comma-separated hidden sizes, each timed in turn")
    ap.add_argument("--blocks", type=int_at_least(1), default=30, help="block pairs (with, then without) per case")
    ap.add_argument("--calls", type=int_at_least(1), default=50, help="round trips per block")
    a = ap.parse_args()
    try:
        hiddens = [int(h) for h in a.hidden.split(",") if h]
    except ValueError:
        ap.error(f"--hidden {a.hidden!r}: comma-separated positive integers")
    if not hiddens or min(hiddens) < 1:
        ap.error(f"--hidden {a.hidden!r}: comma-separated positive integers")
    if E % a.ranks:
        ap.error(f"--ranks {a.ranks}: the benchmark's {E} experts must split evenly over the ranks")
    here = os.path.dirname(os.path.abspath(__file__))
    with RankPool(a.ranks, env={"PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}) as pool:
        per_rank = pool.run(bench_rank, a.tokens, hiddens, a.blocks, a.calls, a.compare, timeout_s=1800)
    what = {"checks": "normal round trip, short against full argument checks",
            "tries": "normal round trip, with against without the one-step exchanges of new routings",
            "ll_steps": "low-latency round trip, with against without the one-step receives"}[a.compare]
    print(f"{what}: {a.ranks} ranks, {a.tokens} tokens, top-{K} of {E} experts, bf16; "
          f"{a.blocks} block pairs of {a.calls} calls, slowest rank")
    print(f"{'hidden':>7}  {'routing':<22}{'with us':>10}{'without us':>12}{'with / without (min-max)':>28}")
    for key in per_rank[0]:
        H, new_routing = key
        with_, without = ([max(r[key][f][i] for r in per_rank) for i in range(a.blocks)] for f in (False, True))
        ratios = [s / f for s, f in zip(with_, without)]
        print(f"{H:>7}  {'new every call' if new_routing else 'one, repeated':<22}"
              f"{statistics.median(with_) * 1e6:>10.1f}{statistics.median(without) * 1e6:>12.1f}"
              f"{statistics.median(ratios):>14.3f} ({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    with memory_errors_as_usage_errors("benchmarks/bench_checks.py"):
        main()
