"""Pieces shared by the forward and backward kernels."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)): exp2 is the native instruction
LN2 = math.log(2.0)


def triton_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def use_interpret(interpret: bool | None) -> bool:
  """Compile through Triton on a GPU; everywhere else run the kernel interpreted."""
  if interpret is not None:
    return interpret
  return jax.default_backend() != "gpu"


def fast_exp2_enabled(interpret: bool) -> bool:
  """Whether compiled kernels take exp2 from the bare `ex2.approx.ftz.f32` instruction.

  Pallas lowers exp2 to libdevice's `__nv_exp2f`, which XLA links without the
  flush-to-zero reflection, so every call becomes `ex2.approx.f32`: the MUFU op plus a
  range test and two predicated multiplies that keep denormal results. Softmax weights
  below 2^-126 are zero to float32 accuracy anyway (each row's sum is >= 1), so the
  kernels use the single instruction on CUDA (same 2-ulp approximation, denormals
  flushed).
  """
  if interpret:
    return False
  device = jax.devices()[0]
  return device.platform == "gpu" and "cuda" in str(device.client.platform_version).lower()


def exp2(x, fast: bool):
  """2**x; `fast` (static) uses `ex2.approx.ftz.f32` for float32 (see fast_exp2_enabled)."""
  if not fast or x.dtype != jnp.float32:
    return jnp.exp2(x)
  return plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]


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


def in_bounds(shape, bounds):
  """Which elements of a tile lie inside the array, or None when all of them do.

  `bounds[a]` is None where axis `a` of the tile never overruns the array (a static
  fact: lengths that are whole tiles, head-dim pieces that end inside the head dim), else
  (index of the tile's first element along that axis, the array's length).
  """
  mask = None
  for axis, bound in enumerate(bounds):
    if bound is None:
      continue
    start, length = bound
    m = start + lax.broadcasted_iota(jnp.int32, shape, axis) < length
    mask = m if mask is None else mask & m
  return mask


def load(ref, *bounds, other=0):
  """ref[...] for a tile that may overrun its array; elements outside read as `other`.

  Tiles are powers of two (Triton's rule) while arrays keep their own lengths and head
  dims. Pallas' Triton lowering turns a block into raw addresses with the array's
  strides and checks nothing, so an overrun row reads the next row (or past the
  buffer) unless the load is masked; interpret mode pads blocks with NaN instead.
  Either way, only masked loads give the zeros the kernels rely on.
  """
  mask = in_bounds(ref.shape, bounds)
  if mask is None:
    return ref[...]
  return plgpu.load(ref, mask=mask, other=other)


def store(ref, value, *bounds):
  """ref[...] = value, writing only the elements inside the array (see `load`)."""
  mask = in_bounds(ref.shape, bounds)
  if mask is None:
    ref[...] = value
  else:
    plgpu.store(ref, value, mask=mask)


def head_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
  """(offset, width) of the column blocks a head dim is split into: its binary digits
  from the largest, each a power of two as Triton's tiles must be, the last widened to
  16 (the smallest tl.dot operand) where it is smaller. 96 -> (0, 64), (64, 32);
  80 -> (0, 64), (64, 16); 72 -> (0, 64), (64, 16) (the last 8 columns masked);
  128 -> (0, 128). Every product over the head dim is one product per piece, so a head
  dim costs the tensor cores its own width, not the next power of two's (96 in one
  128-wide tile would spend a third more on zeros)."""
  pieces, offset = [], 0
  for bit in reversed(range(head_dim.bit_length())):
    width = 1 << bit
    if head_dim & width:
      pieces.append((offset, max(width, 16)))
      offset += width
      if width < 16:       # the widened piece covers the digits below it
        break
  return tuple(pieces)


def _piece_bound(off: int, width: int, head_dim: int):
  """A `bounds` entry of one head-dim piece: None when it ends inside the head dim."""
  return None if off + width <= head_dim else (off, head_dim)


def load_heads(ref, lead, rows, head_dim: int):
  """The pieces (`head_pieces`) of the [rows, head dim] tile ref[*lead, :], where `lead`
  indexes every axis of `ref` but the last (the head dim) and leaves one of rows;
  `rows` is the tile's `bounds` entry along it. (One indexer per load: Pallas's Triton
  lowering takes no view of a view.)"""
  return tuple(load(ref.at[(*lead, pl.ds(off, w))], rows, _piece_bound(off, w, head_dim))
               for off, w in head_pieces(head_dim))


def store_heads(ref, pieces, rows, head_dim: int):
  """ref[:, :] = the [rows, head dim] tile whose head-dim pieces are `pieces`, inside
  the array only."""
  for (off, w), x in zip(head_pieces(head_dim), pieces):
    store(ref.at[:, pl.ds(off, w)], x.astype(ref.dtype), rows, _piece_bound(off, w, head_dim))


def dot_heads(a, b, *, acc=jnp.float32, precision=None):
  """a b^T contracted over the head dim, for tiles given as head-dim pieces: one
  product per piece, summed in float32."""
  out = None
  for x, y in zip(a, b, strict=True):
    part = dot(x, y, trans_b=True, acc=acc, precision=precision)
    out = part if out is None else out + part
  return out


def dot_into_heads(p, b, *, acc=jnp.float32, precision=None):
  """p b for b given as head-dim pieces: the pieces of the [rows, head dim] product."""
  return tuple(dot(p.astype(x.dtype), x, acc=acc, precision=precision) for x in b)


def tail(start, length: int, block: int):
  """A `bounds` entry: None when `length` is whole blocks (the tile never overruns)."""
  return None if length % block == 0 else (start, length)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def out_type(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """A kernel output's type, varying over every mesh axis an operand varies over.

  Inside `shard_map` with its default `check_vma=True`, each output of a `pallas_call`
  must state the manual mesh axes it varies over (a kernel on a device's shard gives
  that device's values); outside one the set is empty.
  """
  mats = [jax.typeof(x).mat for x in operands if x is not None]
  varying = frozenset().union(*(m.varying for m in mats))
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mats[0].update(varying=varying))
