"""The references themselves: float64 NumPy truth, its gradients, the tiled simulation,
and the "xla" baseline."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash


def rand(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape)


def test_numpy_reference_closed_forms():
  # One key: every query returns that key's value and lse = its logit.
  q, k, v = rand((1, 5, 2, 8), 0), rand((1, 1, 2, 8), 1), rand((1, 1, 2, 8), 2)
  out, lse = jflash.attention_numpy(q, k, v, scale=0.5)
  np.testing.assert_allclose(out, np.broadcast_to(v, out.shape))
  np.testing.assert_allclose(lse, 0.5 * np.einsum("btnh,bsnh->bnt", q, k))
  # Zero queries: uniform weights, out = mean of values, lse = log(S).
  v = rand((1, 7, 1, 4), 3)
  out, lse = jflash.attention_numpy(np.zeros((1, 3, 1, 4)), rand((1, 7, 1, 4), 4), v)
  np.testing.assert_allclose(out[0, :, 0], np.broadcast_to(v[0, :, 0].mean(0), (3, 4)))
  np.testing.assert_allclose(lse, np.log(7))


def test_numpy_gradients_match_autodiff_in_float64():
  with jax.enable_x64(True):
    q, k, v, do = rand((2, 9, 4, 6), 5), rand((2, 11, 2, 6), 6), rand((2, 11, 2, 6), 7), rand((2, 9, 4, 6), 8)
    ref = jflash.attention_numpy(q, k, v, is_causal=True, dout=do)
    f = lambda q, k, v: jflash.attention_xla(q, k, v, scale=1 / np.sqrt(6), is_causal=True)[0]
    out, vjp = jax.vjp(f, *(jnp.asarray(x) for x in (q, k, v)))
    for got, want in zip((out, *vjp(jnp.asarray(do))), (ref[0], *ref[2:])):
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_dq_abs_terms():
  # s |dS| |K| bounds |dQ| (triangle inequality), strictly where terms cancel; with two
  # keys a query row's dS is (a, -a) (its entries sum to zero), so with k2 = -k1 both
  # terms of each dQ element have one sign and the bound is |dQ| itself.
  q, do = rand((1, 6, 2, 8), 9), rand((1, 6, 2, 8), 12)
  k, v = rand((1, 10, 2, 8), 10), rand((1, 10, 2, 8), 11)
  for scale in (None, -0.3):
    *_, dq, _, _, terms = jflash.attention_numpy(q, k, v, scale=scale, dout=do, dq_abs_terms=True)
    assert (terms >= np.abs(dq) - 1e-12).all() and (terms > np.abs(dq) + 1e-6).any()
  k = rand((1, 1, 1, 8), 13)
  k = np.concatenate([k, -k], axis=1)
  *_, dq, _, _, terms = jflash.attention_numpy(rand((1, 3, 1, 8), 14), k, rand((1, 2, 1, 8), 15),
                                               dout=rand((1, 3, 1, 8), 16), dq_abs_terms=True)
  np.testing.assert_allclose(terms, np.abs(dq), rtol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("T,S", [(1, 1), (33, 70), (70, 33), (64, 64)])
def test_tiled_simulation_equals_reference(T, S, is_causal):
  q, k, v = rand((1, T, 4, 8), 9), rand((1, S, 2, 8), 10), rand((1, S, 2, 8), 11)
  out, lse = jflash.attention_numpy(q, k, v, is_causal=is_causal)
  t_out, t_lse, visited = jflash.attention_tiled_numpy(q, k, v, is_causal=is_causal,
                                                       block_q=16, block_k=16)
  np.testing.assert_allclose(t_out, out, rtol=0, atol=1e-13)
  np.testing.assert_allclose(t_lse, lse, rtol=0, atol=1e-13)
  full = 4 * -(-T // 16) * -(-S // 16)
  assert visited <= full
  if is_causal and T > 16 and S > 16:
    assert visited < full  # tiles above the diagonal were never visited


def test_causal_tiles_skipped_in_simulation():
  x = rand((1, 256, 1, 8), 12)
  _, _, visited = jflash.attention_tiled_numpy(x, x, x, is_causal=True, block_q=32, block_k=32)
  assert visited == sum(range(1, 9))  # the lower triangle of an 8 x 8 tile grid


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 2e-6), (jnp.float64, 1e-13)])
def test_xla_baseline_matches_float64(dtype, rtol):
  with jax.enable_x64(dtype == jnp.float64):
    q, k, v = (jnp.asarray(rand(s, i), dtype) for i, s in
               enumerate([(1, 40, 4, 16), (1, 50, 2, 16), (1, 50, 2, 16)]))
    out, lse = jflash.attention(q, k, v, is_causal=True, implementation="xla",
                                return_residuals=True)
    ref, ref_lse = jflash.attention_numpy(q, k, v, is_causal=True)
    # float32: a softmax-weighted mean of O(1) values, a few ulps of relative error.
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(lse, ref_lse, rtol=rtol, atol=rtol)
