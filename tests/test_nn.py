"""jflash.nn: the Flax attention_fn adapter is a drop-in for Flax's own attention (nnx and
linen), and the NNX decoder LM trains.

Tolerance rule (float32), after FlashAttention's test suite: the adapter's error against
a float64 reference must be at most twice the error of Flax's own float32 attention
against the same reference, plus a floor of 8 float32 ulps of the reference's largest
magnitude. The factor 2 allows a different but equally good summation order; the floor
covers leaves where Flax's float32 error happens to be ~0, where 2 x 0 would demand
bit-equality that no reordered sum can promise.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jflash
from jflash import nn as jnn

EPS32 = float(np.finfo(np.float32).eps)
# xla_chunked, the CPU default, is the flash path under test; "pallas" runs in slow
# interpret mode on CPU (the kernel suites test it), "xla" is the standard baseline.
IMPLS = ["xla_chunked"]


def assert_within_rule(got, flax32, ref64, what):
  got, flax32, ref64 = (np.asarray(a, np.float64) for a in (got, flax32, ref64))
  err = np.max(np.abs(got - ref64))
  base = np.max(np.abs(flax32 - ref64))
  floor = 8 * EPS32 * max(1.0, float(np.max(np.abs(ref64))))
  assert err <= 2 * base + floor, (
      f"{what}: error {err:.3g} > 2 x Flax float32 error {base:.3g} + floor {floor:.3g}")


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# -- nnx.MultiHeadAttention -------------------------------------------------------------

def _nnx_mha(attention_fn=None, **kw):
  kw = dict(num_heads=4, in_features=32, qkv_features=64, num_kv_heads=2, decode=False,
            rngs=nnx.Rngs(0), **kw)
  if attention_fn is not None:
    kw["attention_fn"] = attention_fn
  return nnx.MultiHeadAttention(**kw)


def _nnx_out_and_grads(module, x, ct, dtype=None, **call_kw):
  """Output and parameter gradients of sum(module(x) * ct), optionally recast to `dtype`."""
  graphdef, params = nnx.split(module, nnx.Param)
  if dtype is not None:
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    x, ct = x.astype(dtype), ct.astype(dtype)

  def loss(p, x, ct, mask):
    out = nnx.merge(graphdef, p)(x, mask=mask, **call_kw)   # call_kw: static options
    return jnp.sum(out * ct), out
  mask = call_kw.pop("mask", None)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x, ct, mask)
  return out, grads


def _compare(got, flax32, ref64):
  (o, g), (o32, g32), (o64, g64) = got, flax32, ref64
  assert_within_rule(o, o32, o64, "output")
  flat = lambda t: jax.tree_util.tree_leaves_with_path(t)
  for (path, a), (_, b), (_, c) in zip(flat(g), flat(g32), flat(g64)):
    assert_within_rule(a, b, c, f"grad {jax.tree_util.keystr(path)}")


# One input for every nnx/linen comparison; odd length, so no tile size divides it.
SHAPE = (2, 37, 32)


def _mask(kind):
  x = _x(SHAPE)
  if kind == "causal":
    return nnx.make_causal_mask(x[..., 0])
  # padding: the second sequence ends after 23 tokens (every row still sees a key).
  valid = jnp.arange(SHAPE[1])[None] < jnp.array([[SHAPE[1]], [23]])
  return nnx.make_attention_mask(jnp.ones(SHAPE[:2], bool), valid)


@functools.cache
def _flax_default_pair(call: tuple):
  """Flax's own attention in float32 and in float64 (the reference), same weights,
  cached per call options (the references are the expensive part of these tests).
  `call`: (("is_causal", bool),) or (("mask", kind),)."""
  kw = {k: (_mask(v) if k == "mask" else v) for k, v in call}
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  flax32 = _nnx_out_and_grads(_nnx_mha(), x, ct, **kw)
  with jax.enable_x64(True):
    ref64 = _nnx_out_and_grads(_nnx_mha(), x, ct, dtype=jnp.float64, **kw)
    ref64 = jax.tree_util.tree_map(np.asarray, ref64)
  return flax32, ref64


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "is_causal"])
def test_nnx_drop_in_matches_flax(impl, causal):
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  flax32, ref64 = _flax_default_pair((("is_causal", causal),))
  got = _nnx_out_and_grads(_nnx_mha(jnn.make_attention_fn(implementation=impl)), x, ct,
                           is_causal=causal)
  _compare(got, flax32, ref64)


def test_nnx_is_causal_option_matches_flax_causal_mask():
  """make_attention_fn(is_causal=True) == Flax's default given nnx.make_causal_mask."""
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  flax32, ref64 = _flax_default_pair((("mask", "causal"),))
  got = _nnx_out_and_grads(_nnx_mha(jnn.make_attention_fn(is_causal=True)), x, ct)
  _compare(got, flax32, ref64)


@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_nnx_dense_mask_forwarded(kind):
  """A dense mask (nnx.make_causal_mask, or a [B, 1, T, S] padding mask) reaches
  jflash.attention's `mask=`."""
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  mask = _mask(kind)
  mha = _nnx_mha(jnn.make_attention_fn())
  flax32, ref64 = _flax_default_pair((("mask", kind),))
  _compare(_nnx_out_and_grads(mha, x, ct, mask=mask), flax32, ref64)


# -- linen.MultiHeadDotProductAttention --------------------------------------------------

def _linen_out_and_grads(attention_fn, x, ct, dtype=None, mask=None):
  kw = {} if attention_fn is None else {"attention_fn": attention_fn}
  mod = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=64, **kw)
  params = mod.init(jax.random.key(0), jnp.zeros_like(x, jnp.float32))
  if dtype is not None:
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    x, ct = x.astype(dtype), ct.astype(dtype)

  def loss(p, x, ct, mask):
    out = mod.apply(p, x, mask=mask)
    return jnp.sum(out * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x, ct, mask)
  return out, grads


@functools.cache
def _linen_default_pair(causal_mask: bool):
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  mask = linen.make_causal_mask(x[..., 0]) if causal_mask else None
  flax32 = _linen_out_and_grads(None, x, ct, mask=mask)
  with jax.enable_x64(True):
    ref64 = jax.tree_util.tree_map(
        np.asarray, _linen_out_and_grads(None, x, ct, jnp.float64, mask=mask))
  return flax32, ref64


@pytest.mark.parametrize("causal", [False, True], ids=["full", "is_causal_vs_flax_mask"])
def test_linen_drop_in_matches_flax(causal):
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  got = _linen_out_and_grads(jnn.make_attention_fn(is_causal=causal), x, ct)
  _compare(got, *_linen_default_pair(causal))


def test_linen_dense_mask_forwarded():
  x, ct = _x(SHAPE), _x(SHAPE, 1)
  mask = linen.make_causal_mask(x[..., 0])
  got = _linen_out_and_grads(jnn.make_attention_fn(), x, ct, mask=mask)
  _compare(got, *_linen_default_pair(True))


# -- what the adapter must refuse, and shapes it must accept ------------------------------

@pytest.mark.parametrize("shape", [(2, 1, 9, 9), (9,)], ids=["B1TS", "S_broadcast"])
def test_adapter_bias_forwarded(shape):
  fn = jnn.make_attention_fn()
  q, k, v = _x((2, 9, 4, 16)), _x((2, 9, 2, 16), 1), _x((2, 9, 2, 16), 2)
  bias = _x(shape, 3)
  flax_fn = jax.jit(lambda q, k, v, b: nnx.dot_product_attention(q, k, v, bias=b))
  want32 = flax_fn(q, k, v, bias)
  with jax.enable_x64(True):
    want64 = np.asarray(flax_fn(*(a.astype(jnp.float64) for a in (q, k, v, bias))))
  got = jax.jit(lambda q, k, v, b: fn(q, k, v, bias=b))(q, k, v, bias)
  assert_within_rule(got, want32, want64, "output with bias")


def test_adapter_dropout_forwarded_and_broadcast_refused():
  fn = jnn.make_attention_fn()
  q = _x((1, 8, 2, 16))
  key = jax.random.key(0)
  a = fn(q, q, q, dropout_rate=0.5, dropout_rng=key, broadcast_dropout=False)
  b = fn(q, q, q, dropout_rate=0.5, dropout_rng=key, broadcast_dropout=False)
  np.testing.assert_array_equal(a, b)          # a function of the key
  assert not np.allclose(a, fn(q, q, q), atol=1e-3)
  # Flax's default shares one mask over batch and heads: a different distribution.
  with pytest.raises(NotImplementedError, match="broadcast_dropout"):
    fn(q, q, q, dropout_rate=0.1, dropout_rng=key)
  mha = _nnx_mha(jnn.make_attention_fn(), dropout_rate=0.1)
  with pytest.raises(NotImplementedError, match="dropout"):
    mha(_x((1, 8, 32)), deterministic=False)
  # Dropout that is switched off is not a request for dropout.
  np.testing.assert_array_equal(
      fn(q, q, q, dropout_rate=0.1, deterministic=True), fn(q, q, q))


def test_adapter_refuses_what_it_cannot_honour():
  fn = jnn.make_attention_fn()
  q = _x((1, 8, 2, 16))
  with pytest.raises(NotImplementedError, match="sow"):
    _nnx_mha(jnn.make_attention_fn())(_x((1, 8, 32)), sow_weights=True)
  with pytest.raises(NotImplementedError, match="precision"):
    fn(q, q, q, precision=jax.lax.Precision.HIGHEST)
  with pytest.raises(NotImplementedError, match="some_future_option"):
    fn(q, q, q, some_future_option=3)
  fn(q, q, q, some_future_option=None)                 # unused future keyword: fine
  with pytest.raises(NotImplementedError, match="no_such_option"):
    jnn.make_attention_fn(no_such_option=1)
  with pytest.raises(ValueError, match="return_residuals"):
    jnn.make_attention_fn(return_residuals=True)


@pytest.mark.parametrize("batch_shape", [(), (2, 3)], ids=["no_batch", "two_batch_dims"])
def test_adapter_batch_dims(batch_shape):
  q = _x(batch_shape + (11, 4, 16))
  k = _x(batch_shape + (11, 2, 16), 1)
  v = _x(batch_shape + (11, 2, 16), 2)
  want = jax.jit(nnx.dot_product_attention)(q, k, v)
  got = jax.jit(jnn.make_attention_fn())(q, k, v)
  assert got.shape == want.shape
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_adapter_dtype_promotion():
  q = _x((1, 8, 2, 16)).astype(jnp.bfloat16)
  out = jnn.make_attention_fn()(q, q, q, dtype=jnp.float32)
  assert out.dtype == jnp.float32


def test_lazy_nn_attribute():
  assert jflash.nn is jnn


# -- our NNX modules ------------------------------------------------------------------------

def test_rope_is_relative():
  """Causal attention with RoPE depends on positions only through differences."""
  attn = jnn.Attention(32, 4, 2, rngs=nnx.Rngs(0), implementation="xla")
  run = nnx.jit(lambda m, x, p: m(x, positions=p))
  x = _x((2, 19, 32))
  pos = jnp.arange(19)
  base = run(attn, x, pos)
  # float32 angles of positions ~1000 carry ~1e-4 absolute rounding.
  np.testing.assert_allclose(base, run(attn, x, pos + 1000), atol=2e-4, rtol=2e-4)
  assert not np.allclose(base, run(attn, x, pos * 2), atol=1e-3)


def test_attention_module_standard_equals_flash():
  x = _x((2, 23, 32))
  a = jnn.Attention(32, 4, 2, rngs=nnx.Rngs(0), implementation="xla")
  b = jnn.Attention(32, 4, 2, rngs=nnx.Rngs(0), implementation="xla_chunked")
  run = nnx.jit(lambda m, x: m(x))
  np.testing.assert_allclose(run(a, x), run(b, x), atol=1e-5, rtol=1e-5)


def test_window_and_segment_options():
  """Forwarded to jflash.attention when it has them (checked against the same call made
  directly), NotImplementedError when it does not."""
  params = jflash.api.OPTIONS
  x = _x((2, 12, 32))
  seg = jnp.array([[0] * 5 + [1] * 7, [0] * 12], jnp.int32)
  if "local_window_size" not in params:
    with pytest.raises(NotImplementedError, match="local_window_size"):
      jnn.Attention(32, 4, local_window_size=(3, 0), rngs=nnx.Rngs(0))
  else:
    attn = jnn.Attention(32, 4, 2, local_window_size=(3, 0), use_rope=False,
                         implementation="xla_chunked", rngs=nnx.Rngs(0))
    q, k, v = attn.query(x), attn.key(x), attn.value(x)
    want = attn.out(jflash.attention(q, k, v, is_causal=True, local_window_size=(3, 0),
                                     implementation="xla"))
    np.testing.assert_allclose(attn(x), want, atol=1e-5, rtol=1e-5)
  attn = jnn.Attention(32, 4, 2, use_rope=False, implementation="xla_chunked",
                       rngs=nnx.Rngs(0))
  if "segment_ids" not in params:
    with pytest.raises(NotImplementedError, match="segment_ids"):
      attn(x, segment_ids=seg)
  else:
    q, k, v = attn.query(x), attn.key(x), attn.value(x)
    want = attn.out(jflash.attention(q, k, v, is_causal=True, segment_ids=seg,
                                     implementation="xla"))
    np.testing.assert_allclose(attn(x, segment_ids=seg), want, atol=1e-5, rtol=1e-5)
  # "cudnn" is a registered implementation: built anywhere, refused off a CUDA GPU.
  cudnn = jnn.Attention(32, 4, implementation="cudnn", local_window_size=(8, 0),
                        rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="cudnn needs a CUDA GPU"):
    cudnn(x)


@pytest.mark.parametrize("build", [
    lambda: jnn.LMConfig(attention_implementation="flash"),
    lambda: jnn.LMConfig(attention_implementation=("xla_chunked", "flsh")),
    lambda: jnn.Attention(32, 4, implementation="flash", rngs=nnx.Rngs(0)),
    lambda: jnn.make_attention_fn(implementation="flsh"),
])
def test_implementation_names_are_checked_where_given(build):
  with pytest.raises(ValueError, match=r"implementation='fl(a)?sh' is unknown"):
    build()


def test_attention_module_validates_options_at_construction():
  # jflash.prepare on the head shapes: bad values fail when the module is built.
  with pytest.raises(ValueError, match="local_window_size"):
    jnn.Attention(32, 4, local_window_size=(-1, 0), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="for implementation 'pallas', which is not among"):
    jnn.Attention(32, 4, implementation="xla_chunked", config=jflash.PallasConfig(),
                  rngs=nnx.Rngs(0))
  attn = jnn.Attention(32, 4, implementation="xla_chunked", use_rope=False,
                       config=jflash.ChunkedConfig(4), rngs=nnx.Rngs(0))
  x = _x((1, 10, 32))
  q, k, v = attn.query(x), attn.key(x), attn.value(x)
  want = attn.out(jflash.attention(q, k, v, is_causal=True, implementation="xla"))
  np.testing.assert_allclose(attn(x), want, atol=1e-5, rtol=1e-5)


def test_lm_config_validates():
  with pytest.raises(ValueError, match="num_kv_heads"):
    jnn.LMConfig(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="divisible"):
    jnn.LMConfig(hidden=30, num_heads=4)


def test_lm_remat_and_layer_loop_match_scan():
  """remat changes memory, not math; the scanned and the unrolled stacks agree."""
  from experiments.lm_common import copy_batch, loss_fn
  cfg = jnn.LMConfig(vocab_size=16, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2,
                     seq_len=32, attention_implementation="xla_chunked")
  x, y, w = copy_batch(np.random.default_rng(0), 2, 32, 16)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)
  results = []
  for c in (cfg, dataclasses.replace(cfg, remat=True)):
    graphdef, params = nnx.split(jnn.DecoderLM(c, rngs=nnx.Rngs(0)), nnx.Param)
    results.append(grad_fn(params, graphdef, x, y, w))
  (l0, g0), (l1, g1) = results
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
  # Unrolled: copy the stacked weights of layer i into block i, then compare the loss.
  scan = jnn.DecoderLM(cfg, rngs=nnx.Rngs(0))
  loop = jnn.DecoderLM(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(1))
  nnx.update(loop.embed, nnx.state(scan.embed))
  nnx.update(loop.norm, nnx.state(scan.norm))
  stacked = nnx.state(scan.blocks)
  for i, block in enumerate(loop.blocks):
    nnx.update(block, jax.tree_util.tree_map(lambda a: a[i], stacked))
  graphdef, params = nnx.split(loop, nnx.Param)
  loss = jax.jit(loss_fn, static_argnums=1)(params, graphdef, x, y, w)
  np.testing.assert_allclose(loss, l0, rtol=1e-5)


def test_lm_learns_long_range_copy():
  """Loss on the copied half falls far below chance (ln 16 = 2.77) in 100 CPU steps."""
  from experiments.lm_common import copy_batch, init_model, make_optimizer, make_train_step
  cfg = jnn.LMConfig(vocab_size=16, num_layers=2, hidden=64, num_heads=4, seq_len=64,
                     attention_implementation="xla_chunked")
  graphdef, params = init_model(cfg, seed=0)
  tx = make_optimizer(3e-3, 100, 15)
  opt_state = tx.init(params)
  step = make_train_step(graphdef, tx)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(100):
    params, opt_state, loss = step(params, opt_state, *copy_batch(rng, 16, 64, 16))
    losses.append(float(loss))
  chance = math.log(16)
  assert abs(losses[0] - chance) < 0.5, f"initial loss {losses[0]:.3f} should be ~chance {chance:.3f}"
  assert np.mean(losses[-10:]) < 0.25 * chance, f"last losses {losses[-10:]}"
