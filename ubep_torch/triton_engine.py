"""``TritonEngine``: the data path of ``TorchEngine`` run by the Triton kernels of ``kernels/``.

Selected with ``Buffer(group, ..., backend="triton")``. Outputs are bit-identical to ``TorchEngine``
(``tests/test_triton_equivalence.py``), and so are memory contents in normal mode; low-latency rows go one
per (token, expert) here, one per (token, rank) there, so a low-latency Buffer uses one of them on every
rank.

What runs as a kernel
---------------------
* ``send_phase``: ONE launch of ``kernels.dispatch.send_phase_kernel`` per call emulates the rank's
  AIVs (program id = AIV id): the token group writes the rows, the count group the control messages.
  ``sync="sw"`` launches it with every program sending rows, runs SyncAll, then launches
  ``write_ctrl_kernel`` with every program writing control messages (the BSP shape).
* ``rows_arrived`` / ``ctrl_arrived``: ``poll_rows_kernel`` (acquire loads of the checked words; DC
  block sums). ``unpack_rows``: ``token_reorder_kernel`` per field, ``rearm_kernel`` for SP.
* The combine reductions: :meth:`combine_accumulate` (normal combine) and :meth:`weighted_combine`
  (low-latency combine); and the decomposed low-latency receive, :meth:`ll_receive` (bf16 dispatch with
  ``tff``/``sp``: CalCumSum by the count AIVs, Token-Reordering by the others on the published offsets).
* ``pack_rows`` stays the torch implementation (local staging only; nothing crosses the UGAS there), and
  so do the normal-mode CalCumSum and the rest listed in ``docs/kernels.md``.

Interpreter policy
------------------
The UGAS heap is host shared memory, which compiled GPU kernels cannot address, so the kernels always
run under the Triton interpreter. ``TRITON_INTERPRET`` is consulted by ``triton.jit`` when a kernel
is *defined*, so the ``kernels/`` package sets ``TRITON_INTERPRET=1`` only while its modules are
imported and then restores the previous value: kernels a user defines elsewhere (for a GPU) keep
compiling normally, whether triton or ``ubep_torch.kernels`` was imported before or after this module,
and whether or not a CUDA device exists. Kernels defined without the interpreter all the same (modules
loaded by path, outside the package) make the engine raise a ``RuntimeError`` that says so instead of
launching a compiled kernel on CPU memory.

Under the interpreter the programs of a launch run one after another in program-id order, so an
in-kernel wait only ever waits for other ranks or for lower-numbered programs, and every wait is
bounded (``max_spins``); cross-rank waits of the Buffer stay in ``protocol.Waiter`` with its deadline.

Knobs: ``TritonEngine(n_aivs=..., n_count=..., mapping=...)`` or the environment variables
``UBEP_TRITON_AIVS``, ``UBEP_TRITON_COUNT_AIVS`` and ``UBEP_TRITON_MAPPING`` (``0`` = topology-agnostic
order) for engines the Buffer creates. ``n_count=None`` uses the Appendix-9 model
(``ubep_torch.mapper.default_count_aivs``).
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Sequence

import torch

from . import protocol as P
from .engine import SendJob, TorchEngine, payload_tensor
from .errors import UBEPKernelWaitError
from .mapper import default_count_aivs
from .mapper import quaternary_search as _search_in_torch
from .topology import NUM_HOP_CLASSES, Topology
from .utils import check_count, env_flag


def _load_kernels() -> tuple[object, object, object, object]:
    """``kernels/`` (installed as ``ubep_torch.kernels``), whose package defines them under the interpreter."""
    try:
        pkg = importlib.import_module("ubep_torch.kernels")
    except ImportError:
        pkg = importlib.import_module("kernels")
    mods = (pkg.data_as_flag, pkg.dispatch, pkg.combine, pkg.mapper)
    from triton.runtime.interpreter import InterpretedFunction
    if not isinstance(mods[1].send_phase_kernel, InterpretedFunction):
        raise RuntimeError(  # noqa: TRY004 - a configuration error, not a bad argument
            "ubep_torch's Triton kernels were defined without the Triton interpreter, but they address the "
            "host shared-memory UGAS heap and must run under it (were their modules loaded by path, outside "
            "the ubep_torch.kernels package?).")
    return mods


daf, kdispatch, kcombine, kmapper = _load_kernels()

_SYNC = {"tff": 0, "dc": 1, "sp": 2, "sw": 3}
_DEFAULT_SPINS = 1 << 16


def _p2(n: int, lo: int = 1) -> int:
    n = max(int(n), lo)
    return 1 << (n - 1).bit_length()


def _addr(t: torch.Tensor) -> int:
    return int(t.data_ptr())


#: most AIVs (programs of a send launch) a rank emulates: a CM384 die has 48
_MAX_AIVS = 256


def _env_int(name: str, least: int) -> int | None:
    """The integer in environment variable ``name`` (None when unset or empty), in [least, _MAX_AIVS]; else
    ValueError naming the variable."""
    v = os.environ.get(name)
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {v!r}") from None
    if not least <= n <= _MAX_AIVS:
        raise ValueError(f"{name} must be in [{least}, {_MAX_AIVS}], got {n}")
    return n


def _check_rows(what: str, fmt: P.RowFormat, rows: torch.Tensor, index: torch.Tensor | None = None) -> None:
    """The kernels address ``rows`` by the format's block count and by ``index`` unchecked: rows of another
    geometry, or an index past them, would be read or written outside the tensor (ValueError/IndexError)."""
    if rows.dtype != torch.uint8 or rows.dim() != 3 or tuple(rows.shape[1:]) != (fmt.blocks, P.BLOCK_BYTES):
        raise ValueError(f"TritonEngine.{what}: rows must be [n, {fmt.blocks}, {P.BLOCK_BYTES}] uint8 (the format's "
                         f"rows), got {rows.dtype} {tuple(rows.shape)}")
    if index is not None and index.numel() and (index.dim() != 1 or int(index.min()) < 0
                                                or int(index.max()) >= rows.shape[0]):
        raise IndexError(f"TritonEngine.{what}: index must be [m] rows in [0, {rows.shape[0]})")


class TritonEngine(TorchEngine):
    """The kernel data path (see the module docstring).

    Args:
        n_aivs: AIVs of one rank = programs of a send launch (default 8, ``UBEP_TRITON_AIVS``; a CM384
            die has 48, but the interpreter runs programs one after another).
        n_count: AIVs of the count group (``None``: Appendix-9 model, ``UBEP_TRITON_COUNT_AIVS``).
        mapping: order the copy sequence with the hierarchical mapper (``False``: plain rank order).
        max_spins: bound of every in-kernel wait.
    """

    name = "triton"
    direct_rows = False     # the kernels read packed staging rows and every source from the slots

    def __init__(self, n_aivs: int | None = None, n_count: int | None = None, mapping: bool | None = None,
                 max_spins: int = _DEFAULT_SPINS):
        super().__init__()
        self.n_aivs = check_count("n_aivs", n_aivs) if n_aivs is not None else \
            _env_int("UBEP_TRITON_AIVS", 2) or 8
        if not 2 <= self.n_aivs <= _MAX_AIVS:
            raise ValueError(f"n_aivs must be in [2, {_MAX_AIVS}] (a token and a count group), got {self.n_aivs}")
        if n_count is not None:     # (at least one AIV; more than n_aivs - 1 run as n_aivs - 1: see count_aivs)
            n_count = check_count("n_count", n_count, 1)
        self.n_count = n_count if n_count is not None else _env_int("UBEP_TRITON_COUNT_AIVS", 1)
        if mapping is None:
            mapping = env_flag("UBEP_TRITON_MAPPING", True)
        self.mapping = bool(mapping)
        self.max_spins = int(max_spins)
        self._order_cache: dict = {}
        self.last_launch: dict = {}

    # ------------------------------------------------------------------ mapper
    def count_aivs(self, n_counts: int, n_copies: int) -> int:
        """Programs of the count group for a call with ``n_counts`` count words and ``n_copies`` rows."""
        if self.n_count is not None:
            n = int(self.n_count)
        else:
            n = default_count_aivs(max(1, n_counts), 1, max(1, n_copies), self.n_aivs)
        return max(1, min(n, self.n_aivs - 1))

    def remap(self, hop: torch.Tensor | None, num: int) -> torch.Tensor:
        """The destination list grouped by hop class (``kernels.mapper.remap_experts_kernel``), cached."""
        key = (None if hop is None else tuple(hop.tolist()), num, self.mapping)
        if key not in self._order_cache:
            self._order_cache[key] = remap_experts(num, hop, self.mapping)
        return self._order_cache[key]

    # ------------------------------------------------------------------ sender side
    def stage_rows(self, fmt: P.RowFormat, fields: Sequence[torch.Tensor | None], meta: torch.Tensor | None,
                   src_index: torch.Tensor, rank: int) -> tuple:
        """Packed staging rows (``pack_rows``): the send kernel reads whole staged rows."""
        return self.pack_rows(fmt, fields, meta, src_index, rank)

    def send_phase(self, job: SendJob, key: tuple | None = None) -> None:
        """Token group + count group of one call in one launch (two launches and SyncAll for "sw")."""
        fmt = job.fmt
        sync = fmt.sync
        dests = job.dests
        D = len(dests)
        if D == 0:
            return
        for d in dests:
            d.ctrl_payload = payload_tensor(d.ctrl_payload)
        me = dests[0].rank
        world = max(d.rank for d in dests) + 1
        hop = Topology.for_ranks(world).hop_class(torch.full((D,), me, dtype=torch.int64),
                                                  torch.tensor([d.rank for d in dests], dtype=torch.int64))
        n_copies = sum(int(d.sel.numel()) for d in dests)
        n_count_words = max(int(d.ctrl_payload.numel()) for d in dests) - P.CTRL_COUNTS
        if sync == "sw":
            n_token, n_count = self.n_aivs, 0
        else:
            n_count = self.count_aivs(n_count_words, n_copies)
            n_token = self.n_aivs - n_count
        order = self.remap(hop, D).tolist()
        ds = [dests[p] for p in order]
        nb = fmt.blocks
        counts = torch.tensor([int(d.sel.numel()) for d in ds], dtype=torch.int64)
        cum = torch.cumsum(counts, 0)
        V = int(cum[-1])
        def cat(xs):
            return (torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))
        sel = cat([d.sel.to(torch.int64) for d in ds]) if V else torch.zeros(1, dtype=torch.int64)
        slot = cat([d.dst_index.to(torch.int64) if d.dst_index is not None
                    else torch.arange(int(d.sel.numel()), dtype=torch.int64) for d in ds]) if V else sel
        has_patch = any(d.meta_patch is not None for d in ds)
        if has_patch:
            patch = torch.cat([d.meta_patch.to(torch.int32) if d.meta_patch is not None else
                               torch.zeros(int(d.sel.numel()), dtype=torch.int32) for d in ds])
            if patch.numel() == 0:
                patch = torch.zeros(1, dtype=torch.int32)
        else:
            patch = torch.zeros(1, dtype=torch.int32)
        dst_addr = torch.tensor([_addr(d.rows) for d in ds], dtype=torch.int64)
        nctrl = int(ds[0].ctrl.shape[0])
        ctrl_addr = torch.tensor([_addr(d.ctrl) for d in ds], dtype=torch.int64)
        ctrl_pay = torch.stack([_ctrl_words(d.ctrl_payload, nctrl) for d in ds])
        staging = job.staging.contiguous()
        if staging.numel() == 0:
            staging = torch.zeros(1, nb, P.BLOCK_BYTES, dtype=torch.uint8)
        checked = job.checked.contiguous() if job.checked is not None else torch.zeros(1, dtype=torch.int64)
        row_sums = job.row_sums.contiguous() if job.row_sums is not None else torch.zeros(1, dtype=torch.int64)
        done = torch.zeros(max(1, n_token), dtype=torch.int64)
        status = torch.zeros(self.n_aivs, dtype=torch.int64)
        grid = (n_token + n_count,)
        kdispatch.send_phase_kernel[grid](
            staging.view(torch.int64), checked, row_sums, cum, sel, slot, patch, dst_addr,
            ctrl_addr, ctrl_pay, done, status,
            V, D, nb, job.flag, n_token, n_count, nctrl, self.max_spins,
            SYNC=_SYNC[sync], MAPPING=self.mapping, HAS_PATCH=has_patch, ROW_BLOCK=_p2(nb * P.BLOCK_WORDS),
            NB_BLOCK=_p2(nb, 2),
            CTRL_BLOCK=_p2(nctrl * P.BLOCK_WORDS), CNB_BLOCK=_p2(nctrl, 2), TOK_BLOCK=_p2(n_token, 2), CHUNK=64,
            CHECKSUM_WORD=P.HEAD_WORDS + P.CTRL_CHECKSUM,
        )
        self.last_launch = {"grid": grid[0], "n_token": n_token, "n_count": n_count, "order": order,
                            "copies": V}
        if bool(status.any()):
            raise UBEPKernelWaitError("TokenCnt-Sending: count group waiting for the token group's done signals",
                                      me, [me], self.max_spins)
        if sync == "sw":
            job.sync_all()
            daf.write_ctrl_kernel[(self.n_aivs,)](
                ctrl_addr, ctrl_pay, D, job.flag, nctrl, ROW_BLOCK=_p2(nctrl * P.BLOCK_WORDS), NB_BLOCK=_p2(nctrl, 2))

    def write_ctrl(self, dst: torch.Tensor, payload: torch.Tensor, flag: int) -> None:
        """Write one control message with ``write_ctrl_kernel``."""
        nctrl = dst.shape[0]
        daf.write_ctrl_kernel[(1,)](
            torch.tensor([_addr(dst)], dtype=torch.int64), _ctrl_words(payload, nctrl)[None], 1, flag, nctrl,
            ROW_BLOCK=_p2(nctrl * P.BLOCK_WORDS), NB_BLOCK=_p2(nctrl, 2))

    # ------------------------------------------------------------------ receiver side
    def _poll(self, sync: str, rows: torch.Tensor, nblocks: int, flag: int, expected: int,
              index: torch.Tensor | None) -> tuple[bool, int]:
        n = rows.shape[0] if index is None else int(index.numel())
        status = torch.zeros(2, dtype=torch.int64)
        idx = index.to(torch.int64).contiguous() if index is not None else torch.zeros(1, dtype=torch.int64)
        daf.poll_rows_kernel[(1,)](
            torch.tensor([_addr(rows)], dtype=torch.int64), idx, status, n, nblocks, flag,
            P.wrap_int64(expected), 1, SYNC=_SYNC[sync], HAS_INDEX=index is not None, NB_BLOCK=_p2(nblocks, 2))
        return bool(status[0]), int(status[1])

    def ctrl_arrived(self, ctrl: torch.Tensor, flag: int) -> bool:
        """Every block of the control message ``ctrl`` ([nctrl, 512]) carries ``flag`` (poll kernel)."""
        return self._poll("tff", ctrl, 1, flag, 0, None)[0]

    def rows_arrived(self, fmt: P.RowFormat, rows: torch.Tensor, flag: int, expected_sum: int = 0,
                     index: torch.Tensor | None = None) -> bool:
        _check_rows("rows_arrived", fmt, rows, index)
        if rows.shape[0] == 0 or (index is not None and index.numel() == 0):
            return True
        if fmt.sync == "sw":
            return True  # ordered by the barrier
        return self._poll(fmt.sync, rows, fmt.blocks, flag, expected_sum, index)[0]

    def unpack_rows(self, fmt: P.RowFormat, rows: torch.Tensor, outs: Sequence[torch.Tensor | None],
                    rearm: bool = True) -> torch.Tensor:
        n = rows.shape[0]
        if not rows.is_contiguous():
            return super().unpack_rows(fmt, rows, outs, rearm)
        _check_rows("unpack_rows", fmt, rows)
        for i, out in enumerate(outs):      # (the kernel stores out.shape[1] bytes of field i into each row)
            if out is not None and (out.dim() != 2 or out.shape[0] < n or out.shape[1] > fmt.fields[i][1]):
                raise ValueError(f"TritonEngine.unpack_rows: output {i} must be [{n} or more, {fmt.fields[i][1]} or "
                                 f"fewer bytes], got {tuple(out.shape)}")
        meta = rows[:, 0, P.FLAG_BYTES:].view(torch.int32)[:, : fmt.meta_words + fmt.bitmap_words].clone()
        if n:
            addr = torch.tensor([_addr(rows)], dtype=torch.int64)
            esc_base = 0
            for i, out in enumerate(outs):
                fb = fmt.field_blocks[i]
                if out is not None and fb and out.shape[1]:
                    if out.stride(1) != 1:
                        raise ValueError("unpack_rows needs outputs with contiguous rows")
                    kdispatch.token_reorder_kernel[(n,)](
                        addr, out, out.stride(0), fmt.blocks, fmt.field_offset_blocks(i), esc_base,
                        fmt.meta_words, out.shape[1], SYNC=_SYNC[fmt.sync], BYTE_BLOCK=512)
                esc_base += fb
            if fmt.sync == "sp" and rearm:
                self.rearm(fmt, rows)
        return meta[:, : fmt.meta_words]

    def unpack_rows_as(self, fmt: P.RowFormat, rows: torch.Tensor, out: torch.Tensor, src_dtype: torch.dtype,
                       rearm: bool = True) -> torch.Tensor:
        """Field 0 of ``rows`` into ``out`` ([n, elems], any dtype): Token-Reordering kernel, then a cast."""
        n = rows.shape[0]
        if not rows.is_contiguous():
            return super().unpack_rows_as(fmt, rows, out, src_dtype, rearm)
        raw = self.scratch("unpack", (n, out.shape[1]), src_dtype)
        meta = self.unpack_rows(fmt, rows, [P.as_bytes(raw)] + [None] * (len(fmt.fields) - 1), rearm)
        out.copy_(raw)
        return meta

    def rearm(self, fmt: P.RowFormat, rows: torch.Tensor, index: torch.Tensor | None = None) -> None:
        if fmt.sync != "sp" or rows.shape[0] == 0:
            return
        _check_rows("rearm", fmt, rows, index)
        n = rows.shape[0] if index is None else int(index.numel())
        if n == 0:
            return
        idx = index.to(torch.int64).contiguous() if index is not None else torch.zeros(1, dtype=torch.int64)
        daf.rearm_kernel[(n,)](torch.tensor([_addr(rows)], dtype=torch.int64), idx, n, fmt.blocks,
                               HAS_INDEX=index is not None, NB_BLOCK=_p2(fmt.blocks, 2))

    # ------------------------------------------------------------------ combine reductions
    def combine_accumulate(self, fmt: P.RowFormat, rows: torch.Tensor, index: torch.Tensor, acc: torch.Tensor,
                           x_dtype: torch.dtype, wacc: torch.Tensor | None = None, first: bool = False) -> None:
        """``acc[index[r]] += x_r`` (and ``wacc[index[r]] += w_r``) straight from arrived rows.

        Equal to ``acc.index_add_(0, index, unpacked_x.to(acc.dtype))`` bit for bit (one row per
        output index per source, as in the normal combine). ``first``: ``acc`` counts as zeros.
        """
        if first:
            acc.zero_()
        kcombine.combine_accumulate(fmt, rows, index, acc, x_dtype, wacc)

    def weighted_combine(self, fmt: P.RowFormat, rows: torch.Tensor, topk_idx: torch.Tensor,
                         weights: torch.Tensor, out: torch.Tensor, pos: torch.Tensor | None = None) -> None:
        """Low-latency combine: ``out[t] = bf16(sum_k w[t,k] * x[pos[t,k]])`` over valid slots."""
        if rows.shape[0] == 0:      # every slot masked: nothing to read
            out.zero_()
            return
        kcombine.weighted_combine(fmt, rows, topk_idx, weights, out, pos)

    def ll_receive(self, fmt: P.RowFormat, ctrl_views: Sequence[torch.Tensor], row_views: Sequence[torch.Tensor],
                   flag: int, n_exp: int, out: torch.Tensor, n_count: int = 1, rank: int = -1) -> torch.Tensor:
        """Decomposed low-latency receive (CalCumSum + Token-Reordering, point-to-point signals).

        Returns the ``[R, 2E+1]`` int64 signal table: per source the packed begins, the counts and
        the flag word the CalCumSum AIV published.
        """
        return kdispatch_ll_receive(fmt, ctrl_views, row_views, flag, n_exp, out, n_count, self.max_spins, rank)




def _ctrl_words(payload: torch.Tensor, nctrl: int) -> torch.Tensor:
    """int64 control payload -> ``[nctrl * 64]`` block-structured words with zero heads."""
    buf = torch.zeros(nctrl, P.BLOCK_WORDS, dtype=torch.int64)
    flat = torch.zeros(nctrl * P.CTRL_WORDS_PER_BLOCK, dtype=torch.int64)
    flat[: payload.numel()] = payload.to(torch.int64)
    buf[:, P.HEAD_WORDS:] = flat.view(nctrl, P.CTRL_WORDS_PER_BLOCK)
    return buf.reshape(-1)


def remap_experts(num: int, hop: torch.Tensor | None = None, mapping: bool = True) -> torch.Tensor:
    """Launcher of ``kernels.mapper.remap_experts_kernel``; equal to ``ubep_torch.mapper.remap_experts`` for
    the topology's hop classes, 0 to ``NUM_HOP_CLASSES - 1`` (others are a ValueError: the kernel sorts those
    classes only)."""
    num = int(num)
    order = torch.empty(max(num, 1), dtype=torch.int64)
    if num == 0:
        return order[:0]
    hop_t = torch.as_tensor(hop, dtype=torch.int64).reshape(num).contiguous() if hop is not None else order
    if hop is not None and (int(hop_t.min()) < 0 or int(hop_t.max()) >= NUM_HOP_CLASSES):
        raise ValueError(f"remap_experts: hop classes must be in [0, {NUM_HOP_CLASSES}), got "
                         f"[{int(hop_t.min())}, {int(hop_t.max())}]")
    kmapper.remap_experts_kernel[(1,)](hop_t, order, num, HAS_HOP=hop is not None, MAPPING=bool(mapping),
                                       BLOCK_E=_p2(num, 2))
    return order


def quaternary_search(cum_counts: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of ``kernels.mapper.quaternary_search_kernel``; equal to ``ubep_torch.mapper.quaternary_search``."""
    cum = torch.as_tensor(cum_counts, dtype=torch.int64).reshape(-1).contiguous()
    t = torch.as_tensor(targets, dtype=torch.int64).reshape(-1).contiguous()
    m = t.numel()
    idx = torch.zeros(m, dtype=torch.int64)
    steps = torch.zeros(m, dtype=torch.int64)
    if cum.numel() == 0 or m == 0:
        return idx, steps
    block = 256
    kmapper.quaternary_search_kernel[(-(-m // block),)](cum, t, idx, steps, cum.numel(), m, BLOCK_M=block)
    return idx, steps


def aiv_slices(cum_counts: torch.Tensor, n_aivs: int, mapping: bool = True) -> dict:
    """Launcher of ``kernels.mapper.aiv_slices_kernel``: every AIV's load and first copy.

    Returns a dict with the ``ubep_torch.mapper.AivAssignment`` names ``slice_start_pos``,
    ``slice_start_offset``, ``search_steps``, ``loads`` and ``slice_bounds``.
    """
    cum = torch.as_tensor(cum_counts, dtype=torch.int64).reshape(-1).contiguous()
    n = check_count("n_aivs", n_aivs, 1)
    out = {k: torch.zeros(n, dtype=torch.int64)
           for k in ("slice_start_pos", "slice_start_offset", "search_steps", "loads")}
    if not cum.numel():     # (no destinations: no copies, and AIV j's first copy is base copy j, as in mapper)
        first = torch.arange(n, dtype=torch.int64) if mapping else torch.zeros(n, dtype=torch.int64)
        out["slice_start_pos"], out["search_steps"] = _search_in_torch(cum, first)
        out["slice_start_offset"] = first
    else:
        kmapper.aiv_slices_kernel[(n,)](cum, cum.numel(), int(cum[-1]), out["slice_start_pos"],
                                        out["slice_start_offset"], out["search_steps"], out["loads"], n,
                                        MAPPING=bool(mapping))
    out["slice_bounds"] = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(out["loads"], 0)])
    return out


def kdispatch_ll_receive(fmt: P.RowFormat, ctrl_views: Sequence[torch.Tensor], row_views: Sequence[torch.Tensor],
                         flag: int, n_exp: int, out: torch.Tensor, n_count: int, max_spins: int,
                         rank: int = -1) -> torch.Tensor:
    """Launcher of ``kernels.dispatch.cal_cumsum_reorder_kernel`` (TFF and SP, one field)."""
    if fmt.sync not in ("tff", "sp"):
        raise ValueError("the decomposed low-latency receive kernel polls TFF flags or SP sentinels")
    R = len(ctrl_views)
    sig = torch.zeros(R, 2 * n_exp + 1, dtype=torch.int64)
    status = torch.zeros(n_count + R, dtype=torch.int64)
    ctrl_addr = torch.tensor([_addr(c) for c in ctrl_views], dtype=torch.int64)
    rows_addr = torch.tensor([_addr(r) for r in row_views], dtype=torch.int64)
    o = out.view(out.shape[0], out.shape[1], -1).view(torch.uint8) if out.dtype != torch.uint8 else out
    kdispatch.cal_cumsum_reorder_kernel[(n_count + R,)](
        ctrl_addr, rows_addr, sig, o, status, R, n_exp, fmt.blocks, flag, o.stride(0), o.stride(1), max_spins,
        n_count, fmt.fields[0][1], fmt.field_offset_blocks(0), 0, fmt.meta_words,
        P.CTRL_COUNTS, ctrl_views[0].shape[0] if R else 1, SYNC=_SYNC[fmt.sync], E_BLOCK=_p2(n_exp, 2),
        BYTE_BLOCK=512, NB_BLOCK=_p2(fmt.blocks, 2), CTRL_WORDS=P.CTRL_WORDS_PER_BLOCK)
    if bool(status.any()):
        missing = [int(i) - n_count for i in status.nonzero().flatten() if int(i) >= n_count]
        raise UBEPKernelWaitError("low_latency_dispatch: CalCumSum / Token-Reordering", rank, missing, max_spins)
    return sig
