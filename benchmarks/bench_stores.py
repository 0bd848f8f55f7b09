"""Plain against streaming stores into the peers' slots, in turn in one run, with the placement they met.

    python benchmarks/bench_stores.py [--rounds 6] [--iters 100] [--tokens 128] [--hidden 7168]

On 2 ranks, every round times back-to-back normal round trips (``dispatch`` then ``combine``, 128 tokens
of hidden 7168, top-8 of 16 experts, as ``bench_buffer.py``) under each ``native_engine.store_policy``:
``plain``, ``streaming`` and ``auto`` (which measures both and keeps the cheaper; it starts afresh in every
round and gets a few calls to settle before the timing). Before them, the round probes where the two
ranks' cores sit: each rank stores 2 MiB into the other's shared memory with a plain copy, then loads back
what the other stored, and copies 2 MiB inside its own memory; the three times are printed. On a VM whose
vCPUs are sometimes placed far apart the store switches between two levels for minutes at a time while
the copy inside the process does not, and which stores win switches with it: the round's lines show both.
The slowest rank counts; the last column is what ``auto`` was using at the end of the round (dispatch /
combine).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ubep_torch import Buffer, native_engine  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402
from ubep_torch.ugas import SymmetricHeap  # noqa: E402
from ubep_torch.utils import int_at_least, memory_errors_as_usage_errors  # noqa: E402

POLICIES = ("plain", "streaming", "auto")
PROBE_BYTES = 2 << 20


def _probe(heap: SymmetricHeap, src: torch.Tensor, dst: torch.Tensor, reps: int = 20) -> tuple:
    """Seconds per store of 2 MiB into the peer's memory, per load of the 2 MiB the peer stored into ours,
    and per plain copy of 2 MiB inside this process."""
    peer = heap.peer(1 - dist.get_rank())
    dist.barrier()
    store = load = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        peer[:PROBE_BYTES].copy_(src)
        store += time.perf_counter() - t0
        dist.barrier()          # (the peer's store is complete before this rank loads it)
        t0 = time.perf_counter()
        dst.copy_(heap.local[:PROBE_BYTES])
        load += time.perf_counter() - t0
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    return store / reps, load / reps, (time.perf_counter() - t0) / reps


def bench_rank(ctx, T: int, H: int, rounds: int, iters: int):
    torch.manual_seed(ctx.rank)
    R, K, E = ctx.world_size, 8, 16
    x = torch.randn(T, H).bfloat16()
    w, topk = torch.randn(T, E).softmax(-1).topk(K, dim=-1)
    buf = Buffer(ctx.group, Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R), 0)
    ntpr, _, ntpe, itr, _ = buf.get_dispatch_layout(topk, E)

    def rt():
        d = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=itr, num_tokens_per_expert=ntpe,
                         topk_idx=topk, topk_weights=w)
        return buf.combine(d[0], d[4])

    heap = SymmetricHeap(ctx.group, PROBE_BYTES)
    src = torch.ones(PROBE_BYTES, dtype=torch.uint8)
    dst = torch.empty_like(src)
    out = []
    for _ in range(rounds):
        row = dict(zip(("store", "load", "copy"), _probe(heap, src, dst)))
        for policy in POLICIES:
            native_engine.store_policy(policy)
            for _ in range(20):     # (auto: the first sends of a kind are not measured, then both ways are tried)
                rt()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                rt()
            row[policy] = (time.perf_counter() - t0) / iters
        kinds = native_engine.store_policy()["kinds"]
        row["auto_in_use"] = f"{kinds['dispatch']['in_use']} / {kinds['combine']['in_use']}"
        out.append(row)
    native_engine.store_policy("auto")
    heap.close()
    buf.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int_at_least(1), default=6)
    ap.add_argument("--iters", type=int_at_least(1), default=100)
    ap.add_argument("--tokens", type=int_at_least(1), default=128)
    ap.add_argument("--hidden", type=int_at_least(1), default=7168)
    a = ap.parse_args()
    if not native_engine.available():
        sys.exit("bench_stores.py times the C path's stores: build the C module first (make install)")
    here = os.path.dirname(os.path.abspath(__file__))
    with RankPool(2, env={"PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}) as pool:
        per_rank = pool.run(bench_rank, a.tokens, a.hidden, a.rounds, a.iters, timeout_s=1800)
    print(f"normal round trip (ms), 2 ranks, {a.tokens} tokens, hidden {a.hidden}, top-8 of 16 experts, "
          f"{a.iters} calls per policy and round, slowest rank")
    print("probe (ms per 2 MiB, slowest rank): store into the peer's memory, load what the peer stored, copy "
          "inside the process")
    print(f"{'round':>5}{'store':>8}{'load':>7}{'copy':>7}{'plain':>9}{'streaming':>11}{'auto':>9}   auto in use "
          f"(dispatch / combine)")
    for i in range(a.rounds):
        rows = [r[i] for r in per_rank]
        c = [max(r[k] for r in rows) * 1e3 for k in ("store", "load", "copy") + POLICIES]
        print(f"{i:>5}{c[0]:>8.3f}{c[1]:>7.3f}{c[2]:>7.3f}{c[3]:>9.3f}{c[4]:>11.3f}{c[5]:>9.3f}   "
              f"{rows[0]['auto_in_use']}")


if __name__ == "__main__":
    with memory_errors_as_usage_errors("benchmarks/bench_stores.py"):
        main()
