"""FP8 rows as dispatch takes and returns them, and DeepEP's accuracy measure.

Normal ``dispatch`` takes ``x`` as an ``(fp8_e4m3 [T, H], scales [T, H/128] float32)`` pair (or other scales), and
``low_latency_dispatch(use_fp8=True)`` returns its rows in the same format: every run of 128 channels of a
token has one float32 scale, and ``value = fp8 * scale``. These helpers make and undo that format, so code
that quantizes its activations, or a test ported from DeepEP's suite, needs nothing of its own.

DeepEP rounds in two slightly different ways, and each is kept here bit for bit: its Python test helper
(:func:`per_token_cast_to_fp8`) and its low-latency kernels (:func:`low_latency_cast_to_fp8`, what
``low_latency_dispatch(use_fp8=True)`` does to the tokens it sends).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .protocol import fresh
from .utils import check_flag, env_flag, share_memory

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0           # the largest finite float8_e4m3fn value
GROUP = 128               # channels per scale
_MIN_AMAX = 1e-4          # an all-zero group still gets a usable (non-zero) scale
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _need_fp8() -> None:
    if FP8 is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no float8_e4m3fn dtype")


def _check_dense(name: str, t: torch.Tensor) -> None:
    """``t`` holds values in dense (strided) memory: a meta tensor has none (ValueError), a sparse or nested
    one is not read here (TypeError)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor (it has no values)")
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{name} must be a dense tensor, got a {'nested' if t.is_nested else str(t.layout)} one")


def _check_hidden(name: str, t: torch.Tensor, per: int = GROUP) -> int:
    if t.dim() < 1 or t.shape[-1] == 0 or t.shape[-1] % per:
        raise ValueError(f"{name} must be [..., H] with H a positive multiple of {per}, got shape {tuple(t.shape)}")
    return t.shape[-1]


def _ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(s))`` exactly, for positive float32 ``s``, from its bits as DeepEP's kernels compute
    it (``exp2(ceil(log2(s)))`` can land one power of two low just above a power of two); a non-finite
    ``s`` gives +inf."""
    bits = fresh(s).view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((e.clamp(max=128) + 127) << 23).view(torch.float32)


def _native_module():
    """The C module when it was built from these sources and the switch ``UBEP_NATIVE`` is not off, else
    None."""
    from . import native_engine
    if native_engine.available() and env_flag("UBEP_NATIVE", True):
        return native_engine._native
    return None


def _cast(x: torch.Tensor, round_scale: bool, helper: bool, out) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both roundings (see :func:`per_token_cast_to_fp8`, :func:`low_latency_cast_to_fp8`): in one C pass
    where the C module has it (no float32 temporaries, whose fresh pages cost more than the arithmetic),
    else with torch operators; the two give the same bits (tests/test_fp8.py)."""
    _need_fp8()
    check_flag("round_scale", round_scale)     # (a string was taken as True)
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be a bf16, fp16, float32 or float64 tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    _check_dense("x", x)
    H = _check_hidden("x", x)
    lead = tuple(x.shape[:-1])
    if out is None:
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        sc = torch.empty(lead + (H // GROUP,), dtype=torch.float32, device=x.device)
    else:
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise TypeError(f"out must be a pair of tensors (fp8 values, float32 scales), got {out!r}"[:200])
        q, sc = out
        _check_dense("out[0]", q)
        _check_dense("out[1]", sc)
        if q.dtype != FP8 or q.shape != x.shape or not q.is_contiguous() or sc.dtype != torch.float32 \
                or tuple(sc.shape) != lead + (H // GROUP,) or not sc.is_contiguous() \
                or q.device != x.device or sc.device != x.device:
            raise ValueError("out must be contiguous tensors on x's device (float8_e4m3fn like x, float32 "
                             "[..., H/128])")
        if share_memory(q, sc) or share_memory(q, x) or share_memory(sc, x):    # (by byte spans)
            raise ValueError("out's two tensors must not overlap each other or x (the cast reads x while it writes "
                             "them)")
    native = _native_module() if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) else None
    if native is not None:
        src = x.resolve_neg().contiguous()      # (the C loop reads memory: a negated view must be resolved)
        if src.numel():
            native.fp8_cast(src.data_ptr(), src.numel() // H, H, 0 if src.dtype == torch.bfloat16 else 1, q.data_ptr(),
                   sc.data_ptr(), int(bool(round_scale)) | (2 if helper else 0))
        return q, sc
    xf = x.float().reshape(x.numel() // H, H // GROUP, GROUP)
    amax = xf.abs().amax(-1).clamp(min=_MIN_AMAX)
    scale = amax / FP8_MAX if helper else amax * torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
    if round_scale:
        scale = _ceil_pow2(scale)
        mult = 1.0 / scale                       # (a power of two: exact)
    elif helper:
        mult = FP8_MAX / amax                    # (as DeepEP's helper writes it: the reciprocal times 448)
    else:
        mult = torch.full_like(amax, FP8_MAX).div_(amax)     # (correctly rounded, as the kernel divides)
    q.view(-1, H // GROUP, GROUP).copy_((xf * mult.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    qb = q.view(torch.uint8)
    qb.masked_fill_(qb == 0xFF, 0x7F)            # (every NaN the positive one: its sign is the operators' whim)
    sc.view(-1, H // GROUP).copy_(scale)
    return q, sc


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to e4m3 with one float32 scale per 128 channels of each token, as DeepEP's test helper
    of the same name does (same bits).

    Args:
        x: ``[..., H]`` bf16, fp16, float32 or float64 tensor, ``H`` a multiple of 128.
        round_scale: round every scale up to a power of two (exactly representable as a UE8M0 exponent).
    Returns:
        ``(x_fp8 [..., H] float8_e4m3fn, scales [..., H/128] float32)``, both contiguous. A group's scale is
        its largest magnitude ``amax`` (at least 1e-4) over 448, so its values fill e4m3's range; they are
        multiplied by ``448.0 / amax``, computed as the reciprocal of ``amax`` times 448 (or by the
        reciprocal of the rounded scale), in float32, then clamped to +-448 and rounded to nearest even
        (a NaN becomes e4m3's positive NaN).
    """
    return _cast(x, round_scale, True, None)


def low_latency_cast_to_fp8(x: torch.Tensor, round_scale: bool = False, out=None
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The quantization of DeepEP's low-latency dispatch kernel, which ``low_latency_dispatch(use_fp8=True)``
    applies to the tokens it sends: the scale is ``amax * float32(1/448)``, the values are multiplied by the
    correctly rounded ``448 / amax``; with ``round_scale`` the scale is that product rounded up to a power
    of two and the values are multiplied by its exact reciprocal. Arguments and results as
    :func:`per_token_cast_to_fp8` (``out``: a pair of preallocated results to fill), from which it differs
    by a unit in the last place of some scales and in the rounding of some fp8 ties."""
    return _cast(x, round_scale, False, out)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` (G a multiple of 4) as UE8M0 exponent bytes, four per int32:
    ``[..., G/4]``, as ``low_latency_dispatch(use_ue8m0=True)`` returns them. A zero scale (an unused row's)
    packs as byte 0, which unpacks to 0; any other scale that is not a positive finite power of two, which
    one byte cannot hold, is a ValueError."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"scales must be a float32 tensor, got "
                        f"{scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__}")
    _check_dense("scales", scales)
    if scales.dim() < 1 or scales.shape[-1] % 4:
        raise ValueError(f"scales must be [..., G] with G a multiple of 4 (four exponents per int32), got shape "
                         f"{tuple(scales.shape)}")
    bits = fresh(scales).view(torch.int32)
    if bool(((bits & 0x7FFFFF) != 0).any() | (bits < 0).any() | (bits >= 0x7F800000).any()):
        raise ValueError("UE8M0 holds positive powers of two only: round the scales first "
                         "(per_token_cast_to_fp8(..., round_scale=True))")
    return fresh(((bits >> 23) & 0xFF).to(torch.uint8)).view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., G/4]`` -> float32 scales ``[..., G]``."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32 or packed.dim() < 1:
        raise TypeError("packed UE8M0 scales must be an int32 tensor of at least one dimension")
    _check_dense("packed", packed)
    exp = fresh(packed).view(torch.uint8).to(torch.int32)
    return (exp << 23).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """Dequantize rows made by :func:`per_token_cast_to_fp8` or returned by a dispatch with fp8 rows.

    Args:
        x_fp8: ``[..., H]`` float8_e4m3fn (``H`` a multiple of 128), e.g. normal dispatch's ``recv_x[0]`` or
            low-latency ``recv_x[0]`` of shape ``[E_local, R*N, H]``.
        scales: one float32 per 128 channels (``[..., H/128]``), or UE8M0 exponents packed four per int32
            (``[..., H/512]``, what ``use_ue8m0=True`` returns). As in DeepEP's helper they are taken in
            ``x_fp8``'s row-major order whatever their shape, so views such as DeepEP's tests make of them
            (``scales.view(-1, H // 128)``) work; only their number must match.
        dtype: of the result (bf16 by default, as DeepEP's helper returns).
    Returns:
        ``[..., H]`` tensor of ``dtype``: every value times its group's scale, computed in float32.
    """
    _need_fp8()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype must be a float dtype of 16 bits or more (the result's), got {dtype!r}")
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8:
        raise TypeError(f"x_fp8 must be a float8_e4m3fn tensor, got "
                        f"{x_fp8.dtype if isinstance(x_fp8, torch.Tensor) else type(x_fp8).__name__}")
    _check_dense("x_fp8", x_fp8)
    H = _check_hidden("x_fp8", x_fp8)
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a tensor, got {type(scales).__name__}")
    _check_dense("scales", scales)
    if scales.device != x_fp8.device:
        raise ValueError(f"scales ({scales.device}) and x_fp8 ({x_fp8.device}) must be on the same device")
    n_groups = x_fp8.numel() // GROUP
    lead = tuple(x_fp8.shape[:-1])
    if scales.dtype == torch.int32:
        if n_groups % 4:
            raise ValueError(f"packed UE8M0 scales hold 4 groups of 128 channels per int32 word, and x_fp8 of shape "
                             f"{tuple(x_fp8.shape)} has {n_groups} groups: pass float32 scales")
        if scales.numel() * 4 != n_groups:
            per_row = f"shape {lead + (H // (4 * GROUP),)}" if H % (4 * GROUP) == 0 else \
                f"packed across rows: H={H} is not a multiple of {4 * GROUP}"
            raise ValueError(f"packed UE8M0 scales for x_fp8 of shape {tuple(x_fp8.shape)} are {n_groups // 4} int32 "
                             f"words ({per_row}; one byte per 128 channels), got {scales.numel()} (shape "
                             f"{tuple(scales.shape)})")
        scales = unpack_ue8m0(scales.reshape(-1)) if n_groups else scales.float()
    elif scales.dtype == torch.float32:
        if scales.numel() != n_groups:
            raise ValueError(f"scales for x_fp8 of shape {tuple(x_fp8.shape)} are {n_groups} float32 values (shape "
                             f"{lead + (H // GROUP,)}: one per 128 channels), got {scales.numel()} (shape "
                             f"{tuple(scales.shape)})")
    else:
        raise TypeError(f"scales must be float32 (or UE8M0 packed in int32), got {scales.dtype}")
    native = _native_module() if dtype == torch.bfloat16 and x_fp8.device.type == scales.device.type == "cpu" \
        else None
    if native is not None:     # (one C pass: torch converts fp8 to float32 slowly, and through a temporary)
        src, sc = x_fp8.resolve_neg().contiguous(), fresh(scales)
        out = torch.empty(x_fp8.shape, dtype=torch.bfloat16)
        if n_groups:
            native.fp8_dequant(src.data_ptr(), n_groups, sc.data_ptr(), out.data_ptr())
        return out
    xf = x_fp8.float().reshape(n_groups, GROUP) * scales.reshape(n_groups, 1)
    out = xf.reshape(x_fp8.shape).to(dtype)
    if dtype == torch.bfloat16:
        # every NaN 0xffff, as the C loop and torch's vector code store it (its scalar code stores 0x7fc0)
        out.view(torch.int16).masked_fill_(out.isnan(), -1)
    return out


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's accuracy measure: ``1 - 2 * sum(x*y) / sum(x*x + y*y)`` over ``x + 1`` and ``y + 1`` in float64.

    0 for equal tensors (empty ones included), growing with the mismatch; shifting by one keeps tensors near
    zero from dividing by almost nothing. DeepEP's tests accept below 5e-6 for bf16 normal mode, 1e-5 for
    bf16 low-latency mode and 9e-4 with fp8 rows.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("calc_diff takes two tensors")
    for name, t in (("x", x), ("y", y)):
        _check_dense(f"calc_diff: {name}", t)
        if t.is_complex():     # (the double() below would drop the imaginary part)
            raise TypeError(f"calc_diff: {name} is complex ({t.dtype}); it compares real tensors")
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ, {tuple(x.shape)} and {tuple(y.shape)}")
    a, b = x.detach().double() + 1, y.detach().double() + 1   # (detached: a float of a graph warns)
    den = (a * a + b * b).sum()
    if den == 0:     # (no elements, or every one -1 in both: equal tensors, not NaN; a rank with no rows)
        return 0.0
    return float(1 - 2 * (a * b).sum() / den)
