"""Data-as-Flag in kernels: the 512 B block writers and pollers of TFF, DC and SP (paper section 3.4).

The wire format is ``ubep_torch.protocol`` (block size, flag header, sentinel, escape); the constants
below are imported from there, never redefined. Every function here works on int64 *words*: a block is
``BLOCK_WORDS`` (64) words and its first word ``w0`` is the word a receiver checks.

Peer memory is addressed by raw addresses (int64 values turned into pointers with ``int_to_ptr``), the
way an AIV addresses the UGAS: a kernel receives a small table of addresses instead of one tensor
argument per peer segment.

Memory ordering: the emulated 512 B atomic write
-------------------------------------------------
The UB fabric makes a 512 B block visible whole; host memory does not. A writer therefore stores a
block in two ordered steps (``protocol`` module docstring):

1. ``store_block_row``: every word of every block with the checked word withheld (TFF: ``w0 = 0``,
   which is never a flag of a live call because epochs start at 1 in the flag; SP: the sentinel).
2. ``publish_checked_words``: the checked words, each with ``tl.atomic_xchg(..., sem="release")``.

A release store orders every earlier store of the same program before it. A poller reads the checked
word with an acquire load (``load_acquire``, in ``poll_tff_row``/``poll_sp_row``); an acquire load
that observes the released value orders every later load after it, so once a poller sees the flag of
a block (or a non-sentinel word) every byte of that block's step 1 is visible to it. Under the CPU
interpreter the atomics are the C++ ``std::atomic`` operations with the same memory orders, so the
argument holds on weakly ordered CPUs too, not only on x86-64 TSO.

DC needs no ordering: the receiver sums the leading 32 B of every block and compares with the
checksum carried by the control block, which is itself published with a release store after the rows
(the count group waits for the token group's done signals first, see ``kernels.dispatch``).

SP never hangs and never corrupts on a sentinel collision: the sender's staging already replaced a
first word equal to the sentinel by ``SP_ESCAPE`` and set the block's bit in the row's escape bitmap;
``publish_checked_words`` publishes that escaped word, and the reader restores the zero bytes in the
output (``kernels.dispatch.token_reorder_kernel``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ubep_torch import protocol as P

#: sync-mode codes the kernels specialize on (``tl.constexpr``)
SYNC_TFF = 0
SYNC_DC = 1
SYNC_SP = 2
SYNC_SW = 3
SYNC_CODE = {"tff": SYNC_TFF, "dc": SYNC_DC, "sp": SYNC_SP, "sw": SYNC_SW}

BLOCK_WORDS: tl.constexpr = tl.constexpr(P.BLOCK_WORDS)
BLOCK_BYTES: tl.constexpr = tl.constexpr(P.BLOCK_BYTES)
HEAD_WORDS: tl.constexpr = tl.constexpr(P.HEAD_WORDS)
SP_SENTINEL: tl.constexpr = tl.constexpr(P.SP_SENTINEL)


# ----------------------------------------------------------------------------- reductions
# Triton's own ``tl.sum``/``tl.max``/``tl.cumsum``/``tl.zeros`` are ``@triton.jit`` library functions,
# defined as the process configured triton; kernels defined under the scoped interpreter (see
# ``ubep_torch.triton_engine``) may only call builtins and functions defined with them, hence these.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def vsum(x, axis):
    """Sum over ``axis`` (wrapping for integers)."""
    return tl.reduce(x, axis, _add)


@triton.jit
def vmax(x, axis):
    """Maximum over ``axis``."""
    return tl.reduce(x, axis, _maximum)


@triton.jit
def vcumsum(x, axis):
    """Inclusive prefix sum over ``axis``."""
    return tl.associative_scan(x, axis, _add)


# ----------------------------------------------------------------------------- acquire loads
if hasattr(tl, "atomic_load"):
    @triton.jit
    def load_acquire(ptr, mask):
        """``*ptr`` (where ``mask``; None: every lane) with acquire semantics."""
        return tl.atomic_load(ptr, mask=mask, sem="acquire")
else:
    # Triton releases before tl.atomic_load: the same acquire as a read-modify-write that adds 0. Its write
    # back cannot lose a value: every word read this way is written atomically (flags, done signals,
    # offsets) or, in step 1, with the withheld value that step 2 then replaces atomically.
    @triton.jit
    def load_acquire(ptr, mask):
        """``*ptr`` (where ``mask``; None: every lane) with acquire semantics."""
        return tl.atomic_add(ptr, 0, mask=mask, sem="acquire")


# ----------------------------------------------------------------------------- addressing
@triton.jit
def as_i64_ptr(addr):
    """An int64 address -> ``pointer<int64>``."""
    return addr.to(tl.pointer_type(tl.int64), bitcast=True)


@triton.jit
def as_i32_ptr(addr):
    """An int64 address -> ``pointer<int32>``."""
    return addr.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def as_u8_ptr(addr):
    """An int64 address -> ``pointer<uint8>``."""
    return addr.to(tl.pointer_type(tl.uint8), bitcast=True)


# ----------------------------------------------------------------------------- writers
@triton.jit
def store_block_row(dst, src, n_words, ROW_BLOCK: tl.constexpr):
    """Step 1: copy ``n_words`` int64 words of a staged row (checked words withheld) to ``dst``."""
    offs = tl.arange(0, ROW_BLOCK)
    m = offs < n_words
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


@triton.jit
def publish_checked_words(dst, values, nblocks, NB_BLOCK: tl.constexpr):
    """Step 2: release-store the checked word ``w0`` of each of the ``nblocks`` blocks at ``dst``.

    ``values`` is a ``[NB_BLOCK]`` int64 tensor (a TFF flag broadcast, or the SP true first words).
    """
    b = tl.arange(0, NB_BLOCK)
    tl.atomic_xchg(dst + b * BLOCK_WORDS, values, mask=b < nblocks, sem="release")


@triton.jit
def write_tff_ctrl(dst, payload, n_words, flag, nblocks, ROW_BLOCK: tl.constexpr, NB_BLOCK: tl.constexpr):
    """A control message: ``payload`` (block-structured words, heads zero) then the flag of every block."""
    store_block_row(dst, payload, n_words, ROW_BLOCK)
    publish_checked_words(dst, tl.full([NB_BLOCK], 0, tl.int64) + flag, nblocks, NB_BLOCK)


# ----------------------------------------------------------------------------- pollers
@triton.jit
def poll_tff_row(row, nblocks, flag, NB_BLOCK: tl.constexpr):
    """1 if every block of the row at ``row`` carries ``flag`` in ``w0`` (acquire loads), else 0."""
    b = tl.arange(0, NB_BLOCK)
    m = b < nblocks
    w0 = load_acquire(row + b * BLOCK_WORDS, m)
    bad = vsum(tl.where(m & (w0 != flag), 1, 0), 0)
    return (bad == 0).to(tl.int32)


@triton.jit
def poll_sp_row(row, nblocks, NB_BLOCK: tl.constexpr):
    """1 if no block of the row at ``row`` still holds the sentinel in ``w0`` (acquire loads), else 0."""
    b = tl.arange(0, NB_BLOCK)
    m = b < nblocks
    w0 = load_acquire(row + b * BLOCK_WORDS, m)
    bad = vsum(tl.where(m & (w0 == SP_SENTINEL), 1, 0), 0)
    return (bad == 0).to(tl.int32)


@triton.jit
def dc_block_sum(row, nblocks, NB_BLOCK: tl.constexpr):
    """Wrapping int64 sum of the leading four words of each of ``nblocks`` blocks at ``row``."""
    b = tl.arange(0, NB_BLOCK)[:, None]
    w = tl.arange(0, HEAD_WORDS)[None, :]
    words = tl.load(row + b * BLOCK_WORDS + w, mask=(b < nblocks) & (w < HEAD_WORDS), other=0)
    return vsum(vsum(words, axis=1), axis=0)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def poll_rows_kernel(rows_addr, index_ptr, status_ptr, n_rows, nblocks, flag, expected, max_spins,
                     SYNC: tl.constexpr, HAS_INDEX: tl.constexpr, NB_BLOCK: tl.constexpr):
    """Did every block of ``n_rows`` rows arrive? One program; polls at most ``max_spins`` times.

    ``rows_addr`` is the address of row 0 (rows of ``nblocks`` blocks); ``index_ptr`` optionally lists
    the rows to check. Writes ``status[0] = 1`` when all arrived, else 0; ``status[1]`` is the DC sum.
    A wait that is not satisfied after ``max_spins`` polls returns (the launcher owns the deadline).
    """
    base = as_i64_ptr(tl.load(rows_addr))
    row_words = nblocks * BLOCK_WORDS
    ok = tl.full([], 0, tl.int32)
    total = tl.full([], 0, tl.int64)
    spins = 0
    while (ok == 0) & (spins < max_spins):
        ok = tl.full([], 1, tl.int32)
        total = tl.full([], 0, tl.int64)
        for r in range(n_rows):
            if HAS_INDEX:
                rr = tl.load(index_ptr + r)
            else:
                rr = tl.full([], 0, tl.int64) + r   # the loop index is a plain int under the interpreter
            row = base + rr * row_words
            if SYNC == 0:
                ok = ok & poll_tff_row(row, nblocks, flag, NB_BLOCK)
            elif SYNC == 2:
                ok = ok & poll_sp_row(row, nblocks, NB_BLOCK)
            elif SYNC == 1:
                total += dc_block_sum(row, nblocks, NB_BLOCK)
        if SYNC == 1:
            ok = (total == expected).to(tl.int32)
        spins += 1
    tl.store(status_ptr, ok.to(tl.int64))
    tl.store(status_ptr + 1, total)


@triton.jit
def write_ctrl_kernel(ctrl_addr_ptr, payload_ptr, n_dest, flag, nblocks, ROW_BLOCK: tl.constexpr,
                      NB_BLOCK: tl.constexpr):
    """Every program writes the control messages of destinations ``pid, pid + grid, ...``.

    ``ctrl_addr_ptr[d]`` is the address of destination ``d``'s control slot; ``payload_ptr`` holds
    ``[n_dest, nblocks * 64]`` block-structured words with zero heads.
    """
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_words = nblocks * BLOCK_WORDS
    for d in range(pid, n_dest, step):
        dst = as_i64_ptr(tl.load(ctrl_addr_ptr + d))
        write_tff_ctrl(dst, payload_ptr + d * n_words, n_words, flag, nblocks, ROW_BLOCK, NB_BLOCK)


@triton.jit
def rearm_kernel(rows_addr, index_ptr, n_rows, nblocks, HAS_INDEX: tl.constexpr, NB_BLOCK: tl.constexpr):
    """SP: store the sentinel back into ``w0`` of every block of the consumed rows (program per row)."""
    r = tl.program_id(0)
    if r < n_rows:
        base = as_i64_ptr(tl.load(rows_addr))
        if HAS_INDEX:
            rr = tl.load(index_ptr + r)
        else:
            rr = r.to(tl.int64)
        b = tl.arange(0, NB_BLOCK)
        tl.store(base + rr * nblocks * BLOCK_WORDS + b * BLOCK_WORDS, tl.full([NB_BLOCK], 0, tl.int64) + SP_SENTINEL,
                 mask=b < nblocks)


# ----------------------------------------------------------------------------- readers
@triton.jit
def load_payload(row_addr, byte_offs, mask, field_block0, esc_base, meta_words, SYNC: tl.constexpr,
                 DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Elements of one field of the row at address ``row_addr`` (int64), by byte offset in the field.

    ``field_block0`` is the field's first block in the row, ``esc_base`` its first data block among
    the row's data blocks (the SP escape bitmap index). Payload blocks carry 480 B after the 32 B head
    (TFF) or 512 raw bytes; 480 and 512 are multiples of every element size, so no element straddles
    two blocks. SP: elements inside the first word of an escaped block read as zero bytes, which is
    what the sender's escaped word stood for.
    """
    if SYNC == 0:
        pay = 480
        start = 32
    else:
        pay = 512
        start = 0
    blk = byte_offs // pay
    within = byte_offs % pay
    addr = row_addr + (field_block0 + blk) * BLOCK_BYTES + start + within
    v = tl.load(addr.to(tl.pointer_type(DTYPE), bitcast=True), mask=mask, other=0)
    if SYNC == 2:
        dblk = esc_base + blk
        waddr = row_addr + 32 + (meta_words + dblk // 32) * 4
        word = tl.load(as_i32_ptr(waddr), mask=mask, other=0)
        bit = (word >> (dblk % 32).to(tl.int32)) & 1
        v = tl.where((bit != 0) & (within < 8), tl.full(v.shape, 0, v.dtype), v)
    return v
