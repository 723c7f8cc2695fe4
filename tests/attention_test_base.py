"""One test base for every flash-type implementation; each test_<impl>.py subclasses it.

Tolerance rule (as in flash-attn's tests): an implementation's error against the
float64 NumPy truth must be at most twice the error of the plain same-dtype
implementation (`jflash.attention_xla`, which materialises the scores) against the
same truth, plus a small floor (`jflash.reference.error_floor`) for cases where the
plain error happens to be (near) zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jflash
from jflash.reference import error_floor as floor, max_err  # noqa: F401  (the rule, shared)

F64 = jnp.float64

# (B, T, S, N, K, H): awkward lengths, T != S both ways, GQA/MQA, odd head dims.
SHAPES = [
    (1, 1, 1, 1, 1, 32),
    (2, 97, 97, 2, 2, 64),
    (1, 113, 203, 4, 2, 59),      # T < S, GQA 2
    (1, 203, 113, 4, 1, 111),     # T > S, MQA (N/K = 4)
    (1, 257, 257, 2, 1, 128),
    (1, 1, 257, 2, 2, 32),
    (1, 257, 1, 2, 2, 32),
]
# Small tiles so that the awkward lengths above span several tiles and clip the last.
TEST_BLOCKS = (32, 32)


def tile_config(implementation, block_q, block_k):
  """One tile shape as the implementation's own config (None for one without tiles).
  "mosaic_gpu" takes its heuristics' tiles (they are what runs) and its own backward
  (the heuristics would pick the Triton one at these lengths)."""
  if implementation == "pallas":
    return jflash.PallasConfig(block_q, block_k, block_q, block_k, block_q, block_k)
  if implementation == "xla_chunked":
    return jflash.ChunkedConfig(block_k)
  if implementation == "mosaic_gpu":
    return jflash.MosaicGPUConfig(backward="mosaic_gpu")
  return None


def reduction_length(shape, name):
  """The longest sum behind one result of a (B, T, S, N, K, H) problem (see `floor`)."""
  B, T, S, N, K, H = shape
  return max(H, T * (N // K) if name in ("dk", "dv") else S)


def random_qkv(shape, dtype, seed=0, scale=1.0):
  B, T, S, N, K, H = shape
  r = np.random.default_rng(seed)
  q = r.standard_normal((B, T, N, H)) * scale
  k = r.standard_normal((B, S, K, H)) * scale
  v = r.standard_normal((B, S, K, H))
  do = r.standard_normal((B, T, N, H))
  cast = lambda x: jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), cast(do)


def cache_problem(cache, new, *, S, N, K, H, seed):
  """A cache of `cache[b]` keys per row and `new[b]` new tokens (right-padded to T), in
  float32: the call's {q, k, v, do, q_len, kv_len} and the concatenated sequence's
  {q, k, v, do, kv_len} (its rows L .. L + n are the new tokens'). Right padding and
  stale cache entries past each row's length hold NaN."""
  B, T = len(cache), max(new)
  r = np.random.default_rng(seed)
  full = np.asarray(cache) + np.asarray(new)
  qf, kf, vf = (r.standard_normal(s) for s in ((B, S, N, H), (B, S, K, H), (B, S, K, H)))
  dof = np.zeros((B, S, N, H))
  q = np.full((B, T, N, H), np.nan)
  do = np.zeros((B, T, N, H))
  for b, (L, n) in enumerate(zip(cache, new)):
    q[b, :n] = qf[b, L:L + n]
    do[b, :n] = r.standard_normal((n, N, H))
    dof[b, L:L + n] = do[b, :n]
  k, v = kf.copy(), vf.copy()
  for b, F in enumerate(full):
    k[b, F:] = v[b, F:] = np.nan
  arr = lambda x: jnp.asarray(x, jnp.float32)
  return (dict(q=arr(q), k=arr(k), v=arr(v), do=arr(do), q_len=jnp.asarray(new, jnp.int32),
               kv_len=jnp.asarray(full, jnp.int32)),
          dict(q=arr(qf), k=arr(kf), v=arr(vf), do=arr(dof), kv_len=full))


class TransformationTests:
  """jit, vmap, bit-identical repeats and second-order gradients of one implementation,
  at `transform_dtype` and `transform_head_dim` (an implementation that computes only in
  half precision, like "hip", sets its own). `attn` is the call under test."""

  implementation: str = ""
  blocks = TEST_BLOCKS
  transform_dtype = jnp.float32
  transform_head_dim = 16
  second_order = True

  def attn(self, q, k, v, **kw):
    return jflash.attention(q, k, v, implementation=self.implementation,
                            config=tile_config(self.implementation, *self.blocks), **kw)

  def fwd_bwd(self, fn, q, k, v, do):
    """(out, dq, dk, dv) of `fn`, compiled as one program."""
    def run(q, k, v, do):
      out, vjp = jax.vjp(fn, q, k, v)
      return (out, *vjp(do))
    return jax.jit(run)(q, k, v, do)

  # -- transformations --------------------------------------------------------------------

  def test_repeated_calls_bit_identical(self):
    q, k, v, do = random_qkv((1, 97, 97, 2, 1, self.transform_head_dim), jnp.bfloat16, seed=8)
    f = jax.jit(lambda *a: self.fwd_bwd(lambda *b: self.attn(*b, is_causal=True), *a))
    first = f(q, k, v, do)
    again = f(q, k, v, do)
    for a, b in zip(first, again):
      assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

  def test_jit_and_vmap(self):
    q, k, v, _ = random_qkv((3, 40, 40, 2, 2, self.transform_head_dim), self.transform_dtype,
                            seed=9)
    eager = self.attn(q, k, v, is_causal=True)
    jitted = jax.jit(lambda *a: self.attn(*a, is_causal=True))(q, k, v)
    # vmap over an extra leading axis: each slice is a [1, T, N, H] call.
    mapped = jax.vmap(lambda *a: self.attn(*a, is_causal=True))(
        q[:, None], k[:, None], v[:, None])[:, 0]
    # The same kernels on the same inputs: equal up to float32 reassociation by XLA.
    np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(eager, np.float32),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(mapped, np.float32), np.asarray(eager, np.float32),
                               rtol=1e-6, atol=1e-6)

  def test_grad_of_grad(self):
    q, k, v, _ = random_qkv((1, 12, 12, 1, 1, self.transform_head_dim), self.transform_dtype,
                            seed=10)
    inner = lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(self.attn(q, k, v) ** 2))(q) ** 2)
    if self.second_order:
      got = jax.jit(jax.grad(inner))(q)
      want = jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(
          jflash.attention(q, k, v, implementation="xla") ** 2))(q) ** 2)))(q)
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)  # float32, chained twice
    else:
      with pytest.raises(NotImplementedError, match="second-order"):
        jax.grad(inner)(q)


class AttentionTestBase(TransformationTests):
  """Accuracy against the float64 truth under the rule, edge cases, and (inherited) the
  transformations. An implementation that computes in fewer dtypes names them in
  `input_dtypes` (the tests of the others skip, saying so), and one with fewer head dims
  its own `half_shapes`."""

  input_dtypes = (jnp.float32, F64, jnp.bfloat16, jnp.float16)
  half_shapes = (SHAPES[2], SHAPES[3])

  def require(self, *dtypes):
    """Skips the test unless the implementation computes in every one of `dtypes`."""
    missing = [jnp.dtype(d).name for d in dtypes if d not in self.input_dtypes]
    if missing:
      pytest.skip(f"{self.implementation} computes in "
                  f"{', '.join(jnp.dtype(d).name for d in self.input_dtypes)} only, not "
                  f"{', '.join(missing)}")

  def assert_within_rule(self, got, plain, ref, dtype, what, length=None):
    err, err_plain = max_err(got, ref), max_err(plain, ref)
    bound = 2 * err_plain + floor(dtype, ref, length or ref.shape[-1])
    assert np.all(np.isfinite(np.asarray(got, np.float64))), f"{what}: non-finite values"
    assert err <= bound, f"{what}: error {err:.3g} > 2 x plain {err_plain:.3g} + floor"

  # -- forward and gradients against the float64 truth -------------------------------

  @pytest.mark.parametrize("shape", SHAPES, ids=str)
  @pytest.mark.parametrize("is_causal", [False, True])
  def test_matches_reference_float32(self, shape, is_causal):
    self.require(jnp.float32)
    q, k, v, do = random_qkv(shape, jnp.float32)
    ref = jflash.attention_numpy(q, k, v, is_causal=is_causal, dout=do)
    got = self.fwd_bwd(lambda *a: self.attn(*a, is_causal=is_causal), q, k, v, do)
    plain = self.fwd_bwd(
        lambda *a: jflash.attention(*a, is_causal=is_causal, implementation="xla"), q, k, v, do)
    for name, g, p, r in zip(("out", "dq", "dk", "dv"), got, plain, (ref[0], *ref[2:])):
      self.assert_within_rule(g, p, r, jnp.float32, name, reduction_length(shape, name))
    assert got[0].dtype == jnp.float32

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
  @pytest.mark.parametrize("which", [0, 1])
  @pytest.mark.parametrize("is_causal", [False, True])
  def test_matches_reference_half(self, dtype, which, is_causal):
    shape = self.half_shapes[which]
    q, k, v, do = random_qkv(shape, dtype, seed=1)
    ref = jflash.attention_numpy(q, k, v, is_causal=is_causal, dout=do)
    got = self.fwd_bwd(lambda *a: self.attn(*a, is_causal=is_causal), q, k, v, do)
    plain = self.fwd_bwd(
        lambda *a: jflash.attention(*a, is_causal=is_causal, implementation="xla"), q, k, v, do)
    for name, g, p, r in zip(("out", "dq", "dk", "dv"), got, plain, (ref[0], *ref[2:])):
      assert g.dtype == dtype, name
      self.assert_within_rule(g, p, r, dtype, name, reduction_length(shape, name))

  @pytest.mark.parametrize("is_causal", [False, True])
  def test_float64_exact(self, is_causal):
    self.require(F64)
    with jax.enable_x64(True):
      q, k, v, do = random_qkv((1, 70, 45, 4, 2, 24), F64, seed=2)
      ref = jflash.attention_numpy(q, k, v, is_causal=is_causal, dout=do)
      out, lse = self.attn(q, k, v, is_causal=is_causal, return_residuals=True)
      got = self.fwd_bwd(lambda *a: self.attn(*a, is_causal=is_causal), q, k, v, do)
      np.testing.assert_allclose(out, ref[0], rtol=0, atol=1e-12)
      np.testing.assert_allclose(lse, ref[1], rtol=0, atol=1e-12)
      for g, r in zip(got[1:], ref[2:]):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-12)

  @pytest.mark.parametrize("scale", [0.0, -0.7, 2.5])
  def test_any_finite_scale(self, scale):
    # The kernels fold a positive scale into exp2's argument after taking the row max;
    # zero and negative scales take the explicit multiply. Both exact in float64.
    self.require(F64)
    with jax.enable_x64(True):
      q, k, v, do = random_qkv((1, 40, 37, 2, 2, 16), F64, seed=9)
      ref = jflash.attention_numpy(q, k, v, scale=scale, is_causal=True, dout=do)
      got = self.fwd_bwd(lambda *a: self.attn(*a, scale=scale, is_causal=True), q, k, v, do)
      for g, r in zip(got, (ref[0], *ref[2:])):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-12)

  def test_lse_and_its_gradient(self):
    # lse is an output too: its cotangent folds into delta. Compared with autodiff of
    # the materialising implementation in float64.
    self.require(F64)
    with jax.enable_x64(True):
      q, k, v, _ = random_qkv((1, 50, 61, 2, 1, 16), F64, seed=3)
      w = jnp.asarray(np.random.default_rng(4).standard_normal((1, 2, 50)))
      loss = lambda impl, blocks: lambda q, k, v: (
          lambda o_l: jnp.sum(o_l[0] ** 2) + jnp.sum(w * o_l[1]))(
              jflash.attention(q, k, v, is_causal=True, implementation=impl,
                               config=tile_config(impl, *blocks), return_residuals=True))
      got = jax.jit(jax.grad(loss(self.implementation, self.blocks), argnums=(0, 1, 2)))(q, k, v)
      want = jax.jit(jax.grad(loss("xla", self.blocks), argnums=(0, 1, 2)))(q, k, v)
      for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-11)

  @pytest.mark.parametrize("dtype", [jnp.float32, F64], ids=["float32", "float64"])
  def test_check_grads(self, dtype):
    self.require(dtype)
    with jax.enable_x64(dtype == F64):
      q, k, v, _ = random_qkv((1, 19, 23, 2, 1, 8), dtype, seed=5)
      f = lambda q, k, v: self.attn(q, k, v, is_causal=True)
      # check_grads picks finite-difference steps and tolerances for the dtype.
      check_grads(f, (q, k, v), order=1, modes=["rev"])

  # -- classic kernel edge cases -------------------------------------------------------

  def test_all_equal_inputs(self):
    # Every logit equal: softmax is uniform and out equals v's (constant) rows exactly.
    self.require(jnp.float32)
    q = jnp.full((1, 77, 2, 32), 0.3, jnp.float32)
    v = jnp.full((1, 91, 2, 32), -1.25, jnp.float32)
    for causal in (False, True):
      out, lse = self.attn(q, q[:, :1].repeat(91, 1), v, is_causal=causal,
                           return_residuals=True)
      np.testing.assert_allclose(out, -1.25, rtol=2e-7)
      n_keys = np.minimum(np.arange(77) + 1, 91) if causal else np.full(77, 91)
      logit = 0.3 * 0.3 * 32 / np.sqrt(32)
      np.testing.assert_allclose(lse[0, 0], logit + np.log(n_keys), rtol=1e-6)

  @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
  def test_huge_logits(self, dtype):
    # Logits of order +-1e4: exp would overflow without the running max.
    self.require(dtype)
    q, k, v, do = random_qkv((1, 65, 81, 2, 2, 16), dtype, seed=6, scale=50.0)
    ref = jflash.attention_numpy(q, k, v, dout=do)
    assert np.abs(np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64),
                            np.asarray(k, np.float64))).max() / 4 > 5e3
    got = self.fwd_bwd(lambda *a: self.attn(*a), q, k, v, do)
    plain = self.fwd_bwd(lambda *a: jflash.attention(*a, implementation="xla"), q, k, v, do)
    self.assert_within_rule(got[0], plain[0], ref[0], dtype, "out")
    for g in got[1:]:
      assert np.all(np.isfinite(np.asarray(g, np.float32)))

  def test_long_row_half_precision(self):
    # 4096 keys in fp16: a sum of 4096 probabilities in fp16 would lose ~3 digits;
    # float32 statistics keep the error at the plain upcasting implementation's.
    q, k, v, _ = random_qkv((1, 16, 4096, 1, 1, 32), jnp.float16, seed=7)
    ref, _ = jflash.attention_numpy(q, k, v)
    got = jflash.attention(q, k, v, implementation=self.implementation,
                           config=tile_config(self.implementation, 16, 512))
    plain = jflash.attention(q, k, v, implementation="xla")
    self.assert_within_rule(got, plain, ref, jnp.float16, "out")


