"""The expert-parallel MoE layer equals the dense layer with the same parameters.

Reference: one dense ``ubep_torch.nn.MoE`` (all experts, no Buffer) in this process. Every rank feeds its
own tokens through the expert-parallel layer (its experts are the dense layer's slice) and backpropagates
``loss_r = <out_r, g_r> + aux_r``. Properties: per rank, outputs, aux loss, input gradients and replicated
parameter gradients equal the dense model's on that rank's tokens; each rank's expert gradients equal the
dense model's gradients of the summed loss over all ranks, restricted to that rank's experts.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests import moe_rank_fns as M
from tests.test_functional import KINDS
from ubep_torch import nn as unn
from ubep_torch.testing import RankPool

WORLD = 2


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, env={"PYTHONPATH": ROOT}) as p:
        yield p


def dense_reference(router: str, shared: bool, dtype: torch.dtype, world: int = WORLD):
    cfg = M.moe_config(router, shared)
    torch.manual_seed(0)
    dense = unn.MoE(**cfg).to(dtype)
    per_rank = []
    for r in range(world):
        dense.zero_grad(set_to_none=True)
        x = torch.randn(6, cfg["hidden"], generator=torch.Generator().manual_seed(40 + r),
                        dtype=torch.float64).to(dtype).requires_grad_()
        out = dense(x)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(60 + r), dtype=torch.float64)
        ((out * g.to(dtype)).sum() + dense.aux_loss).backward()
        per_rank.append((out.detach(), dense.aux_loss.detach(), x.grad.detach(),
                         {n: p.grad.detach().clone() for n, p in dense.named_parameters()}))
    return cfg, per_rank


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("router,shared,layout", [
    ("softmax", True, "expert_major"),
    ("sigmoid", False, "expert_major"),
    ("softmax", False, "rank_major"),
])
def test_layer_equals_dense(pool, kind, router, shared, layout):
    check_equal(pool.run(M.rank_moe_layer, kind, router, shared, layout, "float64"), router, shared, WORLD)


def check_equal(got, router, shared, world, tol=1e-10):
    cfg, ref = dense_reference(router, shared, torch.float64, world)
    e_local = cfg["num_experts"] // world
    for r, (out, aux, gx, grads) in enumerate(got):
        r_out, r_aux, r_gx, r_grads = ref[r]
        torch.testing.assert_close(out, r_out, atol=tol, rtol=tol, msg=f"rank {r} output")
        torch.testing.assert_close(aux, r_aux, atol=tol, rtol=tol, msg=f"rank {r} aux loss")
        torch.testing.assert_close(gx, r_gx, atol=tol, rtol=tol, msg=f"rank {r} grad x")
        for name, g in grads.items():
            if name.startswith("experts."):
                want = sum(ref[s][3][name] for s in range(world))[r * e_local:(r + 1) * e_local]
            else:
                want = r_grads[name]
            torch.testing.assert_close(g, want, atol=tol, rtol=tol, msg=f"rank {r} grad {name}")


@pytest.mark.parametrize("kind", KINDS[-1:])   # the real Buffer when present (the reference is slow)
def test_layer_equals_dense_on_four_ranks(kind):
    with RankPool(4, env={"PYTHONPATH": ROOT}) as pool4:
        for router, layout in (("softmax", "expert_major"), ("sigmoid", "rank_major")):
            check_equal(pool4.run(M.rank_moe_layer, kind, router, True, layout, "float64"), router, True, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_bf16_close_to_dense(pool, kind):
    _, ref = dense_reference("softmax", True, torch.bfloat16)
    for r, (out, _, gx, _) in enumerate(pool.run(M.rank_moe_layer, kind, "softmax", True, "expert_major",
                                                   "bfloat16")):
        torch.testing.assert_close(out.float(), ref[r][0].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(gx.float(), ref[r][2].float(), atol=2e-2, rtol=2e-2)


def test_dense_path_world_size_one():
    """A Buffer-less layer sorts tokens into expert-major rows; check it against the per-token formula."""
    torch.manual_seed(1)
    layer = unn.MoE(16, 24, 4, 2, shared_expert_hidden=None).double()
    x = torch.randn(7, 16, dtype=torch.float64)
    idx, w, _ = layer.router(x)
    experts = [lambda v, e=e: layer.experts._expert(v[None], e)[0] for e in range(4)]
    torch.testing.assert_close(layer(x), M.dense_moe_reference(x, idx, w, experts))
    assert not layer.expert_parallel


def test_balance_loss_is_one_when_uniform():
    router = unn.Router(8, 4, 1)
    with torch.no_grad():
        router.weight.zero_()
    _idx, w, balance = router(torch.randn(8, 8))
    # Uniform probabilities: P_e = 1/E whatever the (tied) choices, so E * sum_e f_e / E = 1.
    torch.testing.assert_close(balance, torch.tensor(1.0))
    assert torch.allclose(w, torch.ones_like(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_shared_expert_follows_the_input_dtype(dtype):
    """float32 master weights, computed in the input's dtype: the shared expert like the routed ones."""
    torch.manual_seed(2)
    layer = unn.MoE(16, 8, 4, 2, shared_expert_hidden=8)
    x = torch.randn(5, 16)
    out = layer(x.to(dtype))
    assert out.dtype == dtype
    ref = layer(x)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.shared_expert.parameters())


def test_expert_without_rows_gets_zero_gradients():
    """A rank whose local experts receive no rows still defines (zero) gradients for every expert weight."""
    experts = unn.GroupedSwiGLU(2, 8, 4)
    experts(torch.zeros(0, 8, requires_grad=True), [0, 0]).sum().backward()
    for p in (experts.w_gate, experts.w_up, experts.w_down):
        assert p.grad is not None and not bool(p.grad.any())


@pytest.mark.parametrize("kind", KINDS)
def test_data_parallel_sync_finds_experts_by_their_place(pool, kind):
    """(former bug: expert parameters were known by an attribute on the Parameter object, which
    ``load_state_dict(..., assign=True)`` and meta-device construction drop: their gradients were then
    averaged with other ranks' experts' gradients; and a dense MoE's experts, replicated on every rank, were
    not all-reduced)"""
    for rank, (same, dense_synced, dense_differed) in enumerate(pool.run(M.rank_sync_after_reload, kind)):
        assert same and dense_synced and dense_differed, (rank, same, dense_synced, dense_differed)


@pytest.mark.parametrize("dp_ranks", ["strided", "adjacent"])
def test_data_parallel_sync_of_expert_parallel_replicas(dp_ranks):
    """Expert parallelism inside data parallelism (two replicas of a two-rank expert-parallel layer on four
    ranks): ``data_parallel_sync(layer, ep_group, dp_group)`` gives every rank the dense model's gradients
    of the mean loss over all four ranks."""
    with RankPool(4, env={"PYTHONPATH": ROOT}) as pool4:
        worst = pool4.run(M.rank_ep_inside_dp, dp_ranks, timeout_s=120)
        # (former bug: a bad module on rank 0 left the other replica's ranks waiting in the dp_group agreement)
        bad = pool4.run(M.rank_dp_bad_module_with_replicas, dp_ranks, timeout_s=60)
    assert max(w for w, _ in worst) < 1e-12, worst
    assert all(refused == [True, True] for _, refused in worst), worst
    assert bad[0] == ("TypeError", True, "ValueError", 4.0), bad
    assert all(b == ("ValueError", True, "ValueError", 4.0) for b in bad[1:]), bad


@pytest.mark.skipif("ubep" not in KINDS, reason="needs ubep_torch.Buffer")
def test_deepcopy_of_an_expert_parallel_model_shares_the_buffer(pool):
    assert pool.run(M.rank_deepcopy_of_expert_parallel_model) == [(True, True, True, True)] * 2


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_a_bad_batch_on_one_rank_cancels_that_step_on_every_rank(pool, layout):
    """(former bug: the layer's own input checks refused the step without telling the peers, whose step
    then took the refusing rank's next one, and the ranks trained a step apart, silently)"""
    for how, error in (("hidden", "ValueError"), ("interrupt", "KeyboardInterrupt")):   # (Ctrl-C, caught)
        r0, r1 = pool.run(M.rank_moe_bad_batch, layout, how=how)
        assert r0[:-1] == [("UBEPPeerAbortedError", True), "ok", "ok"], (how, r0)
        assert r1[:-1] == [(error, None), "ok", "ok"], (how, r1)
        assert r0[-1] == r1[-1] and r0[-1][2] is None, (how, r0[-1], r1[-1])


def test_data_parallel_sync_with_branches_some_ranks_did_not_use(pool):
    """(former bug: each rank all-reduced the gradients it had, so ranks that used different parameters added
    one another's unrelated gradients, silently, or gloo aborted on a size mismatch)"""
    for err, unused_has_grad in pool.run(M.rank_dp_sync_unused_branches):
        assert err < 1e-5 and not unused_has_grad, (err, unused_has_grad)



def test_data_parallel_sync_refuses_models_that_differ_between_ranks(pool):
    """(former bugs: parameters of other sizes or dtypes on one rank aborted the processes inside gloo's
    all-reduce; sparse gradients raised torch's RuntimeError; a bad module on one rank left the others
    waiting in the all-reduce)"""
    for rank, r in enumerate(pool.run(M.rank_dp_sync_mismatched_models)):
        assert r[:3] == [("size", "ValueError", True), ("dtype", "ValueError", True),
                         ("sparse", "TypeError", True)], r
        assert r[3:5] == ([("none", "ValueError", True), ("meta", "ValueError", True)] if rank == 0 else
                          [("none", "TypeError", True), ("meta", "ValueError", True)]), r
        assert r[5] == ("dp", "ValueError", True), r
        assert r[6] == 2.0, r


def test_moe_and_data_parallel_sync_name_bad_arguments():
    """(former bugs: an aux_loss_coef of the wrong type was taken and failed after the dispatch, on one rank
    breaking every Buffer; a buffer that is not one, a module or group that is not one, gave AttributeError)"""
    from ubep_torch import functional
    for coef, error in (("x", TypeError), (None, TypeError), (True, TypeError), (torch.ones(2), TypeError),
                        (float("nan"), ValueError)):
        with pytest.raises(error, match="aux_loss_coef"):
            unn.MoE(8, 16, 4, 2, aux_loss_coef=coef)
    assert unn.MoE(8, 16, 4, 2, aux_loss_coef=0).aux_loss_coef == 0.0
    with pytest.raises(TypeError, match="buffer must be a ubep_torch.Buffer"):
        unn.MoE(8, 16, 4, 2, buffer=object())
    with pytest.raises(TypeError, match="buffer must be a ubep_torch.Buffer"):
        functional.dispatch(None, torch.ones(2, 8), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), 4)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        unn.data_parallel_sync(None)
    with pytest.raises(TypeError, match="group must be None or a process group"):
        unn.data_parallel_sync(torch.nn.Linear(2, 2), group="g")


@pytest.mark.parametrize("make,error,match", [
    (lambda: unn.Router(-1, 4, 2), ValueError, "Router: hidden"),
    (lambda: unn.Router(8, 2 ** 62, 2), ValueError, "more than this machine's memory"),
    (lambda: unn.Router(8, 4, 1.5), TypeError, "Router: top_k"),
    (lambda: unn.Router(8, 4, True), TypeError, "Router: top_k"),
    (lambda: unn.Router(8, 4, 2, normalize_topk="yes"), TypeError, "normalize_topk"),
    (lambda: unn.SwiGLU(8, 2 ** 62), ValueError, "more than this machine's memory"),
    (lambda: unn.SwiGLU(0, 8), ValueError, "SwiGLU: hidden"),
    (lambda: unn.GroupedSwiGLU(2, 8, -4), ValueError, "GroupedSwiGLU: ffn_hidden"),
    (lambda: unn.GroupedSwiGLU(2, 8, 4)(torch.randn(5, 8), [-1, 6]), ValueError, "GroupedSwiGLU: counts"),
    (lambda: unn.GroupedSwiGLU(2, 8, 4)(torch.randn(5, 8), [2.5, 2.5]), TypeError, "GroupedSwiGLU: counts"),
    # (former bug: numpy sizes multiplied in int64, wrapped past the memory check into torch's overflow error)
    (lambda: unn.SwiGLU(np.int64(2 ** 32), np.int64(2 ** 32)), ValueError, "more than this machine's memory"),
    (lambda: unn.MoE(np.int64(2 ** 31), np.int64(2 ** 33), 1, 1), ValueError, "more than this machine's memory"),
    (lambda: unn.MoE(8, 8, 2, 1, shared_expert_hidden=2 ** 40), ValueError, "shared_expert_hidden=1099511627776"),
])
def test_building_blocks_name_bad_arguments(make, error, match):
    """(former bugs: torch's RuntimeErrors, or a top_k of 1.5 or True taken and failing in forward)"""
    with pytest.raises(error, match=match):
        make()
