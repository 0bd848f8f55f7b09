"""``Buffer``: DeepEP's legacy Buffer API over the simulated UGAS, speaking the UBEP protocol.

The Python layer validates, lays out the regions of the shared segment and drives the engine
(``ubep_torch.engine``). Every rank runs the same sequence per call:

* **count group** (TokenCnt-Sending): one control message per peer with the per-expert counts;
* **token group** (Token-Sending): rows written straight into the slots of every destination;
* **CalCumSum**: prefix sums over the counts received from every source give the output offsets;
* **Token-Reordering**: each source's rows are copied out as soon as *that* source's blocks are seen
  (Data-as-Flag), with no global barrier. ``sync="sw"`` instead runs the bulk-synchronous baseline:
  rows, SyncAll, flags and counts, verification, SyncAll, reordering.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import math
import numbers
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from itertools import accumulate, count
from typing import Callable, Deque, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from . import protocol as P
from . import ugas
from .engine import Destination, SendJob, make_engine, send_lists
from .errors import (
    CancelledCallError,
    UBEPBrokenError,
    UBEPError,
    UBEPMismatchError,
    UBEPPeerAbortedError,
    UBEPPeerLostError,
    UBEPTimeoutError,
    UBEPUsageError,
    name_global_ranks,
    refusal,
)
from .fp8 import FP8, low_latency_cast_to_fp8, pack_ue8m0
from .ugas import SymmetricHeap, refuse_setup
from .utils import (
    Config,
    EventHandle,
    EventOverlap,
    TensorCache,
    check_count,
    check_flag,
    check_host,
    physical_memory,
    share_memory,
)

_AUX_REGIONS = 8          # region ids that have an ack table
_MAX_LL_BUFFERS = 8       # receive buffers (halves) a low-latency region may have, each with its acks
# aux words, R per row: acks [region][half][source] | abort words | SyncAll counters, a row per call modulo
# _SYNC_SLOTS | decisions on refused attempts, a row per attempt modulo Buffer._decide_slots (see
# Buffer._post_decision) (one word per rank in each row; row * R + rank)
_ACK_WORDS = _MAX_LL_BUFFERS * _AUX_REGIONS
_ABORT_ROW = _ACK_WORDS
_SYNC_ROW, _SYNC_SLOTS = _ACK_WORDS + 1, 64
_BARRIER_KIND_SHIFT = 20     # a SyncAll word: call << 24 | operation << 20 | barrier index (see _sync_all)
_DECIDE_ROW = _SYNC_ROW + _SYNC_SLOTS
# the region whose epoch a refused call would have taken, by the call (or the step preparing it) that refused
_REFUSED_REGION = {"dispatch": P.REGION_DISPATCH, "combine": P.REGION_DISPATCH,
                   "get_dispatch_layout": P.REGION_DISPATCH, "low_latency_dispatch": P.REGION_LL_DISPATCH,
                   "low_latency_combine": P.REGION_LL_COMBINE, "clean_low_latency_buffer": None}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TOPK_RANGE = "{name} values must be in [-1, {E}); got min {lo}, max {hi} (rank {rank})"
_LL_MAX_TOPK = 16         # top-k the low-latency size hint provisions for
_RECENT_HANDLES = 16      # handles recognised from their plain-tuple copies (per mode)
# what a handle's tuple entries do not say, and two handles with equal entries must agree on to be exchangeable
# (normal handles that differ only in num_worst_tokens match as one whose worst size is unknown)
_DISPATCH_LAYOUT_KEYS = ("num_experts", "layout", "row_index")
_LL_LAYOUT_KEYS = ("K", "num_tokens", "return_slot", "sent_counts", "pos", "n_pairs", "topk_snapshot", "src_k")
_DEFAULT_NVL_BYTES = 256 << 20
# the phases of a call's waits, as its errors name them
_TOKENCNT_PHASE = {rid: f"{name}: TokenCnt (waiting for the count messages)" for rid, name in P.REGION_NAMES.items()}
_REORDER_PHASE = {rid: f"{name}: Token-Reordering (waiting for token blocks)" for rid, name in P.REGION_NAMES.items()}
_MAX_SEEN_KINDS = 16    # kinds of exchange whose last checked control messages a Buffer keeps (see _exchange_receive)
_SEEN_PER_KIND = 2      # the last distinct sets of messages kept of each kind, the most recent first


def _checked_words(m, used: int):
    """The words of a control message (``m``, its first ``used`` payload words) that ``_exchange_receive``'s
    checks read: all but the checksum and the call-specific word 3 (num_worst_tokens, the paired dispatch)."""
    return m[:P.CTRL_CHECKSUM] + m[P.CTRL_NUM_EXPERTS:used]


def _full_words(checked: List[list]) -> List[list]:
    """Every source's message again from its ``_checked_words``, with the checksum and word 3 0."""
    return [c[:P.CTRL_CHECKSUM] + [0, 0] + c[P.CTRL_CHECKSUM:] for c in checked]


_POLLS_BEFORE_REGION_CHECK = 16   # polls of a control-message wait before it also looks at the other regions
_STREAM_ROWS = 32         # fewest arrived rows of a source that streaming Token-Reordering copies at once
_STEADY_SPIN_NS = 1_000_000    # how long the engine's one-step dispatch waits for its peers (see _steady_dispatch)


def _round(x: int, a: int = P.BLOCK_BYTES) -> int:
    return -(-int(x) // a) * a


def _row_bytes_worst(payload_bytes: int, meta_bytes: int = 0) -> int:
    return (1 + P.blocks_for(payload_bytes, "tff") + 1) * P.BLOCK_BYTES + _round(meta_bytes)


def normal_buffer_bytes(num_tokens: int, hidden_bytes: int, num_ranks: int) -> int:
    """``num_nvl_bytes`` that lets every rank send ``num_tokens`` rows of ``hidden_bytes`` to every peer."""
    num_tokens, hidden_bytes = check_count("num_tokens", num_tokens), check_count("hidden_bytes", hidden_bytes)
    num_ranks = check_count("num_ranks", num_ranks, 1)
    region = num_ranks * (P.MAX_CTRL_BLOCKS * P.BLOCK_BYTES + num_tokens * _row_bytes_worst(hidden_bytes))
    return _round(region, 4096)


def _max_local_experts(extra_counts: int) -> int:
    """Local experts whose counts fit one control message next to ``extra_counts`` other counts."""
    return P.MAX_CTRL_COUNTS - extra_counts


def low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                             num_experts: int, num_topk: int = _LL_MAX_TOPK, num_buffers: int = 2) -> int:
    """``num_rdma_bytes`` for low-latency calls of this shape with ``num_buffers`` receive buffers (calls in
    flight at once: see ``Buffer(low_latency_buffers=...)``)."""
    k = _check_ll_buffers(num_buffers, "num_buffers")
    n = check_count("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
    h, num_ranks = check_count("hidden", hidden), check_count("num_ranks", num_ranks, 1)
    num_experts, num_topk = check_count("num_experts", num_experts, 1), check_count("num_topk", num_topk, 1)
    e_local = max(1, -(-num_experts // num_ranks))
    if e_local > _max_local_experts(0):
        raise ValueError(f"num_experts={num_experts} gives {e_local} experts per rank; low-latency control messages "
                         f"carry the counts of at most {_max_local_experts(0)}")
    ctrl = k * num_ranks * P.MAX_CTRL_BLOCKS * P.BLOCK_BYTES
    dispatch_rows = k * num_ranks * e_local * n * _row_bytes_worst(h * 2, 0)
    combine_rows = k * n * num_topk * _row_bytes_worst(h * 2)
    return 2 * _round(ctrl + max(dispatch_rows, combine_rows), 4096) + 4096


def _check_ll_buffers(k, name: str) -> int:
    k = check_count(name, k, 2)
    if k > _MAX_LL_BUFFERS:
        raise ValueError(f"{name} must be at most {_MAX_LL_BUFFERS}, got {k}")
    return k


class _Region:
    """Byte ranges of one protocol region inside every rank's segment (identical on all ranks).

    A region holds ``halves`` copies of its control blocks and slots; call ``epoch`` uses copy
    ``epoch % halves``. Low-latency regions have two (or ``low_latency_buffers``), so a call can be sent
    while a peer still holds the previous call's rows (receive hooks, ``zero_copy``). Normal calls complete
    before they return, so the normal region has one, and normal dispatch and combine share it: a peer's
    rows of the previous call, whichever it was, are consumed (acknowledged) before the next call
    overwrites them, and one set of slots stays warm in cache across a round trip. Epochs and
    acknowledgements belong to the memory, so they are counted under the ``rid`` of the region object
    (``Buffer._next_epoch``, ``_ack_base``); flags carry the call's own region id.
    """

    def __init__(self, rid: int, base: int, nbytes: int, world: int, parts: int, halves: int = 2):
        self.rid = rid
        self.world = world
        self.parts = parts
        self.halves = halves
        self.ctrl_base = base
        ctrl_bytes = halves * world * P.MAX_CTRL_BLOCKS * P.BLOCK_BYTES
        self.rows_base = base + ctrl_bytes
        rem = max(0, nbytes - ctrl_bytes)
        self.part_bytes = (rem // (halves * parts)) // P.BLOCK_BYTES * P.BLOCK_BYTES
        self.nbytes = nbytes
        self._views: dict = {}     # (memory, half, part or source, row blocks) -> view, made once

    def forget_views(self) -> None:
        self._views = {}

    def kept(self, key: tuple, make: Callable):
        """What ``make()`` returns, made once per ``key`` and kept with the views (for the Buffer's life)."""
        if key not in self._views:
            self._views[key] = make()
        return self._views[key]

    def half(self, epoch: int) -> int:
        return int(epoch) % self.halves

    def ctrl(self, mem: torch.Tensor, half: int, src: int, nctrl: int = P.MAX_CTRL_BLOCKS) -> torch.Tensor:
        """The first ``nctrl`` control blocks of source ``src`` in ``mem``, as [nctrl, 512] uint8."""
        key = (mem.data_ptr(), half, src, -nctrl)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.ctrl_sources(mem, half)[src, :nctrl]
        return view

    def ctrl_heads(self, mem: torch.Tensor, half: int):
        """Every source's first control word (its flag word) in ``mem``, as a numpy int64 array of [world]
        views (a word's load costs far less through numpy than through a tensor)."""
        key = (mem.data_ptr(), half, "heads")
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.ctrl_sources(mem, half).view(torch.int64)[:, 0, 0].numpy()
        return view

    def ctrl_notes(self, mem: torch.Tensor, half: int):
        """Every source's head words 1..3 of its first control block (what its store policy says: how it
        stored its rows, what reading rows has cost it; see ``native_engine.store_policy``), as a numpy int64
        array of [world, 3] views (see ``ctrl_heads``)."""
        key = (mem.data_ptr(), half, "notes")
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.ctrl_sources(mem, half).view(torch.int64)[:, 0, 1:4].numpy()
        return view

    def ctrl_sources(self, mem: torch.Tensor, half: int) -> torch.Tensor:
        """Every source's control blocks in ``mem``, as [world, max blocks, 512] uint8."""
        key = (mem.data_ptr(), half, "ctrl")
        view = self._views.get(key)
        if view is None:
            nb = P.MAX_CTRL_BLOCKS * P.BLOCK_BYTES
            off = self.ctrl_base + half * self.world * nb
            view = self._views[key] = mem[off:off + self.world * nb].view(self.world, P.MAX_CTRL_BLOCKS,
                                                                           P.BLOCK_BYTES)
        return view

    def capacity(self, fmt: P.RowFormat) -> int:
        return self.part_bytes // fmt.row_bytes

    def rows(self, mem: torch.Tensor, half: int, part: int, fmt: P.RowFormat, n: Optional[int] = None) -> torch.Tensor:
        """[n, blocks, 512] uint8 view of part ``part`` (n: the part's capacity in rows of ``fmt``)."""
        key = (mem.data_ptr(), half, part, fmt.blocks)
        full = self._views.get(key)
        if full is None:
            cap = self.capacity(fmt)
            off = self.rows_base + (half * self.parts + part) * self.part_bytes
            full = self._views[key] = mem[off:off + cap * fmt.row_bytes].view(cap, fmt.blocks, P.BLOCK_BYTES)
        if n is None or n == full.shape[0]:
            return full
        if n > full.shape[0]:
            raise ValueError(f"{n} rows do not fit a part of {full.shape[0]} rows")
        return full[:n]


class DispatchHandle(tuple):
    """Normal-mode handle. Tuple positions follow DeepEP's intranode handle, with one channel:
    ``(rank_prefix_matrix [R, R] int32, channel_prefix_matrix [R, 1] int32 (tokens this rank sent to
    each rank), recv_channel_prefix_matrix [R, 1] int32 (where the channel's rows begin within each source's
    rows of recv_x, as DeepEP's receiver records it: 0 with one channel; rank_prefix_matrix gives where
    each source's rows begin),
    recv_src_idx [N_recv] int32 (as DeepEP, [num_worst_tokens] with ``num_worst_tokens``: -1 past the
    received rows), is_token_in_rank [T, R] bool, send_head [T, R] int32)``; an expert-major
    handle has a seventh entry, ``row_index`` [rows] int64: the rank-major row of each expert-major row (-1
    for padding), so a plain-tuple copy of it keeps its order. Attributes carry the rest of the layout: send
    lists per destination, and the rows received from each source and where they begin in recv_x
    (``recv_counts`` [R], ``recv_offsets`` [R + 1], as Python ints), and the received rows' source tokens
    (``src_tokens``, int64), the routing's ``token_in_rank`` (for cost-model reports) and an expert-major
    handle's ``row_index``. A handle object's layout is fixed when its dispatch returns it: the Buffer reads
    these attributes, not its tensors, so writing into them changes nothing (a plain-tuple copy is read from
    its entries: see ``from_tuple``)."""

    def __new__(cls, items, **attrs):
        obj = super().__new__(cls, items)
        obj.__dict__.update(attrs)
        return obj

    @classmethod
    def expert_major(cls, base: "DispatchHandle", row_index: torch.Tensor) -> "DispatchHandle":
        """The expert-major handle over the rank-major handle ``base``: its six entries, then ``row_index``
        (the attribute the Buffer reads is a copy of the entry the caller gets)."""
        return cls(tuple(base) + (row_index,), **{**base.__dict__, "layout": "expert_major",
                                                   "row_index": row_index.clone(), "base_handle": base})

    @classmethod
    def from_tuple(cls, items, rank: int, num_ranks: int) -> "DispatchHandle":
        """Rebuild a handle from its tuple entries alone (a handle that went through code which keeps plain
        tuples): six for a rank-major one, seven (``row_index`` last) for an expert-major one. Checks that the
        entries agree with each other."""
        items = tuple(items)
        if len(items) not in (6, 7) or not all(isinstance(t, torch.Tensor) for t in items):
            raise TypeError("a dispatch handle is the tuple of six tensors returned by Buffer.dispatch (seven for "
                            "layout='expert_major')")
        for i, t in enumerate(items):    # (the C loops read the handle's tensors by address)
            _refuse_tensor(f"handle[{i}]", t)
        if len(items) == 7:
            base = cls.from_tuple(items[:6], rank, num_ranks)
            row_index = items[6]
            if row_index.dtype != torch.int64 or row_index.dim() != 1 or (row_index.numel() and (
                    int(row_index.min()) < -1 or int(row_index.max()) >= base.num_recv)):
                raise ValueError(f"handle entries disagree: an expert-major handle's row_index must be int64 rows "
                                 f"in [-1, {base.num_recv})")
            return cls.expert_major(base, row_index)
        rank_prefix, channel_prefix, _, recv_src_idx, itr, _ = items
        R = num_ranks
        if tuple(rank_prefix.shape) != (R, R) or itr.dim() != 2 or itr.shape[1] != R or itr.dtype != torch.bool \
                or tuple(channel_prefix.shape) != (R, 1) or recv_src_idx.dim() != 1:
            raise ValueError(f"handle entries have the wrong shapes for {R} ranks: rank_prefix_matrix "
                             f"{tuple(rank_prefix.shape)}, channel_prefix_matrix {tuple(channel_prefix.shape)}, "
                             f"recv_src_idx {tuple(recv_src_idx.shape)}, is_token_in_rank {tuple(itr.shape)}")
        rank_prefix = rank_prefix.to(torch.int64)
        col = rank_prefix[:, rank]
        counts = torch.diff(col, prepend=torch.zeros(1, dtype=torch.int64))
        num_recv = int(col[-1]) if R else 0
        # (a num_worst_tokens handle's recv_src_idx is that long, -1 past the received rows: its outputs' size)
        if bool((counts < 0).any()) or recv_src_idx.numel() < num_recv or \
                bool((recv_src_idx[num_recv:] != -1).any()):
            raise ValueError(f"handle entries disagree: rank_prefix_matrix says {num_recv} received rows, "
                             f"recv_src_idx has {recv_src_idx.numel()}" +
                             (" (the entries past them must be -1)" if recv_src_idx.numel() > num_recv else ""))
        worst = recv_src_idx.numel() if recv_src_idx.numel() > num_recv else None
        # what this rank sent: is_token_in_rank against both matrices
        sent = itr.sum(0)
        own_row = rank_prefix[rank] - (rank_prefix[rank - 1] if rank else 0)
        if not (torch.equal(sent, channel_prefix[:, 0].to(torch.int64)) and torch.equal(sent, own_row)):
            raise ValueError(f"handle entries disagree: is_token_in_rank sends {sent.tolist()} tokens to the ranks, "
                             f"channel_prefix_matrix says {channel_prefix[:, 0].tolist()} and rank_prefix_matrix "
                             f"{own_row.tolist()}")
        # what this rank received: every source's rows in its token order
        offsets = [0] + col.tolist()
        src = recv_src_idx.to(torch.int64)
        for s in range(R):
            seg = src[offsets[s]:offsets[s + 1]]
            if seg.numel() and (int(seg[0]) < 0 or bool((seg[1:] <= seg[:-1]).any())):
                raise ValueError(f"handle entries disagree: recv_src_idx of the rows from rank {s} are not "
                                 f"increasing token indices")
        send_idx = [itr[:, d].nonzero().squeeze(1) for d in range(R)]
        return cls(items, send_idx=send_idx, recv_counts=counts.tolist(), recv_offsets=offsets, num_recv=num_recv,
                   num_tokens=itr.shape[0], num_experts=0, num_worst_tokens=worst, layout="rank_major",
                   topk_idx=None, peer_tokens=None, pair=0, src_tokens=src, token_in_rank=itr)


class LowLatencyHandle(tuple):
    """Low-latency handle: ``(src_info [E_local, R*N] int32, layout_range [E_local, R] int64, N, H, E)``
    plus attributes (top-k slot of every received row, per-source row counts)."""

    def __new__(cls, items, **attrs):
        obj = super().__new__(cls, items)
        obj.__dict__.update(attrs)
        return obj


def _raise_if_destroyed(buf: "Buffer", e: BaseException, what: str) -> None:
    """A call whose Buffer was destroyed while it ran (from a signal handler or another thread): whatever
    it tripped over then, the cause is the destroy, raised as ``UBEPBrokenError``."""
    if buf._destroyed and isinstance(e, Exception) and not isinstance(e, UBEPError):
        raise UBEPBrokenError(f"ubep_torch: rank {buf.rank}: this Buffer was destroyed during {what}") from e


_SCALARS = (bool, int, float, str)     # (argument types _check_host_tensors passes over at once)
_TENSOR, _STRIDED = torch.Tensor, torch.strided
_HANDLES = (DispatchHandle, LowLatencyHandle)


def _check_host_tensors(fn: Callable, args: tuple, kwargs: dict, buf: Optional["Buffer"] = None) -> None:
    """Every tensor among the arguments of ``fn`` (and inside tuple or list arguments: fp8 pairs, bias
    pairs, handles) is a dense (strided) tensor in host memory, where the UGAS and the C loops read it by
    address; else ValueError (another device) or TypeError (a sparse or other layout) naming the argument,
    before anything is read. (One pass over the values; an argument's name is looked up only for the one
    that fails; a handle object that one of ``buf``'s recent calls returned holds the Buffer's own tensors
    and is passed over.)"""
    values = args + tuple(kwargs.values()) if kwargs else args
    # (the usual call: every argument a host tensor, None or a plain scalar, found in one pass)
    if all(v is None or v.__class__ in _SCALARS or (v.__class__ is _TENSOR and v.is_cpu and v.layout is _STRIDED
                                                    and not v.is_nested)
           or (v.__class__ in _HANDLES and buf is not None and _returned_by(buf, v)) for v in values):
        return
    for k, value in enumerate(values):
        if value is None or value.__class__ in _SCALARS:
            continue
        if isinstance(value, torch.Tensor):
            if value.is_cpu and value.layout == torch.strided and not value.is_nested:
                continue
            where = ""
        elif isinstance(value, (tuple, list)):
            if buf is not None and _returned_by(buf, value):
                continue
            bad = [i for i, t in enumerate(value) if isinstance(t, torch.Tensor)
                   and not (t.is_cpu and t.layout == torch.strided and not t.is_nested)]
            if not bad:
                continue
            where, value = f"[{bad[0]}]", value[bad[0]]
        else:
            continue
        name = fn.__code__.co_varnames[1 + k] if k < len(args) else list(kwargs)[k - len(args)]
        _refuse_tensor(f"{fn.__name__}: {name}{where}", value)


def _returned_by(buf: "Buffer", handle) -> bool:
    """Is ``handle`` the very handle object one of ``buf``'s recent calls returned (not one built from its
    entries or its attributes)?"""
    recent = buf._recent_handles if handle.__class__ is DispatchHandle else \
        buf._recent_ll_handles if handle.__class__ is LowLatencyHandle else ()
    return any(h is handle for h in reversed(recent))


def _refuse_tensor(what: str, value: torch.Tensor) -> None:
    """ValueError for a tensor on another device than the host, TypeError for one of another layout than a
    dense (strided) one, naming ``what``; nothing for a dense host tensor."""
    if value.is_cpu and value.layout == torch.strided and not value.is_nested:
        return
    check_host(what, value)
    if value.is_nested:
        raise TypeError(f"ubep_torch: {what} is a nested tensor; pass a dense tensor (rows of one size)")
    raise TypeError(f"ubep_torch: {what} is a tensor of layout {value.layout}; pass a dense (strided) tensor "
                    f"(.to_dense())")


def _scales_as_given(out_x, x):
    """A dispatch's received rows in the form of its ``x``: an fp8 pair whose scales were given as ``[T]`` gets
    ``[N]`` scales back (as DeepEP returns them; the exchange carries them as ``[T, 1]``)."""
    if isinstance(out_x, tuple) and isinstance(x, tuple) and x[1].dim() == 1:
        return out_x[0], out_x[1].view(-1)
    return out_x


def _check_overlap(previous_event, async_finish, allocate_on_comm_stream) -> None:
    """The overlap arguments of a normal-mode call: flags (``_check_flags``), and a ``previous_event`` that is
    None or an ``EventOverlap`` (DeepEP reads its ``.event``; anything else is a mistake this data path would
    otherwise ignore)."""
    if async_finish is not False or allocate_on_comm_stream is not False:     # (the usual False: nothing to check)
        _check_flags(async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise TypeError(f"previous_event must be None or an EventOverlap (from a call or Buffer.capture()), got "
                        f"{type(previous_event).__name__}")


def _event(async_finish) -> EventOverlap:
    """A call's event, as DeepEP returns it: holding an ``EventHandle`` where the call was asked to finish
    asynchronously, else None (here every call has completed when it returns either way)."""
    return EventOverlap(EventHandle() if async_finish else None)


def _check_count_aivs(n: Optional[int], cost_model, what: str) -> None:
    """A count group of ``n`` AIVs is one the cost model can report: fewer than its die's AIVs (the token
    group needs one); else ValueError (every call's report would fail)."""
    per_die = getattr(getattr(cost_model, "params", None), "aivs_per_die", None)
    if n is not None and isinstance(per_die, int) and n >= per_die:
        raise ValueError(f"{what}={n}: the cost model's die has {per_die} AIVs, so a count group takes at most "
                         f"{per_die - 1} (the token group needs one)")


def _other_barriers(words: Sequence[int], ranks, call: int, kind: int) -> dict:
    """``{rank: operation}`` for the ranks among ``ranks`` whose SyncAll word (``words[rank]``, see
    ``Buffer._sync_all``) is one of call ``call`` in another operation than ``kind``. (A word of no barrier
    is 0: its index is 0.)"""
    return {r: words[r] >> _BARRIER_KIND_SHIFT & 0xF for r in ranks
            if words[r] >> 24 == call and words[r] & ((1 << _BARRIER_KIND_SHIFT) - 1) > 0
            and words[r] >> _BARRIER_KIND_SHIFT & 0xF != kind}


def _check_flags(**flags) -> None:
    """Every flag passes ``check_flag``."""
    for name, flag in flags.items():
        check_flag(name, flag)


def _group_global_ranks(group) -> List[int]:
    """The global rank of every rank of ``group`` (in group order); [] where the group is not usable."""
    try:
        return [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return []


def _resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its values in memory: a tensor with torch's negative bit (``torch._neg_view``, the imaginary
    part of a conjugate) holds the values' negation, which the C loops and byte views would read."""
    return t.resolve_neg() if t.is_neg() else t


def _check_process(buf: "Buffer", what: str) -> None:
    """Only the process that built the Buffer uses it: another one (a fork's child) would write into the
    peers' memory as this rank."""
    if buf._pid != os.getpid():
        raise UBEPUsageError(f"ubep_torch: {what}: this Buffer was built by process {buf._pid}, not this one "
                           f"({os.getpid()}, a forked child?); build a Buffer in this process instead")


def _enter_call(buf: "Buffer", what: str) -> None:
    """Take the Buffer for a call of this thread, or raise before anything is touched: the process must be
    the Buffer's (``_check_process``), and a second thread would interleave its exchanges with the first
    one's (every rank must make the same calls in the same order). Release with
    ``buf._call_lock.release()``."""
    _check_process(buf, what)
    if not buf._call_lock.acquire(blocking=False):
        raise UBEPUsageError(f"ubep_torch: {what}: another thread is inside a call on this Buffer; a Buffer's calls "
                           f"are collective and run one at a time, in the same order on every rank")


def _collective(fn):
    """An exception after a call has started talking to peers breaks the Buffer and aborts the peers'
    waits (they raise ``UBEPPeerAbortedError`` within ~50 ms instead of waiting for their deadline).
    Validation errors are raised before that point and leave everything usable.

    Calls (and their recv hooks) run without autograd recording, as DeepEP's kernels do: inputs that
    require grad are read as data and results do not require grad (``ubep_torch.functional`` is the
    differentiable API)."""
    _REFUSED_REGION[fn.__name__]     # (every collective call says which region a refusal of it skips)

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        _enter_call(self, fn.__name__)
        self._in_call = False
        self.last_report = None       # (a call that makes no report leaves none: see _report)
        begun = self._begun
        grad = torch.is_grad_enabled()
        try:
            _check_host_tensors(fn, args, kwargs, self)
            if not self._destroyed and self._broken is None and not self._nothing_to_settle():
                # (a refusal of this rank's is settled first: a peer that was in another kind of call has
                # posted its decision, then failed, and the mismatch, not its abort, is the cause to name)
                self._settle_refusal()
                self._refused_as_other_ahead(fn.__name__)
                self._check_peers(fn.__name__, self._calls + 1, "start of the call")
            torch._C._set_grad_enabled(False)      # (torch.no_grad() without its context-manager objects)
            out = fn(self, *args, **kwargs)
        except BaseException as e:
            _raise_if_destroyed(self, e, fn.__name__)
            name_global_ranks(e, self._global_ranks, also=(ValueError, TypeError))
            if self._in_call and not isinstance(e, UBEPBrokenError):
                if not self._cancel_call(e):
                    self._fail(e)
            elif self._begun == begun and refusal(e):
                self._refuse(fn.__name__)    # failed before reaching the peers: tell those waiting
            raise
        finally:
            torch._C._set_grad_enabled(grad)
            self._in_call = False
            self._cancel_point = None
            self._call_lock.release()
        hook = out[-1] if isinstance(out, tuple) and out and callable(out[-1]) else None
        if hook is None:
            return out
        issued, issued_seq = self._calls, self._seq     # the hook completes this call, whenever it runs

        @functools.wraps(hook)
        def guarded_hook():
            if getattr(hook, "pending", None) is not None:
                _raise_if_cancelled(hook.pending)    # (before anything is touched: the Buffer stays usable)
            _enter_call(self, f"{fn.__name__} recv hook")
            # (an abort it signals names its own call; a refusal it sees is of its own attempt)
            outer = self._active_call, self._active_seq, self._hook_seq
            self._active_call, self._active_seq, self._hook_seq = issued, issued_seq, issued_seq
            # the hook of a call a peer refused cancels it (see _cancel_call), whatever calls came since: a
            # refused attempt is cancelled on every rank, and later calls do not depend on it
            pend = next((p for p in self._pending if p.call == issued and not p.done), None)
            if pend is not None:
                self._cancel_point = pend.extra.get("cancel_point")
            try:
                # The hook fills tensors the call created, in the caller's mode then: under inference mode
                # they may be inference tensors, which only inference mode may write (it records no grad).
                with torch.inference_mode(), self._waits_in("in its recv hook"):
                    return hook()
            except BaseException as e:
                _raise_if_destroyed(self, e, f"{fn.__name__} recv hook")
                name_global_ranks(e, self._global_ranks, also=(ValueError, TypeError))
                if not isinstance(e, UBEPBrokenError):
                    if self._cancel_call(e):
                        pend.done = pend.extra["cancelled"] = True     # (its combine is refused)
                        self._pending = [p for p in self._pending if not p.done]
                    else:
                        self._fail(e)
                raise
            finally:
                self._active_call, self._active_seq, self._hook_seq = outer
                self._cancel_point = None
                self._call_lock.release()
        # (named for the user: an argument passed to it is refused as "low_latency_dispatch recv hook()
        # takes 0 positional arguments", not by the name of the function inside the call)
        guarded_hook.__name__ = guarded_hook.__qualname__ = f"{fn.__name__} recv hook"
        return out[:-1] + (guarded_hook,)
    return wrapper


class _DispatchPlan:
    """What the checks of a normal dispatch found of its form: the sizes, the dtypes and the row format. A
    later call of the same form (``Buffer._repeated_dispatch``) checks its arguments against these in a few
    comparisons, and its routing against the Buffer's layout of the last routing, and goes on from here."""
    __slots__ = ("T", "H", "K", "E", "fmt", "cap", "dtype", "wdtype")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


@dataclass
class _Pending:
    """A low-latency receive issued with ``return_recv_hook=True`` that has not been completed yet."""
    kind: str
    epoch: int
    done: bool = False
    extra: dict = field(default_factory=dict)
    call: int = 0          # the Buffer's call number (``Buffer._calls``) that issued it
    seq: int = 0           # and its attempt number (``Buffer._seq``)
    pair: int = 0          # what a combine of its rows names it by (see ``Buffer._pair_tag``)


class Buffer:
    """Expert-parallel communication buffer: DeepEP's legacy ``Buffer`` API on the simulated UGAS.

    Args:
        group: torch.distributed process group (gloo or any backend; used only to bootstrap).
        num_nvl_bytes: bytes of the normal-mode region per rank (see ``Config.get_nvl_buffer_size_hint``);
            0 sizes it from ``num_max_tokens_per_rank``/``hidden`` when given, else 256 MiB, or none at all
            in low-latency mode (as in DeepEP, where such a Buffer serves low-latency calls only). A
            Buffer's shared memory is reserved when it is built.
        num_rdma_bytes: bytes of the low-latency region (``get_low_latency_rdma_size_hint``).
        low_latency_mode: enables the low-latency region.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, use_fabric:
            accepted for DeepEP compatibility (no queue pairs or fabric handles exist in shared memory).
        enable_shrink, comm: newer DeepEP options that this Buffer does not have: only their defaults
            (False, None) are accepted.
        timeout_s: deadline of every wait (``UBEP_TIMEOUT_S`` overrides).
        sync: Data-as-Flag variant for payload blocks: ``"tff"`` (default), ``"dc"``, ``"sp"`` or ``"sw"``.
        backend: ``"auto"`` (the C data path ``ubep_torch._native`` when it was built and ``UBEP_NATIVE`` is not
            ``0``, else the torch path), ``"native"`` (the C path, or RuntimeError when it is missing),
            ``"torch"`` (vectorized torch path) or ``"triton"`` (kernels of ``kernels/``); all give the same bits.
        cost_model: optional ``ubep_torch.cost_model.CostModel``: every call then gets a modeled CM384
            report (``last_report``: that of the latest collective call, made when the call completes, with a
            recv hook when the hook runs; None where that call made none: no cost model, its report failed,
            the call failed or was refused, or it is ``clean_low_latency_buffer``), UBEP against the CANN EP
            baseline.
        on_report: optional callback ``fn(kind, report)`` called with every report.
        num_max_tokens_per_rank, hidden: optional sizing of the normal region when ``num_nvl_bytes == 0``.
        shm_dir: shared-memory directory (default ``$UBEP_SHM_DIR`` or ``/dev/shm``).
        num_count_aivs: AIVs of the count group for ``backend="triton"`` (None = the Appendix-9 model;
            ``Config(num_count_aivs=...)`` overrides it per call).
        low_latency_buffers: receive buffers of each low-latency region, used in turn (2, as in DeepEP, up to
            8): how many low-latency calls can wait for their recv hook at once. Size ``num_rdma_bytes`` with
            ``get_low_latency_rdma_size_hint(..., num_buffers=low_latency_buffers)``.

    Attributes: ``backend`` (the engine the Buffer got: ``"native"``, ``"torch"`` or ``"triton"``),
    ``rank``, ``group_size``, ``sync``, ``timeout_s``, ``last_report`` (with a cost model).
    """

    num_sms: int = 20          # (DeepEP's default)

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, *, timeout_s: float = 60.0,
                 sync: str = "tff", backend: str = "auto", cost_model=None,
                 on_report: Optional[Callable] = None, num_max_tokens_per_rank: Optional[int] = None,
                 hidden: Optional[int] = None, shm_dir: Optional[str] = None,
                 num_count_aivs: Optional[int] = None, use_fabric: bool = False, enable_shrink: bool = False,
                 comm=None, low_latency_buffers: int = 2):
        with torch.inference_mode(False):   # the Buffer's memory is reused in any mode later: plain tensors
            try:
                if enable_shrink:
                    raise ValueError("enable_shrink=True (DeepEP's masking of failed ranks in low-latency mode) is "
                                     "not supported: a rank that fails makes its peers raise instead")
                if comm is not None:
                    raise ValueError("comm= (an MPI communicator for DeepEP's set-up) is not used: the Buffer "
                                     "sets up over its torch.distributed group; leave it None")
                self._init(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                           allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, timeout_s, sync,
                           backend, cost_model, on_report, num_max_tokens_per_rank, hidden, shm_dir, num_count_aivs,
                           low_latency_buffers)
            except Exception as e:
                # an error of this rank's own before the set-up (a bad argument, an engine that cannot be
                # made): the peers, waiting in the set-up's first step, are told; later errors the set-up's
                # own steps report to them
                if not getattr(self, "_heap_set_up", False):
                    refuse_setup(group, e)
                # (the set-up's errors name ranks of the group)
                name_global_ranks(e, _group_global_ranks(group), also=(ValueError, RuntimeError))
                raise

    def _init(self, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
              allow_nvlink_for_low_latency_mode, allow_mnnvl, explicitly_destroy, timeout_s, sync, backend,
              cost_model, on_report, num_max_tokens_per_rank, hidden, shm_dir, num_count_aivs,
              low_latency_buffers) -> None:
        if sync not in P.SYNC_MODES:
            raise ValueError(f"sync must be one of {P.SYNC_MODES}, got {sync!r}")
        _check_flags(low_latency_mode=low_latency_mode, explicitly_destroy=explicitly_destroy,
                     allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode, allow_mnnvl=allow_mnnvl)
        if num_count_aivs is not None:     # (a numpy integer too, as Config takes it)
            num_count_aivs = check_count("num_count_aivs", num_count_aivs, 1)
        if group is None:
            if not dist.is_initialized():
                raise ValueError("Buffer needs an initialized torch.distributed process group")
            group = dist.group.WORLD
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this process is not a member of the Buffer's group (new_group returned "
                             "NON_GROUP_MEMBER here)")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed process group, got {type(group).__name__}")
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the Buffer's group")
        num_nvl_bytes = check_count("num_nvl_bytes", num_nvl_bytes)
        num_rdma_bytes = check_count("num_rdma_bytes", num_rdma_bytes)
        if num_max_tokens_per_rank is not None:
            num_max_tokens_per_rank = check_count("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        if hidden is not None:
            hidden = check_count("hidden", hidden, 1)
        # (one of the pair alone, or the pair beside num_nvl_bytes, would be ignored: 256 MiB reserved, say)
        if (num_max_tokens_per_rank is None) != (hidden is None):
            given, missing = ("num_max_tokens_per_rank", "hidden") if hidden is None else \
                ("hidden", "num_max_tokens_per_rank")
            raise ValueError(f"{given} sizes the normal region together with {missing}: pass both (or neither, "
                             f"and num_nvl_bytes)")
        if num_max_tokens_per_rank is not None and num_nvl_bytes:
            raise ValueError(f"num_nvl_bytes={num_nvl_bytes} and num_max_tokens_per_rank/hidden both size the normal "
                             f"region: pass one of the two")
        # held weakly: a Buffer that lives until interpreter exit must not keep the process group alive
        # past destroy_process_group (gloo's threads would then be torn down during finalization)
        self._group_ref = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        # the order an exchange sends in: this rank first, then the next ranks round the ring
        self._send_order = [(self.rank + i) % self.group_size for i in range(self.group_size)]
        self._ctrl_seen: dict = {}    # (see _exchange_receive)
        self._fresh_skip = [0, 0]     # (see _steady_dispatch: one-step tries of new routings to skip, the next pause)
        self._fresh_tries = True      # (one-step exchanges for new routings: benchmarks/bench_checks.py turns it off)
        self._ll_one_step = True      # (low-latency receives in one engine call: bench_checks.py turns it off too)
        self._global_ranks = _group_global_ranks(group)   # (errors on a sub-group name these too)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.sync = sync
        self.timeout_s = P.default_timeout(timeout_s)
        P.spin_seconds()                    # (UBEP_SPIN_S checked before anything is created)
        shm_dir = ugas.shm_dir(shm_dir)     # (checked and normalised: every rank compares peers' paths to it)
        self.low_latency_buffers = _check_ll_buffers(low_latency_buffers, "low_latency_buffers")
        self.engine = make_engine(backend, num_count_aivs)
        self._default_n_count = getattr(self.engine, "n_count", None)   # includes UBEP_TRITON_COUNT_AIVS
        self._num_count_aivs = self._call_count_aivs = num_count_aivs  # the count group the cost model reports
        self.backend = self.engine.name
        self.cost_model = self.on_report = None
        self.set_cost_model(cost_model, on_report)
        self.last_report = None

        R = self.group_size
        if num_nvl_bytes == 0:
            if num_max_tokens_per_rank and hidden:
                num_nvl_bytes = normal_buffer_bytes(num_max_tokens_per_rank, hidden * 4, R)
            elif not self.low_latency_mode:
                num_nvl_bytes = _DEFAULT_NVL_BYTES
        if not self.low_latency_mode:
            num_rdma_bytes = 0
        self.num_nvl_bytes = int(num_nvl_bytes)
        self.num_rdma_bytes = int(num_rdma_bytes)

        # (how far a rank can run ahead of a peer that has not read its decision on a refused attempt: one
        # low-latency call per buffer half of each low-latency region, whose recv hooks are pending, one
        # refused attempt per other rank, and its own: see _post_decision)
        self._decide_slots = 2 * _MAX_LL_BUFFERS + R + 2
        aux = _round((_DECIDE_ROW + self._decide_slots) * R * 8, 4096)
        base = aux
        # normal dispatch and combine take turns in one region (see _Region): their rows never sit in the
        # slots together, and one set of slots stays warm in cache across a round trip
        # (each buffer is mapped whole, up to its next page: get_local_buffer_tensor views all of its bytes, as
        # DeepEP's does, though the regions use whole pages of it)
        nvl = self.num_nvl_bytes // 4096 * 4096
        normal = _Region(P.REGION_DISPATCH, base, nvl, R, R, halves=1)
        self._regions = {P.REGION_DISPATCH: normal, P.REGION_COMBINE: normal}
        base += _round(self.num_nvl_bytes, 4096)
        if self.num_rdma_bytes:
            half_ll = self.num_rdma_bytes // 2 // 4096 * 4096
            k = self.low_latency_buffers
            self._regions[P.REGION_LL_DISPATCH] = _Region(P.REGION_LL_DISPATCH, base, half_ll, R, R, halves=k)
            self._regions[P.REGION_LL_COMBINE] = _Region(P.REGION_LL_COMBINE, base + half_ll, half_ll, R, 1,
                                                         halves=k)
            base += _round(self.num_rdma_bytes, 4096)
        # each region's memory once, if it can take calls at all (a region too small for one slot takes
        # none, and its control words may lie in the next region's memory): what _same_call looks at
        self._call_regions = [r for r in dict.fromkeys(self._regions.values()) if r.part_bytes]
        self._heap_set_up = True     # (from here on the set-up tells the peers of its own errors)
        rank, abort_slot = self.rank, _ABORT_ROW * R + self.rank

        def left(heap: SymmetricHeap) -> None:
            # this rank's set-up failed in its last step, where peers may have completed theirs: its abort
            # word (left the set-up, before call 1) in their memory makes their first call fail at once
            for r in range(R):
                if r != rank:
                    heap.peer(r)[:aux].view(torch.int64).numpy()[abort_slot] = P.abort_word(P.ABORT_LEFT_SETUP, 0)
        self._heap = SymmetricHeap(group, base, directory=shm_dir, timeout_s=self.timeout_s, on_leave=left,
                                   agree={"num_nvl_bytes": self.num_nvl_bytes,
                                          "num_rdma_bytes": self.num_rdma_bytes,
                                          "low_latency_mode": self.low_latency_mode, "sync": sync,
                                          "low_latency_buffers": self.low_latency_buffers,
                                          **({"low_latency_rows": _ll_rows(self.engine)} if low_latency_mode
                                             else {})})
        # views of every rank's memory and aux words, made once; the aux words (acks, SyncAll counters,
        # abort flags) as numpy arrays, whose single-word loads and stores cost far less than a tensor's
        self._aux_words = self._heap.local[:aux].view(torch.int64).numpy()
        self._peer_mem = [self._heap.peer(r) for r in range(R)]
        self._peer_words = [m[:aux].view(torch.int64).numpy() for m in self._peer_mem]
        self._epoch = {region.rid: 0 for region in self._regions.values()}
        # a combine's control messages name the dispatch whose rows it returns as this tag | its call number:
        # the tag (from the heap's random group token, the same on every rank) tells Buffers apart, so ranks
        # that combine with handles of the same numbered call of two Buffers are caught too
        self._pair_tag = (int.from_bytes(self._heap.group_token[:4], "little") & 0x7FFFFFFF) << 32
        self._barriers: dict = {}      # call number -> SyncAll barriers it (and its recv hook) took so far
        self._broken: Optional[str] = None
        self._pending: List[_Pending] = []
        # (attempt, region of its epoch) of the call this rank refused last, until every peer has decided on it
        self._refusal: Optional[tuple] = None
        # (seq, region code, call) of the last attempt this rank took part in and left because a peer refused
        # it: a peer that came to it later as another kind of call is a mismatch this rank names too
        self._left_refused: Optional[tuple] = None
        self._cancel_point: Optional[dict] = None   # how to cancel the call in progress (see _cancel_call)
        self._ll_combine_buffer: Optional[torch.Tensor] = None    # flat; see get_next_low_latency_combine_buffer
        self._ll_combine_zeroed = 0
        # the latest handles of each mode, to recognise copies kept as plain tuples
        self._recent_handles: Deque["DispatchHandle"] = collections.deque(maxlen=_RECENT_HANDLES)
        self._recent_ll_handles: Deque["LowLatencyHandle"] = collections.deque(maxlen=_RECENT_HANDLES)
        # (through a weak reference: a Buffer dropped without destroy() is freed, and its shared memory
        # unmapped, as soon as the last reference goes, not when the cycle collector next runs)
        this = weakref.ref(self)
        self._waiter = P.Waiter(self.rank, self.timeout_s, self._heap.peer_alive,
                                lambda r: this()._peer_aborted(r) if this() is not None else P.ABORT_DESTROYED)
        self._waiter.world_size = R
        self._in_call = False
        self._pid = os.getpid()      # calls are refused in any other process (a fork's child)
        self._call_lock = threading.RLock()   # held by the thread inside a call (see _enter_call)
        self._calls = 0              # calls that reached their peers (the same count on every rank)
        self._begun = 0              # of those, the ones this rank made (not refused ones the peers cancelled)
        self._active_call = 0        # the call whose work runs now (a recv hook's own), named by aborts
        # attempts: the calls this rank made or refused, refused ones included whether or not a peer took part
        # (the same count on every rank once a refusal is settled: see _settle_refusal)
        self._seq = 0
        self._active_seq = 0         # the attempt whose work runs now (a recv hook's own)
        self._hook_seq = 0           # the attempt of the recv hook running now (0: none)
        self._destroyed = False
        self._out = TensorCache()   # output tensors are reused once the caller has dropped them
        self._layout_cache = None   # (num_experts, layout, routing snapshot, derived send lists) of the last routing
        self._dispatch_plan: Optional[_DispatchPlan] = None   # the last dispatch's checks (see _repeated_dispatch)
        self._combine_plan: Optional[tuple] = None   # the last plain combine's row format (see _repeated_combine)
        self.delay_hook: Optional[Callable[[str], None]] = None  # test-only: called at every protocol step
        self._wait_context: Optional[str] = None    # where the waits are, for their errors (see _waits_in)

    # ================================================================== housekeeping
    @property
    def group(self):
        """The process group this Buffer was built on (None once the Buffer, or the group, is destroyed)."""
        return None if self._destroyed else self._group_ref()

    def __del__(self):
        # a Buffer dropped without destroy() (its memory goes with it): peers that wait for it fail at once,
        # as after destroy(), instead of at their deadline (not at interpreter exit: a process that exits is
        # seen to be gone)
        try:
            if not self._destroyed and self._broken is None and self._pid == os.getpid() and not sys.is_finalizing():
                self._signal_abort(P.ABORT_DESTROYED)
        except Exception:  # noqa: BLE001  (a Buffer whose construction failed has nothing to tell)
            pass

    def destroy(self) -> None:
        """Release the shared memory (the segments are already unlinked; this unmaps them). A segment that
        a tensor still views (``get_local_buffer_tensor``, or a call waiting in another thread or under a
        signal handler that called this, which then raises ``UBEPBrokenError``) stays mapped until the last
        such tensor goes. In another process (a fork's child) it only releases that process's mappings: the
        Buffer and its peers go on in the process that built it."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._broken is None and self._pid == os.getpid():   # peers waiting for this rank fail at once
            self._signal_abort(P.ABORT_DESTROYED)
        self._peer_mem, self._peer_words = [], []
        self._aux_words = np.zeros_like(self._aux_words)   # (what a call still running reads from now on)
        for region in self._regions.values():
            region.forget_views()
        self.engine.forget()     # (its kept send phases view the peers' memory)
        self._ctrl_seen.clear()  # (and so do the engine's arguments kept with the messages, see _steady_combine)
        self._heap.close()

    def is_available(self) -> bool:
        """Whether the Buffer can take calls: not destroyed, and no earlier failure (timeout, lost or aborted
        peer, corrupted control message) has made it unusable."""
        return not self._destroyed and self._broken is None

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc_info) -> None:
        """``with Buffer(...) as buf:`` destroys the Buffer when the block ends, on an exception too (which
        then propagates)."""
        self.destroy()

    def __copy__(self) -> "Buffer":
        """The Buffer itself: it stands for this rank's memory and its peers', which a copy cannot have twice
        (``copy.deepcopy`` of a model with expert-parallel layers, for an EMA or evaluation copy, shares it, as
        copies share a process group)."""
        return self

    def __deepcopy__(self, memo) -> "Buffer":
        return self

    def __reduce__(self):
        raise TypeError(f"a ubep_torch.Buffer cannot be pickled or sent to another process (it maps this "
                        f"process's shared memory); save the model's state_dict, and build a Buffer in each "
                        f"process: {self!r}")

    def __repr__(self) -> str:
        try:
            state = "destroyed" if self._destroyed else f"broken ({self._broken})" if self._broken else \
                f"{self._calls} calls"
            regions = (f"normal {self.num_nvl_bytes / 2**20:.1f} MiB" if self.num_nvl_bytes else "no normal region") \
                + (f", low-latency {self.num_rdma_bytes / 2**20:.1f} MiB" if self.low_latency_mode else "")
            return (f"<ubep_torch.Buffer rank {self.rank} of {self.group_size}, {regions}, sync={self.sync!r}, "
                    f"backend={self.backend!r}, {state}>")
        except AttributeError:       # (a Buffer whose set-up failed)
            return "<ubep_torch.Buffer, not set up>"

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """DeepEP's SM count for the configs below; recorded (and checked: positive and even, as in DeepEP)
        only, as no SMs exist here."""
        n = check_count("num_sms", new_num_sms, 1)
        if n % 2:
            raise ValueError(f"num_sms must be even (DeepEP runs its channels in SM pairs), got {n}")
        Buffer.num_sms = n

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: what DeepEP's SM90 build adds (fp8 dispatch and low-latency mode) is available here; DeepEP's
        tests check this before their fp8 cases."""
        return True

    def get_num_rdma_ranks(self) -> int:
        """1: every rank of the group shares one host's memory, as the NVLink ranks of one node in DeepEP."""
        return 1

    def get_rdma_rank(self) -> int:
        """0: this rank's node among the RDMA ranks (see ``get_num_rdma_ranks``)."""
        return 0

    @staticmethod
    def capture() -> EventOverlap:
        """An event for ``previous_event=`` arguments, as in DeepEP: ``EventOverlap(EventHandle())`` (calls
        complete before they return, so there is nothing to wait for)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A ``Config`` for dispatch (``get_nvl_buffer_size_hint`` sizes ``num_nvl_bytes``)."""
        check_count("num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms, 6, 4096)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A ``Config`` for combine, as ``get_dispatch_config``."""
        check_count("num_ranks", num_ranks, 1)
        return Config(Buffer.num_sms, 6, 4096)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int, *, num_buffers: int = 2) -> int:
        """Bytes of ``num_rdma_bytes`` for low-latency calls of this shape (top-k up to 16), with
        ``num_buffers`` receive buffers used in turn (two, as in DeepEP; ``low_latency_buffers`` of the
        constructor)."""
        return low_latency_buffer_bytes(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts,
                                        num_buffers=num_buffers)

    def set_cost_model(self, cost_model, on_report: Optional[Callable] = None) -> None:
        """Enable (or with None disable) per-call CM384 latency reports: ``cost_model`` has a
        ``report(kind, rank, num_ranks, topk_idx, num_experts, hidden, bytes_per_token, sync=...)`` method
        (``ubep_torch.cost_model.CostModel``); ``on_report(kind, report)``, when given, gets every report.
        Each call sets both: one without ``on_report`` leaves no callback."""
        if cost_model is not None and not callable(getattr(cost_model, "report", None)):
            raise TypeError(f"cost_model must have a report() method (ubep_torch.cost_model.CostModel), got "
                            f"{type(cost_model).__name__}")
        if on_report is not None and not callable(on_report):
            raise TypeError(f"on_report must be callable, got {type(on_report).__name__}")
        _check_count_aivs(getattr(self, "_num_count_aivs", None), cost_model, "num_count_aivs")
        self.cost_model = cost_model
        self.on_report = on_report

    def get_local_buffer_tensor(self, dtype: torch.dtype = torch.uint8, size=None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """As in DeepEP: this rank's normal-mode buffer (``use_rdma_buffer``: its low-latency one), a view of
        its shared memory from byte ``offset`` on, as ``dtype``, shaped ``size`` (None: a flat tensor to the
        end of the buffer). For inspection and tests: the peers write into it."""
        if self._destroyed:
            raise UBEPBrokenError("ubep_torch: this Buffer was destroyed")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        _check_flags(use_rdma_buffer=use_rdma_buffer)
        if use_rdma_buffer:
            region = self._regions.get(P.REGION_LL_DISPATCH)
            start, nbytes = (region.ctrl_base, self.num_rdma_bytes) if region is not None else (0, 0)
        else:
            start, nbytes = self._regions[P.REGION_DISPATCH].ctrl_base, self.num_nvl_bytes
        if isinstance(size, numbers.Integral) and not isinstance(size, bool):
            size = (size,)
        if size is not None and not isinstance(size, (tuple, list, torch.Size)):
            raise TypeError(f"size must be a torch.Size (or a tuple of ints), got {type(size).__name__}")
        offset = check_count("offset", offset)      # (an empty buffer gives empty views, as in DeepEP)
        item = dtype.itemsize
        if offset % item or offset > nbytes:
            raise ValueError(f"offset {offset} must be a multiple of {item} (the size of {dtype}) within the "
                             f"buffer's {nbytes} bytes")
        flat = self._heap.local[start + offset:start + nbytes - (nbytes - offset) % item].view(dtype)
        if size is None:
            return flat
        shape = tuple(check_count("size", d) for d in size)
        n = math.prod(shape)
        if n > flat.numel():
            raise ValueError(f"size {shape} needs {n * item} bytes from offset {offset}; the buffer has "
                             f"{nbytes - offset}")
        return flat[:n].view(shape)

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if self._destroyed:
            raise UBEPBrokenError("ubep_torch: this Buffer was destroyed")
        if self._broken is not None:
            raise UBEPBrokenError(f"ubep_torch: this Buffer is unusable after an earlier failure: {self._broken}")

    def _apply_config(self, config: Optional[Config]) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a ubep_torch.Config, got {type(config).__name__}")
        given = config.num_count_aivs if config is not None and config.num_count_aivs else None
        _check_count_aivs(given, self.cost_model, "Config(num_count_aivs)")
        self._call_count_aivs = given or self._num_count_aivs
        if hasattr(self.engine, "n_count"):
            self.engine.n_count = given or self._default_n_count

    def _region(self, rid: int) -> _Region:
        if rid not in self._regions:
            raise ValueError("low-latency calls need Buffer(..., low_latency_mode=True, num_rdma_bytes="
                             "Buffer.get_low_latency_rdma_size_hint(N, H, R, E))")
        return self._regions[rid]

    def _ll_bytes(self, N: int, H: int, E: int, K: int = _LL_MAX_TOPK) -> str:
        """``num_rdma_bytes`` that low-latency calls of this shape need with this Buffer's receive buffers, as
        an error message gives it."""
        k = self.low_latency_buffers
        need = low_latency_buffer_bytes(N, H, self.group_size, E, K, num_buffers=k)
        return f"{need}" + ("" if k == 2 else f" (for low_latency_buffers={k}: Buffer.get_low_latency_rdma_size_hint("
                                                f"..., num_buffers={k}))")

    def _ack_slot(self, mem_words: torch.Tensor, rid: int, src: int) -> torch.Tensor:
        return mem_words[rid * self.group_size + src: rid * self.group_size + src + 1]

    @contextlib.contextmanager
    def _waits_in(self, where: str):
        """The errors of the waits inside this block say ``where`` after their phase ("in its recv hook", "in
        the backward of ubep_torch.functional.combine"): a wait there belongs to a call the user made earlier
        (a recv hook's) or did not make by that name (a backward's)."""
        outer = self._wait_context
        self._wait_context = where if outer is None else f"{outer}, {where}"
        try:
            yield
        finally:
            self._wait_context = outer

    def _wait(self, phase: str, poll: Callable[[], Sequence[int]]) -> None:
        if self.delay_hook is not None:
            self.delay_hook(phase)
        if self._wait_context is not None:      # (the phase the errors name; the delay hook gets the plain one)
            phase = f"{phase}, {self._wait_context}"
        try:
            if not self._destroyed and not poll():    # (most waits are over at the first poll)
                return
        except UBEPError as e:
            if not self._cancel_call(e):
                self._fail(e)
            raise

        def poll_unless_destroyed():   # (destroy() from a signal handler or another thread ends the wait)
            if self._destroyed:
                raise UBEPBrokenError(f"ubep_torch: rank {self.rank}: this Buffer was destroyed while waiting in "
                                      f"phase '{phase}'")
            return poll()
        try:
            self._waiter.wait(phase, poll_unless_destroyed)
        except UBEPError as e:
            if isinstance(e, UBEPPeerAbortedError) and not e.refused and e.aborted_ranks:
                # (a peer may have aborted an earlier call that this rank completed: its data was all there)
                e.name_call(self._abort_when(e.aborted_ranks, self._active_call))
            if not self._cancel_call(e):
                self._fail(e)
            raise

    def _ack_base(self, rid: int, half: int) -> int:
        return (self._regions[rid].rid * _MAX_LL_BUFFERS + half) * self.group_size

    def _wait_acks(self, rid: int, epoch: int) -> None:
        """Before writing call ``epoch`` into a half of every peer: they consumed the call that used it last.

        Acks are kept per half, so recv hooks completed in any order never move an ack backwards."""
        region = self._regions[rid]
        need = epoch - region.halves
        if need <= 0:
            return
        words = self._aux_words
        R = self.group_size
        half = epoch % region.halves
        base = self._ack_base(rid, half)
        if self.delay_hook is None and min(words[base:base + R].tolist()) >= need:
            return            # (the usual case: every peer consumed that half long ago)

        def poll():
            acks = words[base:base + R].tolist()
            return [r for r in range(R) if acks[r] < need]
        self._wait(f"{P.REGION_NAMES[rid]}: waiting for peers to consume the previous call's rows "
                   f"(buffer half {half})", poll)

    def _send_ack(self, rid: int, src: int, epoch: int) -> None:
        """Tell ``src`` that this rank has consumed its call-``epoch`` rows (that half may be reused)."""
        self._send_acks(rid, (src,), epoch)

    def _send_acks(self, rid: int, sources, epoch: int) -> None:
        """``_send_ack`` to every rank in ``sources``, after one fence."""
        at = self._ack_base(rid, self._regions[rid].half(epoch)) + self.rank
        P.memory_fence()
        for src in sources:
            self._peer_words[src][at] = epoch

    def _wait_ctrl(self, region: "_Region", half: int, nctrl: int, flag: int, phase: str) -> dict:
        """Wait (with the deadline) for every source's control message of this call; returns their words
        (``{source: [int, ...]}``: control data is read once, then handled as Python ints)."""
        local, eng, words = self._heap.local, self.engine, {}
        # (the engine's poller of these blocks, made once: the memory is mapped for the Buffer's life)
        poller = region.kept((local.data_ptr(), half, "poller", nctrl),
                             lambda: eng.ctrl_poller(region.ctrl_sources(local, half), nctrl))
        if poller is not None:   # every source at once
            got = [None] * self.group_size
            if self.delay_hook is None and not self._destroyed and not poller(flag, got):
                return dict(enumerate(got))       # (the usual case: every message is there at the first poll)
        polls = count()

        def same_call(missing):   # (the other regions too once the wait lasts: see _same_call)
            return self._same_call(region, half, flag, missing, next(polls) >= _POLLS_BEFORE_REGION_CHECK, phase)
        if poller is not None:
            self._wait(phase, lambda: same_call(poller(flag, got)))
            return dict(enumerate(got))

        def poll():
            missing = []
            for s in range(self.group_size):
                if s not in words:
                    c = region.ctrl(local, half, s, nctrl)
                    if eng.ctrl_arrived(c, flag):
                        words[s] = eng.read_ctrl_words(c)
                    else:
                        missing.append(s)
            return same_call(missing)
        self._wait(phase, poll)
        return words

    def _same_call(self, region: "_Region", half: int, flag: int, missing: List[int],
                   all_regions: bool = False, phase: str = "") -> List[int]:
        """``missing``, the sources whose control message of this call (``flag``) has not arrived, unless one
        of them is in another operation: a mismatch, raised at once instead of at the deadline.

        Normal dispatch and combine share their region and its epochs, so a message of this call's epoch
        and another kind (a rank that skipped a combine, or combined twice) is one. With ``all_regions``,
        so is a message of a later epoch than this rank has reached in any region (a rank in a low-latency
        call where this one is in a normal call, say): a source whose control message of this call is
        missing has not started this call, so all the calls it made are ones this rank made too, unless
        the ranks' calls differ."""
        if not missing:
            return missing
        local = self._heap.local
        heads = region.ctrl_heads(local, half)[missing].tolist()
        other = {s: h & 0xFF for s, h in zip(missing, heads) if h >> 8 == flag >> 8 and h != flag}
        if all_regions and not other:
            # (a source in a SyncAll of this call in another operation: clean_low_latency_buffer, which sends
            # no control message)
            other = self._barriers_of_other_kind(missing, flag & 0xFF)
        if all_regions and not other:
            ahead = self._calls_ahead(missing)
            # (``missing`` was polled before those loads: a source may have sent this call's message and
            # moved on to its next call since. A source stores its messages in call order, and these loads
            # happen in program order, so this call's message is visible now if it was sent before those.)
            now = region.ctrl_heads(local, half)[list(ahead)].tolist() if ahead else []
            other = {s: k for (s, k), head in zip(ahead.items(), now) if head >> 8 != flag >> 8}
        if other:
            self._raise_mismatch(flag & 0xFF, other, phase, missing)
        return missing

    def _calls_ahead(self, missing: List[int]) -> dict:
        """``{source: operation}`` for the sources in ``missing`` that sent a control message of a later epoch
        than this rank has reached in its region: they made a call this rank has not made (yet)."""
        local, ahead = self._heap.local, {}
        for r in self._call_regions:
            reached = self._epoch[r.rid]
            for h in range(r.halves):
                for s, head in zip(missing, r.ctrl_heads(local, h)[missing].tolist()):
                    if head >> 8 > reached:
                        ahead.setdefault(s, head & 0xFF)
        return ahead

    def _barriers_of_other_kind(self, missing: List[int], kind: int) -> dict:
        """``{source: operation}`` for the sources in ``missing`` that stored a SyncAll word of this call for
        another operation than ``kind`` (see ``_sync_all``)."""
        call, R = self._active_call, self.group_size
        off = (_SYNC_ROW + call % _SYNC_SLOTS) * R
        return _other_barriers(self._aux_words[off:off + R].tolist(), missing, call, kind)

    def _raise_mismatch(self, kind: int, other: dict, phase: str, missing: Sequence[int]) -> None:
        """The operation-mismatch error (breaking the Buffer): this rank's call is operation ``kind``, the
        sources in ``other`` are in the operations it names."""
        # (a rank that refused this attempt and went on with its next call: the refusal is the cause)
        self._raise_if_refused(phase, missing, other)
        # a rank that refused this attempt as another kind of call than this rank's: that mismatch is named
        # (and this rank's decision posted, which the refusing rank waits for)
        refusers = [r for r in range(self.group_size) if self._refused_by(r, self._active_seq)]
        if refusers:
            code = self._leave_refused()
            for r in refusers:
                self._refused_as_other_call(r, self._active_seq, code, self._active_call)
        op = P.REGION_NAMES.get(kind, str(kind))
        theirs = ", ".join(f"rank {s} called {P.REGION_NAMES.get(k, 'another operation')}"
                           for s, k in sorted(other.items()))
        self._broken = f"operation mismatch with rank(s) {sorted(other)}"
        raise UBEPMismatchError(f"ubep_torch: rank {self.rank} called {op} as call {self._active_call} of this "
                                f"Buffer, but {theirs}: every rank must make the same calls in the same order")

    def _sync_all(self, phase: str, kind: int) -> None:
        """SyncAll emulation for the "sw" baseline (and ``clean_low_latency_buffer``): a barrier through shared
        memory, not through gloo. ``kind`` is the call's operation (its region id, ``P.REGION_BARRIER`` for
        ``clean_low_latency_buffer``).

        Barriers are counted per call (a recv hook's with its own call's): the i-th barrier of call c waits
        until every rank stored ``c << 24 | kind << 20 | i`` or more in the row of call c. So a barrier never
        pairs with one of another call, whichever order ranks run recv hooks and calls in (every rank must
        still reach the same barrier: with sync="sw" ranks run their hooks at the same point of their calls,
        see the README), and a call cancelled on every rank (see ``_cancel_call``) leaves nothing out of
        step: no rank waits in its row again. A rank whose word of call c names another operation is in
        another call than this one: an operation mismatch, raised at once (``clean_low_latency_buffer`` on
        one rank and ``low_latency_dispatch`` on another would pair their barriers otherwise).
        ``clean_low_latency_buffer`` has no control message for its peers to see, so its wait also looks for
        ranks that made a call it has not (``_calls_ahead``)."""
        call = self._active_call
        index = self._barriers.get(call, 0) + 1
        if index >= 1 << _BARRIER_KIND_SHIFT:
            raise UBEPError(f"{phase}: more than {(1 << _BARRIER_KIND_SHIFT) - 1} SyncAll barriers in one call (its "
                            f"exchanges: tokens over the rows a source's slots hold); give the Buffer more "
                            f"num_nvl_bytes")
        self._barriers[call] = index
        if len(self._barriers) > 2 * _SYNC_SLOTS:
            self._barriers = {c: i for c, i in self._barriers.items() if c > call - _SYNC_SLOTS}
        word = call << 24 | kind << _BARRIER_KIND_SHIFT | index
        R = self.group_size
        off = (_SYNC_ROW + call % _SYNC_SLOTS) * R
        for r in range(R):     # (never lowered: a hook run _SYNC_SLOTS calls late shares a later call's row)
            words_r = self._peer_words[r]
            if words_r[off + self.rank] < word:
                words_r[off + self.rank] = word
        words = self._aux_words
        polls = count()
        look_ahead = kind == P.REGION_BARRIER

        def poll():
            vals = words[off:off + R].tolist()
            missing = [r for r in range(R) if vals[r] < word]
            other = _other_barriers(vals, range(R), call, kind)
            if not other and missing and look_ahead and next(polls) >= _POLLS_BEFORE_REGION_CHECK:
                ahead = self._calls_ahead(missing)
                # (as in ``_same_call``: a rank may have stored its word and moved on since ``vals`` was read)
                now = words[off:off + R].tolist()
                other = {r: k for r, k in ahead.items() if now[r] < word}
            if other:
                self._raise_mismatch(kind, other, phase, missing)
            return missing
        self._wait(phase, poll)

    def _check_layouts(self, ctrl_words: dict, fmt: P.RowFormat, op: str) -> None:
        """Every source's rows have this rank's layout (the digest in its control message), else the Buffer is
        broken with a UBEPError naming the ranks whose rows differ."""
        sig = fmt.signature()
        other = [s for s in range(self.group_size) if ctrl_words[s][P.CTRL_SIGNATURE] != sig]
        if other:
            self._broken = f"layout mismatch with rank(s) {other}"
            raise UBEPMismatchError(
                f"rank(s) {other} sent {op} rows of a different layout than rank {self.rank} expects (hidden size, "
                f"dtype, top-k, the weights' dtype, fp8 (or its scales' dtype and width) or sync mode differ between "
                f"ranks; or the ranks are in different calls of the same operation, as in backward passes of "
                f"ubep_torch.functional where topk_weights require grad on some ranks only)")

    def _check_call_words(self, ctrl_words, op: str) -> None:
        """Every source's control message names the same num_experts and num_max_dispatch_tokens_per_rank as
        this rank's own (a disagreement no single rank can see in its inputs)."""
        me = self.rank
        for word, name in ((P.CTRL_NUM_EXPERTS, "num_experts"),
                           (P.CTRL_MAX_TOKENS, "num_max_dispatch_tokens_per_rank")):
            for s in range(self.group_size):
                if ctrl_words[s][word] != ctrl_words[me][word]:
                    self._broken = f"{name} mismatch with rank {s}"
                    raise UBEPMismatchError(f"rank {s} called {op} with {name}={ctrl_words[s][word]}, rank {me} "
                                            f"with {ctrl_words[me][word]}: every rank must pass the same")

    def _check_pairing(self, op: str, ctrl_words, pair: int) -> None:
        """Every source's combine returns the rows of the dispatch that this rank's does (``pair``: the
        dispatching Buffer's tag | its call number, see ``_pair_tag``; 0 where a handle does not know it).
        Calls pair up in order, so ranks combining different dispatches' handles would sum each other's rows
        of the wrong tokens."""
        for s in range(self.group_size):
            theirs = ctrl_words[s][P.CTRL_PAIRED_CALL]
            if pair and theirs and theirs != pair:
                self._broken = "combine of another dispatch"

                def name(word: int) -> str:
                    return f"call {word & 0xFFFFFFFF}" + ("" if word >> 32 == self._pair_tag >> 32 else
                                                          " of another Buffer")
                raise UBEPMismatchError(f"{op} on rank {self.rank}: rank {s} combines the rows of the dispatch of "
                                        f"{name(theirs)}, this rank those of {name(pair)}: every rank must pass the "
                                        f"handle of the same dispatch")

    def _call_complete(self, op: str) -> None:
        """This rank has sent and consumed everything of the current call: an error in the local work that
        follows (layout conversion, output checks) is raised without breaking the Buffer or the peers."""
        self._check_peers(op, self._calls)
        self._in_call = False

    def _check_peers(self, op: str, call: int, where: str = "end of the call") -> None:
        """Raise ``UBEPPeerAbortedError`` (phase ``"{op}: {where}"``) if a peer has failed or given up in call
        number ``call`` of this Buffer (see ``_next_epoch``) or an earlier one. Waits see that while they
        wait; this is for a rank too slow for its peers' deadline that still finds everything it needs there:
        it fails at the end of that call or at the start of its next one instead of returning results its
        peers have abandoned."""
        words = self._abort_words()
        if not any(words):
            return
        left = [r for r, w in enumerate(words) if r != self.rank and P.abort_how(w) == P.ABORT_LEFT_SETUP]
        if left:     # (a rank without a Buffer: every call waits for it, and it is the cause of any abort)
            cause = P.GONE_CAUSES[P.ABORT_LEFT_SETUP]
            self._broken = f"peer rank(s) {left} {cause}"
            raise UBEPPeerLostError(f"{op}: {where}", self.rank, left, left, cause=cause)
        hows = {r: P.abort_how(w) for r, w in enumerate(words) if r != self.rank and P.abort_call(w) <= call}
        aborted = P.blamed(hows)
        if aborted:
            self._mismatch_in_left_call()
            when = self._abort_when(aborted, call)
            self._broken = f"peer rank(s) {aborted} aborted {when}"
            raise UBEPPeerAbortedError(f"{op}: {where}", self.rank, [], aborted, when=when,
                                       mismatch=P.mismatch_only(hows, aborted))

    def _nothing_to_settle(self) -> bool:
        """The usual start of a call: no refusal of this rank's to settle, no recv hook pending, no peer
        that refused the coming attempt and no peer's abort word, so that ``_settle_refusal``,
        ``_refused_as_other_ahead`` and ``_check_peers`` have nothing to do (each word read in one load)."""
        if self._refusal is not None or self._pending:
            return False
        return not any(self._abort_words()) and not self._refused_by_any(self._seq + 1)

    def _abort_words(self) -> List[int]:
        """Every rank's abort word (see ``_signal_abort``), read in one load."""
        base = _ABORT_ROW * self.group_size
        return self._aux_words[base:base + self.group_size].tolist()

    def _abort_when(self, ranks: List[int], call: int) -> str:
        """Which calls the abort words of ``ranks`` name, as seen from call number ``call`` of this rank."""
        base = _ABORT_ROW * self.group_size
        calls = {r: P.abort_call(int(self._aux_words[base + r])) for r in ranks}
        if len(set(calls.values())) > 1:
            each = ", ".join(f"{m} (rank {r})" for r, m in calls.items())
            return f"calls {each} of this Buffer (this is call {call})"
        m = next(iter(calls.values()))
        if m == call:
            return "this call"
        return f"{'an earlier' if m < call else 'a later'} call (call {m} of this Buffer; this is call {call})"

    def _begin_call(self) -> None:
        """From here on, peers may be waiting for this rank. The first time in a call this numbers the call in
        ``_calls`` (only calls that reach their peers count; every rank makes the same ones, so the numbers
        agree) and the attempt in ``_seq``."""
        if not self._in_call:
            if self._refusal is not None:
                self._settle_refusal()
            self._begun += 1
            self._calls += 1
            self._seq += 1
            self._active_call = self._calls
            self._active_seq = self._seq
            if self._pending:
                self._cancel_refused_hooks()
        self._in_call = True

    def _refuse(self, what: str) -> None:
        """An error in a collective call (bad input, a failed allocation: see ``errors.refusal``), or in a step
        that leads to one (``get_dispatch_layout``, ``ubep_torch.functional``), before it reached the peers:
        this rank refuses the attempt its peers may be waiting in, and tells them (``_post_decision``); ``what``
        names the call (or step). The attempt is cancelled on every rank, always: a peer that waits in it
        leaves it at once with ``UBEPPeerAbortedError`` (``cancelled``), and this rank's next call is the
        next one on every rank (``_settle_refusal``). Only the process that built the Buffer, and not while
        another thread is inside a call (its call is the one the peers wait in)."""
        if self._pid != os.getpid() or not self._call_lock.acquire(blocking=False):
            return
        try:
            if not self._destroyed and self._broken is None and not self._in_call:
                try:
                    self._settle_refusal()
                except UBEPError:     # (the Buffer is broken and says why at its next call)
                    return
                self._seq += 1
                rid = _REFUSED_REGION[what]
                self._post_decision(self._seq, self._region_code(rid), gave_up=False)
                self._refusal = (self._seq, rid)
        finally:
            self._call_lock.release()

    def _post_decision(self, seq: int, region_code: int, gave_up: bool) -> None:
        """Write into every peer's memory what this rank did with attempt ``seq``: refused it, or (``gave_up``)
        took part in it and left it because a peer refused it. ``region_code``: the region whose epoch the
        call takes (see ``_region_code``), so that ranks in different operations are caught.

        A rank decides once per attempt and never takes a decision back, so a peer reads it whenever it
        looks. Rows are kept per attempt modulo ``_decide_slots``, which must exceed how far a rank can run
        ahead of a peer that has not yet read its decision: every call but one with a recv hook waits for
        every peer, so only attempts refused by some rank (each rank refuses one before its next call waits
        for every peer's decision on it) and calls with pending hooks (at most one per buffer half of each
        low-latency region: a call whose half is held is refused) come between."""
        R = self.group_size
        word = seq << 5 | region_code << 1 | int(gave_up)
        slot = (_DECIDE_ROW + seq % self._decide_slots) * R + self.rank
        for r in range(R):
            if r != self.rank:
                self._peer_words[r][slot] = word

    def _decision(self, r: int, seq: int) -> Optional[int]:
        """Rank r's decision word on attempt ``seq`` (see ``_post_decision``), or None: it has not decided."""
        if seq <= 0:          # (attempts count from 1: an empty row decides nothing)
            return None
        w = int(self._aux_words[(_DECIDE_ROW + seq % self._decide_slots) * self.group_size + r])
        return w if w >> 5 == seq else None

    def _refused_by(self, r: int, seq: int) -> bool:
        w = self._decision(r, seq) if r != self.rank else None
        return w is not None and not w & 1

    def _refused_by_any(self, seq: int) -> bool:
        """Whether a peer refused attempt ``seq`` (``_refused_by`` of every peer, their words read in one
        load)."""
        R, me = self.group_size, self.rank
        row = (_DECIDE_ROW + seq % self._decide_slots) * R
        return seq > 0 and any(w >> 5 == seq and not w & 1
                               for r, w in enumerate(self._aux_words[row:row + R].tolist()) if r != me)

    def _settle_refusal(self) -> None:
        """Before this rank's next call (or refusal) after refusing attempt S: wait until every peer has
        decided on S, refused it too or taken part and left it (``_post_decision``). If any peer took part,
        S was a call on every rank, cancelled: this rank counts it too, moves its region's epoch past it and
        acknowledges the rows peers sent in it. If every rank refused S, no rank took part and no call
        happened (the usual case of bad input passed everywhere). Every rank sees the same decisions, so all
        count the same calls and epochs. A peer that took part in another kind of call than this rank refused
        raises ``UBEPError`` and breaks the Buffer, as any operation mismatch does."""
        if self._refusal is None:
            return
        seq, rid = self._refusal
        R, me = self.group_size, self.rank
        outer, self._active_seq = self._active_seq, 0     # (no attempt's work runs here: see _peer_aborted)
        # (an abort this wait signals names the call the refused attempt is on the peers that took part in it,
        # not this rank's last completed call)
        outer_call, self._active_call = self._active_call, self._calls + 1
        own = self._region_code(rid)

        def undecided():
            """The peers yet to decide on ``seq``; none once one of them took part in another kind of call
            (a mismatch: the others may abort before deciding, and the mismatch is the cause to name)."""
            words = [self._decision(r, seq) if r != me else None for r in range(R)]
            if any(w is not None and w & 1 and w >> 1 & 15 != own for w in words):
                return []
            return [r for r in range(R) if r != me and words[r] is None]
        try:
            self._wait(f"the start of the next call: waiting for every rank to leave attempt {seq}, which rank "
                       f"{me} refused", undecided)
        except BaseException as e:
            # an interrupt (Ctrl-C) of this wait: the peers' count of calls may now differ from this rank's, as
            # after an interrupt inside a call, so this Buffer is done (and posting this call as refused would
            # start this wait again)
            if not isinstance(e, UBEPError):
                self._fail(e)
            raise
        finally:
            self._active_seq, self._active_call = outer, outer_call
        self._refusal = None
        decisions = {r: self._decision(r, seq) for r in range(R) if r != me}
        gave_up = {r: w >> 1 & 15 for r, w in decisions.items() if w is not None and w & 1}
        if not gave_up:
            return
        other = {s: k for s, k in gave_up.items() if k != own}
        if other:   # (the peers were in another kind of call: moving this rank's region would not match)
            self._broken = f"operation mismatch with rank(s) {sorted(other)}"
            # (the abort names the refused call: the earlier ones, whose recv hooks may be pending, stand)
            self._signal_abort(call=self._calls + 1)
            raise UBEPMismatchError(f"ubep_torch: rank {me} refused call {self._calls + 1} of this Buffer as "
                                    f"{_operation(own)}, but " + ", ".join(
                                        f"rank {s} was in {_operation(k)}" for s, k in sorted(other.items()))
                                    + ": every rank must make the same calls in the same order")
        self._calls += 1
        epoch = None
        if rid is not None and rid in self._regions:
            epoch = self._next_epoch_number(rid)
        self._cancel_done(rid, epoch)

    def _region_code(self, rid: Optional[int]) -> int:
        """The region whose epoch a call of region ``rid`` takes, as 4 bits (15: none, a barrier-only call)."""
        return 15 if rid is None else self._regions[rid].rid if rid in self._regions else rid

    def _cancel_done(self, rid: Optional[int], epoch: Optional[int]) -> None:
        """A call is cancelled on every rank; on this one it took ``epoch`` of region ``rid`` (None: none).
        Acknowledge every source's rows of that epoch (this rank will not read them: the peers may reuse
        that half)."""
        if epoch is not None:
            self._send_acks(rid, range(self.group_size), epoch)

    def _next_epoch(self, rid: int) -> int:
        """The next epoch of region ``rid`` (see ``_begin_call``)."""
        self._begin_call()
        epoch = self._next_epoch_number(rid)
        self._cancel_point = {"call": self._active_call, "rid": rid, "epoch": epoch, "sent": []}
        return epoch

    def _next_epoch_number(self, rid: int) -> int:
        rid = self._regions[rid].rid      # (normal combine counts in the region it shares with dispatch)
        self._epoch[rid] += 1
        return self._epoch[rid]

    def _peer_aborted(self, r: int) -> int:
        """0, or how rank r aborted: ``P.ABORT_FAILED``, ``P.ABORT_GAVE_UP``, ``P.ABORT_DESTROYED`` or
        ``P.ABORT_LEFT_SETUP``; or
        ``P.ABORT_REFUSED`` when it refused the attempt this rank is in (this rank then leaves it: see
        ``_leave_refused``). Recv hooks still pending for attempts r refused are cancelled on the way
        (``_cancel_refused_hooks``): r waits for this rank to leave them before its next call."""
        if r == self.rank:
            return 0
        self._cancel_refused_hooks([r])
        if self._refused_by(r, self._active_seq):
            self._refused_as_other_call(r, self._active_seq, self._leave_refused(), self._active_call)
            return P.ABORT_REFUSED
        how = P.abort_how(int(self._aux_words[_ABORT_ROW * self.group_size + r]))
        if how in (P.ABORT_FAILED, P.ABORT_GAVE_UP, P.ABORT_MISMATCH):
            self._mismatch_in_left_call()
        return how

    def _leave_refused(self) -> Optional[int]:
        """A peer refused the attempt this rank is in: tell every peer that this rank took part and leaves
        it, and mark the call cancellable (``_cancel_call``). Returns the region code of this rank's call
        (None where the call has not taken its region yet)."""
        cp = self._cancel_point
        code = None
        if cp is not None and cp["call"] == self._active_call:
            cp["refused"] = True
            code = self._region_code(cp["rid"])
            self._left_refused = (self._active_seq, code, self._active_call)
        self._post_decision(self._active_seq, 15 if code is None else code, gave_up=True)
        return code

    def _mismatch_in_left_call(self) -> None:
        """Before this rank reports a peer's abort: if it left a refused call as cancelled (as the refusing
        rank's peers in the same kind of call do) and a peer came to that call later as another kind, the
        peers' aborts come from that mismatch, which is named instead (UBEPError)."""
        if self._left_refused is None:
            return
        seq, code, call = self._left_refused
        r = self._other_kind(seq, code)
        if r is not None:
            self._left_refused = None
            self._refused_as_other_call(r, seq, code, call)

    def _other_kind(self, seq: int, code: int) -> Optional[int]:
        """A peer whose decision on attempt ``seq`` (refused, or took part and left) names another kind of
        call than region ``code``, the refusing peers first; else None."""
        for r in sorted(range(self.group_size), key=lambda r: not self._refused_by(r, seq)):
            w = self._decision(r, seq) if r != self.rank else None
            if w is not None and w >> 1 & 15 != code:
                return r
        return None

    def _refused_as_other_ahead(self, what: str) -> None:
        """At the start of call ``what``: the mismatch, if a peer refused this call, or a call whose recv
        hook is pending here, as another kind of call (or took part in a refused one as another kind). A
        rank that comes late to such a call names the mismatch, as the ranks that were in it do, before it
        sends anything a peer could take for its call, and before it reads the aborts of those that failed
        on it."""
        self._cancel_refused_hooks()        # (raises the mismatch for a pending hook's call)
        seq = self._seq + 1
        if not self._refused_by_any(seq):
            return
        # a peer refused the coming call: the mismatch is the refusal's, or that of a peer that took part in
        # it as another kind of call than this one
        code = self._region_code(_REFUSED_REGION[what])
        r = self._other_kind(seq, code)
        if r is not None:
            self._post_decision(seq, code, gave_up=True)       # (the refusing rank waits for it)
            try:
                self._refused_as_other_call(r, seq, code, self._calls + 1)
            except UBEPError:
                self._signal_abort(call=self._calls + 1)      # (ranks that went on wait for this one)
                raise

    def _refused_as_other_call(self, r: int, seq: int, code: Optional[int], call: int) -> None:
        """Rank r refused attempt ``seq`` as another kind of call than this rank's (region ``code``): an
        operation mismatch, which breaks the Buffer on every rank: r finds it when it settles its refusal,
        from the decision this rank posted, and every other rank of the attempt as this one does, also one
        that comes to it after this rank has aborted (``_refused_as_other_ahead``). Raises ``UBEPError``
        naming both; else nothing."""
        w = self._decision(r, seq)
        theirs = None if w is None else w >> 1 & 15
        if code is None or theirs is None or theirs == code:
            return
        self._broken = f"operation mismatch with rank {r}"
        did = f"was in {_operation(theirs)} in that call, which a peer refused" if w & 1 else \
            f"refused that call as {_operation(theirs)}"
        raise UBEPMismatchError(f"ubep_torch: rank {self.rank} was in {_operation(code)} (call {call} of this "
                                f"Buffer), but rank {r} {did}: every rank must make the same calls in the same order")

    def _raise_if_refused(self, phase: str, missing: Sequence[int], ranks) -> None:
        """The refused-call error (cancelling this call) if any of ``ranks`` refused the attempt this rank is
        in; it names them (and ``missing``, or them again)."""
        refused = [r for r in ranks if self._refused_by(r, self._active_seq)]
        if refused:
            code = self._leave_refused()
            for r in refused:
                self._refused_as_other_call(r, self._active_seq, code, self._active_call)
            raise UBEPPeerAbortedError(phase, self.rank, list(missing) or refused, refused, refused=True)

    def _cancel_refused_hooks(self, ranks=None) -> None:
        """Cancel the pending recv hooks (other than the one running) of attempts that one of ``ranks`` (all:
        None) refused: the hook raises ``CancelledCallError`` when run, and this rank tells the peers that it
        left that attempt (the refusing rank's next call waits for that)."""
        if not self._pending:
            return
        for pend in self._pending:
            if pend.done or pend.seq == self._hook_seq:
                continue
            if not any(self._refused_by(r, pend.seq) for r in (range(self.group_size) if ranks is None else ranks)):
                continue
            cp = pend.extra["cancel_point"]
            code = self._region_code(cp["rid"])
            self._post_decision(pend.seq, code, gave_up=True)
            self._leave_call(cp)
            pend.done = pend.extra["cancelled"] = True
            self._pending = [p for p in self._pending if not p.done]
            for r in range(self.group_size) if ranks is None else ranks:
                if self._refused_by(r, pend.seq):
                    try:
                        self._refused_as_other_call(r, pend.seq, code, cp["call"])
                    except UBEPError as e:
                        pend.extra["mismatch"] = str(e)      # (its hook raises it too)
                        raise
        self._pending = [p for p in self._pending if not p.done]

    def _signal_abort(self, how: int = P.ABORT_FAILED, call: Optional[int] = None) -> None:
        """Tell every peer that this rank failed inside a call (``how``: see ``_peer_aborted``; ``call``: its
        number, the active call's by default), so they fail fast instead of timing out, and their errors name
        the rank that caused it."""
        if self._destroyed and how != P.ABORT_DESTROYED:     # (the cause the peers are told stays the destroy)
            return
        slot = _ABORT_ROW * self.group_size + self.rank
        word = P.abort_word(how, self._active_call if call is None else call)
        for r in range(self.group_size):
            try:
                self._peer_words[r][slot] = word
            except Exception:
                pass

    def _note_send(self, job: SendJob) -> None:
        """What a cancel of this call re-arms (SP): the slots the send phase ``job`` writes into."""
        if self.sync == "sp" and self._cancel_point is not None:
            self._cancel_point["sent"].append((job.fmt, list(job.dests)))

    def _cancel_call(self, e: BaseException) -> bool:
        """True, with the call cancelled and this Buffer usable, when ``e`` says that the ranks this call
        waits for refused it, which cancels it on every rank (see ``_refuse``); else False.

        Every rank that took part leaves the call: it acknowledges the rows of the call's epoch (it will not
        read them) and re-arms (SP) the slots it wrote into its peers, whose first words would otherwise read
        as arrived when the half is next used. The refusing ranks count the call too, when they next call
        (``_settle_refusal``). Flags and checksums carry the epoch, so no other stale block can match a later
        call, and SyncAll barriers are counted per call (``_sync_all``)."""
        if getattr(e, "cancelled", False):
            return True
        cp = self._cancel_point
        if not (isinstance(e, UBEPPeerAbortedError) and e.refused and cp is not None and cp.get("refused")
                and cp["call"] == self._active_call):
            return False
        self._leave_call(cp)
        e.cancel()
        return True

    def _leave_call(self, cp: dict) -> None:
        """Leave the cancelled call of cancel point ``cp`` on this rank: re-arm (SP) the slots it wrote into
        its peers and acknowledge the rows of its epoch (``_cancel_done``)."""
        for fmt, dests in cp["sent"]:
            for d in dests:
                if d.sel.numel():
                    self.engine.rearm(fmt, d.rows[:d.sel.numel()])
        self._cancel_done(cp["rid"], cp["epoch"])

    def _fail(self, e: BaseException) -> None:
        name_global_ranks(e, self._global_ranks)      # (its text is kept for later calls' errors)
        if self._destroyed:
            # a call that failed because destroy() ran meanwhile (another thread, a signal handler): destroy()
            # tells the peers that this rank destroyed its Buffer, whichever of the two gets there first
            return
        if self._broken is None:
            # (an exception without a message, such as Ctrl-C's KeyboardInterrupt, is named with its call)
            self._broken = f"{type(e).__name__}: {e}" if str(e) else \
                f"{type(e).__name__} during call {self._active_call} of this Buffer"
        gave_up = isinstance(e, (UBEPTimeoutError, UBEPPeerLostError, UBEPPeerAbortedError))
        self._signal_abort(P.ABORT_GAVE_UP if gave_up else
                           P.ABORT_MISMATCH if isinstance(e, UBEPMismatchError) else P.ABORT_FAILED)

    def _report(self, kind: str, topk_idx: Optional[torch.Tensor], num_experts: int, hidden: int,
                bytes_per_token: int, token_in_rank: Optional[torch.Tensor] = None) -> None:
        """The cost model's report of a call whose data has moved. The model and ``on_report`` observe the
        call: an error of theirs becomes a warning, so the call's results are returned and no peer waits
        on a call this rank left.

        A normal call whose routing is known only as ``token_in_rank`` ([T, R] bool: a dispatch given
        ``is_token_in_rank`` without ``topk_idx``, its combine, a handle rebuilt from its tuple) is modelled
        with one copy per (token, destination rank), to that rank's first expert: the rows normal mode
        moves; with ``topk_idx``, one per (token, expert), as the paper's kernels move them. ``last_report``
        becomes this call's report, or None where the call has none (no cost model, or its report failed)."""
        self.last_report = None       # (a recv hook's call reports when the hook runs, after other calls)
        if self.cost_model is None:
            return
        if topk_idx is None and token_in_rank is not None:
            R = self.group_size
            if num_experts < R:           # (a handle rebuilt from its tuple does not know E)
                num_experts = R
            first = torch.arange(R, dtype=torch.int64) * (num_experts // R)
            topk_idx = torch.where(token_in_rank.to(torch.bool), first, torch.full_like(first, -1))
        if topk_idx is None:
            return
        try:
            # (the count group the Buffer or a normal call's Config names, else the model's own choice; the
            # mapping the engine runs, where it has a choice: the Triton engine's UBEP_TRITON_MAPPING)
            n, mapping = self._call_count_aivs, getattr(self.engine, "mapping", None)
            kw = {k: v for k, v in (("n_count", n), ("mapping", mapping)) if v is not None}
            rep = self.cost_model.report(kind, self.rank, self.group_size, topk_idx, num_experts, hidden,
                                         bytes_per_token, sync=self.sync, **kw)
        except Exception as e:
            warnings.warn(f"ubep_torch: rank {self.rank}: the cost model report of {kind} failed ({type(e).__name__}: "
                          f"{e}); the call itself completed", RuntimeWarning, stacklevel=2)
            return
        self.last_report = rep
        if self.on_report is not None:
            try:
                self.on_report(kind, rep)
            except Exception as e:
                warnings.warn(f"ubep_torch: rank {self.rank}: on_report raised {type(e).__name__} for the report of "
                              f"{kind} ({e}); the call itself completed", RuntimeWarning, stacklevel=2)

    # ================================================================== validation helpers
    def _check_topk(self, topk_idx: torch.Tensor, num_experts: int, name: str = "topk_idx",
                    values: bool = True) -> torch.Tensor:
        """``topk_idx`` as a contiguous CPU int64 [T, K] tensor, its type and shape checked, and (``values``)
        every id in [-1, num_experts); callers that pass ``values=False`` check the ids themselves."""
        # (the usual routing is already what the steps below make of one: a contiguous CPU int64 [T, K] tensor)
        if not (topk_idx.__class__ is _TENSOR and topk_idx.dtype is torch.int64 and topk_idx.dim() == 2
                and topk_idx.is_cpu and topk_idx.is_contiguous() and not topk_idx.is_neg()):
            if not isinstance(topk_idx, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(topk_idx).__name__}")
            if topk_idx.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be int64 (DeepEP's topk_idx_t; int32 is also taken), got "
                                f"{topk_idx.dtype}")
            if topk_idx.dim() != 2:
                raise ValueError(f"{name} must be [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
            if topk_idx.device.type != "cpu":
                topk_idx = topk_idx.cpu()
            topk_idx = _resolved(topk_idx.to(torch.int64)).contiguous()
        if values and topk_idx.numel():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= num_experts:
                raise ValueError(_TOPK_RANGE.format(name=name, E=num_experts, lo=lo, hi=hi, rank=self.rank))
        return topk_idx

    def _check_num_experts(self, num_experts, low_latency: bool = False) -> int:
        """``num_experts`` as an int: positive, divisible by the group size, and with few enough local experts
        that one control message carries their counts (and, in normal mode, the R token counts and the
        token total after them)."""
        if type(num_experts) is not int and (isinstance(num_experts, bool) or  # (ABC checks only for non-ints)
                                             not isinstance(num_experts, numbers.Integral)) or num_experts <= 0:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        num_experts, R = int(num_experts), self.group_size
        if num_experts % R:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({R})")
        most = _max_local_experts(0 if low_latency else R + 1)
        if num_experts // R > most:
            mode = "low-latency" if low_latency else "normal"
            raise ValueError(f"num_experts={num_experts} gives {num_experts // R} experts per rank; one control "
                             f"message carries the counts of at most {most} in {mode} mode (with {R} ranks)")
        return num_experts

    def _check_expert_counts(self, num_tokens_per_expert, E: int, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """``num_tokens_per_expert`` given without ``topk_idx``: the per-expert counts sent to each rank come
        from it, so it must fit the tokens each rank gets (every such token counted by at least one of that
        rank's experts; counts are slots, so a token may count more than once for one expert, and an expert
        counts nothing where no token goes to its rank)."""
        R = self.group_size
        t = num_tokens_per_expert
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool or \
                tuple(t.shape) != (E,):
            raise ValueError(f"num_tokens_per_expert must be an integer tensor of shape ({E},)")
        per_rank = t.cpu().to(torch.int64).view(R, E // R)
        to_rank = is_token_in_rank.sum(0)
        if (per_rank < 0).any() or ((per_rank > 0) & (to_rank.view(R, 1) == 0)).any() or \
                (per_rank.sum(1) < to_rank).any():
            raise ValueError("num_tokens_per_expert does not fit is_token_in_rank: an expert counts nothing when "
                             "no token is sent to its rank, and every token sent to a rank counts for at least "
                             "one of its experts")
        return per_rank.view(E)

    def _parse_x(self, x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(rows [T, H], scales [T, S] or None), contiguous. As in DeepEP, an fp8 tuple's scales are a payload
        carried with each row: float32 (per-128-channel scales, or any other per-token layout) or int32
        (packed UE8M0 exponents), [T, S] with any S, or [T] (one per token; the received scales are then 1-D
        too)."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError("x as a tuple must be (fp8 tensor [T, H], scales [T, S] float32 or int32)")
            data, scales = x
            if not isinstance(data, torch.Tensor) or not isinstance(scales, torch.Tensor):
                raise TypeError("x tuple entries must be tensors")
            if FP8 is None or data.dtype != FP8:
                raise TypeError(f"x[0] must be torch.float8_e4m3fn, got {data.dtype}")
            if data.dim() != 2:
                raise ValueError(f"x[0] must be [num_tokens, hidden], got {tuple(data.shape)}")
            if scales.dtype not in (torch.float32, torch.int32):
                raise TypeError(f"x[1] (scales) must be float32 (or int32: packed UE8M0 exponents), got "
                                f"{scales.dtype}")
            if scales.dim() not in (1, 2) or scales.shape[0] != data.shape[0]:
                raise ValueError(f"x[1] (scales) must be [{data.shape[0]}, S] or [{data.shape[0]}] (a row of scales "
                                 f"per token, e.g. [T, H/128] per-128-channel scales), got {tuple(scales.shape)}")
            scales = scales.unsqueeze(1) if scales.dim() == 1 else scales
            return _resolved(data).contiguous(), _resolved(scales).contiguous()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor or an (fp8, scales) tuple, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"x must be bfloat16, float32, float16 or float64 (or an fp8 tuple), got {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
        if not x.is_cpu:
            raise ValueError("ubep_torch's shared-memory UGAS moves host tensors: pass CPU tensors")
        return _resolved(x).contiguous(), None

    # ================================================================== layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Per-rank and per-expert token counts of a routing (local computation, no communication).

        Args:
            topk_idx: [T, K] int64 expert ids, -1 for an empty slot.
            num_experts: E, divisible by the group size.
        Returns:
            ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
            is_token_in_rank [T, R] bool, event)``. A token counts once per rank hosting any of its experts,
            and once per slot for an expert (as in DeepEP: a token listing an expert in two slots counts twice
            for it, and its received row lists that expert in both).
        """
        self._check_usable()
        _check_process(self, "get_dispatch_layout")
        try:
            _check_host_tensors(Buffer.get_dispatch_layout, (topk_idx,), {})
            _check_overlap(previous_event, async_finish, allocate_on_comm_stream)
            E = self._check_num_experts(num_experts)
            layout = self._layout(topk_idx, E)[0]
        except BaseException as e:
            name_global_ranks(e, self._global_ranks, also=(ValueError, TypeError))
            if refusal(e):
                self._refuse("get_dispatch_layout")  # (the dispatch it prepares will not come: tell the peers)
            raise
        return tuple(None if t is None else t.clone() for t in layout) + (_event(async_finish),)

    def _layout(self, topk_idx: torch.Tensor, E: int):
        """(layout tuple without the event, validated int64 topk_idx), both private to the Buffer.

        The last routing is remembered by content: a routing equal to it (the same tensor again, or a new
        one with the same values) gets the same answer without a recount. Content, not identity or
        version counters: writes through numpy do not bump a tensor's version, and inference tensors
        have none."""
        hit = self._layout_cache
        if hit is not None and hit[0] == E and _same_routing(topk_idx, hit[2]):
            return hit[1], hit[2]
        checked = self._check_topk(topk_idx, E, values=False)
        # kept between calls: plain tensors, whatever the caller's mode (left only where it is on)
        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():
            topk_idx = checked.clone()      # a snapshot: the caller may change its own tensor later
            lo, hi, layout = self.engine.routing_layout(topk_idx, E, self.group_size)
        if layout is None:
            raise ValueError(_TOPK_RANGE.format(name="topk_idx", E=E, lo=lo, hi=hi, rank=self.rank))
        ntpr, ntpe, itr, send_idx, send_head = layout
        result = (ntpr, None, ntpe, itr)
        # (dispatch's send lists, kept with the layout: see ``derived`` there)
        self._layout_cache = (E, result, topk_idx, {"send_idx": send_idx, "send_head": send_head})
        return result, topk_idx

    # ================================================================== normal dispatch
    @_collective
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle=None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False, *,
                 layout: str = "rank_major", num_experts: Optional[int] = None):
        """Send every token once to each rank that hosts at least one of its experts.

        Args:
            x: [T, H] bf16/fp16/fp32/fp64, or ``(fp8_e4m3 [T, H], scales)``: the scales a payload of each
                row, as in DeepEP: ``[T, H/128]`` float32 per-128-channel scales, any ``[T, S]`` float32 or
                int32 (packed UE8M0), or ``[T]`` (received as ``[N]``).
            handle: a handle from an earlier dispatch: cached mode, reuses its layout, returns only recv_x.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``
                (``is_token_in_rank`` decides which ranks receive each token, as in DeepEP: given with
                ``topk_idx`` it may name other ranks than the experts' (a token arrives with -1 ids on a rank
                that hosts none of its experts); ``num_tokens_per_rank`` must match it and
                ``num_tokens_per_expert`` ``topk_idx``).
            topk_idx: [T, K] int64 expert ids (-1 = none); topk_weights: [T, K] float32 (or float64).
            expert_alignment: each returned per-expert count is rounded up to a multiple of this.
            num_worst_tokens: > 0 sizes the outputs to that many rows (unused rows: topk ids -1, x zero)
                and returns an empty count list (rank-major layout only).
            layout: ``"rank_major"`` (DeepEP order: grouped by source rank, source token order) or
                ``"expert_major"`` (UBEP's Token-Reordering output: rows contiguous per local expert, one
                row per (token, local expert); then recv_topk_idx is [rows] local expert ids,
                recv_topk_weights [rows] the weight of that pair (the sum of the slots' weights where a
                token lists the expert in several slots), and the counts are rows per expert
                padded to expert_alignment with zero rows whose expert id is -1).
            num_experts: E when ``num_tokens_per_expert`` is not given.
        Returns:
            ``(recv_x, recv_topk_idx [N, K] int64 local ids or -1, recv_topk_weights [N, K] (0 where -1),
            num_recv_tokens_per_expert_list (list of E_local ints; empty with num_worst_tokens, or without
            topk_idx and num_tokens_per_expert), handle, event)``; cached mode returns
            ``(recv_x, None, None, None, None, event)``.
        """
        self._check_usable()
        plan = self._repeated_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                       num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                       num_worst_tokens, config, previous_event, async_finish,
                                       allocate_on_comm_stream, layout, num_experts)
        if plan is not None:
            self._apply_config(None)
            routing, layout_of = self._layout_cache[2], self._layout_cache[1]
            return self._dispatch_with(plan, x, x, None, topk_weights, routing, routing, layout_of[3], layout_of[2], 0,
                                       expert_alignment, layout, async_finish)
        _check_overlap(previous_event, async_finish, allocate_on_comm_stream)
        if num_tokens_per_rdma_rank is not None and not isinstance(num_tokens_per_rdma_rank, torch.Tensor):
            raise TypeError(f"num_tokens_per_rdma_rank must be None or a tensor (get_dispatch_layout's, unused "
                            f"within a host), got {type(num_tokens_per_rdma_rank).__name__}")
        self._apply_config(config)
        if layout not in ("rank_major", "expert_major"):
            raise ValueError(f"layout must be 'rank_major' or 'expert_major', got {layout!r}")
        expert_alignment = check_count("expert_alignment", expert_alignment, 1)
        num_worst_tokens = check_count("num_worst_tokens", num_worst_tokens)
        if num_worst_tokens and layout == "expert_major":
            raise ValueError("num_worst_tokens sizes the rank-major outputs (rows of tokens); layout='expert_major' "
                             "returns one row per (token, local expert) padded per expert: pass one of the two")
        xd, scales = self._parse_x(x)
        T, H = xd.shape
        R = self.group_size
        if handle is not None:
            return self._cached_dispatch(xd, scales, handle, x)[:-1] + (_event(async_finish),)

        # ---------------- layout and validation (all before anything reaches a peer)
        for name, t in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                        ("num_tokens_per_expert", num_tokens_per_expert)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor (as get_dispatch_layout returns it), got "
                                f"{type(t).__name__}")
            if t is not None and name != "is_token_in_rank" and (t.dtype.is_floating_point or t.dtype.is_complex
                                                               or t.dtype == torch.bool):
                raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
        if num_experts is None:
            if num_tokens_per_expert is not None:
                num_experts = int(num_tokens_per_expert.numel())
            elif topk_idx is not None:
                raise ValueError("dispatch needs num_tokens_per_expert (from get_dispatch_layout) or "
                                 "num_experts= to interpret topk_idx")
        weights = ntpe = ntpr_cached = None
        routed = None       # (the routing the rows follow, for the cost model: None where is_token_in_rank
        if topk_idx is not None:    # decides otherwise)
            E = self._check_num_experts(num_experts)
            (ntpr_cached, _, ntpe, itr), topk_idx = self._layout(topk_idx, E)
            routed = topk_idx   # (the Buffer's snapshot: the caller may reuse its tensor once the call returns)
            if topk_idx.shape[0] != T:
                raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}")
            K = topk_idx.shape[1]
            if topk_weights is not None:
                if not isinstance(topk_weights, torch.Tensor):
                    raise TypeError("topk_weights must be a tensor")
                if topk_weights.dtype not in (torch.float32, torch.float64):
                    raise TypeError(f"topk_weights must be float32 (or float64), got {topk_weights.dtype}")
                if tuple(topk_weights.shape) != (T, K):
                    raise ValueError(f"topk_weights must have shape {(T, K)}, got {tuple(topk_weights.shape)}")
                weights = _resolved(topk_weights).contiguous()
            if is_token_in_rank is not None:
                if tuple(is_token_in_rank.shape) != (T, R) or is_token_in_rank.dtype != torch.bool:
                    raise ValueError(f"is_token_in_rank must be a [{T}, {R}] bool tensor")
                if not _equal_values(is_token_in_rank, itr):
                    # as in DeepEP, is_token_in_rank decides where rows go and topk_idx only what they
                    # carry: a token sent to a rank that hosts none of its experts arrives with -1 ids there
                    # (a copy: the handle keeps it, and the caller may change theirs)
                    itr = ntpr_cached = routed = None
                    is_token_in_rank = is_token_in_rank.cpu().clone()
            if num_tokens_per_expert is not None and (
                    tuple(num_tokens_per_expert.shape) != (E,) or
                    not _equal_values(num_tokens_per_expert, ntpe)):
                raise ValueError("num_tokens_per_expert does not match topk_idx (use get_dispatch_layout)")
            is_token_in_rank = itr if itr is not None else is_token_in_rank
        else:
            if layout == "expert_major":
                raise ValueError("layout='expert_major' needs topk_idx")
            if is_token_in_rank is None:
                raise ValueError("dispatch needs topk_idx or is_token_in_rank (or a handle for cached mode)")
            if tuple(is_token_in_rank.shape) != (T, R) or is_token_in_rank.dtype != torch.bool:
                raise ValueError(f"is_token_in_rank must be a [{T}, {R}] bool tensor")
            is_token_in_rank = is_token_in_rank.cpu().clone()   # (kept by the handle: the caller may reuse theirs)
            E = self._check_num_experts(num_experts) if num_experts else R
            K = 0
            if topk_weights is not None:
                raise ValueError("topk_weights needs topk_idx")
            if num_tokens_per_expert is not None:   # trusted for the counts, checked against the ranks
                ntpe = self._check_expert_counts(num_tokens_per_expert, E, is_token_in_rank)
        if num_tokens_per_rank is not None:
            if tuple(num_tokens_per_rank.shape) != (R,):
                raise ValueError(f"num_tokens_per_rank must have shape ({R},)")
            expect = ntpr_cached if ntpr_cached is not None else is_token_in_rank.sum(0)
            if not _equal_values(num_tokens_per_rank, expect):
                raise ValueError("num_tokens_per_rank does not match is_token_in_rank/topk_idx")

        wsz = 0 if weights is None else weights.element_size() // 4
        fields = [("x", H * xd.element_size())]
        if scales is not None:
            fields.append(("scales", scales.shape[1] * 4))
        # (the kind: ranks whose rows have the same sizes but other dtypes or top-k must not pair up)
        fmt = P.row_format(self.sync, tuple(fields), K + K * wsz,
                           f"{xd.dtype}/{K}/{None if weights is None else weights.dtype}"
                           + ("" if scales is None else f"/{scales.dtype}"))
        fmt.check_fits()
        cap = self._normal_capacity(P.REGION_DISPATCH, fmt)
        plan = _DispatchPlan(T=T, H=H, K=K, E=E, fmt=fmt, cap=cap, dtype=xd.dtype,
                             wdtype=None if weights is None else weights.dtype)
        # (a call of a form a later call may repeat, with this routing or another one the Buffer laid out: see
        # _repeated_dispatch)
        lc = self._layout_cache
        self._dispatch_plan = plan if routed is not None and scales is None and not num_worst_tokens \
            and ntpr_cached is not None and lc is not None and lc[2] is routed else None
        return self._dispatch_with(plan, x, xd, scales, weights, topk_idx, routed, is_token_in_rank, ntpe,
                                   num_worst_tokens, expert_alignment, layout, async_finish)

    def _repeated_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                           num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                           config, previous_event, async_finish, allocate_on_comm_stream, layout,
                           num_experts) -> Optional[_DispatchPlan]:
        """The plan of the last dispatch (``_dispatch_plan``) where this call has the same form: no handle,
        config, event, rdma counts or ``num_experts``, flags False, a known layout, ``num_worst_tokens`` 0, x a
        contiguous tensor of the same dtype and shape (no fp8 pair), weights of the same dtype and shape (or none
        again) and ``num_tokens_per_expert`` given; and where its routing is the one the Buffer laid out last
        (``get_dispatch_layout`` or an earlier dispatch), of that call's size and expert count, by content:
        ``topk_idx`` equal to the Buffer's snapshot, every given layout tensor to the Buffer's, in the same dtype.
        Else None: the call takes the full checks, which also raise whatever error its arguments deserve."""
        p, lc = self._dispatch_plan, self._layout_cache
        if p is None or lc is None or handle is not None or config is not None or previous_event is not None \
                or async_finish is not False or allocate_on_comm_stream is not False \
                or num_tokens_per_rdma_rank is not None or num_experts is not None or num_tokens_per_expert is None \
                or layout.__class__ is not str or layout not in ("rank_major", "expert_major") \
                or num_worst_tokens.__class__ is not int or num_worst_tokens \
                or expert_alignment.__class__ is not int or expert_alignment < 1 \
                or lc[0] != p.E or lc[2].shape != (p.T, p.K):
            return None
        if x.__class__ is not _TENSOR or x.dtype is not p.dtype or x.shape != (p.T, p.H) or not x.is_contiguous() \
                or x.is_neg():
            return None
        w = topk_weights
        if (w is not None) if p.wdtype is None else (
                w.__class__ is not _TENSOR or w.dtype is not p.wdtype or w.shape != (p.T, p.K)
                or not w.is_contiguous() or w.is_neg()):
            return None
        laid = lc[1]
        for given, expected in ((num_tokens_per_rank, laid[0]), (is_token_in_rank, laid[3]),
                                (num_tokens_per_expert, laid[2])):
            if given is not None and (given.__class__ is not _TENSOR or given.dtype is not expected.dtype
                                      or given.shape != expected.shape or not torch.equal(given, expected)):
                return None
        return p if _same_routing(topk_idx, lc[2]) else None

    def _dispatch_with(self, plan: _DispatchPlan, x, xd: torch.Tensor, scales: Optional[torch.Tensor],
                       weights: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                       routed: Optional[torch.Tensor], is_token_in_rank: torch.Tensor, ntpe: Optional[torch.Tensor],
                       num_worst_tokens: int, expert_alignment: int, layout: str, async_finish: bool):
        """The rest of ``dispatch`` once its arguments are checked (``plan``): the exchange, Token-Reordering
        and the outputs. ``x`` as given, ``xd`` and ``scales`` its rows and scales, ``weights`` contiguous;
        ``topk_idx`` the Buffer's snapshot of the routing (or None), ``routed`` the routing the rows follow (None
        where ``is_token_in_rank`` decides otherwise), ``ntpe`` the per-expert counts (or None)."""
        T, H, K, E, fmt, cap = plan.T, plan.H, plan.K, plan.E, plan.fmt, plan.cap
        R = self.group_size
        E_local = E // R

        # ---------------- send
        # send lists and send_head depend on the routing alone: kept with the cached layout
        lc = self._layout_cache
        derived = lc[3] if topk_idx is not None and lc is not None and lc[1][3] is is_token_in_rank else {}
        if "send_idx" not in derived:
            derived["send_idx"], derived["send_head"] = send_lists(is_token_in_rank)
        send_idx = derived["send_idx"]
        # meta items: the K global expert ids, then the weights' bits
        meta = self.engine.meta_items(topk_idx, weights) if K else None
        fields_data = [P.as_bytes(xd)] + ([P.as_bytes(scales)] if scales is not None else [])
        src_index = self.engine.arange(T)
        if "counts" not in derived:
            derived["counts"] = ntpe.view(R, E_local).tolist() if ntpe is not None else [[0] * E_local] * R
        counts, ntpr, sig = derived["counts"], [s.numel() for s in send_idx], fmt.signature()

        def messages(lists):
            """The control words of an exchange that sends ``lists``: for every token in one exchange, the
            messages of the routing, kept with it."""
            if lists is send_idx:
                words = derived.get(("words", sig, num_worst_tokens, E))
                if words is None:
                    words = derived["words", sig, num_worst_tokens, E] = [
                        (int(send_idx[d].numel()), sig, 0, num_worst_tokens, E, 0, *counts[d], *ntpr, T)
                        for d in self._send_order]
                return words
            return lambda d: [int(lists[d].numel()), sig, 0, num_worst_tokens, E, 0] + counts[d] + ntpr

        def exchange(lists, staged):
            return self._exchange(P.REGION_DISPATCH, fmt, fields_data, meta, src_index, lists, messages(lists), T,
                                  n_counts=E_local, with_matrix=True, staged=staged)

        # ---------------- receive side: CalCumSum and Token-Reordering into the DeepEP layout
        out = {}
        worst_x = None
        if num_worst_tokens:    # sized by the caller: allocated before anything is sent, so too many rows fail here
            try:
                worst_x = self._out.zeros((num_worst_tokens, H), xd.dtype)
            except (RuntimeError, MemoryError, TypeError, OverflowError) as e:
                raise ValueError(f"num_worst_tokens={num_worst_tokens} rows of hidden size {H} cannot be allocated "
                                 f"({type(e).__name__}: {str(e)[:120]})") from None

        def allocate(recv: dict) -> Tuple[List[int], list, torch.Tensor, torch.Tensor]:
            rows_from = self._rows_from(recv, [row[self.rank] for row in recv["ntpr_matrix"]], cap)
            num_recv = sum(rows_from)
            # every rank that receives more rows than its num_worst_tokens, as every rank sees it (the messages
            # carry each sender's row counts and num_worst_tokens): each raises once the call has completed
            worst = [recv["ctrl"][d][P.CTRL_WORST_TOKENS] for d in range(R)]
            received = [sum(col) for col in zip(*recv["ntpr_matrix"])] if any(worst) else None
            out["overflow"] = {d: (received[d], worst[d]) for d in range(R) if 0 < worst[d] < received[d]} \
                if received else {}
            # more rows than num_worst_tokens: the call completes (the peers' rows must be consumed), then
            # raises; a rank cannot know what it will receive before the exchange
            rows_out = max(num_worst_tokens, num_recv) if num_worst_tokens else num_recv
            out["x"] = (worst_x if rows_out == num_worst_tokens else self._out.zeros((rows_out, H), xd.dtype)) \
                if num_worst_tokens else self._out.empty((num_recv, H), xd.dtype)
            out["scales"] = None
            if scales is not None:
                out["scales"] = self._out.zeros((rows_out, scales.shape[1]), scales.dtype)
            # every received row's meta items and source token are written below (rows past num_recv, with
            # num_worst_tokens, are masked by local_topk)
            out["meta"] = torch.empty(rows_out, fmt.meta_words, dtype=torch.int32)
            out["src_idx"] = torch.empty(rows_out, dtype=torch.int32)
            if rows_out > num_recv:     # (DeepEP sizes it as the outputs; rows past num_recv come from no rank)
                out["src_idx"][num_recv:] = -1
            out["recv"] = recv
            outs = [P.as_bytes(out["x"])] + ([P.as_bytes(out["scales"])] if scales is not None else [])
            return rows_from, outs, out["meta"], out["src_idx"]

        def local_copy(o: int, sel: torch.Tensor) -> None:
            n = sel.numel()
            self._gather_own_rows(xd, sel, out["x"], o)
            if scales is not None:
                self._gather_own_rows(scales, sel, out["scales"], o)
            if meta is not None:
                self._gather_own_rows(meta, sel, out["meta"], o)
            out["src_idx"][o:o + n].copy_(sel)

        # (a routing sent before, by the last call or an earlier one: the messages may repeat the last ones)
        steady = None if num_worst_tokens or T > cap else self._steady_dispatch(
            fmt, cap, T, E_local, send_idx, messages(send_idx), fields_data, meta, src_index, allocate,
            "sent" not in derived)
        rows_from, first = steady or (None, None)
        if rows_from is None:
            rows_from = self._dispatch_rounds(P.REGION_DISPATCH, fmt, cap, T, send_idx, exchange, allocate,
                                              local_copy, own_src=(fields_data, meta), first=first)
        derived["sent"] = True
        self._call_complete("dispatch")
        off_l = list(accumulate(rows_from, initial=0))
        num_recv, recv = off_l[-1], out["recv"]
        if out["overflow"]:     # (raised on every rank alike, so that every rank leaves the same step)
            each = "; ".join(f"rank {d} received {n} tokens, more than its num_worst_tokens={worst}"
                             for d, (n, worst) in out["overflow"].items())
            raise ValueError(f"{each} (the call completed on every rank, and every rank raises this error: the "
                             f"Buffer stays usable)")
        recv_x, recv_scales, recv_meta, recv_src_idx = out["x"], out["scales"], out["meta"], out["src_idx"]

        recv_topk_idx = recv_topk_weights = None
        if K:   # global expert ids -> this rank's local ids (-1 for -1, other ranks' experts and unused rows)
            recv_topk_idx, recv_topk_weights = self.engine.local_topk(
                recv_meta, K, None if weights is None else weights.dtype, self.rank * E_local, E_local, num_recv)
        # what the control messages say for the outputs, worked out once per messages (see _exchange_receive: the
        # usual call gets the same ones as the last)
        said = recv["said"]
        if "dispatch" not in said:
            prefix, run = [], [0] * R       # rank_prefix_matrix: column-wise prefix sums of [src, dst] counts
            for row in recv["ntpr_matrix"]:
                run = [a + b for a, b in zip(run, row)]
                prefix.append(run)
            # rank_prefix_matrix and the two channel matrices (below) made from one array (numpy slices of a
            # few ints, then tensors sharing their memory, cost a fraction of tensor slicing)
            said["dispatch"] = ([sum(c) for c in zip(*recv["counts"])],
                                np.array([c for row in prefix for c in row] + recv["ntpr_matrix"][self.rank] + [0] * R,
                                         dtype=np.int32))
        per_expert, matrices = said["dispatch"]
        if num_worst_tokens or ntpe is None:   # (no routing and no per-expert counts: they are unknown)
            count_list: List[int] = []
        else:
            count_list = list(per_expert) if expert_alignment == 1 else \
                [-(-c // expert_alignment) * expert_alignment for c in per_expert]

        # DeepEP-shaped handle
        matrices = matrices.copy()
        rank_prefix = torch.from_numpy(matrices[:R * R].reshape(R, R))
        send_head = derived["send_head"].clone()
        # one channel per rank pair: tokens sent to each rank, and where the channel begins within each
        # source's rows (DeepEP's receiver stores that offset before it adds the source's start: 0 here)
        channel_prefix = torch.from_numpy(matrices[R * R:R * R + R].reshape(R, 1))
        recv_channel_prefix = torch.from_numpy(matrices[R * R + R:].reshape(R, 1))
        h = DispatchHandle(
            (rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, is_token_in_rank.clone(), send_head),
            send_idx=send_idx, recv_counts=rows_from, recv_offsets=off_l, num_recv=num_recv, num_tokens=T,
            num_experts=E, num_worst_tokens=num_worst_tokens, layout="rank_major", topk_idx=routed,
            peer_tokens=recv["num_tokens"], pair=self._pair_tag | self._calls,
            src_tokens=recv_src_idx.long(), token_in_rank=is_token_in_rank)
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        self._report("dispatch", routed, E, H, fmt.fields[0][1] + (fmt.fields[1][1] if scales is not None else 0),
                     token_in_rank=is_token_in_rank)
        if layout == "expert_major":
            res = self._to_expert_major(out_x, recv_topk_idx, recv_topk_weights, h, expert_alignment,
                                        num_recv)[:-1] + (_event(async_finish),)
            h = res[4]
        else:
            res = out_x, recv_topk_idx, recv_topk_weights, count_list, h, _event(async_finish)
        self._recent_handles.append(h)
        return (_scales_as_given(res[0], x),) + res[1:]

    def _gather_own_rows(self, src: torch.Tensor, sel: torch.Tensor, dst: torch.Tensor, o: int) -> None:
        """``dst[o + i] = src[sel[i]]``: this rank's own rows, straight from the source tensor (one C pass
        where the engine has it)."""
        n = sel.numel()
        if not self.engine.copy_rows(src, sel, dst, self.engine.span(o, o + n)):
            torch.index_select(src, 0, sel, out=dst[o:o + n])

    def _to_expert_major(self, out_x, recv_topk_idx, recv_topk_weights, h, alignment: int, num_recv: int):
        """Token-Reordering into UBEP's expert-major layout (local gather after the exchange)."""
        E_local = h.num_experts // self.group_size
        idx = recv_topk_idx[:num_recv]
        # bytes of one padded row in the outputs (rows, its index, expert id and weight): a padding past the
        # machine's memory is refused before it is allocated
        xs = out_x if isinstance(out_x, tuple) else (out_x,)
        row_bytes = sum(t.shape[1] * t.element_size() for t in xs) + 24
        limit, total = physical_memory(), 0
        rows_list, expert_list, weight_list, counts = [], [], [], []
        for e in range(E_local):
            r, k = (idx == e).nonzero(as_tuple=True)
            w = recv_topk_weights[r, k] if recv_topk_weights is not None else None
            # A token may list an expert in several slots: it gets one row, whose weight is the slots' sum
            # (in slot order), so weighting the rows and combining gives the rank-major weighted sum.
            if r.numel() > 1:
                first = torch.ones_like(r, dtype=torch.bool)
                first[1:] = r[1:] != r[:-1]
                if w is not None and not bool(first.all()):
                    w = torch.zeros(int(first.sum()), dtype=w.dtype).index_add_(0, first.cumsum(0) - 1, w)
                r = r[first]
            n = r.numel()
            pad = -(-n // alignment) * alignment - n
            total += n + pad
            if total * row_bytes > limit:
                raise ValueError(f"expert_alignment={alignment} pads the expert-major layout to {total} rows or more "
                                 f"({total * row_bytes} bytes), more than this machine's memory ({limit} bytes); the "
                                 f"call completed on every rank and the Buffer stays usable")
            rows_list.append(torch.cat([r, torch.full((pad,), -1, dtype=torch.int64)]))
            expert_list.append(torch.cat([torch.full((n,), e, dtype=torch.int64),
                                          torch.full((pad,), -1, dtype=torch.int64)]))
            if recv_topk_weights is not None:
                weight_list.append(torch.cat([w, torch.zeros(pad, dtype=recv_topk_weights.dtype)]))
            counts.append(n + pad)
        row_index = torch.cat(rows_list) if rows_list else torch.zeros(0, dtype=torch.int64)
        valid = row_index >= 0
        safe = row_index.clamp(min=0)

        def gather(t):
            g = t.index_select(0, safe)
            g.view(torch.uint8)[~valid] = 0      # byte view: also works for fp8 payloads
            return g

        em_x = (gather(out_x[0]), gather(out_x[1])) if isinstance(out_x, tuple) else gather(out_x)
        em_h = DispatchHandle.expert_major(h, row_index)
        em_w = torch.cat(weight_list) if recv_topk_weights is not None else None
        return (em_x, torch.cat(expert_list), em_w, counts, em_h, EventOverlap(None))

    def _as_dispatch_handle(self, handle) -> "DispatchHandle":
        """The handle itself; for a plain tuple or list, the recent handle it was copied from (all of its
        layout, ``num_worst_tokens`` and expert-major order included), else one rebuilt from the entries."""
        if isinstance(handle, DispatchHandle):
            base = getattr(handle, "base_handle", None) or handle
            if len(base.send_idx) != self.group_size:
                raise ValueError(f"this handle comes from a Buffer of {len(base.send_idx)} ranks; this one has "
                                 f"{self.group_size}")
            return handle
        if isinstance(handle, (tuple, list)):
            return _recent_copy_of(handle, self._recent_handles, _DISPATCH_LAYOUT_KEYS, ("num_worst_tokens",)) or \
                DispatchHandle.from_tuple(handle, self.rank, self.group_size)
        raise TypeError(f"handle must be the handle returned by Buffer.dispatch, got {type(handle).__name__}")

    def _dispatch_pair(self, handle) -> int:
        """The dispatch a handle names (``DispatchHandle.pair``), for the peers to check that every rank
        passes the handle of the same one: known for the handle object dispatch returned and for a plain
        tuple of its own tensors; 0 (not checked) for a copy of its tensors, which may equal the handles of
        other calls (every layer routing alike) while the peers' copies resolve to another of them."""
        if isinstance(handle, DispatchHandle):
            return handle.pair
        original = _recent_original(handle, self._recent_handles)
        return 0 if original is None else original.pair

    def _cached_dispatch(self, xd, scales, handle, x_orig):
        paired = self._dispatch_pair(handle)
        handle = self._as_dispatch_handle(handle)
        base = getattr(handle, "base_handle", None) or handle
        T, H = xd.shape
        if T != base.num_tokens:
            raise ValueError(f"cached dispatch: x has {T} rows but the handle was made for {base.num_tokens}")
        fields = [("x", H * xd.element_size())]
        if scales is not None:
            fields.append(("scales", scales.shape[1] * 4))
        fmt = P.row_format(self.sync, tuple(fields), 0, str(xd.dtype) + ("" if scales is None else f"/{scales.dtype}"))
        cap = self._normal_capacity(P.REGION_DISPATCH, fmt)
        fields_data = [P.as_bytes(xd)] + ([P.as_bytes(scales)] if scales is not None else [])
        sig, src_index = fmt.signature(), self.engine.arange(T)

        # (a cached dispatch's control word 3 names the handle's dispatch, as a combine's does: ranks that pass
        # the handles of different dispatches with the same row counts would get each other's wrong rows)
        def exchange(lists, staged):
            return self._exchange(P.REGION_DISPATCH, fmt, fields_data, None, src_index, lists,
                                  lambda d: [int(lists[d].numel()), sig, 0, paired, 0, 0], T, staged=staged)

        rows_out = base.num_worst_tokens or base.num_recv
        recv_x = self._out.zeros((rows_out, H), xd.dtype) if base.num_worst_tokens else \
            self._out.empty((rows_out, H), xd.dtype)
        recv_scales = self._out.zeros((rows_out, scales.shape[1]), scales.dtype) if scales is not None else None
        outs = [P.as_bytes(recv_x)] + ([P.as_bytes(recv_scales)] if scales is not None else [])

        def allocate(recv: dict):
            self._check_pairing("cached dispatch", recv["ctrl"], paired)
            if any(t <= cap and n != c for t, n, c in zip(recv["num_tokens"], recv["nrows"], base.recv_counts)):
                self._broken = "cached dispatch layout mismatch"
                raise UBEPError(f"cached dispatch on rank {self.rank}: peers sent {recv['nrows']} rows, the "
                                f"handle expects {base.recv_counts} (handles from different calls?)")
            return base.recv_counts, outs, None, None

        def local_copy(o: int, sel: torch.Tensor) -> None:
            self._gather_own_rows(xd, sel, recv_x, o)
            if recv_scales is not None:
                self._gather_own_rows(scales, sel, recv_scales, o)

        self._dispatch_rounds(P.REGION_DISPATCH, fmt, cap, T, base.send_idx, exchange, allocate, local_copy,
                              own_src=(fields_data, None))
        self._call_complete("cached dispatch")
        self._report("dispatch", base.topk_idx, base.num_experts, H, sum(f[1] for f in fields),
                     token_in_rank=base.token_in_rank)
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        if handle.layout == "expert_major":
            row_index = handle.row_index
            valid = row_index >= 0
            safe = row_index.clamp(min=0)

            def gather(t):
                g = t.index_select(0, safe)
                g.view(torch.uint8)[~valid] = 0
                return g
            out_x = (gather(recv_x), gather(recv_scales)) if scales is not None else gather(recv_x)
        return _scales_as_given(out_x, x_orig), None, None, None, None, EventOverlap(None)

    # ------------------------------------------------------------------ the exchange (both normal ops)
    def _exchange(self, rid: int, fmt: P.RowFormat, fields_data, meta, src_index, send_idx,
                  ctrl_payload: Callable, num_tokens: int, n_counts: int = 0, with_matrix: bool = False,
                  staged: Optional[tuple] = None) -> dict:
        """Count group + token group for one exchange; returns what the control messages said.

        ``send_idx[d]`` lists the staging rows for destination ``d`` in slot order; ``ctrl_payload(d)`` the
        control words for ``d`` up to its counts (and rank matrix row), after which every message carries
        ``num_tokens``, the token count of this rank's side of the call (see ``_more_rounds``). Rows are
        staged once per call: ``staged`` is the ``"staged"`` entry an earlier exchange of the call returned
        (None where the engine staged and sent them in one step, ``stage_and_send``: each exchange then does).
        """
        x = self._exchange_begin(rid, fmt, send_idx, ctrl_payload, num_tokens, n_counts, with_matrix)
        staged = self._exchange_send(x, fmt, fields_data, meta, src_index, staged)
        return self._exchange_receive(x, fmt, staged)

    def _exchange_begin(self, rid: int, fmt: P.RowFormat, send_idx, ctrl_payload, num_tokens: int, n_counts: int,
                        with_matrix: bool) -> dict:
        """The start of ``_exchange``: the call's epoch in the region, once the peers have consumed the rows of
        the call that used its half last; returns what its send and receive steps need."""
        R = self.group_size
        region = self._region(rid)
        extra_ctrl = n_counts + (R if with_matrix else 0) + 1
        if extra_ctrl > P.MAX_CTRL_COUNTS:
            raise ValueError(f"too many counts for one control message ({extra_ctrl}); at most {P.MAX_CTRL_COUNTS}")
        epoch = self._next_epoch(rid)
        half = epoch % region.halves
        self._wait_acks(rid, epoch)
        nctrl = P.ctrl_blocks(extra_ctrl)
        order = self._send_order
        # (a caller that sends the same messages call after call passes them, in send order, as a list)
        words = ctrl_payload if ctrl_payload.__class__ is list else \
            [tuple(ctrl_payload(d)) + (num_tokens,) for d in order]
        # rows for this rank itself skip the slots: the receive side copies them straight from the source
        sels = [send_idx[d] for d in order]
        sels[0] = self.engine.span(0, 0)
        # (key: what the destinations' slots and control blocks are made of: the peers' memory is mapped for
        # the Buffer's life, and these name where in it and how many rows fit)
        return {"rid": rid, "region": region, "epoch": epoch, "half": half, "flag": P.flag_word(epoch, rid),
                "nctrl": nctrl, "words": words, "sels": sels, "key": (rid, half, nctrl, fmt.blocks),
                "used": P.CTRL_COUNTS + extra_ctrl, "n_counts": n_counts, "with_matrix": with_matrix}

    def _exchange_send(self, x: dict, fmt: P.RowFormat, fields_data, meta, src_index,
                       staged: Optional[tuple]) -> Optional[tuple]:
        """The send step of ``_exchange``: every destination's control message and rows; returns the staging
        (None where the engine staged and sent in one step)."""
        rid, region, half, flag, eng, me = x["rid"], x["region"], x["half"], x["flag"], self.engine, self.rank
        sels, words, key = x["sels"], x["words"], x["key"]
        # the usual call: rows staged and sent as before, in one step (staging is private to this rank: the
        # meta blocks it writes are read by this call's stores only)
        if staged is not None or not eng.stage_and_send(key, fmt, fields_data, meta, src_index, me, flag, sels,
                                                        words):
            staged = staged or eng.stage_rows(fmt, fields_data, meta, src_index, me)
            staging, checked, row_sums = staged
            if not eng.send_again(key, fmt, staging, flag, sels, words):
                job = SendJob(fmt, staging, checked, row_sums, flag, sync_all=lambda: self._sync_all(
                    f"{P.REGION_NAMES[rid]}: SyncAll after Token-Sending", rid))
                for d, sel, w in zip(self._send_order, sels, words):
                    peer = self._peer_mem[d]
                    job.dests.append(Destination(d, sel, region.rows(peer, half, me, fmt),
                                                 region.ctrl(peer, half, me, x["nctrl"]), list(w)))
                self._note_send(job)
                eng.send_phase(job, key)
        return staged

    def _exchange_receive(self, x: dict, fmt: P.RowFormat, staged: Optional[tuple]) -> dict:
        """The receive step of ``_exchange``: every source's control message, checked; returns what they said."""
        R, me, eng = self.group_size, self.rank, self.engine
        rid, region, half, flag, epoch = x["rid"], x["region"], x["half"], x["flag"], x["epoch"]
        n_counts, with_matrix = x["n_counts"], x["with_matrix"]
        # receive the control messages of every source (verification of flags and counts)
        ctrl_words = self._wait_ctrl(region, half, x["nctrl"], flag, _TOKENCNT_PHASE[rid])
        if self.sync == "sw":
            self._sync_all(f"{P.REGION_NAMES[rid]}: SyncAll after flag verification", rid)
        msgs = [ctrl_words[s] for s in range(R)]
        # Messages whose words that the checks below read (all but the checksum and the call-specific word 3) equal
        # those of one of the last sets of this kind pass them again and say the same: what they said is taken from
        # then (the usual case: the same routing call after call, or two in turn). It is read-only, but for what
        # callers work out from it alone and keep in it (``out["said"]``).
        used = x["used"]
        checked = [_checked_words(m, used) for m in msgs]
        seen_key = (rid, fmt, n_counts, with_matrix)
        kept = self._ctrl_seen.get(seen_key)
        said = None
        for i, (words_i, said_i) in enumerate(kept or ()):
            if words_i == checked:
                said = said_i
                if i:
                    kept.insert(0, kept.pop(i))
                break
        if said is None:
            said = self._check_messages(rid, fmt, ctrl_words, msgs, n_counts, with_matrix)
            if kept is None:
                if len(self._ctrl_seen) >= _MAX_SEEN_KINDS:
                    self._ctrl_seen.clear()
                kept = self._ctrl_seen[seen_key] = []
            kept.insert(0, (checked, said))
            del kept[_SEEN_PER_KIND:]
        out = {"epoch": epoch, "half": half, "flag": flag, "ctrl": ctrl_words, "staged": staged, "said": said}
        out.update(said)
        # how each source stored its rows, and what reading this rank's rows has cost it (its message's head
        # words 1..3; see native_engine.store_policy)
        notes = region.ctrl_notes(self._heap.local, half).tolist()
        out["ways"] = [n[0] for n in notes]
        eng.peer_reads(flag, [n for s, n in enumerate(notes) if s != me])
        return out

    def _check_messages(self, rid: int, fmt: P.RowFormat, ctrl_words: dict, msgs: List[list], n_counts: int,
                        with_matrix: bool) -> dict:
        """What the control messages ``msgs`` (every source's words, in rank order) of an exchange say, once
        they are checked against each other and the slots: ``nrows``, ``counts`` (``n_counts`` per source),
        ``ntpr_matrix`` (``with_matrix``: R per source) and ``num_tokens``, lists with an entry per source.
        A mismatch of the ranks' calls or rows that do not fit raises ``UBEPError``."""
        R, me = self.group_size, self.rank
        mine, sig = msgs[me], fmt.signature()
        if any(m[P.CTRL_SIGNATURE] != sig or m[P.CTRL_NUM_EXPERTS] != mine[P.CTRL_NUM_EXPERTS]
               or m[P.CTRL_MAX_TOKENS] != mine[P.CTRL_MAX_TOKENS] for m in msgs):
            self._check_layouts(ctrl_words, fmt, P.REGION_NAMES[rid])
            self._check_call_words(ctrl_words, P.REGION_NAMES[rid])
        nrows = [m[P.CTRL_NROWS] for m in msgs]
        cap = self._regions[rid].capacity(fmt)
        if max(nrows) > cap or min(nrows) < 0:
            self._broken = "peer announced more rows than fit"
            raise UBEPError(f"a peer announced {max(nrows) if max(nrows) > cap else min(nrows)} rows but slots "
                            f"hold [0, {cap}]")
        c0 = P.CTRL_COUNTS + n_counts
        said = {"nrows": nrows, "counts": [m[P.CTRL_COUNTS:c0] for m in msgs]}
        if with_matrix:
            said["ntpr_matrix"] = [m[c0:c0 + R] for m in msgs]
            c0 += R
        said["num_tokens"] = [m[c0] for m in msgs]
        return said

    def _more_rounds(self, recv: dict, cap: int) -> List[Tuple[int, int]]:
        """The token ranges of a normal call's exchanges after the first.

        Slots hold ``cap`` rows per source, so an exchange carries the rows of at most ``cap`` tokens of each
        rank: the first one tokens [0, cap). Its control messages carry every rank's token count; while some
        rank has more, every rank runs one more exchange per ``cap`` tokens (with nothing to send once its
        own tokens are done), so calls are not limited by the buffer size."""
        most = max(recv["num_tokens"])
        if not 0 <= most < 1 << 40:
            self._broken = "bad token count"
            raise UBEPError(f"a peer announced {most} tokens (corrupted control message)")
        return [(a, min(a + cap, most)) for a in range(cap, most, cap)]

    def _exchanges(self, cap: int, lists_for: Callable, exchange: Callable, first: Optional[dict] = None):
        """The exchanges of one normal call (see ``_more_rounds``): yields ``(lists, recv)`` for each, where
        ``lists = lists_for(a, b)`` is what this rank sends for tokens [a, b) and ``recv = exchange(lists,
        staged)`` what the control messages said; the first exchange stages the call's rows, the others
        reuse that staging. ``first``: what the first exchange said, where it was made already."""
        lists = lists_for(0, cap)
        recv = first if first is not None else exchange(lists, None)
        yield lists, recv
        for a, b in self._more_rounds(recv, cap):
            lists = lists_for(a, b)
            recv = exchange(lists, recv["staged"])
            yield lists, recv

    def _normal_capacity(self, rid: int, fmt: P.RowFormat) -> int:
        """Rows per source that one exchange of a normal call can carry (at least one, else ValueError)."""
        if self.num_nvl_bytes == 0:
            raise ValueError("this Buffer has no normal-mode region (num_nvl_bytes=0 in low-latency mode, as in "
                             "DeepEP): dispatch and combine need Buffer(group, num_nvl_bytes=...), e.g. "
                             "Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R)")
        cap = self._region(rid).capacity(fmt)
        if cap < 1:
            raise ValueError(f"a {P.REGION_NAMES[rid]} row of {fmt.row_bytes} B does not fit the Buffer's slots; "
                             f"create it with num_nvl_bytes >= "
                             f"{normal_buffer_bytes(1, fmt.row_bytes, self.group_size)}")
        return cap

    def _rows_from(self, recv: dict, announced: List[int], cap: int) -> List[int]:
        """Rows each source sends in the whole call, as its first control message announced them: a source
        with at most ``cap`` tokens sends them all in the first exchange."""
        for s, n in enumerate(announced):
            if not 0 <= n <= max(recv["num_tokens"][s], 0) or (recv["num_tokens"][s] <= cap and n != recv["nrows"][s]):
                self._broken = "bad row counts"
                raise UBEPError(f"rank {s} announced {n} rows in all for {recv['num_tokens'][s]} tokens and "
                                f"{recv['nrows'][s]} rows now (corrupted control message)")
        return list(announced)

    def _steady_dispatch(self, fmt: P.RowFormat, cap: int, T: int, n_counts: int, send_idx: List[torch.Tensor],
                         words: list, fields_data: list, meta: Optional[torch.Tensor], src_index: torch.Tensor,
                         allocate: Callable, fresh: bool) -> Optional[tuple]:
        """The usual dispatch, in one step of the engine (``run_reorder``): every source sends this rank as
        many rows as in a call of the general way that the Buffer kept (the last two sets of messages, see
        ``_exchange_receive``: the one whose own message is this call's), so every control message repeats
        those (whose checks and layout are kept) but for the per-expert counts and the rank matrix, which
        follow the routing and are read, not expected; the engine sends, checks that the
        messages are those again and reorders the rows into outputs allocated for that layout beforehand, and
        this rank acknowledges every source. Where every rank repeats its routing, the messages are the last
        ones word for word; where the routings are new (``fresh``: this rank's was not sent before), only where
        the rows per rank pair are those again (every token reaching every rank, say): a try that finds
        otherwise pauses the tries of new routings for a number of calls that doubles with each such try in a
        row (1 to 64), so routings whose rows change call after call cost at most one try in 64 calls.

        Returns None where it does not apply, with nothing done; ``(rows from each source, None)`` once the
        call's data has all moved; ``(None, recv)`` where the exchange was sent but its messages or rows did
        not come as expected within the engine's short wait: ``recv`` is what the messages said, received
        the general way, and the caller goes on from there (``_dispatch_rounds``' ``first``: the outputs made
        here are dropped; nothing was acknowledged)."""
        rid, R, me, eng = P.REGION_DISPATCH, self.group_size, self.rank, self.engine
        if meta is None or not hasattr(eng, "reorder_call") or words.__class__ is not list:
            return None
        if fresh and not self._fresh_tries:
            return None
        if fresh and self._fresh_skip[0]:
            self._fresh_skip[0] -= 1
            return None
        lo, hi = P.CTRL_COUNTS, P.CTRL_COUNTS + n_counts + R    # (the words read, not expected)
        kept = self._kept_messages(rid, fmt, n_counts, True, words[0], (lo, hi))
        if kept is None:
            return None
        checked, said = kept
        plan = said.get(("steady", cap, me))
        if plan is None:
            # what the messages must say again, all their words but the checksum (word 3 is every rank's
            # num_worst_tokens: 0) and [lo, hi), and the rows each source sends, where they go: one exchange,
            # every rank's tokens in it
            rows_from = [row[me] for row in said["ntpr_matrix"]]
            fits = max(said["num_tokens"]) <= cap and rows_from == said["nrows"] and min(rows_from) >= 0
            expected = _full_words(checked)
            plan = said["steady", cap, me] = fits and (
                rows_from, list(accumulate(rows_from, initial=0)), expected,
                np.array(expected, dtype=np.int64).tobytes(), [e[lo:hi] for e in expected])
        if not plan:
            return None
        rows_from, off, expected, expected_bytes, kept_free = plan
        recv = {"said": said, "ctrl": expected}
        recv.update(said)
        _, outs, recv_meta, recv_src_idx = allocate(recv)
        meta_out = recv_meta if fmt.meta_words else None
        x = self._exchange_begin(rid, fmt, send_idx, words, T, n_counts, True)
        region, half, local = x["region"], x["half"], self._heap.local
        # the engine's arguments of the last one-step dispatch of these messages in this half of the buffer, made for
        # the row lists and control words (the very objects) of a routing: (row lists, words, call, sources)
        memo = said.get(("dispatch", me, half))
        call, first, route = None if memo is None else memo[2], False, None
        if call is not None and not call.fits(fields_data, meta, outs, meta_out, recv_src_idx):
            call = None
        elif call is not None and (memo[0] is not send_idx or memo[1] is not words):
            # (another routing of the same rows per rank pair: the same call, with this one's row lists)
            route = call.rerouted(x["sels"], x["words"], send_idx[me])
            call = None if route is None else call
        if call is None:
            slots = [region.rows(local, half, s, fmt) for s in range(R)]
            call = eng.reorder_call(
                x["key"], fmt, fields_data, meta, src_index, me, x["flag"], x["sels"], x["words"],
                region.ctrl_sources(local, half), x["nctrl"], expected_bytes, 1 << P.CTRL_CHECKSUM, outs, meta_out,
                recv_src_idx, _STREAM_ROWS, (send_idx[me], off[me]), (lo, hi))
            if call is not None:
                memo = said["dispatch", me, half] = (send_idx, words, call,
                                                     tuple((slots[s].data_ptr(), rows_from[s], off[s], s)
                                                           for s in range(R) if s != me))
                first = True
        status = None
        if call is not None:    # (the sources' lists are advanced by the engine: new ones every call)
            sources = [[p, n, o, 0, s] for p, n, o, s in memo[3]]
            status = eng.run_reorder(call, fields_data, meta, outs, meta_out, recv_src_idx, x["flag"], sources,
                                     self._steady_spin_ns(), first, route)
        if fresh and status == 1:       # (a message not as expected: pause the tries of new routings)
            pause = self._fresh_skip[1] or 1
            self._fresh_skip[:] = [pause, min(2 * pause, 64)]
        elif status == 0:
            self._fresh_skip[:] = [0, 0]
            read = call.words[:, lo:hi].tolist()
            if read != kept_free:     # (other counts than the kept messages': what they say now)
                counts, matrix = [w[:n_counts] for w in read], [w[n_counts:] for w in read]
                if [row[me] for row in matrix] != rows_from:
                    self._broken = "bad row counts"
                    raise UBEPError(f"dispatch on rank {me}: sources sent {rows_from} rows but their rank matrix rows "
                                    f"say {[row[me] for row in matrix]} (corrupted control message)")
                recv.update(said={}, counts=counts, ntpr_matrix=matrix)
        rest = self._steady_rest(x, status, fmt, fields_data, meta, src_index)
        if rest is None:
            recv.update(epoch=x["epoch"], half=half, flag=x["flag"])
            return rows_from, None
        return None, rest

    def _steady_spin_ns(self) -> int:
        """How long a one-step exchange waits for its peers before the call goes on the general way (a quarter of
        the Buffer's deadline at most)."""
        return min(_STEADY_SPIN_NS, int(self.timeout_s * 2.5e8))

    def _one_step_rows(self, fmt: P.RowFormat) -> bool:
        """Whether an exchange of rows of ``fmt`` may take the engine's one-step calls: TFF rows (the calls read
        flags, not checksums or sentinels) and no delay hook (which only the general way's waits call)."""
        return fmt.sync == "tff" and self.delay_hook is None

    def _kept_messages(self, rid: int, fmt: P.RowFormat, n_counts: int, with_matrix: bool, own: tuple,
                       free: Tuple[int, int] = (0, 0)) -> Optional[tuple]:
        """``(checked words, what they said)`` of the last control messages of this kind of exchange that
        ``_exchange_receive`` kept (of its last sets, the most recent) where a one-step exchange may expect them
        again: TFF rows, no delay hook, and this rank's own message of this call (``own``, its words) the one it
        sent then, but for its words [free[0], free[1]) (at or past word 4, which the one-step call reads
        instead of expecting); else None."""
        kept = self._ctrl_seen.get((rid, fmt, n_counts, with_matrix))
        if kept is None or not self._one_step_rows(fmt):
            return None
        mine = _checked_words(list(own), len(own))
        # (the checked words leave out words 2 and 3: the free range's place among them)
        lo, hi = (max(i - (P.CTRL_NUM_EXPERTS - P.CTRL_CHECKSUM), 0) for i in free)
        return next((entry for entry in kept
                     if entry[0][self.rank][:lo] == mine[:lo] and entry[0][self.rank][hi:] == mine[hi:]), None)

    def _steady_rest(self, x: dict, status: Optional[int], fmt: P.RowFormat, fields_data, meta,
                     src_index) -> Optional[dict]:
        """After the engine's one-step exchange of ``x`` (``_exchange_begin``) ended with ``status``: None once
        it moved everything (every source acknowledged: its slots may be written again); else what the
        messages said, received the general way (the exchange sent first where the engine did not: None)."""
        if status == 0:
            self._send_acks(x["rid"], range(self.group_size), x["epoch"])
            return None
        staged = self._exchange_send(x, fmt, fields_data, meta, src_index, None) if status is None else None
        return self._exchange_receive(x, fmt, staged)

    def _dispatch_rounds(self, rid: int, fmt: P.RowFormat, cap: int, T: int, send_idx: List[torch.Tensor],
                         exchange: Callable, allocate: Callable, local_copy: Callable,
                         own_src: Optional[tuple] = None, first: Optional[dict] = None) -> List[int]:
        """The exchanges of one dispatch, each reordered as it arrives (see ``_more_rounds``).

        ``exchange(lists, staged)`` sends this rank's rows ``lists[d]`` (sorted staging rows) to every rank d
        (see ``_exchanges``); ``allocate(recv)`` sizes the outputs from the first one and returns (rows from
        each source in all, the outputs' byte views, meta and source-token outputs); this rank's own rows
        come from ``local_copy(at, rows)``, or in the engine's reordering step from ``own_src`` (see
        ``_receive_rows``). Returns the rows from each source. ``first``: what the first exchange said, where it
        was made already (see ``_exchanges``)."""
        R, me = self.group_size, self.rank
        rows_from = None
        for lists, recv in self._exchanges(
                cap, lambda a, b: send_idx if a == 0 and T <= cap else _token_slices(send_idx, a, b), exchange,
                first):
            if rows_from is None:
                rows_from, outs, recv_meta, recv_src_idx = allocate(recv)
                off = list(accumulate(rows_from, initial=0))
                done = [0] * R
            nrows = recv["nrows"]
            if any(nrows[s] > rows_from[s] - done[s] for s in range(R)):
                self._broken = "bad row counts"
                raise UBEPError(f"{P.REGION_NAMES[rid]} on rank {me}: sources sent {nrows} more rows after {done} "
                                f"of {rows_from} (corrupted control message or mismatched handles)")
            self._receive_rows(rid, fmt, recv, [off[s] + done[s] for s in range(R)], outs, recv_meta, recv_src_idx,
                               local_copy=lambda o, n, own=lists[me]: local_copy(o, own),
                               own=None if own_src is None else (own_src, lists[me]))
            done = [a + b for a, b in zip(done, nrows)]
        if done != rows_from:
            self._broken = "bad row counts"
            raise UBEPError(f"{P.REGION_NAMES[rid]} on rank {me}: sources sent {done} rows, announced {rows_from}")
        return rows_from

    def _receive_rows(self, rid: int, fmt: P.RowFormat, recv: dict, offsets: Sequence[int], outs, recv_meta,
                      recv_src_idx, reduce: Optional[Callable] = None,
                      local_copy: Optional[Callable] = None, own: Optional[tuple] = None) -> None:
        """Token-Reordering: copy each source's rows out as they arrive.

        Runs of complete rows are copied while the source still writes the rest where the engine can tell
        them apart (see ``_next_run``); otherwise a source's rows once all its blocks are there. This rank's
        own rows never went through the slots: ``local_copy(offset, n)`` takes them from the source tensors,
        or, where the engine's streaming step copies them, ``own = ((fields, meta), rows)`` names the source
        tensors (see ``reorder_sources``) and the rows of them.
        ``reduce(rows)`` replaces the copies (combine): it gets every source's rows at once, in rank order
        (None for this rank's own), once all have arrived, so a reduction reads each token's rows in one
        pass and its result does not depend on the sync mode or the arrival order.
        """
        R = self.group_size
        region = self._region(rid)
        half, flag, epoch = recv["half"], recv["flag"], recv["epoch"]
        local = self._heap.local
        eng = self.engine
        phase = _REORDER_PHASE[rid]
        step = None if reduce is not None else eng.reorder_sources(
            fmt, outs, recv_meta if fmt.meta_words else None, recv_src_idx, _STREAM_ROWS,
            None if own is None else own[0])
        if step is not None:     # every source's newly complete rows in one engine call per poll
            me, nrows = self.rank, recv["nrows"]
            # (each source's slots from their first row: the exchange checked that its rows fit them)
            pending = [[region.rows(local, half, s, fmt).data_ptr(), nrows[s], int(offsets[s]), 0, s,
                        recv["ways"][s]] for s in range(R) if s != me]
            # this rank's own rows, straight from the source: in the first poll
            if not nrows[me]:
                own_args = ()
            elif own is not None and getattr(step, "copies_own", False):
                own_args = ((own[1], int(offsets[me])),)
            else:
                own_args = ()
                local_copy(int(offsets[me]), nrows[me])

            first = True

            def poll_sources():
                nonlocal first
                if first:
                    completed = [*step(pending, flag, *own_args), me]     # (this rank's own rows are done too)
                    first = False
                else:
                    completed = step(pending, flag)
                if completed:
                    self._send_acks(rid, completed, epoch)
                    pending[:] = [p for p in pending if p[3] < p[1]]
                return [p[4] for p in pending]
            self._wait(phase, poll_sources)
            return
        done = set()
        progress = {}                     # source -> rows already reordered (streaming)
        arrived = {}                      # reduce: source -> its rows (None: this rank's own)

        def reorder(s: int, rows: torch.Tensor, lo: int, hi: int) -> None:
            """Rows [lo, hi) of source s to their places in the outputs."""
            o = int(offsets[s])
            rows = rows[lo:hi]
            part = [t[o + lo:o + hi] for t in outs]
            meta_part = recv_meta[o + lo:o + hi] if recv_meta is not None and fmt.meta_words else None
            src_part = recv_src_idx[o + lo:o + hi] if recv_src_idx is not None else None
            if not eng.unpack_to(fmt, rows, None, part, meta_part, src_part):
                meta = eng.unpack_rows(fmt, rows, part)
                if meta_part is not None:
                    meta_part.copy_(meta)
                if src_part is not None and hi > lo:
                    src_part.copy_(rows[:, 0, :].view(torch.int64)[:, 1])

        def poll():
            missing = []
            for s in range(R):
                if s in done:
                    continue
                n = recv["nrows"][s]
                if s == self.rank:
                    if reduce is not None:
                        arrived[s] = None
                    else:
                        if n:
                            local_copy(int(offsets[s]), n)
                        self._send_ack(rid, s, epoch)
                    done.add(s)
                    continue
                rows = region.rows(local, half, s, fmt, n)
                expected = recv["ctrl"][s][P.CTRL_CHECKSUM]
                if reduce is not None:
                    if not eng.rows_arrived(fmt, rows, flag, expected):
                        missing.append(s)
                        continue
                    arrived[s] = rows
                    done.add(s)
                    continue
                start = progress.get(s, 0)
                end = _next_run(eng, fmt, rows, flag, start, expected)
                if end > start:
                    reorder(s, rows, start, end)
                    progress[s] = end
                if end < n:
                    missing.append(s)
                    continue
                done.add(s)
                self._send_ack(rid, s, epoch)
            if reduce is not None and not missing:
                reduce([arrived[s] for s in range(R)])
                self._send_acks(rid, range(R), epoch)     # (the slots may be written again once acknowledged)
            return missing
        self._wait(phase, poll)

    # ================================================================== normal combine
    @_collective
    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]] = None,
                config: Optional[Config] = None, previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Send rows back to the ranks they came from and sum them there (unweighted).

        Args:
            x: [N_recv, H] rows in the order ``dispatch`` returned them (expert-major order for an
                expert-major handle: rows of the same token are summed on this rank first, in float32, and
                rounded to x's dtype before the ranks' rows are summed).
            handle: the dispatch handle.
            topk_weights: optional [N_recv, K] float32 reduced the same way.
            bias: a [T, H] tensor or a pair of them, summed first (as DeepEP sums: the biases, then the ranks'
                rows in rank order, in float32 with one rounding).
        Returns:
            ``(combined_x [T, H] in x's dtype, combined_topk_weights [T, K] or None, event)``.
        """
        self._check_usable()
        plan = self._repeated_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                      allocate_on_comm_stream)
        if plan is not None:
            self._apply_config(None)
            return self._combine_with(x, handle, handle, handle.pair, None, [], plan[0], plan[1], async_finish)
        _check_overlap(previous_event, async_finish, allocate_on_comm_stream)
        self._apply_config(config)
        # the dispatch this combine answers, for the peers to check (see _dispatch_pair)
        paired = handle.pair if handle.__class__ is DispatchHandle else self._dispatch_pair(handle)
        handle = self._as_dispatch_handle(handle)
        if not isinstance(x, torch.Tensor):
            hint = " (combine takes the expert outputs in bfloat16 or another float type, never an (fp8, scales) " \
                "pair: ubep_torch.per_token_cast_back turns one back into bf16)" if isinstance(x, tuple) else ""
            raise TypeError(f"combine x must be a tensor, got {type(x).__name__}{hint}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"combine x must be bfloat16, float32, float16 or float64, got {x.dtype}")
        if x.dim() != 2:
            raise ValueError(f"combine x must be [num_recv_tokens, hidden], got {tuple(x.shape)}")
        base = handle
        if handle.layout == "expert_major":
            base = handle.base_handle
            if x.shape[0] != handle.row_index.numel():
                raise ValueError(f"combine x has {x.shape[0]} rows but the expert-major handle has "
                                 f"{handle.row_index.numel()}")
            valid = handle.row_index >= 0
            acc = torch.zeros(base.num_recv, x.shape[1], dtype=torch.float32 if x.dtype != torch.float64
                              else torch.float64)
            acc.index_add_(0, handle.row_index[valid], x[valid].to(acc.dtype))
            x = acc.to(x.dtype)
            if topk_weights is not None:
                raise ValueError("topk_weights are not reduced for expert-major handles; weight rows before")
        # a handle rebuilt from its tuple entries alone (num_worst_tokens None) does not know the worst size
        rows_expected = x.shape[0] if base.num_worst_tokens is None and x.shape[0] > base.num_recv else \
            base.num_worst_tokens or base.num_recv
        if x.shape[0] not in (base.num_recv, rows_expected):
            raise ValueError(f"combine x has {x.shape[0]} rows; the handle received {base.num_recv}")
        x = _resolved(x if x.shape[0] == base.num_recv else x[: base.num_recv]).contiguous()
        T, H = base.num_tokens, x.shape[1]
        K = 0
        if topk_weights is not None:
            if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in (torch.float32,
                                                                                          torch.float64):
                raise TypeError("topk_weights must be a float32 (or float64) tensor")
            if topk_weights.dim() != 2 or topk_weights.shape[0] not in (base.num_recv, rows_expected):
                raise ValueError(f"topk_weights must be [{base.num_recv}, K], got {tuple(topk_weights.shape)}")
            topk_weights = _resolved(topk_weights[: base.num_recv]).contiguous()
            K = topk_weights.shape[1]
        biases = []
        if isinstance(bias, tuple) and len(bias) > 2:
            raise ValueError(f"bias must be a [T, H] tensor or a pair of them (as DeepEP takes it), got a tuple "
                             f"of {len(bias)}")
        if bias is not None:
            for b in (bias if isinstance(bias, tuple) else (bias,)):
                if b is None:
                    continue
                if not isinstance(b, torch.Tensor) or tuple(b.shape) != (T, H):
                    raise ValueError(f"bias must be a [{T}, {H}] tensor (or a pair of them)")
                if b.dtype not in _FLOAT_DTYPES:
                    raise TypeError(f"bias must be bfloat16, float32, float16 or float64, got {b.dtype}")
                biases.append(_resolved(b))
        wsz = topk_weights.element_size() // 4 if K else 0
        fmt = P.row_format(self.sync, (("x", H * x.element_size()),), K * wsz,
                           f"{x.dtype}/{K}/{topk_weights.dtype if K else None}")
        fmt.check_fits()
        cap = self._normal_capacity(P.REGION_COMBINE, fmt)
        # (the rows of a plain combine, which a later call may repeat: see _repeated_combine)
        self._combine_plan = (fmt, cap, x.dtype, H) if not K and not biases and base is handle else None
        return self._combine_with(x, handle, base, paired, topk_weights, biases, fmt, cap, async_finish)

    def _repeated_combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                          allocate_on_comm_stream) -> Optional[tuple]:
        """The plan of the last plain combine (``_combine_plan``: its rows' format and capacity, dtype and hidden
        size; no weights or bias, a rank-major handle) where this call is one of the same form: no weights, bias,
        config or event, flags False, a handle object one of this Buffer's recent dispatches returned
        (rank-major), and x a contiguous tensor of its dtype and hidden size with the handle's rows. Else None:
        the call takes the full checks."""
        p = self._combine_plan
        if p is None or topk_weights is not None or bias is not None or config is not None \
                or previous_event is not None or async_finish is not False or allocate_on_comm_stream is not False \
                or handle.__class__ is not DispatchHandle or handle.layout != "rank_major" \
                or not _returned_by(self, handle):
            return None
        if x.__class__ is not _TENSOR or x.dtype is not p[2] or x.shape != (handle.num_recv, p[3]) \
                or not x.is_contiguous() or x.is_neg():
            return None
        return p

    def _combine_with(self, x: torch.Tensor, handle: "DispatchHandle", base: "DispatchHandle", paired: int,
                      topk_weights: Optional[torch.Tensor], biases: list, fmt: P.RowFormat, cap: int,
                      async_finish: bool):
        """The rest of ``combine`` once its arguments are checked: ``x`` [num_recv, H] contiguous (summed per
        token first for an expert-major handle, whose ``base`` is the rank-major one), ``topk_weights``
        contiguous or None, ``biases`` a list of [T, H] tensors, ``fmt`` and ``cap`` its rows' format and
        capacity."""
        R, T, H = self.group_size, base.num_tokens, x.shape[1]
        K, meta_words = (0, 0) if topk_weights is None else (topk_weights.shape[1], fmt.meta_words)
        # Destination d gets back the rows that came from d, in d's send order. An exchange carries the rows
        # of d's tokens in one range (see _more_rounds): rows [lo, hi) of x, found among d's rows by their
        # source token; this rank's tokens in that range come back from every rank in the same exchange, so
        # the reduction order per token does not depend on the number of exchanges.
        bounds = base.recv_offsets
        whole = [(bounds[d], bounds[d + 1]) for d in range(R)]
        peer_tokens = getattr(base, "peer_tokens", None)
        ids = {}

        def lists_for(a: int, b: int):
            # (rows of x to send back to each rank, this rank's tokens that come back from each rank, the
            # range of this rank's tokens)
            if a == 0 and peer_tokens is not None and max(peer_tokens) <= cap:
                rows = whole
            else:
                if not ids:     # (the handle's own copy: writes into its recv_src_idx entry change nothing)
                    ids["src"] = base.src_tokens
                rows = []
                for d in range(R):
                    lo, hi = _token_range(ids["src"][bounds[d]:bounds[d + 1]], a, b)
                    rows.append((bounds[d] + lo, bounds[d] + hi))
            toks = base.send_idx if a == 0 and T <= cap else _token_slices(base.send_idx, a, b)
            return rows, toks, (min(a, T), min(b, T))

        def exchange(lists, staged):
            send = [eng.span(lo, hi) for lo, hi in lists[0]]
            return self._exchange(P.REGION_COMBINE, fmt, [P.as_bytes(x)], meta, src_index, send,
                                  lambda d: [int(send[d].numel()), sig, 0, paired, 0, 0], T, staged=staged)

        meta = P.fresh(topk_weights).view(torch.int32).view(-1, meta_words) if K else None
        src_index = self.engine.arange(base.num_recv)
        sig = fmt.signature()
        eng = self.engine
        wacc = torch.zeros(T, K, dtype=topk_weights.dtype) if K else None
        out = self._out.empty((T, H), x.dtype)
        me = self.rank

        def reduce(x_rows, toks, a: int, b: int, recv: dict, slot_rows: List[Optional[torch.Tensor]]) -> None:
            # Every source's rows of tokens [a, b), in rank order; this rank's own straight from x. (A token's
            # rows all come in one exchange, so the sum does not depend on the number of exchanges.)
            rows = [x[x_rows[me][0]:x_rows[me][1]] if r is None else r for r in slot_rows]
            tok = [t if a == 0 else t - a for t in toks]
            # (for the store policy: the peers' rows the sum reads, if their senders stored them one way)
            ways = {recv["ways"][s] for s, r in enumerate(slot_rows) if r is not None and r.shape[0]}
            read = (recv["flag"], ways.pop(), sum(r.shape[0] for r in slot_rows if r is not None) * fmt.row_bytes) \
                if len(ways) == 1 else None
            # (the biases first, then the ranks' rows in rank order: DeepEP's order of additions)
            eng.reduce_sources(fmt, [(bias[a:b], None) for bias in biases] + list(zip(rows, tok)), out[a:b],
                               read)
            settle(x_rows, toks, slot_rows)

        def settle(x_rows, toks, slot_rows: List[Optional[torch.Tensor]]) -> None:
            # the weights of every source's rows summed in the same order; SP slots re-armed
            for s, r in enumerate(slot_rows):
                if K:
                    w = topk_weights[x_rows[s][0]:x_rows[s][1]] if r is None else \
                        P.fresh(r[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, :meta_words]).view(wacc.dtype)
                    wacc.index_add_(0, toks[s], w)
                if r is not None:
                    eng.rearm(fmt, r)

        first = None
        if not K and not biases and base is handle:
            done, first = self._steady_combine(fmt, cap, T, x, base, paired, out) or (False, None)
            if done:
                self._call_complete("combine")
                self._report("combine", base.topk_idx, base.num_experts, H, H * x.element_size(),
                             token_in_rank=base.token_in_rank)
                return out, wacc, _event(async_finish)
        for (x_rows, toks, (a, b)), recv in self._exchanges(cap, lists_for, exchange, first):
            self._check_pairing("combine", recv["ctrl"], paired)
            expect = [t.numel() for t in toks]
            if recv["nrows"] != expect:
                self._broken = "combine layout mismatch"
                raise UBEPError(f"combine on rank {self.rank}: peers returned {recv['nrows']} rows, the handle "
                                f"sent {expect} (was the handle from the latest matching dispatch?)")
            # every token of this rank in this exchange: where the engine can, one C poll checks that the rows
            # of every source are there and then sums them, reading the slots in place
            poll = None if (a, b) != (0, T) or not hasattr(eng, "reduce_poller") else self._reduce_poller(
                recv, fmt, out, biases, x, x_rows[me][0], toks)
            if poll is None:
                self._receive_rows(P.REGION_COMBINE, fmt, recv, None, None, None, None,
                                   reduce=functools.partial(reduce, x_rows, toks, a, b, recv))
                continue
            self._wait(_REORDER_PHASE[P.REGION_COMBINE],
                       functools.partial(poll, recv["flag"]))
            if K:
                settle(x_rows, toks, [None if s == me else self._region(P.REGION_COMBINE).rows(
                    self._heap.local, recv["half"], s, fmt, expect[s]) for s in range(R)])
            self._send_acks(P.REGION_COMBINE, range(R), recv["epoch"])    # (the slots may be written again)
        self._call_complete("combine")
        self._report("combine", base.topk_idx, base.num_experts, H, H * x.element_size(),
                     token_in_rank=base.token_in_rank)
        return out, wacc, _event(async_finish)

    def _steady_combine(self, fmt: P.RowFormat, cap: int, T: int, x: torch.Tensor, base: "DispatchHandle", paired: int,
                        out: torch.Tensor) -> Optional[tuple]:
        """The usual combine (rows of one exchange, unweighted, no bias), in one step of the engine
        (``run_combine``) where every control message repeats the last ones but for the dispatch each
        names (word 3, which must be this rank's ``paired`` where that is known), as ``_steady_dispatch``
        does for dispatch: the engine sends ``x``'s rows back, checks the messages and sums every rank's rows
        into ``out`` once they are all there, and this rank acknowledges every source.

        Returns None where it does not apply, with nothing done; ``(True, None)`` once ``out`` holds the sum;
        ``(False, recv)`` where the exchange was sent but its messages or rows did not come as expected within
        the engine's short wait: ``recv`` is what the messages said, received the general way."""
        rid, R, me, eng = P.REGION_COMBINE, self.group_size, self.rank, self.engine
        peer_tokens = getattr(base, "peer_tokens", None)
        if x.dtype != torch.bfloat16 or not hasattr(eng, "combine_call") or T > cap or peer_tokens is None \
                or max(peer_tokens) > cap:
            return None
        toks, bounds = base.send_idx, base.recv_offsets
        words = [(bounds[d + 1] - bounds[d], fmt.signature(), 0, paired, 0, 0, T)
                 for d in self._send_order]
        kept = self._kept_messages(rid, fmt, 0, False, words[0])
        if kept is None:
            return None
        checked, said = kept
        # the engine's arguments of the last one-step combine of these messages, for each buffer half, where this
        # one answers a dispatch of the same rows per rank pair: (the last call's row lists, row bounds, the spans
        # sent, {half: CombineCall, or False once one call made its arguments for itself alone})
        memo = said.get(("combine", me))
        if memo is None or memo[0] is not toks or memo[1] != bounds:
            # (each rank returns the rows of this rank's tokens; lists the engine reads as they are)
            if said["nrows"] != [t.numel() for t in toks] or \
                    not all(t.dtype is torch.int64 and t.is_contiguous() for t in toks):
                return None
            # (another routing of the same rows per rank pair keeps the calls, which then sum by its token lists)
            memo = said["combine", me] = (toks, bounds, [eng.span(bounds[d], bounds[d + 1]) for d in range(R)], {}) \
                if memo is None or memo[1] != bounds or not self._fresh_tries else (toks,) + memo[1:]
        expected = said.get(("steady", me))
        if expected is None:
            expected = said["steady", me] = np.array(_full_words(checked), dtype=np.int64)
        want = expected.copy()
        want[:, P.CTRL_PAIRED_CALL] = paired
        skip = 1 << P.CTRL_CHECKSUM | (0 if paired else 1 << P.CTRL_PAIRED_CALL)   # (0: a handle that cannot tell)
        fields_data, src_index = [P.as_bytes(x)], eng.arange(base.num_recv)
        xs = self._exchange_begin(rid, fmt, memo[2], words, T, 0, False)
        half, spin = xs["half"], self._steady_spin_ns()
        call, first = memo[3].get(half), False
        if not call or not call.fits(fields_data[0], out):
            region, local = xs["region"], self._heap.local
            slots = [region.rows(local, half, s, fmt) for s in range(R)]    # (held while the engine reads them)
            sources = [(x, bounds[me], said["nrows"][me], toks[me]) if s == me else
                       (s, slots[s].data_ptr(), said["nrows"][s], toks[s], 0) for s in range(R)]
            # (kept from the second call of these messages on: a routing that changes every call, and so its
            # messages, pays nothing for it; None: not seen in this half yet, False: seen once)
            keep = call is not None
            call = eng.combine_call(xs["key"], fmt, fields_data, src_index, me, xs["flag"], xs["sels"], xs["words"],
                                    region.ctrl_sources(local, half), xs["nctrl"], want.nbytes, out, sources, keep)
            if call is not None:
                memo[3][half], first = call if keep else False, True
        status = None if call is None else eng.run_combine(call, fields_data[0], out, xs["flag"], xs["words"],
                                                           want.tobytes(), skip, spin, first, toks)
        rest = self._steady_rest(xs, status, fmt, fields_data, None, src_index)
        return rest is None, rest

    def _reduce_poller(self, recv: dict, fmt: P.RowFormat, out: torch.Tensor, biases: list, x: torch.Tensor,
                       first: int, toks: list):
        """The engine's C poll-and-sum of a one-exchange combine (``NativeEngine.reduce_poller``): the biases,
        then every rank's rows in rank order, this rank's own from ``x[first:]``; ``toks[s]`` are the tokens
        of rank s's rows. None where the engine cannot take these sources."""
        region, local, half, me = self._region(P.REGION_COMBINE), self._heap.local, recv["half"], self.rank
        sources = [(bias, 0, bias.shape[0], None) for bias in biases]
        for s, tok in enumerate(toks):
            n = recv["nrows"][s]
            sources.append((x, first, n, tok) if s == me else
                           (s, region.rows(local, half, s, fmt).data_ptr(), n, tok, recv["ways"][s]))
        return self.engine.reduce_poller(fmt, out, sources)

    # ================================================================== low-latency dispatch
    @_collective
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Low-latency dispatch: one row per (token, selected expert), packed per local expert.

        Args:
            x: [T, H] bfloat16, T <= num_max_dispatch_tokens_per_rank (N, equal on all ranks).
            topk_idx: [T, K] int64 (-1 = none). num_experts: E.
            cumulative_local_expert_recv_stats: optional [E_local] int32, incremented by the counts.
            dispatch_wait_recv_cost_stats: optional [R] int64, incremented by the ns waited per source.
            use_fp8: send fp8 e4m3 with per-128-channel float32 scales (round_scale: powers of two;
                use_ue8m0: scales as packed UE8M0 exponents, int32 [.., H/512]). As in DeepEP, the scales'
                last two dimensions are column-major (a transposed view of [E_local, groups, R*N]; with one
                group, standard strides).
            return_recv_hook: issue the sends only; the data is valid after ``hook()``.
        Returns:
            ``(recv_x [E_local, R*N, H] bf16 or (fp8, scales), recv_count [E_local] int32, handle, event, hook)``.
        """
        self._check_usable()
        self._apply_config(None)     # (the Buffer's count group: a normal call's Config was for that call)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are exclusive")
        _check_flags(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0, async_finish=async_finish,
                     return_recv_hook=return_recv_hook)
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0 needs round_scale=True")
        N = check_count("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        E = self._check_num_experts(num_experts, low_latency=True)
        if isinstance(x, tuple):
            raise TypeError("low_latency_dispatch takes bfloat16 x and quantizes it itself with use_fp8=True (an "
                            "(fp8, scales) pair is normal dispatch's input: ubep_torch.per_token_cast_back "
                            "turns one back into bf16)")
        if not isinstance(x, torch.Tensor):
            raise TypeError("x must be a tensor")
        if x.dtype != torch.bfloat16:
            hint = " (fp8 rows: ubep_torch.per_token_cast_back makes bf16 of them; use_fp8=True quantizes)" \
                if x.dtype == FP8 else ""
            raise TypeError(f"low_latency_dispatch takes bfloat16 x, got {x.dtype}{hint}")
        if x.dim() != 2:
            raise ValueError(f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
        T, H = x.shape
        if T > N:
            raise ValueError(f"{T} tokens > num_max_dispatch_tokens_per_rank={N} (rank {self.rank})")
        if use_fp8 and H % 128:
            raise ValueError(f"use_fp8 needs a hidden size divisible by 128, got {H}")
        if use_ue8m0 and H % 512:
            raise ValueError(f"use_ue8m0 needs a hidden size divisible by 512, got {H}")
        topk_idx = self._check_topk(topk_idx, E, values=False)    # ids: checked by pair_order below
        if topk_idx.shape[0] != T:
            raise ValueError(f"topk_idx has {topk_idx.shape[0]} rows but x has {T}")
        K = topk_idx.shape[1]
        if K > _LL_MAX_TOPK:
            raise ValueError(f"low-latency mode supports top-k up to {_LL_MAX_TOPK}, got {K}")
        eng = self.engine
        # (token, expert) pairs sorted by destination rank, local expert, token; checks repeated experts
        t_idx, k_idx, g, counts, pos = eng.pair_order(topk_idx, E)
        R, me = self.group_size, self.rank
        E_local = E // R
        _check_stats("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, E_local)
        _check_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, R)
        if cumulative_local_expert_recv_stats is not None and dispatch_wait_recv_cost_stats is not None and \
                share_memory(cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, elementwise=True):
            raise ValueError("cumulative_local_expert_recv_stats and dispatch_wait_recv_cost_stats overlap in memory; "
                             "the call would add token counts and nanoseconds into the same words")
        x = _resolved(x).contiguous()
        if use_fp8:
            # (into reused outputs: the rows of a call's fp8 copy of x are read until its recv hook ran)
            xq, sc = low_latency_cast_to_fp8(x, round_scale, out=(self._out.empty((T, H), FP8),
                                                                  self._out.empty((T, H // 128), torch.float32)))
            fields_data = [P.as_bytes(xq), P.as_bytes(sc)]
            fields = (("x", H), ("scales", (H // 128) * 4))
        else:
            fields_data = [P.as_bytes(x)]
            fields = (("x", H * 2),)
        # Engines that store rows straight from x (torch, C) send one row per (token, destination rank) and
        # list the token's (local expert, top-k slot, segment position) pairs on that rank in its meta
        # items; kernel engines send one row per (token, expert) pair, its top-k slot in meta item 0.
        dedup = eng.direct_rows
        fmt = P.row_format(self.sync, fields, 1 + 2 * K if dedup else 1)
        region = self._region(P.REGION_LL_DISPATCH)
        if region.capacity(fmt) < E_local * N:
            raise ValueError(f"the low-latency buffer holds {region.capacity(fmt)} rows per source but "
                             f"E_local*N = {E_local * N} are needed (num_max_dispatch_tokens_per_rank={N}, "
                             f"num_experts={E} or hidden={H} larger than the buffer was sized for?); use "
                             f"num_rdma_bytes >= {self._ll_bytes(N, H, E)}")
        self._check_in_flight(P.REGION_LL_DISPATCH)
        counts = counts.view(R, E_local)
        counts_l = counts.tolist()
        bounds = list(accumulate(map(sum, counts_l), initial=0))
        # staging holds one row per token with zero meta items; each destination slot gets its items patched in
        src_index = self.engine.arange(T)
        send_idx = [t_idx[bounds[d]:bounds[d + 1]] for d in range(R)]
        pair_k = [k_idx[bounds[d]:bounds[d + 1]] for d in range(R)]
        if dedup:
            row_tokens, row_items = eng.token_rows(t_idx, k_idx, g, counts, T, K)
        else:
            row_tokens, row_items = send_idx, [k.to(torch.int32) for k in pair_k]
        nrows_l = [r.numel() for r in row_tokens]
        rid = P.REGION_LL_DISPATCH
        epoch = self._next_epoch(rid)
        half, flag = region.half(epoch), P.flag_word(epoch, rid)
        staging, checked, row_sums = eng.stage_rows(fmt, fields_data, None, src_index, me)
        self._wait_acks(rid, epoch)
        nctrl = P.ctrl_blocks(E_local)
        sig = fmt.signature()

        def ctrl_payload(d):
            return [nrows_l[d], sig, 0, bounds[d], E, N] + counts_l[d]
        job = SendJob(fmt, staging, checked, row_sums, flag,
                      sync_all=lambda: self._sync_all("low_latency_dispatch: SyncAll after Token-Sending",
                                                      P.REGION_LL_DISPATCH))
        # torch and C paths: this rank's own rows skip the slots (the receive side copies them straight from
        # x, or from its fp8 copy); the kernels' decomposed receive reads every source from the slots. Not
        # bf16 rows with a recv hook: the caller may write x before the hook runs, and the rows must be those
        # of the call
        local_direct = eng.direct_rows and (use_fp8 or not return_recv_hook)
        none = eng.span(0, 0)
        for i in range(R):
            d = (me + i) % R
            peer = self._peer_mem[d]
            sel = none if d == me and local_direct else row_tokens[d]
            job.dests.append(Destination(d, sel, region.rows(peer, half, me, fmt, nrows_l[d]),
                                         region.ctrl(peer, half, me, nctrl), ctrl_payload(d),
                                         meta_patch=row_items[d][:sel.numel()]))
        self._note_send(job)
        eng.send_phase(job)
        local_x = (xq, sc) if use_fp8 else (x, None)

        if use_fp8:
            recv_x = self._out.empty((E_local, R * N, H), FP8)
            recv_sc = self._out.zeros((E_local, R * N, H // 128), torch.float32)
        else:
            recv_x = self._out.empty((E_local, R * N, H), torch.bfloat16)
            recv_sc = None
        recv_count = torch.zeros(E_local, dtype=torch.int32)
        src_info = torch.full((E_local, R * N), -1, dtype=torch.int32)
        src_k = torch.full((E_local, R * N), -1, dtype=torch.int32)
        layout_range = torch.zeros(E_local, R, dtype=torch.int64)
        return_slot = torch.zeros(R, dtype=torch.int64)   # where each source wants its rows back (combine)
        handle = LowLatencyHandle((src_info, layout_range, N, H, E), src_k=src_k, K=K, epoch=epoch,
                                  num_tokens=T, recv_count=recv_count, return_slot=return_slot,
                                  sent_counts=counts, sent_rows=[bounds[d + 1] - bounds[d] for d in range(R)],
                                  pos=pos, n_pairs=int(t_idx.numel()), recv_rows=0,
                                  topk_snapshot=topk_idx.clone())
        self._recent_ll_handles.append(handle)
        pending = handle.pending = _Pending("low_latency_dispatch", epoch, call=self._calls, seq=self._seq,
                                            pair=self._pair_tag | self._calls)
        wait_ns = [0] * R            # per source: ns from the start of the receive until its rows were in
        flat_info, flat_k = src_info.view(-1), src_k.view(-1)
        flat_outs = [P.as_bytes(recv_x.view(E_local * R * N, -1))] + (
            [P.as_bytes(recv_sc.view(E_local * R * N, -1))] if recv_sc is not None else [])

        def one_step(local: torch.Tensor) -> bool:
            """The receive in one engine call where it applies (TFF rows of one row per token): True once every
            source's rows are in and acknowledged; False where it does not apply, or where a message or rows
            did not come as expected within the engine's short wait (nothing acknowledged: the general way
            below receives the call, and names what was wrong)."""
            if not (dedup and self._one_step_rows(fmt) and self._ll_one_step and hasattr(eng, "ll_dispatch_receive")):
                return False
            expected = region.kept(("ll expect", sig, E, N, E_local), lambda: np.array(
                [[0, sig, 0, 0, E, N] + [0] * E_local] * R, dtype=np.int64).tobytes())
            own = ([P.as_bytes(t) for t in local_x if t is not None], send_idx[me], pair_k[me]) \
                if local_direct else None
            waited = torch.zeros(R, dtype=torch.int64)
            status = eng.ll_dispatch_receive(
                fmt, region.ctrl_sources(local, half), nctrl, expected, flag, region.rows(local, half, 0, fmt),
                region.part_bytes, N, K, me, flat_outs, own,
                (torch.empty(3, R, E_local, dtype=torch.int64), layout_range, recv_count, flat_info, flat_k,
                 return_slot, waited), self._steady_spin_ns())
            if status != 0:
                return False
            handle.recv_rows = sum(recv_count.tolist())
            wait_ns[:] = waited.tolist()
            self._send_acks(rid, range(R), epoch)
            return True

        def finish() -> None:
            self._check_peers("low_latency_dispatch", pending.call)
            if cumulative_local_expert_recv_stats is not None:
                _add_stats(cumulative_local_expert_recv_stats, recv_count.tolist())
            if dispatch_wait_recv_cost_stats is not None:
                _add_stats(dispatch_wait_recv_cost_stats, wait_ns)
            handle.layout_snapshot = layout_range.clone()    # (a combine checks that the caller left it as is)
            pending.done = True
            self._pending = [p for p in self._pending if not p.done]
            self._report("low_latency_dispatch", topk_idx, E, H, fmt.fields[0][1] + (
                fmt.fields[1][1] if use_fp8 else 0))

        def receive():
            if pending.done:     # (a cancelled call's hook raises before it gets here: see _collective)
                return
            self._check_usable()
            local = self._heap.local
            if one_step(local):
                return finish()
            t0 = time.perf_counter_ns()
            ctrl_words = self._wait_ctrl(region, half, nctrl, flag,
                                         "low_latency_dispatch: TokenCnt (waiting for the count messages)")
            if self.sync == "sw":
                self._sync_all("low_latency_dispatch: SyncAll after flag verification", P.REGION_LL_DISPATCH)
            self._check_layouts(ctrl_words, fmt, "low_latency_dispatch")
            self._check_call_words(ctrl_words, "low_latency_dispatch")
            slots_l = [ctrl_words[s][P.CTRL_RETURN_SLOT] for s in range(R)]
            # CalCumSum: per-expert counts of every source ([R, E_local]), the packed begin of every (source,
            # expert) segment in recv_x[expert] and its flat row in recv_x; fills layout_range and recv_count
            # (a message the checks below reject leaves them filled: the Buffer is broken then, and the call
            # returns nothing)
            try:
                cnt, begin, seg_first, pairs = eng.ll_calcumsum(region.ctrl_sources(local, half), nctrl,
                                                                P.CTRL_COUNTS, E_local, N, layout_range, recv_count)
            except ValueError as e:
                self._broken = "bad counts"
                raise UBEPError(f"low_latency_dispatch on rank {me}: {e} (corrupted control message)") from None
            nrows = [ctrl_words[s][P.CTRL_NROWS] for s in range(R)]
            handle.recv_rows = sum(pairs)
            for s in range(R):     # one row per token, holding 1..K of its pairs (dedup), or one per pair
                if dedup:
                    ok = nrows[s] == pairs[s] == 0 or 0 < nrows[s] <= min(N, pairs[s]) <= pairs[s] <= nrows[s] * K
                else:
                    ok = nrows[s] == pairs[s]
                if not ok:
                    self._broken = "bad row count"
                    raise UBEPError(f"rank {s} announced {nrows[s]} low-latency rows for {pairs[s]} (token, expert) "
                                    f"pairs (corrupted control message)")
            if any(slot < 0 or slot + p > N * K for slot, p in zip(slots_l, pairs)):
                self._broken = "bad return slots"
                raise UBEPError("a peer announced return slots outside its low-latency combine slots "
                                "(corrupted control message, or top-k widths differ between ranks)")
            return_slot.copy_(torch.tensor(slots_l, dtype=torch.int64))
            done = set()
            # Kernel engines run CalCumSum + Token-Reordering as one launch (count AIVs publish each source's
            # offsets, reorder AIVs start on that point-to-point signal); the wait for arrival stays here,
            # with its deadline, so the launch never spins on a slow peer.
            in_kernel = getattr(eng, "ll_receive", None) is not None and not use_fp8 and self.sync in ("tff", "sp")

            def segments(s: int) -> list:
                """(expert, first row in source s's part, first row in recv_x[expert], count) of each
                non-empty segment of source s (for the per-segment fallbacks)."""
                c, b = cnt[s].tolist(), begin[s].tolist()
                off = list(accumulate(c, initial=0))
                return [(e, off[e], b[e], c[e]) for e in range(E_local) if c[e]]

            def place(s: int, n: int) -> torch.Tensor:
                """Flat recv_x row of each of source s's n rows (expert-major segments, dispatch order)."""
                return eng.segment_rows(seg_first[s], cnt[s], n)

            def place_source_info(s: int, rows: torch.Tensor) -> None:
                """Source token (head word 1) and top-k slot (meta item 0) of source s's arrived rows."""
                if rows.shape[0]:
                    at = place(s, rows.shape[0])
                    flat_info[at] = rows[:, 0, :].view(torch.int64)[:, 1].to(torch.int32)
                    flat_k[at] = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, 0]

            progress = [0] * R

            def reorder_items(s: int, rows: torch.Tensor) -> None:
                """Token rows of source s to every (expert, position) their pairs name."""
                try:
                    eng.unpack_items(fmt, rows, K, seg_first[s], cnt[s], flat_outs, flat_info, flat_k)
                except ValueError as e:
                    self._broken = "bad low-latency rows"
                    raise UBEPError(f"low_latency_dispatch on rank {me}: rank {s} sent rows that do not match its "
                                    f"control message ({e})") from None

            def poll_rows():
                missing = []
                for s in range(R):
                    if s in done:
                        continue
                    n = pairs[s]
                    if s == me and local_direct:
                        wait_ns[s] += time.perf_counter_ns() - t0
                        idx = send_idx[me]
                        at = place(s, n) if n else None
                        flat = E_local * R * N
                        if not (n and eng.copy_rows(local_x[0], idx, recv_x.view(flat, H), at) and (
                                recv_sc is None or eng.copy_rows(local_x[1], idx, recv_sc.view(flat, -1), at))):
                            for e, r0, b0, c in segments(s):
                                torch.index_select(local_x[0], 0, idx[r0:r0 + c], out=recv_x[e, b0:b0 + c])
                                if recv_sc is not None:
                                    torch.index_select(local_x[1], 0, idx[r0:r0 + c], out=recv_sc[e, b0:b0 + c])
                        if n:
                            flat_info[at] = idx.to(torch.int32)
                            flat_k[at] = pair_k[me].to(torch.int32)
                        done.add(s)
                        self._send_ack(rid, s, epoch)
                        continue
                    if dedup:
                        # streaming Token-Reordering where the engine can tell complete rows apart: runs of
                        # them go to their final places while the source still writes the rest
                        m = nrows[s]
                        rows = region.rows(local, half, s, fmt, m)
                        start = progress[s]
                        end = _next_run(eng, fmt, rows, flag, start, ctrl_words[s][P.CTRL_CHECKSUM])
                        if end > start:
                            reorder_items(s, rows[start:end])
                            progress[s] = end
                        if end < m:
                            missing.append(s)
                            continue
                        wait_ns[s] += time.perf_counter_ns() - t0
                        eng.rearm(fmt, rows)
                        done.add(s)
                        self._send_ack(rid, s, epoch)
                        continue
                    rows = region.rows(local, half, s, fmt, n)
                    if not eng.rows_arrived(fmt, rows, flag, ctrl_words[s][P.CTRL_CHECKSUM]):
                        missing.append(s)
                        continue
                    wait_ns[s] += time.perf_counter_ns() - t0
                    if in_kernel:
                        done.add(s)
                        continue
                    # kernel engines outside their fused receive: per (source, expert) segment, through
                    # unpack_rows (which restores SP's escaped words / runs the kernel)
                    for e, r0, b0, c in segments(s):
                        outs = [P.as_bytes(recv_x[e, b0:b0 + c])]
                        if recv_sc is not None:
                            outs.append(P.as_bytes(recv_sc[e, b0:b0 + c]))
                        eng.unpack_rows(fmt, rows[r0:r0 + c], outs, rearm=False)
                    place_source_info(s, rows)
                    eng.rearm(fmt, rows)
                    done.add(s)
                    self._send_ack(rid, s, epoch)
                return missing
            self._wait("low_latency_dispatch: Token-Reordering (waiting for token blocks)", poll_rows)
            if in_kernel:
                views = [region.rows(local, half, s, fmt, int(cnt[s].sum())) for s in range(R)]
                sig_table = eng.ll_receive(fmt, [region.ctrl(local, half, s, nctrl) for s in range(R)], views, flag,
                                           E_local, recv_x.view(E_local, R * N, H), rank=self.rank)
                if not (torch.equal(sig_table[:, :E_local], begin) and torch.equal(sig_table[:, E_local:2 * E_local],
                                                                                   cnt)):
                    raise UBEPError("low_latency_dispatch: the CalCumSum kernel disagrees with the control messages")
                for s in range(R):
                    rows = views[s]
                    place_source_info(s, rows)
                    eng.rearm(fmt, rows)
                    self._send_ack(rid, s, epoch)
            finish()

        out_x = recv_x
        if use_fp8:
            # DeepEP's scales: the last two dimensions column-major (for TMA), a transposed view of
            # [E_local, groups, R*N]; the receive fills row-major rows, copied over once they are in
            groups = H // 512 if use_ue8m0 else H // 128
            # (every element is written by the copy below, rows past recv_count with the receive's zeros)
            scales_out = self._out.empty((E_local, groups, R * N), torch.int32 if use_ue8m0 else torch.float32)
            # (one group: the same memory as row-major; standard strides then, so that dtype views work)
            out_x = (recv_x, scales_out.view(E_local, R * N, 1) if groups == 1 else scales_out.transpose(1, 2))

        def receive_scales():
            receive()
            if use_fp8:
                out_x[1].copy_(pack_ue8m0(recv_sc) if use_ue8m0 else recv_sc)
        if return_recv_hook:
            pending.extra["cancel_point"] = self._cancel_point
            self._pending.append(pending)
            receive_scales.pending = pending
            return out_x, recv_count, handle, _event(async_finish), receive_scales
        receive_scales()
        return out_x, recv_count, handle, _event(async_finish), None

    def _check_in_flight(self, rid: int) -> None:
        """Refuse (before anything is sent) a call whose buffer half an earlier call still holds because its
        recv hook has not run: the halves alternate, so waiting for that half would wait for this rank."""
        region, name = self._region(rid), P.REGION_NAMES[rid]
        self._settle_refusal()     # (a call this rank refused and the peers cancelled moves the epoch first)
        self._cancel_refused_hooks()      # (a hook whose call a peer refused holds no half)
        half = region.half(self._epoch[region.rid] + 1)
        pend = [p for p in self._pending if not p.done and p.kind == name]
        if any(region.half(p.epoch) == half for p in pend):
            raise ValueError(f"{len(pend)} earlier {name} call(s) still wait for their recv hook, and one holds the "
                             f"buffer half this call needs (the low-latency buffer has {region.halves} halves, used "
                             f"in turn: Buffer(low_latency_buffers=...) sets how many); call hook() of the older "
                             f"one first")

    # ================================================================== low-latency combine
    def _as_ll_handle(self, handle, prefer: Optional[Callable] = None) -> "LowLatencyHandle":
        """The handle itself, or the one of a recent call that a plain tuple or list was made from (DeepEP's
        low-latency handle is a plain tuple; its entries are this call's own tensors). ``prefer``: see
        ``_recent_copy_of``."""
        if isinstance(handle, LowLatencyHandle):
            ranks = handle[1].shape[1]
            if ranks != self.group_size:
                raise ValueError(f"this handle comes from a low_latency_dispatch over {ranks} ranks; this Buffer's "
                                 f"group has {self.group_size}")
            return handle
        if isinstance(handle, (tuple, list)) and len(handle) == 5:
            found = _recent_copy_of(handle, self._recent_ll_handles, _LL_LAYOUT_KEYS, prefer=prefer)
            if found is not None:
                return found
            raise TypeError(f"this plain-tuple handle equals no handle of this Buffer's last {_RECENT_HANDLES} "
                            f"low_latency_dispatch calls: it is older, from another Buffer, or its entries were "
                            f"changed (a copy's entries must equal its call's); pass the handle object itself")
        raise TypeError(f"handle must come from low_latency_dispatch, got {type(handle).__name__}")

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The [E_local, R*N, H] bf16 tensor that ``low_latency_combine(..., zero_copy=True)`` reads.

        As in DeepEP, where it is a view of the Buffer's memory, every handle's tensor is a view of the same
        memory: what the caller wrote into one stays there when it fetches another handle's (of any shape)
        before the combine. That memory is as large as the low-latency region's rows, which bounds every
        handle of this Buffer; its pages are touched (zeroed) as far as a handle has needed them. An error
        here (a handle that is not one) refuses the combine it prepares, as ``get_dispatch_layout``'s does
        its dispatch."""
        _check_process(self, "get_next_low_latency_combine_buffer")
        self._check_usable()
        self._region(P.REGION_LL_DISPATCH)   # (a Buffer without low-latency calls: no combine to refuse)
        try:
            return self._next_combine_buffer(self._as_ll_handle(handle))
        except BaseException as e:
            name_global_ranks(e, self._global_ranks, also=(ValueError, TypeError))
            if refusal(e):
                self._refuse("low_latency_combine")     # (the combine it prepares will not come: tell the peers)
            raise

    def _next_combine_buffer(self, handle: "LowLatencyHandle") -> torch.Tensor:
        """``get_next_low_latency_combine_buffer`` of a handle already recognised, refusing nothing (inside
        ``low_latency_combine``, whose own error handling refuses it)."""
        _, _, N, H, E = handle
        shape = (E // self.group_size, self.group_size * N, H)
        n = shape[0] * shape[1] * shape[2]
        flat = self._ll_combine_buffer
        if flat is None or flat.numel() < n:
            region = self._region(P.REGION_LL_DISPATCH)
            with torch.inference_mode(False):   # written by the caller in any mode later
                grown = torch.empty(max(n, region.parts * region.part_bytes // 2), dtype=torch.bfloat16)
            if flat is not None:
                grown[:self._ll_combine_zeroed].copy_(flat[:self._ll_combine_zeroed])
            self._ll_combine_buffer = flat = grown
        if n > self._ll_combine_zeroed:
            flat[self._ll_combine_zeroed:n].zero_()
            self._ll_combine_zeroed = n
        return flat[:n].view(shape)

    @_collective
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None):
        """Low-latency combine: ``combined[t] = sum_k w[t, k] * x[e_k][row of t]`` over non-masked slots.

        Args:
            x: [E_local, R*N, H] bf16 expert outputs in the layout of ``low_latency_dispatch``.
            topk_idx, topk_weights: this rank's [T, K] routing and float32 weights. ``topk_idx`` is the
                dispatch's routing; it may mask more slots (-1) or list a token's experts in another order,
                but naming an expert the token was not dispatched to raises ValueError before sending.
            handle: from ``low_latency_dispatch``.
            use_logfmt: accepted for DeepEP compatibility; rows always travel as bf16 (no LogFMT).
            zero_copy: x was already written into ``get_next_low_latency_combine_buffer(handle)``.
            async_finish: accepted (the call has completed when it returns; the event holds nothing).
            return_recv_hook: issue the sends only; ``combined_x`` is valid after ``hook()``.
            out: optional [T, H] bf16 output tensor.
        Returns:
            ``(combined_x [T, H] bf16, event, hook)`` (hook None without ``return_recv_hook``).
        """
        self._check_usable()
        self._apply_config(None)     # (the Buffer's count group: a normal call's Config was for that call)
        _check_flags(use_logfmt=use_logfmt, zero_copy=zero_copy, async_finish=async_finish,
                     return_recv_hook=return_recv_hook)
        if async_finish and return_recv_hook:
            raise ValueError("async_finish and return_recv_hook are exclusive")
        # (see _dispatch_pair: a copy of the handle's tensors may equal the handles of other calls)
        exact = isinstance(handle, LowLatencyHandle) or _recent_original(handle, self._recent_ll_handles) is not None
        # (copies equal to several recent handles: those of a dispatch of this routing first)
        handle = self._as_ll_handle(handle, prefer=None if exact else
                                    lambda h: _same_routing(topk_idx, h.topk_snapshot))
        paired = handle.pending.pair if exact else 0
        if not handle.pending.done:
            raise ValueError("low_latency_combine got the handle of a low_latency_dispatch whose recv hook has "
                             "not run yet; call hook() first")
        if handle.pending.extra.get("cancelled"):
            raise CancelledCallError("low_latency_combine got the handle of a low_latency_dispatch that was "
                                     "cancelled (a peer refused it): it received nothing to send back")
        src_info, layout_range, N, H, E = handle
        if not torch.equal(layout_range, handle.layout_snapshot):
            raise ValueError("the handle's layout_range was changed after its low_latency_dispatch; the combine "
                             "sends rows back by it")
        R, me = self.group_size, self.rank
        E_local = E // R
        if zero_copy:
            x = self._next_combine_buffer(handle)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
            fp8_rows = isinstance(x, tuple) or (isinstance(x, torch.Tensor) and x.dtype == FP8)
            raise TypeError("low_latency_combine x must be a bfloat16 tensor" + (
                " (the experts' outputs; fp8 rows of a dispatch become bf16 with ubep_torch.per_token_cast_back)"
                if fp8_rows else ""))
        if tuple(x.shape) != (E_local, R * N, H):
            raise ValueError(f"low_latency_combine x must have shape {(E_local, R * N, H)}, got {tuple(x.shape)}")
        same_routing = _same_routing(topk_idx, handle.topk_snapshot)    # the dispatch's routing, by content
        topk_idx = handle.topk_snapshot if same_routing else self._check_topk(topk_idx, E)
        T, K = topk_idx.shape
        if T > N:
            raise ValueError(f"{T} tokens > num_max_dispatch_tokens_per_rank={N}")
        if K != handle.K:
            raise ValueError(f"topk_idx has {K} columns; the low_latency_dispatch of this handle had {handle.K} "
                             f"(mask unused slots with -1 instead of dropping columns)")
        if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype != torch.float32:
            raise TypeError("topk_weights must be a float32 tensor")
        if tuple(topk_weights.shape) != (T, K):
            raise ValueError(f"topk_weights must have shape {(T, K)}, got {tuple(topk_weights.shape)}")
        if out is not None and not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor, got {type(out).__name__}")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (T, H)):
            raise ValueError(f"out must be a [{T}, {H}] bfloat16 tensor")
        if out is not None:
            _check_writable("out", out)
            if out.is_neg():      # (the engines store the sums into its memory, which holds their negation)
                raise ValueError("out carries torch's negative bit (a negated view): pass a tensor of its own, e.g. "
                                 "out.resolve_neg(), and negate the result")
        # Every dispatched (token, expert) pair comes back into slot pos[t, k]: its place in this rank's
        # dispatch order (by destination rank, local expert, token), so each host's rows form one run.
        n_valid = handle.n_pairs
        if same_routing:
            pos = handle.pos
        else:
            if T != handle.num_tokens:
                raise ValueError(f"topk_idx has {T} rows; the low_latency_dispatch of this handle had "
                                 f"{handle.num_tokens} tokens")
            pos = _match_pairs(topk_idx, handle.topk_snapshot, handle.pos)
        fmt = P.row_format(self.sync, (("x", H * 2),), 0)
        region = self._region(P.REGION_LL_COMBINE)
        if region.capacity(fmt) < N * K:
            raise ValueError(f"the low-latency buffer holds {region.capacity(fmt)} combine rows, N*K = {N * K} "
                             f"needed; use num_rdma_bytes >= {self._ll_bytes(N, H, E, max(K, 1))}")
        self._check_in_flight(P.REGION_LL_COMBINE)
        rid = P.REGION_LL_COMBINE
        # Rows going back to source s: for every local expert, its packed segment from s. They go back as
        # one contiguous run starting at the slot s named in its dispatch control message, in dispatch
        # order, so every segment is a strided copy out of x (no gather, no scatter).
        eng = self.engine
        xs = _resolved(x).reshape(E_local * R * N, H)   # a strided x is copied once, like every other input
        if H > 1 and xs.stride(1) != 1:
            xs = xs.contiguous()
        # (source, expert) segments of xs, source-major (layout_range: begin << 32 | count); per_host: the
        # rows going back to each source
        try:
            all_rows, per_host = eng.layout_rows(layout_range, N, handle.recv_rows)
        except ValueError as e:
            raise ValueError(f"low_latency_combine: the handle's layout_range no longer matches its dispatch "
                             f"({e})") from None
        back = list(accumulate(per_host, initial=0))
        per_src = [all_rows[back[s]:back[s + 1]] for s in range(R)]
        epoch = self._next_epoch(rid)
        half, flag = region.half(epoch), P.flag_word(epoch, rid)
        direct = eng.direct_rows
        # engines that read this rank's own rows straight from x in the reduction: they skip the slots
        # (not with a recv hook: x may change before the hook runs, and the rows must be those of the call)
        # (nor when out= shares x's memory: the reduction would read rows it has already overwritten)
        own_direct = (eng.combines_local_rows and fmt.sync == "tff" and not return_recv_hook
                      and (out is None or not _same_memory(out, x)))
        if direct:   # payload is stored straight from x
            staging, checked, row_sums = eng.stage_rows(fmt, [P.as_bytes(xs)], None, eng.arange(xs.shape[0]), me)
            sels = per_src
        else:        # kernels read packed staging rows
            gathered = eng.scratch("ll_gather", (all_rows.numel(), H), torch.bfloat16)
            torch.index_select(xs, 0, all_rows, out=gathered)
            staging, checked, row_sums = eng.pack_rows(fmt, [P.as_bytes(gathered)], None, all_rows, me)
            sels = [eng.span(back[s], back[s + 1]) for s in range(R)]
        self._wait_acks(rid, epoch)
        nctrl = 1
        sig = fmt.signature()
        job = SendJob(fmt, staging, checked, row_sums, flag,
                      sync_all=lambda: self._sync_all("low_latency_combine: SyncAll after Token-Sending",
                                                      P.REGION_LL_COMBINE))
        return_slot = handle.return_slot.tolist()
        for i in range(R):
            s = (me + i) % R
            peer = self._peer_mem[s]
            n, at = per_src[s].numel(), return_slot[s]
            payload = [n, sig, 0, paired, E, N]
            sel = sels[s][:0] if s == me and own_direct else sels[s]
            job.dests.append(Destination(s, sel, region.rows(peer, half, 0, fmt, N * K)[at:at + n],
                                         region.ctrl(peer, half, me, nctrl), payload))
        self._note_send(job)
        eng.send_phase(job)

        result = out if out is not None else self._out.empty((T, H), torch.bfloat16)
        pending = _Pending("low_latency_combine", epoch, call=self._calls, seq=self._seq)
        # (weights that share out='s memory are read before the sum overwrites them)
        weights = topk_weights.clone() if out is not None and _same_memory(out, topk_weights) else \
            _resolved(topk_weights).contiguous()

        def one_step(local: torch.Tensor) -> bool:
            """The receive in one engine call where it applies (TFF rows): True once the sum is made and every
            source acknowledged; False where it does not apply, or where a message or rows did not come as
            expected within the engine's short wait (nothing written or acknowledged: the general way below
            receives the call, and names what was wrong)."""
            if not (self._one_step_rows(fmt) and self._ll_one_step and hasattr(eng, "ll_combine_receive")):
                return False
            per_host = handle.sent_rows      # (rows each host sends back: the pairs sent it)
            at = list(accumulate(per_host, initial=0))
            expected = np.array([[n, sig, 0, paired, E, N] for n in per_host], dtype=np.int64).tobytes()
            skip = 1 << P.CTRL_CHECKSUM | (0 if paired else 1 << P.CTRL_PAIRED_CALL)
            runs = [(at[h], per_host[h]) for h in range(R) if per_host[h] and not (own_direct and h == me)]
            status = eng.ll_combine_receive(
                fmt, region.ctrl_sources(local, half), nctrl, expected, skip, flag,
                region.rows(local, half, 0, fmt, n_valid), runs, topk_idx, weights, result, pos,
                (xs, at[me], at[me + 1], per_src[me]) if own_direct else None, self._steady_spin_ns())
            if status != 0:
                return False
            self._send_acks(rid, range(R), epoch)
            return True

        def finish() -> None:
            self._check_peers("low_latency_combine", pending.call)
            pending.done = True
            self._pending = [p for p in self._pending if not p.done]
            self._report("low_latency_combine", topk_idx, E, H, H * 2)

        def receive():
            if pending.done:     # (a cancelled call's hook raises before it gets here: see _collective)
                return
            self._check_usable()
            local = self._heap.local
            if one_step(local):
                return finish()
            ctrl_words = self._wait_ctrl(region, half, nctrl, flag,
                                         "low_latency_combine: waiting for the count messages")
            if self.sync == "sw":
                self._sync_all("low_latency_combine: SyncAll after flag verification", P.REGION_LL_COMBINE)
            self._check_layouts(ctrl_words, fmt, "low_latency_combine")
            self._check_call_words(ctrl_words, "low_latency_combine")
            self._check_pairing("low_latency_combine", ctrl_words, paired)
            per_host = handle.sent_rows
            nrows = [ctrl_words[s][P.CTRL_NROWS] for s in range(R)]
            if nrows != per_host:
                self._broken = "combine row counts"
                raise UBEPError(f"low_latency_combine on rank {me}: hosts announced {nrows} rows, this "
                                f"rank dispatched {per_host} (corrupted control message)")
            rows = region.rows(local, half, 0, fmt, n_valid)
            # each host's rows form one run of slots, in rank order; own rows that skipped the slots
            # (own_direct) are slots [lo, hi) and are not polled
            bounds = list(accumulate(per_host, initial=0))
            lo, hi = (bounds[me], bounds[me + 1]) if own_direct else (0, 0)
            pending_hosts = [h for h in range(R) if bounds[h + 1] > bounds[h] and not (own_direct and h == me)]
            if self.sync == "dc":
                total = P.wrap_int64(sum(ctrl_words[s][P.CTRL_CHECKSUM] for s in range(R)))

                def poll_rows():
                    return [] if eng.rows_arrived(fmt, rows, flag, total) else pending_hosts
            else:
                def poll_rows():
                    # a host whose run has arrived is not scanned again; "sw" rows are ordered by SyncAll
                    pending_hosts[:] = [h for h in pending_hosts
                                        if not eng.rows_arrived(fmt, rows[bounds[h]:bounds[h + 1]], flag, 0)]
                    return pending_hosts
            self._wait("low_latency_combine: waiting for expert outputs", poll_rows)
            # slot (t, k) is row pos[t, k]; masked slots never reach the sum
            with _writing(result):
                if own_direct:
                    eng.weighted_combine(fmt, rows, topk_idx, weights, result, pos, local=(xs, lo, hi, per_src[me]))
                else:
                    eng.weighted_combine(fmt, rows, topk_idx, weights, result, pos)
            eng.rearm(fmt, rows)
            self._send_acks(rid, range(R), epoch)
            finish()

        if return_recv_hook:
            pending.extra["cancel_point"] = self._cancel_point
            self._pending.append(pending)
            receive.pending = pending
            return result, _event(async_finish), receive
        receive()
        return result, _event(async_finish), None

    @_collective
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: wait until no peer has low-latency calls in flight, then re-arm SP sentinels.

        Flags carry epochs, so TFF/DC/SW buffers never need cleaning; this exists for DeepEP code.
        """
        self._check_usable()
        N = check_count("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, 1)
        H = check_count("hidden", hidden, 1)
        E = self._check_num_experts(num_experts, low_latency=True)
        # (as DeepEP asserts: the sizes name calls this Buffer can take: refused only when no low-latency
        # dispatch of them fits, bf16 rows nor (where H allows use_fp8) fp8 rows with their scales)
        region, R = self._region(P.REGION_LL_DISPATCH), self.group_size
        rows = [(("x", H * 2),)] + ([(("x", H), ("scales", (H // 128) * 4))] if H % 128 == 0 else [])
        if max(region.capacity(P.row_format(self.sync, f, 1)) for f in rows) < E // R * N:
            raise ValueError(f"clean_low_latency_buffer: the low-latency buffer is too small for "
                             f"num_max_dispatch_tokens_per_rank={N}, hidden={H}, num_experts={E}; use "
                             f"num_rdma_bytes >= {self._ll_bytes(N, H, E)}")
        self._cancel_refused_hooks()      # (a hook whose call a peer refused is not pending)
        if self._pending:
            raise ValueError("clean_low_latency_buffer called while recv hooks are pending")
        self._begin_call()
        self._cancel_point = {"call": self._active_call, "rid": None, "epoch": None, "sent": []}
        self._sync_all("clean_low_latency_buffer: SyncAll", P.REGION_BARRIER)
        self._call_complete("clean_low_latency_buffer")


def _ll_rows(engine) -> str:
    """The low-latency row layout an engine sends (every rank of a group must send the same)."""
    return ("one per (token, destination rank) (backend 'torch' or 'native')" if engine.direct_rows else
            "one per (token, expert) (backend 'triton')")


def _operation(region_code: int) -> str:
    """The operation a region code stands for (see ``Buffer._region_code``), for mismatch errors."""
    return {**P.REGION_NAMES, P.REGION_DISPATCH: "dispatch or combine", 15: "clean_low_latency_buffer"}.get(
        region_code, "another operation")


def _raise_if_cancelled(pending: _Pending) -> None:
    if pending.extra.get("mismatch"):
        raise UBEPMismatchError(pending.extra["mismatch"])
    if pending.extra.get("cancelled"):
        raise CancelledCallError(f"this {pending.kind} was cancelled (a peer refused it; its recv hook raised so): "
                                 f"it received nothing")


def _add_stats(stats: torch.Tensor, values: List[int]) -> None:
    """``stats += values`` for a checked int32/int64 statistics tensor and Python ints of any size: the sum
    wraps like the tensor's own integer arithmetic (an int32 tensor of nanoseconds wraps after ~2.1 s)
    instead of failing after the exchange."""
    with _writing(stats):
        stats.add_(torch.tensor([P.wrap_int64(v) for v in values], dtype=torch.int64).to(stats.dtype))


def _writing(t: torch.Tensor):
    """The context in which a call writes into the caller's tensor ``t``: inference mode for an inference
    tensor (only that mode may write one), else none (the call's own no-grad mode stays)."""
    return torch.inference_mode() if t.is_inference() else contextlib.nullcontext()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _check_stats(name: str, stats, n: int) -> None:
    """A statistics tensor the call adds to: None, or an int32/int64 CPU tensor of shape (n,). Checked before
    anything is sent, so a bad one leaves the Buffer usable (a narrow or bool dtype would wrap or saturate)."""
    if stats is None:
        return
    if not isinstance(stats, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(stats).__name__}")
    if stats.dtype not in (torch.int32, torch.int64) or stats.device.type != "cpu":
        raise TypeError(f"{name} must be an int32 or int64 CPU tensor, got {stats.dtype} on {stats.device}")
    if tuple(stats.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(stats.shape)}")
    _check_writable(name, stats)


def _check_writable(name: str, t: torch.Tensor) -> None:
    """A tensor the call writes into: no two of its elements share memory (an expanded tensor's do, and so
    may a view made with ``as_strided``). Taken in order of stride, each dimension must step past all the
    elements the smaller-stride dimensions span: true of every view of a tensor of its own (slices,
    transposes, permutations)."""
    if t.numel() == 0:
        return
    span = 0         # (elements' offsets covered so far, minus one)
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= span:
            what = "is expanded (several of its elements share memory)" if stride == 0 else \
                f"has elements that share memory (strides {tuple(t.stride())} for shape {tuple(t.shape)})"
            raise ValueError(f"{name} {what}; the call writes every element: pass a tensor of its own, e.g. "
                             f"{name}.clone()")
        span += stride * (size - 1)


def _next_run(eng, fmt: P.RowFormat, rows: torch.Tensor, flag: int, start: int, expected_sum: int) -> int:
    """End of the rows of one source to reorder now, given that rows [0, start) are done: where the engine
    can tell complete rows apart, the end of the run of complete rows if it reached the last row or holds
    at least ``_STREAM_ROWS``; otherwise all rows once every block arrived. ``start`` means nothing yet."""
    n = rows.shape[0]
    end = eng.arrived_prefix(fmt, rows, flag, start)
    if end is None:
        return n if eng.rows_arrived(fmt, rows, flag, expected_sum) else start
    return end if end == n or end - start >= _STREAM_ROWS else start


def _equal_values(given: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same shape and values, whatever the device and integer dtype of ``given``."""
    if not given.is_cpu:
        given = given.cpu()
    if given.dtype != expected.dtype:
        given, expected = given.to(torch.int64), expected.to(torch.int64)
    return torch.equal(given, expected)


def _recent_original(items, recent) -> Optional[tuple]:
    """The handle in ``recent`` whose own tensors the plain tuple or list ``items`` holds, entry for entry
    (``tuple(handle)``; its other entries equal), else None. Only that handle has those tensors: a copy made
    this way names its call as surely as the handle object does."""
    if not isinstance(items, (tuple, list)):
        return None
    for h in reversed(recent):
        if len(items) == len(h) and all(a is b if isinstance(b, torch.Tensor) else _same_value(a, b)
                                        for a, b in zip(items, h)):
            return h
    return None


def _recent_copy_of(items, recent, layout_keys: Sequence[str], loose_keys: Sequence[str] = (),
                    prefer: Optional[Callable] = None) -> Optional[tuple]:
    """The handle in ``recent`` that a plain tuple ``items`` was made from, else None.

    First by identity (``_recent_original``), then by content (copies of them: equal entries). Several
    recent handles can have equal entries (the same routing on every layer); those for which ``prefer``
    (when given) holds are taken alone if there are any, and the newest is taken when they also agree on
    every attribute in ``layout_keys`` (what the entries do not say), else the tuple is ambiguous and
    TypeError asks for the handle object. An attribute in ``loose_keys`` on which they differ is set to None
    (unknown) in a copy of the newest."""
    h = _recent_original(items, recent)
    if h is not None:
        return h
    same = [h for h in reversed(recent) if len(items) == len(h) and all(_same_value(a, b) for a, b in zip(items, h))]
    if not same:
        return None
    if prefer is not None and len(same) > 1:
        same = [h for h in same if prefer(h)] or same
    newest, unknown = same[0], {}
    for h in same[1:]:
        if not all(_same_value(getattr(newest, k, None), getattr(h, k, None)) for k in layout_keys):
            raise TypeError("this plain-tuple handle equals the handles of several recent calls that differ in "
                            "layout; pass the handle object returned by the call itself")
        unknown.update((k, None) for k in loose_keys if getattr(newest, k) != getattr(h, k))
    return type(newest)(tuple(newest), **{**newest.__dict__, **unknown}) if unknown else newest


def _same_value(a, b) -> bool:
    """Equal handle entries or attributes: tensors by dtype, shape and values, sequences item by item."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _token_range(t: torch.Tensor, a: int, b: int) -> Tuple[int, int]:
    """Positions [lo, hi) of the entries in [a, b) of an ascending int64 tensor."""
    lo, hi = torch.searchsorted(t, torch.tensor([a, b], dtype=torch.int64)).tolist()
    return lo, hi


def _token_slices(lists: List[torch.Tensor], a: int, b: int) -> List[torch.Tensor]:
    """The entries in [a, b) of every ascending int64 tensor in ``lists`` (a view each)."""
    return [t[slice(*_token_range(t, a, b))] for t in lists]


def _same_routing(topk_idx, snapshot: torch.Tensor) -> bool:
    """Is ``topk_idx`` a CPU int64 tensor equal to ``snapshot`` (a routing checked earlier)?"""
    return (isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64 and topk_idx.is_cpu
            and topk_idx.shape == snapshot.shape and torch.equal(topk_idx, snapshot))


def _match_pairs(topk_idx: torch.Tensor, dispatched: torch.Tensor, dispatched_pos: torch.Tensor) -> torch.Tensor:
    """Combine slot of every (token, expert) of ``topk_idx`` given the dispatch's routing and slots.

    A combine may mask more slots (-1) or list a token's experts in another order; every expert it names
    must have been dispatched for that token, or ValueError (before anything is sent)."""
    T, K = topk_idx.shape
    valid = topk_idx >= 0
    if dispatched.shape[1] == 0 or not bool(valid.any()):
        missing = valid
        kd = torch.zeros(T, K, dtype=torch.int64)
    else:
        eq = (topk_idx.unsqueeze(2) == dispatched.unsqueeze(1)) & valid.unsqueeze(2)    # [T, K, K_dispatch]
        missing = valid & ~eq.any(2)
        kd = eq.to(torch.int8).argmax(2)
    if bool(missing.any()):
        t, k = missing.nonzero()[0].tolist()
        raise ValueError(f"topk_idx[{t}, {k}] = {int(topk_idx[t, k])}, but the low_latency_dispatch of this "
                         f"handle did not send token {t} to that expert (low_latency_combine takes the "
                         f"dispatch's topk_idx, optionally with more slots masked as -1)")
    if dispatched.shape[1] == 0:
        return kd
    return torch.gather(dispatched_pos, 1, kd)
