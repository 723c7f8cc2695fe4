"""What the kernels need to mask a tile: static options, optional operands, the
element-wise rules, the dropout hash and the per-tile visiting ranges, and the order in
which query blocks are launched (`query_block_order`).

The caller (jflash) decides *which* tiles exist: under the static rules (causal,
window) each block's ranges in closed form (`static_range`: a table at trace time, or
computed in a kernel from the block index, `StaticRanges`), with data-dependent ones
(lengths, segment ids) from a [B, nq, nk] class table of block summaries
(`ranges_from_classes`); the kernels only follow the ranges and apply element-wise
rules inside boundary tiles.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SKIP, BOUNDARY, FULL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class MaskOptions:
  """Static options (hashable, part of the compiled kernel)."""

  is_causal: bool = False
  window: tuple[int, int] | None = None     # (left, right): i - left <= j <= i + right
  soft_cap: float | None = None             # logits -> cap * tanh(logits / cap)
  dropout_rate: float = 0.0
  # Where query i sits for the causal and window rules: "top_left" at position i,
  # "bottom_right" at i + kv_len - q_len of its batch row (a KV cache's new queries come
  # after the cached keys, as in flash-attn). The offset is data: slot 6 of the ranges.
  causal_alignment: str = "top_left"


@dataclasses.dataclass(frozen=True)
class MaskOperands:
  """Optional arrays; `schedule(block_q, block_k)` returns [B, nq, nk] tile classes."""

  schedule: object = None                   # callable or None (static causal/length rules)
  q_lengths: jax.Array | None = None        # [B] int32
  kv_lengths: jax.Array | None = None       # [B] int32
  q_segment_ids: jax.Array | None = None    # [B, T] int32
  kv_segment_ids: jax.Array | None = None   # [B, S] int32
  mask: jax.Array | None = None             # [B|1, N|1, T, S] bool
  bias: jax.Array | None = None             # [B|1, N|1, T, S] float
  dropout_seed: jax.Array | None = None     # [] uint32


def kernel_operands(ops: MaskOperands) -> dict:
  """The optional per-call arrays as the kernels read them, at their own lengths (the
  kernels mask the loads of a tail tile): the dense mask as int8 (one byte per element
  like bool, and loadable by Triton), the seed as a [1] uint32."""
  out = {}
  if ops.q_segment_ids is not None:
    out["q_seg"] = ops.q_segment_ids
    out["kv_seg"] = ops.kv_segment_ids
  if ops.mask is not None:
    out["mask"] = ops.mask.astype(jnp.int8)
  if ops.bias is not None:
    out["bias"] = ops.bias
  if ops.dropout_seed is not None:
    out["seed"] = jnp.reshape(ops.dropout_seed, (1,)).astype(jnp.uint32)
  return out


# Values a load past the end of an operand reads: segment ids that match nothing (the
# query side and key side differ), a mask that hides, a bias of zero.
FILL = {"q_seg": -1, "kv_seg": -2, "mask": 0, "bias": 0}


# -- dropout: lowbias32 integer hash (C. Wellons), counter-based -----------------------

_M1, _M2 = 0x7FEB352D, 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mix(x, xp):
  u32 = xp.uint32
  x = x ^ (x >> u32(16))
  x = x * u32(_M1)
  x = x ^ (x >> u32(15))
  x = x * u32(_M2)
  return x ^ (x >> u32(16))


def dropout_row_key(seed, batch, head, rows, num_heads, xp=jnp):
  """Hash state of (seed, batch, head, row); one more mix per element decides."""
  u32 = xp.uint32
  bh = xp.asarray(batch).astype(u32) * u32(num_heads) + xp.asarray(head).astype(u32)
  h = _mix(xp.asarray(seed).astype(u32) ^ _mix(bh + u32(_GOLDEN), xp), xp)
  return _mix(h ^ xp.asarray(rows).astype(u32), xp)


def dropout_keep(row_key, cols, rate, xp=jnp):
  """True where kept; P(keep) = 1 - rate to within 2^-31."""
  u32 = xp.uint32
  h = _mix(row_key ^ (xp.asarray(cols).astype(u32) * u32(_GOLDEN)), xp)
  # Compare the top 31 bits as signed ints: no unsigned compare needed in a kernel.
  return (h >> u32(1)).astype(xp.int32) >= xp.int32(int(rate * 2**31))


def dropout_keep_numpy(seed, B, N, T, S, rate):
  """The [B, N, T, S] keep mask the kernels generate (references and tests)."""
  b = np.arange(B)[:, None, None, None]
  n = np.arange(N)[None, :, None, None]
  rows = np.arange(T)[None, None, :, None]
  cols = np.arange(S)[None, None, None, :]
  with np.errstate(over="ignore"):
    key = dropout_row_key(np.uint32(seed), b, n, rows, N, xp=np)
    return dropout_keep(key, cols, rate, xp=np)


# -- element-wise rules -------------------------------------------------------------------

def structured_keep(rows, cols, opts: MaskOptions, *, kv_len=None, q_seg=None, kv_seg=None):
  """Visibility of (row, col) pairs under causal / window / length / segment rules.

  All arguments broadcast against each other: query positions `rows` and segment ids
  `q_seg` lie along the tile's query axis, `cols` and `kv_seg` along its key axis.
  """
  keep = None

  def both(a, b):
    return b if a is None else a & b

  if opts.is_causal:
    keep = both(keep, rows >= cols)
  if opts.window is not None:
    left, right = opts.window
    keep = both(keep, (cols >= rows - left) & (cols <= rows + right))
  if kv_len is not None:
    keep = both(keep, cols < kv_len)
  if q_seg is not None:
    keep = both(keep, q_seg == kv_seg)
  return keep


# -- ranges ---------------------------------------------------------------------------------

def ranges_from_classes(classes, xp=jnp):
  """[..., n] tile classes -> [..., 4] int32 (lo, full_lo, full_hi, hi).

  Visit [lo, hi); [full_lo, full_hi) is the first contiguous run of FULL tiles and runs
  with no element-wise mask; every other visited tile is masked element-wise, which is
  always correct (a FULL tile outside the run only costs a redundant mask). `xp` is
  numpy for static classes (computed once at trace time, nothing for XLA to fold).
  """
  n = classes.shape[-1]
  idx = xp.arange(n, dtype=xp.int32).reshape((1,) * (classes.ndim - 1) + (n,))  # rank of classes
  visible = classes != SKIP
  full = classes == FULL
  any_visible = visible.any(-1)
  any_full = full.any(-1)
  lo = xp.where(any_visible, xp.argmax(visible, -1), 0)
  hi = xp.where(any_visible, n - xp.argmax(visible[..., ::-1], -1), 0)
  full_lo = xp.where(any_full, xp.argmax(full, -1), lo)
  after = (idx >= full_lo[..., None]) & ~full       # first non-FULL tile after the run
  full_hi = xp.where(after.any(-1), xp.argmax(after, -1), n)
  full_hi = xp.where(any_full, xp.minimum(full_hi, hi), lo)
  return xp.stack([lo, full_lo, full_hi, hi], -1).astype(xp.int32)


def classes_static(T, S, block_q, block_k, opts: MaskOptions, offset=0):
  """[nq, nk] classes under the positional rules (causal, window) and the clipped last
  key tile. Query positions are shifted by `offset` (`query_offsets`): an int gives a
  NumPy table, a [B, 1, 1] array a [B, nq, nk] one."""
  xp = np if isinstance(offset, (int, np.integer)) else jnp
  nq, nk = -(-T // block_q), -(-S // block_k)
  r0 = xp.arange(nq)[:, None] * block_q
  r1 = xp.minimum(r0 + block_q, T) - 1
  r0, r1 = r0 + offset, r1 + offset
  c0 = xp.arange(nk)[None, :] * block_k
  c1 = c0 + block_k - 1                  # last column of the tile
  c1_real = xp.minimum(c1, S - 1)         # last column that exists
  any_ = xp.ones(r0.shape[:-1] + (nk,), bool)
  all_ = xp.broadcast_to(c1 < S, any_.shape)
  if opts.is_causal:
    any_ = any_ & (c0 <= r1)
    all_ = all_ & (c1 <= r0)
  if opts.window is not None:
    left, right = opts.window
    any_ = any_ & (c1_real >= r0 - left) & (c0 <= r1 + right)
    all_ = all_ & (c0 >= r1 - left) & (c1 <= r0 + right)
  return xp.where(all_ & any_, FULL, xp.where(any_, BOUNDARY, SKIP)).astype(xp.int8)


def ranges_static(T, S, block_q, block_k, opts: MaskOptions, offset: int = 0,
                  transpose: bool = False):
  """`ranges_from_classes(classes_static(...))` (its `.T` with `transpose`) for an int
  `offset`, in closed form (`static_range` of every row): [n, 4] int32 in O(n) time and
  memory, where the table is [nq, nk] (at 1M tokens in tiles of 128, 67M classes)."""
  n = -(-S // block_k) if transpose else -(-T // block_q)
  rows = static_range(np.arange(n, dtype=np.int64), T=T, S=S, block_q=block_q,
                      block_k=block_k, opts=opts, offset=offset, transpose=transpose)
  return np.stack(rows, -1).astype(np.int32)


def static_range(i, *, T, S, block_q, block_k, opts: MaskOptions, offset: int = 0,
                 transpose: bool = False):
  """(lo, full_lo, full_hi, hi) of row block i under the static rules (causal, window,
  the clipped last key tile), in closed form: i a NumPy array of rows (`ranges_static`)
  or a kernel's traced int32 block index (`StaticRanges`), which then needs no table.
  A row past the end (a kernel's padding) is empty.

  Each rule keeps an interval of the other side's tiles, bounded by floor and ceiling
  divisions of a tile's first and last positions; their intersection is the visited
  run, and the tiles that every rule keeps whole (FULL, one contiguous run inside it)
  the unmasked one. Rows r0..r1 of query block i sit at i bq + offset .. min(i bq + bq,
  T) - 1 + offset; keys c0..c1 of key tile j at j bk .. j bk + bk - 1, of which c1 < S
  for a whole tile. A key tile is visible to a row block where some (row, key) pair is
  (causal: c0 <= r1; window: c0 <= r1 + right and min(c1, S - 1) >= r0 - left), FULL
  where every pair of the whole tile is (c1 < S; causal: c1 <= r0; window: c0 >= r1 -
  left and c1 <= r0 + right), which implies visible.

  A window side of T + S + |offset| or more hides nothing (query positions lie in
  [offset, T + offset), keys in [0, S)), so sides are clipped there and every term
  stays under 4 (T + S + |offset|) in magnitude: int32 in a kernel.
  """
  xp = np if isinstance(i, np.ndarray) else jnp
  if xp is jnp:
    i = jnp.asarray(i, jnp.int32)
  nq, nk = -(-T // block_q), -(-S // block_k)
  limit = T + S + abs(offset)
  causal, window = opts.is_causal, opts.window
  left, right = (min(w, limit) for w in window) if window is not None else (limit, limit)
  down = functools.partial(_floor_div, xp=xp)
  up = lambda a, b: down(a + (b - 1), b)               # ceiling division
  if not transpose:       # rows: query blocks; ranges over key tiles
    m = nk
    r0 = i * block_q + offset
    r1 = xp.minimum(i * block_q + block_q, T) - 1 + offset
    lo = xp.maximum(0, down(r0 - left, block_k))
    hi = xp.minimum(m, down(r1 + right, block_k) + 1)
    if causal:
      hi = xp.minimum(hi, down(r1, block_k) + 1)
    visible = (lo < hi) & (S - 1 >= r0 - left) & (i < nq)
    f_lo = xp.maximum(0, up(r1 - left, block_k))
    f_hi = xp.minimum(S // block_k, down(r0 + right + 1, block_k))
    if causal:
      f_hi = xp.minimum(f_hi, down(r0 + 1, block_k))
  else:                   # rows: key tiles; ranges over query blocks
    m = nq
    c0 = i * block_k
    c1 = c0 + block_k - 1
    last_row = T - 1 + offset                        # position of the last query
    # r1(i) >= c0 - right, and r0(i) <= min(c1, S - 1) + left
    lo = xp.maximum(0, down(c0 - right - offset, block_q))
    hi = xp.minimum(m, down(xp.minimum(c1, S - 1) + left - offset, block_q) + 1)
    visible = (last_row >= c0 - right) & (i < nk)
    if causal:            # r1(i) >= c0
      lo = xp.maximum(lo, down(c0 - offset, block_q))
      visible = visible & (last_row >= c0)
    visible = visible & (lo < hi)
    # r1(i) <= c0 + left (every block's, where the last query's is), r0(i) >= c1 - right
    f_lo = xp.maximum(0, up(c1 - right - offset, block_q))
    if causal:            # r0(i) >= c1
      f_lo = xp.maximum(f_lo, up(c1 - offset, block_q))
    f_hi = xp.where(c1 < S, xp.where(last_row <= c0 + left, m,
                                     down(c0 + left - offset + 1, block_q)), 0)
  lo, hi = xp.where(visible, lo, 0), xp.where(visible, hi, 0)
  full = visible & (f_lo < f_hi)
  full_lo = xp.where(full, f_lo, lo)
  full_hi = xp.where(full, xp.minimum(f_hi, hi), lo)
  return lo, full_lo, full_hi, hi


def _floor_div(a, b: int, xp):
  """floor(a / b) for a positive int b. A kernel's integer division truncates toward
  zero (PTX ISA, div.s32), one less where that rounded a negative quotient up."""
  if xp is np:
    return a // b
  q = lax.div(a, jnp.int32(b))
  return q - (q * b > a).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class StaticRanges:
  """The ranges of the static rules alone (`build_ranges(..., closed_form=True)`): a
  kernel computes row i from its block index (`static_range`) where it would load
  `build_ranges`' row; every batch row has the same, with kv_len = S."""

  T: int
  S: int
  block_q: int
  block_k: int
  opts: MaskOptions
  offset: int = 0
  transpose: bool = False

  def row(self, i):
    """(lo, full_lo, full_hi, hi) of block i (an int32 scalar)."""
    return static_range(i, T=self.T, S=self.S, block_q=self.block_q, block_k=self.block_k,
                        opts=self.opts, offset=self.offset, transpose=self.transpose)


def query_offsets(opts: MaskOptions, *, T, S, q_lengths=None, kv_lengths=None):
  """Position of each batch row's query 0 for the causal and window rules: 0 aligned
  top-left; kv_len - q_len aligned bottom-right (an int without lengths, else [B] int32,
  with lengths clamped to [0, T] and [0, S] as the kernels clamp them)."""
  if opts.causal_alignment != "bottom_right":
    return 0
  if q_lengths is None and kv_lengths is None:
    return S - T
  q = T if q_lengths is None else jnp.clip(q_lengths.astype(jnp.int32), 0, T)
  kv = S if kv_lengths is None else jnp.clip(kv_lengths.astype(jnp.int32), 0, S)
  return jnp.asarray(kv - q, jnp.int32)


def build_ranges(ops: MaskOperands, opts: MaskOptions, *, B, T, S, block_q, block_k,
                 transpose: bool = False, closed_form: bool = False):
  """[B, n, 8] int32 per (batch, block): lo, full_lo, full_hi, hi, q_len, kv_len,
  query offset (`query_offsets`), 0. A NumPy array (a constant) under static rules
  alone, a jnp array where lengths or a schedule make it data. With `closed_form`, the
  static rules' ranges come as a `StaticRanges`, from which a kernel computes its
  blocks' rows (no table, no load before a program's first copy).

  Rows are query blocks (forward, dQ) or, with `transpose`, key blocks (dK/dV). The
  classes of the static rules and of the caller's data-dependent `schedule` combine by
  minimum, since SKIP < BOUNDARY < FULL.
  """
  offset = query_offsets(opts, T=T, S=S, q_lengths=ops.q_lengths, kv_lengths=ops.kv_lengths)
  if ops.schedule is None and ops.q_lengths is None and ops.kv_lengths is None:
    # Static rules only: the ranges are a constant, computed here in closed form and
    # returned as a NumPy array, which a jitted caller embeds in the executable. (A jnp
    # broadcast over the batch is an XLA broadcast that XLA's constant folding leaves
    # alone: a kernel of its own before every call.)
    if closed_form:
      return StaticRanges(T, S, block_q, block_k, opts, offset, transpose)
    r = ranges_static(T, S, block_q, block_k, opts, offset, transpose)
    r = np.concatenate([r, np.tile(np.array([[T, S, offset, 0]], np.int32), (len(r), 1))], -1)
    return np.ascontiguousarray(np.broadcast_to(r[None], (B, *r.shape)))
  per_row = not isinstance(offset, int)
  static = classes_static(T, S, block_q, block_k, opts,
                          offset[:, None, None] if per_row else offset)
  classes = static if per_row else jnp.asarray(static)[None]
  if ops.schedule is not None:
    classes = jnp.minimum(classes, ops.schedule(block_q=block_q, block_k=block_k).astype(jnp.int8))
  classes = jnp.broadcast_to(classes, (B, *classes.shape[1:]))
  if transpose:
    classes = jnp.swapaxes(classes, 1, 2)
  r = ranges_from_classes(classes)
  n = r.shape[1]
  # Lengths are clamped to [0, T] / [0, S]: traced lengths are not range-checked by the
  # caller, and a key length past S would make the zero-filled tail of the last tile
  # visible as phantom keys.
  lens = lambda x, full: jnp.broadcast_to(
      (jnp.full((B,), full, jnp.int32) if x is None
       else jnp.clip(x.astype(jnp.int32), 0, full))[:, None, None],
      (B, n, 1))
  offsets = jnp.broadcast_to(jnp.asarray(offset, jnp.int32).reshape(-1, 1, 1), (B, n, 1))
  zeros = jnp.zeros((B, n, 1), jnp.int32)
  return jnp.concatenate([r, lens(ops.q_lengths, T), lens(ops.kv_lengths, S), offsets, zeros],
                         -1)


def query_offset(ranges, opts: MaskOptions):
  """The query offset of a block's row of `build_ranges` (0, never loaded, top-left)."""
  return ranges[6] if opts.causal_alignment == "bottom_right" else 0


def visit_tiles(ranges, body, carry):
  """Runs `body(j, carry, masked)` over one block's visited tiles (a row of
  `build_ranges`): [lo, full_lo) and [full_hi, hi) with element-wise masks,
  [full_lo, full_hi) without. Returns the final carry."""
  lo, full_lo, full_hi, hi = ranges[0], ranges[1], ranges[2], ranges[3]
  carry = lax.fori_loop(lo, full_lo, functools.partial(body, masked=True), carry)
  carry = lax.fori_loop(full_lo, full_hi, functools.partial(body, masked=False), carry)
  return lax.fori_loop(full_hi, hi, functools.partial(body, masked=True), carry)


def _along(x, axis):
  """A [n] vector laid along `axis` of a 2-D tile."""
  return x[None, :] if axis == 1 else x[:, None]


# -- what a kernel does with a tile ----------------------------------------------------------

def tile_scores(q, k, *, scale, opts: MaskOptions, acc, precision, row0, col0, masked,
                kv_len, q_offset=0, q_seg=None, kv_seg=None, mask_tile=None, bias_tile=None,
                transposed=False):
  """Logits of one tile with every mask applied: (s, t, c).

  The base-2 logits are `s * c`. With no soft cap or bias, `s` is the raw Q K^T and
  `c = scale * log2(e)` is left for the caller to fold into its one fused
  multiply-subtract (`exp2(s * c - m)`): max and masking commute with a positive
  factor, so no per-element multiply is spent here. Otherwise `s` is already in base 2
  and c = 1. `t` is tanh of the soft cap (for the backward), else None.

  The tile is [bq, bk], or [bk, bq] with `transposed` (the dK/dV kernel, which then
  feeds P^T and dS^T to its matmuls without transposing a register tile). `mask_tile`
  and `bias_tile` are always [bq, bk]. `masked` is static: FULL tiles skip the
  element-wise structured rules entirely. `q_offset` shifts the query positions of the
  causal and window rules (slot 6 of the ranges). `q` and `k` are given as head-dim
  pieces (`common.head_pieces`).
  """
  from pallas_kernels.common import LOG2E, dot_heads
  s = dot_heads(k, q, acc=acc, precision=precision) if transposed else \
      dot_heads(q, k, acc=acc, precision=precision)
  qa, ka = (1, 0) if transposed else (0, 1)   # the tile's query axis and key axis
  tr = (lambda x: x.T) if transposed else (lambda x: x)
  c = scale * LOG2E
  t = None
  if opts.soft_cap is not None or bias_tile is not None or not c > 0:
    s = s * scale
    if opts.soft_cap is not None:
      t = jnp.tanh(s / opts.soft_cap)
      s = opts.soft_cap * t
    if bias_tile is not None:
      s = s + tr(bias_tile).astype(acc)
    s = s * LOG2E  # exp(x) = exp2(x log2 e): exp2 is the hardware instruction
    c = 1.0
  keep = None
  if masked:
    rows = row0 + q_offset + lax.broadcasted_iota(jnp.int32, s.shape, qa)
    cols = col0 + lax.broadcasted_iota(jnp.int32, s.shape, ka)
    keep = structured_keep(rows, cols, opts, kv_len=kv_len,
                           q_seg=None if q_seg is None else _along(q_seg, qa),
                           kv_seg=None if kv_seg is None else _along(kv_seg, ka))
  if mask_tile is not None:
    m = tr(mask_tile) != 0
    keep = m if keep is None else keep & m
  if keep is not None:
    s = jnp.where(keep, s, -jnp.inf)
  return s, t, c


def times(x, c):
  """x * c, with no multiply emitted for c = 1."""
  return x if c == 1.0 else x * c


def dropout_scale(seed, batch, head, row0, col0, shape, rate, num_heads, transposed=False):
  """Multiplier Z / (1 - rate) of the hashed keep mask Z for a [bq, bk] tile
  ([bk, bq] with `transposed`)."""
  qa, ka = (1, 0) if transposed else (0, 1)
  nq, nk = shape[qa], shape[ka]
  iota = lambda n, axis: lax.broadcasted_iota(jnp.int32, (1, n) if axis else (n, 1), axis)
  rows = row0 + iota(nq, qa)
  cols = col0 + iota(nk, ka)
  key = dropout_row_key(seed, batch, head, rows, num_heads)
  keep = dropout_keep(key, cols, rate)
  return jnp.where(keep, 1.0 / (1.0 - rate), 0.0)


def query_block_order(num_q_blocks: int, opts: MaskOptions):
  """Launch position -> query block (a grid index, or a persistent program's round).
  Causal work grows with the block index, so the heaviest blocks are launched first and
  the light ones fill the tail of the launch (the wave quantisation that otherwise
  idles SMs at the end)."""
  if opts.is_causal:
    return lambda i: num_q_blocks - 1 - i
  return lambda i: i
