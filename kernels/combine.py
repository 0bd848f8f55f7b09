"""Combine kernels: reductions straight from the arrived DataBlocks (paper section 3.2, combine).

The sending half of combine is the same ``kernels.dispatch.send_phase_kernel`` as dispatch (expert
outputs go back into the source ranks' memory with the same Data-as-Flag protocol); this file holds
the receiving reductions:

* ``combine_accumulate_kernel`` (normal combine, plain sum): program ``r`` adds row ``r`` of one
  source into ``acc[index[r]]`` in float32 (float64 for float64 rows), and its float top-k weights
  (meta items) into ``wacc``. Sources are reduced one after another in rank order by the launcher, so
  every output element sees the same addition order as the torch path's ``index_add_``.
* ``weighted_combine_kernel`` (low-latency combine): program ``t`` computes
  ``bf16(sum_k w[t, k] * x[pos[t, k]])`` over the token's valid top-k slots, k ascending, in float32
  (``pos[t, k]``: the slot that holds the expert output of pair (t, k)).

Both read payload with ``kernels.data_as_flag.load_payload``, so TFF heads are skipped and SP escaped
words read as the zero bytes they stand for.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ubep_torch import protocol as P

from . import data_as_flag as daf

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
             torch.float64: tl.float64}


@triton.jit
def combine_accumulate_kernel(rows_addr_ptr, index_ptr, acc_ptr, wacc_ptr, nblocks, hidden, n_weights, meta_words,
                              field_block0, SYNC: tl.constexpr, X_DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr,
                              W_DTYPE: tl.constexpr, W_BYTES: tl.constexpr, HAS_W: tl.constexpr,
                              ACC_DTYPE: tl.constexpr,
                              H_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
    """``acc[index[r], :] += float(x_r)``; ``wacc[index[r], :] += w_r`` (program ``r`` = row ``r``). The
    indices of one launch must differ (compiled for a GPU the programs run at once and would race; the
    Buffer's rows from one source name each token once)."""
    r = tl.program_id(0)
    row = tl.load(rows_addr_ptr) + r.to(tl.int64) * nblocks * daf.BLOCK_BYTES
    t = tl.load(index_ptr + r)
    for h0 in range(0, hidden, H_BLOCK):
        h = h0 + tl.arange(0, H_BLOCK)
        m = h < hidden
        x = daf.load_payload(row, h.to(tl.int64) * ELEM_BYTES, m, field_block0, 0, meta_words, SYNC, X_DTYPE,
                             ELEM_BYTES)
        a = tl.load(acc_ptr + t * hidden + h, mask=m, other=0)
        tl.store(acc_ptr + t * hidden + h, a + widen(x, X_DTYPE, ACC_DTYPE), mask=m)
    if HAS_W:
        k = tl.arange(0, K_BLOCK)
        km = k < n_weights
        w = tl.load((row + 32 + k * W_BYTES).to(tl.pointer_type(W_DTYPE), bitcast=True), mask=km, other=0)
        a = tl.load(wacc_ptr + t * n_weights + k, mask=km, other=0)
        tl.store(wacc_ptr + t * n_weights + k, a + w, mask=km)


@triton.jit
def widen(x, X_DTYPE: tl.constexpr, ACC_DTYPE: tl.constexpr):
    """``x`` (of ``X_DTYPE``) as ``ACC_DTYPE``, exactly. bf16 goes by its bits, the upper half of a float32:
    the CPU interpreter's ``.to(tl.float32)`` flushes bf16 subnormals to zero."""
    if X_DTYPE == tl.bfloat16:
        y = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True).to(ACC_DTYPE)
    else:
        y = x.to(ACC_DTYPE)
    return y


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bit pattern (int16), rounded to nearest even like torch, every NaN stored as
    0xFFFF (what torch's vectorized conversion and the C path store).

    Done with integer ops because the CPU interpreter's ``.to(tl.bfloat16)`` truncates, while
    compiled kernels and torch round to nearest even; this gives the same bits on both.
    """
    bits = x.to(tl.int32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, 0, bits)          # (a NaN's rounding would overflow int32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return tl.where(nan, -1, rounded >> 16).to(tl.int16)


@triton.jit
def weighted_combine_kernel(rows_addr_ptr, topk_ptr, pos_ptr, w_ptr, out_ptr, n_topk, hidden, nblocks, meta_words,
                            field_block0, SYNC: tl.constexpr, H_BLOCK: tl.constexpr):
    """``out[t] = bf16(sum_k w[t, k] * x[pos[t, k]])`` over valid slots (program ``t`` = token ``t``).

    ``out_ptr`` is the bf16 output viewed as int16 (see :func:`f32_to_bf16_bits`).
    """
    t = tl.program_id(0).to(tl.int64)
    base = tl.load(rows_addr_ptr)
    for h0 in range(0, hidden, H_BLOCK):
        h = h0 + tl.arange(0, H_BLOCK)
        m = h < hidden
        acc = tl.full([H_BLOCK], 0, tl.float32)
        for k in range(n_topk):
            valid = tl.load(topk_ptr + t * n_topk + k) >= 0
            w = tl.load(w_ptr + t * n_topk + k)
            slot = tl.where(valid, tl.load(pos_ptr + t * n_topk + k), 0)
            row = base + slot * nblocks * daf.BLOCK_BYTES
            x = daf.load_payload(row, h.to(tl.int64) * 2, m, field_block0, 0, meta_words, SYNC,
                                 tl.bfloat16, 2)
            x = tl.where(valid, widen(x, tl.bfloat16, tl.float32), 0.0)
            acc += x * tl.where(valid, w, 0.0)
        tl.store(out_ptr + t * hidden + h, f32_to_bf16_bits(acc), mask=m)


def _ieee():
    """Sums of infinities, NaN and overflow give their IEEE results silently, as in torch and on the GPU: the
    interpreter computes with numpy, which would warn (and raise under ``-W error``)."""
    return np.errstate(all="ignore")


def _check_rows(who: str, fmt: P.RowFormat, rows) -> None:
    """``rows`` is a contiguous ``[n, fmt.blocks, 512]`` uint8 tensor: the kernels address a row's blocks from
    the format alone, so rows of another geometry would be read past their end."""
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
        raise TypeError(f"{who}: rows must be a uint8 tensor (the rows' bytes), got "
                        f"{rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__}")
    if rows.dim() != 3 or tuple(rows.shape[1:]) != (fmt.blocks, P.BLOCK_BYTES) or not rows.is_contiguous():
        raise ValueError(f"{who}: rows must be a contiguous [n, {fmt.blocks}, {P.BLOCK_BYTES}] tensor (the format's "
                         f"rows of {fmt.blocks} blocks), got shape {tuple(rows.shape)}"
                         + ("" if rows.is_contiguous() else ", not contiguous"))


def combine_accumulate(fmt: P.RowFormat, rows: torch.Tensor, index: torch.Tensor, acc: torch.Tensor,
                       x_dtype: torch.dtype, wacc: torch.Tensor | None = None) -> None:
    """Launcher of :func:`combine_accumulate_kernel` for one source's arrived rows.

    Args:
        fmt: row format with one field ``x`` of ``H * x_dtype.itemsize`` bytes and ``K`` weights (or 0).
        rows: ``[n, blocks, 512]`` uint8 contiguous view of the rows.
        index: ``[n]`` int64 output row of every arrived row (distinct).
        acc: ``[T, H]`` float32 (float64 for float64 x) contiguous accumulator.
        x_dtype: dtype of the rows' payload.
        wacc: optional ``[T, K]`` accumulator of the weights carried in the meta items.
    """
    _check_rows("combine_accumulate", fmt, rows)
    n = rows.shape[0]
    es = torch.empty(0, dtype=x_dtype).element_size()
    hidden = fmt.fields[0][1] // es
    if acc.dim() != 2 or acc.shape[1] != hidden or acc.dtype not in (torch.float32, torch.float64) or \
            not acc.is_contiguous():
        raise ValueError(f"combine_accumulate: acc must be a contiguous [T, {hidden}] float32 or float64 tensor, got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    if wacc is not None:
        # (the weights are the rows' meta items: K of them, each one or two 4-byte words)
        words = wacc.element_size() // 4 if wacc.dtype in (torch.float32, torch.float64) else 0
        if wacc.dim() != 2 or not words or wacc.shape[0] != acc.shape[0] or \
                wacc.shape[1] * words != fmt.meta_words or not wacc.is_contiguous():
            raise ValueError(f"combine_accumulate: wacc must be a contiguous [{acc.shape[0]}, K] float32 or float64 "
                             f"tensor whose K weights fill the format's {fmt.meta_words} meta words, got "
                             f"{wacc.dtype} {tuple(wacc.shape)}")
    if index.dim() != 1 or index.numel() != n:
        raise ValueError(f"combine_accumulate: index must be [{n}] (an accumulator row per row), got shape "
                         f"{tuple(index.shape)}")
    if n == 0:
        return
    has_w = wacc is not None and wacc.shape[1] > 0
    k = wacc.shape[1] if has_w else 0
    # (the kernel addresses by these indices unchecked: a bad one would read or write outside the tensors)
    index = index.to(torch.int64).contiguous()
    if int(index.min()) < 0 or int(index.max()) >= acc.shape[0]:
        raise IndexError(f"combine_accumulate: index must give each of the {n} rows an accumulator row in "
                         f"[0, {acc.shape[0]})")
    with _ieee():
        combine_accumulate_kernel[(n,)](
            torch.tensor([rows.data_ptr()], dtype=torch.int64), index, acc,
            wacc if has_w else acc, fmt.blocks, hidden, k, fmt.meta_words, fmt.field_offset_blocks(0),
            SYNC=daf.SYNC_CODE[fmt.sync], X_DTYPE=_TL_DTYPE[x_dtype], ELEM_BYTES=es,
            W_DTYPE=_TL_DTYPE[wacc.dtype] if has_w else tl.float32,
            W_BYTES=wacc.element_size() if has_w else 4, HAS_W=has_w, ACC_DTYPE=_TL_DTYPE[acc.dtype],
            H_BLOCK=min(1024, triton.next_power_of_2(max(hidden, 2))), K_BLOCK=triton.next_power_of_2(max(k, 2)))


def weighted_combine(fmt: P.RowFormat, rows: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                     out: torch.Tensor, pos: torch.Tensor | None = None) -> None:
    """Launcher of :func:`weighted_combine_kernel`.

    Args:
        fmt: low-latency combine row format (one bf16 field of ``H * 2`` bytes).
        rows: ``[n, blocks, 512]`` uint8 contiguous view of the arrived rows.
        topk_idx: ``[T, K]`` int64 (-1 = masked). weights: ``[T, K]`` float32. out: ``[T, H]`` bf16.
        pos: ``[T, K]`` int64 row of slot (t, k) (default ``t*K + k``).
    """
    _check_rows("weighted_combine", fmt, rows)
    if topk_idx.dim() != 2:
        raise ValueError(f"weighted_combine: topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    T, K = topk_idx.shape
    hidden = fmt.fields[0][1] // 2
    if weights.dtype != torch.float32 or tuple(weights.shape) != (T, K):
        raise TypeError(f"weighted_combine: weights must be a [{T}, {K}] float32 tensor, got {weights.dtype} "
                        f"{tuple(weights.shape)}")
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (T, hidden):
        raise TypeError(f"weighted_combine: out must be a [{T}, {hidden}] bfloat16 tensor, got {out.dtype} "
                        f"{tuple(out.shape)}")
    if T == 0:
        return
    if pos is None:
        pos = torch.arange(T * K, dtype=torch.int64).view(T, K)
    # (the kernel addresses by these rows unchecked: one past the rows would read outside them)
    used = pos[topk_idx >= 0] if tuple(pos.shape) == (T, K) else None
    if used is None or (used.numel() and (int(used.min()) < 0 or int(used.max()) >= rows.shape[0])):
        raise IndexError(f"weighted_combine: pos must be [{T}, {K}] with every unmasked slot's row in "
                         f"[0, {rows.shape[0]})")
    # (the kernel stores token t's row at t * hidden: any other layout of ``out`` gets the rows through a copy)
    dense = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    with _ieee():
        weighted_combine_kernel[(T,)](
            torch.tensor([rows.data_ptr()], dtype=torch.int64), topk_idx.contiguous(), pos.contiguous(),
            weights.contiguous(),
            dense.view(torch.int16), K, hidden, fmt.blocks, fmt.meta_words, fmt.field_offset_blocks(0),
            SYNC=daf.SYNC_CODE[fmt.sync],
            H_BLOCK=min(1024, triton.next_power_of_2(max(hidden, 2))),
            # compiled kernels would otherwise contract ``acc += x * w`` into one fused multiply-add, whose
            # single rounding differs from the torch path's multiply-then-add (the interpreter ignores this)
            enable_fp_fusion=False)
    if dense is not out:
        out.copy_(dense)
