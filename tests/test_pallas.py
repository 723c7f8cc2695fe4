"""The Pallas kernels (interpret mode on CPU) through the shared test base."""
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash.platforms import device_capability
from pallas_kernels.masking import MaskOptions, classes_static, ranges_from_classes
from tests.attention_test_base import AttentionTestBase


class TestPallas(AttentionTestBase):
  implementation = "pallas"
  second_order = False  # the kernels have no derivative of their own


@pytest.mark.parametrize("T,S,bq,bk", [(257, 257, 32, 32), (97, 203, 16, 64), (203, 97, 64, 16)])
def test_causal_schedule_matches_numpy_simulation(T, S, bq, bk):
  # The kernels' tile ranges visit exactly the tiles the NumPy simulation visits, and
  # never a tile entirely above the diagonal.
  opts = MaskOptions(is_causal=True)
  classes = classes_static(T, S, bq, bk, opts)
  ranges = np.asarray(ranges_from_classes(classes))
  x = np.zeros((1, max(T, S), 1, 16))
  _, _, visited = jflash.attention_tiled_numpy(x[:, :T], x[:, :S], x[:, :S], is_causal=True,
                                               block_q=bq, block_k=bk)
  assert int((ranges[:, 3] - ranges[:, 0]).sum()) == visited
  for i, (lo, full_lo, full_hi, hi) in enumerate(ranges):
    last_row = min(T, (i + 1) * bq) - 1
    assert lo == 0 and (hi - 1) * bk <= last_row    # the last visited tile is needed
    assert full_lo == 0 and full_hi * bk <= i * bq + 1  # unmasked tiles are fully visible


def test_non_causal_schedule_masks_only_the_clipped_tile():
  r = np.asarray(ranges_from_classes(classes_static(100, 200, 32, 64, MaskOptions())))
  assert r.tolist() == [[0, 0, 3, 4]] * 4
  r = np.asarray(ranges_from_classes(classes_static(100, 256, 32, 64, MaskOptions())))
  assert r.tolist() == [[0, 0, 4, 4]] * 4


def test_fast_exp2_only_where_compiled_for_cuda():
  """The bare ex2 instruction is inline PTX: never in interpret mode or off CUDA."""
  from pallas_kernels import common
  assert not common.fast_exp2_enabled(True)
  # Compiled: on exactly where the default device is a CUDA GPU (a capability).
  assert common.fast_exp2_enabled(False) == (device_capability()[1] is not None)
  x = jnp.asarray([-jnp.inf, -200.0, -1.0, 0.0, 3.5], jnp.float32)
  np.testing.assert_array_equal(common.exp2(x, fast=False), jnp.exp2(x))
