"""``ubep_torch.fp8``: the fp8 row format of dispatch (e4m3 values, one float32 scale per 128 channels) and
DeepEP's ``calc_diff``, against their definitions in plain torch."""
import pytest
import torch

import ubep_torch
import ubep_torch.native_engine
from ubep_torch.fp8 import (
    calc_diff,
    low_latency_cast_to_fp8,
    pack_ue8m0,
    per_token_cast_back,
    per_token_cast_to_fp8,
    unpack_ue8m0,
)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_latency_cast_follows_deepeps_kernel(dtype):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(6, 512, generator=g) * torch.logspace(-2, 2, 6).view(6, 1)).to(dtype)
    q, sc = low_latency_cast_to_fp8(x)
    amax = _groups(x).abs().amax(-1).clamp(min=1e-4)
    # the kernel: scale = amax * float32(1/448); values times the correctly rounded 448 / amax
    ref_sc = amax * torch.tensor(1 / 448, dtype=torch.float32)
    mult = torch.div(torch.full_like(amax, 448.0), amax)
    ref_q = (_groups(x) * mult.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(x.shape)
    assert torch.equal(sc, ref_sc) and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_the_two_roundings_differ_where_deepeps_do():
    """-0.0010528564453125 in a group whose amax is 0.0028076171875 is -168 exactly after scaling, halfway
    between e4m3's -160 and -176: the kernel's correctly rounded 448 / amax keeps it a tie, which rounds to
    the even -160; the test helper's reciprocal-times-448 lands above it, on -176."""
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    x[0, 0], x[0, 1] = 0.0028076171875, -0.0010528564453125
    assert low_latency_cast_to_fp8(x)[0][0, 1].item() == -160.0
    assert per_token_cast_to_fp8(x)[0][0, 1].item() == -176.0


@pytest.mark.parametrize("cast", [per_token_cast_to_fp8, low_latency_cast_to_fp8])
def test_rounded_scales_round_up_just_above_a_power_of_two(cast):
    """amax / 448 just above 2**-8 rounds up to 2**-7 (exp2(ceil(log2(s))) of float32 rounds it down)."""
    amax = torch.nextafter(torch.tensor(1.75), torch.tensor(2.0))
    x = torch.zeros(1, 128)
    x[0, 0] = amax
    q, sc = cast(x, round_scale=True)
    assert sc.item() == 2.0 ** -7 and q[0, 0].item() == 224.0     # 1.75 / 2**-7, nothing clipped


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
    x = torch.randn(2, 8, 1024, generator=g).bfloat16() * 3
    q, sc = per_token_cast_to_fp8(x, round_scale=True)
    mant, _ = torch.frexp(sc)
    assert (mant == 0.5).all()                                  # 2^k exactly
    assert (sc >= _groups(x).abs().amax(-1) / 448).all()       # rounded up: nothing clipped
    packed = pack_ue8m0(sc)
    assert packed.dtype == torch.int32 and packed.shape == (2, 8, 2)
    # byte i of the packed words is group i's biased exponent: the scale is 2 ** (byte - 127)
    assert torch.equal(torch.exp2(packed.view(torch.uint8).float() - 127), sc)
    assert torch.equal(unpack_ue8m0(packed), sc)
    assert torch.equal(per_token_cast_back(q, packed), per_token_cast_back(q, sc))
    # views as DeepEP's tests make them: [rows, H] values with the scales viewed as [-1, H/128]
    flat = per_token_cast_back(q.view(-1, 1024), packed.view(-1, 1024 // 128))
    assert torch.equal(flat, per_token_cast_back(q, sc).view(-1, 1024))
    zero = torch.zeros(2, 4)                                    # (an unused row's scales)
    assert torch.equal(pack_ue8m0(zero), torch.zeros(2, 1, dtype=torch.int32))
    assert torch.equal(unpack_ue8m0(pack_ue8m0(zero)), zero)
    for bad in (torch.full((1, 4), 0.75), torch.full((1, 4), -0.5), torch.full((1, 4), float("nan"))):
        with pytest.raises(ValueError, match="powers of two"):
            pack_ue8m0(bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_ue8m0(torch.ones(2, 6))


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
    # (former bug: NaN for a rank with no rows, failing DeepEP-style `assert calc_diff(a, b) < tol` there)
    assert calc_diff(x[:0], y[:0]) == 0.0
    assert calc_diff(-torch.ones(3, 4), -torch.ones(3, 4)) == 0.0


def test_topk_idx_t_is_deepeps_routing_dtype():
    # (DeepEP's tests and frameworks cast routings with `.to(deep_ep.topk_idx_t)`; it was missing)
    import ubep_torch
    assert ubep_torch.topk_idx_t is torch.int64 and "topk_idx_t" in ubep_torch.__all__


def test_bad_arguments_are_named():
    q, sc = per_token_cast_to_fp8(torch.randn(4, 256))
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast_to_fp8(torch.randn(4, 200))
    with pytest.raises(TypeError, match="bf16, fp16, float32 or float64"):
        per_token_cast_to_fp8(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match="bf16, fp16, float32 or float64"):
        per_token_cast_to_fp8(torch.ones(4, 128).to(torch.float8_e5m2))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        per_token_cast_back(q.float(), sc)
    with pytest.raises(ValueError, match=r"are 8 float32 values \(shape \(4, 2\): one per 128 channels\), got 4"):
        per_token_cast_back(q, sc[:, :1])
    # (former message: 'are 2 int32 words (shape (4, 0): ...', a shape of no words)
    with pytest.raises(ValueError, match=r"are 2 int32 words \(packed across rows: H=256 is not a multiple of 512"
                                         r".*got 4"):
        per_token_cast_back(q, torch.zeros(4, 1, dtype=torch.int32))
    q3, _ = per_token_cast_to_fp8(torch.randn(3, 128))          # (3 groups: no int32 words hold them)
    with pytest.raises(ValueError, match="has 3 groups: pass float32 scales"):
        per_token_cast_back(q3, torch.zeros(1, dtype=torch.int32))
    q512, _ = per_token_cast_to_fp8(torch.randn(4, 512))
    with pytest.raises(ValueError, match=r"are 4 int32 words \(shape \(4, 1\); one byte per 128 channels\), got 8"):
        per_token_cast_back(q512, torch.zeros(4, 2, dtype=torch.int32))
    # (former bugs: a string round_scale was taken as True; an integer result dtype truncated the values)
    with pytest.raises(TypeError, match="round_scale"):
        per_token_cast_to_fp8(torch.randn(4, 256), round_scale="no")
    for out in ((1, 2), [None, None], (q, sc, sc)):
        with pytest.raises(TypeError, match="out must be a pair of tensors"):
            low_latency_cast_to_fp8(torch.randn(4, 256), out=out)
    for dtype in (torch.int32, "bf16", torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="dtype must be a float dtype"):
            per_token_cast_back(q, sc, dtype=dtype)
    # (former bugs: torch's RuntimeError for meta, sparse and nested tensors and for scales on another
    # device; calc_diff dropped the imaginary part of complex tensors)
    from ubep_torch.fp8 import pack_ue8m0, unpack_ue8m0
    x = torch.randn(4, 256)
    import warnings
    with warnings.catch_warnings():     # (torch's notice that nested tensors are a prototype)
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 128), torch.randn(3, 128)])
    for bad, error in ((x.to_sparse(), TypeError), (nested, TypeError), (x.to("meta"), ValueError)):
        with pytest.raises(error, match="dense|meta"):
            per_token_cast_to_fp8(bad)
        with pytest.raises(error, match="dense|meta"):
            calc_diff(bad, bad)
    with pytest.raises(ValueError, match="meta"):
        per_token_cast_back(q.to("meta"), sc)
    with pytest.raises(ValueError, match="meta"):
        per_token_cast_back(q, sc.to("meta"))
    with pytest.raises(TypeError, match="dense"):
        per_token_cast_back(q, sc.to_sparse())
    with pytest.raises(TypeError, match="dense"):
        pack_ue8m0(torch.ones(4, 4).to_sparse())
    with pytest.raises(ValueError, match="meta"):
        unpack_ue8m0(torch.ones(4, 1, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="dense"):
        low_latency_cast_to_fp8(x, out=(q.new_empty(4, 256), nested))
    with pytest.raises(TypeError, match="complex"):
        calc_diff(torch.ones(3, dtype=torch.complex64), torch.ones(3, dtype=torch.complex64) * 1j)
    # empty batches keep their shapes
    e_q, e_sc = per_token_cast_to_fp8(torch.randn(0, 256))
    assert e_q.shape == (0, 256) and e_sc.shape == (0, 2) and per_token_cast_back(e_q, e_sc).shape == (0, 256)


def test_helpers_are_exported_at_the_top():
    assert ubep_torch.per_token_cast_to_fp8 is per_token_cast_to_fp8
    assert ubep_torch.per_token_cast_back is per_token_cast_back
    assert ubep_torch.calc_diff is calc_diff


def _torch_cast(cast, x, **kw):
    """``cast`` with torch operators only (the C pass switched off)."""
    import ubep_torch.fp8 as fp8
    saved = fp8._native_module
    fp8._native_module = lambda: None
    try:
        return cast(x, **kw)
    finally:
        fp8._native_module = saved


def _e4m3_probe_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), one float32 step either side of
    them, the subnormal range on a fine grid, and random values, all within +-448."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    fine = torch.linspace(-2.0 ** -5, 2.0 ** -5, 20001)
    rnd = (torch.rand(50000, generator=torch.Generator().manual_seed(7)) * 2 - 1) * 448
    return torch.cat([grid, mids, up, down, fine, rnd])


@pytest.mark.skipif(not ubep_torch.native_engine.available(), reason="the C module was not built")
def test_the_c_pass_gives_the_torch_bits():
    """The C quantization and the torch one agree bit for bit: on every e4m3 value, tie and near-tie (groups
    led by 448, so the kernel's multiplier is exactly 1 and the values meet the rounding as they are), on
    random bf16 and float32 rows of every magnitude, and on groups with zeros, NaN and inf."""
    v = _e4m3_probe_values()
    v = torch.cat([v, torch.zeros((-v.numel()) % 127)]).view(-1, 127)
    led = torch.cat([torch.full((v.shape[0], 1), 448.0), v], 1).reshape(-1, 256)
    g = torch.Generator().manual_seed(8)
    rows = torch.randn(64, 1024, generator=g) * torch.logspace(-6, 4, 64).view(64, 1)
    special = torch.randn(4, 256, generator=g)
    special[0, :128] = 0
    special[1, 5] = float("nan")
    special[2, 7] = float("inf")
    special[3, 9] = -float("inf")
    for x in (led, rows, rows.bfloat16(), special, special.bfloat16()):
        for cast in (per_token_cast_to_fp8, low_latency_cast_to_fp8):
            for rs in (False, True):
                q, sc = cast(x, round_scale=rs)
                tq, tsc = _torch_cast(cast, x, round_scale=rs)
                assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8)), (cast.__name__, x.dtype, rs)
                assert torch.equal(sc.view(torch.int32), tsc.view(torch.int32)), (cast.__name__, x.dtype, rs)


@pytest.mark.skipif(not ubep_torch.native_engine.available(), reason="the C module was not built")
def test_the_c_cast_back_gives_the_torch_bits():
    """Every e4m3 byte (NaN included) times scales of every kind (tiny, huge, zero, power of two, inf, NaN)
    comes back as the bf16 bits of torch's float32 product."""
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(8).view(torch.float8_e4m3fn).view(16, 128)
    sc = torch.tensor([1e-30, 3.3e-7, 1.0, 0.0, 2.0 ** -7, 7.25, 1e30, float("inf"), float("nan"), -0.0,
                       0.011, 448.0, 5e-39, 1e-3, 123.456, 2.0 ** 20]).view(16, 1)
    for scales in (sc, sc.view(4, 4)):                   # (any shape with one scale per 128 values)
        got = per_token_cast_back(q, scales)
        ref = _torch_cast(per_token_cast_back, q, scales=scales)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_nan_rows_cast_back_alike_at_every_cpu_capability():
    """torch's scalar kernels (``ATEN_CPU_CAPABILITY=default``) store a bf16 NaN as 0x7fc0 where its vector
    kernels and the C loop store 0xffff: the torch path settles on 0xffff, so both paths agree there too."""
    import os
    import subprocess
    import sys
    code = (
        "import torch, ubep_torch.fp8 as f\n"
        "q = torch.tensor([[0x7f, 0xff] + [0x38] * 126], dtype=torch.uint8).view(torch.float8_e4m3fn)\n"
        "sc = torch.tensor([[1.0]])\n"
        "c = f.per_token_cast_back(q, sc).view(torch.int16)[0, :3].tolist()\n"
        "f._native_module = lambda: None\n"
        "t = f.per_token_cast_back(q, sc).view(torch.int16)[0, :3].tolist()\n"
        "print(c, t)\n"
        "assert c == t == [-1, -1, 0x3f80], (c, t)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_out_buffers_and_negated_views():
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="meta tensor"):
        low_latency_cast_to_fp8(x, out=(torch.empty(4, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                        torch.empty(4, 2, device="meta")))
    # (former bug: outputs over each other or over x were taken, and the C pass wrote over what it still read)
    raw = torch.empty(4 * 256 + 4 * 2 * 4, dtype=torch.uint8)
    q_over = raw[:1024].view(torch.float8_e4m3fn).view(4, 256)
    for out in ((q_over, raw[:32].view(torch.float32).view(4, 2)),
                (torch.empty(4, 256, dtype=torch.float8_e4m3fn), x[3, :8].view(4, 2)),
                (x.view(torch.uint8).view(-1)[-1024:].view(torch.float8_e4m3fn).view(4, 256), torch.empty(4, 2))):
        with pytest.raises(ValueError, match="overlap"):
            low_latency_cast_to_fp8(x, out=out)
    # two storages over the same memory (numpy views): their bytes are compared, not their storages
    import numpy as np
    mem = np.zeros(4 * 256 * 4 + 2048, dtype=np.uint8)
    x_np = torch.from_numpy(mem[:4096]).view(torch.float32).view(4, 256)
    x_np.copy_(x)
    q_np = torch.from_numpy(mem[1024:2048]).view(torch.float8_e4m3fn).view(4, 256)
    with pytest.raises(ValueError, match="overlap"):
        low_latency_cast_to_fp8(x_np, out=(q_np, torch.empty(4, 2)))
    with pytest.raises(ValueError, match="contiguous"):
        low_latency_cast_to_fp8(x, out=(torch.empty(4, 256, dtype=torch.float8_e4m3fn), torch.empty(4, 3)))
    q, sc = torch.empty(4, 256, dtype=torch.float8_e4m3fn), torch.empty(4, 2)
    assert low_latency_cast_to_fp8(x, out=(q, sc))[0] is q
    if hasattr(torch, "_neg_view"):            # a contiguous view whose values are the negated memory
        neg = torch._neg_view(x)
        for cast in (per_token_cast_to_fp8, low_latency_cast_to_fp8):
            assert torch.equal(cast(neg)[0].view(torch.uint8), cast(-x)[0].view(torch.uint8))


def test_calc_diff_of_tensors_that_require_grad_does_not_warn():
    """(former gap: float() of a tensor in a graph warned; DeepEP's helper stays silent)"""
    import warnings
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert calc_diff(x * 2, x * 2) < 1e-12
