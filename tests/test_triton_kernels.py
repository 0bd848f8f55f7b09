"""Kernel unit tests: each kernel against its plain-torch reference, in one process.

Block writers and pollers are compared byte for byte with ``TorchEngine`` on local tensors that play
the peer's memory; mapper kernels with ``ubep_torch.mapper``; combine kernels with the torch formulas
the Buffer uses.
"""
from __future__ import annotations

import os

import pytest
import torch

from ubep_torch import mapper as M
from ubep_torch import protocol as P
from ubep_torch import triton_engine as TE
from ubep_torch.engine import Destination, SendJob, TorchEngine

SYNCS = ("tff", "dc", "sp", "sw")


# ----------------------------------------------------------------------------- interpreter policy
def test_interpreter_is_scoped_to_our_kernels():
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    assert isinstance(TE.kdispatch.send_phase_kernel, InterpretedFunction)
    assert isinstance(TE.kmapper.quaternary_search_kernel, InterpretedFunction)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert isinstance(std.sum, JITFunction), "triton's own library must keep the process's configuration"


@pytest.mark.parametrize("first", ["ubep_torch.kernels.mapper", "ubep_torch.kernels", "ubep_torch.triton_engine"])
def test_kernels_are_interpreted_whatever_is_imported_first(first):
    """In a fresh process, with the interpreter switched off for the process: importing a kernel module first
    still defines every kernel under the interpreter, restores the variable, and the engine loads."""
    import subprocess
    import sys
    code = (f"import os, {first}; import ubep_torch.triton_engine as TE\n"
            "from triton.runtime.interpreter import InterpretedFunction as I\n"
            "assert isinstance(TE.kmapper.quaternary_search_kernel, I), 'mapper kernel compiled'\n"
            "assert isinstance(TE.kdispatch.send_phase_kernel, I), 'dispatch kernel compiled'\n"
            "assert os.environ['TRITON_INTERPRET'] == '0', os.environ['TRITON_INTERPRET']\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ----------------------------------------------------------------------------- mapper
def test_quaternary_search_matches_searchsorted_and_reference():
    g = torch.Generator().manual_seed(0)
    for E in (1, 2, 3, 7, 64, 333, 1024):
        counts = torch.randint(0, 4, (E,), generator=g)
        counts[0] += 1
        cum = torch.cumsum(counts, 0)
        t = torch.randint(0, int(cum[-1]), (300,), generator=g)
        idx, steps = TE.quaternary_search(cum, t)
        assert torch.equal(idx, torch.searchsorted(cum, t, right=True))
        ridx, rsteps = M.quaternary_search(cum, t)
        assert torch.equal(idx, ridx) and torch.equal(steps, rsteps)
        assert int(steps.max()) <= 5, (E, int(steps.max()))


def test_quaternary_search_out_of_range_targets():
    cum = torch.tensor([2, 2, 5])
    idx, steps = TE.quaternary_search(cum, torch.tensor([-1, 5, 7, 0, 4]))
    assert idx.tolist() == [3, 3, 3, 0, 2]
    assert steps[:3].tolist() == [0, 0, 0]


@pytest.mark.parametrize("mapping", (True, False))
def test_mapper_kernels_match_reference(mapping):
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        E = int(torch.randint(1, 48, (), generator=g))
        n = int(torch.randint(1, 12, (), generator=g))
        hop = torch.randint(0, 4, (E,), generator=g)
        topk = torch.randint(-1, E, (int(torch.randint(0, 20, (), generator=g)), 3), generator=g)
        ref = M.map_tokens_to_aivs(topk, E, n, hop, mapping)
        assert torch.equal(TE.remap_experts(E, hop, mapping), ref.order)
        got = TE.aiv_slices(torch.cumsum(ref.counts[ref.order], 0), n, mapping)
        for k in ("slice_start_pos", "slice_start_offset", "search_steps", "loads", "slice_bounds"):
            assert torch.equal(got[k], getattr(ref, k)), k
        assert int(got["loads"].max() - got["loads"].min()) <= 1     # equal slices: loads differ by <= 1
    # no destinations, and no AIVs (former bugs: zeros for the offsets, and n_aivs=0 returned empty slices)
    ref = M.map_tokens_to_aivs(torch.zeros(0, 1, dtype=torch.int64), 0, 3, None, mapping)
    got = TE.aiv_slices(torch.zeros(0, dtype=torch.int64), 3, mapping)
    for k in ("slice_start_pos", "slice_start_offset", "search_steps", "loads", "slice_bounds"):
        assert torch.equal(got[k], getattr(ref, k)), k
    for n in (0, -1):
        with pytest.raises(ValueError, match="n_aivs"):
            TE.aiv_slices(torch.tensor([1, 3]), n, mapping)
    # no experts and every slot -1 (former bug: IndexError)
    assert M.map_tokens_to_aivs(torch.full((3, 1), -1), 0, 2, None, mapping).aiv_of_copy.tolist() == [[-1]] * 3


def test_transposition_mixes_hop_classes():
    """Every AIV gets floor or ceil(V_h / n) copies of every hop class h."""
    E, n = 32, 6
    hop = torch.arange(E) // 8 % 4
    topk = torch.randint(0, E, (40, 4), generator=torch.Generator().manual_seed(2))
    ref = M.map_tokens_to_aivs(topk, E, n, hop, True)
    V_h = ref.hop_counts.sum(0)
    assert bool((ref.hop_counts <= -(-V_h // n)).all()) and bool((ref.hop_counts >= V_h // n).all())


# ----------------------------------------------------------------------------- block writers / pollers
def send_job_case(sync: str, T: int = 5, H: int = 300, R: int = 3, seed: int = 0, collide: bool = True):
    """A send job of T rows to R fake destinations: ``(build, mem_shape, fmt, (x, scales, meta, sels,
    flag))``, where ``build(mem, to)`` makes the job whose destinations are views of ``mem`` (``to`` moves
    the job's other tensors, e.g. to a device)."""
    g = torch.Generator().manual_seed(seed)
    fmt = P.RowFormat(sync, (("x", H * 2), ("scales", 12)), 2)
    x = torch.randn(T, H, generator=g).bfloat16()
    if collide:
        x[0] = 0                     # SP: every data block's first word equals the sentinel
    sc = torch.randn(T, 3, generator=g)
    meta = torch.randint(-5, 5, (T, 2), generator=g, dtype=torch.int32)
    src = torch.arange(T, dtype=torch.int64) + 100
    staging, checked, row_sums = TorchEngine().pack_rows(fmt, [P.as_bytes(x), P.as_bytes(sc)], meta, src, 0)
    sels = [torch.randperm(T, generator=g)[: int(torch.randint(0, T + 1, (), generator=g))] for _ in range(R)]
    flag = P.flag_word(3, P.REGION_DISPATCH)

    def build(mem: torch.Tensor, to=lambda t: t) -> SendJob:
        job = SendJob(fmt, to(staging), to(checked), to(row_sums), flag, sync_all=lambda: None)
        for d in range(R):
            rows = mem[d, : T * fmt.row_bytes].view(T, fmt.blocks, P.BLOCK_BYTES)
            ctrl = mem[d, T * fmt.row_bytes:].view(-1, P.BLOCK_BYTES)[:1]
            pay = torch.tensor([sels[d].numel(), fmt.signature(), 0, 0, 0, 0, 7 * d], dtype=torch.int64)
            job.dests.append(Destination(d, to(sels[d]), rows, ctrl, to(pay),
                                         meta_patch=to(torch.arange(sels[d].numel(), dtype=torch.int32) + 40)))
        return job

    mem_shape = (R, (T * fmt.blocks + 1) * P.BLOCK_BYTES)
    return build, mem_shape, fmt, (x, sc, meta, sels, flag)


@pytest.mark.parametrize("sync", SYNCS)
def test_send_phase_memory_is_byte_identical(sync):
    build, shape, fmt, _ = send_job_case(sync)
    mem_t = torch.zeros(shape, dtype=torch.uint8)
    mem_k = torch.zeros(shape, dtype=torch.uint8)
    TorchEngine().send_phase(build(mem_t))
    TE.TritonEngine(n_aivs=4).send_phase(build(mem_k))
    assert torch.equal(mem_t, mem_k)


@pytest.mark.parametrize("mapping", (True, False))
@pytest.mark.parametrize("n_count", (1, 3))
def test_send_phase_independent_of_aiv_split(mapping, n_count):
    build, shape, fmt, _ = send_job_case("dc", T=7, R=4, seed=3)
    mem_t = torch.zeros(shape, dtype=torch.uint8)
    mem_k = torch.zeros(shape, dtype=torch.uint8)
    TorchEngine().send_phase(build(mem_t))
    eng = TE.TritonEngine(n_aivs=6, n_count=n_count, mapping=mapping)
    eng.send_phase(build(mem_k))
    assert eng.last_launch["n_count"] == n_count and eng.last_launch["grid"] == 6
    assert torch.equal(mem_t, mem_k)


@pytest.mark.parametrize("sync", ("tff", "dc", "sp"))
def test_pollers_and_token_reorder(sync):
    build, shape, fmt, (x, sc, meta, sels, flag) = send_job_case(sync, seed=4)
    mem = torch.zeros(shape, dtype=torch.uint8)
    eng = TE.TritonEngine(n_aivs=4)
    job = build(mem)
    d = next(i for i in range(len(sels)) if sels[i].numel())
    n = sels[d].numel()
    rows = job.dests[d].rows[:n]
    expected = int(P.wrapping_sum(job.row_sums.index_select(0, sels[d]))) if sync == "dc" else 0
    assert eng.ctrl_arrived(job.dests[d].ctrl, flag) is False
    if sync != "dc" or expected != 0:
        assert eng.rows_arrived(fmt, rows, flag, expected) is False
    eng.send_phase(job)
    assert eng.ctrl_arrived(job.dests[d].ctrl, flag)
    assert eng.rows_arrived(fmt, rows, flag, expected)
    assert torch.equal(eng.read_ctrl(job.dests[d].ctrl)[:7], job.dests[d].ctrl_payload[:7]) or sync == "dc"
    ox = torch.empty(n, x.shape[1], dtype=torch.bfloat16)
    osc = torch.empty(n, 3)
    got_meta = eng.unpack_rows(fmt, rows, [P.as_bytes(ox), P.as_bytes(osc)])
    assert torch.equal(ox, x[sels[d]]) and torch.equal(osc, sc[sels[d]])
    assert torch.equal(got_meta[:, 0], torch.arange(n, dtype=torch.int32) + 40)
    assert torch.equal(got_meta[:, 1], meta[sels[d], 1])
    if sync == "sp":   # re-armed: every block holds the sentinel again
        w0 = rows.view(torch.int64).view(n, fmt.blocks, P.BLOCK_WORDS)[:, :, 0]
        assert bool((w0 == P.SP_SENTINEL).all())
        assert eng.rows_arrived(fmt, rows, flag) is False


# ----------------------------------------------------------------------------- combine
@pytest.mark.parametrize("sync", ("tff", "sp"))
def test_combine_accumulate_equals_index_add(sync):
    g = torch.Generator().manual_seed(5)
    T, H, K, n = 6, 272, 3, 4
    fmt = P.RowFormat(sync, (("x", H * 2),), K)
    x = torch.randn(n, H, generator=g).bfloat16()
    x[1] = 0
    w = torch.rand(n, K, generator=g)
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], w.view(torch.int32), torch.arange(n), 0)
    rows = torch.zeros(n, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, P.flag_word(1, P.REGION_COMBINE))
    idx = torch.tensor([4, 0, 5, 2])
    acc0 = torch.randn(T, H, generator=g)
    w0 = torch.randn(T, K, generator=g)
    ref, wref = acc0.clone(), w0.clone()
    ref.index_add_(0, idx, x.float())
    wref.index_add_(0, idx, w)
    got, wgot = acc0.clone(), w0.clone()
    TE.TritonEngine().combine_accumulate(fmt, rows, idx, got, torch.bfloat16, wgot)
    assert torch.equal(got, ref) and torch.equal(wgot, wref)


def test_weighted_combine_equals_torch_formula():
    g = torch.Generator().manual_seed(6)
    T, K, H = 5, 3, 256
    fmt = P.RowFormat("tff", (("x", H * 2),), 0)
    topk = torch.randint(-1, 8, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    tmp = torch.randn(T * K, H, generator=g).bfloat16()
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(tmp)], None, torch.arange(T * K), 0)
    rows = torch.zeros(T * K, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, 1)
    valid = topk >= 0
    tmp_ref = torch.where(valid.view(-1, 1), tmp, torch.zeros_like(tmp))
    ww = torch.where(valid, w, torch.zeros_like(w))
    ref = (tmp_ref.view(T, K, H).float() * ww.unsqueeze(-1)).sum(1).bfloat16()
    out = torch.empty(T, H, dtype=torch.bfloat16)
    TE.TritonEngine().weighted_combine(fmt, rows, topk, w, out)
    assert torch.equal(out, ref)



def test_kernel_launchers_refuse_what_their_kernels_cannot_take():
    """(former bugs: a hop class outside the topology's four gave a permutation with a repeated position and
    one never written; combine launchers wrote bf16 bits into a float32 ``out``, summed bf16 weights as
    something else, and crashed the process on a row index past the rows)"""
    from ubep_torch.kernels import combine as KC
    with pytest.raises(ValueError, match="hop classes must be in"):
        TE.remap_experts(3, torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="hop classes must be in"):
        TE.remap_experts(3, torch.tensor([0, -1, 1]))
    hops = torch.tensor([0, 3, 1])
    assert TE.remap_experts(3, hops).tolist() == M.remap_experts(3, 1, hops).tolist()
    T, K, H = 3, 2, 200
    fmt = P.RowFormat("tff", (("x", H * 2),), 0)
    x = torch.randn(T * K, H, generator=torch.Generator().manual_seed(0)).bfloat16()
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(T * K), 0)
    rows = torch.zeros(T * K, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, P.flag_word(1, P.REGION_LL_COMBINE))
    topk, w = torch.tensor([[0, 1], [2, -1], [3, 1]]), torch.rand(T, K)
    with pytest.raises(TypeError, match="out must be"):
        KC.weighted_combine(fmt, rows, topk, w, torch.zeros(T, H, dtype=torch.float32))
    for bad in (w.bfloat16(), w.double()):
        with pytest.raises(TypeError, match="weights must be"):
            KC.weighted_combine(fmt, rows, topk, bad, torch.zeros(T, H, dtype=torch.bfloat16))
    with pytest.raises(IndexError, match="pos must be"):
        KC.weighted_combine(fmt, rows, topk, w, torch.zeros(T, H, dtype=torch.bfloat16),
                            pos=torch.tensor([[0, 1], [2, 3], [10 ** 7, 5]]))
    with pytest.raises(IndexError, match="index must give"):
        KC.combine_accumulate(fmt, rows[:2], torch.tensor([0, 1_000_000]), torch.zeros(4, H), torch.bfloat16)
    with pytest.raises(ValueError, match="acc must be"):
        KC.combine_accumulate(fmt, rows[:2], torch.tensor([0, 1]), torch.zeros(4, H + 1), torch.bfloat16)
    # (rows of another geometry than the format's were read past their end; a wacc of another width than the
    # format's weights took meta words past them; misshapen pos/topk_idx/index gave torch's indexing errors)
    out = torch.zeros(T, H, dtype=torch.bfloat16)
    short = rows[:, :1].contiguous()
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        KC.weighted_combine(fmt, short, topk, w, out)
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        KC.combine_accumulate(fmt, short[:2], torch.tensor([0, 1]), torch.zeros(4, H), torch.bfloat16)
    with pytest.raises(ValueError, match="rows must be a contiguous"):
        KC.weighted_combine(fmt, rows.transpose(1, 2), topk, w, out)
    with pytest.raises(TypeError, match="rows must be a uint8"):
        KC.combine_accumulate(fmt, rows[:2].float(), torch.tensor([0, 1]), torch.zeros(4, H), torch.bfloat16)
    with pytest.raises(ValueError, match="wacc must be"):
        KC.combine_accumulate(fmt, rows[:2], torch.tensor([0, 1]), torch.zeros(4, H), torch.bfloat16,
                              torch.zeros(4, 5))
    fmt_w = P.RowFormat("tff", (("x", H * 2),), 1)
    rows_w = torch.zeros(2, fmt_w.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    for bad in (torch.zeros(4, 4), torch.zeros(4, 1, dtype=torch.float64), torch.zeros(3, 1)):
        with pytest.raises(ValueError, match="wacc must be"):
            KC.combine_accumulate(fmt_w, rows_w, torch.tensor([0, 1]), torch.zeros(4, H), torch.bfloat16, bad)
    with pytest.raises(ValueError, match="index must be"):
        KC.combine_accumulate(fmt, rows[:2], torch.tensor([[0], [1]]), torch.zeros(4, H), torch.bfloat16)
    for bad_pos in (torch.zeros(T, K + 1, dtype=torch.long), torch.arange(T * K)):
        with pytest.raises(IndexError, match="pos must be"):
            KC.weighted_combine(fmt, rows, topk, w, out, pos=bad_pos)
    with pytest.raises(ValueError, match="topk_idx must be"):
        KC.weighted_combine(fmt, rows, topk.reshape(-1), w, out)
    assert not out.any()     # (nothing written by a refused call)
    # the engine's receive-side launchers too (former bug: SP re-arming and Token-Reordering wrote past rows of
    # fewer blocks than the format's, past an index beyond the rows, and past a too-short output)
    fmt_sp = P.RowFormat("sp", (("x", 4096),), 0)
    big = torch.zeros(4 * fmt_sp.blocks * P.BLOCK_BYTES, dtype=torch.uint8)
    eng = TE.TritonEngine()
    with pytest.raises(ValueError, match="rows must be"):
        eng.rearm(fmt_sp, big[:2 * P.BLOCK_BYTES].view(2, 1, P.BLOCK_BYTES))
    two = big[:2 * fmt_sp.blocks * P.BLOCK_BYTES].view(2, fmt_sp.blocks, P.BLOCK_BYTES)
    with pytest.raises(IndexError, match="index must be"):
        eng.rearm(fmt_sp, two, torch.tensor([3]))
    with pytest.raises(IndexError, match="index must be"):
        eng.rows_arrived(fmt_sp, two, 1, index=torch.tensor([2]))
    with pytest.raises(ValueError, match="output 0 must be"):
        eng.unpack_rows(fmt_sp, two, [torch.zeros(1, 4096, dtype=torch.uint8)])
    assert not big[2 * fmt_sp.blocks * P.BLOCK_BYTES:].any()

# ----------------------------------------------------------------------------- decomposed LL receive
def ll_receive_case(sync: str, R: int = 3, El: int = 4, N: int = 4, H: int = 256, seed: int = 7,
                    nctrl: int = 0):
    """Arrived low-latency dispatch data of R sources (control blocks and rows, written by the torch path)
    and what the receive must produce: ``(fmt, flag, ctrls, rows, cnt, begin, recv_x)``."""
    g = torch.Generator().manual_seed(seed)
    fmt = P.RowFormat(sync, (("x", H * 2),), 1)
    flag = P.flag_word(2, P.REGION_LL_DISPATCH)
    cnt = torch.randint(0, N + 1, (R, El), generator=g)
    ctrls, rowsv, xs = [], [], []
    for s in range(R):
        n = int(cnt[s].sum())
        x = torch.randn(n, H, generator=g).bfloat16()
        xs.append(x)
        ctrl = torch.zeros(nctrl or P.ctrl_blocks(El), P.BLOCK_BYTES, dtype=torch.uint8)
        TorchEngine().write_ctrl(ctrl, torch.cat([torch.tensor([n, 0, 0, 0, 0, 0]), cnt[s]]), flag)
        st, ck, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], torch.zeros(n, 1, dtype=torch.int32),
                                            torch.arange(n), s)
        rows = torch.zeros(max(n, 1), fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
        TorchEngine().write_rows(fmt, st, ck, None, rows, flag)
        ctrls.append(ctrl)
        rowsv.append(rows)
    begin = torch.cumsum(cnt, 0) - cnt
    ref = torch.zeros(El, R * N, H, dtype=torch.bfloat16)
    for s in range(R):
        off = 0
        for e in range(El):
            c = int(cnt[s, e])
            ref[e, int(begin[s, e]):int(begin[s, e]) + c] = xs[s][off:off + c]
            off += c
    return fmt, flag, ctrls, rowsv, cnt, begin, ref


@pytest.mark.parametrize("sync,El", (("tff", 4), ("sp", 4), ("tff", 60)))
def test_cal_cumsum_reorder_point_to_point(sync, El):
    """CalCumSum AIVs publish offsets with a release store; reorder AIVs poll them and copy rows. With 60
    local experts the counts run into the control message's second block (former bug: they were read as one
    run of words, the 55th from that block's head, and the kernel spun on rows that never come)."""
    fmt, flag, ctrls, rowsv, cnt, begin, ref = ll_receive_case(sync, El=El, N=2, H=128)
    assert ctrls[0].shape[0] == (2 if El == 60 else 1)
    out = torch.zeros_like(ref)
    sig = TE.TritonEngine(max_spins=64).ll_receive(fmt, ctrls, rowsv, flag, El, out, n_count=2)
    assert torch.equal(sig[:, :El], begin) and torch.equal(sig[:, El:2 * El], cnt)
    assert bool((sig[:, 2 * El] == flag).all())
    assert torch.equal(out, ref)


def test_cal_cumsum_waits_for_every_control_block():
    """A control message of two blocks has arrived once both flags are this call's, not the first alone."""
    from ubep_torch.errors import UBEPKernelWaitError
    fmt, flag, ctrls, rowsv, cnt, begin, ref = ll_receive_case("tff", El=4, N=2, H=128, nctrl=2)
    eng = TE.TritonEngine(max_spins=3)
    assert torch.equal(eng.ll_receive(fmt, ctrls, rowsv, flag, 4, torch.zeros_like(ref), n_count=2)[:, 4:8], cnt)
    ctrls[1].view(torch.int64).view(-1)[64] = 0          # source 1's second block not there yet
    with pytest.raises(UBEPKernelWaitError):
        eng.ll_receive(fmt, ctrls, rowsv, flag, 4, torch.zeros_like(ref), n_count=2)


def test_ll_receive_times_out_instead_of_hanging():
    """(former gap: the error named rank -1 and "3s" for three polls, and advised raising timeout_s, which
    this wait does not use)"""
    from ubep_torch.errors import UBEPKernelWaitError, UBEPTimeoutError
    fmt = P.RowFormat("tff", (("x", 512),), 1)
    eng = TE.TritonEngine(max_spins=3)
    ctrl = torch.zeros(1, P.BLOCK_BYTES, dtype=torch.uint8)      # never written
    rows = torch.zeros(1, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(UBEPTimeoutError) as e:
        eng.ll_receive(fmt, [ctrl], [rows], 5, 2, torch.zeros(2, 4, 256, dtype=torch.bfloat16), rank=1)
    assert isinstance(e.value, UBEPKernelWaitError) and e.value.rank == 1 and e.value.missing_ranks == [0]
    assert "rank 1 " in str(e.value) and "after 3 polls" in str(e.value) and "timeout_s" not in str(e.value)


def _special_bf16(n: int, H: int, seed: int) -> torch.Tensor:
    """bf16 rows with subnormals, zeros of both signs, infinities and NaNs among normal values."""
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).bfloat16()
    bits = x.view(torch.int16)
    special = [0x0001, -0x7FFF, 0x007F, -0x7F81, 0x0000, -0x8000, 0x7F80, -0x0080, 0x7FC0, -0x0001]
    bits[:, :len(special)] = torch.tensor(special, dtype=torch.int16)
    return x


def test_combine_kernels_keep_special_values_bit_for_bit():
    """(former bugs: the interpreter flushed bf16 subnormals to zero when widening them, and a NaN sum was
    stored as 0x7FC0 where the other engines store 0xFFFF) Both combine kernels against the torch engine,
    bit for bit, on rows with subnormals, signed zeros, infinities and NaNs."""
    T, K, H = 4, 3, 256
    fmt = P.RowFormat("tff", (("x", H * 2),), 0)
    x = _special_bf16(T * K, H, seed=8)
    staging, checked, _ = TorchEngine().pack_rows(fmt, [P.as_bytes(x)], None, torch.arange(T * K), 0)
    rows = torch.zeros(T * K, fmt.blocks, P.BLOCK_BYTES, dtype=torch.uint8)
    TorchEngine().write_rows(fmt, staging, checked, None, rows, 1)
    # normal combine: each source's rows into float32 sums
    sel = torch.tensor([0, 1, 2, 3])
    for src in range(K):
        part = rows[src * T:(src + 1) * T]
        want, got = torch.zeros(T, H), torch.zeros(T, H)
        TorchEngine().combine_accumulate(fmt, part, sel, want, torch.bfloat16)
        TE.TritonEngine().combine_accumulate(fmt, part, sel, got, torch.bfloat16)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), src
    # low-latency weighted combine into bf16 (weights 1 keep subnormal sums subnormal)
    topk = torch.tensor([[0, 1, 2], [3, -1, 4], [5, 6, 7], [8, 9, 10]])
    for w in (torch.ones(T, K), torch.rand(T, K, generator=torch.Generator().manual_seed(9))):
        want, got = torch.empty(T, H, dtype=torch.bfloat16), torch.empty(T, H, dtype=torch.bfloat16)
        TorchEngine().weighted_combine(fmt, rows, topk, w, want)
        TE.TritonEngine().weighted_combine(fmt, rows, topk, w, got)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("name,value", [("UBEP_TRITON_AIVS", "abc"), ("UBEP_TRITON_AIVS", "2.5"),
                                        ("UBEP_TRITON_AIVS", "1"), ("UBEP_TRITON_AIVS", "0"),
                                        ("UBEP_TRITON_AIVS", "100000"), ("UBEP_TRITON_COUNT_AIVS", "abc"),
                                        ("UBEP_TRITON_COUNT_AIVS", "0"), ("UBEP_TRITON_COUNT_AIVS", "-3"),
                                        ("UBEP_TRITON_MAPPING", "maybe"), ("UBEP_TRITON_MAPPING", "2")])
def test_bad_engine_variables_are_named(monkeypatch, name, value):
    """(former bugs: int()'s bare message, 0 taken as the default, counts below 1 clamped, 100000 AIVs taken;
    any UBEP_TRITON_MAPPING but "0" left the mapping on)"""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        TE.TritonEngine()


@pytest.mark.parametrize("value,mapping", [("0", False), ("false", False), ("Off", False), ("no", False),
                                           ("1", True), ("TRUE", True), ("on", True), ("", True)])
def test_the_mapping_switch_takes_the_usual_spellings(monkeypatch, value, mapping):
    monkeypatch.setenv("UBEP_TRITON_MAPPING", value)
    assert TE.TritonEngine().mapping is mapping


def test_engine_refuses_an_empty_count_group():
    """(former bug: ``TritonEngine(n_count=0)`` or a negative count was taken, and ran as one AIV)"""
    for bad in (0, -3):
        with pytest.raises(ValueError, match="n_count must be at least 1"):
            TE.TritonEngine(n_count=bad)
    with pytest.raises(TypeError, match="n_aivs must be an integer"):
        TE.TritonEngine(n_aivs=4.5)
    assert TE.TritonEngine(n_aivs=4, n_count=9).count_aivs(1, 1) == 3     # (capped: the token group needs one)
