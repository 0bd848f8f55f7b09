"""Autograd of ubep_torch.functional across 2 gloo ranks.

Reference: a plain-torch dense MoE (``moe_rank_fns.dense_moe_reference``) that applies every expert to
every token in one process. Properties: float64 gradcheck of dispatch -> experts -> combine (inputs and
routing weights), combine(dispatch(x)) equals x times the number of destinations in every dtype with exact
gradients, and the low-latency pair matches the dense reference in value and gradients.

Each check runs against ``GatherBuffer`` (an all-gather reference of the Buffer's semantics, isolating
the autograd rules) and against ``ubep_torch.Buffer`` (the real data path) when it is importable.
"""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import moe_rank_fns as M
from ubep_torch.testing import RankPool


def _buffer_kinds():
    kinds = ["ref"]
    try:
        from ubep_torch.buffer import Buffer  # noqa: F401
    except ImportError:  # a partial checkout without the Buffer still checks the autograd rules
        return kinds
    return [*kinds, "ubep"]


KINDS = _buffer_kinds()


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, env={"PYTHONPATH": ROOT}) as p:
        yield p


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_gradcheck_float64(pool, kind, layout):
    results = pool.run(M.rank_gradcheck, kind, layout)
    for rank, (ok, fwd_err) in enumerate(results):
        assert ok, f"gradcheck failed on rank {rank} ({kind}, {layout})"
        assert fwd_err < 1e-12, f"rank {rank}: EP output differs from the dense reference by {fwd_err}"


def test_results_can_be_modified_in_place(pool):
    # (former bug: RuntimeError "Output 0 of _Combine is a view and is being modified inplace", the results
    # being views of the Buffer's reused output memory)
    for rank, res in enumerate(pool.run(M.rank_inplace_on_outputs, KINDS[-1])):
        assert res == {"normal": True, "low_latency": True, "moe": True}, (rank, res)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_roundtrip_and_exact_gradients(pool, kind, layout, dtype):
    for rank, (fwd, gx, gw, out_dtype, recv_dtype) in enumerate(
            pool.run(M.rank_dispatch_roundtrip, kind, layout, dtype)):
        assert fwd, f"rank {rank}: combine(dispatch(x)) != x * destinations"
        assert gx, f"rank {rank}: grad x != number of destinations"
        assert gw, f"rank {rank}: grad of topk_weights not routed back to its slot"
        assert out_dtype and recv_dtype, f"rank {rank}: dtype {dtype} not preserved"


LL_CASES = [("ref", "float64", 1e-6), ("ref", "float32", 1e-5), ("ref", "bfloat16", 3e-2)]
if "ubep" in KINDS:
    LL_CASES.append(("ubep", "bfloat16", 3e-2))   # the Buffer's low-latency mode is bf16, like DeepEP's


@pytest.mark.parametrize("kind,dtype,tol", LL_CASES)
def test_low_latency_pair_matches_dense(pool, kind, dtype, tol):
    for rank, (out_err, gx_err, gw_err) in enumerate(pool.run(M.rank_low_latency_grads, kind, dtype)):
        assert out_err < tol, f"rank {rank}: relative output error {out_err}"
        assert gx_err < tol, f"rank {rank}: relative grad x error {gx_err}"
        assert gw_err < tol, f"rank {rank}: relative grad topk_weights error {gw_err}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_rank_that_receives_nothing(pool, kind, layout):
    results = pool.run(M.rank_empty_receiver, kind, layout)
    assert results[0][0] == 0, "rank 0 hosts no chosen expert and must receive no rows"
    for rank, (_, out_err, gx_err, gw_err) in enumerate(results):
        assert max(out_err, gx_err, gw_err) < 1e-12, f"rank {rank}: errors {out_err}, {gx_err}, {gw_err}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
@pytest.mark.parametrize("wdtype", ["float32", "float64"])
def test_token_listing_an_expert_twice(pool, kind, layout, wdtype):
    """(former bug: the expert-major layout kept only the first slot's weight when float32 weights travelled
    in the Buffer's weight field, so the output lost the other slots)"""
    for rank, errors in enumerate(pool.run(M.rank_repeated_expert, kind, layout, wdtype)):
        assert max(errors) < 1e-5, f"rank {rank}: relative errors (out, grad x, grad w) {errors}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_second_derivatives_raise(pool, kind, mode):
    """(former bug: ``create_graph=True`` gave first-order gradients that did not require grad, so a
    gradient penalty through the exchanges silently added nothing)"""
    for rank, (first_ok, err) in enumerate(pool.run(M.rank_double_backward, kind, mode)):
        assert first_ok, rank
        assert err is not None and "differentiate twice" in err, (rank, err)


@pytest.mark.parametrize("kind", KINDS)
def test_routing_reused_before_backward(pool, kind):
    want = {"normal": True, "low_latency": True, "rank_major_ids": True, "changed routing refused": True}
    if kind == "ubep":
        want["float y named"] = True
    for rank, res in enumerate(pool.run(M.rank_routing_reused_before_backward, kind)):
        assert res == want, (rank, res)
