"""The C data path (``backend="native"``, what ``"auto"`` picks when it was built) against the torch path.

Spec: for the same calls, every output and every byte a sender stores into a peer's memory are identical
to ``backend="torch"``; the C module is built by ``make install`` (the test says so when it is missing).
"""
from __future__ import annotations

import os
import platform
import shutil
import sysconfig
from typing import Optional

import pytest
import torch

from tests import triton_rank_fns as F
from ubep_torch import native_engine
from ubep_torch import protocol as P
from ubep_torch.engine import Destination, SendJob, TorchEngine
from ubep_torch.testing import RankPool
from ubep_torch.utils import env_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYNCS = ("tff", "dc", "sp", "sw")
needs_native = pytest.mark.skipif(not native_engine.available(), reason="ubep_torch._native was not built")


def _c_compiler() -> Optional[str]:
    """The C compiler setuptools would use here, if one is on PATH."""
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(cc[0]) if cc else None


def test_native_module_is_built():
    """``make install`` compiles the C module wherever a C compiler exists (the module is optional: without
    one, or with ``UBEP_NATIVE=0``, everything runs on the torch path)."""
    if not env_flag("UBEP_NATIVE", True):
        pytest.skip("UBEP_NATIVE is off")
    if not native_engine.available() and _c_compiler() is None:
        pytest.skip("no C compiler on PATH: the package runs on the torch path")
    assert native_engine.available(), "ubep_torch._native is missing: reinstall with a C compiler (make install)"


def _rows_case(fields, meta_words, n=7, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = P.row_format("tff", tuple(fields), meta_words)
    data = [torch.randint(0, 256, (T, nbytes), dtype=torch.uint8, generator=g) for _, nbytes in fields]
    meta = torch.randint(-1000, 1000, (T, meta_words), dtype=torch.int32, generator=g) if meta_words else None
    sel = torch.randperm(T, generator=g)[:n]
    patch = torch.randint(0, 8, (n,), dtype=torch.int32, generator=g) if meta_words else None
    return fmt, data, meta, sel, patch


def _x86() -> bool:
    """Streaming stores exist (native.c's STREAMING_STORES: x86-64 only)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def stores():
    """``native_engine.store_policy``, set back after the test to the policy it had (``UBEP_STORES``'s in a
    run under it: a run with ``UBEP_STORES=streaming`` stays streaming after these tests)."""
    before = native_engine.store_policy().get("policy", "auto")
    yield native_engine.store_policy
    native_engine.store_policy(before)


@needs_native
@pytest.mark.parametrize("policy", ["plain", "streaming"])
@pytest.mark.parametrize("fields,meta_words", [
    ((("x", 256 * 2),), 4),                       # one field, two blocks
    ((("x", 7168 * 2),), 16),                     # 29 full blocks and a partial one
    ((("x", 480 * 3),), 1),                       # whole blocks only
    ((("x", 1000), ("scales", 8 * 4)), 1),        # fp8 payload + scales
    ((("x", 4),), 0),                             # a tiny payload, no meta items
])
def test_stores_into_peer_memory_are_byte_identical(fields, meta_words, policy, stores):
    """Every byte of the slots (heads, payload, zeroed padding, patched meta item, flags) matches torch's
    ``write_rows`` of the same staged rows, and the received payload, meta items and source tokens too, with
    plain and with streaming stores."""
    fmt, data, meta, sel, patch = _rows_case(fields, meta_words)
    stores(policy)
    out = {}
    for name, eng in (("torch", TorchEngine()), ("native", native_engine.NativeEngine())):
        st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(data[0].shape[0]), 3)
        dst = torch.full((sel.numel() + 2, fmt.blocks, P.BLOCK_BYTES), 0xA5, dtype=torch.uint8)  # stale bytes
        assert dst.data_ptr() % 64 == 0     # (slots are: streaming stores need whole lines)
        eng.write_rows(fmt, st, None, sel, dst, P.flag_word(5, P.REGION_DISPATCH), meta_patch=patch)
        assert eng.rows_arrived(fmt, dst[: sel.numel()], P.flag_word(5, P.REGION_DISPATCH))
        assert not eng.rows_arrived(fmt, dst, P.flag_word(5, P.REGION_DISPATCH))   # stale rows: not arrived
        assert not eng.rows_arrived(fmt, dst[: sel.numel()], P.flag_word(3, P.REGION_DISPATCH))
        outs = [torch.zeros(sel.numel(), nbytes, dtype=torch.uint8) for _, nbytes in fmt.fields]
        got_meta = eng.unpack_rows(fmt, dst[: sel.numel()], outs)
        out[name] = (dst, outs, got_meta)
    assert torch.equal(out["torch"][0], out["native"][0])
    for a, b in zip(out["torch"][1], out["native"][1]):
        assert torch.equal(a, b)
    for i, d in enumerate(data):
        assert torch.equal(out["native"][1][i], d[sel])
    assert torch.equal(out["torch"][2], out["native"][2])
    state = stores()
    assert state["policy"] == policy and state["sends"][policy] == 1, state


@needs_native
def test_store_policy_auto_keeps_the_cheaper(stores):
    """``auto`` times both kinds of stores on sends of 32 KiB or more, for each kind of send apart, and uses
    the one that measured cheaper; smaller sends take the way in use (plain before any measured send);
    every way gives the same bytes."""
    fmt, data, meta, sel, patch = _rows_case(((("x", 7168 * 2),)), 4, n=24, T=24)
    eng = native_engine.NativeEngine()
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(24), 1)
    assert 24 * fmt.blocks * P.BLOCK_BYTES >= 32 << 10 > 2 * fmt.blocks * P.BLOCK_BYTES
    flag = P.flag_word(9, P.REGION_COMBINE)
    stores("plain")
    ref = torch.zeros(24, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    eng.write_rows(fmt, st, None, sel, ref, flag, meta_patch=patch)
    stores("auto")
    dst = torch.zeros_like(ref)
    eng.write_rows(fmt, st, None, sel[:2], dst[:2], flag, meta_patch=patch[:2])     # small: plain, not timed
    state = stores()
    assert state["sends"] == {"plain": 1, "streaming": 0}, state
    assert state["kinds"]["combine"]["plain_ns_per_kib"] == 0.0, state
    for i in range(40):
        dst.zero_()
        eng.write_rows(fmt, st, None, sel, dst, flag, meta_patch=patch)
        assert torch.equal(dst, ref), i
        k = stores()["kinds"]["combine"]
        best = "streaming" if 0.0 < k["streaming_ns_per_kib"] < k["plain_ns_per_kib"] else "plain"
        assert k["in_use"] == best, (i, k)
    state = stores()
    assert state["kinds"]["combine"]["plain_ns_per_kib"] > 0.0, state
    assert state["kinds"]["combine"]["streaming_ns_per_kib"] > 0.0, state
    assert state["sends"]["plain"] > 1 and state["sends"]["streaming"] >= 1, state
    assert all(k["plain_ns_per_kib"] == k["streaming_ns_per_kib"] == 0.0          # (measured apart)
               for name, k in state["kinds"].items() if name != "combine"), state
    with pytest.raises(ValueError, match="store policy must be one of"):
        stores("fast")


def _ctrl_head(eng, fmt, data, meta, sel, patch, flag, T) -> list:
    """Head words 1..3 of the first control block of a native send phase of rows ``sel`` (of ``flag``)."""
    job = _send_job(eng, fmt, data, meta, [sel], [patch], [[1, 2]], flag, T)
    eng.send_phase(job)
    return job.dests[0].ctrl.view(torch.int64)[0, 1:4].tolist()


@needs_native
def test_store_policy_counts_the_receive_side(stores):
    """For normal dispatch and combine, ``auto`` adds to a way's stores what reading rows stored that way costs
    the peers that read them, as their control messages report it, once both ways are reported: cheaper
    stores whose rows are dear to read lose. A rank's own reads are what it reports, for each kind apart, in
    the head of its control messages of that kind. Low-latency sends count their stores only."""
    fmt, data, meta, sel, patch = _rows_case(((("x", 7168 * 2),)), 4, n=24, T=24)
    eng = native_engine.NativeEngine()
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(24), 1)
    dst = torch.zeros(24, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    nbytes = 24 * fmt.blocks * P.BLOCK_BYTES
    second_per_kib = 1e9 * 1024 / nbytes       # (a read of those rows that took a second)
    code = {"plain": 1, "streaming": 2}
    c = native_engine._native
    stores("auto")
    for kind, name in ((P.REGION_DISPATCH, "dispatch"), (P.REGION_LL_COMBINE, "ll_combine")):
        normal = kind == P.REGION_DISPATCH
        flag = P.flag_word(9, kind)
        for _ in range(24):      # both ways measured: first touches, plain stores, a try of streaming, ...
            eng.write_rows(fmt, st, None, sel, dst, flag, meta_patch=patch)
        k = stores()["kinds"][name]
        assert k["plain_ns_per_kib"] > 0.0 and k["streaming_ns_per_kib"] > 0.0, k
        cheaper = "streaming" if k["streaming_ns_per_kib"] < k["plain_ns_per_kib"] else "plain"
        other = "plain" if cheaper == "streaming" else "streaming"
        assert k["in_use"] == cheaper, k
        # this rank reading its peers' rows, a second for rows of the cheaper stores and a microsecond for
        # the others (the first two reads, first touches, are not timed; a way not said, or fewer bytes
        # than are timed, count for nothing): reported, not weighed in its own choice
        for _ in range(3):
            c.store_read(flag, code[cheaper], nbytes, 10 ** 9)
        c.store_read(flag, code[other], nbytes, 1000)
        c.store_read(flag, 0, nbytes, 1)
        c.store_read(flag, code[other], 1000, 10 ** 9)
        k = stores()["kinds"][name]
        reads = {cheaper: second_per_kib, other: 1000 * 1024 / nbytes} if normal else {cheaper: 0.0, other: 0.0}
        assert k[f"{cheaper}_read_ns_per_kib"] == pytest.approx(reads[cheaper]), k
        assert k[f"{other}_read_ns_per_kib"] == pytest.approx(reads[other]) and k["in_use"] == cheaper, k
        if normal:
            # its control messages of this kind say them (ns per MiB), with the way of their rows (a send
            # too small to be timed: plain stores); those of the other normal kind say that kind's
            head = _ctrl_head(eng, fmt, data, meta, sel[:4], patch[:4], flag, 24)
            assert head == [1, round(reads["plain"] * 1024), round(reads["streaming"] * 1024)], head
            assert _ctrl_head(eng, fmt, data, meta, sel[:4], patch[:4], P.flag_word(9, P.REGION_COMBINE),
                              24) == [1, 0, 0]
            # rows of a way not read for a while (a peer's try of the way not in use): a new estimate
            for _ in range(9):
                c.store_read(flag, code[cheaper], nbytes, 10 ** 9)
            c.store_read(flag, code[other], nbytes, 4000)
            assert stores()["kinds"][name][f"{other}_read_ns_per_kib"] == pytest.approx(4000 * 1024 / nbytes)
        # the peers report that reading this rank's rows of the cheaper stores costs a second: weighed once
        # both ways are reported
        reports = {cheaper: second_per_kib * 1024, other: 1024.0}      # (ns per MiB)
        c.store_peer_reads(flag, reports["plain"] if cheaper == "plain" else 0.0,
                           reports["streaming"] if cheaper == "streaming" else 0.0)
        assert stores()["kinds"][name]["in_use"] == cheaper
        c.store_peer_reads(flag, reports["plain"], reports["streaming"])
        k = stores()["kinds"][name]
        if normal:
            assert k[f"peers_{cheaper}_read_ns_per_kib"] == pytest.approx(second_per_kib), k
            assert k[f"peers_{other}_read_ns_per_kib"] == pytest.approx(1.0) and k["in_use"] == other, k
        else:
            assert k["peers_plain_read_ns_per_kib"] == k["peers_streaming_read_ns_per_kib"] == 0.0, k
            assert k["in_use"] == cheaper, k


@needs_native
def test_store_policy_from_environment(monkeypatch, stores):
    """``UBEP_STORES`` sets the policy when the process's first native engine is built, unless
    ``store_policy`` chose one; a bad value is a ValueError that names the variable."""
    monkeypatch.setattr(native_engine, "_env_applied", "")
    monkeypatch.setenv("UBEP_STORES", "streaming")
    native_engine.NativeEngine()
    assert stores()["policy"] == "streaming"
    stores("plain")                        # an explicit choice outlasts the variable
    native_engine.NativeEngine()
    assert stores()["policy"] == "plain"
    monkeypatch.setattr(native_engine, "_env_applied", "")
    monkeypatch.setenv("UBEP_STORES", "streaming")
    stores("plain")                        # (made before the first engine of the process, too)
    native_engine.NativeEngine()
    assert stores()["policy"] == "plain"
    monkeypatch.setenv("UBEP_STORES", "sometimes")
    with pytest.raises(ValueError, match="UBEP_STORES"):
        native_engine.NativeEngine()


@needs_native
def test_token_reorder_scatters_to_final_rows():
    """``unpack_to``: row i lands in row at[i] of every output, with its first meta item and source token."""
    fmt, data, meta, sel, patch = _rows_case((("x", 1000), ("scales", 32)), 1, n=6, T=6)
    eng = native_engine.NativeEngine()
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(6), 1)
    rows = torch.zeros(6, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    eng.write_rows(fmt, st, None, sel, rows, 77, meta_patch=patch)
    at = torch.tensor([9, 0, 4, 2, 7, 5])
    outs = [torch.zeros(10, 1000, dtype=torch.uint8), torch.zeros(10, 32, dtype=torch.uint8)]
    k = torch.full((10, 1), -1, dtype=torch.int32)
    src = torch.full((10,), -1, dtype=torch.int32)
    assert eng.unpack_to(fmt, rows, at, outs, k, src)
    assert torch.equal(outs[0][at], data[0][sel]) and torch.equal(outs[1][at], data[1][sel])
    assert torch.equal(k[at, 0], patch) and torch.equal(src[at], sel.to(torch.int32))
    untouched = torch.tensor([1, 3, 6, 8])
    assert bool((outs[0][untouched] == 0).all()) and bool((src[untouched] == -1).all())
    # not TFF, or an output that is not addressable row by row: declined, nothing written
    assert not eng.unpack_to(P.row_format("sp", fmt.fields, 1), rows, at, outs, k, src)
    assert not eng.unpack_to(fmt, rows, at, [outs[0][:, ::2], outs[1]], k, src)


@pytest.fixture(scope="module")
def pool():
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with RankPool(2, env=env) as p:
        yield p


@needs_native
def test_normal_calls_read_rows_by_the_way_they_were_stored(pool):
    """In normal round trips every rank learns from the control messages how the peers stored their rows,
    times reading them and reports it back: after calls large enough to be measured (among them each rank's
    first try of streaming stores, where the CPU has them), both kinds have read estimates of both ways,
    its own and its peers'."""
    ways = ("plain", "streaming") if _x86() else ("plain",)
    states = pool.run(F.under_store_policy, "auto", F.measured_round_trips)
    for r, state in enumerate(states):
        for name in ("dispatch", "combine"):
            k = state["kinds"][name]
            assert all(k[f"{w}_read_ns_per_kib"] > 0.0 and k[f"peers_{w}_read_ns_per_kib"] > 0.0 for w in ways), \
                (name, k)
            # what a rank weighs is what its peer reported of the same kind (its own estimate then; one or two
            # reads since move it by a quarter each at most)
            peer = states[1 - r]["kinds"][name]
            for w in ways:
                assert 0.5 < k[f"peers_{w}_read_ns_per_kib"] / peer[f"{w}_read_ns_per_kib"] < 2.0, (name, w, k, peer)
        assert all(k[f"{who}{w}_read_ns_per_kib"] == 0.0 for name, k in state["kinds"].items()
                   if name.startswith("ll_") for who in ("", "peers_") for w in ("plain", "streaming")), state


@needs_native
@pytest.mark.parametrize("sync", SYNCS)
def test_normal_mode_same_bits(pool, sync):
    """dispatch, weighted-reduced combine, cached dispatch, expert-major dispatch and combine; NaN,
    infinities, signed zeros and subnormals in x; a hidden size that ends in a partial block."""
    F.assert_all_same(pool.run(F.normal_equivalence, sync, backend="native", special=True))
    F.assert_all_same(pool.run(F.normal_equivalence, sync, backend="native", H=1000, T=40, K=5, E=8))


@needs_native
def test_calls_that_repeat_a_routing_take_one_engine_step_with_the_same_bits(pool):
    """Dispatch and combine of a routing seen in the last call: sent, checked and received in one C call
    each, with the outputs of the torch path."""
    res = pool.run(F.steady_equivalence)
    F.assert_all_same(res)
    for r in res:      # (the first call of the routing takes the general path: nothing kept to expect)
        assert r["steady"].get("dispatch 0", 0) >= 3 and r["steady"].get("combine 0", 0) >= 3, res


@needs_native
def test_one_engine_step_calls_of_two_row_sizes_in_turn_keep_the_same_bits(pool):
    """A repeated routing whose calls take two hidden sizes in turn: every one-step call runs with the engine
    arguments kept for its own row size, and the bits are the torch path's."""
    res = pool.run(F.steady_equivalence, calls=10, sizes=(1000, 520))
    F.assert_all_same(res)
    for r in res:      # (the first call of each row size takes the general path)
        assert r["steady"].get("dispatch 0", 0) >= 7 and r["steady"].get("combine 0", 0) >= 7, res


@needs_native
def test_one_engine_step_calls_of_fp8_rows_keep_the_same_bits(pool):
    """A repeated routing of fp8 rows and their scales (two payload fields): the one-step calls' bits are the
    torch path's."""
    res = pool.run(F.steady_equivalence, H=1024, fp8=True)
    F.assert_all_same(res)
    for r in res:
        assert r["steady"].get("dispatch 0", 0) >= 3 and r["steady"].get("combine 0", 0) >= 3, res


@needs_native
@pytest.mark.parametrize("case", ["late peer", "new routing on one rank"])
def test_one_engine_step_that_finds_other_messages_goes_on_the_general_way(pool, case):
    """A peer that is late for the engine's wait (rank 0 waits 0 ns), or that routes anew while this rank
    repeats its routing: the step finds messages missing or other than the last ones, and the call goes on
    the general way, with the same bits."""
    kw = {"spin_ns": 0, "lag_s": 0.005} if case == "late peer" else {"change_at": 2}
    res = pool.run(F.steady_equivalence, **kw)
    F.assert_all_same(res)
    status = 3 if case == "late peer" else 1     # (a message missing, or one not as expected)
    assert res[0]["steady"].get(f"dispatch {status}", 0) + res[0]["steady"].get(f"combine {status}", 0) >= 2, res


@needs_native
def test_two_routings_in_turn_take_one_engine_step_each(pool):
    """Two routings of other rows per rank pair, one after the other: the Buffer keeps the messages of both, so
    from the third call on every dispatch and combine is one C call (against the messages of the same routing,
    two calls before), with the torch path's bits."""
    res = pool.run(F.steady_equivalence, calls=8, every_call="two in turn")
    F.assert_all_same(res)
    for r in res:
        assert r["steady"].get("dispatch 0", 0) >= 5 and r["steady"].get("combine 0", 0) >= 5, res


@needs_native
def test_a_late_peer_does_not_pause_the_tries_of_new_routings(pool):
    """New routings of the same rows per rank pair, rank 1 late to every call and no wait in the one-step calls:
    rank 0's tries find a message missing, not other messages, so they go on call after call (a pause is for
    rows that changed); the bits are the torch path's."""
    res = pool.run(F.steady_equivalence, calls=6, spin_ns=0, lag_s=0.005, every_call="same rows")
    F.assert_all_same(res)
    assert res[0]["steady"].get("dispatch 3", 0) >= 4 and not res[0]["steady"].get("dispatch 1"), res


@needs_native
@pytest.mark.parametrize("K,E", [(3, 8), (8, 256)])
def test_new_routings_with_the_same_rows_per_rank_pair_take_one_engine_step(pool, K, E):
    """Every rank routes anew in every call with as many rows for each rank as before: the rows each rank
    sends each rank repeat in number while the tokens, the per-expert counts and the rank matrix change, so
    from the second call on the dispatch is one C call that reads those counts, and the combine one C call
    of the arguments kept for the last routing with this one's token lists; outputs, counts, handles and
    sums are the torch path's (256 experts: control messages of three blocks)."""
    res = pool.run(F.steady_equivalence, calls=8, K=K, E=E, every_call="same rows")
    F.assert_all_same(res)
    for r in res:      # (the first call may find the messages of an earlier test kept: other rows, and a pause)
        assert r["steady"].get("dispatch 0", 0) >= 6 and r["steady"].get("combine 0", 0) >= 6, res


@needs_native
def test_new_routings_whose_rows_change_try_one_engine_step_less_and_less(pool):
    """Every rank routes anew in every call and the rows per rank pair change too: a one-step dispatch that
    finds other messages pauses the tries of new routings for longer each time, and the bits are the torch
    path's."""
    res = pool.run(F.steady_equivalence, calls=24, K=2, E=8, every_call="any")
    F.assert_all_same(res)
    for r in res:
        assert r["steady"].get("dispatch 1", 0) <= 8, res


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_normal_mode_other_dtypes_same_bits(pool, dtype):
    F.assert_all_same(pool.run(F.normal_equivalence, "tff", backend="native", dtype=getattr(torch, dtype),
                              special=True))


@needs_native
def test_normal_mode_fp8_same_bits(pool):
    F.assert_all_same(pool.run(F.normal_equivalence, "tff", fp8=True, backend="native"))


@needs_native
@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("use_fp8", (False, True))
def test_low_latency_same_bits(pool, sync, use_fp8):
    F.assert_all_same(pool.run(F.ll_equivalence, sync, use_fp8=use_fp8, backend="native", special=not use_fp8))


@needs_native
@pytest.mark.parametrize("policy", ["plain", "streaming"])
def test_both_store_ways_same_bits(pool, policy):
    """Normal and low-latency calls (a hidden size that ends in a partial block, and fp8 rows with their
    scales) with every row stored into the peers' slots the one way or the other."""
    for fn, kw in ((F.normal_equivalence, dict(H=1000, T=40, K=5, E=8)), (F.normal_equivalence, dict(fp8=True)),
                   (F.ll_equivalence, dict(T=8, K=8, E=16, N=8, H=7168)), (F.ll_equivalence, dict(use_fp8=True))):
        results = pool.run(F.under_store_policy, policy, fn, "tff", backend="native", **kw)
        F.assert_all_same(results)
        assert all(r["sends"] > 0 for r in results), (fn.__name__, kw, [r["sends"] for r in results])


@needs_native
@pytest.mark.parametrize("use_fp8,hook", [(False, False), (True, False), (False, True), (True, True)])
def test_low_latency_calls_take_one_engine_step_to_receive_with_the_same_bits(pool, use_fp8, hook):
    """The usual low-latency calls (TFF, C stores, new routings) receive in one engine call each, with the torch
    path's bits: bf16 and fp8 rows, the own rows copied from x or (bf16 with a recv hook) through the slots."""
    results = pool.run(F.ll_one_step, use_fp8=use_fp8, hook=hook)
    F.assert_all_same(results)
    for r in results:
        assert r["steps"] == {"ll_dispatch_receive 0": 4, "ll_combine_receive 0": 4}, r["steps"]


@needs_native
def test_low_latency_one_engine_step_that_waits_in_vain_goes_on_the_general_way(pool):
    """A peer late to every call: the one-step receives of the rank waiting for it end with a message
    missing, and the general way receives those calls, with the same bits."""
    results = pool.run(F.ll_one_step, late=True)
    F.assert_all_same(results)
    steps = results[0]["steps"]
    assert steps.get("ll_dispatch_receive 3", 0) >= 3 and steps.get("ll_combine_receive 3", 0) >= 3, steps


@needs_native
def test_low_latency_large_rows_same_bits(pool):
    """Rows of a DeepSeek-size hidden (7168: 30 blocks), top-8, masked slots."""
    F.assert_all_same(pool.run(F.ll_equivalence, "tff", backend="native", T=8, K=8, E=16, N=8, H=7168))


@needs_native
def test_streaming_token_reordering_same_bits(pool):
    """Sources whose rows arrive a few at a time are reordered in runs, as they arrive, with the same
    result as the torch path (normal and low-latency dispatch, the combines after them)."""
    results = pool.run(F.streaming_equivalence)
    F.assert_all_same(results)
    assert all(r["partial_runs"] > 4 for r in results), [r["partial_runs"] for r in results]
    assert all(r["normal_partial_runs"] > 2 for r in results), [r["normal_partial_runs"] for r in results]


@needs_native
def test_arrived_rows_finds_the_complete_prefix():
    """``arrived_rows`` returns the end of the run of complete rows from ``start``: a row missing its last
    block or a middle block ends the run; stale rows of an older call never count."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, sel, patch = _rows_case(((("x", 2000),)), 2, n=6, T=8)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(8), 1)
    rows = torch.zeros(6, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    new, old = P.flag_word(7, P.REGION_DISPATCH), P.flag_word(6, P.REGION_DISPATCH)
    eng.write_rows(fmt, st, None, sel[:4], rows, new, meta_patch=patch[:4])
    assert eng.arrived_prefix(fmt, rows, new, 0) == 4
    assert eng.arrived_prefix(fmt, rows, new, 2) == 4
    assert eng.arrived_prefix(fmt, rows, old, 0) == 0
    words = rows.view(torch.int64).view(6, fmt.blocks, P.BLOCK_WORDS)
    words[2, 1, 0] = old                       # a middle block of row 2 still holds an older call's flag
    assert eng.arrived_prefix(fmt, rows, new, 0) == 2
    words[2, 1, 0] = new
    words[1, -1, 0] = old                      # row 1's last block is not there yet
    assert eng.arrived_prefix(fmt, rows, new, 0) == 1
    assert eng.arrived_prefix(fmt, rows, new, 6) == 6
    assert TorchEngine().arrived_prefix(fmt, rows, new, 0) is None


def _routing(T, K, E, seed, masked=0.2):
    """[T, K] int64 routing with distinct experts per token and about ``masked`` of the slots -1."""
    g0 = torch.Generator().manual_seed(seed)
    if not T:
        return torch.zeros(0, K, dtype=torch.int64)
    topk = torch.stack([torch.randperm(E, generator=g0)[:K] for _ in range(T)])
    topk[torch.rand(T, K, generator=g0) < masked] = -1
    return topk


@needs_native
@pytest.mark.parametrize("T,K,E", [(0, 2, 4), (1, 1, 2), (9, 3, 8), (128, 8, 16), (33, 6, 12), (20, 16, 32)])
def test_pair_order_same_on_both_engines(T, K, E):
    """The C counting sort gives the torch path's pairs, counts and slots, and every slot names its pair."""
    topk = _routing(T, K, E, seed=T + 7 * K)
    ref = TorchEngine().pair_order(topk, E)
    got = native_engine.NativeEngine().pair_order(topk, E)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype == torch.int64 and torch.equal(a, b)
    t_idx, k_idx, g, counts, pos = got
    assert torch.equal(topk[t_idx, k_idx], g) and int(counts.sum()) == int((topk >= 0).sum())
    key = g * (T * K + 1) + t_idx * K + k_idx
    assert bool((key[1:] > key[:-1]).all())                          # by expert, token, slot
    assert torch.equal(pos[t_idx, k_idx], torch.arange(t_idx.numel())) and not bool(pos[topk < 0].any())


@needs_native
@pytest.mark.parametrize("topk,msg", [([[0, 3, 0]], "same expert twice"), ([[0, 4, 1]], "outside"),
                                      ([[-2, 1, 2]], "outside")])
def test_pair_order_refuses_bad_routing(topk, msg):
    topk = torch.tensor(topk, dtype=torch.int64)
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        with pytest.raises(ValueError, match=msg if msg != "outside" else "outside|must be in"):
            eng.pair_order(topk, 4)


@needs_native
@pytest.mark.parametrize("T,K,E,R", [(0, 2, 4, 2), (1, 1, 2, 1), (9, 3, 8, 4), (128, 8, 16, 2), (33, 6, 12, 3),
                                     (20, 0, 8, 2)])
@pytest.mark.parametrize("repeats", [False, True])
def test_routing_layout_same_on_both_engines(T, K, E, R, repeats):
    """The C layout pass gives the torch path's counts, ranks and send lists; a token that names an expert in
    several slots counts once per slot for it (as DeepEP counts) but goes once to its rank, and one whose
    slots are all -1 goes nowhere."""
    topk = _routing(T, K, E, seed=T + K + R)
    if repeats and T and K > 1:
        topk[::2, 1] = topk[::2, 0]          # the same expert (or -1) twice
        topk[1::3] = -1
    ref_lo, ref_hi, ref = TorchEngine().routing_layout(topk, E, R)
    lo, hi, got = native_engine.NativeEngine().routing_layout(topk, E, R)
    assert (lo, hi) == (ref_lo, ref_hi)
    for a, b in zip(ref[:3] + (ref[4],), got[:3] + (got[4],)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert len(got[3]) == R and all(torch.equal(a, b) for a, b in zip(ref[3], got[3]))
    # against the definitions
    hit = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        for e in topk[t].tolist():
            if e >= 0:
                hit[t, e] = True
    assert torch.equal(got[1], torch.tensor([int((topk == e).sum()) for e in range(E)], dtype=torch.int32))
    in_rank = hit.view(T, R, E // R).any(-1)
    assert torch.equal(got[2], in_rank) and torch.equal(got[0], in_rank.sum(0).to(torch.int32))
    for r in range(R):
        assert got[3][r].tolist() == [t for t in range(T) if in_rank[t, r]]
        assert got[4][:, r].tolist() == [got[3][r].tolist().index(t) if in_rank[t, r] else -1 for t in range(T)]


@needs_native
@pytest.mark.parametrize("bad,lo,hi", [(8, -1, 8), (-2, -2, 7), (99, -1, 99)])
def test_routing_layout_reports_ids_out_of_range(bad, lo, hi):
    """An id outside [-1, E) gives no layout, only the smallest and largest id, on both engines."""
    topk = torch.tensor([[0, 7], [3, -1], [5, bad]], dtype=torch.int64)
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        assert eng.routing_layout(topk, 8, 2) == (lo, hi, None)


@needs_native
@pytest.mark.parametrize("wdtype", [None, torch.float32, torch.float64])
@pytest.mark.parametrize("T,K", [(0, 4), (1, 1), (37, 8)])
def test_meta_items_same_on_both_engines(wdtype, T, K):
    """Normal dispatch's meta items: ids as int32, then the weights' bits, on both engines."""
    topk = _routing(T, K, 16, seed=T + K)
    w = None if wdtype is None else torch.rand(T, K, dtype=wdtype)
    ref = TorchEngine().meta_items(topk, w)
    got = native_engine.NativeEngine().meta_items(topk, w)
    assert ref.dtype == got.dtype == torch.int32 and torch.equal(ref, got)
    assert torch.equal(got[:, :K], topk.to(torch.int32))
    if w is not None:
        assert torch.equal(P.fresh(got[:, K:]).view(wdtype), w)


@needs_native
@pytest.mark.parametrize("wdtype", [None, torch.float32, torch.float64])
@pytest.mark.parametrize("lo,valid", [(0, 20), (4, 20), (8, 13)])
@pytest.mark.parametrize("K", [3, 8])     # (the C loop has its own copy for K = 8)
def test_local_topk_same_on_both_engines(wdtype, lo, valid, K):
    """Received global ids become this rank's local ids (-1 elsewhere, and past the valid rows); weights
    follow them, zero where the id is -1."""
    E_local, rows = 4, 20
    wsz = 0 if wdtype is None else torch.finfo(wdtype).bits // 32
    g = torch.randint(-1, 12, (rows, K), dtype=torch.int32, generator=torch.Generator().manual_seed(lo))
    w = torch.rand(rows, K, dtype=wdtype or torch.float32)
    meta = torch.zeros(rows, K + K * wsz + 2, dtype=torch.int32)
    meta[:, :K] = g
    if wsz:
        meta[:, K:K + K * wsz] = w.view(torch.int32).view(rows, K * wsz)
    ref = TorchEngine().local_topk(meta, K, wdtype, lo, E_local, valid)
    got = native_engine.NativeEngine().local_topk(meta, K, wdtype, lo, E_local, valid)
    local = g.to(torch.int64) - lo
    want = torch.where((local >= 0) & (local < E_local), local, torch.full_like(local, -1))
    want[valid:] = -1
    for idx, wts in (ref, got):
        assert idx.dtype == torch.int64 and torch.equal(idx, want)
        if wdtype is None:
            assert wts is None
        else:
            assert wts.dtype == wdtype and torch.equal(wts, torch.where(want >= 0, w, torch.zeros_like(w)))


@needs_native
def test_segment_rows_same_on_both_engines():
    first = torch.tensor([40, 0, 7, 100], dtype=torch.int64)
    counts = torch.tensor([3, 0, 2, 4], dtype=torch.int64)
    want = torch.tensor([40, 41, 42, 7, 8, 100, 101, 102, 103])
    assert torch.equal(TorchEngine().segment_rows(first, counts, 9), want)
    assert torch.equal(native_engine.NativeEngine().segment_rows(first, counts, 9), want)
    with pytest.raises(ValueError, match="sum to 9"):
        native_engine.NativeEngine().segment_rows(first, counts, 10)


def _ll_ctrl(counts, N, nctrl, g):
    """[R, MAX_CTRL_BLOCKS, 512] control blocks, as the senders write them, holding ``counts`` ([R, E_local])
    after random header words; the unused blocks hold stale bytes."""
    R, E_local = counts.shape
    ctrl = torch.randint(0, 256, (R, P.MAX_CTRL_BLOCKS, P.BLOCK_BYTES), dtype=torch.uint8, generator=g)
    for s in range(R):
        head = torch.randint(0, 1 << 20, (P.CTRL_COUNTS,), generator=g)
        TorchEngine().write_ctrl(ctrl[s, :nctrl], torch.cat([head, counts[s]]), 5)
    return ctrl


@needs_native
@pytest.mark.parametrize("R,E_local,N", [(1, 1, 1), (2, 8, 8), (3, 5, 4), (2, 128, 16), (4, 64, 3), (2, 474, 2)])
def test_ll_calcumsum_same_on_both_engines(R, E_local, N):
    """Low-latency CalCumSum from the arrived control messages: counts, segment begins (lower sources
    first), flat rows, layout_range, recv_count and rows per source, C against the torch path and against
    a reference loop; the counts may span several control blocks."""
    g = torch.Generator().manual_seed(R * 1000 + E_local)
    counts = torch.randint(0, N + 1, (R, E_local), generator=g)
    counts[0, 0] = N                                           # both ends of the range
    if R * E_local > 1:
        counts[-1, -1] = 0
    nctrl = P.ctrl_blocks(E_local)
    ctrl = _ll_ctrl(counts, N, nctrl, g)
    begin = torch.zeros(R, E_local, dtype=torch.int64)
    for s in range(1, R):
        begin[s] = begin[s - 1] + counts[s - 1]
    flat = begin + torch.arange(E_local) * R * N
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        lr = torch.full((E_local, R), -5, dtype=torch.int64)
        rc = torch.full((E_local,), -5, dtype=torch.int32)
        cnt, b, f, rows = eng.ll_calcumsum(ctrl, nctrl, P.CTRL_COUNTS, E_local, N, lr, rc)
        assert torch.equal(cnt, counts) and torch.equal(b, begin) and torch.equal(f, flat), type(eng).__name__
        assert torch.equal(lr, ((begin << 32) | counts).t()) and torch.equal(rc, counts.sum(0).to(torch.int32))
        assert rows == counts.sum(1).tolist()
        # the combine side reads the same layout back: rows per source, segment by segment
        n = int(counts.sum())
        got, per_source = eng.layout_rows(lr, N, n)
        want = [e * R * N + int(begin[s, e]) + i for s in range(R) for e in range(E_local)
                for i in range(int(counts[s, e]))]
        assert got.tolist() == want and per_source == rows
        with pytest.raises(ValueError, match="sum to"):
            eng.layout_rows(lr, N, n + 1)


@needs_native
@pytest.mark.parametrize("bad", [-1, 9, 1 << 40])
def test_ll_calcumsum_refuses_bad_counts_before_writing(bad):
    """A count outside [0, N] (a corrupted control message) raises ValueError naming the source and the
    expert, and layout_range and recv_count are left as they were."""
    g = torch.Generator().manual_seed(3)
    R, E_local, N = 3, 70, 8
    counts = torch.randint(0, N + 1, (R, E_local), generator=g)
    counts[2, 65] = bad
    nctrl = P.ctrl_blocks(E_local)
    ctrl = _ll_ctrl(counts, N, nctrl, g)
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        lr = torch.full((E_local, R), -5, dtype=torch.int64)
        rc = torch.full((E_local,), -5, dtype=torch.int32)
        with pytest.raises(ValueError, match=f"rank 2 announced {bad} rows for local expert 65"):
            eng.ll_calcumsum(ctrl, nctrl, P.CTRL_COUNTS, E_local, N, lr, rc)
        assert bool((lr == -5).all()) and bool((rc == -5).all())


@needs_native
def test_ll_calcumsum_refuses_what_it_cannot_address():
    """Word ranges outside the control blocks, and views that are not whole 512 B blocks, are refused (or
    left to the torch path, which reads through the view) instead of being read past."""
    g = torch.Generator().manual_seed(4)
    counts = torch.randint(0, 3, (2, 6), generator=g)
    ctrl = _ll_ctrl(counts, 2, 1, g)
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        lr, rc = torch.zeros(6, 2, dtype=torch.int64), torch.zeros(6, dtype=torch.int32)
        for first, E_local in ((-6, 6), (P.CTRL_WORDS_PER_BLOCK - 5, 6), (0, -1)):
            with pytest.raises(ValueError, match="do not fit"):
                eng.ll_calcumsum(ctrl, 1, first, E_local, 2, lr, rc)
        with pytest.raises((ValueError, RuntimeError)):
            eng.ll_calcumsum(ctrl[:, :, :40], 1, 0, 2, 2, lr[:2], rc[:2])
        assert not lr.any() and not rc.any()


@needs_native
@pytest.mark.parametrize("T,K,E,R", [(0, 2, 4, 2), (1, 1, 2, 2), (9, 3, 8, 2), (40, 8, 16, 2), (33, 6, 12, 3),
                                     (17, 4, 4, 4), (25, 16, 32, 1)])
def test_one_row_per_token_layout_same_on_both_engines(T, K, E, R):
    """Low-latency rows per (token, destination): the C and torch senders list the same tokens and meta
    items, and every pair lands in its own recv_x row, at its position among its expert's pairs."""
    topk = _routing(T, K, E, seed=T * 100 + K)
    t_idx, k_idx, g, counts, _ = TorchEngine().pair_order(topk, E)
    counts = counts.view(R, E // R)
    ref = TorchEngine().token_rows(t_idx, k_idx, g, counts, T, K)
    got = native_engine.NativeEngine().token_rows(t_idx, k_idx, g, counts, T, K)
    for d in range(R):
        assert torch.equal(ref[0][d], got[0][d]) and torch.equal(ref[1][d], got[1][d])
        items = got[1][d]
        assert int(items[:, 0].sum()) == int(counts[d].sum())             # every pair on d, once
        for row, t in enumerate(got[0][d].tolist()):
            for j in range(int(items[row, 0])):
                e, k, p = int(items[row, 1 + 2 * j]) >> 8, int(items[row, 1 + 2 * j]) & 0xFF, int(items[row, 2 + 2 * j])
                assert int(topk[t, k]) == d * (E // R) + e
                seg = t_idx[g == d * (E // R) + e]                         # the expert's pairs, in dispatch order
                assert int(seg[p]) == t


@needs_native
@pytest.mark.parametrize("bad", ["count", "expert", "slot", "position", "room"])
def test_one_row_per_token_items_are_checked(bad):
    """Meta items naming pairs outside the announced segments are refused by both engines (ValueError)
    before anything is written."""
    fmt = P.row_format("tff", (("x", 1000),), 1 + 2 * 3)
    K, n = 3, 4
    rows = torch.zeros(n, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    items = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)
    items[:, 0] = 2
    items[:, 1], items[:, 2] = (0 << 8) | 1, torch.arange(n, dtype=torch.int32)     # expert 0, slot 1
    items[:, 3], items[:, 4] = (1 << 8) | 2, torch.arange(n, dtype=torch.int32)     # expert 1, slot 2
    base = torch.tensor([0, 8], dtype=torch.int64)
    cnt = torch.tensor([n, n], dtype=torch.int64)
    room = 16
    if bad == "count":
        items[2, 0] = K + 1
    elif bad == "expert":
        items[1, 3] = (2 << 8) | 2
    elif bad == "slot":
        items[3, 1] = (0 << 8) | K
    elif bad == "position":
        items[0, 4] = n
    else:
        room = 8 + n - 1
    for eng in (TorchEngine(), native_engine.NativeEngine()):
        out = torch.full((room, 1000), 7, dtype=torch.uint8)
        info = torch.full((room,), -1, dtype=torch.int32)
        kk = torch.full((room,), -1, dtype=torch.int32)
        with pytest.raises(ValueError):
            eng.unpack_items(fmt, rows, K, base, cnt, [out], info, kk)
        assert bool((out == 7).all()) and bool((info == -1).all()) and bool((kk == -1).all())


@needs_native
def test_three_ranks_same_bits():
    """Three ranks: the general combine (no two-source pass) and uneven per-source row counts."""
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with RankPool(3, env=env) as p:
        F.assert_all_same(p.run(F.normal_equivalence, "tff", backend="native", E=6, K=3, T=20, special=True))
        F.assert_all_same(p.run(F.ll_equivalence, "tff", backend="native", E=6, K=3, T=8, special=True))


@needs_native
@pytest.mark.parametrize("nctrl,nwords", [(1, 6), (1, 60), (2, 61), (8, 300)])
def test_control_messages_are_byte_identical(nctrl, nwords):
    """The count group's control blocks: same bytes as torch's ``write_ctrl`` (zeroed heads and bodies over
    stale bytes), arrival only with this call's flag, and the same payload words read back."""
    payload = torch.arange(nwords, dtype=torch.int64) * -7 + 3
    out = {}
    for name, eng in (("torch", TorchEngine()), ("native", native_engine.NativeEngine())):
        dst = torch.full((nctrl, P.BLOCK_BYTES), 0x5A, dtype=torch.uint8)
        assert not eng.ctrl_arrived(dst, 99)
        eng.write_ctrl(dst, payload, 99)
        assert eng.ctrl_arrived(dst, 99) and not eng.ctrl_arrived(dst, 98)
        out[name] = (dst, eng.read_ctrl_words(dst))
    assert torch.equal(out["torch"][0], out["native"][0])
    assert out["torch"][1] == out["native"][1] and out["native"][1][:nwords] == payload.tolist()


def _way_said(ctrl: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A native send phase's control message with the head words of its first block that its store policy
    fills checked and zeroed, as torch's send phase leaves them: word 1 the way its rows ``rows`` were stored
    (these sends are small, so plain but for a policy of streaming stores into 64 B aligned slots: 1 plain,
    2 streaming), words 2 and 3 what reading rows has cost this rank (nothing read here: 0)."""
    words = ctrl.clone().view(torch.int64).view(ctrl.shape[0], P.BLOCK_WORDS)
    way = 2 if native_engine.store_policy()["policy"] == "streaming" and rows.data_ptr() % 64 == 0 and _x86() else 1
    assert words[0, 1:4].tolist() == [way, 0, 0], (words[0, 1:4].tolist(), way)
    words[0, 1:4] = 0
    return words.view(torch.uint8).view(ctrl.shape)


def _send_job(eng, fmt, data, meta, sels, patches, payloads, flag, T):
    """A SendJob of TFF rows to one destination per entry of ``sels`` (slots and control blocks of stale
    bytes), as ``Buffer`` builds it."""
    st, checked, sums = eng.stage_rows(fmt, data, meta, eng.arange(T), 2)
    job = SendJob(fmt, st, checked, sums, flag)
    for d, (sel, patch, words) in enumerate(zip(sels, patches, payloads)):
        rows = torch.full((sel.numel() + 1, fmt.blocks, P.BLOCK_BYTES), 0xA5, dtype=torch.uint8)
        ctrl = torch.full((2, P.BLOCK_BYTES), 0x5A, dtype=torch.uint8)
        job.dests.append(Destination(d, sel, rows, ctrl, words, meta_patch=patch))
    return job


@needs_native
@pytest.mark.parametrize("fields,meta_words", [((("x", 7168 * 2),), 16), ((("x", 1000), ("scales", 8 * 4)), 2)])
def test_send_phase_is_byte_identical(fields, meta_words):
    """The native send phase (every destination's control message, then its rows, in one call) stores the
    same bytes as torch's, for control payloads given as lists or tensors, an empty destination and meta
    patches of one or several items; its control messages also name how their rows were stored."""
    fmt, data, meta, sel, _ = _rows_case(fields, meta_words, n=7, T=9)
    g = torch.Generator().manual_seed(4)
    sels = [sel, torch.tensor([], dtype=torch.int64), sel[:3].flip(0)]
    patches = [None, None, torch.randint(0, 9, (3, min(2, meta_words)), dtype=torch.int32, generator=g)]
    payloads = [[7, 1, 2, -3], torch.arange(61, dtype=torch.int64) - 30, [5] * 60 + [-1] * 10]
    mem = {}
    for name, eng in (("torch", TorchEngine()), ("native", native_engine.NativeEngine())):
        job = _send_job(eng, fmt, data, meta, sels, patches, payloads, P.flag_word(9, P.REGION_COMBINE), 9)
        eng.send_phase(job)
        mem[name] = [(d.rows, d.ctrl) for d in job.dests]
    for (rows_t, ctrl_t), (rows_n, ctrl_n) in zip(mem["torch"], mem["native"]):
        assert torch.equal(rows_t, rows_n) and torch.equal(ctrl_t, _way_said(ctrl_n, rows_n))


@needs_native
def test_send_phase_keeps_converted_indices_and_patches_alive():
    """Staging rows given as int32 and meta patches as int64 are converted per destination; every converted
    tensor lives until the stores, so later destinations do not overwrite earlier ones' (same bytes as
    torch). Jobs the C call does not take (a destination without a row list, more destinations than it
    holds, a control view narrower than a block) go the torch way, as they would on the torch engine."""
    fmt, data, meta, _, _ = _rows_case((("x", 1000),), 2, n=7, T=9)
    sels = [torch.tensor([0, 1, 2, 3, 4, 5, 6], dtype=torch.int32), torch.tensor([8, 7, 6, 5, 4, 3, 2])]
    patches = [torch.arange(7, dtype=torch.int64), torch.arange(100, 107, dtype=torch.int64)]
    mem = {}
    for name, eng in (("torch", TorchEngine()), ("native", native_engine.NativeEngine())):
        job = _send_job(eng, fmt, data, meta, sels, patches, [[1, 2, 3], [4, 5, 6]], 9, 9)
        eng.send_phase(job)
        mem[name] = [torch.cat([d.rows.view(-1), (d.ctrl if name == "torch" else _way_said(d.ctrl, d.rows)).view(-1)])
                     for d in job.dests]
    assert all(torch.equal(a, b) for a, b in zip(mem["torch"], mem["native"]))
    for jobs in ((2, None, 512), (1025, torch.tensor([0]), 512), (1, torch.tensor([0]), 64)):
        out = {}
        for name, eng in (("torch", TorchEngine()), ("native", native_engine.NativeEngine())):
            st, checked, sums = eng.stage_rows(fmt, data, meta, eng.arange(9), 0)
            job = SendJob(fmt, st, checked, sums, 5)
            for d in range(jobs[0]):
                job.dests.append(Destination(d, jobs[1], torch.zeros(10, fmt.blocks, 512, dtype=torch.uint8),
                                             torch.zeros(1, jobs[2], dtype=torch.uint8), [d]))
            try:
                eng.send_phase(job)
                out[name] = torch.stack([d.rows for d in job.dests[:3]])
            except Exception as e:        # noqa: BLE001 - the same error on both engines
                out[name] = type(e)
        assert (out["torch"] == out["native"]) if isinstance(out["torch"], type) else \
            torch.equal(out["torch"], out["native"])


_HOSTILE_CALLS = """
import sys, threading, time, torch
from tests.test_native_engine import _rows_case, _send_job
from ubep_torch import native_engine, protocol as P
eng = native_engine.NativeEngine()

class Shrinks:                     # converting this word empties the list it came in
    def __init__(self, words):
        self.words = words
    def __index__(self):
        self.words.clear()
        return 1

fmt, data, meta, sel, _ = _rows_case((("x", 1000),), 2, n=7, T=9)
words = [0] * 60
words[0] = Shrinks(words)
job = _send_job(eng, fmt, data, meta, [sel], [None], [words], 5, 9)
eng.send_phase(job)
assert job.dests[0].ctrl.view(torch.int64)[0, 4:6].tolist() == [1, 0]

fmt = P.row_format("tff", (("x", 14336),), 1)
T = 2048
st, _, _ = eng.stage_rows(fmt, [torch.randint(0, 256, (T, 14336), dtype=torch.uint8)], None, eng.arange(T), 1)
slots = torch.zeros(T, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
eng.write_rows(fmt, st, None, eng.arange(T), slots, 7)
step = eng.reorder_sources(fmt, [torch.zeros(T, 14336, dtype=torch.uint8)], None, None, 32)
# Another thread replaces the list while the copy runs without the GIL. With a long switch interval the
# thread gets the GIL only when this one gives it up: inside the C copy, or at the join after it.
sys.setswitchinterval(60.0)
during = 0
for _ in range(200):
    sources = [[slots.data_ptr(), T, 0, 0, 7]] + [[slots.data_ptr(), 0, 0, 0, 8 + i] for i in range(50)]
    go = threading.Event()
    th = threading.Thread(target=lambda: (go.wait(), sources.clear(), sources.append(None)))
    th.start()
    go.set()
    step(sources, 7)
    during += sources == [None]    # replaced before the call returned: during its copy
    th.join()
    if during >= 3:
        break
assert during >= 1, during
print("ok")
"""


@needs_native
def test_c_calls_survive_arguments_changed_under_them():
    """A control word whose conversion empties its list, and a sources list that another thread replaces
    while the C loop copies without the GIL, neither crash nor corrupt: the C calls read their own copies
    and references. (In a subprocess: a crash must fail this test, not the run.)"""
    import subprocess
    import sys
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-X", "dev", "-c", _HOSTILE_CALLS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.returncode, res.stderr[-2000:])


@needs_native
def test_send_phase_checks_every_destination_before_any_store():
    """A bad staging row in the last destination, or a payload too long for its blocks, raises before the
    first destination's control message or rows are stored."""
    fmt, data, meta, sel, _ = _rows_case((("x", 1000),), 1, n=4, T=4)
    eng = native_engine.NativeEngine()
    for sels, payloads, err in (([sel, torch.tensor([0, 4])], [[1], [2]], IndexError),
                                ([sel, sel], [[1], list(range(121))], ValueError)):
        job = _send_job(eng, fmt, data, meta, sels, [None, None], payloads, 5, 4)
        before = [(d.rows.clone(), d.ctrl.clone()) for d in job.dests]
        with pytest.raises(err):
            eng.send_phase(job)
        for d, (rows, ctrl) in zip(job.dests, before):
            assert torch.equal(d.rows, rows) and torch.equal(d.ctrl, ctrl)


@needs_native
def test_one_step_exchanges_wait_for_the_expected_messages_and_every_row():
    """native.c's ``exchange_reorder`` and ``exchange_combine`` (with nothing to send) on blocks laid out by
    hand: 3 while a message is missing, 1 while one says other words than the expected ones (skipped words
    and the free range aside), 2 while rows are missing, 0 once everything came: then the outputs are those of
    ``reorder_sources`` and ``combine_rows_bf16``, and every message's words, free ones included, are copied
    out where the caller asks."""
    C, eng = native_engine._native, native_engine.NativeEngine()
    flag = P.flag_word(9, P.REGION_DISPATCH)
    fmt, data, meta, _, _ = _rows_case((("x", 1500),), 3, n=1, T=6)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(6), 1)
    rows = torch.zeros(6, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    ctrl = torch.zeros(2, P.MAX_CTRL_BLOCKS, P.BLOCK_BYTES, dtype=torch.uint8)
    words = torch.tensor([[6, 11, 99, 0, 4], [0, 11, 99, 0, 4]], dtype=torch.int64)
    expected = words.clone()
    expected[:, 2] = -5                                  # (word 2 is not compared: skip bit 2)
    nothing = (fmt.blocks, 0, 0, 0, flag, (), ())     # (a send with no destination)
    check = (ctrl.data_ptr(), ctrl.stride(0), 1, 2, 5, expected.numpy().tobytes(), 1 << 2)
    x = torch.zeros(6, 1500, dtype=torch.uint8)
    meta_out, src = torch.zeros(6, 3, dtype=torch.int32), torch.zeros(6, dtype=torch.int32)

    def reorder(sources):
        return (fmt.blocks, flag, 4, 6, meta_out.data_ptr(), 12, 12, src.data_ptr(),
                ((x.data_ptr(), 1500, 1500, 1),), sources)

    def arrive(s, w):
        eng.write_ctrl(ctrl[s, :1], w, flag)

    sources = [[rows.data_ptr(), 6, 0, 0, 0]]
    assert C.exchange_reorder(nothing, check, reorder(sources), 0) == 3                  # no message yet
    arrive(0, words[0])
    arrive(1, words[1] + torch.tensor([0, 0, 0, 0, 1]))
    assert C.exchange_reorder(nothing, check, reorder(sources), 0) == 1                  # source 1: other words
    arrive(1, words[1] + torch.tensor([0, 0, 0, 5, 0]))
    assert C.exchange_reorder(nothing, check, reorder(sources), 0) == 1                  # word 3 differs too
    read = torch.full((2, 5), -1, dtype=torch.int64)
    free = check + (3, 4, read.data_ptr())                                                # word 3 read, not compared
    eng.write_rows(fmt, st, None, eng.arange(3), rows[:3], flag)
    assert C.exchange_reorder(nothing, free, reorder(sources), 0) == 2 and sources[0][3] == 0   # rows missing
    # (the messages came as expected: their words are out, the free one as it was sent)
    assert read.tolist() == [words[0].tolist(), (words[1] + torch.tensor([0, 0, 0, 5, 0])).tolist()]
    eng.write_rows(fmt, st, None, eng.span(3, 6), rows[3:], flag)
    assert C.exchange_reorder(nothing, free, reorder(sources), 0) == 0 and sources[0][3] == 6
    with pytest.raises(ValueError, match="bad control blocks"):                           # a range past the words
        C.exchange_reorder(nothing, check + (3, 6, 0), reorder(sources), 0)
    arrive(1, words[1])
    ref_x = torch.zeros(6, 1500, dtype=torch.uint8)
    assert torch.equal(meta_out, eng.unpack_rows(fmt, rows, [ref_x])) and torch.equal(x, ref_x)
    assert torch.equal(src, torch.arange(6, dtype=torch.int32))
    # the combine: this rank's own bf16 rows and a peer's slot rows of the same tokens, summed once all came
    H = 750
    cfmt = P.row_format("tff", (("x", 2 * H),), 0)
    own, peer = torch.randn(6, H).bfloat16(), torch.randn(6, H).bfloat16()
    cst, _, _ = eng.stage_rows(cfmt, [peer.view(torch.uint8)], None, eng.arange(6), 1)
    slots = torch.zeros(6, cfmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    tok = torch.arange(6)
    spec = (native_engine._plain_spec(own, 0, tok.data_ptr(), 6) + (0, -1),
            native_engine._slot_spec(cfmt, slots.data_ptr(), tok.data_ptr(), 6) + (slots.data_ptr(), 1))
    out = torch.zeros(6, H, dtype=torch.bfloat16)
    cnothing = (cfmt.blocks, 0, 0, 0, flag, (), ())
    eng.write_rows(cfmt, cst, None, eng.arange(5), slots[:5], flag)
    assert C.exchange_combine(cnothing, check, 6, H, spec, out.data_ptr(), 0) == 2 and not out.any()
    eng.write_rows(cfmt, cst, None, eng.span(5, 6), slots[5:], flag)
    assert C.exchange_combine(cnothing, check, 6, H, spec, out.data_ptr(), 0) == 0
    assert torch.equal(out, (own.float() + peer.float()).bfloat16())


@needs_native
def test_low_latency_one_step_receives_wait_for_the_expected_messages_and_every_row():
    """native.c's ``ll_dispatch_receive`` and ``ll_combine_receive`` on blocks laid out as two senders store
    them: 3 while a message is missing, 1 while one says other words than expected or counts, rows or items
    that do not fit, 2 while rows are missing, 0 once everything came; then the dispatch's outputs are those
    of ``ll_calcumsum``, ``unpack_items`` and the own rows' copy, and the combine's sum that of
    ``weighted_combine``. An item outside its source's segments is refused before its rows are written."""
    eng, torch_eng = native_engine.NativeEngine(), TorchEngine()
    R, me, E_local, N, K, H = 2, 0, 2, 6, 3, 300
    E = R * E_local
    fmt = P.row_format("tff", (("x", 2 * H),), 1 + 2 * K)
    flag = P.flag_word(5, P.REGION_LL_DISPATCH)
    topk = [_routing(5, K, E, seed=s, masked=0.3) for s in range(R)]
    xs = [torch.randn(5, H, generator=torch.Generator().manual_seed(s)).bfloat16() for s in range(R)]
    slots = torch.zeros(R, N, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)    # this rank's, per source
    ctrl = torch.zeros(R, P.MAX_CTRL_BLOCKS, P.BLOCK_BYTES, dtype=torch.uint8)
    sig = fmt.signature()
    words, rows_of, own = [], [], None
    for s in range(R):        # what source s sends this rank: its rows' tokens and items, its control words
        t_idx, k_idx, g, counts, _ = eng.pair_order(topk[s], E)
        tokens, items = eng.token_rows(t_idx, k_idx, g, counts.view(R, E_local), 5, K)
        words.append([tokens[me].numel(), sig, 0, 0, E, N] + counts.view(R, E_local)[me].tolist())
        rows_of.append((tokens[me], items[me]))
        if s == me:
            n = int(counts.view(R, E_local)[me].sum())
            own = ([xs[s].view(torch.uint8)], t_idx[:n].contiguous(), k_idx[:n].contiguous())
    expected = torch.tensor([[0, sig, 0, 0, E, N] + [0] * E_local] * R, dtype=torch.int64).numpy().tobytes()

    def outputs():
        return (torch.zeros(3, R, E_local, dtype=torch.int64), torch.zeros(E_local, R, dtype=torch.int64),
                torch.zeros(E_local, dtype=torch.int32), torch.full((E_local * R * N,), -1, dtype=torch.int32),
                torch.full((E_local * R * N,), -1, dtype=torch.int32), torch.zeros(R, dtype=torch.int64),
                torch.zeros(R, dtype=torch.int64))

    def receive(results, out):
        return eng.ll_dispatch_receive(fmt, ctrl, 1, expected, flag, slots[0], slots[0].numel(), N, K, me, [out],
                                       own, results, 0)

    def send_rows(s, upto=None):
        tokens, items = rows_of[s]
        st, _, _ = eng.stage_rows(fmt, [xs[s].view(torch.uint8)], None, eng.arange(5), s)
        upto = tokens.numel() if upto is None else upto
        eng.write_rows(fmt, st, None, tokens[:upto], slots[s, :upto], flag, meta_patch=items[:upto])

    assert rows_of[1][0].numel() >= 2 and own[1].numel() >= 1       # (rows from the peer, own pairs)
    out = torch.zeros(E_local * R * N, 2 * H, dtype=torch.uint8)
    assert receive(outputs(), out) == 3                                   # no message yet
    for s in range(R):
        eng.write_ctrl(ctrl[s, :1], torch.tensor(words[s]), flag)
    bad = list(words[1])
    bad[1] += 1
    eng.write_ctrl(ctrl[1, :1], torch.tensor(bad), flag)
    assert receive(outputs(), out) == 1                                   # source 1: another row layout
    bad = list(words[1])
    bad[6] = N + 1
    eng.write_ctrl(ctrl[1, :1], torch.tensor(bad), flag)
    assert receive(outputs(), out) == 1                                   # a count past N
    for slot in (-1, N * K, 2 ** 63 - 1):                                 # return slots that do not fit
        bad = list(words[1])
        bad[3] = slot
        eng.write_ctrl(ctrl[1, :1], torch.tensor(bad), flag)
        assert receive(outputs(), out) == 1, slot
    eng.write_ctrl(ctrl[1, :1], torch.tensor(words[1]), flag)
    send_rows(1, upto=1)
    assert receive(outputs(), out) == 2                                   # rows missing
    send_rows(1)
    results = outputs()
    out.zero_()
    assert receive(results, out) == 0
    # the general way's outputs of the same blocks
    ref = outputs()
    ref_out = torch.zeros_like(out)
    cnt, begin, first, pairs = eng.ll_calcumsum(ctrl, 1, P.CTRL_COUNTS, E_local, N, ref[1], ref[2])
    tokens, items = rows_of[1]
    eng.unpack_items(fmt, slots[1, :tokens.numel()], K, first[1], cnt[1], [ref_out], ref[3], ref[4])
    at = eng.segment_rows(first[me], cnt[me], pairs[me])
    ref_out[at] = xs[me].view(torch.uint8)[own[1]]
    ref[3][at], ref[4][at] = own[1].to(torch.int32), own[2].to(torch.int32)
    assert torch.equal(out, ref_out) and torch.equal(results[0], torch.stack([cnt, begin, first]))
    for got, want in zip(results[1:5], ref[1:5]):
        assert torch.equal(got, want)
    assert results[5].tolist() == [0, 0] and bool((results[6] >= 0).all())
    # an item outside source 1's segments: refused, the source's rows not reordered
    items[0, 2] = N
    send_rows(1)
    out.zero_()
    assert receive(outputs(), out) == 1
    assert all(not out[int(first[1, e]):int(first[1, e] + cnt[1, e])].any() for e in range(E_local))
    # the combine: this rank's own pairs read in place, the peer's run of slots, the weighted sum once it came
    cfmt = P.row_format("tff", (("x", 2 * H),), 0)
    cflag = P.flag_word(5, P.REGION_LL_COMBINE)
    T, n_valid = 4, 6
    ctopk = torch.tensor([[0, 1, -1], [2, -1, 3], [1, 0, -1], [-1, 2, 3]])
    pos = torch.tensor([[0, 1, 0], [2, 0, 3], [4, 5, 0], [0, 1, 2]])
    w = torch.rand(T, K)
    cslots = torch.zeros(n_valid, cfmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    peer_rows = torch.randn(n_valid, H).bfloat16()
    local_x = torch.randn(3, H).bfloat16()
    local = (local_x, 0, 2, torch.tensor([2, 0]))          # slots 0 and 1: own rows 2 and 0, read in place
    cst, _, _ = eng.stage_rows(cfmt, [peer_rows.view(torch.uint8)], None, eng.arange(n_valid), 1)
    cwords = [[2, cfmt.signature(), 0, 7, E, N], [4, cfmt.signature(), 0, 7, E, N]]
    cexp = torch.tensor(cwords, dtype=torch.int64).numpy().tobytes()
    cctrl = torch.zeros(R, P.MAX_CTRL_BLOCKS, P.BLOCK_BYTES, dtype=torch.uint8)
    got = torch.zeros(T, H, dtype=torch.bfloat16)

    def combine():
        return eng.ll_combine_receive(cfmt, cctrl, 1, cexp, 1 << P.CTRL_CHECKSUM, cflag, cslots, [(2, 4)], ctopk,
                                      w, got, pos, local, 0)
    assert combine() == 3
    for s in range(R):
        eng.write_ctrl(cctrl[s, :1], torch.tensor(cwords[s]), cflag)
    eng.write_rows(cfmt, cst, None, eng.span(2, 5), cslots[2:5], cflag)
    assert combine() == 2 and not got.any()                                # slot 5 missing
    eng.write_rows(cfmt, cst, None, eng.span(5, 6), cslots[5:6], cflag)
    eng.write_ctrl(cctrl[1, :1], torch.tensor(cwords[1][:3] + [8] + cwords[1][4:]), cflag)
    assert combine() == 1 and not got.any()                                # another dispatch's rows
    eng.write_ctrl(cctrl[1, :1], torch.tensor(cwords[1]), cflag)
    assert combine() == 0
    want = torch.zeros(T, H, dtype=torch.bfloat16)
    eng.weighted_combine(cfmt, cslots, ctopk, w, want, pos, local=local)
    assert torch.equal(got, want) and got.any()
    ref_rows = torch.zeros(n_valid, H).bfloat16()                          # the torch path, every row in slots
    ref_rows[2:] = peer_rows[2:]
    ref_rows[:2] = local_x[torch.tensor([2, 0])]
    tst, _, _ = torch_eng.stage_rows(cfmt, [ref_rows.view(torch.uint8)], None, torch_eng.arange(n_valid), 1)
    all_slots = torch.zeros_like(cslots)
    torch_eng.write_rows(cfmt, tst, None, torch_eng.arange(n_valid), all_slots, cflag)
    want_torch = torch.zeros(T, H, dtype=torch.bfloat16)
    torch_eng.weighted_combine(cfmt, all_slots, ctopk, w, want_torch, pos)
    assert torch.equal(got, want_torch)


@needs_native
def test_ctrl_poller_reads_each_source_once_it_arrived():
    """A ``ctrl_poller`` poll returns the sources whose control message is not complete (a block with
    another call's flag counts as missing) and fills in the payload words of the others, as
    ``read_ctrl_words``."""
    eng, flag = native_engine.NativeEngine(), 77
    ctrl = torch.zeros(3, P.MAX_CTRL_BLOCKS, P.BLOCK_BYTES, dtype=torch.uint8)
    for s in range(3):
        eng.write_ctrl(ctrl[s, :2], torch.arange(100, dtype=torch.int64) * (s + 1), flag if s != 1 else flag - 1)
    poll, words = eng.ctrl_poller(ctrl, 2), [None] * 3
    assert poll(flag, words) == [1]
    assert words[0] == eng.read_ctrl_words(ctrl[0, :2]) and words[2][:100] == list(range(0, 300, 3))
    assert words[1] is None
    eng.write_ctrl(ctrl[1, :2], torch.arange(5, dtype=torch.int64), flag)
    ctrl.view(torch.int64)[1, 1, 0] = flag - 1          # its second block is still the older call's
    assert poll(flag, words) == [1]
    ctrl.view(torch.int64)[1, 1, 0] = flag
    assert poll(flag, words) == [] and words[1][:6] == [0, 1, 2, 3, 4, 0]
    # views the C loop cannot address get no poller; a words list of the wrong length is refused
    assert eng.ctrl_poller(ctrl[:, :0], 1) is None and eng.ctrl_poller(ctrl.transpose(0, 1), 1) is None
    assert eng.ctrl_poller(ctrl, P.MAX_CTRL_BLOCKS + 1) is None
    with pytest.raises(ValueError):
        poll(flag, [None] * 2)


@needs_native
def test_reorder_sources_streams_runs_of_complete_rows():
    """One ``reorder_sources`` step per poll: each source's complete rows are reordered once they reach its
    last row or ``min_run`` rows, into the same bytes as ``unpack_rows``; finished sources are returned
    once. A source whose rows would not fit the outputs raises IndexError before anything is written."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, _, _ = _rows_case((("x", 1500),), 3, n=1, T=70)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(70), 1)
    flag = P.flag_word(4, P.REGION_DISPATCH)
    a = torch.zeros(20, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    b = torch.zeros(70, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    eng.write_rows(fmt, st, None, eng.arange(20), a, flag)
    eng.write_rows(fmt, st, None, eng.arange(40), b[:40], flag)
    x = torch.zeros(90, 1500, dtype=torch.uint8)
    meta_out = torch.zeros(90, 3, dtype=torch.int32)
    src = torch.full((90,), -1, dtype=torch.int32)
    step = eng.reorder_sources(fmt, [x], meta_out, src, 32)
    with pytest.raises(IndexError):
        step([[a.data_ptr(), 20, 71, 0, 5]], flag)
    assert int(x.count_nonzero()) == 0
    sources = [[a.data_ptr(), 20, 70, 0, 5], [b.data_ptr(), 70, 0, 0, 6], [b.data_ptr(), 0, 0, 0, 7]]
    assert step(sources, flag) == [5, 7]
    assert [p[3] for p in sources] == [20, 40, 0]
    eng.write_rows(fmt, st, None, eng.span(40, 50), b[40:50], flag)
    assert step(sources[1:2], flag) == [] and sources[1][3] == 40          # 10 new rows: fewer than 32
    eng.write_rows(fmt, st, None, eng.span(50, 70), b[50:], flag)
    assert step(sources[1:2], flag) == [6] and sources[1][3] == 70
    ref_x = torch.zeros(90, 1500, dtype=torch.uint8)
    ref_meta = torch.cat([eng.unpack_rows(fmt, b, [ref_x[:70]]), eng.unpack_rows(fmt, a, [ref_x[70:]])])
    assert torch.equal(x, ref_x) and torch.equal(meta_out, ref_meta)
    assert torch.equal(src, torch.cat([torch.arange(70), torch.arange(20)]).to(torch.int32))


@needs_native
def test_reorder_step_copies_own_rows_from_their_sources():
    """A step made with ``own_src`` copies the receiving rank's own rows (payload fields, meta items, source
    row as source token) straight from the source tensors in the same call as the peers' rows, into the same
    bytes as reordering them through slots would; an own row outside the source, or own rows past the
    outputs, raise IndexError before anything is written."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, sel, _ = _rows_case((("x", 1000), ("scales", 8 * 4)), 3, n=5, T=9)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(9), 2)
    flag = P.flag_word(3, P.REGION_DISPATCH)
    peer = torch.zeros(4, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    eng.write_rows(fmt, st, None, eng.arange(4), peer, flag)
    own_slots = torch.zeros(5, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    eng.write_rows(fmt, st, None, sel, own_slots, flag)
    outs = [torch.zeros(9, 1000, dtype=torch.uint8), torch.zeros(9, 32, dtype=torch.uint8)]
    meta_out = torch.zeros(9, 3, dtype=torch.int32)
    src = torch.full((9,), -1, dtype=torch.int32)
    step = eng.reorder_sources(fmt, outs, meta_out, src, 32, own_src=(data, meta))
    assert step.copies_own
    for bad_sel, offset in ((torch.tensor([0, 9]), 0), (sel, 5)):
        with pytest.raises(IndexError):
            step([[peer.data_ptr(), 4, 5, 0, 1]], flag, (bad_sel, offset))
        assert all(int(t.count_nonzero()) == 0 for t in outs + [meta_out]) and bool((src == -1).all())
    sources = [[peer.data_ptr(), 4, 5, 0, 1]]
    assert step(sources, flag, (sel, 0)) == [1] and sources[0][3] == 4
    ref = [torch.zeros(9, 1000, dtype=torch.uint8), torch.zeros(9, 32, dtype=torch.uint8)]
    ref_meta = torch.cat([eng.unpack_rows(fmt, own_slots, [r[:5] for r in ref]),
                          eng.unpack_rows(fmt, peer, [r[5:] for r in ref])])
    assert all(torch.equal(a, b) for a, b in zip(outs, ref)) and torch.equal(meta_out, ref_meta)
    assert torch.equal(src, torch.cat([sel, torch.arange(4)]).to(torch.int32))
    # sources the C loop cannot address: the step takes no own rows and the caller copies them
    assert not eng.reorder_sources(fmt, outs, meta_out, src, 32, own_src=(data, meta[:, :2])).copies_own
    for own in ([0, 0, 0, 0, 0, 0, ()], (0, 0, 0, 0, 0, 0, ([0, 0],))):    # a list where a tuple belongs
        with pytest.raises(TypeError):
            native_engine._native.reorder_sources(fmt.blocks, flag, 32, 9, 0, 0, 0, 0, ((0, 1000, 1000, 1),), [], own)


@needs_native
def test_kept_send_phases_take_new_row_lists_and_store_the_same_bytes():
    """A send phase kept under a key is repeated by ``send_again`` for any row lists (a new routing every call
    reuses it) with the same stores as a send phase of them; a row list the C stores cannot take as it is
    (not int64, more rows than the slots hold) or rows of another size get False and nothing is stored.
    At most ``_MAX_PLANS`` are kept, the least recently used dropped first; ``forget`` drops them all and
    keeps nothing later."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, _, _ = _rows_case((("x", 1000),), 1, n=3, T=4)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(4), 0)
    flag = P.flag_word(2, P.REGION_DISPATCH)

    def job(sel, slots, ctrl):
        j = SendJob(fmt, st, None, None, flag)
        j.dests.append(Destination(1, sel, slots, ctrl, [sel.numel(), 7]))
        return j

    def memory():
        return (torch.zeros(4, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8),
                torch.zeros(1, P.BLOCK_BYTES, dtype=torch.uint8))
    first, (slots, ctrl) = torch.tensor([2, 0, 3]), memory()
    eng.send_phase(job(first, slots, ctrl), ("k",))
    for sel in (first, torch.tensor([1, 3]), torch.tensor([], dtype=torch.int64)):
        ref_slots, ref_ctrl = memory()
        eng.send_phase(job(sel, ref_slots, ref_ctrl))
        slots.zero_(), ctrl.zero_()
        assert eng.send_again(("k",), fmt, st, flag, [sel], [[sel.numel(), 7]])
        assert torch.equal(slots, ref_slots) and torch.equal(ctrl, ref_ctrl)
    slots.zero_(), ctrl.zero_()
    for sel in (torch.tensor([1, 3], dtype=torch.int32), torch.tensor([0, 1, 2, 3, 0]), torch.arange(6)[::2]):
        assert not eng.send_again(("k",), fmt, st, flag, [sel], [[sel.numel(), 7]])
    assert int(slots.count_nonzero()) == 0 and int(ctrl.count_nonzero()) == 0
    # rows of another size than the kept slots were checked for: refused, nothing stored past the slots
    wide = P.row_format("tff", (("x", 3000),), 1)
    wide_st, _, _ = eng.stage_rows(wide, [torch.ones(4, 3000, dtype=torch.uint8)], meta, eng.arange(4), 0)
    assert wide.blocks > fmt.blocks
    assert not eng.send_again(("k",), wide, wide_st, flag, [first], [[3, 7]])
    assert int(slots.count_nonzero()) == 0 and int(ctrl.count_nonzero()) == 0
    eng.send_phase(job(first, slots, ctrl), ("k",))       # kept again: drops nothing else
    for i in range(3 * native_engine._MAX_PLANS):
        eng.send_phase(job(torch.arange(3), *memory()), ("new", i))
        assert eng.send_again(("k",), fmt, st, flag, [first], [[3, 7]])
        assert len(eng._send_plans) <= native_engine._MAX_PLANS
    assert not eng.send_again(("new", 0), fmt, st, flag, [first], [[3, 7]])       # dropped long ago
    assert eng.send_again(("new", 3 * native_engine._MAX_PLANS - 1), fmt, st, flag, [first], [[3, 7]])
    eng.forget()
    assert not eng.send_again(("k",), fmt, st, flag, [first], [[3, 7]])
    eng.send_phase(job(first, slots, ctrl), ("k",))
    assert not eng._send_plans


@needs_native
def test_stage_and_send_stores_what_staging_then_sending_stores():
    """``stage_and_send`` (the usual exchange: rows of a format staged before, to a kept send phase) stores
    the bytes ``stage_rows`` then ``send_again`` store, with new meta items and payload every call; where
    either step would take its general path (no kept phase or staging, another source index, a field the C
    stores cannot address) it returns False and stores nothing."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, _, _ = _rows_case((("x", 1000),), 1, n=3, T=4)
    flag = P.flag_word(2, P.REGION_DISPATCH)

    def memory():
        return (torch.zeros(4, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8),
                torch.zeros(1, P.BLOCK_BYTES, dtype=torch.uint8))
    sel, (slots, ctrl) = torch.tensor([2, 0, 3]), memory()
    assert not eng.stage_and_send(("k",), fmt, data, meta, eng.arange(4), 0, flag, [sel], [[3, 7]])   # nothing kept
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(4), 0)
    job = SendJob(fmt, st, None, None, flag)
    job.dests.append(Destination(1, sel, slots, ctrl, [3, 7]))
    eng.send_phase(job, ("k",))
    for _ in range(3):
        data2 = [torch.randint(0, 256, d.shape, dtype=torch.uint8) for d in data]
        meta2 = torch.randint(-9, 9, meta.shape, dtype=torch.int32)
        ref_slots, ref_ctrl = memory()
        ref_st, _, _ = eng.stage_rows(fmt, data2, meta2, eng.arange(4), 0)
        ref_job = SendJob(fmt, ref_st, None, None, flag)
        ref_job.dests.append(Destination(1, sel, ref_slots, ref_ctrl, [3, 7]))
        eng.send_phase(ref_job)
        slots.zero_(), ctrl.zero_()
        assert eng.stage_and_send(("k",), fmt, data2, meta2, eng.arange(4), 0, flag, [sel], [[3, 7]])
        assert torch.equal(slots, ref_slots) and torch.equal(ctrl, ref_ctrl)
    slots.zero_(), ctrl.zero_()
    for args in ((("other",), fmt, data, meta, eng.arange(4)),           # no send phase kept under this key
                 (("k",), fmt, data, meta, torch.arange(4)),             # not the engine's shared source index
                 (("k",), fmt, data, None, eng.arange(4)),               # no staging of rows without meta kept
                 (("k",), fmt, [data[0][:, ::2]], meta, eng.arange(4)),  # a field that is not row by row
                 (("k",), fmt, [data[0][:2]], meta, eng.arange(4))):     # fewer rows than staged
        assert not eng.stage_and_send(*args, 0, flag, [sel], [[3, 7]])
    assert int(slots.count_nonzero()) == 0 and int(ctrl.count_nonzero()) == 0


@needs_native
def test_fields_outside_their_rows_are_refused_before_any_store():
    """The C loops address a row's fields by (first block, bytes): a field reaching past its rows' blocks, or
    into the meta block, or rows of no blocks, raise ValueError before anything is stored or read; payload
    rows narrower than their field are never handed to them."""
    eng = native_engine.NativeEngine()
    fmt, data, meta, _, _ = _rows_case((("x", 1000),), 1, n=2, T=2)
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(2), 0)
    flag = P.flag_word(1, P.REGION_DISPATCH)
    rows = torch.zeros(3, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    ctrl = torch.zeros(1, P.BLOCK_BYTES, dtype=torch.uint8)
    out = torch.zeros(2, 4000, dtype=torch.uint8)
    x, C = data[0], native_engine._native
    assert fmt.blocks == 4 and fmt.field_offset_blocks(0) == 1
    for block, nbytes in ((1, 1000 + 3 * P.TFF_PAYLOAD_BYTES), (2, 1000), (0, 1000)):
        with pytest.raises(ValueError):
            C.write_rows(rows.data_ptr(), 2, fmt.blocks, 0, 2, st.meta.data_ptr(), 0, 0, 0, flag,
                         ((x.data_ptr(), 1000, nbytes, block),))
        with pytest.raises(ValueError):
            C.send_exchange(fmt.blocks, 2, st.meta.data_ptr(), 0, flag, ((x.data_ptr(), 1000, nbytes, block),),
                            ((rows.data_ptr(), 2, 0, ctrl.data_ptr(), 1, (2, 7), 0, 0),))
        with pytest.raises(ValueError):
            C.unpack(rows.data_ptr(), 2, fmt.blocks, 0, 2, 0, 0, 0, 0, ((out.data_ptr(), 4000, nbytes, block),))
    for nb in (0, -1):                                   # rows of no blocks, or fewer
        with pytest.raises(ValueError):
            C.write_rows(rows.data_ptr(), 2, nb, 0, 2, st.meta.data_ptr(), 0, 0, 0, flag, ())
        with pytest.raises(ValueError):
            C.unpack(rows.data_ptr(), 2, nb, 0, 2, 0, 0, 0, 0, ())
    assert int(rows.count_nonzero()) == 0 and int(ctrl.count_nonzero()) == 0 and int(out.count_nonzero()) == 0
    # staged payload rows narrower than the format's field: not handed to the C stores (they would read past)
    narrow, _, _ = eng.stage_rows(fmt, [x[:, :900]], meta, eng.arange(2), 0)
    assert native_engine._payload_fields(st) is not None and native_engine._payload_fields(narrow) is None


@needs_native
def test_out_of_range_indices_are_refused_before_any_store():
    """The C loops write where indices say: an index outside its tensor raises IndexError and writes nothing."""
    fmt, data, meta, sel, patch = _rows_case((("x", 1000),), 1, n=4, T=4)
    eng = native_engine.NativeEngine()
    st, _, _ = eng.stage_rows(fmt, data, meta, eng.arange(4), 0)
    rows = torch.zeros(4, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(IndexError):
        eng.write_rows(fmt, st, None, torch.tensor([0, 1, 2, 4]), rows, 5)
    assert int(rows.count_nonzero()) == 0
    eng.write_rows(fmt, st, None, sel, rows, 5, meta_patch=patch)
    out = torch.zeros(4, 1000, dtype=torch.uint8)
    with pytest.raises(IndexError):
        eng.unpack_to(fmt, rows, torch.tensor([0, 1, 2, 4]), [out], None, None)
    with pytest.raises(IndexError):
        eng.unpack_to(fmt, rows, None, [out[:3]], None, None)
    assert int(out.count_nonzero()) == 0
    wfmt = P.row_format("tff", (("x", 500 * 2),), 0)
    wrows = torch.zeros(2, wfmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    res = torch.zeros(1, 500, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        eng.weighted_combine(wfmt, wrows, torch.tensor([[0, 1]]), torch.ones(1, 2), res, torch.tensor([[0, 2]]))
    with pytest.raises(IndexError):
        eng.weighted_combine(wfmt, wrows, torch.tensor([[0, 1]]), torch.ones(1, 2), res, torch.tensor([[0, 1]]),
                             local=(torch.zeros(3, 500, dtype=torch.bfloat16), 1, 2, torch.tensor([3])))


def test_engine_selection(monkeypatch):
    """"auto" takes the C path when it is built and allowed, else torch; "native" without it says how to get it."""
    from ubep_torch.engine import make_engine

    assert make_engine("torch").name == "torch"
    with pytest.raises(ValueError, match="backend must be"):
        make_engine("cuda")
    if native_engine.available():
        assert make_engine("auto").name == "native"
        monkeypatch.setenv("UBEP_NATIVE", "0")
        assert make_engine("auto").name == "torch"
        monkeypatch.delenv("UBEP_NATIVE")
    monkeypatch.setattr(native_engine, "_native", None)
    assert make_engine("auto").name == "torch"
    with pytest.raises(RuntimeError, match="C compiler"):
        make_engine("native")


@needs_native
def test_low_latency_combine_into_strided_out(pool):
    F.assert_all_same(pool.run(F.ll_strided_out))


@needs_native
@pytest.mark.parametrize("H", [7168, 100, 1])
def test_combine_reduction_checks_tokens_first(H):
    """The C normal-combine pass refuses a token out of range, a token twice in one source, or a token list
    of the wrong length before it writes anything; for good lists it has the torch path's bits."""
    g = torch.Generator().manual_seed(H)
    T, n = 9, 5
    fmt = P.row_format("tff", (("x", H * 2),), 0)
    own = torch.randn(n, H + 3, generator=g).bfloat16()[:, :H]       # strided rows
    x = torch.randn(n, H, generator=g).bfloat16()
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(n), 1)
    rows = torch.zeros_like(staging)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, P.flag_word(1, P.REGION_COMBINE))
    own_tok, peer_tok = torch.tensor([0, 2, 3, 7, 8]), torch.tensor([1, 2, 4, 5, 8])
    got, want = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16)
    native_engine.NativeEngine().reduce_sources(fmt, [(own, own_tok), (rows, peer_tok)], got)
    TorchEngine().reduce_sources(fmt, [(own, own_tok), (rows, peer_tok)], want)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not got[6].any()                                          # no rows: zeros
    for bad, err in ((torch.tensor([0, 2, 3, 7, 9]), IndexError), (torch.tensor([-1, 2, 3, 7, 8]), IndexError),
                     (torch.tensor([0, 2, 2, 7, 8]), IndexError), (torch.tensor([0, 2, 3, 7]), ValueError)):
        untouched = torch.full((T, H), 7.0, dtype=torch.bfloat16)
        with pytest.raises(err):
            native_engine.NativeEngine().reduce_sources(fmt, [(rows, peer_tok), (own, bad)], untouched)
        assert bool((untouched == 7.0).all())


def _awkward_bf16(n: int, H: int, g: torch.Generator) -> torch.Tensor:
    """bf16 rows with NaN, infinities, subnormals, signed zeros and sums that round either way."""
    x = torch.randn(n, H, generator=g) * torch.tensor([1e-3, 1.0, 3e4]).repeat(H)[:H]
    pick = torch.randint(0, 12, (n, H), generator=g)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, -0.0, 0.0, 3.0e38])
    x = torch.where(pick < special.numel(), special[pick.clamp(max=special.numel() - 1)], x)
    return x.bfloat16()


@needs_native
@pytest.mark.parametrize("H", [7168, 250, 241, 17, 1])
@pytest.mark.parametrize("pairs", [True, False], ids=["pair_loops", "element_loops"])
def test_pair_sums_have_the_element_loops_bits(H, pairs):
    """The sums two elements a word (the C path's default) and element by element give the torch path's bits
    for the normal combine (0 to 3 operands per token, strided and slot rows, odd widths, whose rows start on
    2-byte boundaries) and the weighted low-latency combine (masked slots, local rows), with NaN, infinities,
    subnormals and signed zeros in the operands."""
    from ubep_torch import _native
    g = torch.Generator().manual_seed(H)
    T, n = 11, 7
    fmt = P.row_format("tff", (("x", H * 2),), 0)
    own = _awkward_bf16(n, H + 3, g)[:, :H]                                 # strided rows
    slot_rows = []
    for _ in range(2):
        x = _awkward_bf16(n, H, g)
        staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(n), 1)
        rows = torch.zeros_like(staging)
        TorchEngine().write_rows(fmt, staging, checked, None, rows, P.flag_word(1, P.REGION_COMBINE))
        slot_rows.append(rows)
    sources = [(own, torch.tensor([0, 2, 3, 7, 8, 9, 10])), (slot_rows[0], torch.tensor([1, 2, 4, 5, 8, 9, 10])),
               (slot_rows[1], torch.tensor([2, 3, 5, 6, 8, 9, 4]))]
    want = torch.zeros(T, H, dtype=torch.bfloat16)
    TorchEngine().reduce_sources(fmt, sources, want)
    K = 4
    topk = torch.randint(-1, 3, (T, K), generator=g)
    w = torch.randn(T, K, generator=g)
    w[0, 0] = float("nan")
    pos = torch.randint(0, n, (T, K), generator=g)
    wfmt = P.row_format("tff", (("x", H * 2),), 0)
    local = (own, 0, 2, torch.tensor([4, 6]))                               # slots 0 and 1: local rows
    wwant = torch.zeros(T, H, dtype=torch.bfloat16)
    torch_slots = slot_rows[0].clone()
    for p, r in zip(range(local[1], local[2]), local[3].tolist()):          # the torch path reads slots only
        staged, chk, _ = TorchEngine().pack_rows(wfmt, [P.as_bytes(own[r:r + 1].contiguous())], None,
                                                 torch.arange(1), 1)
        TorchEngine().write_rows(wfmt, staged, chk, None, torch_slots[p:p + 1], P.flag_word(1, P.REGION_COMBINE))
    TorchEngine().weighted_combine(wfmt, torch_slots, topk, w, wwant, pos)
    try:
        _native.use_pair_sums(pairs)
        got = torch.full((T, H), 5.0, dtype=torch.bfloat16)
        native_engine.NativeEngine().reduce_sources(fmt, sources, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        wgot = torch.full((T, H), 5.0, dtype=torch.bfloat16)
        native_engine.NativeEngine().weighted_combine(wfmt, slot_rows[0], topk, w, wgot, pos, local=local)
        assert torch.equal(wgot.view(torch.int16), wwant.view(torch.int16))
    finally:
        _native.use_pair_sums(True)
