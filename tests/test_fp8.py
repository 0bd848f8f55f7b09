"""``ubep_torch.fp8``: the fp8 row format of dispatch (e4m3 values, one float32 scale per 128 channels) and
DeepEP's ``calc_diff``, against their definitions in plain torch."""
import pytest
import torch

import ubep_torch
from ubep_torch.fp8 import calc_diff, pack_ue8m0, per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0


def _groups(t: torch.Tensor) -> torch.Tensor:
    return t.float().reshape(*t.shape[:-1], t.shape[-1] // 128, 128)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cast_to_fp8_follows_its_definition(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 384, generator=g) * torch.logspace(-3, 3, 5).view(1, 5, 1)).to(dtype)
    x[0, 0, :128] = 0                                           # an all-zero group
    q, sc = per_token_cast_to_fp8(x)
    amax = _groups(x).abs().amax(-1)
    ref_sc = amax.clamp(min=1e-4) / 448
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.is_contiguous()
    assert sc.dtype == torch.float32 and sc.shape == (3, 5, 3) and sc.is_contiguous()
    assert torch.equal(sc, ref_sc)
    # values times 448 / amax in float32 (DeepEP's rounding; dividing by the scale rounds some ties apart)
    ref_q = (_groups(x) * (448 / amax.clamp(min=1e-4)).unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(x.shape)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    # every group's largest magnitude maps to e4m3's largest value (the range is used in full)
    nz = amax > 1e-4
    assert torch.equal(_groups(q).abs().amax(-1)[nz], torch.full_like(amax[nz], 448.0))


def test_cast_back_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=g) * torch.rand(64, 1, generator=g) * 10
    q, sc = per_token_cast_to_fp8(x)
    back = per_token_cast_back(q, sc, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a normal value, and 2^-10 of the scale below 2^-6
    err = (back - x).abs()
    bound = torch.maximum(x.abs() / 16, (sc * 2.0 ** -10).repeat_interleave(128, dim=1))
    assert (err <= bound * (1 + 1e-6)).all()
    assert per_token_cast_back(q, sc).dtype == torch.bfloat16
    assert calc_diff(back, x) < 9e-4             # DeepEP's tolerance for fp8 rows


def test_rounded_scales_are_powers_of_two_and_pack_into_ue8m0():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 1024, generator=g).bfloat16() * 3
    q, sc = per_token_cast_to_fp8(x, round_scale=True)
    mant, _ = torch.frexp(sc)
    assert (mant == 0.5).all()                                  # 2^k exactly
    assert (sc >= _groups(x).abs().amax(-1) / 448).all()       # rounded up: nothing clipped
    packed = pack_ue8m0(sc)
    assert packed.dtype == torch.int32 and packed.shape == (2, 7, 2)
    # byte i of the packed words is group i's biased exponent: the scale is 2 ** (byte - 127)
    assert torch.equal(torch.exp2(packed.view(torch.uint8).float() - 127), sc)
    assert torch.equal(unpack_ue8m0(packed), sc)
    assert torch.equal(per_token_cast_back(q, packed), per_token_cast_back(q, sc))


def test_calc_diff_is_deepeps_measure():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=g)
    y = x + 0.01 * torch.randn(8, 256, generator=g)
    a, b = x.double() + 1, y.double() + 1
    assert calc_diff(x, y) == pytest.approx(float(1 - 2 * (a * b).sum() / (a * a + b * b).sum()), rel=1e-12)
    assert calc_diff(x, x) == 0.0
    assert calc_diff(x.bfloat16(), x) < 5e-6 < calc_diff(x, y)
    with pytest.raises(ValueError, match="shapes differ"):
        calc_diff(x, y[:4])


def test_bad_arguments_are_named():
    q, sc = per_token_cast_to_fp8(torch.randn(4, 256))
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast_to_fp8(torch.randn(4, 200))
    with pytest.raises(TypeError, match="bf16, fp16 or float32"):
        per_token_cast_to_fp8(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        per_token_cast_back(q.float(), sc)
    with pytest.raises(ValueError, match=r"scales must have shape \(4, 2\)"):
        per_token_cast_back(q, sc[:, :1])
    with pytest.raises(ValueError, match="multiple of 512"):
        per_token_cast_back(q, torch.zeros(4, 1, dtype=torch.int32))
    # empty batches keep their shapes
    e_q, e_sc = per_token_cast_to_fp8(torch.randn(0, 256))
    assert e_q.shape == (0, 256) and e_sc.shape == (0, 2) and per_token_cast_back(e_q, e_sc).shape == (0, 256)


def test_helpers_are_exported_at_the_top():
    assert ubep_torch.per_token_cast_to_fp8 is per_token_cast_to_fp8
    assert ubep_torch.per_token_cast_back is per_token_cast_back
    assert ubep_torch.calc_diff is calc_diff
