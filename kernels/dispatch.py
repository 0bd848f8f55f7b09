"""Dispatch-side kernels: one launch = one rank's AIVs (paper sections 3.2 and 3.3).

``send_phase_kernel``: program id = AIV id. Programs ``[0, n_token)`` are the **token group**
(Token-Sending): the copy sequence lists destinations grouped by hop class (``kernels.mapper``) and
AIV ``j`` sends copies ``j, j + n_token, ...`` of it (the logical matrix transposition; contiguous
slices with ``mapping=False``), starting at the destination a quaternary search finds.
Programs ``[n_token, n_token + n_count)`` are the **count group** (TokenCnt-Sending): each writes the
control messages (counts, layout signature, DC checksum) of destinations ``c, c + n_count, ...``.

Dependencies are point to point, never a grid-wide barrier: in DC the checksum of a destination
covers its rows, so a count AIV polls the token AIVs' done signals (acquire loads of words each token
AIV release-stores after its slice) before it publishes the control block. The signals come from
lower-numbered programs, which is what makes the wait legal under ``TRITON_INTERPRET=1``, where the
programs of a launch run one after another in program-id order. Every wait is bounded by a spin
count and reports failure through a status word instead of hanging.

``sync="sw"`` is the BSP baseline: ``send_phase_kernel`` is launched with every program in the token
group, the launcher runs the cross-rank SyncAll, then ``write_ctrl_kernel`` (``kernels.data_as_flag``)
with every program writing control messages: the kernel boundary is the barrier between phases.

Receive side: ``token_reorder_kernel`` copies the payload of arrived rows into the output tensors
(SP: restoring escaped words); ``cal_cumsum_reorder_kernel`` is the decomposed low-latency receive:
count AIVs poll the TokenCnt control blocks of their sources and publish CalCumSum offsets with a
release store, and the reorder AIVs poll those offsets (point-to-point signals) and copy their rows.
"""
from __future__ import annotations

import triton
import triton.language as tl

from . import data_as_flag as daf
from .mapper import first_copy, quaternary_search_one

BLOCK_WORDS: tl.constexpr = daf.BLOCK_WORDS


@triton.jit
def send_phase_kernel(
    staging_ptr, checked_ptr, row_sums_ptr,
    cum_ptr, sel_ptr, slot_ptr, patch_ptr, dst_addr_ptr,
    ctrl_addr_ptr, ctrl_pay_ptr, done_ptr, status_ptr,
    n_items, n_dest, nblocks, flag, n_token, n_count, ctrl_blocks, max_spins,
    SYNC: tl.constexpr, MAPPING: tl.constexpr, HAS_PATCH: tl.constexpr, ROW_BLOCK: tl.constexpr, NB_BLOCK: tl.constexpr,
    CTRL_BLOCK: tl.constexpr, CNB_BLOCK: tl.constexpr, TOK_BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    CHECKSUM_WORD: tl.constexpr,
):
    """Token group + count group of one call (see the module docstring).

    Tables (destination position ``p`` in remapped order): ``cum[p]`` inclusive copy counts,
    ``dst_addr[p]`` address of the destination's slot 0, ``ctrl_addr[p]`` of its control slot,
    ``ctrl_pay[p]`` its block-structured control words. Per copy ``k``: ``sel[k]`` staging row,
    ``slot[k]`` destination slot, ``patch[k]`` int32 for meta item 0. ``done[j]`` is token AIV ``j``'s
    signal, ``status[pid]`` is set to 1 by a program whose wait ran out of spins.
    """
    pid = tl.program_id(0)
    row_words = nblocks * BLOCK_WORDS
    row_bytes = row_words * 8
    if pid < n_token:
        # ---------------------------------------------------------------- Token-Sending
        start, load, stride = first_copy(pid, n_items, n_token, MAPPING)
        if load > 0:
            p = quaternary_search_one(cum_ptr, n_dest, start)
            for k in range(start, start + load * stride, stride):
                while tl.load(cum_ptr + p) <= k:
                    p += 1
                src = tl.load(sel_ptr + k)
                slot = tl.load(slot_ptr + k)
                dst = tl.load(dst_addr_ptr + p) + slot * row_bytes
                # step 1: the whole row, checked words withheld (the staging holds 0 / the sentinel there)
                daf.store_block_row(daf.as_i64_ptr(dst), staging_ptr + src * row_words, row_words, ROW_BLOCK)
                if HAS_PATCH:
                    tl.store(daf.as_i32_ptr(dst + 32), tl.load(patch_ptr + k))
                # step 2: the checked words, release-ordered after step 1
                if SYNC == 0:
                    daf.publish_checked_words(daf.as_i64_ptr(dst), tl.full([NB_BLOCK], 0, tl.int64) + flag,
                                              nblocks, NB_BLOCK)
                elif SYNC == 2:
                    b = tl.arange(0, NB_BLOCK)
                    vals = tl.load(checked_ptr + src * nblocks + b, mask=b < nblocks, other=0)
                    daf.publish_checked_words(daf.as_i64_ptr(dst), vals, nblocks, NB_BLOCK)
        tl.atomic_xchg(done_ptr + pid, 1, sem="release")
    elif pid < n_token + n_count:
        # ---------------------------------------------------------------- TokenCnt-Sending
        c = pid - n_token
        ready = tl.full([], 1, tl.int32)
        if SYNC == 1:
            # DC: the checksum covers the rows, so wait for every token AIV's done signal
            j = tl.arange(0, TOK_BLOCK)
            spins = 0
            seen = tl.full([], 0, tl.int32)
            while (seen < n_token) & (spins < max_spins):
                sig = daf.load_acquire(done_ptr + j, j < n_token)
                seen = daf.vsum(tl.where(j < n_token, sig, 0).to(tl.int32), 0)
                spins += 1
            ready = (seen >= n_token).to(tl.int32)
            if ready == 0:
                tl.store(status_ptr + pid, 1)
        if ready != 0:
            n_words = ctrl_blocks * BLOCK_WORDS
            w = tl.arange(0, CTRL_BLOCK)
            for p in range(c, n_dest, n_count):
                dst = daf.as_i64_ptr(tl.load(ctrl_addr_ptr + p))
                pay = tl.load(ctrl_pay_ptr + p * n_words + w, mask=w < n_words, other=0)
                if SYNC == 1:
                    hi = tl.load(cum_ptr + p)
                    lo = tl.load(cum_ptr + p - 1, mask=p > 0, other=0)
                    if hi > lo:
                        total = tl.full([], 0, tl.int64)
                        for k0 in range(lo, hi, CHUNK):
                            kk = k0 + tl.arange(0, CHUNK)
                            km = kk < hi
                            rows = tl.load(sel_ptr + kk, mask=km, other=0)
                            total += daf.vsum(tl.load(row_sums_ptr + rows, mask=km, other=0), axis=0)
                        pay = tl.where(w == CHECKSUM_WORD, total, pay)
                tl.store(dst + w, pay, mask=w < n_words)
                daf.publish_checked_words(dst, tl.full([CNB_BLOCK], 0, tl.int64) + flag, ctrl_blocks, CNB_BLOCK)


@triton.jit
def token_reorder_kernel(rows_addr_ptr, out_ptr, out_stride, nblocks, field_block0, esc_base, meta_words, nbytes,
                         SYNC: tl.constexpr, BYTE_BLOCK: tl.constexpr):
    """Token-Reordering of one field: program ``r`` copies row ``r``'s payload bytes to ``out[r]``."""
    r = tl.program_id(0)
    row = tl.load(rows_addr_ptr) + r.to(tl.int64) * nblocks * daf.BLOCK_BYTES
    for b0 in range(0, nbytes, BYTE_BLOCK):
        b = b0 + tl.arange(0, BYTE_BLOCK)
        m = b < nbytes
        v = daf.load_payload(row, b.to(tl.int64), m, field_block0, esc_base, meta_words, SYNC, tl.uint8, 1)
        tl.store(out_ptr + r.to(tl.int64) * out_stride + b, v, mask=m)


@triton.jit
def cal_cumsum_reorder_kernel(
    ctrl_addr_ptr, rows_addr_ptr, offsets_ptr, out_ptr, status_ptr,
    n_src, n_exp, nblocks, flag, out_stride_e, out_stride_r, max_spins, n_count, nbytes, field_block0,
    esc_base, meta_words, ctrl_first_count, n_ctrl,
    SYNC: tl.constexpr, E_BLOCK: tl.constexpr, BYTE_BLOCK: tl.constexpr, NB_BLOCK: tl.constexpr,
    CTRL_WORDS: tl.constexpr,
):
    """Decomposed low-latency receive: CalCumSum by the count AIVs, Token-Reordering by the others.

    Programs ``[0, n_count)``: poll the TokenCnt control block of sources ``c, c + n_count, ...``
    (acquire), compute the packed offsets ``begin[s, e] = sum_{s' < s} cnt[s', e]`` for their
    sources, write ``offsets[s, 0:E] = begin`` and ``offsets[s, E:2E] = cnt``, then release-store
    ``offsets[s, 2E] = flag``: the address signal. Program ``n_count + s`` polls that signal of
    source ``s`` (a lower-numbered program) and the arrival of ``s``'s rows, then copies row ``i``
    of expert ``e`` to ``out[e, begin + i]``. The prefix over sources needs every source's counts,
    so each count AIV reads all of them; it only *publishes* its own sources.

    A control message is ``n_ctrl`` DataBlocks, each with its own flag and ``CTRL_WORDS`` payload words
    after its head: it has arrived once every block's flag is this call's, and payload word ``p`` (count
    ``e`` is word ``ctrl_first_count + e``) lies in block ``p // CTRL_WORDS``.
    """
    pid = tl.program_id(0)
    e = tl.arange(0, E_BLOCK)
    em = e < n_exp
    sig_words = 2 * n_exp + 1
    if pid < n_count:
        # ------------------------------------------------------------ TokenCnt wait + CalCumSum
        spins = 0
        arrived = tl.full([], 0, tl.int32)
        while (arrived < n_src) & (spins < max_spins):
            arrived = tl.full([], 0, tl.int32)
            for s in range(n_src):
                cw = daf.as_i64_ptr(tl.load(ctrl_addr_ptr + s))
                blocks_in = tl.full([], 0, tl.int32)
                for b in range(n_ctrl):
                    w0 = daf.load_acquire(cw + b * daf.BLOCK_WORDS, None)
                    blocks_in += (w0 == flag).to(tl.int32)
                arrived += (blocks_in == n_ctrl).to(tl.int32)
            spins += 1
        if arrived < n_src:
            tl.store(status_ptr + pid, 1)
        else:
            begin = tl.full([E_BLOCK], 0, tl.int64)
            for s in range(n_src):
                cw = daf.as_i64_ptr(tl.load(ctrl_addr_ptr + s))
                pw = ctrl_first_count + e          # (payload words of the message, block by block)
                cnt = tl.load(cw + (pw // CTRL_WORDS) * daf.BLOCK_WORDS + daf.HEAD_WORDS + pw % CTRL_WORDS,
                              mask=em, other=0)
                if s % n_count == pid:
                    tl.store(offsets_ptr + s * sig_words + e, begin, mask=em)
                    tl.store(offsets_ptr + s * sig_words + n_exp + e, cnt, mask=em)
                    tl.atomic_xchg(offsets_ptr + s * sig_words + 2 * n_exp, flag, sem="release")
                begin += cnt
    elif pid < n_count + n_src:
        # ------------------------------------------------------------ Token-Reordering of source s
        s = pid - n_count
        spins = 0
        sig = daf.load_acquire(offsets_ptr + s * sig_words + 2 * n_exp, None)
        while (sig != flag) & (spins < max_spins):
            sig = daf.load_acquire(offsets_ptr + s * sig_words + 2 * n_exp, None)
            spins += 1
        if sig != flag:
            tl.store(status_ptr + pid, 1)
        else:
            begin = tl.load(offsets_ptr + s * sig_words + e, mask=em, other=0)
            cnt = tl.load(offsets_ptr + s * sig_words + n_exp + e, mask=em, other=0)
            n_rows = daf.vsum(cnt, axis=0)
            base = tl.load(rows_addr_ptr + s)
            row_words = nblocks * BLOCK_WORDS
            ok = tl.full([], 0, tl.int32)
            spins = 0
            while (ok == 0) & (spins < max_spins):
                ok = tl.full([], 1, tl.int32)
                for r in range(n_rows):
                    row = daf.as_i64_ptr(base + r * row_words * 8)
                    if SYNC == 0:
                        ok = ok & daf.poll_tff_row(row, nblocks, flag, NB_BLOCK)
                    elif SYNC == 2:
                        ok = ok & daf.poll_sp_row(row, nblocks, NB_BLOCK)
                spins += 1
            if ok == 0:
                tl.store(status_ptr + pid, 1)
            else:
                src_off = daf.vcumsum(cnt, axis=0) - cnt
                for r in range(n_rows):
                    ex = daf.vsum(tl.where(em & (src_off <= r), 1, 0), axis=0) - 1
                    eb = daf.vsum(tl.where(e == ex, begin, 0), axis=0)
                    eo = daf.vsum(tl.where(e == ex, src_off, 0), axis=0)
                    row = base + r * row_words * 8
                    dst = out_ptr + ex * out_stride_e + (eb + r - eo) * out_stride_r
                    for b0 in range(0, nbytes, BYTE_BLOCK):
                        b = b0 + tl.arange(0, BYTE_BLOCK)
                        m = b < nbytes
                        v = daf.load_payload(row, b.to(tl.int64), m, field_block0, esc_base, meta_words, SYNC,
                                             tl.uint8, 1)
                        tl.store(dst + b, v, mask=m)
