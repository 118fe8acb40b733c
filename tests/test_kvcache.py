import pytest
import torch

from triedec.core.errors import TriedecError
from triedec.core.kvcache import KVCache


def fill(cache, n, offset, layers=2):
    cache.stage(torch.arange(n) + 100)
    for layer in range(layers):
        k = torch.arange(offset, offset + n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)
        cache.write(layer, k, -k)
        keys, values = cache.view(layer)
        assert keys.shape == values.shape == (1, 2, cache.length + n, 3)


def slots(cache, layer=0):
    return cache.keys[layer][0, 0, : cache.length, 0].tolist()


def test_commit_keeps_chosen_pending_slots_in_order():
    cache = KVCache(16)
    fill(cache, 4, 0)
    cache.commit(range(4))
    fill(cache, 5, 10)
    cache.commit([0, 3, 4])
    assert cache.length == 7
    assert slots(cache) == [0, 1, 2, 3, 10, 13, 14]
    assert cache.values[1][0, 1, : cache.length, 2].tolist() == [-0.0, -1, -2, -3, -10, -13, -14]
    assert cache.positions().tolist() == [100, 101, 102, 103, 100, 103, 104]
    assert cache.peak == 9


def test_select_compacts_committed_slots():
    cache = KVCache(16)
    fill(cache, 6, 0)
    cache.commit(range(6))
    cache.select([1, 4, 5])
    assert slots(cache) == [1, 4, 5]
    assert cache.positions().tolist() == [101, 104, 105]


def test_capacity_and_index_errors():
    cache = KVCache(4)
    with pytest.raises(TriedecError):
        cache.stage(torch.arange(5))
    fill(cache, 3, 0)
    with pytest.raises(TriedecError):
        cache.commit([3])
    with pytest.raises(TriedecError):  # the slots as they stand, one more than pending
        cache.commit([0, 1, 2, 3])
    assert cache.length == 0 and cache.pending == 3
    cache.commit((0, 1))  # a prefix as it stands: nothing moves
    assert cache.length == 2 and cache.pending == 0
    with pytest.raises(TriedecError):
        KVCache(0)


def test_clone_and_extend_to_make_caches_for_timing():
    cache = KVCache(16)
    fill(cache, 3, 0)
    cache.commit(range(3))
    twin = cache.clone()
    twin.extend_to(8)
    assert slots(twin) == [0, 1, 2, 0, 1, 2, 0, 1] and twin.positions().tolist()[3:] == [3, 4, 5, 6, 7]
    assert slots(cache) == [0, 1, 2]  # the original is untouched
    with pytest.raises(TriedecError):
        twin.extend_to(17)
