"""Input checks and implementation dispatch of jflash.attention."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jflash
from jflash import api
from jflash.platforms import device_capability
from tests.attention_test_base import floor, max_err, reduction_length


def qkv(B=1, T=8, S=8, N=2, K=2, H=16, dtype=jnp.float32):
  r = np.random.default_rng(0)
  return (jnp.asarray(r.standard_normal((B, T, N, H)), dtype),
          jnp.asarray(r.standard_normal((B, S, K, H)), dtype),
          jnp.asarray(r.standard_normal((B, S, K, H)), dtype))


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q[0], k, v), r"query must have rank 4.*\(8, 2, 16\)"),
    (lambda q, k, v: (q, k[..., None], v), r"key must have rank 4"),
    (lambda q, k, v: (q, k, v[:, :5]), r"key and value must have the same shape.*\(1, 5, 2, 16\)"),
    (lambda q, k, v: (jnp.concatenate([q, q]), k, v), r"batch mismatch: query has 2, key/value have 1"),
    (lambda q, k, v: (q[..., :8], k, v), r"head_dim mismatch: query has 8, key/value have 16"),
    (lambda q, k, v: (jnp.concatenate([q, q[:, :, :1]], 2), k, v),
     r"query heads N=3 must be a multiple of key/value heads K=2"),
    (lambda q, k, v: (q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)),
     r"query.dtype=int32 is not supported"),
    (lambda q, k, v: (q, k.astype(jnp.bfloat16), v), r"share one dtype.*key.dtype=bfloat16"),
    (lambda q, k, v: (q[:, :, :0], k, v), r"heads length must be >= 1, got 0"),
    (lambda q, k, v: (np.zeros((1, 2, 3)), k, v), r"query must have rank 4"),
    (lambda q, k, v: ([1.0], k, v), r"query must be an array, got list"),
])
def test_bad_input_raises_value_error(bad, match):
  with pytest.raises(ValueError, match=match):
    jflash.attention(*bad(*qkv()))


@pytest.mark.parametrize("kwargs,match", [
    ({"implementation": "flash3"}, r"implementation='flash3' is unknown"),
    ({"implementation": ("xla_chunked", "nope")}, r"implementation='nope' is unknown"),
    ({"implementation": 3}, r"implementation must be None, a name or a sequence"),
    ({"scale": float("nan")}, r"scale must be finite, got scale=nan"),
    ({"scale": "big"}, r"scale must be a Python number"),
    ({"is_causal": 1}, r"is_causal must be a bool, got 1"),
    ({"config": (64, 64)}, r"config must be a jflash.config backend config"),
    ({"config": jflash.PallasConfig(), "implementation": "xla_chunked"},
     r"config=PallasConfig\(.*\) is for implementation 'pallas', which is not among the "
     r"candidate implementations \('xla_chunked',\)"),
    ({"local_window_size": 2**40}, r"local_window_size=1099511627776 must be <= 2147483647"),
    ({"config": jflash.HipConfig(), "implementation": ("pallas", "xla")}, r"'hip'"),
    ({"config": (jflash.ChunkedConfig(64), jflash.ChunkedConfig(32)),
      "implementation": "xla_chunked"}, r"two configs for backend 'xla_chunked'"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.float32(3)}, r"dropout_rng must be one PRNG key"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.zeros((3,), jnp.uint32)}, r"dropout_rng"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.split(jax.random.key(0))}, r"dropout_rng"),
    ({"dropout_rate": 0.1, "dropout_rng": 0},
     r"dropout_rng must be one PRNG key .*got 0 of type int"),
    ({"dropout_rng": 0}, r"dropout_rng must be one PRNG key .*got 0 of type int"),
])
def test_bad_options_raise_value_error(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jflash.attention(*qkv(), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"block_q": 48}, r"block_q=48 must be a power of two >= 16"),
    ({"block_k_dq": 8}, r"block_k_dq=8 must be a power of two >= 16"),
    ({"num_warps": 0}, r"num_warps=0 must be a positive int"),
    ({"num_stages_dq": 1.5}, r"num_stages_dq=1.5 must be a positive int"),
])
def test_bad_pallas_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jflash.PallasConfig(**kwargs)


@pytest.mark.parametrize("make,match", [
    (lambda: jflash.ChunkedConfig(0), r"block_k=0 must be a positive int"),
    (lambda: jflash.ChunkedConfig(None), r"block_k=None must be a positive int"),
    (lambda: jflash.HipConfig(block_q=64), r"must both be set"),
    (lambda: jflash.HipConfig(0, 64), r"block_q=0 must be a positive int"),
])
def test_bad_backend_configs(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_config_tunes_only_its_own_implementation():
  # A fallback chain takes one config per backend; each reaches only its implementation.
  q, k, v = qkv(T=40, S=40)
  want, _ = jflash.attention_numpy(q, k, v, is_causal=True)
  both = (jflash.PallasConfig(16, 16, 16, 16, 16, 16), jflash.ChunkedConfig(16))
  got = jflash.attention(q, k, v, is_causal=True, implementation=("xla_chunked", "pallas"),
                         config=both)
  plain = jflash.attention(q, k, v, is_causal=True, implementation="xla")
  assert max_err(got, want) <= 2 * max_err(plain, want) + floor(jnp.float32, want, 40)
  # With implementation=None the candidates depend on the device, so a config for any
  # implementation is valid everywhere (a GPU tuning runs unchanged on a CPU).
  anywhere = jflash.attention(q, k, v, is_causal=True, config=both[0])
  assert max_err(anywhere, want) <= 2 * max_err(plain, want) + floor(jnp.float32, want, 40)
  cfg, _ = jflash.prepare(q, k, v, implementation="xla_chunked", config=both[1])
  assert cfg.backend_config(jflash.ChunkedConfig) == both[1]
  assert cfg.backend_config(jflash.PallasConfig) is None


def test_prepare_is_the_validation_of_attention():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="implementation='flash' is unknown"):
    jflash.prepare(q, k, v, implementation="flash")
  cfg, masks = jflash.prepare(q, k, v, is_causal=True, local_window_size=3,
                              logits_soft_cap=5, scale=0.5)
  assert cfg == jflash.AttentionConfig(scale=0.5)
  assert masks == jflash.Masks(is_causal=True, window=(3, 3), soft_cap=5.0)
  assert masks.in_use() == ("is_causal", "window", "soft_cap")
  with pytest.raises(ValueError, match="local_window_size"):
    jflash.prepare(q, k, v, local_window_size=-1)


def test_options_are_the_keywords_of_attention():
  # jflash.nn checks option names against api.OPTIONS (no signature reading at run time).
  import inspect
  params = inspect.signature(jflash.attention).parameters
  assert api.OPTIONS == frozenset(params) - {"query", "key", "value"}


def test_launch_params_precedence():
  """Per-kernel values win over num_warps/num_stages, which win over the table."""
  from pallas_kernels.tuning import _TABLE, launch_params
  table = {kernel: _TABLE[64][kernel][2:] for kernel in ("fwd", "dkv", "dq")}
  from pallas_kernels.tuning import BlockSizes
  plain = BlockSizes()
  assert [launch_params(64, plain, kn) for kn in ("fwd", "dkv", "dq")] == list(table.values())
  both = BlockSizes(num_warps=2, num_stages=5)
  assert launch_params(48, both, "dkv") == (2, 5)  # 48 pads to 64
  own = BlockSizes(num_warps=2, num_warps_dq=8, num_stages_dkv=1)
  assert launch_params(64, own, "dq") == (8, table["dq"][1])
  assert launch_params(64, own, "dkv") == (2, 1)
  assert launch_params(64, own, "fwd") == (2, table["fwd"][1])
  with pytest.raises(ValueError, match="kernel='bwd' is not one of"):
    launch_params(64, plain, "bwd")


def test_every_built_in_implementation_is_available():
  # What implementation=None tries on this device: tests/test_registry.py.
  assert set(jflash.available_implementations()) >= {
      "xla", "xla_chunked", "pallas", "pallas_decode", "mosaic_gpu", "hip", "cudnn"}


def test_sequence_falls_back_only_on_not_implemented(monkeypatch):
  def refuse(q, k, v, cfg, masks):
    raise NotImplementedError("refuses everything")

  api.register_implementation("refuser", lambda: api.Implementation(
      "refuser", direct=lambda *a: None, supports=refuse))
  try:
    q, k, v = qkv()
    out = jflash.attention(q, k, v, implementation=("refuser", "xla"))
    np.testing.assert_allclose(out, jflash.attention(q, k, v, implementation="xla"))
    with pytest.raises(NotImplementedError, match="refuser: refuses everything"):
      jflash.attention(q, k, v, implementation="refuser")
  finally:
    api.unregister_implementation("refuser")


def test_scale_default_and_explicit():
  q, k, v = qkv()
  a = jflash.attention(q, k, v, implementation="xla_chunked")
  b = jflash.attention(q, k, v, implementation="xla_chunked", scale=1 / 4.0)
  c = jflash.attention(q, k, v, implementation="xla_chunked", scale=0.5)
  np.testing.assert_array_equal(a, b)
  want, _ = jflash.attention_numpy(q, k, v, scale=0.5)
  plain = jflash.attention(q, k, v, implementation="xla", scale=0.5)
  bound = 2 * max_err(plain, want) + floor(jnp.float32, want, reduction_length(
      (1, 8, 8, 2, 2, 16), "out"))
  assert max_err(c, want) <= bound, (max_err(c, want), bound)


def test_residuals_are_exactly_q_k_v_out_lse():
  # The custom_vjp keeps only (q, k, v, out, lse): nothing of size T x S.
  q, k, v = qkv(T=64, S=64)
  f = lambda q, k, v: jflash.attention(q, k, v, implementation="xla_chunked")
  _, vjp = jax.vjp(f, q, k, v)
  res = [x for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "shape")]
  shapes = sorted(tuple(x.shape) for x in res)
  assert shapes == sorted([q.shape, k.shape, v.shape, q.shape, (1, 2, 64)]), shapes


def test_head_dim_limits_per_implementation():
  # The README's table: "xla" and "xla_chunked" take any head_dim >= 1, "pallas" up to
  # 256 (a NotImplementedError from the implementation that cannot, so a sequence of
  # names moves on); head_dim 0 is an invalid value for all (ValueError).
  q, k, v = qkv(H=300)
  want, _ = jflash.attention_numpy(q, k, v)
  plain = jflash.attention(q, k, v, implementation="xla")
  bound = 2 * max_err(plain, want) + floor(jnp.float32, want, 300)
  assert max_err(jflash.attention(q, k, v, implementation="xla_chunked"), want) <= bound
  with pytest.raises(NotImplementedError, match="head_dim <= 256, got 300"):
    jflash.attention(q, k, v, implementation="pallas")
  assert max_err(jflash.attention(q, k, v, implementation=("pallas", "xla_chunked")),
                 want) <= bound
  for impl in ("xla", "xla_chunked", "pallas", "hip"):
    with pytest.raises(ValueError, match="head_dim length must be >= 1, got 0"):
      jflash.attention(*qkv(H=0), implementation=impl)


def test_hip_on_cpu_is_not_implemented():
  with pytest.raises(NotImplementedError):
    jflash.attention(*qkv(dtype=jnp.float16), implementation="hip")


_FORWARD_MODE = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "jit_jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "jit_jacfwd": lambda f, x: jax.jit(jax.jacfwd(f))(x),
    "linearize": lambda f, x: jax.linearize(f, x)[1](x),
    "check_grads_fwd": lambda f, x: check_grads(f, (x,), order=1, modes=["fwd"]),
}


@pytest.mark.parametrize("transform", sorted(_FORWARD_MODE))
@pytest.mark.parametrize("wrt", ["query", "bias"])
def test_forward_mode_names_jflash_and_the_way_out(transform, wrt):
  q, k, v = qkv(T=4, S=4, H=8)
  bias = jnp.zeros((1, 1, 4, 4))
  f = {"query": lambda q: jflash.attention(q, k, v, bias, implementation="xla_chunked"),
       "bias": lambda b: jflash.attention(q, k, v, b, implementation="xla_chunked")}[wrt]
  with pytest.raises(NotImplementedError, match=r"jflash.attention defines reverse-mode"
                     r"(.|\n)*use implementation='xla'"):
    _FORWARD_MODE[transform](f, q if wrt == "query" else bias)


def test_forward_mode_through_xla_and_reverse_mode_unchanged():
  # The way out works (checked against finite differences in float64), and the guard
  # the flash paths put on their inputs is the identity for reverse mode, also twice.
  with jax.enable_x64(True):
    q, k, v = qkv(T=5, S=6, H=4, dtype=jnp.float64)
    xla = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation="xla")
    check_grads(xla, (q, k, v), order=1, modes=["fwd"])
    chunked = lambda q, k, v: jflash.attention(q, k, v, is_causal=True,
                                               implementation="xla_chunked")
    check_grads(chunked, (q, k, v), order=2, modes=["rev"])


def test_row_the_masks_empty_is_zeros_where_jax_nn_gives_the_mean_of_v():
  # The documented difference from jax.nn (README, attention's docstring), with a bias:
  # row 2 of the mask hides every key.
  q, k, v = qkv(T=4, S=4, N=1, K=1)
  mask = jnp.ones((1, 1, 4, 4), bool).at[0, 0, 2, :].set(False)
  bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 4, 4)), jnp.float32)
  theirs = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
  np.testing.assert_allclose(theirs[0, 2, 0], v[0, :, 0].mean(0), atol=1e-6)
  for impl in ("xla", "xla_chunked"):
    ours = jflash.attention(q, k, v, bias, mask, implementation=impl)
    np.testing.assert_array_equal(ours[0, 2], 0)
    np.testing.assert_allclose(np.delete(ours, 2, 1), np.delete(theirs, 2, 1), atol=1e-6)


def test_cudnn_is_a_registered_implementation_in_the_chain():
  # jax.nn's cuDNN kernel: off a CUDA GPU it is refused with the reason, so a chain
  # moves on; on one, first in a chain, it runs as jax.nn's own cuDNN call.
  q, k, v = qkv(dtype=jnp.bfloat16)
  assert "cudnn" in jflash.available_implementations()
  if device_capability()[1] is None:
    with pytest.raises(NotImplementedError,
                       match=r"mosaic_gpu: .*; cudnn: cudnn needs a CUDA GPU"):
      jflash.attention(q, k, v, implementation=("mosaic_gpu", "cudnn"))
    got = jflash.attention(q, k, v, implementation=("mosaic_gpu", "cudnn", "xla_chunked"))
    want = jflash.attention(q, k, v, implementation="xla_chunked")
  else:
    got = jflash.attention(q, k, v, implementation=("cudnn", "xla_chunked"))
    want = jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_cudnn_refuses_what_it_lacks_on_a_gpu(monkeypatch):
  # On a (mocked) CUDA device: the options jax.nn does not pass to cuDNN and a
  # differentiable lse are NotImplementedError before anything is traced.
  from jflash import cudnn_impl
  monkeypatch.setattr(cudnn_impl, "device_capability", lambda device=None: ("gpu", "9.0"))
  q, k, v = qkv(dtype=jnp.bfloat16)
  for kw, reason in (({"logits_soft_cap": 5.0}, "no soft_cap"),
                     ({"segment_ids": jnp.zeros((1, 8), jnp.int32)}, "no q_segment_ids"),
                     ({"local_window_size": (2, 2)}, "no right window"),
                     ({"return_residuals": True}, "no differentiable lse")):
    with pytest.raises(NotImplementedError, match=reason):
      jflash.attention(q, k, v, implementation="cudnn", **kw)
  with pytest.raises(NotImplementedError, match="float16 or bfloat16, got float32"):
    jflash.attention(*qkv(), implementation="cudnn")


def test_an_implementation_reading_stacks_must_keep_padding_out():
  with pytest.raises(ValueError, match="forward_stacked needs masks_padding"):
    api.Implementation("stacked", forward_stacked=lambda *a: None)
