"""``utils.TensorCache``: outputs are reused only once nothing outside the cache refers to them; ``Config``."""
import torch

from ubep_torch.utils import Config, TensorCache


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_held_results_are_never_handed_out_again():
    cache = TensorCache(min_bytes=0)
    a = cache.empty((4, 8), torch.float32)
    b = cache.empty((4, 8), torch.float32)
    assert _ptr(a) != _ptr(b)
    view = a[1:]
    del a
    c = cache.empty((4, 8), torch.float32)          # a's memory is still referenced by its view
    assert _ptr(c) not in (_ptr(view), _ptr(b))
    del view
    d = cache.empty((4, 8), torch.float32)          # now it is free again
    assert _ptr(d) not in (_ptr(b), _ptr(c))


def test_dropped_results_are_reused_smallest_fit_first():
    cache = TensorCache(min_bytes=0)
    big = cache.empty((1000,), torch.bfloat16)
    small = cache.empty((100,), torch.bfloat16)
    ptr_big, ptr_small = _ptr(big), _ptr(small)
    del big, small
    assert _ptr(cache.empty((50,), torch.bfloat16)) == ptr_small
    assert _ptr(cache.empty((500,), torch.bfloat16)) == ptr_big
    kept = [cache.empty((60,), torch.bfloat16), cache.empty((60,), torch.bfloat16)]
    assert ptr_small in [_ptr(t) for t in kept]
    assert all(t.shape == (60,) and t.dtype == torch.bfloat16 for t in kept)


def test_a_full_cache_evicts_a_free_entry_or_allocates_outside():
    cache = TensorCache(max_entries=2, min_bytes=0)
    held = [cache.empty((10,), torch.int32), cache.empty((20,), torch.int32)]
    extra = cache.empty((30,), torch.int32)          # both entries held: a tensor of its own
    assert _ptr(extra) not in [_ptr(t) for t in held]
    del held[0]
    fresh = cache.empty((40,), torch.int32)          # the free 10-entry makes room for a 40-entry
    del fresh
    assert _ptr(cache.empty((35,), torch.int32)) not in (_ptr(held[0]), _ptr(extra))
    assert len(cache._entries[torch.int32]) == 2



def test_only_tensors_of_min_bytes_or_more_are_cached():
    cache = TensorCache(min_bytes=1024)
    small = cache.empty((16, 8), torch.float32)      # 512 bytes: a plain tensor, never kept
    assert small.shape == (16, 8) and small.dtype == torch.float32 and torch.float32 not in cache._entries
    big = cache.empty((16, 16), torch.float32)       # 1024 bytes: kept, and handed out again once dropped
    ptr = _ptr(big)
    del big
    assert _ptr(cache.empty((16, 16), torch.float32)) == ptr

def test_config_repr_names_every_argument_and_rebuilds_the_same_config():
    """(former bug: the repr left out the RDMA chunk sizes and num_count_aivs, so a logged Config could not
    be told from another or rebuilt)"""
    c = Config(24, 8, 512, 7, 130, num_count_aivs=3)
    text = repr(c)
    for value in ("num_sms=24", "num_max_nvl_chunked_send_tokens=8", "num_max_nvl_chunked_recv_tokens=512",
                  "num_max_rdma_chunked_send_tokens=7", "num_max_rdma_chunked_recv_tokens=130",
                  "num_count_aivs=3"):
        assert value in text
    again = eval(text, {"Config": Config})
    assert vars(again) == vars(c)
