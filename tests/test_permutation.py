"""``geometry.permutation.collapse``: the smallest Transpose moves the same elements (no QNN)."""

import itertools
import random

import numpy as np
import pytest

from qnn_convbwd.geometry import conv as geo
from qnn_convbwd.geometry.permutation import collapse


def _through_view(x: np.ndarray, perm) -> np.ndarray:
    view = collapse(x.shape, perm)
    return x.reshape(view.source_shape).transpose(view.perm).reshape(view.result_shape)


def _shapes(rank: int, count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        yield tuple(rng.choice((1, 1, 2, 3, 5)) for _ in range(rank))


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
def test_every_permutation_matches_numpy(rank):
    for shape in _shapes(rank, 12, seed=rank):
        x = np.arange(int(np.prod(shape))).reshape(shape)
        for perm in itertools.permutations(range(rank)):
            view = collapse(shape, perm)
            np.testing.assert_array_equal(_through_view(x, perm), x.transpose(perm))
            assert view.result_shape == x.transpose(perm).shape
            assert len(view.perm) <= sum(d != 1 for d in shape)


@pytest.mark.parametrize("spatial", [1, 2, 3])
def test_oihw_to_hwio(spatial):
    # a 1x1 kernel: [O, I] -> [I, O]; larger kernels: [O, I, K] -> [K, I, O]
    ones = collapse((64, 32, *[1] * spatial), geo.oihw_to_hwio(spatial))
    assert ones.source_shape == (64, 32) and ones.perm == (1, 0)
    three = collapse((64, 32, *[3] * spatial), geo.oihw_to_hwio(spatial))
    assert three.source_shape == (64, 32, 3**spatial) and three.perm == (2, 1, 0)


def test_hwio_to_oihw_is_rank_two():
    # grad_weight leaves its convolution as [I, kH, kW, O]
    view = collapse((32, 3, 3, 64), (3, 0, 1, 2))
    assert view.source_shape == (32 * 9, 64) and view.perm == (1, 0)


def test_depthwise_layouts_need_no_transpose_for_hwoi():
    # HWIO [3, 3, 1, C] -> HWOI [3, 3, C, 1]: only a unit dim moves
    view = collapse((3, 3, 1, 16), geo.HWIO_TO_HWOI)
    assert not view.transposes
    # OIHW [C, 1, 3, 3] -> HWIO [3, 3, 1, C]: [C, 9] -> [9, C]
    view = collapse((16, 1, 3, 3), geo.OIHW_TO_HWIO)
    assert view.source_shape == (16, 9) and view.perm == (1, 0)


def test_batch_one_activation_swaps():
    # grad_output [1, H, W, C] -> filter [H, W, 1, C]: a Reshape
    assert not collapse((1, 4, 4, 8), (1, 2, 0, 3)).transposes
    # input [1, H, W, C] -> [C, H, W, 1]: [H*W, C] -> [C, H*W]
    view = collapse((1, 4, 4, 8), (3, 1, 2, 0))
    assert view.source_shape == (16, 8) and view.perm == (1, 0)


def test_all_unit_dims():
    view = collapse((1, 1, 1), (2, 0, 1))
    assert not view.transposes and view.result_shape == (1, 1, 1)


def test_not_a_permutation():
    with pytest.raises(ValueError, match="not a permutation"):
        collapse((2, 3), (0, 0))
