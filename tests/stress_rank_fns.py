"""Randomized back-to-back calls with injected stragglers, checked bit for bit against a local reference.

``stress(ctx, seed, calls, ...)`` runs inside RankPool workers. Every choice that must agree between ranks
(operation, buffer, hidden size, dtype, top-k, experts, layout, fp8, hooks) comes from a generator seeded
by ``(seed, step)`` alone; every rank's inputs come from a generator seeded by ``(seed, step, rank)``, so
each rank rebuilds all peers' inputs and computes its reference with plain torch and no communication.
Expert outputs are elementwise functions of the received rows that the reference can recompute on the
sending side, so combine results are compared exactly too.

Two Buffers on two process groups are used in random alternation: ``A`` (normal mode, WORLD) and ``B``
(normal + low-latency mode, a second group over the same ranks), with different sync modes. The
``delay_hook`` of both sleeps a random time before a random fraction of the protocol waits.
"""
from __future__ import annotations

import hashlib
import random
import time
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from ubep_torch import Buffer
from ubep_torch.buffer import normal_buffer_bytes
from ubep_torch.fp8 import low_latency_cast_to_fp8
from ubep_torch.protocol import fresh

N_LL = 16          # num_max_dispatch_tokens_per_rank of the low-latency calls
H_MAX = 256
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- inputs
def _gen(*key) -> torch.Generator:
    h = int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)
    return torch.Generator().manual_seed(h)


def routing(g: torch.Generator, T: int, K: int, E: int, mode: str) -> torch.Tensor:
    """[T, K] int64 ids, distinct per token: uniform, hot experts, -1 masks, or every slot -1."""
    if K == 0:
        return torch.zeros(T, 0, dtype=torch.int64)
    scores = torch.rand(T, E, generator=g)
    if mode == "hot":
        hot = torch.randint(0, E, (2,), generator=g)
        scores[:, hot] += (torch.rand(T, 1, generator=g) < 0.9).float() * 10
    topk = scores.topk(K, dim=1).indices.to(torch.int64)
    if mode in ("masked", "hot"):
        topk = topk.masked_fill(torch.rand(T, K, generator=g) < (0.3 if mode == "masked" else 0.1), -1)
        if T:
            topk[torch.rand(T, generator=g) < 0.15] = -1       # some tokens with every slot masked
    elif mode == "all_masked":
        topk.fill_(-1)
    return topk


def call_inputs(seed: int, step: int, rank: int, p: dict):
    g = _gen(seed, step, rank, "in")
    T = p["T"][rank]
    topk = routing(g, T, p["K"], p["E"], p["mode"])
    w = torch.rand(T, p["K"], generator=g)
    if p["wdtype"] == "f64":
        w = w.double()
    x = torch.empty(T, p["H"], dtype=torch.float64).copy_(torch.randn(T, p["H"], generator=g) * 4)
    if p.get("special") and x.numel():
        vals = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, 3e38, -65504.0, 1e-7])
        pick = torch.rand(x.shape, generator=g) < p["special"]
        x[pick] = vals[torch.randint(0, len(vals), (int(pick.sum()),), generator=g)].double()
        if T and p.get("zero_rows"):
            x[torch.rand(T, generator=g) < 0.5] = 0.0      # whole blocks equal to the SP sentinel
    return x, topk, w


def make_x(x: torch.Tensor, dtype: str, H: int):
    if dtype == "fp8":
        q = x.clamp(-448, 448).to(FP8)
        sc = torch.rand(x.shape[0], H // 128, generator=_gen(float(x.sum()), x.shape[0])).add_(0.5)
        return (q, sc)
    return x.to(getattr(torch, dtype))


def g_expert(v: torch.Tensor, d: int) -> torch.Tensor:
    """What rank ``d``'s 'experts' return for received rows ``v`` (elementwise)."""
    if v.dtype == FP8:
        v = v.to(torch.bfloat16)
    out = v * float(d + 1)
    return out


def g_ll(v: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Low-latency expert ``gid``'s output for bf16 rows ``v`` (elementwise, per row factor)."""
    return (v.float() * (1.0 + (gid % 3).float()).unsqueeze(-1)).bfloat16()


def dequant(q: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    H = q.shape[-1]
    return (q.float().reshape(*q.shape[:-1], H // 128, 128) * sc.unsqueeze(-1)).reshape(q.shape).bfloat16()


# ----------------------------------------------------------------------------- schedule
def call_params(seed: int, step: int, R: int, ll_ok: bool, zero_rank_prob: float = 0.15) -> dict:
    rng = random.Random(f"{seed}/{step}/params")
    op = rng.choices(["normal", "ll", "ll_two"], weights=[6, 3, 1] if ll_ok else [1, 0, 0])[0]
    E = R * rng.choice([1, 2, 4])
    if op == "normal":
        H = rng.choice([128, 256, 200, 64, 8])
        dtype = rng.choice(["bfloat16", "float16", "float32", "float64", "fp8"])
        if dtype == "fp8" and H % 128:
            H = 128
        Tmax = 24
    else:
        H = rng.choice([128, 256])
        dtype = "bfloat16"
        Tmax = N_LL
    K = rng.choice([0, 1, 2, 3, 4]) if op == "normal" else rng.choice([1, 2, 3, 4])
    K = min(K, E)
    wdtype = rng.choice(["f32", "f32", "f64"]) if op == "normal" else "f32"
    T = [rng.choice([0, 1, 2, 5, 8, 13, Tmax]) for _ in range(R)]
    for r in range(R):
        if rng.random() < zero_rank_prob:
            T[r] = 0
    use_fp8 = rng.random() < 0.5
    use_w = rng.random() < 0.7
    layout = rng.choice(["rank_major", "rank_major", "expert_major"])
    return {
        "op": op, "E": E, "H": H, "dtype": dtype, "K": K, "T": T,
        "mode": rng.choice(["uniform", "hot", "masked", "masked", "all_masked"] if K else ["uniform"]),
        "wdtype": wdtype,
        "weights": use_w,
        "layout": layout,
        "align": rng.choice([1, 1, 2, 4]),
        "worst": rng.random() < 0.15,
        "cached": rng.random() < 0.3,
        "buffer": rng.choice(["A", "B"]) if op == "normal" else "B",
        "use_fp8": use_fp8,
        "round_scale": rng.random() < 0.5,
        "hook": rng.random() < 0.4,
    }


# ----------------------------------------------------------------------------- buffers
def get_buffers(ctx, syncs, timeout_s: float, backend: str = "auto"):
    key = f"stress-{syncs}-{timeout_s}-{backend}"
    if key not in ctx.cache:
        for k in [k for k in ctx.cache if k.startswith("stress-")]:
            for b in ctx.cache.pop(k).values():
                b.destroy()
        R = ctx.world_size
        group2 = dist.new_group(list(range(R)))
        rdma = Buffer.get_low_latency_rdma_size_hint(N_LL, H_MAX, R, 4 * R)
        ctx.cache[key] = {
            # A's slots hold 8 rows of the widest payload: larger normal calls run in several exchanges
            "A": Buffer(ctx.group, normal_buffer_bytes(8, H_MAX * 8, R), 0, sync=syncs[0], timeout_s=timeout_s,
                        backend=backend),
            "B": Buffer(group2, 8 << 20, rdma, low_latency_mode=True, sync=syncs[1], timeout_s=timeout_s,
                        backend=backend),
        }
    return ctx.cache[key]


class Delays:
    """delay_hook: before a random fraction of the waits, sleep up to ``max_s`` (or just yield)."""

    def __init__(self, seed: int, rank: int, prob: float, max_s: float):
        self.rng = random.Random(f"{seed}/{rank}/delays")
        self.prob, self.max_s = prob, max_s
        self.count = 0

    def __call__(self, phase: str) -> None:
        if self.prob <= 0 or self.rng.random() >= self.prob:
            return
        self.count += 1
        d = self.rng.random() * self.max_s
        if d < self.max_s * 0.3:
            time.sleep(0)
        else:
            time.sleep(d)


# ----------------------------------------------------------------------------- checks
class Checker:
    def __init__(self, step: int, op: str, hasher=None):
        self.step, self.op = step, op
        self.failures: List[str] = []
        self.hasher = hasher

    def eq(self, what: str, got, ref) -> None:
        if self.hasher is not None:
            self.hasher.update(what.encode())
            if isinstance(got, torch.Tensor):
                self.hasher.update(_bits(got).numpy().tobytes())
            else:
                self.hasher.update(repr(got).encode())
        if got is None or ref is None:
            if got is not ref:
                self.failures.append(f"step {self.step} {self.op}: {what}: got {type(got)} ref {type(ref)}")
            return
        if isinstance(got, torch.Tensor):
            ok = got.shape == ref.shape and got.dtype == ref.dtype and torch.equal(
                _bits(got), _bits(ref))
        else:
            ok = got == ref
        if not ok:
            detail = (got, ref)
            if isinstance(got, torch.Tensor):
                detail = (tuple(got.shape), tuple(ref.shape))
                if got.shape == ref.shape and got.is_floating_point() and got.dtype != FP8:
                    bad = (got != ref) & ~(got.isnan() & ref.isnan())
                    rows = bad.reshape(bad.shape[0], -1).any(1).nonzero().flatten().tolist() if bad.dim() else []
                    diff = (got.double() - ref.double()).abs()[bad]
                    detail += (f"rows {rows[:8]}", f"max abs diff {float(diff.max()) if diff.numel() else 0}",
                               f"{int(bad.sum())} elements")
            self.failures.append(f"step {self.step} {self.op}: {what} differs {detail}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    # (a copy with standard strides: contiguous() keeps the strides of a view it deems contiguous, such as an
    # empty slice of the low-latency scales' column-major view, and a dtype view rejects them)
    t = fresh(t)
    if t.dtype == torch.bool:
        return t
    return t.view(torch.uint8)


def _local_ref(all_in, me: int, E: int, R: int):
    """Rank-major dispatch reference on rank ``me``: per source (rows, ids, weights, token index)."""
    El = E // R
    per_src = []
    for s in range(R):
        x, topk, w = all_in[s]
        loc = topk - me * El
        ok = (topk >= 0) & (loc >= 0) & (loc < El)
        sel = ok.any(1) if topk.shape[1] else torch.zeros(topk.shape[0], dtype=torch.bool)
        per_src.append((sel, torch.where(ok, loc, torch.full_like(loc, -1))[sel],
                        torch.where(ok, w, torch.zeros_like(w))[sel]))
    return per_src


def _payload(p: dict, x64: torch.Tensor):
    return make_x(x64, p["dtype"], p["H"])


def run_normal(buf: Buffer, p: dict, seed: int, step: int, me: int, R: int, chk: Checker) -> int:
    E, K, H = p["E"], p["K"], p["H"]
    El = E // R
    all_in = [call_inputs(seed, step, s, p) for s in range(R)]
    x64, topk, w = all_in[me]
    x = _payload(p, x64)
    fp8 = isinstance(x, tuple)
    use_w = p["weights"] and K > 0
    kw = dict(topk_idx=topk, topk_weights=w if use_w else None, num_experts=E, expert_alignment=p["align"],
              layout=p["layout"])
    T = x64.shape[0]
    worst = 0
    if p["worst"] and p["layout"] == "rank_major":
        worst = sum(p["T"]) + 3
        kw["num_worst_tokens"] = worst
    if K == 0:  # no routing: every token to every rank
        kw = dict(is_token_in_rank=torch.ones(T, R, dtype=torch.bool), num_experts=E)
        worst = 0
    calls = 1
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(x, **kw)

    # ---------------- reference (rank-major)
    per_src = _local_ref(all_in, me, E, R) if K else None
    srcs = [_payload(p, all_in[s][0]) for s in range(R)]
    if K:
        sels = [ps[0] for ps in per_src]
    else:
        sels = [torch.ones(all_in[s][0].shape[0], dtype=torch.bool) for s in range(R)]

    def rows_of(t_list):
        if fp8:
            return (torch.cat([t[0][sel] for t, sel in zip(t_list, sels)]),
                    torch.cat([t[1][sel] for t, sel in zip(t_list, sels)]))
        return torch.cat([t[sel] for t, sel in zip(t_list, sels)])
    ref_x = rows_of(srcs)
    ref_idx = torch.cat([ps[1] for ps in per_src]) if K else None
    ref_w = torch.cat([ps[2] for ps in per_src]) if (K and use_w) else None

    if p["layout"] == "expert_major" and K:
        rows_l, eidx_l, ew_l, ref_counts = [], [], [], []
        for e in range(El):
            hit = (ref_idx == e)
            rr = hit.any(1).nonzero().squeeze(1)
            kk = hit.int().argmax(1)[rr]
            c = rr.numel()
            pad = -(-c // p["align"]) * p["align"] - c
            rows_l.append((rr, pad))
            eidx_l.append(torch.cat([torch.full((c,), e), torch.full((pad,), -1)]))
            if use_w:
                ew_l.append(torch.cat([ref_w[rr, kk], torch.zeros(pad, dtype=ref_w.dtype)]))
            ref_counts.append(c + pad)

        def em(t):
            parts = []
            for rr, pad in rows_l:
                parts.append(t[rr])
                parts.append(torch.zeros((pad,) + tuple(t.shape[1:]), dtype=t.dtype))
            return torch.cat(parts)
        ref_em = (em(ref_x[0]), em(ref_x[1])) if fp8 else em(ref_x)
        _cmp_x(chk, "expert-major x", recv_x, ref_em, fp8)
        chk.eq("expert-major ids", recv_idx, torch.cat(eidx_l).to(torch.int64))
        if use_w:
            chk.eq("expert-major weights", recv_w, torch.cat(ew_l))
        chk.eq("expert-major counts", counts, ref_counts)
    else:
        if worst:
            def pad_rows(t, fill=0):
                extra = torch.zeros((worst - t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
                if fill:
                    extra.fill_(fill)
                return torch.cat([t, extra])
            ref_x_w = (pad_rows(ref_x[0]), pad_rows(ref_x[1])) if fp8 else pad_rows(ref_x)
            _cmp_x(chk, "x (num_worst_tokens)", recv_x, ref_x_w, fp8)
            chk.eq("ids (num_worst_tokens)", recv_idx, pad_rows(ref_idx, -1))
            if use_w:
                chk.eq("weights (num_worst_tokens)", recv_w, pad_rows(ref_w))
            chk.eq("counts (num_worst_tokens)", counts, [])
        else:
            _cmp_x(chk, "x", recv_x, ref_x, fp8)
            chk.eq("ids", recv_idx, ref_idx)
            chk.eq("weights", recv_w, ref_w)
            if K:
                ref_counts = [-(-int((ref_idx == e).any(1).sum()) // p["align"]) * p["align"] for e in range(El)]
                chk.eq("counts", counts, ref_counts)

    # ---------------- cached dispatch with a new payload
    if p["cached"]:
        x2_64 = x64 * 2 + 1
        cx, *_ = buf.dispatch(_payload(p, x2_64), handle=handle)
        calls += 1
        src2 = [_payload(p, all_in[s][0] * 2 + 1) for s in range(R)]
        ref2 = rows_of(src2)
        if p["layout"] == "expert_major" and K:
            ref2 = (em(ref2[0]), em(ref2[1])) if fp8 else em(ref2)
        elif worst:
            ref2 = (pad_rows(ref2[0]), pad_rows(ref2[1])) if fp8 else pad_rows(ref2)
        _cmp_x(chk, "cached x", cx, ref2, fp8)

    # ---------------- combine: experts return g_expert(rows, me)
    y = g_expert(recv_x[0] if fp8 else recv_x, me)
    cw = recv_w if (use_w and p["layout"] == "rank_major") else None
    comb, comb_w, _ = buf.combine(y, handle, topk_weights=cw)
    calls += 1
    cdtype = y.dtype
    acc_dtype = torch.float64 if cdtype == torch.float64 else torch.float32
    xin = srcs[me][0] if fp8 else srcs[me]
    ref = torch.zeros(T, H, dtype=acc_dtype)
    wref = torch.zeros(T, K, dtype=w.dtype) if cw is not None else None
    for d in range(R):
        if K:
            loc = topk - d * El
            okd = (topk >= 0) & (loc >= 0) & (loc < El)
            sel = okd.any(1)
        else:
            okd = None
            sel = torch.ones(T, dtype=torch.bool)
        if not bool(sel.any()):
            continue
        v = g_expert(xin[sel], d)
        if p["layout"] == "expert_major" and K:
            c = okd.sum(1)[sel]
            tmp = torch.zeros(v.shape, dtype=acc_dtype)
            for j in range(int(c.max())):
                m = c > j
                tmp[m] += v[m].to(acc_dtype)
            v = tmp.to(cdtype)
        ref[sel] += v.to(acc_dtype)
        if wref is not None:
            wref[sel] += torch.where(okd, w, torch.zeros_like(w))[sel]
    chk.eq("combine", comb, ref.to(cdtype))
    chk.eq("combine weights", comb_w, wref)
    return calls


def _cmp_x(chk, what, got, ref, fp8):
    if fp8:
        chk.eq(what + " (fp8)", got[0], ref[0])
        chk.eq(what + " (scales)", got[1], ref[1])
    else:
        chk.eq(what, got, ref)


def ll_reference(all_in, me, E, R, p):
    """Per local expert: (source, token) list in receive order, plus the rows."""
    El = E // R
    out = []
    for e in range(El):
        gid = me * El + e
        pairs = []
        for s in range(R):
            topk = all_in[s][1]
            ts = (topk == gid).any(1).nonzero().squeeze(1) if topk.numel() else torch.zeros(0, dtype=torch.int64)
            pairs.append(ts)
        out.append(pairs)
    return out


def ll_sender_payload(x64: torch.Tensor, p: dict):
    x = x64.to(torch.bfloat16)
    if p["use_fp8"]:
        q, sc = low_latency_cast_to_fp8(x, p["round_scale"])
        return x, q, sc
    return x, None, None


def run_ll_dispatch(buf, p, seed, step, me, R, chk, hook):
    E = p["E"]
    x64, topk, w = call_inputs(seed, step, me, p)
    x = x64.to(torch.bfloat16)
    out = buf.low_latency_dispatch(x, topk, N_LL, E, use_fp8=p["use_fp8"], round_scale=p["round_scale"],
                                   return_recv_hook=hook)
    return out, (x64, topk, w)


def check_ll_dispatch(out, p, seed, step, me, R, chk):
    E = p["E"]
    El = E // R
    recv_x, recv_count, handle, _, _ = out
    all_in = [call_inputs(seed, step, s, p) for s in range(R)]
    ref = ll_reference(all_in, me, E, R, p)
    payloads = [ll_sender_payload(all_in[s][0], p) for s in range(R)]
    src_info, layout_range = handle[0], handle[1]
    ref_count = torch.tensor([sum(t.numel() for t in ref[e]) for e in range(El)], dtype=torch.int32)
    chk.eq("ll recv_count", recv_count, ref_count)
    for e in range(El):
        c = int(ref_count[e])
        ts = torch.cat(ref[e])
        chk.eq(f"ll src_info e{e}", src_info[e, :c], ts.to(torch.int32))
        begin = 0
        lr = []
        for s in range(R):
            n = ref[e][s].numel()
            lr.append((begin << 32) | n)
            begin += n
        chk.eq(f"ll layout_range e{e}", layout_range[e], torch.tensor(lr, dtype=torch.int64))
        if p["use_fp8"]:
            rq = torch.cat([payloads[s][1][ref[e][s]] for s in range(R)])
            rs = torch.cat([payloads[s][2][ref[e][s]] for s in range(R)])
            chk.eq(f"ll fp8 e{e}", recv_x[0][e, :c], rq)
            chk.eq(f"ll scales e{e}", recv_x[1][e, :c], rs)
        else:
            rx = torch.cat([payloads[s][0][ref[e][s]] for s in range(R)])
            chk.eq(f"ll x e{e}", recv_x[e, :c], rx)


def ll_expert_outputs(recv_x, p, me, R):
    El = p["E"] // R
    v = dequant(*recv_x) if p["use_fp8"] else recv_x
    gid = (me * El + torch.arange(El)).view(El, 1).expand(El, v.shape[1]).reshape(-1)
    return g_ll(v.reshape(-1, v.shape[-1]), gid).view(v.shape)


def ll_combine_reference(p, x64, topk, w):
    T, K = topk.shape
    H = p["H"]
    x, q, sc = ll_sender_payload(x64, p)
    v = dequant(q, sc) if p["use_fp8"] else x
    valid = topk >= 0
    tmp = torch.zeros(T * K, H, dtype=torch.float32)
    flat = topk.reshape(-1)
    tok = torch.arange(T).repeat_interleave(K)
    ok = flat >= 0
    tmp[ok] = g_ll(v[tok[ok]], flat[ok]).float()
    wm = torch.where(valid, w, torch.zeros_like(w))
    # the documented reduction: over k in order from +0.0, one multiply and one add per slot (no FMA)
    acc = torch.zeros(T, H, dtype=torch.float32)
    t3 = tmp.view(T, K, H)
    for k in range(K):
        acc.add_(t3[:, k] * wm[:, k:k + 1])
    return acc.to(torch.bfloat16)


def run_ll(buf, p, seed, step, me, R, chk) -> int:
    out, (x64, topk, w) = run_ll_dispatch(buf, p, seed, step, me, R, chk, p["hook"])
    if p["hook"]:
        out[4]()
    check_ll_dispatch(out, p, seed, step, me, R, chk)
    y = ll_expert_outputs(out[0], p, me, R)
    comb, _, hk = buf.low_latency_combine(y, topk, w, out[2], return_recv_hook=p["hook"])
    if hk is not None:
        hk()
    chk.eq("ll combine", comb, ll_combine_reference(p, x64, topk, w))
    return 2


def run_ll_two(buf, p, seed, step, me, R, chk, reverse_hooks: bool = False) -> int:
    """Two dispatches in flight (recv hooks deferred), then both combines in flight."""
    p2 = dict(p)
    p2["use_fp8"] = not p["use_fp8"]
    o1, in1 = run_ll_dispatch(buf, p, seed, step, me, R, chk, True)
    o2, in2 = run_ll_dispatch(buf, p2, seed, step + 10 ** 7, me, R, chk, True)
    o1[4]()
    o2[4]()
    check_ll_dispatch(o1, p, seed, step, me, R, chk)
    check_ll_dispatch(o2, p2, seed, step + 10 ** 7, me, R, chk)
    c1 = buf.low_latency_combine(ll_expert_outputs(o1[0], p, me, R), in1[1], in1[2], o1[2], return_recv_hook=True)
    c2 = buf.low_latency_combine(ll_expert_outputs(o2[0], p2, me, R), in2[1], in2[2], o2[2],
                                 return_recv_hook=True)
    if reverse_hooks:
        c2[2]()
        c1[2]()
    else:
        c1[2]()
        c2[2]()
    chk.eq("ll two combine 1", c1[0], ll_combine_reference(p, *in1))
    chk.eq("ll two combine 2", c2[0], ll_combine_reference(p2, *in2))
    return 4


def stress(ctx, seed: int, steps: int, syncs=("tff", "sp"), delay_prob: float = 0.2, delay_max_s: float = 0.002,
           buffer_timeout_s: float = 30.0, backend: str = "auto", digest: bool = False) -> Dict:
    """Run ``steps`` random steps (each one to four Buffer calls). Returns counts, failures and, with
    ``digest``, a hash of every output for the determinism tests."""
    bufs = get_buffers(ctx, tuple(syncs), buffer_timeout_s, backend)
    me, R = ctx.rank, ctx.world_size
    delays = Delays(seed, me, delay_prob, delay_max_s)
    for b in bufs.values():
        b.delay_hook = delays
    calls, failures = 0, []
    ops: Dict[str, int] = {}
    h = hashlib.sha256()
    t0 = time.monotonic()
    error: Optional[str] = None
    for step in range(steps):
        p = call_params(seed, step, R, ll_ok=True)
        chk = Checker(step, p["op"], h if digest else None)
        buf = bufs[p["buffer"]]
        try:
            if p["op"] == "normal":
                calls += run_normal(buf, p, seed, step, me, R, chk)
            elif p["op"] == "ll":
                calls += run_ll(buf, p, seed, step, me, R, chk)
            else:
                calls += run_ll_two(buf, p, seed, step, me, R, chk, reverse_hooks=bool(step % 2))
        except Exception as e:  # noqa: BLE001 - a raised error is a failure of the run; stop
            error = f"step {step} {p}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}"
            failures.append(error)
            break
        ops[p["op"]] = ops.get(p["op"], 0) + 1
        failures.extend(chk.failures)
    for b in bufs.values():
        b.delay_hook = None
    return {"rank": me, "calls": calls, "steps": steps, "ops": ops, "failures": failures[:20],
            "n_failures": len(failures), "delays": delays.count, "error": error,
            "seconds": time.monotonic() - t0, "digest": h.hexdigest() if digest else None}


def hooks_newest_first(ctx, buffer_timeout_s: float) -> Optional[str]:
    """Two low-latency rounds whose combine hooks are completed newest-first, then plain rounds.
    Returns None when every call succeeds and matches, else the first failure."""
    R = ctx.world_size
    rdma = Buffer.get_low_latency_rdma_size_hint(N_LL, H_MAX, R, 4 * R)
    buf = Buffer(ctx.group, 1 << 20, rdma, low_latency_mode=True, timeout_s=buffer_timeout_s)
    try:
        p = call_params(0, 0, R, True)
        p.update(op="ll_two", E=2 * R, H=128, K=2, T=[8] * R, mode="uniform", use_fp8=False, hook=False)
        for step in range(4):
            chk = Checker(step, "ll_two")
            run_ll_two(buf, p, 0, step, ctx.rank, R, chk, reverse_hooks=(step == 0))
            if chk.failures:
                return chk.failures[0]
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        buf.destroy()


def shm_entries(ctx, directory: str) -> List[str]:
    import os
    return sorted(n for n in os.listdir(directory) if n.startswith("ubep-"))
