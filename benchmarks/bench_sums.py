"""The normal combine's reduction on one core: every token's bf16 rows summed, its own rank's rows from a tensor
and each peer's rows from TFF slots (512 B blocks, 32 B flag each), as in a combine of ``--peers`` + 1 ranks.

Prints, side by side in one run, the C path with its pair loops (two bf16 elements a 32-bit word: the sums a
Buffer's combines make), the C path with its element loops (the reference form of the same sums), the torch
path, and ``torch.add`` of the own rows and the first peer's as plain tensors (no slots), with the rows in cache
and with the cache flushed before each call (the combine reads rows a peer has just written).

    python benchmarks/bench_sums.py [--tokens 128] [--hidden 7168] [--peers 1] [--iters 50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ubep_torch import native_engine  # noqa: E402
from ubep_torch import protocol as P  # noqa: E402
from ubep_torch.engine import TorchEngine  # noqa: E402
from ubep_torch.utils import int_at_least, memory_errors_as_usage_errors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int_at_least(1), default=128)
    ap.add_argument("--hidden", type=int_at_least(1), default=7168)
    ap.add_argument("--peers", type=int_at_least(1), default=1)
    ap.add_argument("--iters", type=int_at_least(1), default=50)
    a = ap.parse_args()
    torch.set_num_threads(1)
    T, H = a.tokens, a.hidden
    fmt = P.row_format("tff", (("x", H * 2),), 0)
    own = torch.randn(T, H).to(torch.bfloat16)
    peer = torch.randn(T, H).to(torch.bfloat16)
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(peer)], None, torch.arange(T), 1)
    slots = torch.zeros_like(staging)
    TorchEngine().write_rows(fmt, staging, checked, None, slots, P.flag_word(1, P.REGION_COMBINE))
    tok = torch.arange(T)
    sources = [(own, tok)] + [(slots, tok)] * a.peers
    out = torch.empty(T, H, dtype=torch.bfloat16)
    flush = torch.empty(64 << 20, dtype=torch.uint8)

    paths = {"torch.add (plain tensors)": lambda: torch.add(own, peer, out=out),
             "torch path (slots)": lambda: TorchEngine().reduce_sources(fmt, sources, out)}
    native = native_engine.available()
    if native:
        from ubep_torch import _native

        def c_path(pairs):
            def run():
                _native.use_pair_sums(pairs)
                native_engine.NativeEngine().reduce_sources(fmt, sources, out)
            return run
        paths["C path, pair loops"] = c_path(True)
        paths["C path, element loops"] = c_path(False)
    want = torch.zeros(T, H, dtype=torch.bfloat16)
    TorchEngine().reduce_sources(fmt, sources, want)
    for name, f in paths.items():   # every path must give the torch path's bits before it is timed
        out.fill_(0)
        f()
        if name != "torch.add (plain tensors)" and not torch.equal(out.view(torch.int16), want.view(torch.int16)):
            raise SystemExit(f"{name} gave different bits from the torch path")

    def median_us(f, cold):
        ts = []
        for _ in range(a.iters):
            if cold:
                flush.add_(1)
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    nbytes = (a.peers + 2) * T * H * 2   # the operands read, the sum written
    peers = f"{a.peers} peer" + ("s" if a.peers > 1 else "")
    print(f"bf16 sum of {T} rows x {H} (own rows and the slots of {peers}), one thread, median of {a.iters} calls"
          + ("" if native else "  (C path not built: only the torch rows)"))
    res = {name: (median_us(f, False), median_us(f, True)) for name, f in paths.items()}
    ref = res["torch.add (plain tensors)"]
    print(f"{'path':<28}{'in cache us':>12}{'GB/s':>8}{'vs add':>8}{'flushed us':>12}{'GB/s':>8}{'vs add':>8}")
    for name, (hot, cold) in res.items():
        print(f"{name:<28}{hot:>12.1f}{nbytes / hot / 1e3:>8.2f}{ref[0] / hot:>7.2f}x"
              f"{cold:>12.1f}{nbytes / cold / 1e3:>8.2f}{ref[1] / cold:>7.2f}x")
    if native:
        _native.use_pair_sums(True)


if __name__ == "__main__":
    with memory_errors_as_usage_errors("benchmarks/bench_sums.py"):
        main()
