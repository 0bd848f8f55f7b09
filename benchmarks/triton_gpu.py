"""ubep_torch's Triton kernels compiled for a CUDA GPU, checked against the torch path, in one process.

    python benchmarks/triton_gpu.py                  # needs a CUDA device: kernels compiled for it
    python benchmarks/triton_gpu.py --device cpu     # the same checks, kernels under the interpreter

A Buffer keeps its UGAS heap in host shared memory, which compiled GPU kernels cannot address, so
``Buffer(backend="triton")`` always runs its kernels under the Triton interpreter (docs/kernels.md). This
script compiles the same kernel sources for the GPU instead: it loads ``kernels/`` under a package name of
its own, without the interpreter, points the engine's launchers (``ubep_torch.triton_engine``) at those
modules, and runs every kernel on GPU tensors that play the memories of several ranks. Each check builds
its inputs on the CPU, runs the torch path there as the reference, runs the kernel on copies on the
device, and compares every output and every byte written, bit for bit:

* the mapper: quaternary search, expert remapping by transposition and the AIVs' slices;
* the send phase (token and count groups, TFF / DC / SP / SW blocks) into three peers' memories;
* the pollers and Token-Reordering out of arrived blocks;
* the combine reductions (``index_add`` of arrived rows, the weighted low-latency sum);
* the decomposed low-latency receive: CalCumSum programs publish offsets, reorder programs wait for them.

It prints one line per check: pass or the first difference, the median wall time of ``--iters`` launches
after the first (launcher included, synchronised after each; the first launch compiles), and on a GPU the
device time of the Triton kernels of one more launch (CUDA profiler). Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
import traceback
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the kernel unit tests' cases: the same inputs, run compiled here
from tests.test_triton_kernels import ll_receive_case, send_job_case  # noqa: E402
from ubep_torch import mapper as M  # noqa: E402
from ubep_torch import protocol as P  # noqa: E402
from ubep_torch import triton_engine as TE  # noqa: E402
from ubep_torch.engine import TorchEngine  # noqa: E402


def load_kernels(interpret: bool, rmw_acquire: bool = False) -> None:
    """Define ``kernels/`` again as the package ``ubep_kernels_<mode>`` (its ``__init__`` not run, so the
    interpreter is not forced) and make the engine's launchers use it. ``rmw_acquire``: define them as
    with a Triton release that lacks ``tl.atomic_load`` (acquire loads as atomic adds of 0)."""
    import triton.language as tl
    name = "ubep_kernels_interpreted" if interpret else "ubep_kernels_compiled"
    hidden = tl.__dict__.pop("atomic_load", None) if rmw_acquire else None
    for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[m]
    pkg = types.ModuleType(name)
    pkg.__path__ = [os.path.join(ROOT, "kernels")]
    sys.modules[name] = pkg
    prev = os.environ.pop("TRITON_INTERPRET", None)
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        mods = [importlib.import_module(f"{name}.{m}") for m in ("data_as_flag", "dispatch", "combine", "mapper")]
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if prev is not None:
            os.environ["TRITON_INTERPRET"] = prev
        if hidden is not None:
            tl.atomic_load = hidden
    TE.daf, TE.kdispatch, TE.kcombine, TE.kmapper = mods


class Checks:
    def __init__(self, device: str, iters: int):
        self.dev = torch.device(device)
        self.iters = iters
        self.failed = 0

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def on_device(self, fn):
        """Run ``fn`` with new tensors allocated on the device (the launchers' scratch tensors)."""
        with torch.device(self.dev):
            out = fn()
        self.sync()
        return out

    def time(self, fn) -> tuple:
        """``(wall, kernels)``: the median wall microseconds of ``iters`` more runs of ``fn`` (launchers
        included, synchronised), and on a GPU the device microseconds of the Triton kernels of one more run
        (CUDA profiler: every kernel named ``*_kernel``, summed)."""
        ts = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            self.on_device(fn)
            ts.append(time.perf_counter() - t0)
        wall = statistics.median(ts) * 1e6 if ts else float("nan")
        if self.dev.type != "cuda" or not self.iters:
            return wall, float("nan")
        import warnings

        from torch.profiler import ProfilerActivity, profile
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")      # (the profiler's notes on its own event cycles)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    self.on_device(fn)
                ours = [e for e in prof.key_averages() if e.key.endswith("_kernel")]
        except Exception:  # noqa: BLE001 - no profiler here: the wall time stands alone
            return wall, float("nan")
        return wall, sum(getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0) for e in ours) \
            if ours else float("nan")

    def run(self, name: str, check) -> None:
        try:
            problem, us = check()
        except Exception:  # noqa: BLE001 - a failing check is reported, the others still run
            problem, us = "raised:\n" + traceback.format_exc(limit=4), float("nan")
        if problem:
            self.failed += 1
        wall, kern = us if isinstance(us, tuple) else (us, float("nan"))
        status = "FAIL " + problem if problem else "pass"
        print(f"{name:<48} {wall:>10.1f} {kern:>10.1f}   {status}", flush=True)

    def d(self, t):
        return None if t is None else t.to(self.dev)


def _diff(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    got = got.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if torch.equal(got, want):
        return ""
    a, b = got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
    i = int((a != b).nonzero()[0])
    return f"{name}: byte {i} is {int(a[i])}, torch path {int(b[i])}"


# ----------------------------------------------------------------------------- mapper
def check_quaternary(c: Checks, E: int, m: int):
    g = torch.Generator().manual_seed(E)
    counts = torch.randint(0, 4, (E,), generator=g)
    counts[0] += 1
    cum = torch.cumsum(counts, 0)
    t = torch.randint(-1, int(cum[-1]) + 2, (m,), generator=g)     # (out-of-range targets included)
    ref_idx, ref_steps = M.quaternary_search(cum, t)
    idx, steps = c.on_device(lambda: TE.quaternary_search(c.d(cum), c.d(t)))
    ok = (t >= 0) & (t < cum[-1])
    problem = _diff("index", idx, ref_idx) or _diff("steps", steps, ref_steps) or \
        _diff("vs searchsorted", idx.cpu()[ok], torch.searchsorted(cum, t[ok], right=True))
    return problem, c.time(lambda: TE.quaternary_search(c.d(cum), c.d(t)))


def check_mapper(c: Checks, mapping: bool):
    g = torch.Generator().manual_seed(1)
    E, n = 40, 7
    hop = torch.randint(0, 4, (E,), generator=g)
    topk = torch.randint(-1, E, (50, 4), generator=g)
    ref = M.map_tokens_to_aivs(topk, E, n, hop, mapping)
    order = c.on_device(lambda: TE.remap_experts(E, c.d(hop), mapping))
    problem = _diff("order", order, ref.order)
    cum = torch.cumsum(ref.counts[ref.order], 0)
    got = c.on_device(lambda: TE.aiv_slices(c.d(cum), n, mapping))
    for k in ("slice_start_pos", "slice_start_offset", "search_steps", "loads", "slice_bounds"):
        problem = problem or _diff(k, got[k], getattr(ref, k))
    return problem, c.time(lambda: TE.aiv_slices(c.d(cum), n, mapping))


# ----------------------------------------------------------------------------- send phase, pollers
def check_send(c: Checks, sync: str, T: int, H: int, R: int, n_aivs: int):
    build, shape, fmt, _ = send_job_case(sync, T, H, R)
    ref = torch.zeros(shape, dtype=torch.uint8)
    TorchEngine().send_phase(build(ref))
    mem = torch.zeros(shape, dtype=torch.uint8, device=c.dev)
    job = build(mem, c.d)
    eng = TE.TritonEngine(n_aivs=n_aivs)
    c.on_device(lambda: eng.send_phase(job))
    return _diff("peer memory", mem, ref), c.time(lambda: eng.send_phase(job))


def check_poll_unpack(c: Checks, sync: str, T: int, H: int):
    build, shape, fmt, (x, sc, meta, sels, flag) = send_job_case(sync, T, H, seed=4)
    mem = torch.zeros(shape, dtype=torch.uint8, device=c.dev)
    job = build(mem, c.d)
    eng = TE.TritonEngine(n_aivs=4)
    d = next(i for i in range(len(sels)) if sels[i].numel())
    dst, n = job.dests[d], int(sels[d].numel())
    rows = dst.rows[:n]
    expected = int(P.wrapping_sum(job.row_sums.cpu().index_select(0, sels[d]))) if sync == "dc" else 0
    before = c.on_device(lambda: (eng.ctrl_arrived(dst.ctrl, flag), eng.rows_arrived(fmt, rows, flag, expected)))
    if before[0] or (before[1] and (sync != "dc" or expected != 0)):
        return f"arrival seen before anything was sent: {before}", float("nan")
    c.on_device(lambda: eng.send_phase(job))
    after = c.on_device(lambda: (eng.ctrl_arrived(dst.ctrl, flag), eng.rows_arrived(fmt, rows, flag, expected)))
    if not all(after):
        return f"arrival not seen after the send: {after}", float("nan")
    t_poll = c.time(lambda: eng.rows_arrived(fmt, rows, flag, expected))
    ox = torch.empty(n, H, dtype=torch.bfloat16, device=c.dev)
    osc = torch.empty(n, 3, device=c.dev)
    got_meta = c.on_device(lambda: eng.unpack_rows(fmt, rows, [P.as_bytes(ox), P.as_bytes(osc)]))
    problem = _diff("x", ox, x[sels[d]]) or _diff("scales", osc, sc[sels[d]]) or \
        _diff("meta 0", got_meta[:, 0], torch.arange(n, dtype=torch.int32) + 40) or \
        _diff("meta 1", got_meta[:, 1], meta[sels[d], 1])
    return problem, t_poll


# ----------------------------------------------------------------------------- combine
def _arrived_rows(fmt: P.RowFormat, x: torch.Tensor, meta, flag: int) -> torch.Tensor:
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], meta, torch.arange(x.shape[0]), 0)
    rows = torch.zeros(x.shape[0], fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, flag)
    return rows


def check_combine_accumulate(c: Checks, sync: str, T: int, H: int, n: int):
    g = torch.Generator().manual_seed(5)
    K = 3
    fmt = P.RowFormat(sync, (("x", H * 2),), K)
    x = torch.randn(n, H, generator=g).bfloat16()
    x[1] = 0
    w = torch.rand(n, K, generator=g)
    rows = _arrived_rows(fmt, x, w.view(torch.int32), P.flag_word(1, P.REGION_COMBINE))
    idx = torch.randperm(T, generator=g)[:n]        # one row per token, as from one source
    acc0, w0 = torch.randn(T, H, generator=g), torch.randn(T, K, generator=g)
    ref, wref = acc0.clone(), w0.clone()
    ref.index_add_(0, idx, x.float())
    wref.index_add_(0, idx, w)
    got, wgot = c.d(acc0), c.d(w0)
    drows, didx = c.d(rows), c.d(idx)
    eng = TE.TritonEngine()
    c.on_device(lambda: eng.combine_accumulate(fmt, drows, didx, got, torch.bfloat16, wgot))
    # (sums of floats in another order round differently: the kernel adds each source's rows in row order,
    # as index_add_ does on the CPU)
    problem = _diff("acc", got, ref) or _diff("weights", wgot, wref)
    return problem, c.time(lambda: eng.combine_accumulate(fmt, drows, didx, got, torch.bfloat16, wgot))


def check_weighted_combine(c: Checks, T: int, H: int, K: int):
    g = torch.Generator().manual_seed(6)
    fmt = P.RowFormat("tff", (("x", H * 2),), 0)
    topk = torch.randint(-1, 8, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    tmp = torch.randn(T * K, H, generator=g).bfloat16()
    rows = _arrived_rows(fmt, tmp, None, 1)
    valid = topk >= 0
    ww = torch.where(valid, w, torch.zeros_like(w))
    ref = (torch.where(valid.view(-1, 1), tmp, torch.zeros_like(tmp)).view(T, K, H).float()
           * ww.unsqueeze(-1)).sum(1).bfloat16()
    out = torch.empty(T, H, dtype=torch.bfloat16, device=c.dev)
    drows, dtopk, dw = c.d(rows), c.d(topk), c.d(w)
    eng = TE.TritonEngine()
    c.on_device(lambda: eng.weighted_combine(fmt, drows, dtopk, dw, out))
    return _diff("combined", out, ref), c.time(lambda: eng.weighted_combine(fmt, drows, dtopk, dw, out))


# ----------------------------------------------------------------------------- low-latency receive
def check_ll_receive(c: Checks, sync: str):
    fmt, flag, ctrls, rowsv, cnt, begin, ref = ll_receive_case(sync)
    El = cnt.shape[1]
    ctrls, rowsv = [c.d(t) for t in ctrls], [c.d(t) for t in rowsv]
    out = torch.zeros_like(ref, device=c.dev)
    eng = TE.TritonEngine(n_aivs=8)
    sig = c.on_device(lambda: eng.ll_receive(fmt, ctrls, rowsv, flag, El, out, n_count=2))
    problem = _diff("begin", sig[:, :El], begin) or _diff("counts", sig[:, El:2 * El], cnt) or \
        _diff("recv_x", out, ref)
    return problem, c.time(lambda: eng.ll_receive(fmt, ctrls, rowsv, flag, El, out, n_count=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (kernels compiled for it) or cpu (interpreted)")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed launches per check after the first (default 20 on a GPU, 2 interpreted)")
    ap.add_argument("--small", action="store_true", help="small sizes only (the interpreter is slow)")
    ap.add_argument("--rmw-acquire", action="store_true",
                    help="define the kernels as with a Triton release that lacks tl.atomic_load")
    a = ap.parse_args()
    if a.device not in ("cuda", "cpu"):
        ap.error("--device must be cuda or cpu")
    if a.iters is None:
        a.iters = 20 if a.device == "cuda" else 2
    if a.iters < 0:
        ap.error("--iters must be >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu for the interpreted kernels", file=sys.stderr)
        return 2
    load_kernels(interpret=a.device == "cpu", rmw_acquire=a.rmw_acquire)
    import triton
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(f"ubep_torch Triton kernels on {where} ({'compiled' if a.device == 'cuda' else 'interpreted'}), "
          f"triton {triton.__version__}, torch {torch.__version__}")
    if a.device == "cpu" and not a.small:
        print(f"(interpreted: a launch of the large checks takes seconds, so this run takes minutes; --small "
              f"takes well under a minute; {a.iters} timed launches per check)", flush=True)
    elif a.device == "cpu":
        print(f"(interpreted, small checks: well under a minute; {a.iters} timed launches per check)", flush=True)
    print(f"{'check':<48} {'wall us':>10} {'kernel us':>10}   result")
    c = Checks(a.device, a.iters)
    big = not a.small
    m = 4096 if big else 64
    c.run(f"quaternary search, 300 experts, {m} targets", lambda: check_quaternary(c, 300, m))
    for mapping in (True, False):
        c.run(f"remap + AIV slices (mapping={mapping})", lambda m=mapping: check_mapper(c, m))
    for sync in ("tff", "dc", "sp", "sw"):
        c.run(f"send phase {sync}, <=6 rows x 300 to 3 peers", lambda s=sync: check_send(c, s, 6, 300, 3, 4))
    if big:
        for sync in ("tff", "sp"):
            c.run(f"send phase {sync}, <=128 rows x 7168 to 2 peers, 48 AIVs",
                  lambda s=sync: check_send(c, s, 128, 7168, 2, 48))
    for sync in ("tff", "dc", "sp"):
        c.run(f"poll + Token-Reordering {sync}", lambda s=sync: check_poll_unpack(c, s, 6, 300))
    for sync in ("tff", "sp"):
        c.run(f"combine accumulate {sync}, 4 rows", lambda s=sync: check_combine_accumulate(c, s, 6, 272, 4))
    if big:
        c.run("combine accumulate tff, 128 rows x 7168",
              lambda: check_combine_accumulate(c, "tff", 128, 7168, 128))
    c.run("weighted combine, 5 tokens x 3", lambda: check_weighted_combine(c, 5, 256, 3))
    if big:
        c.run("weighted combine, 128 tokens x 8 x 7168", lambda: check_weighted_combine(c, 128, 7168, 8))
    for sync in ("tff", "sp"):
        c.run(f"low-latency receive {sync} (CalCumSum + reorder)",
              lambda s=sync: check_ll_receive(c, s))
    print(f"{c.failed} check(s) failed" if c.failed else "every check passed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
