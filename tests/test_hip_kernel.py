"""The forward kernel's numbers against the float64 truth.

Two runners share one grid: "emulated" runs the kernel source on CPU fibers (g++,
hip_ffi/emulate.py; always here), "device" runs it through the FFI custom call on a
ROCm or CUDA device (skipped without one; experiments/hip_check.py runs the same
grid, larger, on the H200).

Tolerance rule (as tests/attention_test_base.py): the kernel's max error against
`jflash.attention_numpy` (float64) is at most twice the error of the plain fp16
implementation `jflash.attention_xla` against the same truth, plus a floor of one
fp16 ulp of the largest output (2**-10 * max|out|): the kernel rounds P and O to
fp16 once each, and for degenerate inputs (all-equal) the plain error is ~0. lse
uses the base's float32 floor, a few roundings of a length-H dot product.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hip_ffi
import jflash
from hip_ffi import build
from tests.attention_test_base import floor

# (B, T, S, N, K, H): T, S in 1, 97, 113, 203, 257; T != S both ways; GQA and MQA.
SHAPES = [
    (1, 1, 1, 2, 1, 64),
    (2, 97, 97, 2, 2, 64),
    (1, 113, 203, 4, 2, 64),
    (1, 203, 113, 4, 1, 128),
    (1, 257, 257, 2, 1, 128),
    (1, 1, 257, 2, 2, 64),
    (1, 257, 1, 2, 2, 128),
    (1, 97, 257, 2, 1, 128),
]


@pytest.fixture(scope="module", params=["emulated", "device"])
def runner(request):
  if request.param == "emulated":
    if build.compiler("emulate") is None:
      pytest.skip("no C++ compiler (g++, c++ or clang++) for the CPU emulation")
    from hip_ffi import emulate
    return emulate.flash_forward
  platform = next(iter(hip_ffi.device_platforms()), None)
  if platform is None:
    pytest.skip("no CUDA or ROCm device")  # the device runner needs a GPU
  if build.compiler(platform) is None:
    pytest.skip(f"no compiler for {platform}")
  build.build(platform)
  assert platform in hip_ffi.register(), hip_ffi.load_errors()

  def run(q, k, v, *, scale, is_causal, tile=0):
    bq, bk, _ = hip_ffi.tile_table()[q.shape[-1]][tile]
    out, lse = jflash.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=scale,
                                is_causal=is_causal, implementation="hip",
                                block_sizes=jflash.BlockSizes(bq, bk), return_residuals=True)
    return np.asarray(out), np.asarray(lse)
  return run


def qkv(shape, seed=0):
  B, T, S, N, K, H = shape
  r = np.random.default_rng(seed)
  return (r.standard_normal((B, T, N, H)).astype(np.float16),
          r.standard_normal((B, S, K, H)).astype(np.float16),
          r.standard_normal((B, S, K, H)).astype(np.float16))


# One compile per shape instead of one per op (the plain reference dominates test time).
_plain = jax.jit(jflash.attention_xla, static_argnames=("scale", "is_causal"))


def check(runner, q, k, v, scale, is_causal, tile=0):
  out, lse = runner(q, k, v, scale=scale, is_causal=is_causal, tile=tile)
  ref_o, ref_l = jflash.attention_numpy(q, k, v, scale=scale, is_causal=is_causal)
  xo, xl = _plain(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=float(scale),
                  is_causal=is_causal)
  assert out.dtype == np.float16 and lse.dtype == np.float32
  assert np.isfinite(out).all() and np.isfinite(lse).all()
  err = lambda x, ref: float(np.abs(np.asarray(x, np.float64) - ref).max())
  o_bound = 2 * err(xo, ref_o) + 2.0**-10 * max(1.0, float(np.abs(ref_o).max()))
  l_bound = 2 * err(xl, ref_l) + floor(jnp.float32, ref_l, q.shape[-1])
  assert err(out, ref_o) <= o_bound, f"out error {err(out, ref_o):.3g} > {o_bound:.3g}"
  assert err(lse, ref_l) <= l_bound, f"lse error {err(lse, ref_l):.3g} > {l_bound:.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_awkward_shapes(runner, shape, is_causal):
  q, k, v = qkv(shape)
  check(runner, q, k, v, 1 / np.sqrt(shape[-1]), is_causal)


@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_second_tile(runner, H, is_causal):
  q, k, v = qkv((1, 203, 113, 2, 1, H), seed=1)
  check(runner, q, k, v, 1 / np.sqrt(H), is_causal, tile=1)


@pytest.mark.parametrize("is_causal", [False, True])
def test_all_equal_inputs(runner, is_causal):
  # Every logit equal: out = v exactly, lse = logit + log(visible keys).
  x = np.full((1, 130, 2, 64), 0.5, np.float16)
  check(runner, x, x[:, :, :1], x[:, :, :1], 0.125, is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_logits_of_1e4(runner, is_causal):
  # Near one-hot softmax rows; exp() of un-shifted logits would overflow.
  q, k, v = qkv((1, 97, 113, 2, 1, 64), seed=2)
  s = np.einsum("btnh,bsh->bnts", q.astype(np.float64), k[:, :, 0].astype(np.float64))
  check(runner, q, k, v, 1e4 / np.abs(s).max(), is_causal)


def test_long_rows(runner):
  # 4096 keys on the CPU emulation (seconds); hip_check.py runs 16K on the GPU.
  q, k, v = qkv((1, 3, 4096, 1, 1, 64), seed=3)
  check(runner, q, k, v, 0.125, False)


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
  bad_lse = jax.ShapeDtypeStruct((1, 2, 9), jnp.float32)  # T is 8
  call = jax.ffi.ffi_call(hip_ffi.TARGET_NAME,
                          (jax.ShapeDtypeStruct(q.shape, q.dtype), bad_lse))
  with pytest.raises(Exception, match="lse"):
    jax.block_until_ready(call(q, q, q, scale=np.float32(0.125), is_causal=np.bool_(False),
                               tile=np.int32(0)))
  with pytest.raises(Exception, match="tile"):
    jax.block_until_ready(jax.ffi.ffi_call(
        hip_ffi.TARGET_NAME, (jax.ShapeDtypeStruct(q.shape, q.dtype),
                              jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)))(
        q, q, q, scale=np.float32(0.125), is_causal=np.bool_(False), tile=np.int32(9)))
