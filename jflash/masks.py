"""Masks as compact data, and their per-tile schedule.

Structured masks (causal, sliding window, sequence lengths, segment ids) never become
a [T, S] array on the kernel paths. Before a kernel runs they are summarised per tile
(from O(T/bq + S/bk) block summaries) as skip / full / boundary, then turned into,
for every (batch, query block), the range of key blocks to visit and the contiguous
run of them that needs no element-wise mask; the dK/dV kernel gets the transposed
ranges (per key block, which query blocks). Dense `mask`/`bias` are the caller's own
[B|1, N|1, T, S] inputs and are read tile by tile.

Dropout uses a counter-based hash of (seed, batch, head, row, col), so the backward
pass regenerates the forward's keep mask instead of storing it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

from pallas_kernels.masking import (
    BOUNDARY, FULL, SKIP, MaskOperands, MaskOptions, classes_static, dropout_keep,
    dropout_row_key, query_offsets, ranges_from_classes)

_STATIC = ("is_causal", "window", "soft_cap", "dropout_rate", "causal_alignment")
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
_ARRAYS = ("bias", "mask", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids",
           "dropout_seed")


@dataclasses.dataclass(frozen=True)
class Masks:
  """Everything of one attention call that decides which logits a query sees and how
  they are shaped beyond `scale * q.k`: the one mask record every implementation takes.

  The static options are part of the compiled program (pytree metadata); the arrays are
  per-call data (pytree leaves, any of them None). `jflash.prepare` builds it from the
  keyword options of `jflash.attention`.
  """

  is_causal: bool = False                   # query i sees keys j <= i (top-left aligned)
  window: tuple[int, int] | None = None     # (left, right): i - left <= j <= i + right
  soft_cap: float | None = None             # logits -> cap * tanh(logits / cap)
  dropout_rate: float = 0.0                 # keep mask from dropout_seed, see below
  # Query i's position for the causal and window rules: i ("top_left", jax.nn), or
  # i + kv_len - q_len of its row ("bottom_right", KV caches; `query_offsets`).
  causal_alignment: str = "top_left"
  bias: Array | None = None                 # [B|1, N|1, T, S] float, added to logits
  mask: Array | None = None                 # [B|1, N|1, T, S] bool, True = attend
  q_lengths: Array | None = None            # [B] int32
  kv_lengths: Array | None = None           # [B] int32
  q_segment_ids: Array | None = None        # [B, T] int32
  kv_segment_ids: Array | None = None       # [B, S] int32
  dropout_seed: Array | None = None         # [] uint32

  @property
  def structured(self) -> bool:
    """Lengths or segment ids: tile ranges depend on the data."""
    return any(x is not None for x in (self.q_lengths, self.kv_lengths, self.q_segment_ids))

  def in_use(self) -> tuple[str, ...]:
    """Names of the fields that change the result (non-default options, set arrays);
    what an implementation that lacks some of them checks in `supports`."""
    default = Masks()
    return tuple(n for n in _STATIC if getattr(self, n) != getattr(default, n)) + tuple(
        n for n in _ARRAYS if getattr(self, n) is not None)


jax.tree_util.register_dataclass(Masks, data_fields=list(_ARRAYS), meta_fields=list(_STATIC))


def offsets_of(masks: Masks, T: int, S: int):
  """`query_offsets` of `masks`: 0, an int, or [B] int32."""
  return query_offsets(masks, T=T, S=S, q_lengths=masks.q_lengths, kv_lengths=masks.kv_lengths)


def dense_keep_numpy(B, N, T, S, masks: Masks):
  """The whole [B, N, T, S] visibility (without dropout) for references and tests."""
  is_causal, window = masks.is_causal, masks.window
  rows = np.arange(T)[None, None, :, None]
  cols = np.arange(S)[None, None, None, :]
  pos = rows + np.reshape(np.asarray(offsets_of(masks, T, S)), (-1, 1, 1, 1))
  keep = np.ones((B, N, T, S), bool)
  if is_causal:
    keep &= pos >= cols
  if window is not None:
    keep &= (cols >= pos - window[0]) & (cols <= pos + window[1])
  if masks.q_lengths is not None:
    keep &= rows < np.asarray(masks.q_lengths)[:, None, None, None]
  if masks.kv_lengths is not None:
    keep &= cols < np.asarray(masks.kv_lengths)[:, None, None, None]
  if masks.q_segment_ids is not None:
    keep &= (np.asarray(masks.q_segment_ids)[:, None, :, None]
             == np.asarray(masks.kv_segment_ids)[:, None, None, :])
  if masks.mask is not None:
    keep &= np.asarray(masks.mask, bool)
  return keep


def check_key(rng) -> None:
  """ValueError naming `dropout_rng` unless it is one PRNG key: a typed key or a raw
  uint32[2] one (the output of `jax.random.PRNGKey`)."""
  dtype = getattr(rng, "dtype", None)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  raw = dtype == jnp.uint32 and tuple(getattr(rng, "shape", ())) == (2,)
  if (typed and rng.shape == ()) or raw:
    return
  got = (f"dtype={dtype}, shape={tuple(rng.shape)}" if dtype is not None
         else f"{rng!r} of type {type(rng).__name__}")
  raise ValueError("dropout_rng must be one PRNG key (jax.random.key(seed) or the "
                   f"uint32[2] of jax.random.PRNGKey(seed)), got {got}")


def seed_from_key(rng) -> Array:
  """A uint32 seed from a PRNG key (`check_key`'s rule)."""
  check_key(rng)
  return jax.random.bits(rng, (), jnp.uint32)


# -- per-tile schedule -------------------------------------------------------------------

def _block_summary(x, block, n_blocks):
  """min and max of each block of the last axis (the clipped block padded by its edge)."""
  pad = n_blocks * block - x.shape[-1]
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], mode="edge")
  x = x.reshape(*x.shape[:-1], n_blocks, block)
  return x.min(-1), x.max(-1)


def data_tile_classes(*, B, T, S, block_q, block_k, masks: Masks):
  """[B, nq, nk] int8 classes from the data-dependent rules (lengths, segment ids).

  Computed from per-block bounds only (O(T/bq + S/bk) summaries); the kernels combine
  them with the static rules (causal, window, clipped tile) by minimum.
  """
  nq, nk = -(-T // block_q), -(-S // block_k)
  r0 = (jnp.arange(nq) * block_q)[None, :, None]
  c0 = (jnp.arange(nk) * block_k)[None, None, :]
  c1 = c0 + block_k - 1
  any_ = jnp.ones((B, nq, nk), bool)
  all_ = jnp.ones((B, nq, nk), bool)
  if masks.q_lengths is not None:
    # Rows past q_len are zeroed per row at the end, not masked per element.
    any_ = any_ & (r0 < masks.q_lengths[:, None, None])
  if masks.kv_lengths is not None:
    kv = masks.kv_lengths[:, None, None]
    any_ = any_ & (c0 < kv)
    all_ = all_ & (c1 < kv)
  if masks.q_segment_ids is not None:
    qmin, qmax = _block_summary(masks.q_segment_ids, block_q, nq)
    kmin, kmax = _block_summary(masks.kv_segment_ids, block_k, nk)
    qmin, qmax = qmin[:, :, None], qmax[:, :, None]
    kmin, kmax = kmin[:, None, :], kmax[:, None, :]
    any_ = any_ & (qmin <= kmax) & (kmin <= qmax)
    all_ = all_ & (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
  all_ = all_ & any_
  return jnp.where(all_, FULL, jnp.where(any_, BOUNDARY, SKIP)).astype(jnp.int8)


def tile_classes(*, B, T, S, block_q, block_k, masks: Masks):
  """[B, nq, nk] classes under every structured rule: what the kernels visit."""
  offset = offsets_of(masks, T, S)
  classes = jnp.asarray(classes_static(
      T, S, block_q, block_k, masks, offset if isinstance(offset, int) else offset[:, None, None]))
  classes = classes if classes.ndim == 3 else classes[None]
  if masks.structured:
    classes = jnp.minimum(classes, data_tile_classes(B=B, T=T, S=S, block_q=block_q,
                                                     block_k=block_k, masks=masks))
  return jnp.broadcast_to(classes, (B, *classes.shape[1:]))


def visited_tiles(classes) -> Array:
  """How many tiles a kernel following these classes loads (for tests and reports)."""
  r = ranges_from_classes(classes)  # per block: (lo, full_lo, full_hi, hi), visit [lo, hi)
  lo, hi = r[..., 0], r[..., 3]
  return jnp.sum(hi - lo)


# -- the same rules on [B, K, G, T, c] logits in plain JAX ("xla" and "xla_chunked") -----

def hidden_logit(dtype):
  """The finite logit a hidden entry holds in the plain-JAX implementations: far below
  any real logit, so it never wins a row maximum, and finite, so no inf is ever
  computed (`jax.debug_infs`). Hidden entries are zeroed by the keep mask, not by
  exp() of it. As jax.nn, capped at float32's range."""
  return -0.7 * float(min(jnp.finfo(dtype).max, jnp.finfo(jnp.float32).max))


def is_neg_inf(x):
  """x == -inf, computed without an inf constant (which `jax.debug_infs` reports)."""
  return ~jnp.isfinite(x) & (x < 0)


def _heads(x, K, G):
  """[B|1, N|1, T|1, c] -> [B|1, K|1, G|1, T|1, c] to line up with grouped logits."""
  b, n, t, c = x.shape
  return x.reshape(b, 1, 1, t, c) if n == 1 else x.reshape(b, K, G, t, c)


def _columns(x, cols):
  """The key columns `cols` of a [..., S|1] operand (a size-one axis is read as it is;
  columns past S, padding, read the last one and are hidden by the caller)."""
  if x.shape[-1] == 1:
    return x
  return jnp.take(x, jnp.clip(cols, 0, x.shape[-1] - 1), axis=-1)


def masked_logits(raw, cols, masks: Masks, *, K, G, S):
  """Scaled logits `raw` [B, K, G, T, c] of key columns `cols` [c] -> (logits with
  `hidden_logit` where hidden, keep mask (True where visible; broadcasts against the
  logits), tanh of the soft cap or None, dropout multiplier or None).

  Applies soft cap, bias, causal/window/length/segment/dense masks and the dropout keep
  mask exactly as the kernels do. `cols` may run past S (padding): those are hidden.
  Every operand is laid out at rank 5 (no rank promotion). The bias and mask may have
  size one along any axis of [B, N, T, S].
  """
  B, _, _, T, c = raw.shape
  rows = jnp.arange(T).reshape(1, 1, 1, T, 1)
  colsb = cols.reshape(1, 1, 1, 1, c)
  per_batch = lambda x: x.reshape(x.shape[0], 1, 1, 1, 1)
  # Query positions of the causal and window rules: [1, 1, 1, T, 1], or
  # [B, 1, 1, T, 1] per row.
  offset = offsets_of(masks, T, S)
  pos = rows + (offset if isinstance(offset, int) else per_batch(offset))
  t = None
  s = raw
  if masks.soft_cap is not None:
    t = jnp.tanh(raw / masks.soft_cap)
    s = masks.soft_cap * t
  keep = colsb < S
  if masks.is_causal:
    keep = keep & (pos >= colsb)
  if masks.window is not None:
    left, right = masks.window
    keep = keep & (colsb >= pos - left) & (colsb <= pos + right)
  if masks.bias is not None:
    s = s + _heads(_columns(masks.bias, cols), K, G).astype(s.dtype)
  if masks.q_lengths is not None:
    keep = keep & (rows < per_batch(masks.q_lengths))
  if masks.kv_lengths is not None:
    keep = keep & (colsb < per_batch(masks.kv_lengths))
  if masks.q_segment_ids is not None:
    kv = _columns(masks.kv_segment_ids, cols)
    keep = keep & (masks.q_segment_ids.reshape(B, 1, 1, T, 1) == kv.reshape(B, 1, 1, 1, c))
  if masks.mask is not None:
    keep = keep & _heads(_columns(masks.mask, cols), K, G)
  s = jnp.where(keep, s, jnp.asarray(hidden_logit(s.dtype), s.dtype))
  drop = None
  if masks.dropout_rate > 0:
    b = jnp.arange(B).reshape(B, 1, 1, 1, 1)
    n = (jnp.arange(K)[:, None] * G + jnp.arange(G)[None, :]).reshape(1, K, G, 1, 1)
    key = dropout_row_key(masks.dropout_seed, b, n, rows, K * G)
    z = dropout_keep(key, colsb, masks.dropout_rate)
    drop = z.astype(raw.dtype) / (1 - masks.dropout_rate)
  return s, keep, t, drop


def kernel_records(masks: Masks, *, B: int, T: int, S: int) -> tuple[MaskOptions, MaskOperands]:
  """`masks` as pallas_kernels.masking's own records: the static options and the arrays
  with the data-dependent tile schedule (lengths, segment ids). Every kernel backend
  ("pallas", "mosaic_gpu", "hip") builds its per-tile ranges from these, so they all
  skip and mask exactly the same tiles."""
  opts = MaskOptions(is_causal=masks.is_causal, window=masks.window,
                     soft_cap=masks.soft_cap, dropout_rate=masks.dropout_rate,
                     causal_alignment=masks.causal_alignment)
  schedule = None
  if masks.structured:
    schedule = functools.partial(data_tile_classes, B=B, T=T, S=S, masks=masks)
  ops = MaskOperands(schedule=schedule, q_lengths=masks.q_lengths,
                     kv_lengths=masks.kv_lengths, q_segment_ids=masks.q_segment_ids,
                     kv_segment_ids=masks.kv_segment_ids, mask=masks.mask,
                     bias=masks.bias, dropout_seed=masks.dropout_seed)
  return opts, ops
