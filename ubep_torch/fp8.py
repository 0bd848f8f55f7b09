"""FP8 rows as dispatch takes and returns them, and DeepEP's accuracy measure.

Normal ``dispatch`` takes ``x`` as an ``(fp8_e4m3 [T, H], scales [T, H/128] float32)`` pair, and
``low_latency_dispatch(use_fp8=True)`` returns its rows in the same format: every run of 128 channels of a
token has one float32 scale, and ``value = fp8 * scale``. These helpers make and undo that format, so code
that quantizes its activations, or a test ported from DeepEP's suite, needs nothing of its own.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0           # the largest finite float8_e4m3fn value
GROUP = 128               # channels per scale
_MIN_AMAX = 1e-4          # an all-zero group still gets a usable (non-zero) scale


def _fresh(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy with standard contiguous strides, which a dtype ``view`` always accepts (``contiguous()`` may
    keep odd strides of size-1 dimensions)."""
    return torch.empty(t.shape, dtype=dtype).copy_(t)


def _need_fp8() -> None:
    if FP8 is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no float8_e4m3fn dtype")


def _check_hidden(name: str, t: torch.Tensor, per: int = GROUP) -> int:
    if t.dim() < 1 or t.shape[-1] == 0 or t.shape[-1] % per:
        raise ValueError(f"{name} must be [..., H] with H a positive multiple of {per}, got shape {tuple(t.shape)}")
    return t.shape[-1]


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to e4m3 with one float32 scale per 128 channels of each token.

    Args:
        x: ``[..., H]`` floating tensor (bf16, fp16 or float32), ``H`` a multiple of 128.
        round_scale: round every scale up to a power of two (DeepEP's ``round_scale``; such scales are
            exactly representable as UE8M0 exponents).
    Returns:
        ``(x_fp8 [..., H] float8_e4m3fn, scales [..., H/128] float32)``, both contiguous. A group's scale is
        its largest magnitude (at least 1e-4) over 448, so the group's values fill e4m3's range; they are
        multiplied by ``448 / amax`` in float32, as DeepEP's ``per_token_cast_to_fp8`` and its low-latency
        kernels do, so the bits agree with theirs.
    """
    _need_fp8()
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype == FP8:
        raise TypeError(f"x must be a bf16, fp16 or float32 tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    H = _check_hidden("x", x)
    lead = x.shape[:-1]
    xf = x.float().reshape(x.numel() // H, H // GROUP, GROUP)
    amax = xf.abs().amax(-1).clamp(min=_MIN_AMAX)
    scale = amax / FP8_MAX
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
        inv = 1.0 / scale                       # (a power of two: exact)
    else:
        inv = FP8_MAX / amax                    # (multiplied, not divided by the scale: DeepEP's rounding)
    q = (xf * inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, H).contiguous(), scale.reshape(*lead, H // GROUP).contiguous()


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[..., G]`` (G a multiple of 4) as UE8M0 exponent bytes, four per int32:
    ``[..., G/4]``, as ``low_latency_dispatch(use_ue8m0=True)`` returns them."""
    exp = ((_fresh(scales, torch.float32).view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return _fresh(exp, torch.uint8).view(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., G/4]`` -> float32 scales ``[..., G]``."""
    exp = _fresh(packed, torch.int32).view(torch.uint8).to(torch.int32)
    return (exp << 23).view(torch.float32)


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                        ) -> torch.Tensor:
    """Dequantize rows made by :func:`per_token_cast_to_fp8` or returned by a dispatch with fp8 rows.

    Args:
        x_fp8: ``[..., H]`` float8_e4m3fn (``H`` a multiple of 128), e.g. normal dispatch's ``recv_x[0]`` or
            low-latency ``recv_x[0]`` of shape ``[E_local, R*N, H]``.
        scales: ``[..., H/128]`` float32, or UE8M0 exponents packed four per int32 ``[..., H/512]`` (what
            ``use_ue8m0=True`` returns); leading dimensions as ``x_fp8``'s.
        dtype: of the result (bf16 by default, as DeepEP's helper returns).
    Returns:
        ``[..., H]`` tensor of ``dtype``: every value times its group's scale, computed in float32.
    """
    _need_fp8()
    if not isinstance(x_fp8, torch.Tensor) or x_fp8.dtype != FP8:
        raise TypeError(f"x_fp8 must be a float8_e4m3fn tensor, got "
                        f"{x_fp8.dtype if isinstance(x_fp8, torch.Tensor) else type(x_fp8).__name__}")
    H = _check_hidden("x_fp8", x_fp8)
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a tensor, got {type(scales).__name__}")
    if scales.dtype == torch.int32:
        if H % (4 * GROUP):
            raise ValueError(f"packed UE8M0 scales need H to be a multiple of {4 * GROUP}, got {H}")
        scales = unpack_ue8m0(scales)
    elif scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32 (or UE8M0 packed in int32), got {scales.dtype}")
    if tuple(scales.shape) != tuple(x_fp8.shape[:-1]) + (H // GROUP,):
        raise ValueError(f"scales must have shape {tuple(x_fp8.shape[:-1]) + (H // GROUP,)} for x_fp8 of shape "
                         f"{tuple(x_fp8.shape)}, got {tuple(scales.shape)}")
    n = x_fp8.numel() // H
    xf = x_fp8.float().reshape(n, H // GROUP, GROUP) * scales.reshape(n, H // GROUP, 1)
    return xf.reshape(x_fp8.shape).to(dtype)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's accuracy measure: ``1 - 2 * sum(x*y) / sum(x*x + y*y)`` over ``x + 1`` and ``y + 1`` in float64.

    0 for equal tensors, growing with the mismatch; shifting by one keeps tensors near zero from dividing by
    almost nothing. DeepEP's tests accept below 5e-6 for bf16 normal mode, 1e-5 for bf16 low-latency mode and
    9e-4 with fp8 rows.
    """
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TypeError("calc_diff takes two tensors")
    if x.shape != y.shape:
        raise ValueError(f"calc_diff: shapes differ, {tuple(x.shape)} and {tuple(y.shape)}")
    a, b = x.double() + 1, y.double() + 1
    den = (a * a + b * b).sum()
    return float(1 - 2 * (a * b).sum() / den)
