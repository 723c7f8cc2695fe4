"""Pieces shared by the forward and backward kernels."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

try:  # jax >= 0.7 names it CompilerParams; older releases TritonCompilerParams
  from jax.experimental.pallas.triton import CompilerParams as _TritonParams
except ImportError:  # pragma: no cover - depends on the installed jax
  from jax.experimental.pallas.triton import TritonCompilerParams as _TritonParams

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)): exp2 is the native instruction
LN2 = math.log(2.0)


def triton_params(num_warps: int, num_stages: int):
  return _TritonParams(num_warps=num_warps, num_stages=num_stages)


def use_interpret(interpret: bool | None) -> bool:
  """Compile through Triton on a GPU; everywhere else run the kernel interpreted."""
  if interpret is not None:
    return interpret
  return jax.default_backend() != "gpu"


def acc_dtype(dtype):
  """float32 statistics and accumulators (float64 only for float64 inputs)."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def dot_precision(dtype):
  # float32 inputs ask for full-precision products: Triton would otherwise use TF32
  # (10-bit mantissa), an error well above a plain float32 implementation's.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) in (jnp.float32, jnp.float64) else None


def dot(a, b, *, trans_b: bool = False, acc=jnp.float32, precision=None):
  if trans_b:
    b = b.T
  return jnp.dot(a, b, preferred_element_type=acc, precision=precision)


def fit_block(block: int, n: int) -> int:
  """The tile actually used along a length-n axis: no larger than n rounded up to a
  power of two (>= 16, the smallest tile tl.dot accepts)."""
  return min(block, max(16, 1 << (n - 1).bit_length()))


def pad_to(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def pad_tiles(x, seq: int, head_dim: int):
  """[B, L, heads, H] zero-padded to [B, seq, heads, head_dim] (whole tiles)."""
  return pad_to(pad_to(x, 3, head_dim), 1, seq)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m
