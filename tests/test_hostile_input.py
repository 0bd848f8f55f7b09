"""Hostile and odd input: exact results or clear errors, never a hang or a crash, Buffer usable after.

Property-based (hypothesis) over shapes, dtypes, top-k, expert counts, routing modes (uniform, hot,
-1 masks, every slot -1), zero-token ranks, NaN/inf/-0/denormals in payloads and whole zero rows
(SP sentinel collisions), for every sync mode; every 16-bit pattern through dispatch and combine; bad
ids and shapes on every rank raise ValueError/TypeError and the Buffer keeps working. Each hypothesis
example is one ``pool.run`` that rebuilds the example's inputs on every rank from its parameters.
"""
import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import stress_rank_fns as S  # noqa: E402

from ubep_torch import Buffer  # noqa: E402
from ubep_torch import protocol as P  # noqa: E402
from ubep_torch.testing import RankPool  # noqa: E402

SYNCS = ["tff", "dc", "sp", "sw"]
R = 2


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("shm"))
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": d}
    with RankPool(R, env=env) as p:
        yield p


# ----------------------------------------------------------------------------- rank functions
def _buffers(ctx, sync):
    return S.get_buffers(ctx, (sync, sync), 20.0)


def run_case(ctx, p, seed):
    """One example: a normal or low-latency round trip checked bit for bit. Returns the failures."""
    bufs = _buffers(ctx, p["sync"])
    chk = S.Checker(0, p["op"])
    me = ctx.rank
    if p["op"] == "normal":
        S.run_normal(bufs[p["buffer"]], p, seed, 0, me, ctx.world_size, chk)
    else:
        S.run_ll(bufs["B"], p, seed, 0, me, ctx.world_size, chk)
    return chk.failures


def bad_case(ctx, sync, kind):
    """Every rank passes the same bad input: all raise ValueError/TypeError, then a valid call works."""
    bufs = _buffers(ctx, sync)
    buf = bufs["B"]
    T, H, K, E = 4, 128, 2, 2 * ctx.world_size
    x = torch.randn(T, H).bfloat16()
    topk = torch.tensor([[0, 1], [1, 2], [-1, -1], [3, 0]])

    def ll_handle():
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, topk, S.N_LL, E, use_fp8=False)
        bad_case.pending = (recv_x, handle)     # combined below, so the Buffer is in step again
        return handle

    def combine(x_of=lambda recv_x: recv_x, **kw):     # a dispatch, then its combine of x_of(recv_x)
        recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
        return buf.combine(x_of(recv_x), h, **kw)

    def ll_combine(**kw):  # a low-latency dispatch, then its combine with arguments of kw's choice
        h = ll_handle()
        return buf.low_latency_combine(kw.pop("x", bad_case.pending[0]), topk, kw.pop("w", torch.rand(T, K)), h,
                                       **kw)

    def edited_tuple(i, edit):
        recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
        items = [t.clone() for t in h]
        edit(items[i])
        return buf.combine(recv_x, tuple(items))

    def ll_layout_edited():
        # every rank's two local experts get different counts, so swapping their layout rows changes them and
        # keeps every range valid
        uneven = torch.tensor([[0, 1], [0, 2], [0, 3], [2, -1]])
        recv_x, _, h, _, _ = buf.low_latency_dispatch(x, uneven, S.N_LL, E, use_fp8=False)
        layout = h[1].clone()
        h[1].copy_(layout.flip(0))
        try:
            return buf.low_latency_combine(recv_x, uneven, torch.rand(T, K), h)
        finally:
            h[1].copy_(layout)
            buf.low_latency_combine(recv_x, uneven, torch.rand(T, K), h)

    def flip_first(t):
        t[0] = ~t[0]

    def hand_built(i, ll=False):
        # a handle object built by hand from a call's handle, one entry moved to the meta device (former bug:
        # handle objects passed the host-memory check unlooked-at, though only the Buffer's own are its own)
        from ubep_torch import DispatchHandle, LowLatencyHandle
        if ll:
            h = ll_handle()
            items = list(h)
            items[i] = items[i].to(meta)
            return buf.low_latency_combine(bad_case.pending[0], topk, torch.rand(T, K),
                                           LowLatencyHandle(tuple(items), **h.__dict__))
        recv_x, _, _, _, h, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
        items = list(h)
        items[i] = items[i].to(meta)
        return buf.combine(recv_x, DispatchHandle(tuple(items), **h.__dict__))

    meta = torch.device("meta")
    stats_of = {"recv": E // ctx.world_size, "wait": ctx.world_size}
    def count_group_past_the_model():
        # (former bug: accepted, then every call's report failed with a warning: a CM384 die has 48 AIVs)
        from ubep_torch import Config
        from ubep_torch.cost_model import CostModel
        buf.set_cost_model(CostModel())
        try:
            buf.dispatch(x, topk_idx=topk, num_experts=E, config=Config(num_count_aivs=48))
        finally:
            buf.set_cost_model(None)

    cases = {
        "id too large": lambda: buf.dispatch(x, topk_idx=topk + E, num_experts=E),
        "id < -1": lambda: buf.dispatch(x, topk_idx=topk.clamp(max=0) - 2, num_experts=E),
        "float ids": lambda: buf.dispatch(x, topk_idx=topk.float(), num_experts=E),
        "3-d ids": lambda: buf.dispatch(x, topk_idx=topk.view(T, K, 1), num_experts=E),
        "E not divisible": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E + 1),
        "E zero": lambda: buf.get_dispatch_layout(topk, 0),
        "x rows": lambda: buf.dispatch(x[:3], topk_idx=topk, num_experts=E),
        "x int": lambda: buf.dispatch(x.to(torch.int16), topk_idx=topk, num_experts=E),
        "x 3-d": lambda: buf.dispatch(x.view(T, H, 1), topk_idx=topk, num_experts=E),
        "weights int": lambda: buf.dispatch(x, topk_idx=topk, topk_weights=topk, num_experts=E),
        "alignment 0": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, expert_alignment=0),
        "worst < 0": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_worst_tokens=-1),
        "layout": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, layout="nope"),
        "ll T > N": lambda: buf.low_latency_dispatch(torch.randn(S.N_LL + 1, H).bfloat16(),
                                                     torch.zeros(S.N_LL + 1, 1, dtype=torch.int64), S.N_LL, E),
        "ll N <= 0": lambda: buf.low_latency_dispatch(x, topk, 0, E),
        "ll wait stats shape": lambda: buf.low_latency_dispatch(
            x, topk, S.N_LL, E, dispatch_wait_recv_cost_stats=torch.zeros(ctx.world_size + 1, dtype=torch.int64)),
        "ll wait stats list": lambda: buf.low_latency_dispatch(x, topk, S.N_LL, E,
                                                              dispatch_wait_recv_cost_stats=[0] * ctx.world_size),
        "ll recv stats bool": lambda: buf.low_latency_dispatch(
            x, topk, S.N_LL, E, cumulative_local_expert_recv_stats=torch.zeros(E // ctx.world_size, dtype=torch.bool)),
        "ll duplicate": lambda: buf.low_latency_dispatch(x, torch.zeros(T, K, dtype=torch.int64), S.N_LL, E),
        "ll fp8 H": lambda: buf.low_latency_dispatch(torch.randn(T, 100).bfloat16(), topk, S.N_LL, E),
        "ll hidden too big": lambda: buf.low_latency_dispatch(torch.randn(T, 64 * 1024).bfloat16(), topk,
                                                              S.N_LL, E),
        "ll top-k 17": lambda: buf.low_latency_dispatch(x, torch.full((T, 17), -1, dtype=torch.int64),
                                                        S.N_LL, E),
        "combine handle": lambda: buf.combine(x, ("not", "a", "handle")),
        "counts as lists": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                num_tokens_per_rank=[T] * ctx.world_size),
        "rank mask as list": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                  is_token_in_rank=[[True] * ctx.world_size] * T),
        "float rank counts": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                  num_tokens_per_rank=torch.full((ctx.world_size,), 2.5)),
        "expert counts as list": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                      num_tokens_per_expert=[1] * E),
        "ll out list": lambda: buf.low_latency_combine(x, topk, torch.rand(T, K), ll_handle(), out=[0]),
        "ll combine handle": lambda: buf.low_latency_combine(x, topk, torch.rand(T, K), ("x",)),
        # tensors outside host memory (the C loops would read them by address)
        "meta weights": lambda: buf.dispatch(x, topk_idx=topk, topk_weights=torch.rand(T, K, device=meta),
                                             num_experts=E),
        "meta fp8": lambda: buf.dispatch((torch.empty(T, H, dtype=torch.float8_e4m3fn, device=meta),
                                          torch.ones(T, H // 128, device=meta)), topk_idx=topk, num_experts=E),
        "meta combine x": lambda: combine(x_of=lambda recv_x: recv_x.to(meta)),
        "meta combine bias": lambda: combine(bias=torch.zeros(T, H, device=meta)),
        "meta layout ids": lambda: buf.get_dispatch_layout(topk.to(meta), E),
        "meta ll x": lambda: buf.low_latency_dispatch(x.to(meta), topk, S.N_LL, E),
        "meta ll weights": lambda: ll_combine(w=torch.rand(T, K, device=meta)),
        "meta ll out": lambda: ll_combine(out=torch.empty(T, H, dtype=torch.bfloat16, device=meta)),
        "meta in a hand-built handle": lambda: hand_built(3),
        "meta in a hand-built ll handle": lambda: hand_built(1, ll=True),
        # sparse tensors (former bug: a sparse low-latency weight or combine bias passed the checks and broke the
        # Buffer once the call had reached the peers)
        "sparse ll weights": lambda: ll_combine(w=torch.rand(T, K).to_sparse()),
        "sparse combine bias": lambda: combine(bias=torch.zeros(T, H).bfloat16().to_sparse()),
        "sparse bias in a pair": lambda: combine(bias=(None, torch.zeros(T, H).bfloat16().to_sparse())),
        "sparse x": lambda: buf.dispatch(x.to_sparse(), topk_idx=topk, num_experts=E),
        "nested x": lambda: buf.dispatch(torch.nested.nested_tensor([x[:1], x[1:]]), topk_idx=topk, num_experts=E),
        "nested ll weights": lambda: ll_combine(w=torch.nested.nested_tensor([torch.rand(1, K),
                                                                             torch.rand(T - 1, K)])),
        "sparse ll out": lambda: ll_combine(out=torch.zeros(T, H).bfloat16().to_sparse()),
        "sparse ll stats": lambda: buf.low_latency_dispatch(
            x, topk, S.N_LL, E, cumulative_local_expert_recv_stats=torch.zeros(
                stats_of["recv"], dtype=torch.int32).to_sparse()),
        # flags and counts of the wrong type (former bugs: taken by their truth value, or True as 1)
        "ll zero_copy str": lambda: ll_combine(zero_copy="no"),
        "ll combine hook str": lambda: ll_combine(return_recv_hook="no"),
        "ll dispatch hook str": lambda: buf.low_latency_dispatch(x, topk, S.N_LL, E, return_recv_hook="no"),
        "layout async str": lambda: buf.get_dispatch_layout(topk, E, async_finish="yes"),
        "dispatch async str": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, async_finish="yes"),
        "dispatch comm stream None": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E,
                                                          allocate_on_comm_stream=None),
        "combine async str": lambda: combine(async_finish="yes"),
        "layout event str": lambda: buf.get_dispatch_layout(topk, E, previous_event="event"),
        "dispatch event str": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, previous_event=3),
        "combine event str": lambda: combine(previous_event=object()),
        "rdma counts str": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_tokens_per_rdma_rank="x"),
        "worst past int64": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_worst_tokens=1 << 63),
        "worst True": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_worst_tokens=True),
        "alignment True": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, expert_alignment=True),
        "ll N True": lambda: buf.low_latency_dispatch(x, topk, True, E),
        "bias triple": lambda: combine(bias=(torch.zeros(T, H).bfloat16(),) * 3),
        # tensors the call writes whose elements share memory
        "ll recv stats expanded": lambda: buf.low_latency_dispatch(
            x, topk, S.N_LL, E, cumulative_local_expert_recv_stats=torch.zeros(1, dtype=torch.int32).expand(
                stats_of["recv"])),
        "ll wait stats expanded": lambda: buf.low_latency_dispatch(
            x, topk, S.N_LL, E, dispatch_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int64).expand(
                stats_of["wait"])),
        "ll stats overlap": lambda: (lambda shared: buf.low_latency_dispatch(    # (added up into the same words)
            x, topk, S.N_LL, E, cumulative_local_expert_recv_stats=shared[:stats_of["recv"]],
            dispatch_wait_recv_cost_stats=shared[:stats_of["wait"]]))(
                torch.zeros(max(stats_of.values()), dtype=torch.int64)),
        "ll out expanded": lambda: ll_combine(out=torch.zeros(1, H).bfloat16().expand(T, H)),
        "ll out overlapping": lambda: ll_combine(out=torch.zeros(T * H).bfloat16().as_strided((T, H), (1, 1))),
        # sizes found only after the exchange before: now checked first
        "worst huge": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, num_worst_tokens=1 << 50),
        "E huge": lambda: buf.get_dispatch_layout(topk, ctx.world_size << 44),
        "ll experts per rank": lambda: buf.low_latency_dispatch(x, topk, S.N_LL, ctx.world_size * 475),
        "experts per rank": lambda: buf.dispatch(x, topk_idx=topk, num_experts=ctx.world_size * 472),
        "ll clean args": lambda: buf.clean_low_latency_buffer(-5, "x", None),
        "ll clean too big": lambda: buf.clean_low_latency_buffer(S.N_LL, H * 64, E),     # (as DeepEP asserts)
        # handles edited by the caller
        "tuple rank mask edited": lambda: edited_tuple(4, flip_first),
        "tuple source index edited": lambda: edited_tuple(3, lambda t: t.fill_(10 ** 6)),
        "ll layout edited": ll_layout_edited,
        "cost model str": lambda: buf.set_cost_model("not a model"),
        "count group past the model": count_group_past_the_model,
        # (former bug: torch's allocation error of terabytes, or an allocation that succeeded lazily)
        "alignment past memory": lambda: buf.dispatch(x, topk_idx=topk, num_experts=E, layout="expert_major",
                                                      expert_alignment=1 << 40),
        "on_report not callable": lambda: buf.set_cost_model(None, on_report=3),
    }
    fn = cases[kind]
    try:
        fn()
    except (ValueError, TypeError) as e:
        msg = str(e)
    else:
        return f"{kind}: accepted"
    if not buf.is_available():
        return f"{kind}: Buffer unusable after a local error"
    pending = getattr(bad_case, "pending", None)
    if pending is not None:
        bad_case.pending = None
        buf.low_latency_combine(pending[0], topk, torch.rand(T, K), pending[1])
    p = S.call_params(5, 0, ctx.world_size, True)
    p.update(op="normal", buffer="B", H=64, dtype="bfloat16", K=2, T=[3] * ctx.world_size, weights=True,
             layout="rank_major", worst=False, cached=False, wdtype="f32")
    chk = S.Checker(0, "after")
    S.run_normal(buf, p, 5, 0, ctx.rank, ctx.world_size, chk)
    return chk.failures or msg


def all_16bit_patterns(ctx, sync, dtype_name):
    """Every 16-bit pattern as bf16/fp16 payload, dispatched to every rank and combined back."""
    bufs = _buffers(ctx, sync)
    buf = bufs["A"]
    dtype = getattr(torch, dtype_name)
    R_, me = ctx.world_size, ctx.rank
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    bits = bits.roll(me * 977)                     # each rank sends them in a different order
    x = bits.view(dtype).view(256, 256).clone()
    x[::17] = 0                                    # whole zero rows: every block collides with the sentinel
    E = R_
    topk = torch.arange(R_).repeat(256, 1)         # every token to every rank
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=E)
    ref = []
    for s in range(R_):
        b = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).roll(s * 977).view(dtype).view(256, 256)
        b = b.clone()
        b[::17] = 0
        ref.append(b)
    ref = torch.cat(ref)
    if not torch.equal(recv_x.view(torch.int16), ref.view(torch.int16)):
        bad = (recv_x.view(torch.int16) != ref.view(torch.int16)).nonzero()[:5].tolist()
        return f"dispatch bits differ at {bad}"
    comb, _, _ = buf.combine(recv_x, handle)
    acc = torch.zeros(256, 256)
    for _ in range(R_):
        acc += x.float()
    exp = acc.to(dtype)
    if not torch.equal(comb.view(torch.int16), exp.view(torch.int16)):
        return "combine bits differ"
    return None


def sp_words(ctx, sync):
    """float64 payload words equal to the sentinel, the escape value and the row magic."""
    bufs = _buffers(ctx, sync)
    buf = bufs["A"]
    T, H = 6, 64 * 4
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(ctx.rank)).double()
    w = x.view(torch.int64)
    w[0, :] = 0
    w[1, ::64] = P.SP_ESCAPE
    w[2, ::64] = P.ROW_MAGIC
    w[3, ::2] = P.SP_SENTINEL
    w[4, :] = P.SP_ESCAPE
    topk = torch.tensor([[r] for r in range(T)]) % ctx.world_size
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_experts=ctx.world_size)
    n = recv_x.shape[0]
    if not torch.isfinite(recv_x).any() and n:
        return "no finite data"
    comb, _, _ = buf.combine(recv_x, handle)
    if not torch.equal(comb.view(torch.int64), (x + 0.0).view(torch.int64)) and not torch.equal(
            comb.view(torch.int64), x.view(torch.int64)):
        return "sp special words corrupted"
    return None


# ----------------------------------------------------------------------------- strategies
@st.composite
def normal_params(draw):
    K = draw(st.integers(0, 4))
    E = R * draw(st.sampled_from([1, 2, 4]))
    K = min(K, E)
    dtype = draw(st.sampled_from(["bfloat16", "float16", "float32", "float64", "fp8"]))
    H = draw(st.sampled_from([128, 256])) if dtype == "fp8" else draw(st.sampled_from([1, 3, 8, 64, 200, 256]))
    layout = draw(st.sampled_from(["rank_major", "expert_major"])) if K else "rank_major"
    wdtype = draw(st.sampled_from(["f32", "f64"]))
    return {
        "op": "normal", "sync": draw(st.sampled_from(SYNCS)), "buffer": draw(st.sampled_from(["A", "B"])),
        "E": E, "K": K, "H": H, "dtype": dtype,
        "T": draw(st.lists(st.sampled_from([0, 0, 1, 2, 7, 24]), min_size=R, max_size=R)),
        "mode": draw(st.sampled_from(["uniform", "hot", "masked", "all_masked"])),
        "wdtype": wdtype, "weights": True if layout == "expert_major" else draw(st.booleans()),
        "layout": layout, "align": draw(st.sampled_from([1, 3, 8])),
        "worst": draw(st.booleans()), "cached": draw(st.booleans()),
        "use_fp8": False, "round_scale": False, "hook": False,
        "special": draw(st.sampled_from([0.0, 0.05, 0.5])), "zero_rows": draw(st.booleans()),
    }


@st.composite
def ll_params(draw):
    E = R * draw(st.sampled_from([1, 2, 4]))
    T = draw(st.lists(st.sampled_from([0, 1, 5, S.N_LL]), min_size=R, max_size=R))
    return {
        "op": "ll", "sync": draw(st.sampled_from(SYNCS)), "buffer": "B", "E": E,
        "K": min(E, draw(st.integers(1, 4))), "H": 256 if 0 in T else draw(st.sampled_from([128, 256])),
        "dtype": "bfloat16", "T": T, "mode": draw(st.sampled_from(["uniform", "hot", "masked", "all_masked"])),
        "wdtype": "f32", "weights": True, "layout": "rank_major", "align": 1, "worst": False, "cached": False,
        "use_fp8": draw(st.booleans()), "round_scale": draw(st.booleans()), "hook": draw(st.booleans()),
        "special": draw(st.sampled_from([0.0, 0.05, 0.5])), "zero_rows": draw(st.booleans()),
    }


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
                 database=None)


@settings(max_examples=40, **_SETTINGS)
@given(p=normal_params(), seed=st.integers(0, 2 ** 20))
def test_normal_dispatch_combine_property(pool, p, seed):
    out = pool.run(run_case, p, seed)
    assert out == [[], []], (p, out)


@settings(max_examples=30, **_SETTINGS)
@given(p=ll_params(), seed=st.integers(0, 2 ** 20))
def test_low_latency_property(pool, p, seed):
    out = pool.run(run_case, p, seed)
    assert out == [[], []], (p, out)


BAD_KINDS = ["id too large", "id < -1", "float ids", "3-d ids", "E not divisible", "E zero", "x rows", "x int",
             "x 3-d", "weights int", "alignment 0", "worst < 0", "layout", "ll T > N", "ll N <= 0",
             "ll duplicate", "ll fp8 H", "ll hidden too big", "ll top-k 17", "combine handle",
             "ll combine handle", "ll wait stats shape", "ll wait stats list", "ll recv stats bool",
             "counts as lists", "rank mask as list", "float rank counts", "expert counts as list", "ll out list",
             "meta weights", "meta fp8", "meta combine x", "meta combine bias", "meta layout ids", "meta ll x",
             "meta ll weights", "meta ll out", "meta in a hand-built handle", "meta in a hand-built ll handle",
             "ll recv stats expanded", "ll wait stats expanded", "ll out expanded",
             "ll out overlapping", "ll stats overlap", "worst huge", "worst past int64", "layout event str",
             "dispatch event str",
             "combine event str", "rdma counts str", "E huge", "ll experts per rank", "experts per rank",
             "ll clean args", "ll clean too big",
             "tuple rank mask edited", "tuple source index edited", "ll layout edited", "cost model str",
             "on_report not callable", "sparse ll weights", "sparse combine bias", "sparse bias in a pair",
             "sparse x", "sparse ll out", "sparse ll stats", "nested x", "nested ll weights", "ll zero_copy str",
             "ll combine hook str", "count group past the model", "alignment past memory",
             "ll dispatch hook str", "worst True", "alignment True", "ll N True", "bias triple",
             "layout async str", "dispatch async str", "dispatch comm stream None", "combine async str"]


# what the error of some kinds must say (an earlier check could refuse them for another reason)
BAD_SAYS = {**{k: "must be True or False" for k in ("layout async str", "dispatch async str",
                                                   "dispatch comm stream None", "combine async str")},
            "meta combine x": "meta tensor", "meta ll out": "meta tensor",
            "meta in a hand-built handle": "combine: handle[3] is a meta tensor",
            "meta in a hand-built ll handle": "low_latency_combine: handle[1] is a meta tensor",
            "ll out overlapping": "share memory",
            "ll experts per rank": "control message", "nested x": "nested tensor", "nested ll weights": "nested tensor",
            "experts per rank": "control message", "ll layout edited": "changed after",
            "ll clean too big": "too small for", "worst past int64": "num_worst_tokens",
            "count group past the model": "a count group takes at most 47",
            "alignment past memory": "more than this machine's memory",
            "ll stats overlap": "overlap in memory",
            **{k: "previous_event must be" for k in ("layout event str", "dispatch event str", "combine event str")},
            **{k: "layout torch.sparse_coo" for k in ("sparse ll weights", "sparse combine bias",
                                                       "sparse bias in a pair", "sparse x", "sparse ll out",
                                                       "sparse ll stats")}}


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_bad_input_raises_and_buffer_stays_usable(pool, sync):
    for kind in BAD_KINDS:
        out = pool.run(bad_case, sync, kind)
        assert all(isinstance(o, str) and "accepted" not in o and "unusable" not in o for o in out), (kind, out)
        assert all(BAD_SAYS.get(kind, "") in o for o in out), (kind, out)


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16bit_pattern_round_trips(pool, sync, dtype):
    assert pool.run(all_16bit_patterns, sync, dtype) == [None, None]


@pytest.mark.parametrize("sync", SYNCS)
def test_payload_words_equal_to_protocol_constants(pool, sync):
    assert pool.run(sp_words, sync) == [None, None]


# ----------------------------------------------------------------------------- known library bugs
def known_bug(ctx, kind, backend):
    """Reproducers of bugs in ubep_torch (every rank hits the same condition, so nobody hangs)."""
    buf = Buffer(ctx.group, 1 << 20, Buffer.get_low_latency_rdma_size_hint(8, 128, ctx.world_size, 2 * ctx.world_size),
                 low_latency_mode=True, timeout_s=3.0, backend=backend)
    E = 2 * ctx.world_size
    try:
        if kind == "f64-weights-odd-k":       # one received row, K = 1, float64 weights
            topk = torch.tensor([[ctx.rank * 2]])
            buf.dispatch(torch.randn(1, 64), topk_idx=topk, topk_weights=torch.rand(1, 1).double(), num_experts=E)
        elif kind == "empty-nonunit-stride":  # no tokens; x made by an elementwise op has strides (1, 0)
            x = torch.rand(0, 1) + 0.5
            buf.dispatch(x, topk_idx=torch.zeros(0, 1, dtype=torch.int64), num_experts=E)
        elif kind == "ll-fp8-zero-tokens-h128":
            buf.low_latency_dispatch(torch.zeros(0, 128).bfloat16(), torch.zeros(0, 1, dtype=torch.int64), 8, E,
                                     use_fp8=True)
        elif kind == "empty-outputs-view":   # nothing received: outputs must still take dtype views
            T = 0 if ctx.rank == 0 else 5
            topk = torch.full((T, 1), -1, dtype=torch.int64)
            ids = buf.dispatch(torch.randn(T, 8), topk_idx=topk, num_experts=E)[1]
            _, ids2, w, _, _, _ = buf.dispatch(torch.randn(T, 8), topk_idx=topk, topk_weights=torch.rand(T, 1),
                                               num_experts=E)
            ids.view(torch.uint8), ids2.view(torch.uint8), w.view(torch.uint8)
        elif kind == "expert-major-without-weights":
            buf.dispatch(torch.randn(3, 64), topk_idx=torch.tensor([[0], [1], [2]]), num_experts=E,
                         layout="expert_major")
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        buf.destroy()


@pytest.mark.parametrize("kind", ["f64-weights-odd-k", "empty-nonunit-stride", "ll-fp8-zero-tokens-h128",
                                  "expert-major-without-weights", "empty-outputs-view"])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_former_bug_stays_fixed(pool, kind, backend):
    assert pool.run(known_bug, kind, backend) == [None, None]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_wait_statistics_wrap_instead_of_failing(dtype):
    """A wait longer than an int32 holds in nanoseconds (~2.1 s) wraps in an int32 statistics tensor, as the
    tensor's own integer arithmetic does, instead of raising after the exchange and breaking the Buffer."""
    from ubep_torch.buffer import _add_stats
    stats = torch.tensor([5, -3], dtype=dtype)
    waits = [3_000_000_000, 7]
    _add_stats(stats, waits)
    want = torch.tensor([5, -3], dtype=dtype) + torch.tensor(waits, dtype=torch.int64).to(dtype)
    assert stats.dtype == dtype and torch.equal(stats, want)
    if dtype == torch.int32:
        assert int(stats[0]) == 5 + 3_000_000_000 - (1 << 32)


def foreign_size_handle(ctx):
    """A handle made by a Buffer of another group size is refused before sending."""
    import torch.distributed as dist
    singles = [dist.new_group([r]) for r in range(ctx.world_size)]
    small = Buffer(singles[ctx.rank], 8 << 20, timeout_s=20.0)
    buf = _buffers(ctx, "tff")["B"]
    x = torch.randn(4, 64).bfloat16()
    topk = torch.tensor([[0, 1], [1, 2], [-1, -1], [3, 0]])
    _, _, _, _, h, _ = small.dispatch(x, topk_idx=topk, num_experts=4)
    small.destroy()
    try:
        buf.dispatch(x, handle=h)
    except ValueError as e:
        msg = str(e)
    else:
        return "accepted"
    recv_x, _, _, _, h2, _ = buf.dispatch(x, topk_idx=topk, num_experts=4)
    ranks_per_token = torch.tensor([1, 2, 0, 2]).view(4, 1)    # experts 0-1 live on rank 0, 2-3 on rank 1
    torch.testing.assert_close(buf.combine(recv_x, h2)[0].float(), x.float() * ranks_per_token)
    return msg


def test_handle_of_another_group_size_is_refused(pool):
    out = pool.run(foreign_size_handle)
    assert all("ranks" in o for o in out), out


def odd_but_valid(ctx):
    """Inputs that once passed the checks and then failed after the exchange (breaking the Buffer on every
    rank) or gave wrong results: each must now work. Returns the failures."""
    import warnings

    import numpy as np

    from ubep_torch.cost_model import CostModel
    buf = _buffers(ctx, "tff")["B"]
    R = ctx.world_size
    T, H, K, E = 4, 128, 2, 2 * R
    torch.manual_seed(ctx.rank)
    x = torch.randn(T, H).bfloat16()
    topk = torch.tensor([[0, 1], [1, 2], [-1, -1], [3, 0]])
    w = torch.rand(T, K)
    # the low-latency combine of the identity expert: every valid slot's weight times the token
    want = (x.float() * (w * (topk >= 0)).sum(1, keepdim=True)).bfloat16().float()
    fails = []

    def check(name, got):
        if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2):
            fails.append(f"{name}: max error {(got.float() - want).abs().max()}")

    # statistics tensors made in inference mode, updated outside it
    with torch.inference_mode():
        recv_stats, wait_stats = torch.zeros(E // R, dtype=torch.int32), torch.zeros(R, dtype=torch.int64)
    recv_x, count, h, _, _ = buf.low_latency_dispatch(x, topk, S.N_LL, E, use_fp8=False,
                                                      cumulative_local_expert_recv_stats=recv_stats,
                                                      dispatch_wait_recv_cost_stats=wait_stats)
    if not torch.equal(recv_stats, count.to(torch.int32)) or int(wait_stats.min()) < 0:
        fails.append(f"stats {recv_stats.tolist()} for counts {count.tolist()}, waits {wait_stats.tolist()}")
    # a strided out= made in inference mode
    with torch.inference_mode():
        out = torch.zeros(H, T, dtype=torch.bfloat16).t()
    check("inference out", buf.low_latency_combine(recv_x, topk, w, h, out=out)[0])
    check("inference out itself", out)
    # out= over the memory of topk_weights: the weights are read before the sum overwrites them
    recv_x, _, h, _, _ = buf.low_latency_dispatch(x, topk, S.N_LL, E, use_fp8=False)
    memory = torch.zeros(T * H, dtype=torch.bfloat16)
    shared_w = memory[:2 * T * K].view(torch.float32).view(T, K)
    shared_w.copy_(w)
    check("out over the weights", buf.low_latency_combine(recv_x, topk, shared_w, h, out=memory.view(T, H))[0])
    # a numpy integer for num_experts, as the constructor takes numpy integers
    recv_x, _, _, _, hn, _ = buf.dispatch(x, topk_idx=topk, num_experts=np.int64(E))
    # an on_report that raises: a warning, the call's results, and a usable Buffer
    def broken_report(kind, report):
        raise KeyError("observer bug")
    buf.set_cost_model(CostModel(), on_report=broken_report)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            recv_x, _, h, _, _ = buf.low_latency_dispatch(x, topk, S.N_LL, E, use_fp8=False)
            check("with a failing on_report", buf.low_latency_combine(recv_x, topk, w, h)[0])
        if not any("observer bug" in str(c.message) for c in caught):
            fails.append(f"no warning for the failing on_report: {[str(c.message) for c in caught]}")
    finally:
        buf.set_cost_model(None)
        buf.on_report = None
    recv_x, _, h, _, _ = buf.low_latency_dispatch(x, topk, S.N_LL, E, use_fp8=False)
    check("after", buf.low_latency_combine(recv_x, topk, w, h)[0])
    # numpy integers for the counts DeepEP's binding converts (former bug: refused, while num_experts took them)
    recv_x, _, h, _, _ = buf.low_latency_dispatch(x, topk, np.int64(S.N_LL), E, use_fp8=False)
    check("numpy N", buf.low_latency_combine(recv_x, topk, w, h)[0])
    for kw in ({"expert_alignment": np.int32(2)}, {"num_worst_tokens": np.int64(4 * R)}):
        recv_x, _, _, _, hn, _ = buf.dispatch(x, topk_idx=topk, num_experts=E, **kw)
        got = buf.combine(recv_x, hn)[0].float()
        reached = torch.zeros(T, R)
        reached.scatter_(1, topk.clamp(min=0) // (E // R), 1.0)
        reached[2] = 0          # (every slot of token 2 is -1)
        if not torch.allclose(got, x.float() * reached.sum(1, keepdim=True), rtol=1e-2, atol=1e-2):
            fails.append(f"numpy {kw}")
    # [n, 1] tensors with the stride of a transposed [1, n] one, which torch calls contiguous but no dtype
    # view takes (former bug: a RuntimeError): fp8 scales of H = 128, a hidden size of 1, combine rows of it
    xq = (torch.randn(T, 128) * 8).to(torch.float8_e4m3fn)
    sc_t = torch.rand(1, T).add(0.5).t()
    (rq, rs), _, _, _, _, _ = buf.dispatch((xq, sc_t), topk_idx=topk, num_experts=E)
    (rq2, rs2), _, _, _, _, _ = buf.dispatch((xq, sc_t.contiguous().clone()), topk_idx=topk, num_experts=E)
    if not (torch.equal(rq.view(torch.uint8), rq2.view(torch.uint8)) and torch.equal(rs, rs2)):
        fails.append("fp8 scales of stride (1, T)")
    x1 = torch.randn(1, T).bfloat16().t()
    recv_x, _, _, _, h1, _ = buf.dispatch(x1, topk_idx=topk, num_experts=E)
    back = buf.combine(torch.randn(1, recv_x.shape[0]).bfloat16().t().copy_(recv_x), h1)[0]
    if back.shape != (T, 1) or not torch.allclose(back.float(), x1.float() * reached.sum(1, keepdim=True),
                                                  rtol=1e-2, atol=1e-2):
        fails.append("hidden size 1 of stride (1, T)")
    return fails


def test_odd_but_valid_inputs_work(pool):
    assert pool.run(odd_but_valid) == [[], []]


def _small_setup(ctx, backend, H):
    """A Buffer for normal and low-latency calls of 4 tokens of hidden ``H``, top-2 over 2 experts per rank
    (20 s deadline), and inputs: ``(buf, x, topk, (E, T, H, N))``."""
    import torch.distributed as dist
    E, T, N = 2 * ctx.world_size, 4, 8
    buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, ctx.world_size, E),
                 low_latency_mode=True, timeout_s=20.0, backend=backend)
    torch.manual_seed(ctx.rank)
    x = torch.randn(T, H).bfloat16()
    return buf, x, torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]]), (E, T, H, N)


def zero_copy_buffer_after_destroy(ctx):
    """get_next_low_latency_combine_buffer of a destroyed Buffer (low-latency, and normal-mode): what it
    raised, per Buffer."""
    import torch.distributed as dist
    R = ctx.world_size
    E, T, H, N = 2 * R, 4, 128, 8
    out = []
    for ll in (True, False):
        buf = Buffer(dist.group.WORLD, 1 << 22, Buffer.get_low_latency_rdma_size_hint(N, H, R, E) if ll else 0,
                     low_latency_mode=ll, timeout_s=20.0)
        handle = buf.low_latency_dispatch(torch.randn(T, H).bfloat16(), torch.tensor([[0, 2]] * T), N, E,
                                          use_fp8=False)[2] if ll else (None, None, N, H, E)
        buf.destroy()
        try:
            buf.get_next_low_latency_combine_buffer(handle)
            out.append("returned")
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_destroyed_buffer_gives_no_zero_copy_buffer(pool):
    """(former bug: it returned a view of the unmapped memory's copy, and on a normal-mode Buffer raised a
    ValueError asking for low_latency_mode)"""
    for out in pool.run(zero_copy_buffer_after_destroy):
        assert all(o.startswith("UBEPBrokenError") and "destroyed" in o for o in out), out


def negated_views(ctx, backend):
    """Inputs that carry torch's negative bit (``torch._neg_view``: the values are the negation of the memory)
    give what their materialized values give: normal dispatch (x, weights) and combine (x, weights, bias),
    low-latency dispatch (bf16 and fp8) and combine (x, weights). Returns the failures."""
    buf, x, topk, (E, T, H, N) = _small_setup(ctx, backend, 128)
    w = torch.rand(T, 2)
    bias = torch.randn(T, H).bfloat16()
    neg = torch._neg_view
    fails = []

    def same(name, got, want):
        got, want = (got, want) if isinstance(got, (tuple, list)) else ((got,), (want,))
        for g, v in zip(got, want):
            if g is not None and not torch.equal(g, v):
                fails.append(name)
                return
    ref = buf.dispatch(-x, topk_idx=topk, topk_weights=-w, num_experts=E)
    got = buf.dispatch(neg(x), topk_idx=topk, topk_weights=neg(w), num_experts=E)
    same("dispatch", got[:3], ref[:3])
    ys = ref[0].float().mul(0.5).bfloat16()
    same("combine", buf.combine(neg(ys), got[4], topk_weights=neg(got[2]), bias=neg(bias))[:2],
         buf.combine(-ys, ref[4], topk_weights=-ref[2], bias=-bias)[:2])
    for fp8 in (False, True):
        ref = buf.low_latency_dispatch(-x, topk, N, E, use_fp8=fp8)
        ref = [t.clone() for t in (ref[0] if fp8 else (ref[0],))], ref[1].clone()
        got = buf.low_latency_dispatch(neg(x), topk, N, E, use_fp8=fp8)
        got = list(got[0]) if fp8 else [got[0]], got[1]
        same(f"low-latency counts (fp8 {fp8})", got[1], ref[1])
        for e, n in enumerate(ref[1].tolist()):     # (rows past each expert's count are not written)
            same(f"low-latency dispatch (fp8 {fp8})", [t[e, :n] for t in got[0]], [t[e, :n] for t in ref[0]])
    ref = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    want = buf.low_latency_combine(-ref[0], topk, -w, ref[2])[0].clone()
    got = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    same("low-latency combine", buf.low_latency_combine(neg(got[0]), topk, neg(w), got[2])[0], want)
    # routing held negated (the C checks read memory): the same results as the plain routing
    ntopk = neg(-topk)
    same("dispatch of a negated routing", buf.dispatch(x, topk_idx=ntopk, num_experts=E)[:2],
         buf.dispatch(x, topk_idx=topk, num_experts=E)[:2])
    got = buf.low_latency_dispatch(x, ntopk, N, E, use_fp8=False)
    same("low-latency counts of a negated routing", got[1], ref[1])
    # an out= whose memory holds the negation of its values: refused before anything is sent, Buffer usable
    try:
        buf.low_latency_combine(got[0], topk, w, got[2], out=neg(torch.empty(T, H, dtype=torch.bfloat16)))
        fails.append("negated out= taken")
    except ValueError as e:
        if "negative bit" not in str(e):
            fails.append(f"negated out=: {e}")
    got = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
    same("after the refused out=", buf.low_latency_combine(-got[0], topk, -w, got[2])[0], want)
    buf.destroy()
    return fails


def test_negated_views_give_their_values(pool):
    """(former bug: a bf16 x with the negative bit raised RuntimeError from a dtype view, and in a low-latency
    combine it broke the Buffer on every rank)"""
    for backend in ("auto", "torch"):
        assert pool.run(negated_views, backend) == [[], []], backend


def grad_weights_and_tuple_copies(ctx, backend):
    """Valid programs the checks of a call must leave alone. Low-latency combine with weights that require
    grad (a router's softmax), directly and through a recv hook: the weights are read as data. A normal
    combine through a plain-tuple copy of an older handle, when a newer handle has the same entries on one
    rank only (the copy cannot say which dispatch it answers, so it is not checked against the peers').
    Returns the failures."""
    buf, x, topk, (E, T, H, N) = _small_setup(ctx, backend, 64)
    w = torch.randn(T, 2, requires_grad=True).softmax(-1)
    fails = []
    for hook in (False, True):
        recv_x, _, h, _, _ = buf.low_latency_dispatch(x, topk, N, E, use_fp8=False)
        out = buf.low_latency_combine(recv_x, topk, w, h, return_recv_hook=hook)
        if hook:
            out[2]()
        err = float((out[0].float() - x.float() * w.detach().sum(1, keepdim=True)).abs().max())
        if err > 0.05 or out[0].requires_grad:
            fails.append(f"weights that require grad (hook {hook}): error {err}, grad {out[0].requires_grad}")
    # rank 0 routes the same way twice, rank 1 differently (experts 0-1 live on rank 0, 2-3 on rank 1)
    routes = [torch.tensor([[0], [2], [0], [2]])] * 2 if ctx.rank == 0 else \
        [torch.tensor([[0], [2], [-1], [-1]]), torch.tensor([[0], [-1], [2], [-1]])]
    xs = [torch.randn(T, H) for _ in range(2)]
    calls = [buf.dispatch(xi, topk_idx=r, num_experts=E) for xi, r in zip(xs, routes)]
    y = buf.combine(calls[0][0], tuple(t.clone() for t in calls[0][4]))[0]
    reach = (routes[0] >= 0).float()
    if not torch.allclose(y, reach * xs[0]):
        fails.append(f"plain-tuple copy of the older handle: error {(y - reach * xs[0]).abs().max()}")
    buf.destroy()
    return fails


def functional_bad_args(ctx):
    """ubep_torch.functional's low-latency calls with counts that are not integers, and weights, routing or
    expert outputs of the wrong kind, on every rank; then a valid round trip. Returns (what each bad call
    raised, the round trip's largest error)."""
    import torch.distributed as dist

    from ubep_torch import functional as UF
    R = ctx.world_size
    E, T, H, N = 2 * R, 4, 128, 8
    buf = Buffer(dist.group.WORLD, 0, Buffer.get_low_latency_rdma_size_hint(N, H, R, E), low_latency_mode=True,
                 timeout_s=20.0)
    x = torch.randn(T, H).bfloat16()
    topk = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    w = torch.rand(T, 2)
    raised = {}
    for name, n, e in (("N str", "8", E), ("N float", 8.9, E), ("N bool", True, E), ("N inf", float("inf"), E),
                       ("N float tensor", torch.tensor(8.0), E), ("E str", N, str(E)), ("E float", N, float(E))):
        try:
            UF.low_latency_dispatch(buf, x, topk, n, e)
            raised[name] = "accepted"
        except (TypeError, ValueError) as err:
            raised[name] = type(err).__name__
    recv_x, _, h = UF.low_latency_dispatch(buf, x, topk, N, E)
    for name, y, idx, wt in (("complex weights", recv_x, topk, w.to(torch.complex64)),
                             ("int weights", recv_x, topk, (w * 10).long()),
                             ("meta topk_idx", recv_x, topk.to("meta"), w),
                             ("nested y", torch.nested.nested_tensor([recv_x[0], recv_x[1]]), topk, w)):
        try:
            UF.low_latency_combine(buf, y, idx, wt, h)
            raised[name] = "accepted"
        except (TypeError, ValueError) as err:
            raised[name] = type(err).__name__
    y = UF.low_latency_combine(buf, recv_x, topk, w, h)
    err = float((y.float() - x.float() * w.sum(1, keepdim=True)).abs().max())
    buf.destroy()
    return raised, err


def test_functional_low_latency_calls_refuse_counts_and_tensors_of_the_wrong_kind(pool):
    """(former bugs: counts went through int(), so '8', 8.9 and True were taken and inf raised
    OverflowError; complex and integer weights were taken, the imaginary part dropped; a meta topk_idx
    raised NotImplementedError)"""
    for raised, err in pool.run(functional_bad_args):
        assert all(v in ("TypeError", "ValueError") for v in raised.values()), raised
        assert err < 0.05, err


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_valid_programs_the_checks_leave_alone(pool, backend):
    assert pool.run(grad_weights_and_tuple_copies, backend) == [[], []]


def test_errors_before_the_peers_are_posted_as_refusals():
    """Any error (not only ValueError/TypeError) raised before a call reaches the peers is posted to them,
    so they stop waiting, and so is an interrupt (a loop that catches KeyboardInterrupt goes on with its next
    call, which the peers must not take for this one); protocol errors are not (they are about the peers)."""
    import types

    from ubep_torch import UBEPTimeoutError, functional
    from ubep_torch.errors import refusal
    assert refusal(ValueError()) and refusal(RuntimeError()) and refusal(MemoryError())
    assert not refusal(UBEPTimeoutError("p", 0, [1], 1.0)) and refusal(KeyboardInterrupt())
    posted = []
    raised = [RuntimeError("allocation failed"), KeyboardInterrupt()]

    def failing_layout(*args, **kwargs):
        raise raised.pop(0)
    fake = types.SimpleNamespace(rank=0, group_size=2, _calls=3, _seq=3,
                                 _refuse=lambda what: posted.append(what), get_dispatch_layout=failing_layout)
    x, topk = torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="allocation failed"):
        functional.dispatch(fake, x, topk, torch.ones(3, 1), 2)
    assert posted == ["dispatch"]   # (the call it prepares: its region is skipped if cancelled)
    with pytest.raises(KeyboardInterrupt):
        functional.dispatch(fake, x, topk, torch.ones(3, 1), 2)
    assert posted == ["dispatch", "dispatch"]


def count_group_past_the_cost_model(ctx):
    """A Buffer whose count group its cost model cannot report (a CM384 die has 48 AIVs), set at
    construction or with set_cost_model: ValueError on every rank."""
    import dataclasses

    from ubep_torch.cost_model import CostModel
    from ubep_torch.topology import CM384
    errors = []
    try:
        Buffer(ctx.group, 1 << 20, 0, num_count_aivs=60, cost_model=CostModel())
    except ValueError as e:
        errors.append(str(e))
    with Buffer(ctx.group, 1 << 20, 0, num_count_aivs=48) as buf:
        try:
            buf.set_cost_model(CostModel())
        except ValueError as e:
            errors.append(str(e))
        buf.set_cost_model(CostModel(params=dataclasses.replace(CM384, aivs_per_die=64)))   # (a die of 64 takes it)
        assert buf.cost_model is not None
    return errors


def test_a_count_group_past_the_cost_models_die_is_refused(pool):
    """(former bug: accepted, then every call's report failed with a warning)"""
    for errors in pool.run(count_group_past_the_cost_model):
        assert len(errors) == 2 and all("a count group takes at most 47" in e for e in errors), errors


def test_statistics_tensors_overlap_element_by_element():
    """(former bug: interleaved columns of one table, which share no element, were refused as overlapping)"""
    import functools

    from ubep_torch.utils import share_memory
    _overlap = functools.partial(share_memory, elementwise=True)
    table = torch.zeros(8, 2, dtype=torch.int64)
    assert not _overlap(table[:4, 0], table[:2, 1])
    assert _overlap(table[:4, 0], table[2:6, 0]) and _overlap(table[:, 0], table[3:4, 0])
    shared = torch.zeros(8, dtype=torch.int64)
    assert _overlap(shared[:4], shared[:2]) and not _overlap(shared[:4], shared[4:])
    assert _overlap(shared.view(torch.int32)[1:2], shared[:1])       # (other dtypes: byte by byte)
    assert not _overlap(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))


def test_row_metadata_past_a_meta_block_names_what_fills_it():
    """(former message: 'reduce top-k (at most 52) or the hidden size' for every layout, while float32
    weights fit top-k 60 and float64 weights not 41, and the hidden size matters in SP alone)"""
    fits = P.row_format("tff", (("x", 256),), 2 * 60)
    fits.check_fits()
    for sync, K, wsz in (("tff", 61, 1), ("tff", 41, 2)):
        with pytest.raises(ValueError, match="reduce top-k$") as e:
            P.row_format(sync, (("x", 256),), K + K * wsz).check_fits()
        assert "at most 52" not in str(e.value) and "bitmap" not in str(e.value), e.value
    with pytest.raises(ValueError, match="SP escape bitmap.*reduce top-k or the hidden size"):
        P.row_format("sp", (("x", 1 << 21),), 2 * 8).check_fits()       # (one bitmap bit per block)
    with pytest.raises(ValueError, match="reduce top-k$") as e:           # (a one-word bitmap: no smaller one)
        P.row_format("sp", (("x", 512),), 120).check_fits()
    assert "hidden size" not in str(e.value), e.value


def test_argument_checks_without_a_process_group():
    """Constructor arguments, size helpers and Config name the bad argument."""
    import types

    from ubep_torch import Config, functional, nn
    with pytest.raises(TypeError, match="group"):
        Buffer(42)
    assert Buffer.num_sms == 20 and Config().num_sms == 20      # DeepEP's default
    with pytest.raises(TypeError, match="num_sms"):
        Buffer.set_num_sms("x")
    for odd in (1, 23):                                          # DeepEP asserts an even count
        with pytest.raises(ValueError, match="num_sms must be even"):
            Buffer.set_num_sms(odd)
    assert Buffer.num_sms == 20 and Buffer.is_sm90_compiled()
    with pytest.raises(ValueError, match="enable_shrink=True"):
        Buffer(None, enable_shrink=True)
    with pytest.raises(ValueError, match="comm="):
        Buffer(None, comm=object())
    # (former bugs: a string was taken by its truth value, True as 1 AIV or 1 s)
    for flag in ("low_latency_mode", "explicitly_destroy", "allow_mnnvl", "allow_nvlink_for_low_latency_mode"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            Buffer(None, **{flag: "no"})
    with pytest.raises(TypeError, match="num_count_aivs must be an integer"):
        Buffer(None, num_count_aivs=True)
    with pytest.raises(ValueError, match="num_count_aivs must be at least 1"):
        Buffer(None, num_count_aivs=0)
    # (former bug: a numpy integer was refused, which Config(num_count_aivs=...) takes; here the group is next)
    import numpy as np
    with pytest.raises(ValueError, match="process group"):
        Buffer(None, num_count_aivs=np.int64(8))
    for seconds in ("5", True):
        with pytest.raises(TypeError, match="timeout_s must be a number of seconds"):
            P.default_timeout(seconds)
    assert P.default_timeout(5) == 5.0 or os.environ.get("UBEP_TIMEOUT_S")
    # (former bugs: OverflowError for an int past any float, RuntimeError for a meta tensor)
    for seconds in (10 ** 400, torch.tensor(1.0, device="meta")):
        with pytest.raises(ValueError, match="timeout_s must be a .*number of seconds"):
            P.default_timeout(seconds)
    assert P.check_deadline("timeout_s", torch.tensor(2.0)) == 2.0
    with pytest.raises(ValueError, match="num_sms"):
        Config(num_sms=0)
    with pytest.raises(ValueError, match="num_ranks"):
        Config().get_nvl_buffer_size_hint(256, -2)
    with pytest.raises(ValueError, match="num_ranks"):
        Buffer.get_low_latency_rdma_size_hint(8, 128, 0, 4)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank"):
        Buffer.get_low_latency_rdma_size_hint(-1, 128, 2, 4)
    with pytest.raises(TypeError, match="num_ranks"):
        Buffer.get_dispatch_config("x")
    assert Buffer.get_low_latency_rdma_size_hint(8, 128, 2, 4) > 0
    fake = types.SimpleNamespace(rank=0, group_size=2)
    x, topk = torch.randn(3, 8), torch.zeros(3, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match="x must be a tensor"):
        functional.dispatch(fake, x.tolist(), topk, torch.ones(3, 1), 2)
    with pytest.raises(TypeError, match="topk_weights must be a float tensor"):
        functional.dispatch(fake, x, topk, topk, 2)
    with pytest.raises(ValueError, match="functional.dispatch: x is a meta tensor"):
        functional.dispatch(fake, x.to("meta"), topk, torch.ones(3, 1), 2)
    # (former bugs: ZeroDivisionError, a negative-dimension RuntimeError, a string taken by its truth value,
    # an fp8 x that passed the check and failed inside)
    for bad, error in ((dict(hidden=0), ValueError), (dict(ffn_hidden=-2), ValueError),
                       (dict(shared_expert_hidden=-1), ValueError), (dict(top_k=1.5), TypeError),
                       (dict(normalize_topk="no"), TypeError),
                       # (former bugs: torch's storage-size RuntimeError)
                       (dict(hidden=2 ** 62), ValueError), (dict(num_experts=2 ** 62), ValueError),
                       (dict(ffn_hidden=2 ** 62), ValueError)):
        with pytest.raises(error, match="ubep_torch.nn.MoE"):
            nn.MoE(**{**dict(hidden=8, ffn_hidden=16, num_experts=2, top_k=1), **bad})
    moe = nn.MoE(hidden=8, ffn_hidden=16, num_experts=2, top_k=1)
    with pytest.raises(TypeError, match="float tensor"):
        moe(torch.zeros(4, 8).to(torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="dense tensor"):
        moe(torch.zeros(4, 8).to_sparse())
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        moe(torch.randn(4, 16))
    with pytest.raises(TypeError, match="float tensor"):
        moe(torch.zeros(4, 8, dtype=torch.int64))
    assert moe(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    # (former bugs: torch's NotImplementedError on the dense path, AttributeError)
    with pytest.raises(ValueError, match="meta tensor"):
        moe(torch.randn(4, 8, device="meta"))
    with pytest.raises(TypeError, match="state dict"):
        moe.load_dense_state_dict(None)
    with pytest.raises(TypeError, match="names to tensors"):       # (former bugs: AttributeError, IndexError)
        moe.load_dense_state_dict({1: torch.zeros(2)})
    with pytest.raises(ValueError, match="0-dim"):
        moe.load_dense_state_dict({**moe.state_dict(), "experts.w_gate": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="load_dense_state_dict: the state is not a dense MoE"):
        moe.load_dense_state_dict(nn.MoE(hidden=8, ffn_hidden=16, num_experts=4, top_k=1).state_dict())
    # an expert-parallel rank's own state is refused on every rank, the one whose slice of it would fit too
    # (former bug: rank 0 of 2 loaded a 2-expert shard as the first two of 4 experts; rank 1 refused it)
    class Rank0Of2:          # (what MoE reads of its Buffer when it is built)
        rank, group_size = 0, 2
    ep = nn.MoE(hidden=8, ffn_hidden=16, num_experts=4, top_k=1, buffer=Rank0Of2())
    with pytest.raises(ValueError, match="not a dense MoE of this layer's sizes: experts.w_gate has 2 rows"):
        ep.load_dense_state_dict(ep.state_dict())
    dense = nn.MoE(hidden=8, ffn_hidden=16, num_experts=4, top_k=1)
    ep.load_dense_state_dict(dense.state_dict())
    assert torch.equal(ep.experts.w_gate, dense.experts.w_gate[:2])


def test_a_rebuilt_handle_holds_host_tensors_only():
    """A call passes over the tensors of a handle object in its host-memory check (they are the Buffer's own):
    a handle rebuilt from a tuple with a tensor outside host memory, or of another layout, is refused where
    it is rebuilt."""
    from ubep_torch.buffer import DispatchHandle

    def items(last):
        return (torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.int32),
                torch.zeros(2, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                torch.zeros(0, 2, dtype=torch.bool), last)
    assert DispatchHandle.from_tuple(items(torch.zeros(0, 2, dtype=torch.int32)), 0, 2).num_recv == 0
    with pytest.raises(ValueError, match=r"handle\[5\] is a meta tensor"):
        DispatchHandle.from_tuple(items(torch.zeros(0, 2, dtype=torch.int32, device="meta")), 0, 2)
    with pytest.raises(TypeError, match=r"handle\[5\] is a tensor of layout torch.sparse_coo"):
        DispatchHandle.from_tuple(items(torch.zeros(1, 2, dtype=torch.int32).to_sparse()), 0, 2)
