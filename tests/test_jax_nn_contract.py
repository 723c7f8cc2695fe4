"""jflash.attention beside jax.nn.dot_product_attention over jax.nn's contract, for every
implementation that runs on a CPU: "xla", "xla_chunked", "pallas" and
"pallas_decode" (interpreted), "mosaic_gpu" (Mosaic GPU's interpreter, the Hopper check bypassed) and "hip" (its CPU
emulation). Unbatched inputs and vmap, bias and mask of any broadcastable shape,
`jax_numpy_rank_promotion="raise"`, `jax.debug_infs`, empty inputs, a scale given as an
array, and the errors.

Values follow the suite's rule: jflash's error against the float64 truth is at most
twice jax.nn's error against it (jax.nn is the plain same-dtype implementation here),
plus the floor. Masks here leave every query row a visible key: a row the masks
empty is the one documented difference in values (zeros in jflash, the mean of the
values in jax.nn; tests/test_api.py).
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hip_ffi
import jflash
from hip_ffi import build
from jflash import api, mosaic_impl
from jflash.platforms import device_capability
from tests.attention_test_base import floor, max_err

B, T, S, N, K = 2, 9, 12, 4, 2
# Per implementation: the dtype and head dim it computes in (the Hopper and MI50
# kernels take half precision and head dims from 64), and whether it takes a dense
# bias and mask.
PROFILES = {
    "xla": (jnp.float32, 16, True),
    "xla_chunked": (jnp.float32, 16, True),
    "pallas": (jnp.float32, 16, True),
    "pallas_decode": (jnp.float32, 16, False),
    "mosaic_gpu": (jnp.bfloat16, 64, False),
    "hip": (jnp.float16, 64, False),
}
DENSE = [name for name, p in PROFILES.items() if p[2]]
# Small tiles, so the 9 x 12 problem spans several of them.
CONFIGS = {"xla_chunked": jflash.ChunkedConfig(4),
           "pallas": jflash.PallasConfig(16, 16, 16, 16, 16, 16)}


@pytest.fixture(params=list(PROFILES))
def impl(request, monkeypatch):
  """An implementation name, with what makes it run on this CPU in place."""
  name = request.param
  if name == "mosaic_gpu":   # its forward runs under Mosaic GPU's interpreter off the GPU
    monkeypatch.setattr(mosaic_impl, "device_capability", lambda device=None: ("gpu", "9.0"))
  ctx = contextlib.nullcontext()
  if name == "hip":
    if build.compiler("emulate") is None:
      pytest.skip("no C++ compiler (g++, c++ or clang++) for hip's CPU emulation")
    ctx = hip_ffi.emulated()
  with ctx:
    yield name


def ours(impl, *args, **kw):
  return jflash.attention(*args, implementation=impl, config=CONFIGS.get(impl), **kw)


def inputs(impl, batch=(B,), T=T, S=S, seed=0):
  dtype, H, _ = PROFILES[impl]
  r = np.random.default_rng(seed)
  make = lambda *shape, scale=1.0: jnp.asarray(r.standard_normal(shape) * scale, dtype)
  return (make(*batch, T, N, H), make(*batch, S, K, H), make(*batch, S, K, H),
          make(*batch, T, N, H))


def truth(q, k, v, do, **kw):
  """float64 (out, lse, dq, dk, dv[, dbias]) for batched [B, T, N, H] inputs."""
  f64 = lambda x: None if x is None else np.asarray(x, np.float64)
  return jflash.attention_numpy(f64(q), f64(k), f64(v), dout=f64(do), **kw)


def assert_rule(got, theirs, ref, dtype, what, length):
  err, err_theirs = max_err(got, ref), max_err(theirs, ref)
  assert np.all(np.isfinite(np.asarray(got, np.float64))), f"{what}: non-finite values"
  assert err <= 2 * err_theirs + floor(dtype, ref, length), (
      f"{what}: error {err:.3g} > 2 x jax.nn's {err_theirs:.3g} + floor")


def grads(fn, args, do):
  out, vjp = jax.vjp(fn, *args)
  return (out, *vjp(do))


# -- unbatched [T, N, H] and vmap ----------------------------------------------------------

def test_unbatched_and_vmapped_like_jax_nn(impl):
  q, k, v, do = inputs(impl)
  dtype = q.dtype
  ref = truth(q, k, v, do, is_causal=True)
  # One unbatched call: out [T, N, H] as jax.nn, lse [N, T] (jax.nn's residual: [T, N]).
  out, lse = ours(impl, q[1], k[1], v[1], is_causal=True, return_residuals=True)
  theirs, their_lse = jax.nn.dot_product_attention(q[1], k[1], v[1], is_causal=True,
                                                   return_residual=True)
  assert out.shape == theirs.shape == q.shape[1:] and out.dtype == theirs.dtype == dtype
  assert lse.shape == their_lse.T.shape == (N, T)
  assert_rule(out, theirs, ref[0][1], dtype, "out", S)
  assert_rule(lse, their_lse.T, ref[1][1], dtype, "lse", S)
  # jax.vmap over the batch of unbatched calls, differentiated.
  mapped = lambda f: jax.vmap(lambda q, k, v: f(q, k, v, is_causal=True))
  got = grads(mapped(lambda *a, **kw: ours(impl, *a, **kw)), (q, k, v), do)
  want = grads(mapped(jax.nn.dot_product_attention), (q, k, v), do)
  for name, g, w, r in zip(("out", "dq", "dk", "dv"), got, want, (ref[0], *ref[2:])):
    assert g.shape == w.shape and g.dtype == w.dtype
    assert_rule(g, w, r, dtype, name, max(S, T * N // K))


def test_unbatched_takes_per_batch_options_without_their_batch_axis():
  # Lengths [] and segment ids [T] (what vmap over the batch hands each call), or with a
  # batch of one ([1], [1, T]).
  q, k, v, _ = inputs("xla_chunked", T=S)
  ids = jnp.asarray(np.repeat([0, 1, 2], 4)[None].repeat(B, 0), jnp.int32)
  lengths = jnp.asarray([7, 12], jnp.int32)
  want = truth(q, k, v, None, segment_ids=np.asarray(ids),
               key_value_seq_lengths=np.asarray(lengths))[0]
  plain = ours("xla", q, k, v, segment_ids=ids, key_value_seq_lengths=lengths)
  mapped = jax.vmap(lambda q, k, v, ids, n: ours("xla_chunked", q, k, v, segment_ids=ids,
                                                 key_value_seq_lengths=n))
  assert_rule(mapped(q, k, v, ids, lengths), plain, want, q.dtype, "vmapped", S)
  one = ours("xla_chunked", q[0], k[0], v[0], segment_ids=ids[:1],
             key_value_seq_lengths=lengths[:1])
  assert_rule(one, plain[0], want[0], q.dtype, "batch of one", S)


# -- bias and mask of any shape that broadcasts to [B, N, T, S] -------------------------------

BROADCAST_SHAPES = [(T, S), (N, T, S), (B, 1, 1, S), (1, N, 1, S), (S,), (B, 1, T, 1),
                    (1, 1, 1, 1), (B, N, T, S)]


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=str)
def test_broadcast_bias_and_mask_like_jax_nn(impl, shape):
  q, k, v, do = inputs(impl, seed=1)
  r = np.random.default_rng(2)
  bias = jnp.asarray(r.standard_normal(shape), jnp.float32)
  # A mask that leaves every row a key: column 0 is kept (all keys where S is broadcast).
  keep = r.random(shape) > 0.3
  keep[..., 0] = True
  mask = jnp.asarray(keep)
  if not PROFILES[impl][2]:
    with pytest.raises(NotImplementedError, match=f"{impl}: .*(mask|bias)"):
      ours(impl, q, k, v, bias, mask)
    return
  ref = truth(q, k, v, do, bias=np.asarray(bias), mask=keep)   # NumPy broadcasts them
  # Full float32 products (XLA's default on NVIDIA GPUs is TF32-like): the flash
  # backward's delta = rowsum(dO * O) and its dP = dO V^T then agree to float32, so a
  # bias broadcast over the keys, whose exact gradient sum_j dS_ij cancels to zero (as
  # jax.nn's autodiff of softmax does), is checked to float32 as on a CPU.
  with jax.default_matmul_precision("highest"):
    got = grads(lambda q, k, v, b: ours(impl, q, k, v, b, mask), (q, k, v, bias), do)
    want = grads(lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, b, mask),
                 (q, k, v, bias), do)
  for name, g, w, r in zip(("out", "dq", "dk", "dv", "dbias"), got, want,
                           (ref[0], *ref[2:6])):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    length = B * N * T * S // max(1, int(np.prod(shape))) if name == "dbias" else S
    assert_rule(g, w, r, q.dtype, name, max(length, T * N // K))


@pytest.mark.parametrize("implementation, materialised", [
    ("xla", ()), ("xla_chunked", ()), ("pallas", ("T", "S"))])
def test_what_is_materialised(implementation, materialised):
  # "xla" and "xla_chunked" read a size-one axis as it is; the Pallas kernels read
  # size-one batch and head axes, and jflash.attention broadcasts T and S to full size
  # for them (a copy of [B|1, N|1, T, S]).
  impl = api.get_implementation(implementation)
  full = (B, N, T, S)
  x = jnp.zeros((1, 1, 1, S))
  widened = api.broadcast_dense(jflash.Masks(bias=x, mask=x > 0), impl.broadcast_axes, full)
  want = tuple(f if a in materialised else d for a, d, f in zip("BNTS", x.shape, full))
  assert widened.bias.shape == widened.mask.shape == want


# -- configuration flags many codebases set -----------------------------------------------------

def _options(impl):
  """Every option the implementation takes, with no row left without a key."""
  kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([7, 12], jnp.int32),
            query_seq_lengths=jnp.asarray([9, 5], jnp.int32))
  if impl != "pallas_decode":
    kw["local_window_size"] = (6, 0)
  if impl in DENSE:
    kw["bias"] = jnp.asarray(np.random.default_rng(3).standard_normal((B, 1, 1, S)),
                             jnp.float32)
    kw["mask"] = jnp.ones((1, N, T, 1), bool)
  if impl in ("xla", "xla_chunked", "pallas", "hip"):
    kw["segment_ids"] = (jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32))
    kw["logits_soft_cap"] = 20.0
  return kw


def test_rank_promotion_raise(impl):
  q, k, v, do = inputs(impl, seed=4)
  kw = _options(impl)
  run = lambda: grads(lambda q, k, v: ours(impl, q, k, v, **kw), (q, k, v), do)
  plain = run()
  with jax.numpy_rank_promotion("raise"):
    raised = run()
    jax.nn.dot_product_attention(q, k, v, is_causal=True)   # jax.nn runs under it too
  for a, b in zip(plain, raised):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_debug_infs_outside_jit(impl):
  if impl == "mosaic_gpu":
    pytest.skip("Mosaic GPU's interpreter runs the kernel's ops one by one, and its "
                "running max starts at -inf; on a GPU the kernel is one op")
  # Query lengths are left out: rows past them see no key, and their lse is -inf by
  # jflash's rule (attention's docstring), which debug_infs reports.
  q, k, v, do = inputs(impl, seed=5)
  kw = {n: x for n, x in _options(impl).items() if n != "query_seq_lengths"}
  with jax.debug_infs(True):
    got = grads(lambda q, k, v: ours(impl, q, k, v, **kw), (q, k, v), do)
    jax.nn.dot_product_attention(q, k, v, is_causal=True)
  want = grads(lambda q, k, v: ours(impl, q, k, v, **kw), (q, k, v), do)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# -- empty inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("empty", ["B", "T", "S"])
def test_empty_inputs_like_jax_nn(impl, empty):
  sizes = {**dict(B=B, T=T, S=S), empty: 0}
  q, k, v, do = inputs(impl, batch=(sizes["B"],), T=sizes["T"], S=sizes["S"])
  got = grads(lambda q, k, v: ours(impl, q, k, v, is_causal=True), (q, k, v), do)
  want = grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
               (q, k, v), do)
  for g, w in zip(got, want):   # empty, or zeros where S = 0 (no key: jax.nn's zeros too)
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
  out, lse = ours(impl, q, k, v, return_residuals=True)
  assert lse.shape == (sizes["B"], N, sizes["T"]) and np.all(np.isneginf(lse))


# -- scale given as an array ------------------------------------------------------------------

@pytest.mark.parametrize("scale", [jnp.float32(0.5), np.float64(0.5), jnp.asarray(0.5),
                                   np.asarray(0.5, np.float16), jnp.bfloat16(0.5)],
                         ids=lambda s: type(s).__name__ + str(getattr(s, "dtype", "")))
def test_scale_as_a_scalar_array(scale):
  q, k, v, _ = inputs("xla_chunked")
  cfg, _ = jflash.prepare(q, k, v, scale=scale)
  assert cfg.scale == 0.5 and type(cfg.scale) is float
  np.testing.assert_array_equal(ours("xla_chunked", q, k, v, scale=scale),
                                ours("xla_chunked", q, k, v, scale=0.5))
  theirs = jax.nn.dot_product_attention(q, k, v, scale=scale)
  want = truth(q, k, v, np.zeros(q.shape), scale=0.5)[0]
  assert_rule(ours("xla_chunked", q, k, v, scale=scale), theirs, want, q.dtype, "out", S)


def test_traced_scale_is_a_clear_error():
  # The scale is compiled into the kernels: under jit it must be static.
  q, k, v, _ = inputs("xla_chunked")
  with pytest.raises(ValueError, match="scale must be a concrete number .*traced"):
    jax.jit(lambda q, s: ours("xla_chunked", q, k, v, scale=s))(q, 0.5)
  static = jax.jit(lambda q, s: ours("xla_chunked", q, k, v, scale=s), static_argnums=1)
  np.testing.assert_array_equal(static(q, 0.5), ours("xla_chunked", q, k, v, scale=0.5))
  with pytest.raises(ValueError, match=r"scale must be .* scalar array"):
    ours("xla_chunked", q, k, v, scale=jnp.ones(2))


# -- errors: jflash raises where jax.nn raises ---------------------------------------------

@pytest.mark.parametrize("change", [
    lambda q, k, v: dict(query=q[..., :8]),                       # head dims differ
    lambda q, k, v: dict(query=q[:, :, :3]),                      # N not a multiple of K
    lambda q, k, v: dict(mask=jnp.ones((T, S), jnp.float32)),     # mask not boolean
    lambda q, k, v: dict(bias=jnp.zeros((1, 1, 1, 1, S))),        # bias of rank 5
    lambda q, k, v: dict(implementation="flash"),                 # an unknown name
])
def test_errors_like_jax_nn(change):
  q, k, v, _ = inputs("xla_chunked")
  kw = {**dict(query=q, key=k, value=v), **change(q, k, v)}
  with pytest.raises(ValueError):
    jax.nn.dot_product_attention(**kw)
  kw.setdefault("implementation", "xla_chunked")
  with pytest.raises(ValueError):
    jflash.attention(**kw)


def test_cudnn_in_the_fallback_chain():
  # Off a CUDA GPU cudnn refuses with the reason, after mosaic_gpu's; on one it runs
  # first in a chain, as jax.nn's own cuDNN call.
  q, k, v, _ = inputs("mosaic_gpu")
  if device_capability()[1] is None:
    with pytest.raises(NotImplementedError, match="mosaic_gpu: .*; cudnn: cudnn needs a CUDA"):
      jflash.attention(q, k, v, implementation=("mosaic_gpu", "cudnn"))
    return
  got = jflash.attention(q, k, v, implementation=("cudnn", "xla_chunked"))
  want = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# -- the documented difference: the gradient through lse ------------------------------------

def test_lse_is_differentiated_where_jax_nn_stops_it():
  # d lse_i / d s_ij = P_ij: jflash's gradient through lse is that closed form (float64
  # truth of sum(lse) w.r.t. q: scale * P K), jax.nn's is zero (stop_gradient).
  q, k, v, _ = inputs("xla_chunked")
  f = lambda q: ours("xla_chunked", q, k, v, return_residuals=True)[1].sum()
  g = lambda q: jax.nn.dot_product_attention(q, k, v, return_residual=True)[1].sum()
  qd, kd = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), N // K, axis=2)
  scale = 1 / np.sqrt(q.shape[-1])
  s = np.einsum("btnh,bsnh->bnts", qd, kd) * scale
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  want = np.einsum("bnts,bsnh->btnh", p, kd) * scale
  plain = jax.grad(lambda q: ours("xla", q, k, v, return_residuals=True)[1].sum())(q)
  assert_rule(jax.grad(f)(q), plain, want, q.dtype, "dlse/dq", S)
  assert not np.any(np.asarray(jax.grad(g)(q)))
