"""The data path: packing rows into DataBlocks, writing them into a peer's memory, polling, unpacking.

``TorchEngine`` is the vectorized torch implementation of the protocol defined in
``ubep_torch.protocol``. The Triton backend (``ubep_torch.triton_engine``) implements the same methods
with the kernels of ``kernels/`` and must produce bit-identical outputs, and memory contents in normal
mode (its low-latency rows go one per (token, expert), one per (token, rank) here).

Where a token is written into a peer's memory: :meth:`TorchEngine.write_rows` (step 1: whole blocks,
checked word withheld; step 2: the checked words), and :meth:`TorchEngine.write_ctrl` for counts.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch

from . import protocol as P
from .utils import env_flag, version_of


@dataclass
class DirectRows:
    """Rows described by where their payload lives (see :meth:`TorchEngine.stage_rows`)."""
    n: int
    parts: list                        #: per field: (first block, full blocks, [n, nbytes] data, tail block)
    meta: torch.Tensor                 #: [n, 512] uint8 meta blocks, checked word withheld
    hdr: Optional[torch.Tensor]        #: TFF: [n, blocks - 1, 3] int64 head words 1..3 of the data blocks
    rank: int = 0                      #: the sending rank (head word 3)


@dataclass
class Destination:
    """What one rank sends to one peer in one call."""
    rank: int
    sel: torch.Tensor                 #: [n] int64 staging rows, in slot order
    rows: torch.Tensor                #: [m, blocks, 512] uint8 view of the peer's slots for this source
    ctrl: torch.Tensor                #: [nctrl, 512] uint8 view of the peer's control slot for this source
    ctrl_payload: Union[torch.Tensor, List[int]]   #: int64 control words (DC: the engine fills in the checksum)
    dst_index: Optional[torch.Tensor] = None   #: [n] slot of each row (None: slots 0..n-1)
    meta_patch: Optional[torch.Tensor] = None  #: [n] or [n, m] int32 written into meta items 0 (.. m-1) of each slot


def payload_tensor(payload: Union[torch.Tensor, List[int]]) -> torch.Tensor:
    """A control message's payload words (an int64 tensor or a list of ints) as an int64 tensor."""
    return payload if isinstance(payload, torch.Tensor) else torch.tensor(payload, dtype=torch.int64)


@dataclass
class SendJob:
    """One rank's whole send phase of one call (token group + count group)."""
    fmt: P.RowFormat
    staging: torch.Tensor             #: [T, blocks, 512] uint8 packed rows
    checked: Optional[torch.Tensor]   #: SP: [T, blocks] int64 true first words
    row_sums: Optional[torch.Tensor]  #: DC: [T] int64 checksum contribution per row
    flag: int
    dests: List[Destination] = field(default_factory=list)
    sync_all: Optional[Callable[[], None]] = None   #: SyncAll for the "sw" baseline


def _sp_escaped(fmt: P.RowFormat, rows: torch.Tensor) -> bool:
    """Do SP rows hold escaped words (payload words equal to the sentinel, restored on unpacking), so their
    payload cannot be read in place?"""
    if fmt.sync != "sp" or not fmt.bitmap_words or not rows.shape[0]:
        return False
    return bool(rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, fmt.meta_words:fmt.meta_words + fmt.bitmap_words].any())


def _pair_targets(meta: torch.Tensor, K: int, base: torch.Tensor, cnt: torch.Tensor, room: int):
    """(row, output row, top-k slot) of every pair listed in one-row-per-token meta items (see
    ``TorchEngine.unpack_items``), after checking every item against the announced segments."""
    n = meta.shape[0]
    m = meta[:, 0].to(torch.int64)
    if bool(((m < 0) | (m > K)).any()):
        raise ValueError(f"a row lists more than {K} (expert, slot) pairs, or a negative number")
    pairs = P.fresh(meta[:, 1:]).view(n, K, 2).to(torch.int64)
    listed = torch.arange(K, dtype=torch.int64).unsqueeze(0) < m.unsqueeze(1)
    row = torch.arange(n, dtype=torch.int64).unsqueeze(1).expand(n, K)[listed]
    ek, pos = pairs[..., 0][listed], pairs[..., 1][listed]
    e, k = ek >> 8, ek & 0xFF
    safe_e = e.clamp(0, base.numel() - 1)
    target = base.index_select(0, safe_e) + pos
    ok = ((e >= 0) & (e < base.numel()) & (k < K) & (pos >= 0) & (pos < cnt.index_select(0, safe_e))
          & (target >= 0) & (target < room))
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise ValueError(f"row {int(row[i])} names expert {int(e[i])} slot {int(k[i])} position {int(pos[i])}, "
                         f"outside the announced segments")
    return row, target, k


def send_lists(is_token_in_rank: torch.Tensor) -> tuple:
    """Normal dispatch's send lists of a [T, R] bool routing: ``(send_idx, send_head)``, where ``send_idx[r]``
    holds the tokens that go to rank r in order (int64) and ``send_head[t, r]`` (int32) is token t's place in
    it, -1 where it does not go."""
    T, R = is_token_in_rank.shape
    send_idx = [is_token_in_rank[:, d].nonzero().squeeze(1) for d in range(R)]
    head = torch.full((T, R), -1, dtype=torch.int32)
    for d in range(R):
        head[send_idx[d], d] = torch.arange(send_idx[d].numel(), dtype=torch.int32)
    return send_idx, head


def check_ctrl_words(first: int, n: int, nctrl: int) -> None:
    """ValueError unless payload words [first, first + n) lie in ``nctrl`` control blocks."""
    if first < 0 or n < 0 or first + n > nctrl * P.CTRL_WORDS_PER_BLOCK:
        raise ValueError(f"{n} counts from word {first} do not fit {nctrl} control blocks")


class TorchEngine:
    name = "torch"
    #: the Buffer may hand this engine DirectRows, skip the slots for a rank's own rows and read payload
    #: in place from the slots (engines that run kernels on packed staging rows say False)
    direct_rows = True
    #: low-latency combine may leave a rank's own expert outputs out of the slots and hand them to
    #: ``weighted_combine(..., local=...)`` to read in place (the C path does)
    combines_local_rows = False
    #: low-latency combines of at most this many T*K*H elements take every top-k column in one step
    small_combine_elems = 1 << 20

    def __init__(self) -> None:
        # Reused scratch tensors. Fresh multi-MB allocations are mmap'ed and faulted in page by page on
        # every call, which costs more than the copies themselves; staging never outlives a call.
        self._scratch: dict = {}
        self._spans: dict = {}
        self._runs_cache: dict = {}

    def arange(self, n: int) -> torch.Tensor:
        """A shared ``arange(n)`` int64 (read-only by convention): staging keyed on it is reused."""
        return self.span(0, n)

    def span(self, lo: int, hi: int) -> torch.Tensor:
        """A shared ``arange(lo, hi)`` int64 (read-only by convention), the same tensor on every call."""
        t = self._spans.get((lo, hi))
        if t is None:
            if len(self._spans) > 64:
                self._spans.clear()
            with torch.inference_mode(False):   # kept between calls: a plain tensor in any mode
                t = self._spans[(lo, hi)] = torch.arange(lo, hi, dtype=torch.int64)
        return t

    def runs(self, sel: torch.Tensor, row_bytes: int):
        """:func:`_runs`, remembered for a selection tensor that is passed again unmodified."""
        key = (id(sel), row_bytes)
        hit = self._runs_cache.get(key)
        version = version_of(sel)
        if hit is not None and hit[0]() is sel and version is not None and hit[1] == version:
            return hit[2]
        r = _runs(sel, row_bytes)
        if version is not None:
            if len(self._runs_cache) > 64:
                self._runs_cache.clear()
            self._runs_cache[key] = (weakref.ref(sel), version, r)
        return r

    def scratch(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= int(d)
        buf = self._scratch.get((name, dtype))
        if buf is None or buf.numel() < n:
            with torch.inference_mode(False):
                buf = torch.empty(max(n, 1), dtype=dtype)
            self._scratch[(name, dtype)] = buf
        return buf[:n].view(*shape)

    # ------------------------------------------------------------------ sender side
    def pack_rows(self, fmt: P.RowFormat, fields: Sequence[Optional[torch.Tensor]], meta: Optional[torch.Tensor],
                  src_index: torch.Tensor, rank: int) -> tuple:
        """Build the local staging rows of ``n`` tokens.

        Args:
            fmt: the row format.
            fields: per field a [n, nbytes] uint8 tensor (the payload streams, e.g. x and fp8 scales).
            meta: [n, fmt.meta_words] int32 meta items (None: zero items).
            src_index: [n] int64 source token index (goes into the meta head).
            rank: this rank (TFF head word 3).
        Returns:
            ``(staging [n, blocks, 512] uint8, checked [n, blocks] int64 or None, row_sums [n] int64 or None)``.
            ``checked`` holds the true first word of every block for SP (the staging holds the sentinel
            there until step 2); ``row_sums`` is the DC checksum contribution of every row.
        """
        n = src_index.shape[0]
        nb = fmt.blocks
        staging = self.scratch("staging", (n, nb, P.BLOCK_BYTES), torch.uint8)
        words = staging.view(torch.int64).view(n, nb, P.BLOCK_WORDS)
        # payload fields
        for i, data in enumerate(fields):
            fb = fmt.field_blocks[i]
            if fb == 0:
                continue
            off = fmt.field_offset_blocks(i)
            blk = staging[:, off:off + fb]
            pay = P.payload_per_block(fmt.sync)
            nbytes = fmt.fields[i][1]
            tail = fb * pay - nbytes
            if tail:  # zero the padding of the last block so memory contents are deterministic
                start = (P.FLAG_BYTES if fmt.sync == "tff" else 0) + (pay - tail)
                blk[:, fb - 1, start:start + tail].zero_()
            P.pack_field(blk, data, fmt.sync)
        # meta block: 32 B head + meta items + (SP) escape bitmap
        head = words[:, 0, : P.HEAD_WORDS]
        head[:, 1] = src_index
        head[:, 2] = 0
        head[:, 3] = rank
        meta_area = staging[:, 0, P.FLAG_BYTES:].view(torch.int32)
        meta_area.zero_()
        if fmt.meta_words and meta is not None:
            meta_area[:, : fmt.meta_words] = meta
        checked = None
        row_sums = None
        if fmt.sync == "tff":
            # data-block heads: (flag, token, block, rank); the flag itself is written in step 2
            if nb > 1:
                dh = words[:, 1:, : P.HEAD_WORDS]
                dh[:, :, 1] = src_index.unsqueeze(1)
                dh[:, :, 2] = torch.arange(1, nb, dtype=torch.int64)
                dh[:, :, 3] = rank
            words[:, :, 0] = 0
        else:
            head[:, 0] = P.ROW_MAGIC
            if fmt.sync == "sp":
                first = words[:, 1:, 0]
                mask = P.sp_escape_inplace(first)
                if fmt.bitmap_words and bool(mask.any()):
                    meta_area[:, fmt.meta_words: fmt.meta_words + fmt.bitmap_words] = \
                        P.pack_bitmap(mask, fmt.bitmap_words)
                checked = words[:, :, 0].clone()
                words[:, :, 0] = P.SP_SENTINEL
            elif fmt.sync == "dc":
                row_sums = P.wrapping_sum(words[:, :, :4].reshape(n, nb * 4))
        return staging, checked, row_sums

    def stage_and_send(self, key: tuple, fmt: P.RowFormat, fields: Sequence[torch.Tensor],
                       meta: Optional[torch.Tensor], src_index: torch.Tensor, rank: int, flag: int,
                       sels: Sequence[torch.Tensor], words: Sequence[Sequence[int]]) -> bool:
        """``stage_rows`` and the send phase of a call in one step, where the engine has it (the C path: see
        ``NativeEngine.stage_and_send``); False here: the caller stages and sends."""
        return False

    def stage_rows(self, fmt: P.RowFormat, fields: Sequence[Optional[torch.Tensor]], meta: Optional[torch.Tensor],
                   src_index: torch.Tensor, rank: int) -> tuple:
        """Like :meth:`pack_rows`, without the packed copy: returns a :class:`DirectRows` that keeps the
        payload in the caller's tensors, so :meth:`write_rows` stores each payload byte exactly once,
        straight from the source tensor into the peer's slots (the last, partial block of a field too,
        with its padding zeroed there). Only the meta blocks are staged. Memory contents after the write
        are identical."""
        n = src_index.shape[0]
        nb = fmt.blocks
        sync = fmt.sync
        pay = P.payload_per_block(sync)
        # head words and meta blocks that depend only on (token, block, rank): kept between calls; a kept
        # block with meta items gets all of them rewritten by every call (the stores copy it synchronously)
        reusable = src_index is self._spans.get((0, n))
        plan_key = (fmt, n, rank, meta is not None)
        plan = self._scratch.get(plan_key) if reusable and sync == "tff" else None
        if plan is not None:      # (TFF rows of this format staged before: the kept blocks, each field's place)
            meta_blk, meta_items, places, hdr = plan
            if meta is not None:
                meta_items.copy_(meta)
            return DirectRows(n, [(off, full, fields[i], rem) for i, off, full, rem in places], meta_blk, hdr,
                              rank), None, None
        keep = reusable and sync != "sp"
        items = fmt.meta_words if meta is not None else 0
        key = ("meta", n, nb, rank, sync, fmt.meta_words, items)
        kept = self._scratch.get(key) if keep else None
        if kept is None:
            with torch.inference_mode(False):   # (kept between calls: plain tensors and views, in any mode)
                meta_blk = torch.zeros(n, P.BLOCK_BYTES, dtype=torch.uint8)
                kept = meta_blk, meta_blk[:, P.FLAG_BYTES:].view(torch.int32)[:, :items]   # and its meta items
            mw = meta_blk.view(torch.int64)
            mw[:, 1] = src_index
            mw[:, 3] = rank
            if sync != "tff":
                mw[:, 0] = P.ROW_MAGIC
            if keep:
                self._scratch[key] = kept
        meta_blk, meta_items = kept
        if items:
            meta_items.copy_(meta)
        # per field: (first block, full blocks, data, bytes in the last partial block)
        places = [(i, fmt.field_offset_blocks(i), fmt.fields[i][1] // pay, fmt.fields[i][1] % pay)
                  for i in range(len(fields)) if fmt.field_blocks[i]]
        parts = [(off, full, fields[i], rem) for i, off, full, rem in places]
        hdr = checked = row_sums = None
        if sync == "tff":
            if nb > 1:
                key = ("hdr", n, nb, rank)
                hdr = self._scratch.get(key) if reusable else None
                if hdr is None:
                    with torch.inference_mode(False):
                        hdr = torch.empty(n, nb - 1, 3, dtype=torch.int64)
                    hdr[:, :, 0] = src_index.unsqueeze(1)
                    hdr[:, :, 1] = torch.arange(1, nb, dtype=torch.int64)
                    hdr[:, :, 2] = rank
                    if reusable:
                        self._scratch[key] = hdr
            if reusable:
                self._scratch[plan_key] = (meta_blk, meta_items, places, hdr)
        elif sync in ("sp", "dc"):
            # the leading 32 B of every block, read from where the payload lives
            mw = meta_blk.view(torch.int64)
            lead = torch.zeros(n, nb, 4, dtype=torch.int64)
            lead[:, 0] = mw[:, :4]
            for off, full, data, rem in parts:
                if full:
                    lead[:, off:off + full] = P.fresh(data[:, : full * pay].view(n, full, pay)[:, :, :32]) \
                        .view(torch.int64).view(n, full, 4)
                if rem:
                    head = torch.zeros(n, 32, dtype=torch.uint8)
                    head[:, : min(rem, 32)] = data[:, full * pay: full * pay + min(rem, 32)]
                    lead[:, off + full] = head.view(torch.int64)
            if sync == "sp":
                first = lead[:, 1:, 0]
                mask = P.sp_escape_inplace(first)
                if fmt.bitmap_words and bool(mask.any()):
                    meta_blk[:, P.FLAG_BYTES:].view(torch.int32)[:, fmt.meta_words: fmt.meta_words + fmt.bitmap_words] \
                        = P.pack_bitmap(mask, fmt.bitmap_words)
                checked = lead[:, :, 0].clone()
                mw[:, 0] = P.SP_SENTINEL
            else:
                row_sums = P.wrapping_sum(lead.view(n, nb * 4))
        return DirectRows(n, parts, meta_blk, hdr, rank), checked, row_sums

    def _write_direct(self, fmt: P.RowFormat, st: "DirectRows", sel: torch.Tensor, out: torch.Tensor) -> None:
        """Step 1 of the atomic write for :class:`DirectRows`: everything but the checked words."""
        n = sel.shape[0]
        sync = fmt.sync
        pay = P.payload_per_block(sync)
        base = P.FLAG_BYTES if sync == "tff" else 0       # where payload starts in a block
        start = base + (8 if sync == "sp" else 0)          # first byte written in step 1
        runs = self.runs(sel, fmt.row_bytes)

        def take(src: torch.Tensor, dst: torch.Tensor) -> None:
            if runs is None:
                torch.index_select(src, 0, sel, out=dst)
                return
            for a, b, o in runs:   # runs of consecutive rows: strided copies, no gather
                dst[o:o + b - a].copy_(src[a:b])

        take(st.meta, out[:, 0, :])
        T = st.n
        for off, full, data, rem in st.parts:
            if full and base == 0 and start == 0:
                # raw blocks (dc, sw): the field is one contiguous run in the row, copied as such
                take(data[:, : full * pay], out[:, off:off + full].view(n, full * P.BLOCK_BYTES))
            elif full:
                src = data[:, : full * pay].view(T, full, pay)
                take(src[:, :, start - base:], out[:, off:off + full, start:base + pay])
            if rem:
                last = out[:, off + full]
                if rem > start - base:
                    take(data[:, full * pay + start - base: full * pay + rem], last[:, start:base + rem])
                last[:, max(start, base + rem):].zero_()     # padding: zero, as in packed rows
        if st.hdr is not None:
            words = out.view(torch.int64).view(n, fmt.blocks, P.BLOCK_WORDS)
            take(st.hdr, words[:, 1:, 1:4])

    def write_rows(self, fmt: P.RowFormat, staging: torch.Tensor, checked: Optional[torch.Tensor],
                   sel: Optional[torch.Tensor], dst: torch.Tensor, flag: int,
                   dst_index: Optional[torch.Tensor] = None, meta_patch: Optional[torch.Tensor] = None) -> None:
        """Store rows into a peer's memory (the emulated 512 B atomic write, see ``protocol``).

        ``dst`` is a [m, blocks, 512] uint8 view of the peer's slots. Rows ``staging[sel]`` go to
        ``dst[0:n]`` (or to ``dst[dst_index]`` when given).
        """
        if isinstance(staging, DirectRows):
            if sel is None:
                sel = torch.arange(staging.n, dtype=torch.int64)
            if dst_index is not None:
                raise ValueError("DirectRows are written to consecutive slots; use pack_rows for scattered slots")
        n = (staging.n if isinstance(staging, DirectRows) else staging.shape[0]) if sel is None else sel.shape[0]
        if n == 0:
            return
        if isinstance(staging, DirectRows):
            self._write_direct(fmt, staging, sel, dst[:n])
        elif dst_index is None:
            src = staging.view(staging.shape[0], fmt.row_bytes)
            out = dst[:n].view(n, fmt.row_bytes)
            if sel is None:
                out.copy_(src)
            else:
                torch.index_select(src, 0, sel, out=out)
        else:
            # int64 words: index_copy_ moves element by element, so wide elements are much faster
            src = staging.view(torch.int64).view(staging.shape[0], fmt.row_bytes // 8)
            rng = _as_range(sel)
            rows = src if sel is None else (src[rng[0]:rng[1]] if rng else src.index_select(0, sel))
            dst.view(torch.int64).view(dst.shape[0], fmt.row_bytes // 8).index_copy_(0, dst_index, rows)
        if meta_patch is not None:
            width = 1 if meta_patch.dim() == 1 else meta_patch.shape[1]
            items = dst[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, :width]
            patch = meta_patch.to(torch.int32).view(-1, width)
            if dst_index is None:
                items[:n] = patch[:n]
            else:
                items.index_copy_(0, dst_index, patch)
        P.memory_fence()
        # step 2: the word the receiver checks
        w0 = dst.view(torch.int64).view(dst.shape[0], fmt.blocks, P.BLOCK_WORDS)[:, :, 0]
        if fmt.sync == "tff":
            if dst_index is None:
                w0[:n].fill_(flag)
            else:
                w0.index_fill_(0, dst_index, flag)
        elif fmt.sync == "sp":
            vals = checked if sel is None else checked.index_select(0, sel)
            if dst_index is None:
                w0[:n].copy_(vals)
            else:
                w0.index_copy_(0, dst_index, vals)

    def send_phase(self, job: SendJob, key: Optional[tuple] = None) -> None:
        """Run the token group and the count group of one call.

        TFF/SP: counts first (they do not depend on the tokens), then every destination's rows; DC: each
        destination's rows, then its checksum-carrying control message; SW (BSP baseline): all rows,
        SyncAll, then flags and counts. (``key``: see ``send_again``; this engine keeps nothing.)
        """
        sync = job.fmt.sync
        for d in job.dests:
            d.ctrl_payload = payload_tensor(d.ctrl_payload)
        if sync == "sw":
            for d in job.dests:
                self._send_rows(job, d)
            job.sync_all()
            for d in job.dests:
                self.write_ctrl(d.ctrl, d.ctrl_payload, job.flag)
            return
        if sync != "dc":
            for d in job.dests:
                self.write_ctrl(d.ctrl, d.ctrl_payload, job.flag)
        for d in job.dests:
            self._send_rows(job, d)
            if sync == "dc":
                payload = d.ctrl_payload.clone()
                if d.sel.numel():
                    payload[P.CTRL_CHECKSUM] = P.wrapping_sum(job.row_sums.index_select(0, d.sel))
                self.write_ctrl(d.ctrl, payload, job.flag)

    def send_again(self, key: tuple, fmt: P.RowFormat, staging, flag: int, sels: Sequence[torch.Tensor],
                   words: Sequence[Sequence[int]]) -> bool:
        """Repeat a kept send phase for new rows (see ``NativeEngine.send_again``): this engine keeps none."""
        return False

    def peer_reads(self, flag: int, notes: Sequence[Sequence[int]]) -> None:
        """What the peers' control messages of an exchange said for the store policy (``[way, plain read,
        streaming read]`` per peer; see ``native_engine.store_policy``): this engine stores no other way."""

    def forget(self) -> None:
        """Drop what the engine keeps of a Buffer's memory (its Buffer is being destroyed)."""

    def _send_rows(self, job: SendJob, d: Destination) -> None:
        self.write_rows(job.fmt, job.staging, job.checked, d.sel, d.rows, job.flag, dst_index=d.dst_index,
                        meta_patch=d.meta_patch)

    def write_ctrl(self, dst: torch.Tensor, payload: torch.Tensor, flag: int) -> None:
        """Write a control message (int64 ``payload``) into ``dst`` ([nctrl, 512] uint8 peer view)."""
        nctrl = dst.shape[0]
        words = dst.view(torch.int64).view(nctrl, P.BLOCK_WORDS)
        if payload.numel() > nctrl * P.CTRL_WORDS_PER_BLOCK:
            raise ValueError(f"control payload of {payload.numel()} words does not fit {nctrl} blocks")
        buf = torch.zeros(nctrl, P.BLOCK_WORDS, dtype=torch.int64)
        if nctrl == 1:
            buf[0, P.HEAD_WORDS:P.HEAD_WORDS + payload.numel()] = payload
        else:
            body = torch.zeros(nctrl * P.CTRL_WORDS_PER_BLOCK, dtype=torch.int64)
            body[: payload.numel()] = payload
            buf[:, P.HEAD_WORDS:] = body.view(nctrl, P.CTRL_WORDS_PER_BLOCK)
        words.copy_(buf)
        P.memory_fence()
        words[:, 0] = flag

    # ------------------------------------------------------------------ receiver side
    def ctrl_arrived(self, ctrl: torch.Tensor, flag: int) -> bool:
        w0 = ctrl.view(torch.int64).view(ctrl.shape[0], P.BLOCK_WORDS)[:, 0]
        return bool((w0 == flag).all())

    def read_ctrl(self, ctrl: torch.Tensor) -> torch.Tensor:
        words = ctrl.view(torch.int64).view(ctrl.shape[0], P.BLOCK_WORDS)
        return words[:, P.HEAD_WORDS:].reshape(-1).clone()

    def read_ctrl_words(self, ctrl: torch.Tensor) -> list:
        """The payload words of an arrived control message, as Python ints."""
        return self.read_ctrl(ctrl).tolist()

    def ctrl_poller(self, ctrl: torch.Tensor, nctrl: int) -> Optional[Callable[[int, list], list]]:
        """A step that polls every source's control message at once (see the native engine), or None where
        callers poll source by source with :meth:`ctrl_arrived` (this engine)."""
        return None

    def reorder_sources(self, fmt: P.RowFormat, outs: Sequence[Optional[torch.Tensor]],
                        meta_out: Optional[torch.Tensor], src_out: Optional[torch.Tensor],
                        min_run: int, own_src: Optional[tuple] = None) -> Optional[Callable[..., list]]:
        """A step that reorders the newly complete rows of several sources per poll (see the native engine),
        or None where rows are reordered source by source (this engine)."""
        return None

    def rows_arrived(self, fmt: P.RowFormat, rows: torch.Tensor, flag: int, expected_sum: int = 0,
                     index: Optional[torch.Tensor] = None) -> bool:
        """Did every block of ``rows`` ([n, blocks, 512] local view) arrive? (``index``: only those rows)."""
        if rows.shape[0] == 0 or (index is not None and index.numel() == 0):
            return True
        words = rows.view(torch.int64).view(rows.shape[0], fmt.blocks, P.BLOCK_WORDS)
        if fmt.sync == "tff":
            w0 = words[:, :, 0] if index is None else words[:, :, 0].index_select(0, index)
            return bool((w0 == flag).all())
        if fmt.sync == "sp":
            w0 = words[:, :, 0] if index is None else words[:, :, 0].index_select(0, index)
            return bool((w0 != P.SP_SENTINEL).all())
        if fmt.sync == "dc":
            s = P.wrapping_sum(words[:, :, :4].reshape(-1))
            return int(s) == int(expected_sum)
        return True  # "sw": ordered by the barrier

    def arrived_prefix(self, fmt: P.RowFormat, rows: torch.Tensor, flag: int, start: int) -> Optional[int]:
        """End ``r`` of the run of complete rows that begins at row ``start`` (rows ``[start, r)`` have every
        block, row ``r`` has not), for receivers that reorder rows while the rest are still being written.
        None where an engine checks arrival only source by source (this one: one vectorized check of all
        rows is cheaper here than a scan per poll)."""
        return None

    def unpack_rows(self, fmt: P.RowFormat, rows: torch.Tensor, outs: Sequence[Optional[torch.Tensor]],
                    rearm: bool = True) -> torch.Tensor:
        """Copy the payload of ``rows`` ([n, blocks, 512]) into ``outs`` (per field [n, nbytes] uint8 or
        None to skip). Returns the [n, meta_words] int32 meta items (a copy). For SP, escaped first words
        are restored in ``outs`` and the consumed blocks are re-armed with the sentinel."""
        n = rows.shape[0]
        meta = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, : fmt.meta_words + fmt.bitmap_words].clone()
        for i, out in enumerate(outs):
            if out is None or fmt.field_blocks[i] == 0:
                continue
            off = fmt.field_offset_blocks(i)
            P.unpack_field(rows[:, off:off + fmt.field_blocks[i]], out, fmt.sync)
        if fmt.sync == "sp" and n:
            if fmt.bitmap_words:
                esc = P.unpack_bitmap(meta[:, fmt.meta_words:], fmt.data_blocks)
                if bool(esc.any()):
                    self._restore_escaped(fmt, esc, outs)
            if rearm:
                rows.view(torch.int64).view(n, fmt.blocks, P.BLOCK_WORDS)[:, :, 0] = P.SP_SENTINEL
        return meta[:, : fmt.meta_words]

    def unpack_to(self, fmt: P.RowFormat, rows: torch.Tensor, at: Optional[torch.Tensor],
                  outs: Sequence[Optional[torch.Tensor]], meta_out: Optional[torch.Tensor],
                  src_out: Optional[torch.Tensor]) -> bool:
        """Token-Reordering in one pass, where an engine has it (row ``i`` of ``rows`` to row ``at[i]`` of
        every output; see ``NativeEngine.unpack_to``). Returns False: the caller copies per segment with
        :meth:`unpack_rows`, which for torch is a few strided copies rather than a scatter."""
        return False

    def pair_order(self, topk_idx: torch.Tensor, E: int) -> tuple:
        """Low-latency (token, slot) pairs with an expert, sorted by expert (so by destination rank and local
        expert), then token, then slot: the order rows are dispatched in and returned to by combine.

        ``topk_idx`` is a contiguous [T, K] int64 routing, -1 for an empty slot. Returns ``(t_idx, k_idx,
        expert, counts [E], pos [T, K])``, all int64: ``pos`` holds every pair's index in that order (0 for
        an empty slot). ValueError when an id lies outside [-1, E) or a token names one expert twice."""
        T, K = topk_idx.shape
        if topk_idx.numel():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= E:
                raise ValueError(f"topk_idx values must be in [-1, {E}); got min {lo}, max {hi}")
        if K > 1 and T:
            srt = topk_idx.sort(dim=1).values
            if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
                raise ValueError("topk_idx lists the same expert twice for one token")
        t_idx, k_idx = (topk_idx >= 0).nonzero(as_tuple=True)
        g = topk_idx[t_idx, k_idx]
        order = torch.argsort(g * (T * K) + t_idx * K + k_idx)
        t_idx, k_idx, g = t_idx[order], k_idx[order], g[order]
        pos = torch.zeros(T, K, dtype=torch.int64)
        pos[t_idx, k_idx] = torch.arange(t_idx.numel(), dtype=torch.int64)
        return t_idx, k_idx, g, torch.bincount(g, minlength=E), pos

    def routing_layout(self, topk_idx: torch.Tensor, E: int, R: int) -> tuple:
        """Normal-mode layout of a [T, K] int64 routing: ``(lo, hi, layout)``, its smallest and largest id (0, 0
        without any) and, when they lie in [-1, E), ``layout = (num_tokens_per_rank [R] int32,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, send_idx, send_head)`` (see
        :func:`send_lists`); else None. ``num_tokens_per_expert`` counts slots, as DeepEP does: a token that
        names an expert in several slots counts once per slot (its received rows list the expert that often)."""
        T = topk_idx.shape[0]
        lo, hi = (int(topk_idx.min()), int(topk_idx.max())) if topk_idx.numel() else (0, 0)
        if lo < -1 or hi >= E:
            return lo, hi, None
        per_expert = torch.zeros(T, E + 1, dtype=torch.bool)    # column 0 collects the -1 slots
        if T and topk_idx.shape[1]:
            per_expert.scatter_(1, topk_idx + 1, True)
        per_expert = per_expert[:, 1:]
        is_token_in_rank = per_expert.view(T, R, E // R).any(-1)
        per_slot = torch.bincount(topk_idx[topk_idx >= 0], minlength=E)
        return lo, hi, (is_token_in_rank.sum(0).to(torch.int32), per_slot.to(torch.int32),
                        is_token_in_rank) + send_lists(is_token_in_rank)

    def meta_items(self, topk_idx: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """Normal dispatch's [T, K + K * w] int32 meta items: the [T, K] int64 expert ids as int32, then the
        [T, K] weights' bits (w = 1 for float32, 2 for float64; none without weights)."""
        T, K = topk_idx.shape
        meta = topk_idx.to(torch.int32)
        if weights is not None:   # (a float32 view needs no copy: same element size)
            wsz = weights.element_size() // 4
            bits = weights.view(torch.int32) if wsz == 1 else P.fresh(weights).view(torch.int32).view(T, K * wsz)
            meta = torch.cat((meta, bits), 1)
        return meta

    def local_topk(self, meta: torch.Tensor, K: int, wdtype: Optional[torch.dtype], lo: int, E_local: int,
                   valid_rows: int) -> tuple:
        """Normal dispatch's received routing from its meta items ([rows, m] int32: K global expert ids, then
        K weights' bits when ``wdtype`` is given). Returns ``([rows, K] int64 local ids, [rows, K] weights
        or None)``: the id minus ``lo`` where that lies in [0, E_local) and the row is below ``valid_rows``,
        else -1, and the weight there (0 where the id is -1)."""
        g = P.fresh(meta[:, :K].to(torch.int64)).sub_(lo)   # standard strides even with no rows
        g.masked_fill_((g < 0) | (g >= E_local), -1)
        g[valid_rows:] = -1
        w = None
        if wdtype is not None:
            w = P.fresh(meta[:, K:K + K * (torch.finfo(wdtype).bits // 32)]).view(wdtype).masked_fill_(g < 0, 0.0)
        return g, w

    def ll_calcumsum(self, ctrl: torch.Tensor, nctrl: int, first: int, E_local: int, N: int,
                     layout_range: torch.Tensor, recv_count: torch.Tensor) -> tuple:
        """CalCumSum of low-latency dispatch from the arrived control messages of every source.

        ``ctrl`` is [R, max blocks, 512] uint8 (source s's message in ``ctrl[s]``, ``nctrl`` blocks used);
        the per-expert counts are payload words [first, first + E_local). Fills ``layout_range`` ([E_local,
        R] int64: begin << 32 | count) and ``recv_count`` ([E_local] int32: rows per expert) and returns
        ``(cnt, begin, seg_first, rows)``: [R, E_local] int64 counts, begin of every (source, expert)
        segment in recv_x[expert], its flat row in recv_x (expert * R * N + begin), and the list of each
        source's count sum. A count outside [0, N] raises ValueError before anything is written."""
        R = ctrl.shape[0]
        check_ctrl_words(first, E_local, nctrl)
        words = ctrl.view(torch.int64).view(R, ctrl.shape[1], P.BLOCK_WORDS)[:, :nctrl, P.HEAD_WORDS:]
        cnt = words.reshape(R, nctrl * P.CTRL_WORDS_PER_BLOCK)[:, first:first + E_local].clone()
        bad = ((cnt < 0) | (cnt > N)).nonzero()
        if bad.numel():
            s, e = bad[0].tolist()
            raise ValueError(f"rank {s} announced {int(cnt[s, e])} rows for local expert {e}, outside [0, {N}]")
        begin = cnt.cumsum(0) - cnt
        layout_range.copy_(((begin << 32) | cnt).t())
        recv_count.copy_(cnt.sum(0))
        seg_first = begin + torch.arange(0, E_local * R * N, R * N, dtype=torch.int64)
        return cnt, begin, seg_first, cnt.sum(1).tolist()

    def layout_rows(self, layout_range: torch.Tensor, N: int, n: int) -> tuple:
        """The ``n`` rows of a low-latency combine's flat x that go back to each source, from the dispatch's
        ``layout_range`` ([E_local, R] int64: begin << 32 | count): source by source, expert by expert,
        segment (expert, source) from flat row expert * R * N + begin. Returns ``(rows, rows per source)``."""
        E_local, R = layout_range.shape
        ranges = layout_range.t()
        first = (ranges >> 32) + torch.arange(0, E_local * R * N, R * N, dtype=torch.int64)
        lengths = ranges & 0xFFFFFFFF
        per_source = lengths.sum(1).tolist()
        total = sum(per_source)
        if total != n:
            raise ValueError(f"layout_range counts sum to {total} rows, not {n}")
        return self.segment_rows(first.reshape(-1), lengths.reshape(-1), n), per_source

    def segment_rows(self, first: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        """Rows of consecutive segments laid end to end: segment ``s`` holds ``counts[s]`` rows starting at row
        ``first[s]`` (int64); returns their ``n = counts.sum()`` row indices in segment order."""
        starts = torch.cumsum(counts, 0) - counts
        return torch.repeat_interleave(first - starts, counts, output_size=n) + torch.arange(n, dtype=torch.int64)

    def token_rows(self, t_idx: torch.Tensor, k_idx: torch.Tensor, g: torch.Tensor, counts: torch.Tensor, T: int,
                   K: int) -> tuple:
        """One low-latency row per (token, destination rank) from the pairs of :meth:`pair_order`.

        Returns, per destination rank, the tokens of its rows (ascending) and their [rows, 1 + 2K] int32 meta
        items: the number m of the token's pairs on that rank, then per pair ``(local expert << 8) | top-k
        slot`` and its position in the (this rank, local expert) segment of the receiver's ``recv_x``, which
        is the pair's place in dispatch order within its expert (the same rows the per-pair format fills)."""
        R, E_local = counts.shape
        n = t_idx.numel()
        flat = counts.reshape(-1)
        ar = torch.arange(n, dtype=torch.int64)
        seg_pos = ar - torch.repeat_interleave(torch.cumsum(flat, 0) - flat, flat, output_size=n)
        d, e = g // E_local, g % E_local
        key = d * T + t_idx                               # (destination, token): one row each
        order = torch.argsort(key * E_local + e)          # pairs by destination, token, expert
        keys, per_row = torch.unique_consecutive(key[order], return_counts=True)
        row = torch.repeat_interleave(torch.arange(keys.numel(), dtype=torch.int64), per_row, output_size=n)
        slot = ar - torch.repeat_interleave(torch.cumsum(per_row, 0) - per_row, per_row, output_size=n)
        items = torch.zeros(keys.numel(), 1 + 2 * K, dtype=torch.int32)
        items[:, 0] = per_row.to(torch.int32)
        items[row, 1 + 2 * slot] = ((e[order] << 8) | k_idx[order]).to(torch.int32)
        items[row, 2 + 2 * slot] = seg_pos[order].to(torch.int32)
        bounds = [0] + torch.cumsum(torch.bincount(keys // T, minlength=R), 0).tolist()
        tokens = keys % T
        return ([tokens[bounds[r]:bounds[r + 1]] for r in range(R)],
                [items[bounds[r]:bounds[r + 1]] for r in range(R)])

    def unpack_items(self, fmt: P.RowFormat, rows: torch.Tensor, K: int, base: torch.Tensor, cnt: torch.Tensor,
                     outs: Sequence[Optional[torch.Tensor]], info_out: torch.Tensor, k_out: torch.Tensor) -> None:
        """Low-latency Token-Reordering of one-row-per-token rows ([n, blocks, 512]): meta item 0 of a row is
        its number m <= K of (local expert, top-k slot) pairs, items ``1 + 2j`` / ``2 + 2j`` are pair j's
        ``(e << 8) | k`` and its position p in this source's segment of expert e. The payload goes to row
        ``base[e] + p`` of every ``outs`` field ([rows, nbytes] uint8), the source token to ``info_out``
        and k to ``k_out`` there. Items are checked first: ValueError, nothing written. SP rows are not
        re-armed here (the caller re-arms the whole source)."""
        n = rows.shape[0]
        if n == 0:
            return
        room = min([o.shape[0] for o in outs if o is not None] + [info_out.numel(), k_out.numel()])
        meta = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, : 1 + 2 * K]
        row, target, k = _pair_targets(meta, K, base, cnt, room)
        tmp = [None if o is None or fmt.field_blocks[i] == 0 else torch.empty(n, o.shape[1], dtype=torch.uint8)
               for i, o in enumerate(outs)]
        self.unpack_rows(fmt, rows, tmp, rearm=False)
        # targets sorted: a whole source fills one run of consecutive rows per expert, each gathered
        # straight into its output rows (no scatter)
        if target.numel() == 0:
            return
        order = torch.argsort(target)
        target, row, k = target[order], row[order], k[order]
        cut = [0] + ((target[1:] - target[:-1]) != 1).nonzero().flatten().add(1).tolist() + [target.numel()]
        for o, t in zip(outs, tmp):
            if t is None:
                continue
            for a, b in zip(cut[:-1], cut[1:]):
                first = int(target[a])
                torch.index_select(t, 0, row[a:b], out=o[first:first + b - a])
        token = rows[:, 0, :].view(torch.int64)[:, 1]
        info_out.index_copy_(0, target, token.index_select(0, row).to(torch.int32))
        k_out.index_copy_(0, target, k.to(torch.int32))

    def copy_rows(self, src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, at: torch.Tensor) -> bool:
        """``dst[at[i]] = src[idx[i]]`` in one pass, where an engine has it (2-D tensors of one dtype).
        Returns False: the caller copies per segment with ``index_select``, which needs no scatter."""
        return False

    def unpack_rows_as(self, fmt: P.RowFormat, rows: torch.Tensor, out: torch.Tensor, src_dtype: torch.dtype,
                       rearm: bool = True) -> torch.Tensor:
        """Field 0 of ``rows`` converted into ``out`` ([n, elems] of any dtype); returns the meta items."""
        n = rows.shape[0]
        meta = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, : fmt.meta_words + fmt.bitmap_words].clone()
        # raw strided copy in the payload dtype, then one contiguous conversion (strided casts are slow)
        raw = self.scratch("unpack", (n, out.shape[1]), src_dtype)
        P.unpack_field(rows[:, fmt.field_offset_blocks(0):fmt.field_offset_blocks(0) + fmt.field_blocks[0]],
                       P.as_bytes(raw), fmt.sync)
        out.copy_(raw)
        if fmt.sync == "sp" and n:
            if fmt.bitmap_words:
                esc = P.unpack_bitmap(meta[:, fmt.meta_words:], fmt.data_blocks)
                if bool(esc.any()):  # escaped first words were all-zero bytes: zero the elements they held
                    es = torch.empty(0, dtype=src_dtype).element_size()
                    r, b = esc[:, : fmt.field_blocks[0]].nonzero(as_tuple=True)
                    per = max(1, 8 // es)
                    cols = (b * (P.RAW_PAYLOAD_BYTES // es)).unsqueeze(1) + torch.arange(per)
                    rr = r.unsqueeze(1).expand_as(cols)
                    keep = cols < out.shape[1]
                    out[rr[keep], cols[keep]] = 0
            if rearm:
                rows.view(torch.int64).view(n, fmt.blocks, P.BLOCK_WORDS)[:, :, 0] = P.SP_SENTINEL
        return meta[:, : fmt.meta_words]

    # ------------------------------------------------------------------ combine reductions
    def combine_accumulate(self, fmt: P.RowFormat, rows: torch.Tensor, index: torch.Tensor, acc: torch.Tensor,
                           x_dtype: torch.dtype, wacc: Optional[torch.Tensor] = None, first: bool = False) -> None:
        """Normal combine, one source: ``acc[index[r]] += float(x_r)`` and ``wacc[index[r]] += w_r``.

        ``index`` holds distinct rows in ascending order, so the result does not depend on the order rows
        are added in. ``first``: ``acc`` holds nothing yet and counts as zeros (``0 + x``, so ``-0.0``
        becomes ``+0.0`` exactly as an accumulation from zeros would). SP blocks are not re-armed here
        (the caller does it once the rows are consumed).
        """
        n = rows.shape[0]
        if n == 0:
            if first:
                acc.zero_()
            return
        if first and n == acc.shape[0]:   # every token, in order: write 0 + x, no zeroing, no gather
            raw = self.scratch("unpack", (n, acc.shape[1]), x_dtype)
            meta = self.unpack_rows(fmt, rows, [P.as_bytes(raw)], rearm=False)
            acc.copy_(raw)
            acc.add_(0.0)
            if wacc is not None and wacc.shape[1]:
                wacc.index_add_(0, index, P.fresh(meta).view(wacc.dtype))
            return
        if first:
            acc.zero_()
        tmp = self.scratch("combine_rows", (n, acc.shape[1]), acc.dtype)
        meta = self.unpack_rows_as(fmt, rows, tmp, x_dtype, rearm=False)
        acc.index_add_(0, index, tmp)
        if wacc is not None and wacc.shape[1]:
            wacc.index_add_(0, index, P.fresh(meta).view(wacc.dtype))

    def reduce_sources(self, fmt: P.RowFormat, sources: Sequence[tuple], out: torch.Tensor,
                       read: Optional[tuple] = None) -> None:
        """Normal combine of one range of tokens: ``out[t]`` = the sum of the rows of token ``t``.

        ``sources`` is ``[(rows, tok)]`` in the order the sum runs (any biases, then the ranks in rank
        order): ``rows`` are plain rows ``[n, H]`` (this rank's own, a bias) or rows in the slots
        (``[n, fmt.blocks, 512]`` uint8, field 0 holding the payload in ``out``'s dtype), and row ``r`` belongs
        to token ``tok[r]`` (ascending, distinct rows of ``out``; None: row ``r`` is token ``r``). The sum is
        that of an accumulator (float32; float64 for float64 rows) starting at +0.0 and adding the rows
        widened, in source order, rounded once into ``out``; a token with no rows gets zeros. SP blocks are
        not re-armed here (the caller does it once the rows are consumed). ``read``: ``(flag word, way, bytes)``,
        the bytes of peers' rows the sum reads and how they were stored (engines that choose how rows are
        stored time the sum for that choice; see ``native_engine.store_policy``).
        """
        T, H = out.shape
        if out.numel() == 0:
            return
        acc_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
        acc = self.scratch("combine_acc", (T, H), acc_dtype)
        first = True   # acc holds nothing yet
        # A source with every token (ascending and distinct, so in order) is added without a gather, the
        # first one copied: (a + b + ...) + 0 has the bits of 0 + a + b + ..., since a sum that starts at
        # +0.0 differs from one that does not only while it is -0.0, and the final + 0.0 maps that to +0.0.
        for rows, tok in sources:
            n = rows.shape[0]
            if n == 0:
                continue
            views = None
            if rows.dim() == 2:
                src = rows if rows.dtype in (acc_dtype, out.dtype) else rows.to(acc_dtype)
                views = [(0, H, src)] if n == T else None
            elif n == T and self.direct_rows and not _sp_escaped(fmt, rows):
                views = P.field_views(rows, fmt, 0, out.dtype)
            if views is not None:
                for lo, hi, v in views:
                    part = acc[:, lo:hi].view(v.shape)
                    if first:
                        part.copy_(v)      # widening copies are exact
                    else:
                        part.add_(v)
            elif rows.dim() == 2:
                if first:
                    acc.zero_()
                acc.index_add_(0, tok, src.to(acc_dtype))
            else:
                self.combine_accumulate(fmt, rows, tok, acc, out.dtype, None, first=first)
            first = False
        if first:
            acc.zero_()
        torch.add(acc, 0.0, out=out)     # computed in the accumulator's dtype, rounded once into out

    def weighted_combine(self, fmt: P.RowFormat, rows: torch.Tensor, topk_idx: torch.Tensor,
                         weights: torch.Tensor, out: torch.Tensor, pos: Optional[torch.Tensor] = None) -> None:
        """Low-latency combine: ``out[t] = bf16(sum_k w[t, k] * x[pos[t, k]])`` over the valid slots.

        ``pos`` ([T, K] int64) is the row of ``rows`` holding slot (t, k) (default ``t*K + k``); masked
        slots (``topk_idx == -1``) are never read. The sum runs over ``k`` in order, starting from +0.0,
        one multiply and one add per slot (no fused multiply-add), so every backend produces the same bits.
        """
        T, K = topk_idx.shape
        if T == 0:
            return
        if rows.shape[0] == 0:      # every slot masked: the sum of nothing
            out.zero_()
            return
        H = out.shape[1]
        valid = topk_idx >= 0
        if pos is None:
            pos = torch.arange(T * K, dtype=torch.int64).view(T, K)
        pos = torch.where(valid, pos, torch.zeros_like(pos))     # masked slots read row 0, then count as 0
        w = torch.where(valid, weights, torch.zeros_like(weights))
        any_invalid = [bool(c) for c in (~valid).any(0).tolist()]
        acc = self.scratch("ll_combine_out", (T, H), torch.float32)
        views = P.field_views(rows, fmt, 0, torch.bfloat16)
        if views is not None and fmt.sync == "sp" and fmt.bitmap_words:
            bm = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, fmt.meta_words:fmt.meta_words + fmt.bitmap_words]
            if bool(bm.any()):
                views = None       # escaped words: read through an unpacked copy
        if views is None:
            raw = self.scratch("ll_combine_raw", (rows.shape[0], H), torch.bfloat16)
            self.unpack_rows(fmt, rows, [P.as_bytes(raw)], rearm=False)
            views = [(0, H, raw)]
        # Top-k columns in groups: all of them at once for small calls (decoding), one at a time otherwise
        # (a [T, H] float32 product stays in cache). Either way: gather (bf16), widen (exact), zero masked
        # slots (maybe stale NaN bytes: they add +0.0), one multiply each (bf16 * f32 in float32), then
        # the adds in k order from +0.0.
        kc = K if T * K * H <= self.small_combine_elems else 1
        prod = self.scratch("ll_combine_prod", (T * kc, H), torch.float32)
        gathers = [(self.scratch(f"ll_combine_gather{lo}", (T * kc,) + tuple(v.shape[1:]), torch.bfloat16),
                    lo, hi, v) for lo, hi, v in views]
        p3 = prod.view(T, kc, H)
        for k0 in range(0, K, kc):
            cols = pos[:, k0:k0 + kc].reshape(-1)            # row t*kc + j holds slot (t, k0 + j)
            for g, lo, hi, v in gathers:
                torch.index_select(v, 0, cols, out=g)
                prod[:, lo:hi].view(g.shape).copy_(g)
            if any(any_invalid[k0:k0 + kc]):
                prod[~valid[:, k0:k0 + kc].reshape(-1)] = 0
            p3.mul_(w[:, k0:k0 + kc].unsqueeze(2))
            for j in range(kc):
                if k0 + j == 0:
                    torch.add(p3[:, j], 0.0, out=acc)
                else:
                    acc.add_(p3[:, j])
        # float32 -> bf16 into a strided destination takes torch's scalar conversion, which stores NaN as
        # 0x7FC0 instead of the vectorized 0xFFFF: convert contiguously, then move the bf16 bits
        if out.is_contiguous():
            out.copy_(acc)
        else:
            out.copy_(acc.to(out.dtype))

    @staticmethod
    def _restore_escaped(fmt: P.RowFormat, esc: torch.Tensor, outs: Sequence[Optional[torch.Tensor]]) -> None:
        base = 0
        for i, out in enumerate(outs):
            fb = fmt.field_blocks[i]
            if out is not None and fb:
                r, b = esc[:, base:base + fb].nonzero(as_tuple=True)
                if r.numel():
                    cols = (b * P.RAW_PAYLOAD_BYTES).unsqueeze(1) + torch.arange(8)
                    rr = r.unsqueeze(1).expand_as(cols)
                    keep = cols < out.shape[1]
                    out[rr[keep], cols[keep]] = 0  # the sentinel value is all-zero bytes
            base += fb

    def rearm(self, fmt: P.RowFormat, rows: torch.Tensor, index: Optional[torch.Tensor] = None) -> None:
        """SP: write the sentinel back into consumed blocks (no-op for other modes)."""
        if fmt.sync != "sp" or rows.shape[0] == 0:
            return
        w0 = rows.view(torch.int64).view(rows.shape[0], fmt.blocks, P.BLOCK_WORDS)[:, :, 0]
        if index is None:
            w0.fill_(P.SP_SENTINEL)
        else:
            w0.index_fill_(0, index, P.SP_SENTINEL)


def _as_range(sel: Optional[torch.Tensor]):
    """(start, stop) when ``sel`` is a run of consecutive indices, else None."""
    if sel is None or sel.numel() == 0:
        return None
    a, b = int(sel[0]), int(sel[-1])
    if b - a + 1 == sel.numel() and (sel.numel() == 1 or bool((sel[1:] - sel[:-1] == 1).all())):
        return a, b + 1
    return None


def _runs(sel: torch.Tensor, row_bytes: int):
    """``[(start, stop, position)]`` when ``sel`` is one run of consecutive indices, or a few runs of at least
    256 KiB on average (then strided copies per run beat a gather), else None."""
    n = sel.numel()
    if n == 0:
        return []
    if n == 1:
        a = int(sel[0])
        return [(a, a + 1, 0)]
    breaks = ((sel[1:] - sel[:-1]) != 1).nonzero().squeeze(1)
    if breaks.numel() and n * row_bytes < (256 << 10) * (breaks.numel() + 1):
        return None
    pos = [0] + (breaks + 1).tolist() + [n]
    firsts = sel[pos[:-1]].tolist()
    return [(a, a + pos[i + 1] - pos[i], pos[i]) for i, a in enumerate(firsts)]


def make_engine(backend: str, num_count_aivs: Optional[int] = None):
    """``"auto"``: the C data path when it was built (and the switch ``UBEP_NATIVE`` is not off: ``0``,
    ``false``, ``no`` or ``off``), else torch."""
    if backend == "auto":
        from . import native_engine
        use = native_engine.available() and env_flag("UBEP_NATIVE", True)
        return native_engine.NativeEngine() if use else TorchEngine()
    if backend == "native":
        from .native_engine import NativeEngine
        return NativeEngine()
    if backend == "torch":
        return TorchEngine()
    if backend == "triton":
        from .triton_engine import TritonEngine
        return TritonEngine(n_count=num_count_aivs)
    raise ValueError(f"backend must be 'auto', 'native', 'torch' or 'triton', got {backend!r}")

