"""Bottom-right causal alignment (KV caches): a decode step (T = 1) and a chunked
prefill (T = 16, ragged) over a cache of L_b keys per row equal the rows L_b .. of full
causal attention over the concatenated sequence, forward and gradients, against the
float64 NumPy truth under the tolerance rule (tests/attention_test_base.py), where the
plain same-dtype implementation is "xla" over the whole concatenated sequence. The
"hip" kernels' bottom-right cases run in tests/test_hip_kernel.py (half precision).

The cache test computes with full float32 products (XLA's default on NVIDIA GPUs is
TF32-like). At TF32 a flash backward's delta = rowsum(dO * O) and its dP = dO V^T
disagree by TF32's rounding: a query that sees one key has dq = 0 exactly, which the
plain implementation's autodiff of softmax reproduces, while a flash backward returns
that rounding. The test is about which keys each row sees, checked to float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from jflash import mosaic_impl
from tests.attention_test_base import cache_problem, floor, max_err, tile_config

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")
N, K, H = 4, 2, 16
S = 48          # the cache buffer: keys past a row's length are padding (NaN here)


def _fwd_bwd(fn, q, k, v, do):
  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))
  return jax.jit(run)(q, k, v, do)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("cache,new", [((40, 3, 0), (1, 1, 1)),         # decode
                                       ((9, 31, 0), (16, 7, 1))],       # chunked prefill
                         ids=["decode", "chunked_prefill"])
def test_cache_rows_equal_full_causal_attention(implementation, cache, new):
  call, whole = cache_problem(cache, new, S=S, N=N, K=K, H=H, seed=1)
  q, k, v, do, q_len, kv_len = (call[x] for x in ("q", "k", "v", "do", "q_len", "kv_len"))
  qf, kf, vf, dof, full = (whole[x] for x in ("q", "k", "v", "do", "kv_len"))
  cfg = tile_config(implementation, 16, 16)
  with jax.default_matmul_precision("highest"):   # see the module's docstring
    got = _fwd_bwd(lambda q, k, v: jflash.attention(
        q, k, v, is_causal=True, causal_alignment="bottom_right", query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len, implementation=implementation, config=cfg), q, k, v, do)
    plain = _fwd_bwd(lambda q, k, v: jflash.attention(
        q, k, v, is_causal=True, key_value_seq_lengths=kv_len, implementation="xla"),
        qf, kf, vf, dof)
  ref = jflash.attention_numpy(qf, kf, vf, is_causal=True, key_value_seq_lengths=full,
                               dout=dof)
  ref_out, ref_dq, ref_dk, ref_dv = ref[0], *ref[2:]
  T = q.shape[1]
  for b, (L, n) in enumerate(zip(cache, new)):
    rows = slice(L, L + n)
    checks = [("out", got[0][b, :n], plain[0][b, rows], ref_out[b, rows]),
              ("dq", got[1][b, :n], plain[1][b, rows], ref_dq[b, rows]),
              ("dk", got[2][b, :full[b]], plain[2][b, :full[b]], ref_dk[b, :full[b]]),
              ("dv", got[3][b, :full[b]], plain[3][b, :full[b]], ref_dv[b, :full[b]])]
    for name, g, p, want in checks:
      g = np.asarray(g, np.float64)
      assert np.all(np.isfinite(g)), f"row {b} {name}: non-finite"
      err, err_plain = max_err(g, want), max_err(p, want)
      bound = 2 * err_plain + floor(jnp.float32, want, max(S, T * N // K))
      assert err <= bound, (b, name, err, err_plain)
    # Padded query rows give zeros; padded keys get zero gradients.
    np.testing.assert_array_equal(np.asarray(got[0][b, n:]), 0)
    np.testing.assert_array_equal(np.asarray(got[2][b, full[b]:]), 0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_without_lengths_aligns_the_last_query_with_the_last_key(implementation):
  # No lengths: the offset is S - T for every row (a static one for the kernels). With
  # a window, query i sees keys S - T + i - 3 .. S - T + i.
  r = np.random.default_rng(2)
  B, T = 2, 5
  q, k, v = (jnp.asarray(r.standard_normal(s), jnp.float32)
             for s in ((B, T, N, H), (B, 37, K, H), (B, 37, K, H)))
  for kw in (dict(), dict(local_window_size=(3, 0))):
    got = jflash.attention(q, k, v, is_causal=True, causal_alignment="bottom_right",
                           implementation=implementation,
                           config=tile_config(implementation, 16, 16), **kw)
    qf = jnp.zeros((B, 37, N, H), jnp.float32).at[:, 37 - T:].set(q)
    want = jflash.attention_numpy(qf, k, v, is_causal=True,
                                  local_window_size=kw.get("local_window_size"))[0][:, 37 - T:]
    plain = jflash.attention(qf, k, v, is_causal=True, implementation="xla", **kw)[:, 37 - T:]
    err, err_plain = max_err(got, want), max_err(plain, want)
    assert err <= 2 * err_plain + floor(jnp.float32, want, 37), (kw, err, err_plain)


def test_top_left_stays_the_default():
  r = np.random.default_rng(3)
  q = jnp.asarray(r.standard_normal((1, 3, 2, 8)), jnp.float32)
  k = jnp.asarray(r.standard_normal((1, 9, 2, 8)), jnp.float32)
  out = jflash.attention(q, k, k, is_causal=True, implementation="xla")
  theirs = jax.nn.dot_product_attention(q, k, k, is_causal=True)   # top-left, as jax.nn
  want = jflash.attention_numpy(q, k, k, is_causal=True, causal_alignment="top_left")[0]
  assert max_err(out, want) <= 2 * max_err(theirs, want) + floor(jnp.float32, want, 9)


def test_alignments_that_coincide_are_recorded_top_left():
  # T == S without lengths (self-attention in training, as Flax's adapter calls it):
  # the offset is 0, so every implementation with top-left causal runs it.
  x = jnp.zeros((1, 4, 1, 8))
  masks = jflash.prepare(x, x, x, is_causal=True, causal_alignment="bottom_right")[1]
  assert masks.causal_alignment == "top_left"
  masks = jflash.prepare(x[:, :1], x, x, is_causal=True, causal_alignment="bottom_right")[1]
  assert masks.causal_alignment == "bottom_right"
  masks = jflash.prepare(x, x, x, is_causal=True, causal_alignment="bottom_right",
                         key_value_seq_lengths=jnp.asarray([3]))[1]
  assert masks.causal_alignment == "bottom_right"


def test_bad_alignment_is_a_value_error():
  x = jnp.zeros((1, 2, 1, 8))
  with pytest.raises(ValueError, match="causal_alignment"):
    jflash.attention(x, x, x, is_causal=True, causal_alignment="lower_right")


def test_mosaic_gpu_refuses_bottom_right():
  x = jnp.zeros((1, 2, 1, 64), jnp.bfloat16)
  q = x[:, :1]
  cfg, masks = jflash.prepare(q, x, x, is_causal=True, causal_alignment="bottom_right")
  with pytest.raises(NotImplementedError, match="causal_alignment"):
    mosaic_impl.check_call(q, x, x, cfg, masks, platform="gpu", capability="9.0")

