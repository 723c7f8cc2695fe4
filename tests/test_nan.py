"""NaN and inf semantics: only rows that the masks empty become zeros.

A NaN or inf that reaches a visible logit must reach the output and the gradients,
forward and backward, exactly where it does in `jax.nn.dot_product_attention` (the
yardstick: a standard implementation with no special case for blow-ups). A NaN in a
position the masks hide (padding past the sequence lengths) must stay hidden.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import parallel

IMPLEMENTATIONS = ["xla", "xla_chunked", "pallas"]
B, T, S, N, K, H = 1, 24, 24, 2, 1, 16   # GQA: both query heads read key head 0


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  q = r.standard_normal((B, T, N, H)).astype(np.float32)
  k = r.standard_normal((B, S, K, H)).astype(np.float32)
  v = r.standard_normal((B, S, K, H)).astype(np.float32)
  do = r.standard_normal((B, T, N, H)).astype(np.float32)
  return q, k, v, do


def _out_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  return [np.asarray(x) for x in (out, *vjp(jnp.asarray(do)))]


def _poisoned(where, value):
  q, k, v, do = _inputs()
  {"q": q, "k": k}[where][0, 3 if where == "q" else 5, 0, 0] = value
  return q, k, v, do


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("where,value,causal", [
    ("q", np.nan, False),   # one query row: that row's output, dq row, all of dk/dv
    ("k", np.nan, False),   # one key: every row of both heads that read key head 0
    ("k", np.nan, True),    # causal: only the rows that see key 5 (i >= 5)
    ("q", np.inf, False),   # +inf logits: exp(inf - inf) = NaN, never a zero row
], ids=["nan_in_q", "nan_in_k", "nan_in_k_causal", "inf_in_q"])
def test_blow_up_in_a_visible_logit_reaches_output_and_gradients(implementation, where,
                                                                 value, causal):
  q, k, v, do = _poisoned(where, value)
  got = _out_and_grads(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=causal, implementation=implementation), q, k, v, do)
  want = _out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal), q, k, v, do)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    assert np.isnan(w).any(), f"{name}: the yardstick has no NaN, the case is vacuous"
    if value == np.inf and name in ("dk", "dv") and implementation == "pallas":
      # +inf * k gives +inf and -inf logits in one row. A kernel masks with -inf, so a
      # -inf logit is an invisible key there: its P is exactly 0 and it adds nothing to
      # dK/dV, where the yardstick's 0 / NaN normalisation spreads NaN to every key of
      # the row. The blow-up must still reach these gradients, and only where the
      # yardstick has it.
      assert (~np.isfinite(g)).any(), f"{implementation}: the inf never reached {name}"
      assert not (~np.isfinite(g) & np.isfinite(w)).any(), f"{implementation}: {name}"
      continue
    np.testing.assert_array_equal(~np.isfinite(g), ~np.isfinite(w),
                                  err_msg=f"{implementation}: non-finite pattern of {name}")


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_nan_in_padding_stays_hidden(implementation):
  # Rows and keys past the sequence lengths hold NaN: they are hidden by the masks, so
  # the result is finite and equals the one with clean padding.
  q, k, v, do = _inputs(1)
  q_len, kv_len = np.array([T - 2], np.int32), np.array([S - 3], np.int32)
  fn = lambda q, k, v: jflash.attention(q, k, v, implementation=implementation,
                                        query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
  clean = _out_and_grads(fn, q, k, v, do)
  q[:, T - 2:] = np.nan
  k[:, S - 3:] = np.nan
  v[:, S - 3:] = np.nan
  got = _out_and_grads(fn, q, k, v, do)
  for name, g, c in zip(("out", "dq", "dk", "dv"), got, clean):
    assert np.isfinite(g).all(), f"{implementation}: NaN padding leaked into {name}"
    np.testing.assert_array_equal(g, c, err_msg=f"{implementation}: {name}")


def test_ring_merge_propagates_nan_and_keeps_empty_rows_zero():
  # The online-softmax merge of two blocks' partials (jflash.parallel): a NaN lse in
  # one block reaches the merged row; a row no block has seen stays zeros and -inf.
  o = jnp.ones((1, 3, 1, 2), jnp.float32)
  l1 = jnp.asarray([[[jnp.nan, -jnp.inf, 0.5]]], jnp.float32)
  l2 = jnp.asarray([[[0.0, -jnp.inf, jnp.inf]]], jnp.float32)
  out, lse = parallel._merge(o, l1, 2 * o, l2)
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.isnan(out[0, 0]).all() and np.isnan(lse[0, 0, 0])
  assert (out[0, 1] == 0).all() and lse[0, 0, 1] == -np.inf
  # an inf lse is a blow-up, not a weight of 1: the whole merged row is NaN
  assert np.isnan(out[0, 2]).all() and not np.isfinite(lse[0, 0, 2])
