"""The HIP kernels (forward, delta, dQ, dK/dV) against the float64 truth.

Two runners share the tests: "emulated" runs the kernel source on CPU fibers (g++,
hip_ffi/emulate.py, through `hip_ffi.emulated()`: the whole jflash path, ranges,
dtype handling, custom_vjp and vmap included; always here), "device" runs it through
the FFI custom calls on a ROCm or CUDA device (skipped without one;
experiments/hip_check.py runs the same checks, larger, on the H200).

Tolerance rule (tests/attention_test_base.py): the error of out, lse, dq, dk, dv
against `jflash.attention_numpy` (float64) is at most twice the error of the plain
same-dtype implementation (`implementation="xla"`) against the same truth, plus the
base's floor (two roundings to the dtype and a few float32 roundings of a length-H dot
product, times the largest reference value).
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
from jflash import hip_impl
from tests.attention_test_base import TransformationTests, floor, max_err, random_qkv

# (B, T, S, N, K, H): T, S span several tiles and clip the last; T != S both ways; GQA, MQA;
# every compiled head dim.
SHAPES = [
    (1, 1, 1, 2, 1, 64),
    (2, 97, 97, 2, 2, 64),
    (1, 70, 133, 4, 2, 64),
    (1, 133, 70, 4, 1, 128),
    (1, 1, 77, 2, 2, 128),
    (1, 77, 1, 2, 2, 64),
    (1, 70, 133, 4, 2, 96),
    (1, 133, 70, 4, 1, 80),
]
DTYPES = [jnp.float16, jnp.bfloat16]


@pytest.fixture(scope="module", params=["emulated", "device"])
def runner(request):
  """A context manager under which implementation="hip" runs the kernels."""
  if request.param == "emulated":
    if build.compiler("emulate") is None:
      pytest.skip("no C++ compiler (g++, c++ or clang++) for the CPU emulation")
    return hip_ffi.emulated
  platform = next(iter(hip_ffi.device_platforms()), None)
  if platform is None:
    pytest.skip("no CUDA or ROCm device")  # the device runner needs a GPU
  if build.compiler(platform) is None:
    pytest.skip(f"no compiler for {platform}")
  build.build(platform)
  assert platform in hip_ffi.register(), hip_ffi.load_errors()
  return contextlib.nullcontext


def fwd_bwd(fn, q, k, v, do):
  """(out, lse, dq, dk, dv) of `fn` (which returns (out, lse)), the cotangent on out."""
  def run(q, k, v, do):
    (out, lse), vjp = jax.vjp(fn, q, k, v)
    return (out, lse, *vjp((do, jnp.zeros_like(lse))))
  return jax.jit(run)(q, k, v, do)


def check(runner, q, k, v, do, config=None, **kw):
  """hip vs the float64 truth under the 2x rule, forward and gradients."""
  dtype = q.dtype
  with runner():
    got = fwd_bwd(lambda *a: jflash.attention(*a, implementation="hip", return_residuals=True,
                                              config=config, **kw), q, k, v, do)
  plain = fwd_bwd(lambda *a: jflash.attention(*a, implementation="xla", return_residuals=True,
                                              **kw), q, k, v, do)
  ref = jflash.attention_numpy(q, k, v, dout=do, **kw)
  H = q.shape[-1]
  for name, g, p, r in zip(("out", "lse", "dq", "dk", "dv"), got, plain, ref):
    assert g.dtype == (jnp.float32 if name == "lse" else dtype), name
    g, p = np.asarray(g, np.float64), np.asarray(p, np.float64)
    if name == "lse":  # rows that see no key: -inf in all three
      hidden = np.isneginf(r)
      assert np.array_equal(np.isneginf(g), hidden), "lse: -inf rows differ"
      g, p, r = g[~hidden], p[~hidden], r[~hidden]
    assert np.isfinite(g).all(), f"{name}: non-finite values"
    bound = 2 * max_err(p, r) + floor(jnp.float32 if name == "lse" else dtype, r, H)
    assert max_err(g, r) <= bound, f"{name}: error {max_err(g, r):.3g} > {bound:.3g}"
  return got


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_awkward_shapes_float16(runner, shape, is_causal):
  q, k, v, do = random_qkv(shape, jnp.float16)
  check(runner, q, k, v, do, is_causal=is_causal)


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_bfloat16(runner, shape, is_causal):
  q, k, v, do = random_qkv(shape, jnp.bfloat16, seed=1)
  check(runner, q, k, v, do, is_causal=is_causal)


def test_second_forward_tile(runner):
  for H in hip_ffi.head_dims():
    bq, bk, _ = hip_ffi.tile_table()[H][1]
    q, k, v, do = random_qkv((1, 100, 75, 2, 1, H), jnp.float16, seed=2)
    check(runner, q, k, v, do, is_causal=True, config=jflash.HipConfig(bq, bk))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kw", [
    dict(query_seq_lengths=np.array([50, 1], np.int32),
         key_value_seq_lengths=np.array([90, 33], np.int32)),
    dict(is_causal=True, local_window_size=(20, 0)),
    dict(local_window_size=(7, 30)),
    dict(segment_ids=np.repeat(np.array([[0] * 30 + [1] * 50 + [2] * 20,
                                         [5] * 100], np.int32), 1, 0)),
    dict(is_causal=True, key_value_seq_lengths=np.array([64, 100], np.int32),
         segment_ids=np.array([[0] * 64 + [1] * 36, [3] * 40 + [4] * 60], np.int32)),
    # A KV cache's new queries after its keys: query i of row b at i + kv_len - q_len.
    dict(is_causal=True, causal_alignment="bottom_right",
         query_seq_lengths=np.array([50, 1], np.int32),
         key_value_seq_lengths=np.array([90, 33], np.int32)),
    dict(is_causal=True, causal_alignment="bottom_right", local_window_size=(20, 0)),
], ids=["lengths", "causal-window", "window", "segments", "causal-lengths-segments",
        "bottom-right-lengths", "bottom-right-window"])
def test_masks(runner, dtype, kw):
  # Rows past a query length and rows whose window or segment leaves no key are zeros
  # (lse = -inf) with zero gradients, as in the reference.
  q, k, v, do = random_qkv((2, 100, 100, 2, 1, 64), dtype, seed=3)
  check(runner, q, k, v, do, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,kw", [
    ((2, 100, 100, 2, 1, 64), dict(logits_soft_cap=1.5)),
    ((1, 90, 110, 4, 2, 128), dict(logits_soft_cap=2.0, is_causal=True,
                                   local_window_size=(40, 0),
                                   key_value_seq_lengths=np.array([101], np.int32))),
], ids=["d64", "d128-gqa-causal-window-lengths"])
def test_soft_cap(runner, dtype, shape, kw):
  # A cap near the logits' own spread (random q, k: about N(0, 1) after the scale), so
  # tanh bends most of them; the gradients carry its slope 1 - tanh^2.
  q, k, v, do = random_qkv(shape, dtype, seed=11)
  check(runner, q, k, v, do, **kw)


@pytest.mark.parametrize("is_causal", [False, True])
def test_soft_cap_saturates_to_a_uniform_softmax(runner, is_causal):
  # Every logit scale q.k = 1e4 under a cap of 2 is 2 tanh(5e3) = 2 exactly: the softmax
  # is uniform over the visible keys, so out is their mean of v and lse = 2 +
  # log(count); the cap's slope 1 - tanh^2 is 0 there, so dq = dk = 0 exactly, and dv
  # gets each query's dO / count.
  T, N, H = 70, 2, 64
  q = jnp.full((1, T, N, H), 0.5, jnp.float16)
  k = jnp.full((1, T, 1, H), 0.5, jnp.float16)        # q.k = 16 for every pair
  _, _, v, do = random_qkv((1, T, T, N, 1, H), jnp.float16, seed=12)
  out, lse, dq, dk, dv = _hip_fwd_bwd(runner, q, k, v, do, scale=1e4 / 16,
                                      logits_soft_cap=2.0, is_causal=is_causal)
  sees = np.tril(np.ones((T, T))) if is_causal else np.ones((T, T))   # [query, key]
  count = sees.sum(1)
  v64, do64 = np.asarray(v, np.float64)[0, :, 0], np.asarray(do, np.float64)[0]
  want_out = (sees / count[:, None]) @ v64                           # [T, H], every head
  want_dv = np.einsum("ts,tnh->sh", sees / count[:, None], do64)     # heads share k, v
  assert max_err(out[0], np.broadcast_to(want_out[:, None], out[0].shape)) <= floor(
      jnp.float16, want_out, T)
  assert max_err(lse[0], np.broadcast_to(2 + np.log(count), lse[0].shape)) <= floor(
      jnp.float32, 2 + np.log(count), T)
  assert max_err(dv[0, :, 0], want_dv) <= floor(jnp.float16, want_dv, T * N)
  assert not dq.any() and not dk.any()


@pytest.mark.parametrize("H", [128, 96, 80])
def test_masks_head_dims_above_64_mqa(runner, H):
  q, k, v, do = random_qkv((1, 90, 110, 4, 1, H), jnp.float16, seed=4)
  check(runner, q, k, v, do, is_causal=True, local_window_size=(33, 5),
        key_value_seq_lengths=np.array([101], np.int32))


@pytest.mark.parametrize("is_causal", [False, True])
def test_all_equal_inputs(runner, is_causal):
  # Every logit equal: out = v exactly, lse = logit + log(visible keys).
  x = jnp.full((1, 130, 2, 64), 0.5, jnp.float16)
  do = jnp.full((1, 130, 2, 64), 0.25, jnp.float16)
  check(runner, x, x[:, :, :1], x[:, :, :1], do, scale=0.125, is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_logits_of_1e4(runner, is_causal):
  # Near one-hot softmax rows; exp() of un-shifted logits would overflow.
  q, k, v, do = random_qkv((1, 97, 113, 2, 1, 64), jnp.float16, seed=5)
  s = np.einsum("btnh,bsh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64)[:, :, 0])
  check(runner, q, k, v, do, scale=1e4 / np.abs(s).max(), is_causal=is_causal)


def test_long_rows(runner):
  # 4096 keys on the CPU emulation (seconds); hip_check.py runs 16K on the GPU.
  q, k, v, do = random_qkv((1, 3, 4096, 1, 1, 64), jnp.float16, seed=6)
  check(runner, q, k, v, do, scale=0.125)


# -- NaN semantics -------------------------------------------------------------------------

def _hip_fwd_bwd(runner, q, k, v, do, **kw):
  with runner():
    return [np.asarray(x, np.float32) for x in fwd_bwd(
        lambda *a: jflash.attention(*a, implementation="hip", return_residuals=True, **kw),
        q, k, v, do)]


@pytest.mark.parametrize("is_causal", [False, True])
def test_nan_in_a_visible_input_reaches_the_output(runner, is_causal):
  q, k, v, do = (np.array(x) for x in random_qkv((1, 70, 70, 2, 1, 64), jnp.float16, seed=7))
  q[0, 3, 0, 0] = np.nan  # query row 3 of head 0
  out, lse, dq, dk, dv = _hip_fwd_bwd(runner, q, k, v, do, is_causal=is_causal)
  assert np.isnan(out[0, 3, 0]).all() and np.isnan(lse[0, 0, 3])
  bad = np.zeros(out.shape, bool)
  bad[0, 3, 0] = True
  assert np.isfinite(out[~bad]).all() and np.isfinite(np.delete(lse[0, 0], 3)).all()
  assert np.isnan(dq[0, 3, 0]).all()
  seen = slice(0, 4) if is_causal else slice(None)  # keys row 3 sees
  assert np.isnan(dv[0, seen, 0]).any(axis=-1).all() and np.isnan(dk[0, seen, 0]).all()
  assert np.isfinite(np.delete(dq[0, :, 0], 3, axis=0)).all()  # other rows: finite

  k[0, 5, 0, 0] = np.nan  # key 5: every row that sees it
  q[0, 3, 0, 0] = 0
  out, *_ = _hip_fwd_bwd(runner, q, k, v, do, is_causal=is_causal)
  rows = np.arange(70) >= 5 if is_causal else np.ones(70, bool)
  assert np.isnan(out[0, rows]).all(axis=(-1, -2)).all()
  assert np.isfinite(out[0, ~rows]).all()


def test_inf_in_a_query_gives_nan_as_the_softmax_does(runner):
  q, k, v, do = (np.array(x) for x in random_qkv((1, 20, 20, 1, 1, 64), jnp.float16, seed=8))
  q[0, 2, 0, :] = np.inf
  out, lse, *_ = _hip_fwd_bwd(runner, q, k, v, do)
  want = np.asarray(jax.nn.dot_product_attention(q, k, v), np.float32)
  assert np.array_equal(np.isnan(out), np.isnan(want)) and np.isnan(out[0, 2]).all()


def test_rows_emptied_by_masks_are_zero_not_nan(runner):
  q, k, v, do = random_qkv((1, 40, 40, 1, 1, 64), jnp.float16, seed=9)
  seg = (np.array([[0] * 20 + [1] * 20], np.int32), np.array([[0] * 40], np.int32))
  out, lse, dq, dk, dv = _hip_fwd_bwd(runner, q, k, v, do, segment_ids=seg)
  assert (out[0, 20:] == 0).all() and np.isneginf(lse[0, 0, 20:]).all()
  assert (dq[0, 20:] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


# -- bfloat16 range and transformations ---------------------------------------------------

def _range_case():
  # bf16 values fp16 cannot hold: v of 1e5 (fp16 max 65504) and output gradients of
  # 1e-7 (fp16's smallest subnormal is 6e-8): typical of bf16 training without loss
  # scaling.
  q, k, v, do = random_qkv((1, 70, 70, 2, 1, 64), jnp.float32, seed=10)
  return (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), (v * 1e5).astype(jnp.bfloat16),
          (do * 1e-7).astype(jnp.bfloat16))


def test_bfloat16_outside_the_float16_range(runner):
  check(runner, *_range_case(), is_causal=True)


def test_bfloat16_range_fix_is_what_makes_it_work(monkeypatch):
  # Without the power-of-two scaling, the fp16 conversion turns v into inf and the
  # gradients into zeros: the rule above fails. (Emulated: the measurement behind
  # hip_impl's bf16 design.)
  if build.compiler("emulate") is None:
    pytest.skip("no C++ compiler for the CPU emulation")
  monkeypatch.setattr(hip_impl, "_pow2_exponent", lambda x: jnp.int32(0))
  with pytest.raises(AssertionError, match="non-finite values|error .* > "):
    check(hip_ffi.emulated, *_range_case(), is_causal=True)


def test_vmap(runner):
  q, k, v, do = random_qkv((3, 40, 50, 2, 1, 64), jnp.float16, seed=11)
  f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation="hip")
  with runner():
    mapped = jax.vmap(f)(q[:, None], k[:, None], v[:, None])[:, 0]
    loss = lambda q: jnp.sum(jax.vmap(f)(q, k[:, None], v[:, None]).astype(jnp.float32) ** 2)
    dq_mapped = jax.grad(loss)(q[:, None])[:, 0]
    eager = f(q, k, v)
    dq = jax.grad(lambda q: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2))(q)
  np.testing.assert_array_equal(np.asarray(mapped), np.asarray(eager))
  np.testing.assert_array_equal(np.asarray(dq_mapped), np.asarray(dq))


def test_handler_rejects_a_bad_call_with_an_error():
  # Bypass the Python checks: the C++ handler must answer with an ffi::Error.
  platform = next(iter(hip_ffi.device_platforms()), None)
  if platform is None:
    pytest.skip("no CUDA or ROCm device")  # the handler runs on the device only
  if build.compiler(platform) is None:
    pytest.skip(f"no compiler for {platform}")
  build.build(platform)
  hip_ffi.register()
  q = jnp.zeros((1, 8, 2, 64), jnp.float16)
  r = jnp.zeros((1, 1, 8), jnp.int32)
  seg = jnp.zeros((1, 1), jnp.int32)
  attrs = dict(scale=np.float32(0.125), is_causal=np.bool_(False), window_left=np.int32(-1),
               window_right=np.int32(-1), has_segments=np.bool_(False),
               soft_cap=np.float32(0.0))
  out = jax.ShapeDtypeStruct(q.shape, q.dtype)
  call = lambda lse_shape, tile, ranges: jax.ffi.ffi_call(
      hip_ffi.TARGET_NAME, (out, jax.ShapeDtypeStruct(lse_shape, jnp.float32)))(
      q, q, q, ranges, seg, seg, tile=np.int32(tile), **attrs)
  with pytest.raises(Exception, match="lse"):
    jax.block_until_ready(call((1, 2, 9), 0, r))  # T is 8
  with pytest.raises(Exception, match="tile"):
    jax.block_until_ready(call((1, 2, 8), 9, r))
  with pytest.raises(Exception, match="ranges"):
    jax.block_until_ready(call((1, 2, 8), 0, jnp.zeros((1, 3, 8), jnp.int32)))
  attrs["soft_cap"] = np.float32(-1.0)
  with pytest.raises(Exception, match="soft_cap"):
    jax.block_until_ready(call((1, 2, 8), 0, r))
  attrs["soft_cap"] = np.float32(0.0)
  q = jnp.zeros((1, 8, 2, 72), jnp.float16)        # no kernel compiled for head_dim 72
  with pytest.raises(Exception, match="64, 80, 96 or 128, got 72"):
    jax.block_until_ready(jax.ffi.ffi_call(hip_ffi.TARGET_NAME, (
        jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)))(
        q, q, q, r, seg, seg, tile=np.int32(0), **attrs))


def test_malformed_ranges_cannot_read_outside_the_arrays(runner):
  # The raw op takes the caller's tile table: values past the tile count or the lengths
  # are clamped in the kernel, so the call returns (what the clamped table says)
  # instead of reading out of bounds.
  from pallas_kernels.masking import MaskOperands, MaskOptions, build_ranges
  q, k, v, _ = random_qkv((1, 70, 90, 2, 1, 64), jnp.float16, seed=13)
  bq, bk, _ = hip_ffi.tile_table()[64][0]
  good = jnp.asarray(build_ranges(MaskOperands(), MaskOptions(), B=1, T=70, S=90,
                                  block_q=bq, block_k=bk))
  n = -(-90 // bk)
  bad = good.at[..., 0].set(-7).at[..., 1].set(-3).at[..., 2].set(10 * n).at[..., 3].set(
      10 * n).at[..., 4].set(1 << 30).at[..., 5].set(1 << 30)
  with runner():
    want = hip_ffi.flash_forward(q, k, v, good, scale=0.125, is_causal=False)
    got = hip_ffi.flash_forward(q, k, v, bad, scale=0.125, is_causal=False)
  # The clamped table visits every key tile with no element mask (so the zero-filled
  # rows of the clipped last tile count as keys: a wrong but bounded result).
  for g in got:
    assert np.isfinite(np.asarray(g, np.float32)).all()
  assert np.asarray(got[0]).shape == np.asarray(want[0]).shape


class TestHipTransformations(TransformationTests):
  """The shared test base's jit / vmap / bit-identical repeat / second-order tests,
  through the emulated runner here and the device runner where a GPU exists: float16
  and head_dim 64, what the kernels compute in."""

  implementation = "hip"
  transform_dtype = jnp.float16
  transform_head_dim = 64
  second_order = False   # the kernels have no derivative of their own

  @pytest.fixture(autouse=True)
  def _run_under(self, runner):
    with runner():   # the whole test: forward and backward are traced inside
      yield
