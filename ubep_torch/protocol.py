"""The UBEP wire protocol: one definition of blocks, flags, epochs and slot layout.

Everything that crosses the simulated unified global address space (UGAS) is a sequence of
512-byte ``DataBlock``s. The torch path (``ubep_torch.buffer``), the Triton kernels (``kernels/``),
the cost model and the docs all import the constants below; nothing else defines them.

DataBlock (512 B, the CM384 UB atomic write unit)
-------------------------------------------------
* ``sync="tff"`` (Token-Flag Fusion): bytes ``[0, 32)`` are the flag header, ``[32, 512)`` payload.
  Header words (int64): ``w0 = flag_word(epoch, region)``, ``w1 = source token index``,
  ``w2 = block index inside the row``, ``w3 = source rank``. The receiver checks ``w0`` alone.
* ``sync="dc"`` (Data Checksum) and ``sync="sw"`` (stop-and-wait): payload blocks are raw 512 B.
  DC follows each (source, destination) batch with a control block holding the wrapping int64 sum
  of the leading 32 B (four words) of every block of the batch.
* ``sync="sp"`` (Sentinel Polling): payload blocks are raw 512 B. The receiver's memory holds the
  sentinel ``SP_SENTINEL`` (= 0, so freshly mapped shared memory is already armed) in the first word of
  every block; arrival is ``w0 != SP_SENTINEL``. A block whose own first word equals the sentinel is
  *escaped* by the sender: it stores ``SP_ESCAPE`` instead and sets the block's bit in the row's escape
  bitmap, which travels in the row's meta block (whose first word is ``ROW_MAGIC`` and so can never be
  the sentinel). The receiver restores escaped words after copying the row out, then re-arms the
  consumed blocks by writing the sentinel back. A collision therefore never hangs and never corrupts.

Rows
----
A row (one token, or one returned expert output) is one *meta block* followed by one or more *field*
streams, each padded to whole blocks: e.g. dispatch = meta | x | fp8 scales. The meta block always has
a 32 B head (``w0`` = flag for TFF, ``ROW_MAGIC`` otherwise) and 480 B of int32/float32 meta payload
(top-k ids and weights, escape bitmap). Field blocks carry 480 B (TFF) or 512 B (others) of payload.

Low-latency dispatch rows come in two layouts, told apart by the row format (and so by the control
message's layout signature, which every receiver checks):

* one row per (token, destination rank), sent by engines that store rows straight from ``x`` (torch, C):
  meta item 0 is the number m <= K of the token's (local expert, top-k slot) pairs on that rank, items
  ``1 + 2j`` and ``2 + 2j`` are pair j's ``(local expert << 8) | slot`` and its position in the
  (source, expert) segment of the receiver's ``recv_x``; the receiver copies the payload to each of the
  m places. A token bound for several experts of one rank crosses the fabric once.
* one row per (token, expert) pair, in (expert, token) order, its top-k slot in meta item 0 (the
  Triton kernels' layout).

The control message's row count is the number of rows; its per-expert counts are pairs either way.

Control blocks
--------------
Counts (TokenCnt), DC checksums and the per-call "I have sent everything" signal travel in control
blocks, which always use a TFF head whatever the data sync mode: ``w0`` = flag word, payload = int64
words. Every rank sends one control message to every peer on every call, even when it sends no rows.
``w1..w3`` of a message's first block may say, for the C path's store policy, how its rows were stored
(1 plain, 2 streaming stores) and what reading rows stored each way has cost the sender (ns per MiB; see
``native_engine.store_policy``); 0 says nothing, and nothing else reads them.

Epochs and buffer reuse
-----------------------
Each region (normal, shared by dispatch and combine; low-latency dispatch; low-latency combine) has a
call counter ``epoch`` that advances identically on every rank (calls are collective and ordered). A
region holds ``halves`` copies of its control blocks and slots and call ``epoch`` uses copy
``epoch % halves``: two by default for the low-latency regions (a call may be sent while a receive hook of the
previous one is still pending), one for the normal region (its calls complete before they return).
Flags carry the epoch and the call's kind (``flag_word``), so stale blocks of earlier calls never match
and buffers need no reset between calls.

Reuse argument: after consuming a source's rows of call ``n`` (and re-arming them in ``sp`` mode) a
receiver R stores ``n`` into that source's ack word for the half in the source's memory. A sender S
writes call ``n + halves`` into a half of R only after R's ack word for that half reached ``n``. So no
half is overwritten while it is being read, without any barrier, and the wait has a deadline like every
other.

Memory ordering (why the emulated 512 B atomic write is safe on this machine)
-----------------------------------------------------------------------------
The fabric guarantees a 512 B block is observed whole. Host memory does not, so every write is split in
two ordered steps: (1) the whole block content with the checked word set to a value the receiver treats
as "not yet" (flag 0 for TFF, the sentinel for SP), (2) the checked word itself. On x86-64 (TSO) stores
become visible to other cores in program order, and loads are not reordered with older loads: a
receiver that observes the checked word of step (2) therefore also observes every byte of step (1).
Step (1) may be executed by several intra-op threads; the op returns only after its workers have joined
(a synchronizing operation), so all of its stores precede step (2) in the issuing thread's order.
On weakly ordered CPUs (aarch64) ``memory_fence()`` adds a full barrier between the steps and after a
successful poll; it is a no-op on x86-64. Streaming (non-temporal) stores are the exception to TSO's order
on x86-64: where the C path writes step (1) with them (see ``native_engine.store_policy``), it issues an
``sfence`` before the flag stores of step (2), which orders them like plain stores.
"""
from __future__ import annotations

import functools
import math
import os
import platform
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional, Sequence, Tuple

import torch

from .errors import UBEPPeerAbortedError, UBEPPeerLostError, UBEPTimeoutError

# ----------------------------------------------------------------------------- block geometry
BLOCK_BYTES = 512            #: DataBlock size: the UB fabric's atomic write unit
FLAG_BYTES = 32              #: TFF flag header at the start of each block
TFF_PAYLOAD_BYTES = BLOCK_BYTES - FLAG_BYTES   #: 480 B of payload per TFF block
RAW_PAYLOAD_BYTES = BLOCK_BYTES                 #: DC / SP / SW blocks carry raw payload
BLOCK_WORDS = BLOCK_BYTES // 8
HEAD_WORDS = FLAG_BYTES // 8
META_PAYLOAD_BYTES = TFF_PAYLOAD_BYTES          #: meta blocks always keep a 32 B head

SYNC_MODES = ("tff", "dc", "sp", "sw")

#: First word of every meta block outside TFF (never equal to the sentinel).
ROW_MAGIC = 0x5542_4550_524F_5721          # "UBEPROW!"
#: SP: the value the receiver's memory holds in the first word of every unfilled block.
SP_SENTINEL = 0
#: SP: what the sender stores instead of a first word that happens to equal the sentinel.
SP_ESCAPE = 0x5542_4550_4553_4321          # "UBEPESC!"

# ----------------------------------------------------------------------------- regions
REGION_DISPATCH = 1
REGION_COMBINE = 2
REGION_LL_DISPATCH = 3
REGION_LL_COMBINE = 4
REGION_BARRIER = 5
REGION_NAMES = {
    REGION_DISPATCH: "dispatch",
    REGION_COMBINE: "combine",
    REGION_LL_DISPATCH: "low_latency_dispatch",
    REGION_LL_COMBINE: "low_latency_combine",
    REGION_BARRIER: "clean_low_latency_buffer",   # (no region of its own: the kind of its SyncAll)
}

#: int64 payload words per control block (each control block keeps a TFF head).
CTRL_WORDS_PER_BLOCK = TFF_PAYLOAD_BYTES // 8
# control message words: [0] rows sent, [1] layout signature, [2] DC checksum, [3] first return slot
# (low-latency dispatch), the dispatch a combine answers, or a normal dispatch's num_worst_tokens, [4]
# num_experts and [5] num_max_dispatch_tokens_per_rank of the call (0 where the call has none; every rank
# must have passed the same), [6..] per-expert counts
CTRL_NROWS = 0
CTRL_SIGNATURE = 1
CTRL_CHECKSUM = 2
#: Low-latency dispatch: where the receiver's rows for this sender start in the sender's low-latency
#: combine slots, i.e. how many of the sender's (token, expert) pairs go to lower ranks. Low-latency
#: combine returns each host's rows there as one contiguous run, in the order they were dispatched.
CTRL_RETURN_SLOT = 3
#: Combine (both modes), in the same word: the call number of the dispatch whose rows it returns (0: not
#: known, for a handle rebuilt from a plain tuple). Every rank must combine the same dispatch's rows.
CTRL_PAIRED_CALL = 3
#: Normal dispatch, in the same word: the sender's ``num_worst_tokens`` (0: none). With the row counts every
#: message carries, each rank learns which ranks received more rows than their own ``num_worst_tokens``.
CTRL_WORST_TOKENS = 3
CTRL_NUM_EXPERTS = 4
CTRL_MAX_TOKENS = 5
CTRL_COUNTS = 6


#: Control blocks reserved for every control message (room for 474 words after the fixed six).
MAX_CTRL_BLOCKS = 8
#: Counts one control message carries at most, after its fixed words.
MAX_CTRL_COUNTS = MAX_CTRL_BLOCKS * CTRL_WORDS_PER_BLOCK - CTRL_COUNTS


def ctrl_blocks(num_counts: int) -> int:
    """Control blocks needed for a message that carries ``num_counts`` per-expert counts."""
    return max(1, -(-(CTRL_COUNTS + int(num_counts)) // CTRL_WORDS_PER_BLOCK))


def flag_word(epoch: int, region: int) -> int:
    """The value of ``w0`` that marks a block of call ``epoch`` of kind ``region`` (a ``REGION_*`` id; normal
    dispatch and combine share one region's memory and epochs, and differ here) as arrived."""
    return (int(epoch) << 8) | int(region)


def payload_per_block(sync: str) -> int:
    return TFF_PAYLOAD_BYTES if sync == "tff" else RAW_PAYLOAD_BYTES


def blocks_for(nbytes: int, sync: str) -> int:
    p = payload_per_block(sync)
    return max(0, -(-int(nbytes) // p))


# ----------------------------------------------------------------------------- row format
@dataclass(frozen=True)
class RowFormat:
    """Block layout of one row: a meta block, then each field padded to whole blocks.

    ``fields`` are (name, bytes per row) of the payload streams; ``meta_words`` is the number of 4-byte
    meta items (top-k ids, weights, ...). The escape bitmap for SP follows the meta items. ``kind`` names
    what the bytes are (dtypes, top-k) where rows of the same sizes could carry different things: it does
    not change the layout, only the signature peers compare.
    """

    sync: str
    fields: Tuple[Tuple[str, int], ...]
    meta_words: int
    kind: str = ""

    @cached_property
    def field_blocks(self) -> Tuple[int, ...]:
        return tuple(blocks_for(n, self.sync) for _, n in self.fields)

    @cached_property
    def data_blocks(self) -> int:
        return sum(self.field_blocks)

    @cached_property
    def bitmap_words(self) -> int:
        return -(-self.data_blocks // 32) if self.sync == "sp" else 0

    @cached_property
    def meta_blocks(self) -> int:
        return 1

    @cached_property
    def blocks(self) -> int:
        return self.meta_blocks + self.data_blocks

    @cached_property
    def row_bytes(self) -> int:
        return self.blocks * BLOCK_BYTES

    def field_offset_blocks(self, i: int) -> int:
        return self.meta_blocks + sum(self.field_blocks[:i])

    def __hash__(self) -> int:      # (formats key the Buffer's and the engine's caches: hashed once)
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.sync, self.fields, self.meta_words, self.kind))

    def __getstate__(self) -> dict:
        # (a string's hash differs between processes: another process hashes a format it receives anew)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def signature(self) -> int:
        return self._signature

    @cached_property
    def _signature(self) -> int:
        """A 62-bit digest of the layout; peers compare it to catch mismatched calls."""
        h = 1469598103934665603
        for item in (self.sync, self.meta_words, self.kind) + tuple(x for f in self.fields for x in f):
            for ch in str(item):
                h = ((h ^ ord(ch)) * 1099511628211) & ((1 << 62) - 1)
        return h

    def check_fits(self) -> None:
        if (self.meta_words + self.bitmap_words) * 4 > META_PAYLOAD_BYTES:
            # (the escape bitmap is at least one word: a smaller hidden size helps only where that would fit)
            hidden_helps = self.bitmap_words > 1 and (self.meta_words + 1) * 4 <= META_PAYLOAD_BYTES
            raise ValueError(
                f"row metadata needs {(self.meta_words + self.bitmap_words) * 4} bytes (the top-k ids and weights"
                f"{', and the SP escape bitmap' if self.bitmap_words else ''}"
                f"{', which grows with the hidden size' if hidden_helps else ''}) "
                f"but a meta block holds {META_PAYLOAD_BYTES}: reduce top-k"
                f"{' or the hidden size' if hidden_helps else ''}"
            )


@functools.lru_cache(maxsize=256)
def row_format(sync: str, fields: Tuple[Tuple[str, int], ...], meta_words: int, kind: str = "") -> RowFormat:
    """The (shared, immutable) RowFormat of these parameters, with its derived sizes computed once."""
    return RowFormat(sync, tuple(fields), int(meta_words), str(kind))


# ----------------------------------------------------------------------------- packing (torch path)
def _block_view(rows: torch.Tensor, nblocks: int) -> torch.Tensor:
    """[n, nblocks * 512] uint8 -> [n, nblocks, 512] view."""
    return rows.view(rows.shape[0], nblocks, BLOCK_BYTES)


def pack_field(blocks: torch.Tensor, data: torch.Tensor, sync: str) -> None:
    """Write ``data`` ([n, nbytes] uint8) into the payload area of ``blocks`` ([n, nb, 512] uint8)."""
    n, nbytes = data.shape
    if n == 0 or nbytes == 0:
        return
    p = payload_per_block(sync)
    start = FLAG_BYTES if sync == "tff" else 0
    full = nbytes // p
    if full:
        blocks[:, :full, start:start + p].copy_(data[:, : full * p].view(n, full, p))
    rem = nbytes - full * p
    if rem:
        blocks[:, full, start:start + rem].copy_(data[:, full * p:])


def unpack_field(blocks: torch.Tensor, out: torch.Tensor, sync: str) -> None:
    """Inverse of :func:`pack_field`: payload of ``blocks`` ([n, nb, 512]) into ``out`` ([n, nbytes])."""
    n, nbytes = out.shape
    if n == 0 or nbytes == 0:
        return
    p = payload_per_block(sync)
    start = FLAG_BYTES if sync == "tff" else 0
    full = nbytes // p
    if full and start == 0 and p == BLOCK_BYTES:
        out[:, : full * p].copy_(blocks[:, :full].reshape(n, full * p))   # raw blocks: one run per row
    elif full:
        out[:, : full * p].view(n, full, p).copy_(blocks[:, :full, start:start + p])
    rem = nbytes - full * p
    if rem:
        out[:, full * p:].copy_(blocks[:, full, start:start + rem])


def field_views(blocks: torch.Tensor, fmt: "RowFormat", i: int, dtype: torch.dtype):
    """Typed views of field ``i``'s payload where it lies in ``blocks`` ([n, fmt.blocks, 512] uint8).

    Returns ``[(lo, hi, view)]``: elements ``[lo, hi)`` of every row, as a view shaped like
    ``out[:, lo:hi]`` or ``[n, k, per]`` (whole blocks), with no copy, so a reduction can read the
    payload straight from the slots. None when the layout does not split into whole elements.
    """
    n = blocks.shape[0]
    es = torch.empty(0, dtype=dtype).element_size()
    nbytes = fmt.fields[i][1]
    off, fb = fmt.field_offset_blocks(i), fmt.field_blocks[i]
    pay = payload_per_block(fmt.sync)
    if nbytes % es or pay % es:
        return None
    if fmt.sync != "tff":
        flat = blocks[:, off:off + fb].reshape(n, fb * BLOCK_BYTES)
        return [(0, nbytes // es, flat[:, :nbytes].view(dtype))]
    full, rem = divmod(nbytes, pay)
    per = pay // es
    views = []
    if full:
        views.append((0, full * per, blocks[:, off:off + full, FLAG_BYTES:].view(dtype)))
    if rem:
        views.append((full * per, nbytes // es, blocks[:, off + full, FLAG_BYTES:FLAG_BYTES + rem].view(dtype)))
    return views


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy with standard contiguous strides, always (``contiguous()``/``clone()`` may keep odd strides of
    size-1 dimensions, which a dtype ``view`` then rejects), on the tensor's device."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, ...] tensor -> [n, nbytes] uint8 view (contiguous rows required)."""
    if t.dim() == 2 and t.stride(1) == 1 and t.is_contiguous() and t.numel():
        return t.view(torch.uint8)       # one view: the last dimension widens to the row's bytes
    row = t.element_size()
    for d in t.shape[1:]:
        row *= d
    if t.numel() == 0:   # empty tensors may carry strides that no dtype view accepts
        return torch.empty(t.shape[0] if t.dim() else 0, row, dtype=torch.uint8)
    t = t.contiguous()
    if t.stride(-1) != 1:    # (contiguous with an odd stride on a size-1 last dimension: ``x.t()`` of [1, T])
        t = fresh(t)
    return t.view(torch.uint8).reshape(t.shape[0], row)


def block_words(rows: torch.Tensor, nblocks: int) -> torch.Tensor:
    """[n, nblocks*512] uint8 -> [n, nblocks, 64] int64 view."""
    return rows.view(torch.int64).view(rows.shape[0], nblocks, BLOCK_WORDS)


# ----------------------------------------------------------------------------- memory fence
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()


def memory_fence() -> None:
    """Full barrier between the two steps of an emulated atomic block write (no-op on x86-64 TSO)."""
    if not _X86:
        with _fence_lock:  # lock acquire/release are full barriers in CPython's pthread implementation
            pass


def full_fence() -> None:
    """Full barrier on every CPU, x86-64 included: a store before it is visible to every core before any
    load after it (TSO lets a load pass an older store to another address; a locked instruction, which
    acquiring and releasing a lock executes, does not)."""
    with _fence_lock:
        pass


# ----------------------------------------------------------------------------- waiting
#: the longest deadline a wait takes (about 116 days: beyond it the clocks' arithmetic overflows)
MAX_TIMEOUT_S = 1e7


def _seconds(source: str, raw, highest: float, zero: bool = False) -> float:
    """``raw`` as a finite number of seconds > 0 (>= 0 with ``zero``) and at most ``highest``, else
    ValueError naming ``source``."""
    try:
        value = float(raw)
    except OverflowError:       # (an int past any float)
        raise ValueError(f"{source} must be a finite number of seconds, got a number past any float") from None
    except (TypeError, ValueError, RuntimeError):   # (RuntimeError: a tensor without values, on the meta device)
        raise ValueError(f"{source} must be a number of seconds, got {raw!r}"[:300]) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero) or value > highest:
        raise ValueError(f"{source} must be a finite number of seconds {'>=' if zero else '>'} 0 and at most "
                         f"{highest:g}, got {raw!r}")
    return value


def check_deadline(name: str, value) -> float:
    """A deadline given in code: a finite number of seconds > 0 (there is no "wait forever"), at most
    ``MAX_TIMEOUT_S``; TypeError for what is not a number (a string or a bool that ``float()`` would take),
    else ValueError, naming ``name``."""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    return _seconds(name, value, MAX_TIMEOUT_S)


def default_timeout(timeout_s: Optional[float]) -> float:
    """The deadline of every wait: ``UBEP_TIMEOUT_S`` if set, else ``timeout_s`` (default 60 s), each as
    ``check_deadline`` takes it."""
    given = 60.0 if timeout_s is None else check_deadline("timeout_s", timeout_s)   # checked even
    env = os.environ.get("UBEP_TIMEOUT_S")                                                 # when overridden
    return _seconds("UBEP_TIMEOUT_S", env, MAX_TIMEOUT_S) if env else given


def spin_seconds() -> float:
    """How long a wait busy-polls before it sleeps: ``UBEP_SPIN_S`` (seconds >= 0, at most 1), else 2 ms."""
    env = os.environ.get("UBEP_SPIN_S")
    return _seconds("UBEP_SPIN_S", env, 1.0, zero=True) if env else 0.002


#: what a rank writes into its peers' abort word for it: it failed inside a call, it gave up on another
#: rank, or it destroyed its Buffer; ``ABORT_LEFT_SETUP``: its Buffer set-up failed (or was interrupted) in
#: the last step, where the peers may have completed theirs
ABORT_FAILED, ABORT_GAVE_UP, ABORT_DESTROYED = 1, 2, 3
ABORT_REFUSED = 4   # (not an abort word: a rank refused a call before reaching its peers; see Buffer._peer_aborted)
ABORT_LEFT_SETUP = 5
ABORT_MISMATCH = 6  # (it failed on finding that the ranks' calls differ: a UBEPMismatchError)
#: how a wait names a rank whose abort word says it has no Buffer (in this order: one that never had one is
#: the cause where another destroyed its own since)
GONE_CAUSES = {ABORT_LEFT_SETUP: "left its Buffer set-up in the last step (interrupted or failed there: it has no "
                                 "Buffer)",
               ABORT_DESTROYED: "destroyed its Buffer"}


def abort_word(how: int, call: int) -> int:
    """The abort word: ``how`` (``ABORT_*``) in the low byte, the number of the call it happened in above."""
    return how | call << 8


def abort_how(word: int) -> int:
    return word & 0xFF


def abort_call(word: int) -> int:
    return word >> 8


def blamed(hows: dict) -> list:
    """Of ``{rank: how}``, the ranks an abort error names: those that failed themselves, else those that
    gave up waiting (on a rank that failed or stalled)."""
    aborted = [r for r, h in hows.items() if h in (ABORT_FAILED, ABORT_GAVE_UP, ABORT_MISMATCH)]
    return [r for r in aborted if hows[r] in (ABORT_FAILED, ABORT_MISMATCH)] or aborted


def mismatch_only(hows: dict, ranks: list) -> bool:
    """Every one of ``ranks`` (blamed ones) failed on finding that the ranks' calls differ."""
    return bool(ranks) and all(hows.get(r) == ABORT_MISMATCH for r in ranks)


class Waiter:
    """Polls a condition with a deadline, yielding the CPU (ranks may outnumber cores).

    ``poll()`` returns the list of ranks still missing (empty = done). On deadline the error names the
    phase and the missing ranks; a missing rank whose process has exited, that aborted, or that refused
    the call (``peer_aborted`` says how) is reported within about 50 ms.
    """

    def __init__(self, rank: int, timeout_s: float, peer_alive: Optional[Callable[[int], bool]] = None,
                 peer_aborted: Optional[Callable[[int], int]] = None):
        self.rank = rank
        self.timeout_s = timeout_s
        self.spin_s = spin_seconds()    # how long a wait busy-polls (with ``sched_yield``) before it sleeps
        self.peer_alive = peer_alive
        self.peer_aborted = peer_aborted

    def wait(self, phase: str, poll: Callable[[], Sequence[int]]) -> None:
        missing = poll()
        if not missing:
            return
        start = time.monotonic()
        deadline = start + self.timeout_s
        spin_until = start + self.spin_s
        naps = 0
        next_liveness = start + 0.05
        while True:
            # Busy-poll (yielding the core to any other runnable rank) while a peer is probably a few
            # hundred microseconds behind, then back off to sleeps so long waits cost no CPU.
            if time.monotonic() < spin_until:
                os.sched_yield()
            else:
                naps += 1
                time.sleep(min(1e-3, 2e-5 * naps))
            missing = poll()
            if not missing:
                memory_fence()
                return
            now = time.monotonic()
            # (also at the deadline: under a deadline shorter than that period, a missing rank that refused,
            # aborted or died is named as such, not as a stalled one)
            if now >= next_liveness or now >= deadline:
                next_liveness = now + 0.05
                # A rank that died without aborting first: peers that lost it abort too, and the error
                # should name the cause. A rank that aborted (and may have exited since) is an abort.
                codes = {} if self.peer_aborted is None else \
                    {r: self.peer_aborted(r) for r in range(self._world(missing))}
                alive = {} if self.peer_alive is None else {r: self.peer_alive(r) for r in missing}
                # ``missing`` was polled before those loads: a peer may have delivered since, then finished its
                # call and destroyed its Buffer (or exited). It stores what it delivers before its abort word,
                # so a poll after the loads sees it: poll again before blaming anyone
                memory_fence()
                missing = poll()
                if not missing:
                    memory_fence()
                    return
                # a rank that destroyed its Buffer counts only when this wait still needs it (it may have
                # finished its part of this call before destroying, while others still deliver)
                for how, cause in GONE_CAUSES.items():
                    gone = [r for r in missing if codes.get(r) == how]
                    if gone:
                        raise UBEPPeerLostError(phase, self.rank, list(missing), gone, cause=cause)
                aborted = blamed(codes)
                if self.peer_alive is not None:
                    dead = [r for r in missing if r not in aborted and not alive.get(r, True)]
                    if dead:
                        raise UBEPPeerLostError(phase, self.rank, list(missing), dead)
                # a rank that refused the call is the cause of those that gave up waiting for it
                refused = [r for r in missing if codes.get(r) == ABORT_REFUSED]
                if refused and all(codes[r] == ABORT_GAVE_UP for r in aborted):
                    raise UBEPPeerAbortedError(phase, self.rank, list(missing), refused, refused=True)
                # so is a rank that exited without a word while the ranks this wait needs gave up (waiting for
                # it, as this one does not: it delivered here before it died, or sends this rank nothing)
                if aborted and self.peer_alive is not None and all(codes[r] == ABORT_GAVE_UP for r in aborted):
                    # (a rank found gone is asked again for its word: it may have given up and exited since)
                    dead = [r for r in range(self._world(missing)) if r != self.rank and not codes.get(r)
                            and not self.peer_alive(r) and not self.peer_aborted(r)]
                    if dead:
                        raise UBEPPeerLostError(phase, self.rank, list(missing), dead)
                if aborted:
                    raise UBEPPeerAbortedError(phase, self.rank, list(missing), aborted,
                                               mismatch=mismatch_only(codes, aborted))
            if now >= deadline:
                raise UBEPTimeoutError(phase, self.rank, list(missing), self.timeout_s)


    world_size: int = 0

    def _world(self, missing: Sequence[int]) -> int:
        return self.world_size or (max(missing) + 1 if missing else 0)


# ----------------------------------------------------------------------------- sp escape
def sp_escape_inplace(words0: torch.Tensor) -> torch.Tensor:
    """SP sender side: escape first words equal to the sentinel. Returns the boolean escape mask.

    ``words0`` is the [n, nblocks] int64 tensor of the data blocks' first words (modified in place).
    """
    mask = words0 == SP_SENTINEL
    if bool(mask.any()):
        words0.masked_fill_(mask, SP_ESCAPE)
    return mask


def pack_bitmap(mask: torch.Tensor, nwords: int) -> torch.Tensor:
    """[n, nblocks] bool -> [n, nwords] int32 bitmap (bit b of word b // 32)."""
    n, nb = mask.shape
    padded = torch.zeros(n, nwords * 32, dtype=torch.int64)
    padded[:, :nb] = mask.to(torch.int64)
    weights = (torch.ones(32, dtype=torch.int64) << torch.arange(32, dtype=torch.int64))
    words = (padded.view(n, nwords, 32) * weights).sum(-1)
    return words.to(torch.int64).where(words < (1 << 31), words - (1 << 32)).to(torch.int32)


def unpack_bitmap(words: torch.Tensor, nblocks: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitmap`: [n, nwords] int32 -> [n, nblocks] bool."""
    n, nwords = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    bits = (w.unsqueeze(-1) >> torch.arange(32, dtype=torch.int64)) & 1
    return bits.view(n, nwords * 32)[:, :nblocks].bool()


def wrap_int64(v: int) -> int:
    """A Python int reduced modulo 2**64 into int64's range, as int64 arithmetic wraps."""
    v = int(v) & ((1 << 64) - 1)
    return v - (1 << 64) if v >= (1 << 63) else v


def wrapping_sum(words: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum of int64 words modulo 2**64 (torch integer sums wrap on overflow)."""
    return words.sum(dim=dim, dtype=torch.int64)

