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


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


# -- the tile schedule --------------------------------------------------------------
# Shared by the kernels (with traced block indices) and by `key_block_schedule` (with
# Python ints), so a test can count exactly the tiles a kernel visits.

def _div(a, b):
  return lax.div(a, jnp.asarray(b, a.dtype)) if isinstance(a, jax.Array) else a // b


def _traced(*xs):
  return any(isinstance(x, jax.Array) for x in xs)


def _min(a, b):
  return jnp.minimum(a, b) if _traced(a, b) else min(a, b)


def _max(a, b):
  return jnp.maximum(a, b) if _traced(a, b) else max(a, b)


def kv_range(i, *, block_q, block_k, num_k_blocks, kv_len, is_causal):
  """Key blocks a query block visits: [0, n_full) need no mask, [n_full, hi) do.

  Causal (top-left aligned): key block j is entirely visible to query block i when
  its last column (j + 1) * bk - 1 <= i * bq, and entirely hidden when j * bk > the
  block's last row, so blocks past `hi` are skipped without being loaded. The last
  block is masked when kv_len is not a multiple of the tile.
  """
  hi = num_k_blocks
  n_full = kv_len // block_k
  if is_causal:
    hi = _min(hi, _div((i + 1) * block_q + block_k - 1, block_k))
    n_full = _min(n_full, _div(i * block_q + 1, block_k))
  return _min(n_full, hi), hi


def q_range(j, *, block_q, block_k, num_q_blocks, is_causal):
  """Query blocks a key block meets in the dK/dV kernel: [lo, n_mask) are boundary
  tiles, [n_mask, num_q_blocks) are fully visible."""
  if not is_causal:
    return 0, 0
  lo = _div(j * block_k, block_q)
  n_mask = _div((j + 1) * block_k - 1 + block_q - 1, block_q)
  return lo, _max(lo, _min(n_mask, num_q_blocks))


def key_block_schedule(T, S, *, block_q, block_k, is_causal):
  """Per query block (n_unmasked, n_boundary) key tiles, for tests and reports."""
  bq, bk = fit_block(block_q, T), fit_block(block_k, S)
  nk = round_up(S, bk) // bk
  rows = []
  for i in range(round_up(T, bq) // bq):
    n_full, hi = kv_range(i, block_q=bq, block_k=bk, num_k_blocks=nk, kv_len=S,
                          is_causal=is_causal)
    rows.append((n_full, hi - n_full))
  return rows
