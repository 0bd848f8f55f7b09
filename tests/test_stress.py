"""Stragglers and interleavings (short version of ``benchmarks/stress.py``), and determinism.

Random per-rank delays before the protocol waits, back-to-back calls with random shapes, dtypes, -1
masks, hot experts and zero-token ranks, normal and low-latency calls alternating on two Buffers over
two process groups, two low-latency calls in flight: every output must equal the local reference bit
for bit (``stress_rank_fns``). The same inputs must give the same bits across runs, sync modes and
backends.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import stress_rank_fns as S  # noqa: E402

from ubep_torch.testing import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shm"))


def _env(shm_dir):
    return {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE]), "UBEP_SHM_DIR": shm_dir}


@pytest.fixture(scope="module")
def pool2(shm_dir):
    with RankPool(2, env=_env(shm_dir)) as p:
        yield p


def _summary(results):
    return {r["rank"]: (r["calls"], r["n_failures"], r["failures"][:3], r["error"]) for r in results}


def _assert_clean(results, min_calls):
    assert all(r["n_failures"] == 0 and r["error"] is None for r in results), _summary(results)
    assert len({r["calls"] for r in results}) == 1
    assert results[0]["calls"] >= min_calls, _summary(results)
    assert all(r["delays"] > 0 for r in results)


@pytest.mark.parametrize("syncs", [("tff", "sp"), ("dc", "sw")])
def test_random_calls_with_stragglers_two_ranks(pool2, syncs, shm_dir):
    res = pool2.run(S.stress, 7, 110, syncs, 0.25, 0.003, 20.0)
    _assert_clean(res, 240)
    assert pool2.run(S.shm_entries, shm_dir) == [[], []]


def test_random_calls_with_stragglers_three_ranks(shm_dir):
    with RankPool(3, env=_env(shm_dir)) as pool:
        res = pool.run(S.stress, 11, 50, ("sp", "tff"), 0.25, 0.003, 20.0)
        _assert_clean(res, 100)


def test_same_inputs_same_bits_across_runs_and_sync_modes(pool2):
    digests = set()
    for syncs in [("tff", "sp"), ("tff", "sp"), ("sw", "dc")]:
        res = pool2.run(S.stress, 3, 30, syncs, 0.3, 0.002, 20.0, "torch", True)
        _assert_clean(res, 60)
        digests.add(tuple(r["digest"] for r in res))
    assert len(digests) == 1, digests


def test_same_bits_across_backends(pool2):
    pytest.importorskip("triton")
    # the Triton engine runs its kernels under the interpreter: a few steps only
    ref = pool2.run(S.stress, 5, 4, ("tff", "sp"), 0.0, 0.0, 60.0, "torch", True)
    tri = pool2.run(S.stress, 5, 4, ("tff", "sp"), 0.0, 0.0, 60.0, "triton", True, timeout_s=300)
    for res in (ref, tri):
        assert all(r["n_failures"] == 0 and r["error"] is None for r in res), _summary(res)
    assert [r["digest"] for r in ref] == [r["digest"] for r in tri]


def test_same_bits_torch_and_native(pool2):
    """Random and hostile calls (stress.py's mix) give the same digest on the torch and the C data path."""
    from ubep_torch import native_engine
    if not native_engine.available():
        pytest.skip("ubep_torch._native was not built")
    for seed in (6, 7):
        ref = pool2.run(S.stress, seed, 40, ("tff", "sp"), 0.0, 0.0, 60.0, "torch", True)
        nat = pool2.run(S.stress, seed, 40, ("tff", "sp"), 0.0, 0.0, 60.0, "native", True)
        for res in (ref, nat):
            assert all(r["n_failures"] == 0 and r["error"] is None for r in res), _summary(res)
        assert [r["digest"] for r in ref] == [r["digest"] for r in nat]


def test_recv_hooks_completed_newest_first(shm_dir):
    with RankPool(2, env=_env(shm_dir)) as pool:
        res = pool.run(S.hooks_newest_first, 3.0)
    assert all(r is None for r in res), res
