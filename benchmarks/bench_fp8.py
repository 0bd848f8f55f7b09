"""fp8 rows: the per-128-channel e4m3 quantization and its inverse, and low-latency dispatch with and without it.

Prints, side by side in one run: ``per_token_cast_to_fp8``, ``low_latency_cast_to_fp8`` and
``per_token_cast_back`` through the C module's one-pass loops and through torch operators (the fallback where
the C module was not built; both give the same bits), on one core; then ``low_latency_dispatch`` on 2 ranks
with bf16 rows, with ``use_fp8=True`` (DeepEP's default: the tokens are quantized, then half as many bytes
travel), and with ``use_fp8=True`` quantizing through torch operators, in turn. Times are medians.

    python benchmarks/bench_fp8.py [--tokens 128] [--hidden 7168] [--iters 20]
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ubep_torch.fp8 as fp8  # noqa: E402
from ubep_torch import Buffer, native_engine  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402
from ubep_torch.utils import env_flag, int_at_least, memory_errors_as_usage_errors  # noqa: E402


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _torch_only(fn):
    def run():
        saved = fp8._native_module
        fp8._native_module = lambda: None
        try:
            return fn()
        finally:
            fp8._native_module = saved
    return run


def ll_dispatch(ctx, T: int, H: int, iters: int, K: int = 8, E: int = 16) -> dict:
    """Median ms of ``low_latency_dispatch`` with bf16 rows, with fp8 rows, and with fp8 rows quantized by
    torch operators (the C pass switched off), the three in turn."""
    torch.manual_seed(ctx.rank)
    x = torch.randn(T, H).bfloat16()
    _, topk = torch.randn(T, E).topk(K, dim=-1)
    modes = ("bf16", "fp8", "fp8, torch quantization")
    out = {m: [] for m in modes}
    with Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(T, H, ctx.world_size, E),
                low_latency_mode=True) as buf:
        for rnd in range(3 * (iters + 2)):
            mode = modes[rnd % 3]
            call = functools.partial(buf.low_latency_dispatch, x, topk, T, E, use_fp8=mode != "bf16")
            if mode == "fp8, torch quantization":
                call = _torch_only(call)
            t0 = time.perf_counter()
            call()
            if rnd >= 6:
                out[mode].append(time.perf_counter() - t0)
    return {m: statistics.median(v) * 1e3 for m, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int_at_least(1), default=128)
    ap.add_argument("--hidden", type=int_at_least(128), default=7168)
    ap.add_argument("--iters", type=int_at_least(1), default=20)
    a = ap.parse_args()
    if a.hidden % 128:
        raise SystemExit("--hidden must be a multiple of 128")
    torch.set_num_threads(1)
    T, H = a.tokens, a.hidden
    x = torch.randn(T, H).bfloat16()
    q, sc = fp8.per_token_cast_to_fp8(x)
    print(f"ubep_torch fp8 benchmark: {T} tokens, hidden {H}, bf16 in; one core, median of {a.iters}")
    print(f"{'step':<28}{'C ms':>10}{'torch ms':>12}{'torch / C':>12}")
    steps = (("per_token_cast_to_fp8", lambda: fp8.per_token_cast_to_fp8(x)),
             ("low_latency_cast_to_fp8", lambda: fp8.low_latency_cast_to_fp8(x)),
             ("per_token_cast_back", lambda: fp8.per_token_cast_back(q, sc)))
    have_c = native_engine.available() and env_flag("UBEP_NATIVE", True)
    for name, fn in steps:
        t_torch = _median_ms(_torch_only(fn), a.iters)
        if have_c:
            t_c = _median_ms(fn, a.iters)
            print(f"{name:<28}{t_c:>10.3f}{t_torch:>12.3f}{t_torch / t_c:>11.1f}x")
        else:
            print(f"{name:<28}{'-':>10}{t_torch:>12.3f}   (the C module was not built)")
    with RankPool(2) as pool:
        res = pool.run(ll_dispatch, T, H, a.iters)
    slow = {m: max(r[m] for r in res) for m in res[0]}
    print("\nlow_latency_dispatch, 2 ranks, top-8 of 16 experts, slowest rank:")
    for mode, ms in slow.items():
        print(f"  {mode:<28}{ms:>8.3f} ms  ({ms / slow['bf16']:.2f}x bf16)")


if __name__ == "__main__":
    with memory_errors_as_usage_errors("benchmarks/bench_fp8.py"):
        main()
