"""backend="triton" against backend="torch" on 2 ranks: every output bit-identical.

Each rank function runs the same calls with the same inputs on both backends (see
``tests/triton_rank_fns.py``) and reports, per call, whether the raw bytes of every output agree.
"""
from __future__ import annotations

import os

import pytest

from tests import triton_rank_fns as F
from ubep_torch.testing import RankPool

SYNCS = ("tff", "dc", "sp", "sw")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def pool():
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with RankPool(2, env=env) as p:
        yield p


@pytest.mark.parametrize("sync", SYNCS)
def test_normal_bf16(pool, sync):
    """dispatch, weighted combine, cached dispatch, expert-major dispatch and combine."""
    F.assert_all_same(pool.run(F.normal_equivalence, sync))


@pytest.mark.parametrize("sync", ("tff", "sp"))
def test_normal_fp8_tuple(pool, sync):
    F.assert_all_same(pool.run(F.normal_equivalence, sync, fp8=True))


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("use_fp8", (False, True))
def test_low_latency(pool, sync, use_fp8):
    F.assert_all_same(pool.run(F.ll_equivalence, sync, use_fp8=use_fp8))


@pytest.mark.parametrize("sync", ("tff", "sp"))
def test_low_latency_with_counts_past_one_control_block(pool, sync):
    """110 experts on 2 ranks: 55 local experts' counts run into the control message's second block
    (former bug: the receive kernel read them as one run of words and spun on rows that never come)."""
    F.assert_all_same(pool.run(F.ll_equivalence, sync, T=4, H=128, K=3, E=110, timeout_s=120))


def test_sp_sentinel_collision(pool):
    """Rows whose first words equal the sentinel arrive (no hang) and intact (same as torch)."""
    res = pool.run(F.sp_collision)
    assert all(r["same"] for r in res)
    assert sum(r["zero_rows"] for r in res) >= 1


@pytest.mark.parametrize("sync", ("tff", "sw"))
def test_one_launch_emulates_the_aivs(pool, sync):
    """One send launch whose grid is the rank's AIVs: token group + count group (all senders for sw)."""
    for shape in pool.run(F.launch_shape, sync):
        assert shape["grid"] == shape["n_token"] + shape["n_count"]
        assert shape["n_count"] == (0 if sync == "sw" else shape["n_count"]) and shape["n_token"] >= 1
        if sync != "sw":
            assert shape["n_count"] >= 1


def test_a_calls_config_sets_its_count_group_only(pool):
    """(former bug: a normal call's Config(num_count_aivs=5) stayed in the Triton engine, and the low-latency
    calls after it launched 5 count programs while their reports modelled the model's own choice)"""
    for r in pool.run(F.count_group_per_call):
        assert r["normal with Config(5)"] == (5, 5), r
        assert r["ll after"] == r["ll before"], r
        assert r["mapping reported"] is True and r["mapping off reported"] is False, r


def test_mixed_backends(pool):
    """(former bug: ranks mixing the kernels with another engine built a low-latency Buffer whose first call
    failed with a layout mismatch and broke it)"""
    for r in pool.run(F.mixed_backends):
        assert r["normal_ok"], r
        assert "low_latency_rows" in r["ll"] and "triton" in r["ll"] and "(token, expert)" in r["ll"], r


def test_low_latency_combine_into_strided_out(pool):
    """(former bug: the kernel stored rows ``hidden`` elements apart whatever ``out``'s strides, so a transposed
    ``out=`` got wrong values and a column slice's stores ran into the columns beside it)"""
    F.assert_all_same(pool.run(F.ll_strided_out, "triton"))


def test_ieee_sums_raise_no_warning(pool):
    """(former bug: the interpreter's numpy warned of inf - inf, inf * 0 and overflow in the combine kernels,
    and under warnings-as-errors that failed the call and broke the Buffer on every rank)"""
    for r in pool.run(F.ieee_sums_under_warnings_as_errors):
        assert r == [True] * 6, r
