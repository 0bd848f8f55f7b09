"""``NativeEngine``: the TFF data path of ``TorchEngine`` as compiled C loops (``ubep_torch._native``).

``Buffer(..., backend="auto")`` uses it when the C module was built at install time (it is optional:
without a C compiler the package installs without it and ``"auto"`` means the torch path);
``backend="native"`` asks for it explicitly and fails when it is missing.

What runs in C (``sync="tff"``, the default): the send phase, every destination's control message and
then its rows in one call (the token group's stores into a peer's slots: each 512 B DataBlock written
and then published by a release store of its flag word), the arrival poll
(acquire loads of the flag words), Token-Reordering (payload, meta items and source tokens copied out of
the slots, scattered straight to their final rows), and the two bf16 reductions (normal combine of any
number of sources, low-latency weighted combine), each one pass over the rows instead of several torch
operators. The count group's control messages (write, poll, read-back) and the low-latency routing
(pairs sorted by expert, per-expert counts, combine slots, one row per (token, destination rank) with its
meta items, segment row lists) run in C too. Everything else (DC/SP/SW
rows, other dtypes, CalCumSum, the call bookkeeping) is the inherited torch implementation. Memory
contents and outputs are bit-identical to ``TorchEngine`` (``tests/test_native_engine.py``), but for three
words: the send phase's control messages say in their head how their rows were stored and what reading
rows has cost this rank (see ``store_policy``). ``ubep_torch/csrc/native.c`` states the memory-ordering argument.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from itertools import accumulate
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from . import protocol as P
from .engine import DirectRows, SendJob, TorchEngine, check_ctrl_words

try:
    from . import _native
except ImportError:     # built without a C compiler: the torch path serves
    _native = None


#: the argument layout of ubep_torch/csrc/native.c this module calls
API_VERSION = 29


def _matches() -> bool:
    return (_native.BLOCK_BYTES, _native.FLAG_BYTES, getattr(_native, "API_VERSION", 0)) == \
        (P.BLOCK_BYTES, P.FLAG_BYTES, API_VERSION)


def available() -> bool:
    """Whether the C module was built from these sources (``backend="auto"`` then uses this engine)."""
    return _native is not None and _matches()


#: ``UBEP_STORES`` values, as ``store_policy`` names them, and the C module's codes for them
STORE_POLICIES = {"auto": 0, "plain": 1, "streaming": 2}


#: the kinds of sends whose stores ``store_policy`` measures apart (their flag words' region ids)
STORE_KINDS = {P.REGION_DISPATCH: "dispatch", P.REGION_COMBINE: "combine", P.REGION_LL_DISPATCH: "ll_dispatch",
               P.REGION_LL_COMBINE: "ll_combine"}


def store_policy(policy: Optional[str] = None) -> dict:
    """How this process stores rows into its peers' slots (the C path's TFF stores), and what it measured.

    ``"plain"`` stores go through the cache; ``"streaming"`` stores write whole lines around it (x86-64 only;
    elsewhere every store is plain), each block's flag written after an sfence; ``"auto"`` (the default, or
    ``UBEP_STORES``) measures both on sends of 32 KiB or more, for each kind of send apart, and keeps the cheaper,
    trying the other now and then (native.c says when); smaller sends take the way in use for their kind. Which one
    wins depends on where the cores of the ranks sit: plain stores take every line from the core that last read it,
    which costs several times more when the two cores are far apart; streaming stores leave the lines in memory,
    where the receiver must fetch them, instead of in the writer's cache. So for normal dispatch and combine a way's
    cost also counts the receive side: every control message names the way its rows were stored, the receivers time
    their copies out of the slots and their sums per way (``plain_read_ns_per_kib``, ``streaming_read_ns_per_kib``)
    and report those in their next control messages, and a way's cost is the sender's store estimate plus, once its
    peers have reported both ways, their read estimate (``peers_plain_read_ns_per_kib``,
    ``peers_streaming_read_ns_per_kib``). Low-latency sends, whose rows a recv hook may read much later, are weighed
    by their stores. Outputs are the same either way, and so are the memory contents but for three head words of the
    control messages.

    Passing ``policy`` sets it for the whole process (counts and estimates start afresh), over
    ``UBEP_STORES`` (which the process's first native engine applies unless a policy was set). Returns
    ``{"policy", "sends": {"plain": n, "streaming": n}, "kinds": {kind: {"in_use": "plain" or "streaming",
    "plain_ns_per_kib", "streaming_ns_per_kib", "plain_read_ns_per_kib", "streaming_read_ns_per_kib",
    "peers_plain_read_ns_per_kib", "peers_streaming_read_ns_per_kib"}}}`` (an estimate of 0.0: not
    measured; kinds: ``dispatch``, ``combine``, ``ll_dispatch``, ``ll_combine``; reads are measured for the
    first two); an empty dict where the C module is not built.
    """
    global _env_applied
    if policy is not None and policy not in STORE_POLICIES:
        raise ValueError(f"store policy must be one of {sorted(STORE_POLICIES)}, got {policy!r}")
    if not available():
        return {}
    if policy is not None:
        # an explicit choice outlasts UBEP_STORES: the first engine built after it does not apply the
        # variable over it (a bad value is still refused there)
        _env_applied = os.environ.get("UBEP_STORES", "").strip().lower()
    code, n_plain, n_stream, kinds = _native.store_policy(-1 if policy is None else STORE_POLICIES[policy])
    names = {v: k for k, v in STORE_POLICIES.items()}
    return {"policy": names[code], "sends": {"plain": n_plain, "streaming": n_stream},
            "kinds": {name: {"in_use": "streaming" if kinds[rid][0] else "plain", "plain_ns_per_kib": kinds[rid][1],
                             "streaming_ns_per_kib": kinds[rid][2], "plain_read_ns_per_kib": kinds[rid][3],
                             "streaming_read_ns_per_kib": kinds[rid][4], "peers_plain_read_ns_per_kib": kinds[rid][5],
                             "peers_streaming_read_ns_per_kib": kinds[rid][6]}
                      for rid, name in STORE_KINDS.items()}}


def _env_store_policy() -> None:
    """``UBEP_STORES`` (auto, plain or streaming), applied once per process; ValueError naming it if bad."""
    global _env_applied
    value = os.environ.get("UBEP_STORES", "").strip().lower()
    if value and value not in STORE_POLICIES:
        raise ValueError(f"UBEP_STORES must be one of {sorted(STORE_POLICIES)}, got {os.environ['UBEP_STORES']!r}")
    if value and _env_applied != value:
        store_policy(value)
    _env_applied = value


_env_applied = ""


def _rowwise(t: Optional[torch.Tensor]) -> bool:
    """Rows of contiguous bytes (any row stride): what the C loops address."""
    return t is not None and t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1)


def _contiguous_int64(t: Optional[torch.Tensor]) -> bool:
    return t is not None and t.dtype == torch.int64 and t.is_contiguous()


def _slots(rows: torch.Tensor, fmt: P.RowFormat) -> bool:
    """``rows`` is a contiguous [n, fmt.blocks, 512] uint8 view, as the C loops address it."""
    return rows.dim() == 3 and tuple(rows.shape[1:]) == (fmt.blocks, P.BLOCK_BYTES) and rows.is_contiguous()


def _source_spec(fmt: P.RowFormat, rows: torch.Tensor, tok: Optional[torch.Tensor], H: int) -> Optional[tuple]:
    """``(base, stride, step, tok, n)`` of one bf16 source of ``combine_rows_bf16`` (see native.c), or None
    when the C loop cannot address it."""
    n = rows.shape[0]
    if tok is not None and tok.numel() != n:
        raise ValueError(f"{tok.numel()} tokens for {n} combine rows")
    tok_p = 0 if tok is None or n == 0 else tok.data_ptr()
    if _rows_of(rows, torch.bfloat16, H):
        return _plain_spec(rows, 0, tok_p, n)
    if _slots(rows, fmt):
        return _slot_spec(fmt, rows.data_ptr(), tok_p, n)
    return None


def _plain_spec(rows: torch.Tensor, first: int, tok_p: int, n: int) -> tuple:
    """The source spec of plain bf16 rows ``rows[first:first + n]``: pieces of 240 elements, 480 B apart."""
    stride = rows.stride(0) * 2
    return rows.data_ptr() + first * stride, stride, P.TFF_PAYLOAD_BYTES, tok_p, n


def _slot_spec(fmt: P.RowFormat, base: int, tok_p: int, n: int) -> tuple:
    """The source spec of ``n`` TFF rows of ``fmt`` in slots at address ``base``: the payload of field 0,
    480 B past each block's flag."""
    return base + fmt.field_offset_blocks(0) * P.BLOCK_BYTES + P.FLAG_BYTES, fmt.row_bytes, P.BLOCK_BYTES, tok_p, n


#: destinations of one ``send_exchange`` call at most (native.c's MAX_DESTS)
_MAX_DESTS = 1024
_MAX_PLANS = 16       # kept send phases, the least recently used dropped first (see NativeEngine.send_again)


def _ctrl_blocks(ctrl: torch.Tensor) -> bool:
    """``ctrl`` is a control message's blocks as the C stores address them: [nctrl, 512] uint8, contiguous,
    1 <= nctrl <= MAX_CTRL_BLOCKS."""
    return (ctrl.dim() == 2 and ctrl.dtype == torch.uint8 and ctrl.shape[1] == P.BLOCK_BYTES
            and 0 < ctrl.shape[0] <= P.MAX_CTRL_BLOCKS and ctrl.is_contiguous())


def _payload_fields(st: DirectRows) -> Optional[tuple]:
    """The payload fields of TFF :class:`DirectRows` as the C stores take them, or None when a field's rows
    are not addressable row by row (or fewer than the staged rows)."""
    if not (st.meta.dim() == 2 and st.meta.shape[1] == P.BLOCK_BYTES and st.meta.is_contiguous()):
        return None
    fields = []
    for off, full, data, rem in st.parts:
        spec = _field_spec(data, st.meta.shape[0], off, full, rem)
        if spec is None:
            return None
        fields.append(spec)
    return tuple(fields)


def _field_spec(data: torch.Tensor, n: int, off: int, full: int, rem: int) -> Optional[tuple]:
    """One payload field of ``n`` TFF rows as the C stores take it, ``(address, row stride, bytes, first
    block)``: ``full`` whole blocks and ``rem`` bytes from block ``off`` on; None when ``data`` is not [n or
    more, bytes or more] uint8 rows, addressable row by row."""
    nbytes = full * P.TFF_PAYLOAD_BYTES + rem
    if not (data is not None and _rows_of(data, torch.uint8, nbytes, exact=False) and data.shape[0] >= n):
        return None
    return data.data_ptr(), data.stride(0), nbytes, off


def _kept_dests(plan: tuple, sels: Sequence[torch.Tensor], words: Sequence[Sequence[int]]) -> Optional[tuple]:
    """The destinations of ``send_exchange`` for a kept send phase ``plan`` (see ``NativeEngine.send_again``):
    destination i gets rows ``sels[i]`` and control words ``words[i]``; None where a row list is not a 1-D
    contiguous int64 tensor or has more rows than its slots hold."""
    dests = []
    int64 = torch.int64
    for (rows_p, room, ctrl_p, nctrl), sel, w in zip(plan[0], sels, words):
        if not (isinstance(sel, torch.Tensor) and sel.dtype is int64 and sel.dim() == 1 and sel.is_contiguous()):
            return None
        n = sel.shape[0]
        if n > room:
            return None
        dests.append((rows_p, n, sel.data_ptr() if n else 0, ctrl_p, nctrl, w, 0, 0))
    return tuple(dests)


def _patch_rows(fmt: P.RowFormat, patch: Optional[torch.Tensor], n: int) -> Optional[tuple]:
    """``(patch, items)``: the meta patch of n rows as the C stores take it, int32 [n, items] (``(0, 0)``
    when there is none), or None when it does not fit the rows' meta items."""
    if patch is None or n == 0:
        return 0, 0
    if not (patch.dtype == torch.int32 and patch.shape[0] == n and patch.is_contiguous()):   # (the usual: as is)
        patch = patch[:n].to(torch.int32).contiguous()
    if patch.dim() == 1:
        patch = patch.view(-1, 1)
    if patch.dim() != 2 or patch.shape[0] != n or patch.shape[1] > fmt.meta_words:
        return None
    return patch, patch.shape[1]


def _rows_of(t: torch.Tensor, dtype: torch.dtype, width: int, exact: bool = True) -> bool:
    """``t`` is a 2-D ``dtype`` tensor of rows of contiguous bytes (any row stride), ``width`` wide (at least
    ``width`` where not ``exact``): what the C loops address (``_rowwise``, in one step)."""
    if t.dtype is not dtype or t.dim() != 2:
        return False
    n = t.shape[1]
    return (n == width if exact else n >= width) and (n <= 1 or t.stride(1) == 1)


def _reorder_outputs(fmt: P.RowFormat, outs: Sequence[Optional[torch.Tensor]], meta_out: Optional[torch.Tensor],
                     src_out: Optional[torch.Tensor]) -> Optional[tuple]:
    """The outputs of Token-Reordering as the C loops take them: ``(fields, rows of every output, meta bytes,
    meta row stride)``, or None when one is not addressable row by row. ``outs`` are [rows, nbytes] uint8
    per field, ``meta_out`` [rows, m] int32 (the first m meta items), ``src_out`` [rows] int32."""
    fields, targets = [], []                     # (the C loops check every target row against the rows)
    uint8, blocks, sizes = torch.uint8, fmt.field_blocks, fmt.fields
    for i, out in enumerate(outs):
        if out is None or blocks[i] == 0:
            continue
        if not _rows_of(out, uint8, sizes[i][1]):
            return None
        fields.append((out.data_ptr(), out.stride(0), sizes[i][1], fmt.field_offset_blocks(i)))
        targets.append(out.shape[0])
    meta_bytes = meta_stride = 0
    if meta_out is not None:
        m = meta_out.shape[1] if meta_out.dim() == 2 else -1
        if not (0 <= m <= fmt.meta_words and _rows_of(meta_out, torch.int32, m)):
            return None
        meta_bytes, meta_stride = m * 4, meta_out.stride(0) * 4
        targets.append(meta_out.shape[0])
    if src_out is not None:
        if src_out.dtype is not torch.int32 or not src_out.is_contiguous():
            return None
        targets.append(src_out.numel())
    if not targets:     # (nothing to write: rows of hidden size 0 alone, as in a cached dispatch of such rows)
        return None
    return fields, targets, meta_bytes, meta_stride


def _own_sources(fmt: P.RowFormat, outs: Sequence[Optional[torch.Tensor]], meta_bytes: int,
                 own_src: tuple) -> Optional[tuple]:
    """The own rows' sources of ``reorder_sources`` as the C loop takes them: ``(rows, meta address, meta row
    stride, ((address, row stride) per output field))``, or None when one is not addressable row by row or
    is narrower than what its output takes."""
    fields_src, meta_src = own_src
    srcs, rows = [], []
    uint8, blocks, sizes = torch.uint8, fmt.field_blocks, fmt.fields
    for i, out in enumerate(outs):
        if out is None or blocks[i] == 0:
            continue
        src = fields_src[i] if i < len(fields_src) else None
        if src is None or not _rows_of(src, uint8, sizes[i][1]):
            return None
        srcs.append((src.data_ptr(), src.stride(0)))
        rows.append(src.shape[0])
    meta_p = meta_stride = 0
    if meta_bytes:
        if meta_src is None or not _rows_of(meta_src, torch.int32, -(-meta_bytes // 4), exact=False):
            return None
        meta_p, meta_stride = meta_src.data_ptr(), meta_src.stride(0) * 4
        rows.append(meta_src.shape[0])
    if not rows:
        return None
    return min(rows), meta_p, meta_stride, tuple(srcs)


def _reorder_args(fmt: P.RowFormat, outs: Sequence[Optional[torch.Tensor]], meta_out: Optional[torch.Tensor],
                  src_out: Optional[torch.Tensor], own_src: Optional[tuple]) -> Optional[tuple]:
    """``(outputs, room, own spec)``: the outputs of a ``reorder_sources`` step as its C loop takes them (meta
    address, meta bytes, meta row stride, source-token address, fields), the rows every output has, and the
    own rows' sources (``_own_sources``; None without ``own_src`` or where the loop cannot take them); None
    where the rows are not TFF or an output is not addressable row by row."""
    spec = _reorder_outputs(fmt, outs, meta_out, src_out) if fmt.sync == "tff" else None
    if spec is None:
        return None
    fields, targets, meta_bytes, meta_stride = spec
    outputs = (0 if meta_out is None else meta_out.data_ptr(), meta_bytes, meta_stride,
               0 if src_out is None else src_out.data_ptr(), tuple(fields))
    own_spec = _own_sources(fmt, outs, meta_bytes, own_src) if own_src is not None else None
    return outputs, min(targets), own_spec


def _sum_spec(fmt: P.RowFormat, out: torch.Tensor, sources: Sequence[tuple]) -> Optional[tuple]:
    """The sources of a one-exchange normal combine (see ``NativeEngine.reduce_poller``) as the C sums take
    them: ``(spec, alive, waiting, ways, read_bytes)``: a ``(base, stride, step, tok, n, slot rows, rank)``
    per source with rows (slot rows 0 for plain rows), the tensors whose addresses those hold, ``(rank,
    address, n)`` of every peer's rows, the ways they were stored and their bytes; None where the C loops
    cannot address ``out`` or a source."""
    T, H = out.shape
    if not (fmt.sync == "tff" and out.dtype == torch.bfloat16 and out.is_contiguous() and fmt.fields[0][1] == H * 2):
        return None
    spec, alive, waiting, ways, read_bytes = [], [out], [], set(), 0
    for src in sources:
        tok, n = src[3], src[2]
        if n == 0:
            continue
        if not (tok is None or _contiguous_int64(tok)):
            return None
        tok_p = 0 if tok is None else tok.data_ptr()
        if len(src) == 4:     # plain rows
            rows, first = src[0], src[1]
            if not (_rows_of(rows, torch.bfloat16, H)
                    and 0 <= first and first + n <= rows.shape[0]):
                return None
            spec.append(_plain_spec(rows, first, tok_p, n) + (0, -1))
            alive.append(rows)
        else:
            rank, base, _, _, way = src
            spec.append(_slot_spec(fmt, base, tok_p, n) + (base, rank))
            waiting.append((rank, base, n))
            ways.add(way)
            read_bytes += n * fmt.row_bytes
        alive.append(tok)
    return spec, alive, waiting, ways, read_bytes


class CombineCall:
    """The arguments of a one-step normal combine (``NativeEngine.run_combine``) that stay the same from
    call to call of one layout: the staging and slots the rows go to, the row lists, the control blocks, the
    peers' slots and the row lists of the sum (``NativeEngine.combine_call`` makes them). ``run`` adds those
    of one call: the rows' and the output's addresses, the flag, the control words and the expected ones.
    The call it is made for runs with the arguments as made (``first``); the kept form is worked out when
    another call runs it, so that a layout seen once costs no more than before."""

    __slots__ = ("first", "x_p", "ctrl", "T", "H", "rows", "alive", "toks", "head", "payload", "dests", "spec")

    def __init__(self, send: tuple, spec: tuple, x_p: int, ctrl: tuple, T: int, H: int, rows: tuple, alive: tuple,
                 toks: tuple):
        self.first = (send, spec)       # (the C call's arguments for the call it is made with)
        self.x_p, self.ctrl, self.T, self.H, self.rows = x_p, ctrl, T, H, rows
        self.alive = alive    # (every kept tensor whose address the arguments hold)
        self.toks = toks      # (the sum's sources' token lists, in the order of its spec)
        self.head = None

    def fits(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """``x`` (uint8 rows, as ``combine_call``'s ``fields[0]``) and ``out`` are laid out as this call's
        were: the same addresses work for them."""
        return (x.dtype is torch.uint8 and x.dim() == 2 and (x.stride(0), x.shape[0], x.shape[1]) == self.rows
                and (x.shape[1] <= 1 or x.stride(1) == 1) and out.dtype is torch.bfloat16
                and tuple(out.shape) == (self.T, self.H) and out.is_contiguous())

    def _keep(self) -> None:
        send, spec = self.first
        self.head, self.payload, self.dests = send[:4], send[5][0][1:], tuple(d[:5] for d in send[6])
        # (the own rows' spec holds their address as an offset into x; every other value holds again)
        self.spec = tuple((s[0] - self.x_p,) + s[1:6] + (-2,) if s[6] == -1 else s for s in spec)
        self.first = None

    def run(self, x: torch.Tensor, out: torch.Tensor, flag: int, words: Sequence[Sequence[int]], expected: bytes,
            skip: int, spin_ns: int, first: bool = False, toks: Optional[Sequence[torch.Tensor]] = None) -> int:
        """native.c's ``exchange_combine`` of ``x`` (uint8 rows) into ``out``, which ``fits``: 0, 1, 2 or 3 (see
        ``NativeEngine.run_combine``). ``first``: this is the call ``combine_call`` made it with (those
        tensors, that flag and those words); ``toks``: every source's token list (one per rank, contiguous
        int64, each as long as the one the call was made with), where they may be other than the call's
        (another routing of the same rows per rank pair)."""
        if first:
            send, spec = self.first
        else:
            if self.head is None:
                self._keep()
            x_p = x.data_ptr()
            send = self.head + (int(flag), ((x_p,) + self.payload,),
                                tuple(d + (w, 0, 0) for d, w in zip(self.dests, words)))
            spec = tuple(s if s[6] != -2 else (s[0] + x_p,) + s[1:6] + (-1,) for s in self.spec)
            if toks is not None and any(toks[r] is not t for r, t in self.toks):
                # (contiguous int64 lists as long as the call's: the caller checks that before its exchange begins,
                # see Buffer._steady_combine, and the C loop checks every token they hold)
                spec = tuple(s[:3] + (toks[r].data_ptr(),) + s[4:] for (r, _), s in zip(self.toks, spec))
        # (the C loop checks every staging row and every token before it stores or sums anything)
        return _native.exchange_combine(send, self.ctrl + (expected, int(skip)), self.T, self.H, spec,
                                        out.data_ptr(), int(spin_ns))


def _layout_of(ts: Sequence[Optional[torch.Tensor]]) -> tuple:
    """What the C calls' addresses of these tensors depend on, besides where they start."""
    return tuple(None if t is None else (t.dtype, tuple(t.shape), t.stride()) for t in ts)


class ReorderCall:
    """The arguments of a one-step normal dispatch (``NativeEngine.run_reorder``) that stay the same from call
    to call of one layout: the staging and slots the rows go to, the row lists and control words, the control
    messages expected, the peers' slots and where the own rows go (``NativeEngine.reorder_call`` makes them).
    ``run`` adds those of one call: the rows', meta items' and outputs' addresses and the flag. As
    ``CombineCall``: the call it is made for runs with the arguments as made, and the kept form is worked out
    when another call runs it."""

    __slots__ = ("first", "ctrl", "pay_idx", "out_idx", "layouts", "meta_items", "alive", "words", "head", "payload",
                 "dests", "step", "meta_out", "out_fields", "own", "own_strides")

    def __init__(self, send: tuple, ctrl: tuple, reorder: tuple, pay_idx: tuple, out_idx: tuple, layouts: tuple,
                 meta_items: torch.Tensor, alive: tuple, words: np.ndarray):
        # (the C call's arguments for the call it is made with; reorder: all but the sources' lists)
        self.first = (send, reorder)
        self.ctrl, self.pay_idx, self.out_idx, self.layouts = ctrl, pay_idx, out_idx, layouts
        self.meta_items = meta_items    # (the staging's meta items: every call's are copied there)
        self.alive = alive    # (the kept tensors whose addresses the arguments hold, and the control words)
        self.words = words    # every source's control message of the last run whose messages came as expected
        self.head = None

    def fits(self, fields, meta, outs, meta_out, src_out) -> bool:
        """These tensors are laid out as the ones this call was made of: the same addresses work for them."""
        lay = self.layouts
        return (_layout_of(fields) == lay[0] and _layout_of((meta, meta_out)) == lay[1] and _layout_of(outs) == lay[2]
                and (None if src_out is None else src_out.numel()) == lay[3]
                and (src_out is None or (src_out.dtype is torch.int32 and src_out.is_contiguous())))

    def _keep(self) -> None:
        send, (nb, _, min_run, room, _, meta_bytes, meta_stride, _, fields, own) = self.first
        self.head, self.payload, self.dests = send[:4], tuple(p[1:] for p in send[5]), send[6]
        self.step, self.meta_out, self.out_fields = (nb, min_run, room), (meta_bytes, meta_stride), \
            tuple(f[1:] for f in fields)
        self.own, self.own_strides = own[:4], (own[5], tuple(st for _, st in own[6]))
        self.first = None

    def rerouted(self, sels: Sequence[torch.Tensor], words: Sequence[Sequence[int]], own: torch.Tensor
                 ) -> Optional[tuple]:
        """``run``'s ``route`` for a call that sends rows ``sels`` with control words ``words`` (both in send
        order) and takes its own rows ``own`` (as many as the call was made for): the same slots, outputs
        and messages expected, other row lists. None where a list cannot go this way."""
        if self.head is None:
            self._keep()
        dests = _kept_dests(self.alive[0], sels, words)
        if dests is None or not _contiguous_int64(own) or own.shape[0] != self.own[1]:
            return None
        return dests, (own.data_ptr() if own.shape[0] else 0,) + self.own[1:]

    def run(self, fields, meta, outs, meta_out, src_out, flag: int, sources: list, spin_ns: int,
            first: bool = False, route: Optional[tuple] = None) -> int:
        """native.c's ``exchange_reorder`` of these tensors, which ``fits``: 0, 1, 2 or 3 (see
        ``NativeEngine.run_reorder``). ``first``: this is the call ``reorder_call`` made it with (those tensors
        and that flag; the staging holds its meta items); ``route``: other row lists (``rerouted``)."""
        # (the C loop checks every staging row, source and output row before it stores or copies anything)
        if first:
            send, reorder = self.first
            return _native.exchange_reorder(send, self.ctrl, reorder[:9] + (sources, reorder[9]), int(spin_ns))
        if self.head is None:
            self._keep()
        dests, own = route if route is not None else (self.dests, self.own)
        self.meta_items.copy_(meta)     # (the stores copy the staging's meta items with the rows)
        flag = int(flag)
        nb, min_run, room = self.step
        return _native.exchange_reorder(
            self.head + (flag, tuple((fields[i].data_ptr(),) + q for i, q in zip(self.pay_idx, self.payload)),
                         dests), self.ctrl,
            (nb, flag, min_run, room, 0 if meta_out is None else meta_out.data_ptr(), *self.meta_out,
             0 if src_out is None else src_out.data_ptr(),
             tuple((outs[i].data_ptr(),) + q for i, q in zip(self.out_idx, self.out_fields)), sources,
             own + (meta.data_ptr(), self.own_strides[0],
                    tuple((fields[i].data_ptr(), st) for i, st in zip(self.out_idx, self.own_strides[1])))),
            int(spin_ns))


class NativeEngine(TorchEngine):
    name = "native"

    def __init__(self) -> None:
        if _native is None:
            raise RuntimeError("backend='native' needs the C module ubep_torch._native, which was not built "
                               "(install the package on a machine with a C compiler, or use backend='torch')")
        if not _matches():
            raise RuntimeError("ubep_torch._native was built from other sources than this package; reinstall it "
                               "(make install, or pip install -e .)")
        _env_store_policy()
        super().__init__()
        self._send_plans: OrderedDict = OrderedDict()
        self._last_dests: dict = {}    # send plan key -> (words, row lists, destinations) of its last call
        self._forgotten = False

    # ------------------------------------------------------------------ sender side
    def write_rows(self, fmt: P.RowFormat, staging, checked: Optional[torch.Tensor], sel: Optional[torch.Tensor],
                   dst: torch.Tensor, flag: int, dst_index: Optional[torch.Tensor] = None,
                   meta_patch: Optional[torch.Tensor] = None) -> None:
        n = staging.n if sel is None and isinstance(staging, DirectRows) else (
            sel.shape[0] if sel is not None else -1)
        if not (fmt.sync == "tff" and isinstance(staging, DirectRows) and dst_index is None and n >= 0):
            return super().write_rows(fmt, staging, checked, sel, dst, flag, dst_index, meta_patch)
        if n == 0:
            return
        rows = dst[:n]
        fields = _payload_fields(staging)
        patch = _patch_rows(fmt, meta_patch, n)
        if fields is None or patch is None or rows.shape[0] != n or not _slots(rows, fmt):
            return super().write_rows(fmt, staging, checked, sel, dst, flag, dst_index, meta_patch)
        if sel is not None and not _contiguous_int64(sel):
            sel = sel.to(torch.int64).contiguous()
        patch_t, items = patch
        # (the C loop checks every staging row index against the staged rows before it stores anything)
        _native.write_rows(rows.data_ptr(), n, fmt.blocks, 0 if sel is None else sel.data_ptr(), staging.meta.shape[0],
                           staging.meta.data_ptr(), patch_t.data_ptr() if items else 0, items, int(staging.rank),
                           int(flag), fields)

    def send_phase(self, job: SendJob, key: Optional[tuple] = None) -> None:
        """TFF: the whole send phase (every destination's control message, then its rows) in one C call,
        with the same stores as ``TorchEngine.send_phase``; other jobs take the inherited path. With a
        ``key`` (see ``send_again``), the checked destinations are kept for later calls of that key."""
        st, fmt = job.staging, job.fmt
        fields = _payload_fields(st) if fmt.sync == "tff" and isinstance(st, DirectRows) \
            and len(job.dests) <= _MAX_DESTS else None
        dests, alive = [], []      # (alive: converted index and patch tensors, until the C call returns)
        for d in job.dests if fields is not None else ():
            sel = d.sel
            n = sel.shape[0] if isinstance(sel, torch.Tensor) and sel.dim() == 1 else -1
            patch = _patch_rows(fmt, d.meta_patch, n) if n >= 0 else None
            if patch is None or d.dst_index is not None or n > d.rows.shape[0] or not _slots(d.rows, fmt) \
                    or not _ctrl_blocks(d.ctrl):
                fields = None
                break
            if n and not _contiguous_int64(sel):
                sel = sel.to(torch.int64).contiguous()
            patch_t, items = patch
            alive += [sel, patch_t]
            words = d.ctrl_payload.tolist() if isinstance(d.ctrl_payload, torch.Tensor) else d.ctrl_payload
            dests.append((d.rows.data_ptr(), n, sel.data_ptr() if n else 0, d.ctrl.data_ptr(), d.ctrl.shape[0],
                          tuple(words), patch_t.data_ptr() if items else 0, items))
        if fields is None:
            return super().send_phase(job)
        # (the C loop checks every staging row, payload size and patch width before it stores anything)
        _native.send_exchange(fmt.blocks, st.meta.shape[0], st.meta.data_ptr(), int(st.rank), int(job.flag),
                              fields, tuple(dests))
        del alive
        # kept: where each destination's slots and control blocks are, how many rows they hold (and the views
        # whose addresses those are); not once forgotten (destroy() in another thread while the C call ran)
        if key is not None and not self._forgotten and all(d.meta_patch is None for d in job.dests):
            if key not in self._send_plans and len(self._send_plans) >= _MAX_PLANS:
                self._last_dests.pop(self._send_plans.popitem(last=False)[0], None)
            self._last_dests.pop(key, None)
            self._send_plans[key] = (tuple((d.rows.data_ptr(), d.rows.shape[0], d.ctrl.data_ptr(), d.ctrl.shape[0])
                                           for d in job.dests), [(d.rows, d.ctrl) for d in job.dests], fmt.blocks)

    def peer_reads(self, flag: int, notes: Sequence[Sequence[int]]) -> None:
        """The peers' reports of what reading this rank's rows of ``flag``'s kind has cost them, each way
        (``[way, plain, streaming]`` per peer, ns per MiB, 0: not measured), averaged over the peers that
        reported, for the store policy."""
        plain = [n[1] for n in notes if n[1] > 0]
        streaming = [n[2] for n in notes if n[2] > 0]
        if plain or streaming:
            _native.store_peer_reads(int(flag), sum(plain) / len(plain) if plain else 0.0,
                                     sum(streaming) / len(streaming) if streaming else 0.0)

    def forget(self) -> None:
        self._forgotten = True
        self._send_plans.clear()
        self._last_dests.clear()

    def send_again(self, key: tuple, fmt: P.RowFormat, staging, flag: int, sels: Sequence[torch.Tensor],
                   words: Sequence[Sequence[int]]) -> bool:
        """The send phase of a call whose destinations (slots and control blocks) are those of an earlier
        ``send_phase(job, key)``, for the rows ``staging`` holds now: destination i (in the job's order) gets
        staging rows ``sels[i]`` and control words ``words[i]``. False, with nothing stored, when no send
        phase of that key is kept, the rows are not TFF rows the C stores take or not rows of the size the kept
        slots were checked for, a row list is not a 1-D contiguous int64 tensor or has more rows than its
        slots hold.

        ``key`` must name everything the slots and control blocks are made of: the caller builds it from the
        region, its half, the control blocks and the row size (the peers' memory is mapped once)."""
        plan = self._send_plans.get(key)
        # (rows of another size than the kept slots hold: their row capacity means nothing for these)
        if plan is None or plan[2] != fmt.blocks or fmt.sync != "tff" or not isinstance(staging, DirectRows) \
                or not len(sels) == len(words) == len(plan[0]):
            return False
        self._send_plans.move_to_end(key)
        fields = _payload_fields(staging)
        dests = _kept_dests(plan, sels, words)
        if fields is None or dests is None:
            return False
        # (the C loop checks every staging row and the control words' size before it stores anything)
        _native.send_exchange(fmt.blocks, staging.meta.shape[0], staging.meta.data_ptr(), int(staging.rank),
                              int(flag), fields, dests)
        return True

    def stage_and_send(self, key: tuple, fmt: P.RowFormat, fields: Sequence[torch.Tensor],
                       meta: Optional[torch.Tensor], src_index: torch.Tensor, rank: int, flag: int,
                       sels: Sequence[torch.Tensor], words: Sequence[Sequence[int]]) -> bool:
        """``stage_rows`` then ``send_again`` in one step, for TFF rows of a format staged before (with the same
        ``src_index``, ``rank`` and presence of ``meta``) to destinations of a kept send phase: the kept meta
        blocks take ``meta``, and the payload is stored straight from ``fields``. False, with nothing written,
        where either step would take its general path (the caller then stages and sends)."""
        send = self._send_args(key, fmt, fields, meta, src_index, rank, flag, sels, words)
        if send is None:
            return False
        # (the C loop checks every staging row and the control words' size before it stores anything)
        _native.send_exchange(*send[0])
        return True

    def _send_args(self, key: tuple, fmt: P.RowFormat, fields: Sequence[torch.Tensor], meta: Optional[torch.Tensor],
                   src_index: torch.Tensor, rank: int, flag: int, sels: Sequence[torch.Tensor],
                   words: Sequence[Sequence[int]]) -> Optional[tuple]:
        """``send_exchange``'s arguments for ``stage_and_send``, with ``meta`` staged; None, with nothing
        written, where the send would take its general path."""
        plan = self._send_plans.get(key)
        n = src_index.shape[0]
        staged = self._scratch.get((fmt, n, rank, meta is not None)) \
            if src_index is self._spans.get((0, n)) else None
        if plan is None or staged is None or plan[2] != fmt.blocks or fmt.sync != "tff" \
                or not len(sels) == len(words) == len(plan[0]):
            return None
        meta_blk, meta_items, places, _ = staged
        payload = []
        for i, off, full, rem in places:
            spec = _field_spec(fields[i], n, off, full, rem)
            if spec is None:
                return None
            payload.append(spec)
        # (the destinations of the last call of this plan, where this one sends the same row lists, the very
        # tensors, and the same control words: the usual call of a routing seen before)
        last = self._last_dests.get(key)
        if last is not None and last[0] == words and len(last[1]) == len(sels) and \
                all(a is b for a, b in zip(last[1], sels)):
            dests = last[2]
        else:
            dests = _kept_dests(plan, sels, words)
            if dests is None:
                return None
            self._last_dests[key] = (words, sels, dests)     # (the caller does not change them after the call)
        if meta is not None:
            meta_items.copy_(meta)
        self._send_plans.move_to_end(key)
        # (the plan: the views of the destinations' memory, held by the caller until the stores are done)
        return (fmt.blocks, n, meta_blk.data_ptr(), int(rank), int(flag), tuple(payload), dests), plan

    def reorder_call(self, key: tuple, fmt: P.RowFormat, fields: Sequence[torch.Tensor], meta: Optional[torch.Tensor],
                     src_index: torch.Tensor, rank: int, flag: int, sels: Sequence[torch.Tensor],
                     words: Sequence[Sequence[int]], ctrl: torch.Tensor, nctrl: int, expected: bytes, skip: int,
                     outs: Sequence[Optional[torch.Tensor]], meta_out: Optional[torch.Tensor],
                     src_out: Optional[torch.Tensor], min_run: int, own: tuple,
                     free: Tuple[int, int] = (0, 0)) -> Optional["ReorderCall"]:
        """The arguments of ``run_reorder`` that stay the same from call to call of one layout (a
        ``ReorderCall``): ``stage_and_send``'s send of ``fields`` and ``meta`` to the kept send phase ``key``
        (row lists ``sels``, control words ``words``), every source's control message (``ctrl``: [R, max
        blocks, 512] uint8, ``_Region.ctrl_sources``, of which each message takes the first ``nctrl``; the first
        ``len(expected) // (8 R)`` words of each must equal ``expected``, an int64 buffer, but for the word
        indices in the bit mask ``skip`` and the words [free[0], free[1]), which each run leaves for the caller in
        the call's ``words``, [R, m] int64), then the sources' rows reordered as a ``reorder_sources`` step of
        ``(fields, meta)`` does with ``own`` (``(rows, first output row)`` of the own rows). The call of these
        arguments (``flag``) runs it first (``run_reorder(..., first=True)``; its meta items are staged here); a
        later call of the same layout runs it again with other tensors that ``ReorderCall.fits``. None where the
        send or the reordering would take a general path."""
        R = ctrl.shape[0]
        if not (fmt.sync == "tff" and ctrl.dim() == 3 and ctrl.dtype == torch.uint8 and ctrl.is_contiguous()
                and ctrl.shape[2] == P.BLOCK_BYTES and 0 < nctrl <= ctrl.shape[1] and len(expected) % (8 * R) == 0):
            return None
        prep = _reorder_args(fmt, outs, meta_out, src_out, (fields, meta))
        if prep is None or prep[2] is None or meta is None:
            return None
        outputs, room, (limit, meta_p, meta_stride_src, srcs) = prep
        sel, offset = own
        if not _contiguous_int64(sel):
            return None
        send = self._send_args(key, fmt, fields, meta, src_index, rank, flag, sels, words)
        if send is None:
            return None
        staged = self._scratch.get((fmt, src_index.shape[0], rank, True))
        pay_idx = tuple(i for i, _, _, _ in staged[2])
        out_idx = tuple(i for i, o in enumerate(outs) if o is not None and fmt.field_blocks[i])
        # (the payload's and the own rows' sources are the same tensors, fields)
        if [p[0] for p in send[0][5]] != [fields[i].data_ptr() for i in pay_idx] or \
                [p for p, _ in srcs] != [fields[i].data_ptr() for i in out_idx] or meta_p != meta.data_ptr():
            return None
        m = len(expected) // (8 * R)
        words_out = np.zeros((R, m), dtype=np.int64)
        return ReorderCall(
            send[0], (ctrl.data_ptr(), ctrl.stride(0), int(nctrl), R, m, expected, int(skip), int(free[0]),
                      int(free[1]), words_out.ctypes.data),
            (fmt.blocks, int(flag), int(min_run), room, *outputs,
             (sel.data_ptr(), sel.numel(), limit, int(offset), meta_p, meta_stride_src, tuple(srcs))),
            pay_idx, out_idx, (_layout_of(fields), _layout_of((meta, meta_out)), _layout_of(outs),
                               None if src_out is None else src_out.numel()),
            staged[1], (send[1], staged, list(sels), ctrl, sel, words), words_out)

    def run_reorder(self, call: "ReorderCall", fields: Sequence[torch.Tensor], meta: torch.Tensor,
                    outs: Sequence[torch.Tensor], meta_out: Optional[torch.Tensor], src_out: Optional[torch.Tensor],
                    flag: int, sources: list, spin_ns: int, first: bool = False, route: Optional[tuple] = None) -> int:
        """A normal dispatch's exchange in one C call (native.c's ``exchange_reorder``), for a caller that expects
        the control messages of the last one again: the send of ``call`` (``reorder_call``) with these
        ``fields`` and ``meta``, every source's control message as it expects them, then the rows of
        ``sources`` reordered into ``outs``, ``meta_out`` and ``src_out`` (the own rows first), for up to
        ``spin_ns``; the tensors must fit ``call`` (``first``: the call ``reorder_call`` made it for; ``route``:
        other row lists, ``ReorderCall.rerouted``). 0 (done: ``sources`` advanced), 1 (a message not as
        expected), 2 (rows missing) or 3 (a message missing): then only the send has happened, and the caller
        receives the call the general way."""
        return call.run(fields, meta, outs, meta_out, src_out, flag, sources, spin_ns, first, route)

    def ctrl_poller(self, ctrl: torch.Tensor, nctrl: int) -> Optional[Callable[[int, list], list]]:
        """``poll(flag, words)``: one poll of every source's control message, where ``ctrl`` is every
        source's control blocks, [R, max blocks, 512] uint8 contiguous (``_Region.ctrl_sources``), of which
        each message takes the first ``nctrl``. ``words[s]`` (None until then, one entry per source)
        becomes source s's payload words once its ``nctrl`` blocks carry ``flag``; it returns the sources
        still missing. None where the C loop cannot address ``ctrl``."""
        if not (ctrl.dim() == 3 and ctrl.dtype == torch.uint8 and ctrl.is_contiguous()
                and ctrl.shape[2] == P.BLOCK_BYTES and 0 < nctrl <= ctrl.shape[1]):
            return None
        base, stride, world, native_poll = ctrl.data_ptr(), ctrl.stride(0), ctrl.shape[0], _native.poll_ctrl

        def poll(flag: int, words: list) -> list:
            if len(words) != world:
                raise ValueError(f"poll_ctrl: {len(words)} entries of words for {world} sources")
            return native_poll(base, stride, nctrl, flag, words)
        poll.keep = ctrl      # (the blocks stay mapped while the poller lives)
        return poll

    def reorder_sources(self, fmt: P.RowFormat, outs: Sequence[Optional[torch.Tensor]],
                        meta_out: Optional[torch.Tensor], src_out: Optional[torch.Tensor],
                        min_run: int, own_src: Optional[tuple] = None) -> Optional[Callable[..., list]]:
        """Streaming Token-Reordering of several sources per poll: returns ``step(sources, flag, own=None)``,
        which takes ``[[slots [n, blocks, 512] address, n, first output row, rows done, rank], ...]`` and
        reorders every source's newly complete rows (runs of at least ``min_run`` rows, or up to its last row)
        into the outputs (as ``unpack_to``), advancing "rows done"; it returns the ranks that completed (a
        source's list may end in a sixth item, the way its rows were stored as its control message names it:
        the copies are then timed for ``store_policy``). None
        when the rows are not TFF or an output is not addressable row by row.

        ``own_src``: ``(fields, meta)``, the tensors this rank's own rows come from ([T, bytes] rows per field
        of ``outs``, [T, m] int32 meta items or None), which never go through the slots; ``step(..., own=(sel,
        offset))`` then first copies their rows ``sel`` (int64) to output rows offset.. (payload, meta items,
        and the source row as source token), in the same C call. A step made without them (or whose sources
        the C loop cannot address) takes no ``own``: the caller copies those rows itself."""
        prep = _reorder_args(fmt, outs, meta_out, src_out, own_src)
        if prep is None:
            return None
        outputs, room, own_spec = prep

        def step(sources: list, flag: int, own: Optional[tuple] = None,
                 _alive=(outs, meta_out, src_out, own_src)) -> list:
            # (_alive: the outputs and sources whose addresses ``outputs`` and ``own_spec`` hold live as long as
            # the step does; the C loop checks every source's output rows against them before it writes)
            if own is None:
                return _native.reorder_sources(fmt.blocks, int(flag), int(min_run), room, *outputs, sources)
            sel, offset = own
            if own_spec is None:
                raise ValueError("reorder_sources: this step has no own rows to copy (see own_src)")
            if not _contiguous_int64(sel):
                sel = sel.to(torch.int64).contiguous()
            limit, meta_p, meta_stride_src, srcs = own_spec
            return _native.reorder_sources(fmt.blocks, int(flag), int(min_run), room, *outputs, sources,
                                           (sel.data_ptr(), sel.numel(), limit, int(offset), meta_p,
                                            meta_stride_src, srcs))
        step.copies_own = own_spec is not None
        return step

    def write_ctrl(self, dst: torch.Tensor, payload: torch.Tensor, flag: int) -> None:
        if not (_ctrl_blocks(dst) and payload.dtype == torch.int64 and payload.is_contiguous()):
            return super().write_ctrl(dst, payload, flag)
        _native.write_ctrl(dst.data_ptr(), dst.shape[0], payload.data_ptr(), payload.numel(), int(flag))

    # ------------------------------------------------------------------ receiver side
    def rows_arrived(self, fmt: P.RowFormat, rows: torch.Tensor, flag: int, expected_sum: int = 0,
                     index: Optional[torch.Tensor] = None) -> bool:
        if fmt.sync != "tff" or index is not None or not rows.is_contiguous():
            return super().rows_arrived(fmt, rows, flag, expected_sum, index)
        n = rows.shape[0]
        return n == 0 or _native.arrived(rows.data_ptr(), n, fmt.blocks, int(flag))

    def arrived_prefix(self, fmt: P.RowFormat, rows: torch.Tensor, flag: int, start: int) -> Optional[int]:
        if fmt.sync != "tff" or not _slots(rows, fmt):
            return None
        return _native.arrived_rows(rows.data_ptr(), rows.shape[0], fmt.blocks, int(flag), int(start))

    def ctrl_arrived(self, ctrl: torch.Tensor, flag: int) -> bool:
        if not ctrl.is_contiguous():
            return super().ctrl_arrived(ctrl, flag)
        return _native.arrived(ctrl.data_ptr(), 1, ctrl.shape[0], int(flag))

    def read_ctrl_words(self, ctrl: torch.Tensor) -> list:
        if not ctrl.is_contiguous():
            return super().read_ctrl_words(ctrl)
        return _native.read_ctrl(ctrl.data_ptr(), ctrl.shape[0], ctrl.shape[0] * P.CTRL_WORDS_PER_BLOCK)

    def unpack_rows(self, fmt: P.RowFormat, rows: torch.Tensor, outs: Sequence[Optional[torch.Tensor]],
                    rearm: bool = True) -> torch.Tensor:
        n = rows.shape[0]
        meta = torch.empty(n, fmt.meta_words, dtype=torch.int32)
        if not self.unpack_to(fmt, rows, None, outs, meta if fmt.meta_words else None, None):
            return super().unpack_rows(fmt, rows, outs, rearm)
        return meta

    def unpack_to(self, fmt: P.RowFormat, rows: torch.Tensor, at: Optional[torch.Tensor],
                  outs: Sequence[Optional[torch.Tensor]], meta_out: Optional[torch.Tensor],
                  src_out: Optional[torch.Tensor]) -> bool:
        """Token-Reordering in one pass: row ``i`` of ``rows`` goes to row ``at[i]`` (or ``i``) of every
        ``outs`` field ([rows, nbytes] uint8), of ``meta_out`` ([rows, m] int32, its first m meta items)
        and of ``src_out`` ([rows] int32, the source token). Returns False (nothing written) when the rows
        are not TFF or an output is not addressable row by row; the caller then takes the torch path."""
        n = rows.shape[0]
        if fmt.sync != "tff" or not _slots(rows, fmt):
            return False
        if at is not None and (not _contiguous_int64(at) or at.numel() != n):
            return False
        spec = _reorder_outputs(fmt, outs, meta_out, src_out)
        if spec is None:
            return False
        fields, targets, meta_bytes, meta_stride = spec
        if n:
            room = min(targets) if targets else n
            _native.unpack(rows.data_ptr(), n, fmt.blocks, 0 if at is None else at.data_ptr(), room,
                           0 if meta_out is None else meta_out.data_ptr(), meta_bytes, meta_stride,
                           0 if src_out is None else src_out.data_ptr(), tuple(fields))
        return True

    def pair_order(self, topk_idx: torch.Tensor, E: int) -> tuple:
        if not (_contiguous_int64(topk_idx) and topk_idx.dim() == 2):
            return super().pair_order(topk_idx, E)
        T, K = topk_idx.shape
        m = T * K
        # (one allocation, sliced: token, slot and expert of every pair, pos, counts)
        out = torch.empty(4 * m + E, dtype=torch.int64)
        p = out.data_ptr()
        n = _native.pair_order(topk_idx.data_ptr(), T, K, E, p, p + 8 * m, p + 16 * m, p + 24 * m, p + 32 * m)
        return out[:n], out[m:m + n], out[2 * m:2 * m + n], out[4 * m:], out[3 * m:4 * m].view(T, K)

    def routing_layout(self, topk_idx: torch.Tensor, E: int, R: int) -> tuple:
        if not (_contiguous_int64(topk_idx) and topk_idx.dim() == 2):
            return super().routing_layout(topk_idx, E, R)
        T, K = topk_idx.shape
        ntpr, ntpe = torch.empty(R, dtype=torch.int32), torch.empty(E, dtype=torch.int32)
        itr, head = torch.empty(T, R, dtype=torch.bool), torch.empty(T, R, dtype=torch.int32)
        send_idx = torch.empty(R, T, dtype=torch.int64)
        lo, hi = _native.routing_layout(topk_idx.data_ptr(), T, K, E, R, ntpe.data_ptr(), itr.data_ptr(),
                                        ntpr.data_ptr(), send_idx.data_ptr(), head.data_ptr())
        if lo < -1 or hi >= E:
            return lo, hi, None
        flat = send_idx.view(-1)      # (slicing a flat tensor costs a fraction of indexing the 2-D one)
        return lo, hi, (ntpr, ntpe, itr, [flat[r * T:r * T + n] for r, n in enumerate(ntpr.tolist())], head)

    def meta_items(self, topk_idx: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        if not (_contiguous_int64(topk_idx) and topk_idx.dim() == 2 and (weights is None or (
                weights.is_contiguous() and weights.dtype in (torch.float32, torch.float64)
                and weights.shape == topk_idx.shape))):
            return super().meta_items(topk_idx, weights)
        T, K = topk_idx.shape
        wsz = 0 if weights is None else weights.element_size() // 4
        out = torch.empty(T, K + K * wsz, dtype=torch.int32)
        if out.numel():
            _native.meta_items(topk_idx.data_ptr(), T, K, 0 if weights is None else weights.data_ptr(), wsz,
                               out.data_ptr())
        return out

    def local_topk(self, meta: torch.Tensor, K: int, wdtype: Optional[torch.dtype], lo: int, E_local: int,
                   valid_rows: int) -> tuple:
        if not (meta.dtype == torch.int32 and meta.dim() == 2 and meta.is_contiguous()):
            return super().local_topk(meta, K, wdtype, lo, E_local, valid_rows)
        rows = meta.shape[0]
        idx = torch.empty(rows, K, dtype=torch.int64)
        w = None if wdtype is None else torch.empty(rows, K, dtype=wdtype)
        wsz = 0 if w is None else w.element_size() // 4
        _native.local_topk(meta.data_ptr(), rows, meta.shape[1], K, wsz, lo, E_local, valid_rows, idx.data_ptr(),
                           0 if w is None else w.data_ptr())
        return idx, w

    def ll_calcumsum(self, ctrl: torch.Tensor, nctrl: int, first: int, E_local: int, N: int,
                     layout_range: torch.Tensor, recv_count: torch.Tensor) -> tuple:
        R = ctrl.shape[0]
        check_ctrl_words(first, E_local, nctrl)
        # (the C loop reads whole 512 B blocks of every source: the view must be exactly that, in host memory)
        if not (ctrl.dim() == 3 and ctrl.dtype == torch.uint8 and tuple(ctrl.stride()[1:]) == (P.BLOCK_BYTES, 1)
                and ctrl.shape[2] == P.BLOCK_BYTES and 0 < nctrl <= ctrl.shape[1] and _contiguous_int64(layout_range)
                and tuple(layout_range.shape) == (E_local, R) and recv_count.dtype == torch.int32
                and recv_count.is_contiguous() and recv_count.numel() == E_local
                and ctrl.device.type == layout_range.device.type == recv_count.device.type == "cpu"):
            return super().ll_calcumsum(ctrl, nctrl, first, E_local, N, layout_range, recv_count)
        out = torch.empty(3, R, E_local, dtype=torch.int64)
        rows = _native.ll_calcumsum(ctrl.data_ptr(), R, ctrl.stride(0), first, E_local, N, out.data_ptr(),
                                    layout_range.data_ptr(), recv_count.data_ptr())
        cnt, begin, seg_first = out.unbind(0)
        return cnt, begin, seg_first, rows

    def layout_rows(self, layout_range: torch.Tensor, N: int, n: int) -> tuple:
        if not (_contiguous_int64(layout_range) and layout_range.dim() == 2 and layout_range.device.type == "cpu"):
            return super().layout_rows(layout_range, N, n)
        E_local, R = layout_range.shape
        rows = torch.empty(n, dtype=torch.int64)
        per_source = _native.layout_rows(layout_range.data_ptr(), E_local, R, N, rows.data_ptr(), n)
        return rows, per_source

    def segment_rows(self, first: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        first, counts = first.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
        if first.numel() != counts.numel():
            raise ValueError("segment_rows: first and counts differ in length")
        out = torch.empty(n, dtype=torch.int64)
        _native.segment_rows(first.data_ptr(), counts.data_ptr(), counts.numel(), out.data_ptr(), n)
        return out

    def token_rows(self, t_idx: torch.Tensor, k_idx: torch.Tensor, g: torch.Tensor, counts: torch.Tensor, T: int,
                   K: int) -> tuple:
        R, E_local = counts.shape
        if not (_contiguous_int64(t_idx) and _contiguous_int64(k_idx) and _contiguous_int64(g)):
            t_idx, k_idx, g = (v.to(torch.int64).contiguous() for v in (t_idx, k_idx, g))
        tokens = torch.empty(R * T + R, dtype=torch.int64)      # (then the rows per destination)
        items = torch.empty(R * T, 1 + 2 * K, dtype=torch.int32)
        _native.token_rows(t_idx.data_ptr(), k_idx.data_ptr(), g.data_ptr(), g.numel(), T, E_local, R, K,
                           tokens.data_ptr(), items.data_ptr(), tokens.data_ptr() + 8 * R * T)
        bounds = list(accumulate(tokens[R * T:].tolist(), initial=0))
        return ([tokens[bounds[r]:bounds[r + 1]] for r in range(R)],
                [items[bounds[r]:bounds[r + 1]] for r in range(R)])

    def ll_dispatch_receive(self, fmt: P.RowFormat, ctrl: torch.Tensor, nctrl: int, expected: bytes, flag: int,
                            slots: torch.Tensor, part_bytes: int, N: int, K: int, me: int,
                            outs: Sequence[torch.Tensor], own: Optional[tuple], results: Sequence[torch.Tensor],
                            spin_ns: int) -> Optional[int]:
        """A low-latency dispatch's receive of TFF rows of one row per token in one C call (native.c's
        ``ll_dispatch_receive``), polling for up to ``spin_ns``: every source's control message (``ctrl``: [R, max
        blocks, 512] uint8, ``_Region.ctrl_sources``, each message its first ``nctrl`` blocks), whose first
        ``6 + E_local`` words must equal ``expected`` (an int64 buffer of R rows) but for its row count, checksum,
        return slot and counts; CalCumSum of the counts; every source's rows (source s's at ``slots``' address +
        s * ``part_bytes``, ``N`` rows at least: ``slots`` is source 0's) reordered into ``outs`` ([E_local * R *
        N, bytes] uint8 per field) as ``unpack_items`` does, and ``own`` = ``(x rows per field, token list, top-k
        slots)`` of this rank's pairs copied from its own rows (None: they came through the slots). ``results`` =
        (counts, begins and flat begins [3, R, E_local] int64, layout_range, recv_count, source tokens and top-k
        slots of every output row (int32), return slots [R] int64, ns waited per source [R] int64, added to). 0:
        done; 1, 2 or 3 (a message not as expected, rows missing, a message missing): the caller receives the call
        the general way. None where the C loop cannot address the tensors, with nothing done."""
        cnt3, layout_range, recv_count, info, k_out, return_slot, waited = results
        R, E_local = cnt3.shape[1:]
        if not (fmt.sync == "tff" and _slots(slots, fmt) and slots.shape[0] >= N and ctrl.dim() == 3
                and ctrl.is_contiguous() and ctrl.dtype == torch.uint8 and ctrl.shape[2] == P.BLOCK_BYTES
                and 0 < nctrl <= ctrl.shape[1] and ctrl.shape[0] == R
                and len(expected) == 8 * R * (P.CTRL_COUNTS + E_local)
                and all(_contiguous_int64(t) for t in (cnt3, layout_range, return_slot, waited))
                and recv_count.dtype == info.dtype == k_out.dtype == torch.int32
                and all(t.is_contiguous() for t in (recv_count, info, k_out))
                and info.numel() == k_out.numel() == E_local * R * N and recv_count.numel() == E_local
                and layout_range.numel() == E_local * R and return_slot.numel() == waited.numel() == R
                and cnt3.numel() == 3 * R * E_local and len(outs) == len(fmt.fields)):
            return None
        fields = []
        for i, out in enumerate(outs):
            if not (_rows_of(out, torch.uint8, fmt.fields[i][1]) and out.shape[0] == E_local * R * N):
                return None
            fields.append((out.data_ptr(), out.stride(0), fmt.fields[i][1], fmt.field_offset_blocks(i)))
        own_args = ()
        if own is not None:
            rows, idx, pk = own
            if not (len(rows) == len(outs) and _contiguous_int64(idx) and _contiguous_int64(pk)
                    and idx.numel() == pk.numel()
                    and all(_rows_of(r, torch.uint8, fmt.fields[i][1]) and r.shape[0] == rows[0].shape[0]
                            for i, r in enumerate(rows))):
                return None
            own_args = (idx.data_ptr(), pk.data_ptr(), idx.numel(), rows[0].shape[0],
                        tuple((r.data_ptr(), r.stride(0)) for r in rows))
        words = torch.empty(R, P.CTRL_COUNTS + E_local, dtype=torch.int64)
        skip = (1 << P.CTRL_NROWS) | (1 << P.CTRL_CHECKSUM) | (1 << P.CTRL_RETURN_SLOT)
        # (the C loop checks the own token list first; every count, row count, return slot and item it reads
        # from the peers before it writes by them: what it does not take, it leaves to the general way)
        return _native.ll_dispatch_receive(
            (ctrl.data_ptr(), ctrl.stride(0), nctrl, R, P.CTRL_COUNTS + E_local, expected, skip, P.CTRL_COUNTS,
             P.CTRL_COUNTS + E_local, words.data_ptr()),
            (slots.data_ptr(), part_bytes, fmt.blocks, flag, N, K, E_local, me), tuple(fields), own_args,
            (cnt3.data_ptr(), layout_range.data_ptr(), recv_count.data_ptr(), info.data_ptr(), k_out.data_ptr(),
             return_slot.data_ptr(), waited.data_ptr()), spin_ns)

    def unpack_items(self, fmt: P.RowFormat, rows: torch.Tensor, K: int, base: torch.Tensor, cnt: torch.Tensor,
                     outs: Sequence[Optional[torch.Tensor]], info_out: torch.Tensor, k_out: torch.Tensor) -> None:
        fields, targets = [], [info_out.numel(), k_out.numel()]
        usable = (fmt.sync == "tff" and _slots(rows, fmt) and _contiguous_int64(base) and _contiguous_int64(cnt)
                  and base.numel() == cnt.numel() and info_out.dtype == k_out.dtype == torch.int32
                  and info_out.is_contiguous() and k_out.is_contiguous())
        for i, out in enumerate(outs):
            if out is None or fmt.field_blocks[i] == 0:
                continue
            if not _rows_of(out, torch.uint8, fmt.fields[i][1]):
                usable = False
                break
            fields.append((out.data_ptr(), out.stride(0), fmt.fields[i][1], fmt.field_offset_blocks(i)))
            targets.append(out.shape[0])
        if not usable:
            return super().unpack_items(fmt, rows, K, base, cnt, outs, info_out, k_out)
        if rows.shape[0]:   # (the C loop checks every item before it writes)
            _native.unpack_items(rows.data_ptr(), rows.shape[0], fmt.blocks, K, base.data_ptr(), cnt.data_ptr(),
                                 base.numel(), min(targets), info_out.data_ptr(), k_out.data_ptr(), tuple(fields))

    def copy_rows(self, src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, at: torch.Tensor) -> bool:
        if not (src.dtype == dst.dtype and _rowwise(src) and _rowwise(dst) and src.shape[1] == dst.shape[1]
                and _contiguous_int64(idx) and _contiguous_int64(at) and idx.numel() == at.numel()):
            return False
        n = idx.numel()
        if n:   # (the C loop checks both index lists before it copies)
            _native.copy_rows(src.data_ptr(), src.stride(0) * src.element_size(), idx.data_ptr(), n, src.shape[0],
                              dst.data_ptr(), dst.stride(0) * dst.element_size(), at.data_ptr(), dst.shape[0],
                              src.shape[1] * src.element_size())
        return True

    # ------------------------------------------------------------------ combine reductions
    def reduce_sources(self, fmt: P.RowFormat, sources: Sequence[tuple], out: torch.Tensor,
                       read: Optional[tuple] = None) -> None:
        T, H = out.shape
        sources = [(rows, tok) for rows, tok in sources if rows.shape[0]]
        if fmt.sync == "tff" and out.dtype == torch.bfloat16 and out.is_contiguous() and fmt.fields[0][1] == H * 2:
            toks = [tok if tok is None or _contiguous_int64(tok) else tok.to(torch.int64).contiguous()
                    for _, tok in sources]
            spec = [_source_spec(fmt, rows, tok, H) for (rows, _), tok in zip(sources, toks)]
            if None not in spec:
                _native.combine_rows_bf16(T, H, tuple(spec), out.data_ptr(), *(read or ()))
                return
        super().reduce_sources(fmt, sources, out)

    def reduce_poller(self, fmt: P.RowFormat, out: torch.Tensor, sources: Sequence[tuple]
                      ) -> Optional[Callable[[int], list]]:
        """The receive side of a one-exchange normal combine in C: returns ``poll(flag)``, which checks which
        peers' rows carry ``flag`` in every block and, once all do, sums every source into ``out`` as
        ``reduce_sources`` does, in one pass; it returns the ranks still missing. None where the C loops
        cannot address a source (``reduce_sources`` then does the work).

        ``sources``, in the order of the sum (biases, then the ranks in rank order): ``(rows, first, n, tok)``
        for plain rows (``rows[first:first + n]``, bf16 [.., H]: a bias, this rank's own), ``(rank, address,
        n, tok, way)`` for a peer's rows in this rank's slots (``way``: how the peer stored them, as its control
        message says; see ``store_policy``). ``tok``: contiguous int64 token of each row, or None (row r is
        token r)."""
        T, H = out.shape
        plan = _sum_spec(fmt, out, sources)
        if plan is None:
            return None
        spec, alive, waiting, ways, read_bytes = plan
        spec = tuple(p[:5] for p in spec)
        nb, out_p, arrived, combine = fmt.blocks, out.data_ptr(), _native.arrived, _native.combine_rows_bf16
        way = ways.pop() if len(ways) == 1 else 0

        def poll(flag: int, _alive=alive) -> list:
            # (_alive: the tensors whose addresses ``spec`` holds live as long as the poller does)
            waiting[:] = [w for w in waiting if not arrived(w[1], w[2], nb, flag)]
            if waiting:
                return [w[0] for w in waiting]
            if way:         # (the sum timed for the store policy: rows stored one way by every peer)
                combine(T, H, spec, out_p, flag, way, read_bytes)
            else:
                combine(T, H, spec, out_p)
            return []
        return poll

    def run_combine(self, call: "CombineCall", x: torch.Tensor, out: torch.Tensor, flag: int,
                    words: Sequence[Sequence[int]], expected: bytes, skip: int, spin_ns: int,
                    first: bool = False, toks: Optional[Sequence[torch.Tensor]] = None) -> int:
        """A normal combine's exchange in one C call (native.c's ``exchange_combine``), for a caller that expects
        the control messages of the last one again: ``stage_and_send``'s send of ``x`` (uint8 rows without meta
        items) with control words ``words``, every source's control message as ``run_reorder`` checks it
        (``expected``, ``skip``), then ``out`` = the sum of the sources of ``call`` (``combine_call``), which
        ``x`` and ``out`` must fit (``first``: the call ``combine_call`` made it for; ``toks``: the sources' token
        lists, see ``CombineCall.run``), once the peers' rows are all there, for up to ``spin_ns``. 0 (summed),
        1 (a message not as expected), 2 (rows missing) or 3 (a message missing): then only the send has happened
        (``out`` is not written), and the caller receives the call the general way."""
        return call.run(x, out, flag, words, expected, skip, spin_ns, first, toks)

    def combine_call(self, key: tuple, fmt: P.RowFormat, fields: Sequence[torch.Tensor], src_index: torch.Tensor,
                     rank: int, flag: int, sels: Sequence[torch.Tensor], words: Sequence[Sequence[int]],
                     ctrl: torch.Tensor, nctrl: int, expected_bytes: int, out: torch.Tensor,
                     sources: Sequence[tuple], keep: bool = True) -> Optional["CombineCall"]:
        """The arguments of ``run_combine`` that stay the same from call to call of one layout (a ``CombineCall``):
        the send of ``fields[0]`` (uint8 rows) to the kept send phase ``key`` (as ``stage_and_send``: row lists
        ``sels``, control words like ``words``), the control blocks ``ctrl`` ([R, max blocks, 512] uint8,
        ``_Region.ctrl_sources``, of which each message takes the first ``nctrl``; ``expected_bytes`` of
        expected words) and the sum of ``sources`` into ``out``, as ``reduce_poller`` takes them; the own
        source among them must be rows of ``fields[0]``'s tensor (the combine's ``x``). The call of these
        arguments (``flag``, ``words``) runs it first (``run_combine(..., first=True)``); a later call of the
        same layout runs it again with other rows and outputs that ``CombineCall.fits``, unless it was made with
        ``keep`` False (for that call alone, checked and made with less). None where the send or the sum would
        take a general path."""
        R = ctrl.shape[0]
        if not (fmt.sync == "tff" and ctrl.dim() == 3 and ctrl.dtype == torch.uint8 and ctrl.is_contiguous()
                and ctrl.shape[2] == P.BLOCK_BYTES and 0 < nctrl <= ctrl.shape[1] and expected_bytes % (8 * R) == 0):
            return None
        x_p = fields[0].data_ptr()
        if keep and any(len(src) == 4 and src[0].data_ptr() != x_p for src in sources):
            return None
        plan = _sum_spec(fmt, out, sources)
        if plan is None:
            return None
        send = self._send_args(key, fmt, fields, None, src_index, rank, flag, sels, words)
        if send is None or len(send[0][5]) != 1:
            return None
        T, H = out.shape
        # (kept alive: the row lists, the staging, the send plan's views and the control blocks, not x or out)
        alive = ([src[3] for src in sources], self._scratch.get((fmt, src_index.shape[0], rank, False)), send[1],
                 list(sels), ctrl) if keep else None
        # (rank and token list of each source the sum's spec has, in its order: those with rows)
        toks = tuple((r, src[3]) for r, src in enumerate(sources) if src[2])
        return CombineCall(send[0], tuple(plan[0]), x_p,
                           (ctrl.data_ptr(), ctrl.stride(0), int(nctrl), R, expected_bytes // (8 * R)), T, H,
                           (fields[0].stride(0), fields[0].shape[0], fields[0].shape[1]) if keep else None, alive, toks)

    combines_local_rows = True

    def weighted_combine(self, fmt: P.RowFormat, rows: torch.Tensor, topk_idx: torch.Tensor,
                         weights: torch.Tensor, out: torch.Tensor, pos: Optional[torch.Tensor] = None,
                         local: Optional[tuple] = None) -> None:
        """``TorchEngine.weighted_combine`` in one pass. ``local = (src, lo, hi, src_rows)``: slots
        ``[lo, hi)`` were not written; slot ``p`` of them is row ``src_rows[p - lo]`` of ``src`` ([n, H] bf16),
        read in place."""
        T, K = topk_idx.shape
        H = out.shape[1]
        if T == 0:
            return
        if out.dtype == torch.bfloat16 and not out.is_contiguous():     # e.g. a strided ``out=`` of the caller
            tmp = torch.empty(T, H, dtype=torch.bfloat16)
            self.weighted_combine(fmt, rows, topk_idx, weights, tmp, pos, local)
            out.copy_(tmp)
            return
        prep = self._weighted_args(fmt, rows, topk_idx, weights, out, pos, local)
        if prep is None:
            return super().weighted_combine(fmt, rows, topk_idx, weights, out, pos)
        # (the C loop checks every slot and local row index before it reads a row)
        _native.weighted_combine_bf16(*prep[0])

    def _weighted_args(self, fmt: P.RowFormat, rows: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                       out: torch.Tensor, pos: Optional[torch.Tensor], local: Optional[tuple]) -> Optional[tuple]:
        """``(arguments of native.c's weighted_combine_bf16, the tensors they address)`` for
        ``weighted_combine`` into a contiguous ``out``, or None where the C loop does not take these rows."""
        T, K = topk_idx.shape
        H = out.shape[1]
        usable = (fmt.sync == "tff" and out.dtype == torch.bfloat16 and out.shape[0] == T
                  and _slots(rows, fmt) and fmt.fields[0][1] == H * 2 and weights.dtype == torch.float32
                  and tuple(weights.shape) == (T, K))
        if local is not None and not _rowwise(local[0]):
            local = (local[0].contiguous(),) + tuple(local[1:])
        if local is not None and not (usable and local[0].dtype == torch.bfloat16 and local[0].shape[1] == H):
            raise ValueError("weighted_combine reads local rows only for TFF bf16 rows")
        if not usable or (rows.shape[0] == 0 and local is None):
            return None
        pos = torch.arange(T * K, dtype=torch.int64) if pos is None else pos.to(torch.int64).contiguous()
        topk = topk_idx.to(torch.int64).contiguous()
        if pos.numel() != T * K:
            raise ValueError(f"pos must have {T * K} entries, got {pos.numel()}")
        src = src_rows = None
        lo = hi = 0
        if local is not None:
            src, lo, hi, src_rows = local
            src_rows = src_rows.to(torch.int64).contiguous()
            if hi > lo and src_rows.numel() != hi - lo:
                raise IndexError(f"{src_rows.numel()} local combine rows for slots [{lo}, {hi})")
        w = weights.contiguous()
        return ((T, K, H, topk.data_ptr(), pos.data_ptr(), w.data_ptr(), out.data_ptr(), rows.data_ptr(),
                 rows.shape[0], fmt.row_bytes, fmt.field_offset_blocks(0) * P.BLOCK_BYTES + P.FLAG_BYTES,
                 0 if src is None else src.data_ptr(), 0 if src is None else src.stride(0) * 2, lo, hi,
                 0 if src_rows is None else src_rows.data_ptr(), 0 if src is None else src.shape[0]),
                (pos, topk, w, src, src_rows))

    def ll_combine_receive(self, fmt: P.RowFormat, ctrl: torch.Tensor, nctrl: int, expected: bytes, skip: int,
                           flag: int, rows: torch.Tensor, runs: Sequence[Tuple[int, int]], topk_idx: torch.Tensor,
                           weights: torch.Tensor, out: torch.Tensor, pos: torch.Tensor, local: Optional[tuple],
                           spin_ns: int) -> Optional[int]:
        """A low-latency combine's receive of TFF rows in one C call (native.c's ``ll_combine_receive``),
        polling for up to ``spin_ns``: every source's control message (``ctrl`` as ``ll_dispatch_receive`` takes
        it), whose first ``len(expected) // (8 R)`` words must equal ``expected`` but for the indices in the bit
        mask ``skip``; then the slots of ``rows`` in ``runs`` (``(first, count)`` each) complete, then the sum
        ``weighted_combine`` makes into ``out``. 0: summed; 1, 2 or 3 (a message not as expected, rows missing,
        a message missing): ``out`` is not written and the caller receives the call the general way. None where
        the C loop does not take these tensors, with nothing done."""
        R = ctrl.shape[0] if ctrl.dim() == 3 else 0
        if topk_idx.shape[0] == 0 or not out.is_contiguous() or not (
                ctrl.dim() == 3 and ctrl.is_contiguous() and ctrl.dtype == torch.uint8
                and ctrl.shape[2] == P.BLOCK_BYTES and 0 < nctrl <= ctrl.shape[1] and len(expected) % (8 * R) == 0
                and _slots(rows, fmt)):
            return None
        prep = self._weighted_args(fmt, rows, topk_idx, weights, out, pos, local)
        if prep is None or any(a < 0 or n < 0 or a + n > rows.shape[0] for a, n in runs):
            return None
        return _native.ll_combine_receive(
            (ctrl.data_ptr(), ctrl.stride(0), nctrl, R, len(expected) // (8 * R), expected, skip),
            (rows.data_ptr(), fmt.blocks, flag, tuple(runs)), prep[0], spin_ns)
