"""The host's per-row reductions give torch's answers: argmax bit for bit (first index of the
maximum, NaN as the maximum), top-k the same values largest first, on vocabularies that take the
two-level path and those that do not, with ties and a ragged last chunk."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triedec.core.errors import TriedecError
from triedec.core.rowops import CHUNK, argmax, topk_indices

# a few distinct values make ties common; the vocabularies straddle the two-level threshold
# (4 * k chunks) and leave a ragged tail
VOCABS = st.sampled_from([7, 4 * 8 * CHUNK - 1, 4 * 8 * CHUNK, 40 * CHUNK + 17, 768 * CHUNK])


@st.composite
def logits(draw: st.DrawFn) -> torch.Tensor:
    rows, vocab = draw(st.integers(1, 5)), draw(VOCABS)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        x = torch.randint(-3, 4, (rows, vocab), generator=g).float()  # many ties
    else:
        x = torch.randn(rows, vocab, generator=g)
    if draw(st.booleans()):  # a maximum planted in the ragged tail or at the very start
        x[0, draw(st.sampled_from([0, vocab - 1]))] = 100.0
    return x


@given(x=logits())
@settings(max_examples=60, deadline=None)
def test_argmax_is_torch_argmax(x: torch.Tensor) -> None:
    assert argmax(x) == x.argmax(dim=-1).tolist()


def test_argmax_nan_and_infinities_as_torch() -> None:
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, 3.0, nan], [2.0, 2.0, 1.0, 0.0], [-inf] * 4, [0.0, -0.0, 0.0, -1.0],
                      [1.0, inf, inf, 0.0]])
    assert argmax(x) == x.argmax(dim=-1).tolist() == [1, 0, 0, 0, 1]
    half = x.to(torch.bfloat16)  # not numpy's: torch's own path
    assert argmax(half) == half.argmax(dim=-1).tolist()


@given(x=logits(), k=st.sampled_from([1, 2, 8]))
@settings(max_examples=60, deadline=None)
def test_topk_values_are_torch_topk_values(x: torch.Tensor, k: int) -> None:
    k = min(k, x.shape[1])
    got = topk_indices(x, k)
    want = x.topk(k, dim=-1)
    assert got.shape == (x.shape[0], k) and got.dtype == torch.long
    assert torch.equal(x.gather(1, got), want.values)  # the same values, largest first
    assert all(len(set(row)) == k for row in got.tolist())  # k distinct columns


def test_topk_distinct_values_give_torch_indices() -> None:
    x = torch.randn(3, 768 * CHUNK, generator=torch.Generator().manual_seed(0))
    assert torch.equal(topk_indices(x, 8), x.topk(8, dim=-1).indices)


def test_topk_ranks_nan_largest_as_torch() -> None:
    x = torch.randn(3, 768 * CHUNK + 5, generator=torch.Generator().manual_seed(1))
    x[1, 100] = float("nan")  # torch ranks NaN first
    assert torch.equal(topk_indices(x, 8), x.topk(8, dim=-1).indices)
    assert topk_indices(x, 8)[1, 0].item() == 100


def test_topk_of_a_strided_view_and_of_float64() -> None:
    x = torch.randn(6, 768 * CHUNK, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    view = x[::2, ::2]  # not contiguous
    assert torch.equal(topk_indices(view, 4), view.topk(4, dim=-1).indices)


@pytest.mark.parametrize(("shape", "k"), [((5,), 1), ((2, 10), 0), ((2, 10), 11)])
def test_bad_shapes_are_refused(shape: tuple[int, ...], k: int) -> None:
    with pytest.raises(TriedecError):
        topk_indices(torch.zeros(shape), k)
    if len(shape) != 2:
        with pytest.raises(TriedecError):
            argmax(torch.zeros(shape))
