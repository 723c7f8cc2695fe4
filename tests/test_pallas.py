"""The Pallas kernels (interpret mode on CPU) through the shared test base."""
import numpy as np
import pytest

import jflash
from pallas_kernels import common
from tests.attention_test_base import AttentionTestBase


class TestPallas(AttentionTestBase):
  implementation = "pallas"
  second_order = False  # the kernels have no derivative of their own


@pytest.mark.parametrize("T,S,bq,bk", [(257, 257, 32, 32), (97, 203, 16, 64), (203, 97, 64, 16)])
def test_causal_schedule_matches_numpy_simulation(T, S, bq, bk):
  # The kernels' tile bounds visit exactly the tiles the NumPy simulation visits, and
  # never a tile entirely above the diagonal.
  rows = common.key_block_schedule(T, S, block_q=bq, block_k=bk, is_causal=True)
  x = np.zeros((1, max(T, S), 1, 16))
  _, _, visited = jflash.attention_tiled_numpy(x[:, :T], x[:, :S], x[:, :S], is_causal=True,
                                               block_q=bq, block_k=bk)
  assert sum(a + b for a, b in rows) == visited
  for i, (n_full, n_boundary) in enumerate(rows):
    last_row = min(T, (i + 1) * bq) - 1
    assert (n_full + n_boundary - 1) * bk <= last_row  # the last visited tile is needed
    assert n_full * bk <= i * bq + 1                    # unmasked tiles are fully visible


def test_non_causal_schedule_masks_only_the_clipped_tile():
  rows = common.key_block_schedule(100, 200, block_q=32, block_k=64, is_causal=False)
  assert rows == [(3, 1)] * 4
  rows = common.key_block_schedule(100, 256, block_q=32, block_k=64, is_causal=False)
  assert rows == [(4, 0)] * 4
