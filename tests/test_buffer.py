"""DeepEP-semantics tests of the Buffer on real multi-process gloo groups, every sync mode.

Rank-side code lives in ``core_rank_fns``; each test states the property and the reference is plain
torch over the all-gathered inputs of every rank.
"""
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import core_rank_fns as F  # noqa: E402

from ubep_torch.testing import RankPool  # noqa: E402

SYNCS = ["tff", "dc", "sp", "sw"]


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shm"))


@pytest.fixture(scope="module")
def pool2(shm_dir):
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": shm_dir}
    with RankPool(2, env=env) as p:
        yield p


@pytest.fixture(scope="module")
def pool4(shm_dir):
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": shm_dir}
    with RankPool(4, env=env) as p:
        yield p


@pytest.mark.parametrize("sync", SYNCS)
def test_normal_dispatch_combine_matches_reference(pool2, sync):
    out = pool2.run(F.smoke, sync)
    assert len(out) == 2


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_two_rank_combine_is_bit_exact(pool2, sync, dtype):
    import torch
    assert pool2.run(F.combine_pair_exact, sync, getattr(torch, dtype)) == [True, True]


@pytest.mark.parametrize("sync", SYNCS)
def test_dispatch_variants(pool2, sync):
    pool2.run(F.dispatch_variants, sync)


@pytest.mark.parametrize("sync", SYNCS)
def test_is_token_in_rank_decides_where_rows_go(pool2, sync):
    assert pool2.run(F.token_in_rank_decides, sync) == [True, True]


@pytest.mark.parametrize("sync", SYNCS)
def test_low_latency_roundtrip(pool2, sync):
    pool2.run(F.ll_roundtrip, sync)
    pool2.run(F.ll_roundtrip, sync, use_fp8=True, hook=True, zero_copy=True, seed=4)
    pool2.run(F.ll_roundtrip, sync, hook=True, seed=6)


def test_low_latency_fp8_with_ue8m0_scales(pool2):
    pool2.run(F.ll_roundtrip, "tff", H=512, use_fp8=True, ue8m0=True, seed=5)


def test_with_block_destroys_the_buffer_and_repr_tells_its_state(pool2):
    pool2.run(F.context_manager_and_repr)


def test_low_latency_buffer_without_normal_region(pool2):
    """(former behaviour: num_nvl_bytes=0 in low-latency mode still reserved a 256 MiB normal region)"""
    assert all(n < 16 << 20 for n in pool2.run(F.low_latency_only_buffer))


def test_zero_copy_buffers_of_other_shapes_share_memory(pool2):
    """(former bug: fetching another handle's buffer of another shape replaced the one already written, and
    the zero-copy combine read zeros)"""
    assert pool2.run(F.ll_zero_copy_shapes) == [True, True]


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_low_latency_two_in_flight(pool2, sync):
    pool2.run(F.ll_two_in_flight, sync)


@pytest.mark.parametrize("sync,k", [("tff", 3), ("sp", 4), ("dc", 8)])
def test_low_latency_more_buffers_in_flight(pool2, sync, k):
    """More calls waiting for their recv hook than DeepEP's two buffers allow (one of its users' pain
    points), with ``low_latency_buffers``."""
    assert pool2.run(F.ll_k_in_flight, sync, k) == [True, True]


def test_too_small_for_its_receive_buffers_names_their_size(pool2):
    """(former bug: the message named the two-buffer size, the very size passed)"""
    for size3, msgs in pool2.run(F.ll_buffers_size_message):
        assert len(msgs) == 2 and all(f">= {size3} (for low_latency_buffers=3" in m for m in msgs), (size3, msgs)


@pytest.mark.parametrize("sync", SYNCS)
def test_bad_inputs_raise_before_sending_and_buffer_stays_usable(pool2, sync):
    names = pool2.run(F.bad_inputs, sync)
    assert names[0] == names[1] and len(names[0]) == 33


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_routing_by_content_inference_mode_and_ll_combine_routings(pool2, sync):
    assert pool2.run(F.routing_robustness, sync) == [["inference_mode", "numpy_write", "ll_combine_routings",
                                                           "requires_grad", "functional_padding"]] * 2


@pytest.mark.parametrize("sync", SYNCS)
def test_repeated_calls_with_changing_shapes(pool2, sync):
    pool2.run(F.repeated, sync)


@pytest.mark.parametrize("sync,backend", [("tff", "auto"), ("sp", "auto"), ("tff", "torch")])
def test_a_dispatch_that_repeats_the_last_one_checks_less_and_gives_the_same_bits(pool2, sync, backend):
    res = pool2.run(F.repeated_dispatch_checks, sync, backend)
    for short, took, errors in res:
        # (the dispatch of every compared call took the short checks, and its combine but for an expert-major one)
        assert took == [(1, 1), (1, 0), (1, 1), (1, 1), (1, 1), (1, 1)], res
        assert short["dispatch"] >= 10 and short["combine"] >= 10, res
        assert errors == {"expert counts": "ValueError", "rank counts": "ValueError", "weights shape": "ValueError",
                          "alignment": "ValueError", "layout": "ValueError", "no expert counts": "ValueError",
                          "routing changed in place": True,
                          "counts of another routing": "ValueError", "combine rows": "ValueError",
                          "combine hidden": "ok", "combine of a copied handle": "ok, all columns"}, res


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_ranks_that_repeat_their_routing_next_to_ranks_that_change_it(pool2, sync):
    assert pool2.run(F.some_ranks_repeat_their_routing, sync) == [True, True]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_expert_counts_count_slots_as_deepep_does(pool4, backend):
    counts = pool4.run(F.slot_counts, backend)
    assert len(counts) == 4 and all(len(c) == 4 for c in counts)


@pytest.mark.parametrize("sync", ["tff", "sp", "sw"])
def test_four_ranks(pool4, sync):
    pool4.run(F.smoke, sync, T=13)
    pool4.run(F.dispatch_variants, sync)
    pool4.run(F.ll_roundtrip, sync, use_fp8=True, seed=9)


def test_timeout_names_missing_ranks(pool2):
    elapsed = pool2.run(F.timeout_names_missing_rank)
    assert 0.9 <= elapsed[0] < 10.0


def test_no_segment_left_in_shm_dir(pool2, shm_dir):
    pool2.run(F.smoke, "tff")
    assert pool2.run(F.shm_entries, shm_dir) == [[], []]


def test_failure_inside_a_call_aborts_peer_waits(pool2):
    (n0, _, _), (n1, t1, a1) = pool2.run(F.peer_failure_aborts_waits)
    assert n0 == "InjectedFailure"
    assert n1 == "UBEPPeerAbortedError" and t1 < 5.0 and a1 == [0]


def test_failure_on_four_ranks_names_the_rank_that_failed(pool4):
    out = pool4.run(F.peer_failure_aborts_waits)
    assert out[0][0] == "InjectedFailure"
    assert all(name == "UBEPPeerAbortedError" and t < 5.0 and aborted == [0] for name, t, aborted in out[1:]), out


def test_an_interrupted_call_is_named_in_later_errors(pool2):
    """A KeyboardInterrupt has no message: the broken Buffer's later errors name it and its call (they
    ended in "KeyboardInterrupt: " with nothing after it)."""
    (n0, m0), (n1, _) = pool2.run(F.interrupted_call_is_named)
    assert n0 == "UBEPBrokenError" and "KeyboardInterrupt during call 3 of this Buffer" in m0, m0
    assert n1 == "UBEPPeerAbortedError"


def test_a_peer_that_destroyed_its_buffer_is_named_at_once(pool2):
    out = pool2.run(F.peer_destroyed_its_buffer)
    assert out[1] is None and out[0][:2] == ([1], True) and out[0][2] < 5.0, out


def test_a_destroyed_peer_counts_only_when_a_wait_needs_it():
    """A rank may destroy its Buffer once it has done its part of the last call while the others still
    deliver to each other: a wait that does not need that rank is not failed by it."""
    from ubep_torch import protocol as P
    from ubep_torch.errors import UBEPPeerLostError

    codes = {0: P.ABORT_DESTROYED, 1: 0, 2: 0}
    looked = []

    def code(r):
        looked.append(r)
        return codes[r]
    w = P.Waiter(1, 5.0, lambda r: True, code)
    w.world_size = 3
    late = time.monotonic() + 0.3
    w.wait("test phase", lambda: [2] if time.monotonic() < late else [])   # rank 0's departure is not needed
    assert 0 in looked                               # (the abort words were consulted meanwhile)
    with pytest.raises(UBEPPeerLostError, match=r"\[0\] destroyed its Buffer"):
        P.Waiter(1, 5.0, lambda r: True, lambda r: codes[r]).wait("test phase", lambda: [0, 2])


def test_a_peer_that_delivered_before_destroying_its_buffer_is_not_blamed():
    """A wait looks at the abort words after a poll that found a peer missing: the peer may have delivered
    in between, then completed its call and destroyed its Buffer (a rank descheduled there on a loaded
    machine). Its delivery is polled again before the peer is blamed."""
    from ubep_torch import protocol as P

    delivered = []

    def code(r):     # by the time the abort words are read, rank 0 has delivered and destroyed its Buffer
        delivered.append(r)
        return P.ABORT_DESTROYED if r == 0 else 0
    w = P.Waiter(1, 5.0, lambda r: not delivered, code)
    w.world_size = 2
    w.wait("test phase", lambda: [] if delivered else [0])


def test_a_deadline_shorter_than_the_liveness_period_still_names_the_cause():
    """Under a ``timeout_s`` below the ~50 ms between looks at the peers' state, a wait on a rank that
    refused the call, aborted or died raises that, not a timeout blaming a stalled rank (former bug: a refusal
    on one rank with timeout_s=0.03 broke every Buffer with UBEPTimeoutError)."""
    from ubep_torch import protocol as P
    from ubep_torch.errors import UBEPPeerAbortedError, UBEPPeerLostError, UBEPTimeoutError

    def waiter(alive, how):
        w = P.Waiter(0, 0.01, lambda r: alive, lambda r: how if r == 1 else 0)
        w.world_size = 2
        return w
    with pytest.raises(UBEPPeerAbortedError) as e:
        waiter(True, P.ABORT_REFUSED).wait("test phase", lambda: [1])
    assert e.value.refused and e.value.aborted_ranks == [1]
    with pytest.raises(UBEPPeerAbortedError) as e:
        waiter(True, P.ABORT_FAILED).wait("test phase", lambda: [1])
    assert not e.value.refused
    with pytest.raises(UBEPPeerLostError):
        waiter(False, 0).wait("test phase", lambda: [1])
    with pytest.raises(UBEPTimeoutError):       # (a rank that is merely late still times out)
        waiter(True, 0).wait("test phase", lambda: [1])


def test_a_rank_that_died_is_named_where_the_ranks_waited_for_gave_up_on_it():
    """Three ranks: rank 2 dies without a word after delivering to rank 0 (or sending it nothing); rank 1,
    which waits for it, gives up. Rank 0, waiting for rank 1 only, names rank 2 as the rank that exited (the
    cause), not rank 1 as the one that gave up (former gap). A rank that failed itself is still named as
    such, and with every rank alive the rank that gave up is."""
    from ubep_torch import protocol as P
    from ubep_torch.errors import UBEPPeerAbortedError, UBEPPeerLostError

    def waiter(codes, dead):
        w = P.Waiter(0, 5.0, lambda r: r not in dead, lambda r: codes.get(r, 0))
        w.world_size = 3
        return w
    with pytest.raises(UBEPPeerLostError) as e:
        waiter({1: P.ABORT_GAVE_UP}, {2}).wait("test phase", lambda: [1])
    assert e.value.dead_ranks == [2] and e.value.missing_ranks == [1]
    with pytest.raises(UBEPPeerAbortedError) as e:
        waiter({1: P.ABORT_FAILED}, {2}).wait("test phase", lambda: [1])
    assert e.value.aborted_ranks == [1]
    with pytest.raises(UBEPPeerAbortedError) as e:
        waiter({1: P.ABORT_GAVE_UP}, set()).wait("test phase", lambda: [1])
    assert e.value.aborted_ranks == [1]
    # rank 2 gave up and exited between this rank's look at the abort words and at the processes: it is
    # asked again, and not named as a rank that exited without a word
    asked = []

    def late_code(r):
        asked.append(r)
        return P.ABORT_GAVE_UP if r == 1 or (r == 2 and asked.count(2) > 1) else 0
    w = P.Waiter(0, 5.0, lambda r: r != 2, late_code)
    w.world_size = 3
    with pytest.raises(UBEPPeerAbortedError) as e:
        w.wait("test phase", lambda: [1])
    assert e.value.aborted_ranks == [1] and asked.count(2) == 2


@pytest.mark.parametrize("sync", ["sp", "tff"])
def test_last_ll_combine_with_a_peer_that_destroys_its_buffer_at_once(pool2, sync):
    """ll_k_in_flight's last combine with rank 0 stalled between its poll and its look at the abort words
    while rank 1 delivers, completes and destroys its Buffer (once seen in a loaded run of the suite)."""
    assert pool2.run(F.ll_k_in_flight, sync, 4, preempted=True) == [True, True]


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_clean_accepts_sizes_that_fp8_low_latency_calls_fit(pool2, sync):
    assert pool2.run(F.clean_of_an_fp8_sized_buffer, sync) == ["refused", "refused"]


def test_num_worst_tokens_too_small_raises_and_buffer_stays_usable(pool2):
    assert pool2.run(F.worst_tokens_too_small) == [True, True]


def test_buffer_arguments_must_agree_across_ranks(pool2, shm_dir):
    out = pool2.run(F.mismatched_buffer_args)
    assert out == [{"num_nvl_bytes": True, "sync": True, "low_latency_mode": True}] * 2, out
    assert pool2.run(F.shm_entries, shm_dir) == [[], []]


@pytest.mark.parametrize("case", ["hidden", "experts"])
def test_a_mismatch_after_calls_that_agreed_is_reported(pool2, case):
    """A rank keeps what the peers' last control messages said while they repeat: a call that differs on one
    rank after such calls is still checked (the layout, or num_experts, which no rank sees alone)."""
    out = pool2.run(F.mismatch_after_agreeing_calls, case)
    expect = "different layout" if case == "hidden" else "num_experts"
    assert all(name == "UBEPMismatchError" and expect in msg for name, msg in out), out


def test_mismatched_hidden_sizes_are_reported(pool2):
    out = pool2.run(F.mismatched_hidden)
    assert all(name is not None for name, _ in out)
    assert any("different layout" in msg for _, msg in out)


@pytest.mark.parametrize("case", ["dtype", "hidden", "topk", "combine", "cached", "scales"])
def test_rows_of_the_same_bytes_but_other_dtypes_or_top_k_are_reported(pool2, case):
    out = pool2.run(F.same_bytes_other_rows, case)
    assert all(name == "UBEPMismatchError" and "different layout" in msg for name, msg in out), out
    assert case != "scales" or all("scales' dtype and width" in msg for _, msg in out), out


@pytest.mark.parametrize("case", ["topk", "hidden"])
def test_low_latency_rows_of_another_layout_are_reported_with_the_causes(pool2, case):
    """(former message: 'rank 1 sent low-latency rows of a different layout than rank 0 expects', naming no
    cause)"""
    out = pool2.run(F.ll_layout_mismatch, case)
    for r, (name, msg) in enumerate(out):
        assert name == "UBEPMismatchError" and \
            f"rank(s) [{1 - r}] sent low_latency_dispatch rows of a different layout" in msg and \
            "hidden size, dtype, top-k" in msg, out


@pytest.mark.parametrize("low_latency", [False, True])
def test_mismatched_call_arguments_are_reported(pool2, low_latency):
    out = pool2.run(F.mismatched_call_args, low_latency)
    name = "num_max_dispatch_tokens_per_rank" if low_latency else "num_experts"
    assert all(kind == "UBEPMismatchError" and name in msg for kind, msg in out), out


@pytest.mark.parametrize("nvl", [0, 4096])
def test_low_latency_buffer_without_normal_room_and_a_slow_rank(pool2, nvl):
    assert pool2.run(F.ll_only_buffer_with_a_slow_rank, nvl) == [6, 6]


def test_mismatch_check_rereads_the_awaited_message(pool2):
    seen = pool2.run(F.mismatch_check_rereads)[0]
    assert seen[:2] == [[1], [1]], seen
    assert len(seen) == 4 and "rank 1 called low_latency_dispatch" in seen[2], seen
    assert "rank 1 called combine" in seen[3], seen


@pytest.mark.parametrize("sync,case", [("tff", "skipped combine"), ("sw", "skipped combine"),
                                       ("tff", "low-latency"), ("sp", "low-latency with a hook"),
                                       ("tff", "clean against low-latency"), ("sw", "clean against low-latency"),
                                       ("tff", "clean against dispatch")])
def test_ranks_in_different_operations_fail_at_once(pool2, sync, case):
    """(They used to wait for the 60 s deadline; a clean_low_latency_buffer against another call too, and in
    sync="sw" its barrier paired with the other call's first one: it returned, as if both ranks had cleaned.)"""
    (kind0, msg0, t0, _), (kind1, msg1, t1, _) = pool2.run(F.mismatched_operations, sync, case)
    ops = {"skipped combine": ("combine", "dispatch"),
           "clean against dispatch": ("clean_low_latency_buffer", "dispatch"),
           "clean against low-latency": ("clean_low_latency_buffer", "low_latency_dispatch")}.get(
               case, ("dispatch", "low_latency_dispatch"))
    assert kind0 == kind1 == "UBEPMismatchError", (msg0, msg1)
    assert f"rank 0 called {ops[0]} " in msg0 and f"rank 1 called {ops[1]}:" in msg0, msg0
    assert f"rank 1 called {ops[1]} " in msg1 and f"rank 0 called {ops[0]}:" in msg1, msg1
    assert max(t0, t1) < 20, (t0, t1, msg0, msg1)


@pytest.mark.parametrize("sync", ["tff", "sw"])
def test_a_rank_late_to_mismatched_calls_learns_that_the_calls_differ(pool4, sync):
    """Rank 0 makes a normal dispatch, the others a low-latency one, rank 3 half a second after the rest: the
    first three find the mismatch (UBEPMismatchError naming both operations: those that see their peers'
    aborts first say that the peers found the calls to differ) and abort, and rank 3, which finds their
    aborts, says that they found the ranks' calls to differ (it said only that they "failed or gave up")."""
    out = pool4.run(F.mismatched_operations, sync, "low-latency", 3)

    def told(o):
        return o[0] == "UBEPPeerAbortedError" and o[3] is True and "found that the ranks' calls differ" in o[1]
    assert all(told(o) or o[0] == "UBEPMismatchError" and "called dispatch" in o[1]
               and "called low_latency_dispatch" in o[1] for o in out[:3]), out
    assert any(o[0] == "UBEPMismatchError" for o in out[:3]), out
    assert told(out[3]) and out[3][2] < 5, out[3]


@pytest.mark.parametrize("sync", SYNCS)
def test_calls_larger_than_the_slots_run_in_several_exchanges(pool2, sync):
    assert pool2.run(F.normal_rounds, sync) == [23, 3]


@pytest.mark.parametrize("sync", ["tff", "sp"])
def test_a_slow_reader_keeps_its_rows_when_peers_move_on(pool2, sync):
    assert pool2.run(F.slow_reader_in_shared_region, sync) == [8, 8]


def test_calls_larger_than_the_slots_on_four_ranks(pool4):
    assert pool4.run(F.normal_rounds, "tff") == [23, 3, 0, 17]
    assert pool4.run(F.normal_rounds, "sp", backend="torch") == [23, 3, 0, 17]


def test_many_local_experts_use_multi_block_control_messages(pool2):
    # 64 local experts: the per-expert counts need two control blocks
    pool2.run(F.smoke, "tff", E=128, K=6, T=20)
    pool2.run(F.smoke, "dc", E=128, K=6, T=20, seed=3)


@pytest.mark.parametrize("sync", SYNCS)
def test_deepep_semantics_with_torch_backend(pool2, sync):
    """The tests above run the default engine (the C data path where it was built); the torch path too."""
    pool2.run(F.smoke, sync, backend="torch")
    pool2.run(F.ll_roundtrip, sync, backend="torch")
    pool2.run(F.ll_roundtrip, sync, use_fp8=True, hook=True, zero_copy=True, seed=4, backend="torch")
    pool2.run(F.ll_roundtrip, sync, hook=True, seed=6, backend="torch")
    pool2.run(F.dispatch_variants, sync, backend="torch")


@pytest.mark.parametrize("sync", ["tff", "sp", "dc", "sw"])
def test_deepep_semantics_with_triton_backend(pool2, sync):
    pool2.run(F.smoke, sync, T=6, backend="triton")
    pool2.run(F.ll_roundtrip, sync, T=4, backend="triton")
    if sync in ("tff", "sp"):
        pool2.run(F.dispatch_variants, sync, backend="triton")
    if sync == "tff":
        assert pool2.run(F.normal_rounds, sync, backend="triton") == [23, 3]


def _engine(name):
    """A fresh engine of that name (the C one is skipped where it was not built)."""
    from ubep_torch import native_engine
    from ubep_torch.engine import TorchEngine

    if name == "native":
        if not native_engine.available():
            pytest.skip("ubep_torch._native was not built")
        return native_engine.NativeEngine()
    return TorchEngine()


ENGINES = ["torch", "native"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64"])
@pytest.mark.parametrize("sync,every", [("tff", True), ("tff", False), ("sp", True), ("dc", False)])
def test_combine_reduction_equals_accumulator_from_zero(dtype, sync, every, engine):
    """The normal combine's one-pass reduction (``reduce_sources``) has the bits of an accumulator in the
    rows' precision (float32; float64 for float64) that starts at +0.0 and adds the sources in order,
    rounded once: this rank's strided rows first, two sources read from the slots, then a bias, with every
    token in every source or each source with its own subset of tokens (and a token with none). Every
    16-bit pattern against random ones (NaNs, signed zeros, infinities, subnormals), random bit patterns
    for float32/float64; SP rows whose payload equals the sentinel are escaped. The C and torch engines
    agree bit for bit."""
    import torch

    from ubep_torch import protocol as P
    from ubep_torch.engine import TorchEngine

    dt = getattr(torch, dtype)
    es = torch.empty(0, dtype=dt).element_size()
    g = torch.Generator().manual_seed(11)
    T, H = 256, 500                                  # H * 2 not a multiple of the 480 B TFF payload
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[es]
    lo, hi = -(1 << (8 * es - 1)), (1 << (8 * es - 1))

    def rnd(n, width=H):
        if es == 8:
            return torch.randint(-(1 << 62), 1 << 62, (n, width), generator=g).view(dt)
        return torch.randint(lo, hi, (n, width), dtype=torch.int64, generator=g).to(bits).view(dt)

    def tokens():
        if every:
            return torch.arange(T)
        keep = torch.rand(T, generator=g) < 0.6
        keep[7] = False                                      # token 7 comes back from nobody
        return keep.nonzero().squeeze(1)

    own_tok = tokens()
    own = rnd(own_tok.numel(), H + 3)[:, :H]                  # strided rows, as a slice of x
    if es == 2 and own.shape[0] >= 128:
        own[:128, :H] = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dt).view(128, 512)[:, :H]
    own[100:110] = -0.0
    fmt = P.row_format(sync, (("x", H * es),), 0)
    sources, ref_rows = [(own, own_tok)], [(own, own_tok)]
    for i in range(2):
        tok = tokens()
        x = rnd(tok.numel())
        x[100:105], x[105:110] = -0.0, 0.0                    # zero rows: SP sentinel collisions
        staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(tok.numel()), i)
        rows = torch.zeros_like(staging)                      # the slots, as the receiver sees them
        TorchEngine().write_rows(fmt, staging, checked, None, rows, P.flag_word(1, P.REGION_COMBINE))
        sources.append((rows, tok))
        ref_rows.append((x, tok))
    bias = rnd(T)
    sources.append((bias, None))
    ref_rows.append((bias, torch.arange(T)))
    acc_dt = torch.float64 if dt == torch.float64 else torch.float32
    acc = torch.zeros(T, H, dtype=acc_dt)
    for x, tok in ref_rows:
        acc[tok] = acc[tok] + x.to(acc_dt)
    ref = acc.to(dt)
    out = torch.full((T, H), float("nan"), dtype=dt)
    _engine(engine).reduce_sources(fmt, sources, out)
    # (which NaN survives when two meet depends on the operator's operand order: NaNs compare as NaNs)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.view(bits)[~out.isnan()], ref.view(bits)[~ref.isnan()])
    if engine == "native":      # the engines agree bit for bit (a bf16 NaN is stored as 0xFFFF by both)
        want = torch.empty_like(out)
        TorchEngine().reduce_sources(fmt, sources, want)
        assert torch.equal(out.view(bits), want.view(bits))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("sync", SYNCS)
def test_weighted_combine_paths_agree_bit_for_bit(sync, engine):
    """The one-step path for small low-latency combines and the per-column path give the same bits,
    stale NaN bytes in masked slots and signed zeros included; both match a float32 reference."""
    import torch

    from ubep_torch import protocol as P

    g = torch.Generator().manual_seed(7)
    T, K, H = 6, 4, 1000                                    # H not a multiple of the 480 B payload
    n = T * K
    x = torch.randn(n, H, generator=g).bfloat16()
    x[3, :5] = -0.0
    x[0] = float("nan")                                     # a stale row: masked slots read row 0
    x[7, 11:40] = float("inf")
    x[9, :300] = float("nan")                               # NaN, infinities and huge products survive
    x[10, 500:] = 3e38
    fmt = P.row_format(sync, (("x", H * 2),), 0)
    eng = _engine(engine)
    staging, _, _ = eng.pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(n), 0)
    rows = staging.clone()
    if sync == "sp":                                        # as the receiver sees them after step 2
        rows.view(torch.int64).view(n, fmt.blocks, P.BLOCK_WORDS)[:, :, 0] = \
            eng.pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(n), 0)[1]
    topk = torch.randint(0, 8, (T, K), generator=g)
    topk[1, 2] = -1
    topk[4, 0] = -1
    pos = torch.randperm(n, generator=g).view(T, K)
    pos[pos == 0] = 5                                       # no valid slot reads the NaN row
    pos[1, 2] = pos[4, 0] = 0
    w = torch.rand(T, K, generator=g)
    w[0, 1] = -0.0
    outs = []
    for small in (1 << 30, 0):
        eng.small_combine_elems = small
        out = torch.empty(T, H, dtype=torch.bfloat16)
        eng.weighted_combine(fmt, rows, topk, w, out, pos)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    valid = topk >= 0
    ref = torch.zeros(T, H)
    for k in range(K):
        ref = ref + torch.where(valid[:, k:k + 1], x[pos[:, k]].float() * w[:, k:k + 1], torch.zeros(1))
    assert torch.equal(outs[0].view(torch.int16), ref.bfloat16().view(torch.int16))


def test_size_hints_hold_what_they_promise():
    """``Config.get_nvl_buffer_size_hint`` / ``normal_buffer_bytes`` and ``get_low_latency_rdma_size_hint``
    give regions that hold the rows they were asked for, for any token count, hidden size, top-k (ids
    and weights, or one-row-per-token items), fp8 and world size: tiny ones included, where the 4 KiB
    alignment of the regions eats a larger share."""
    from ubep_torch import buffer as B
    from ubep_torch import protocol as P
    for R in (1, 2, 3, 4):
        for T in (1, 2, 3, 17, 128):
            for hidden_bytes in (1, 7, 256, 2000, 14336):
                nvl = B.normal_buffer_bytes(T, hidden_bytes, R) // 4096 * 4096
                region = B._Region(P.REGION_DISPATCH, 0, nvl, R, R, halves=1)
                for meta_words in (0, 16, 48):
                    fmt = P.row_format("tff", (("x", hidden_bytes),), meta_words)
                    assert region.capacity(fmt) >= T, (R, T, hidden_bytes, meta_words)
        for N in (1, 3, 128):
            for H in (1, 128, 7168):
                for E_local in (1, 3, 8):
                    half = B.Buffer.get_low_latency_rdma_size_hint(N, H, R, E_local * R) // 2 // 4096 * 4096
                    dispatch = B._Region(P.REGION_LL_DISPATCH, 0, half, R, R)
                    combine = B._Region(P.REGION_LL_COMBINE, 0, half, R, 1)
                    for K in (1, 8, 16):
                        fields = [(("x", H * 2),)] + ([(("x", H), ("scales", H // 128 * 4))] if H % 128 == 0 else [])
                        for f in fields:
                            for meta_words in (1, 1 + 2 * K):
                                assert dispatch.capacity(P.row_format("tff", f, meta_words)) >= E_local * N
                        assert combine.capacity(P.row_format("tff", (("x", H * 2),), 0)) >= N * K


def test_benchmark_copies_only_round_trip_moves_the_rows(pool4):
    """The benchmark's floor (plain copies through shared memory) must move what a round trip moves."""
    for rank_result in pool4.run(F.bench_copies_only):
        for rows_equal, excess in rank_result:
            assert rows_equal
            assert excess <= 0, excess


def test_get_local_buffer_tensor_takes_deepeps_arguments(pool2):
    """(former signature: (dtype, offset), the whole segment; a negative offset counted from its end)"""
    for out in pool2.run(F.local_buffer_tensor):
        assert out == [(1 << 20,), (4, 8), True, "ValueError", "ValueError", "ValueError", "TypeError",
                       "TypeError"], out


def test_deepeps_event_idioms_run_unchanged(pool2):
    """(former gaps: ubep_torch had no EventHandle, so ``EventOverlap(EventHandle())`` failed at import; the
    events of ``capture()`` and of calls with ``async_finish=True`` held None, where DeepEP's hold an
    EventHandle)"""
    for err, kinds in pool2.run(F.deepep_event_idioms):
        assert err < 1e-5
        assert kinds == ["EventHandle"] * 4 + ["NoneType"] + ["EventHandle"] * 2


def test_results_sent_to_another_process_are_never_overwritten(pool2):
    """(former bug: the output cache reused a result's memory once the rank dropped it, though the pool's
    process still held it: torch had moved it to shared memory to send it, and later calls overwrote it)"""
    kept = [pool2.run(F.results_sent_away, float(v)) for v in (1, 2, 3)]
    for v, per_rank in zip((1, 2, 3), kept):
        for rank, (recv_x, combined) in enumerate(per_rank):
            assert combined.eq(v).all(), (v, rank)
            assert recv_x.shape[0] == (128 if rank == 0 else 0) and recv_x.eq(v).all(), (v, rank)


def test_a_row_format_hashes_once_and_anew_in_another_process():
    """A row format keys the Buffer's caches: its hash is computed once, equals that of an equal format made
    apart, and is not carried in a pickle (a string's hash differs between processes)."""
    import pickle

    from ubep_torch import protocol as P
    fmt = P.row_format("tff", (("x", 14336),), 16, "torch.bfloat16/8/torch.float32")
    twin = P.RowFormat("tff", (("x", 14336),), 16, "torch.bfloat16/8/torch.float32")
    assert twin is not fmt and twin == fmt and hash(twin) == hash(fmt) and {fmt: 1}[twin] == 1
    assert hash(P.RowFormat("tff", (("x", 14336),), 16, "other")) != hash(fmt)
    assert "_hash" in fmt.__dict__ and fmt.blocks == 31
    back = pickle.loads(pickle.dumps(fmt))
    assert back == fmt and "_hash" not in back.__dict__ and back.blocks == 31 and hash(back) == hash(fmt)
