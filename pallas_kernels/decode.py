"""Split-KV decode kernel (flash-decoding): attention of a few query rows per sequence
(decoding, speculative decoding, short prefill chunks) over a long KV cache.

With T of 1 to ~64, the forward kernel's grid (query blocks x batch x heads) has one
program per (batch, head), each walking the whole key range: a long cache and a small
batch leave most of the GPU idle, and the query heads of a GQA group each read the same
K/V again. Here (Dao et al., "Flash-Decoding for long-context inference", 2023):
  * one program owns all T x G query rows of a GQA group (a [T * G, H] tile, row
    t * G + g), so each K/V byte is read once per program;
  * the key range is split over `num_splits` programs, each writing a partial (out, lse)
    in float32; `merge_splits` combines them (out = sum_s exp(lse_s - lse) out_s). With
    one split the program's rows are the result, written in q's dtype (no merge).
Each program reads one row of a small table: (q_len, kv_len, query offset, cache row) of
its batch row (pallas_kernels.masking's `query_offsets`: bottom-right alignment puts query
t at position t + kv_len - q_len). Programs stop at the row's last visible key (kv_len, and the
causal limit of its last query), so ragged caches skip the tiles past each row's length.

K/V come either contiguous, [R, S, K, H] cache rows of which batch row b reads row
info[b, 3] (b itself for a [B, S, K, H] cache; layer * B + b for a stack of layers'
caches [L, B, S, K, H] seen as [L * B, S, K, H], so a decode loop reads its layer in
place), or paged, [pages, page_size, K, H] with a [B, max_pages] page table (vLLM's
PagedAttention layout): key c of batch row b lies in page table[b, c // page_size] at
c % page_size. Both go through the same loop with the same tiles, so their results are
bit-identical.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.tuning import padded_head_dim

# Query rows (T x G) one program holds: its [rows, H] float32 accumulator lives in
# registers next to a K and a V tile.
MAX_BLOCK_M = 64


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
  """Tiles of the decode kernel: `block_k` keys per step, `num_splits` programs per
  (batch row, key head) along the keys (None: `default_splits`). The key range is cut
  into `num_splits` chunks of whole tiles, so a count that does not divide the tiles
  runs as the fewer chunks their rounding leaves (9 splits of 64 tiles: 8 of 8)."""

  block_k: int = 64
  num_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    if self.num_splits is not None and (not isinstance(self.num_splits, int)
                                        or self.num_splits < 1):
      raise ValueError(f"num_splits={self.num_splits!r} must be None or an int >= 1")


def default_splits(programs: int, S: int, block_k: int, target_programs: int = 528,
                   round_down: bool = True, short_tiles: int = 4) -> int:
  """Splits of the key range for a grid of `programs` (batch rows x key heads x row
  blocks) over S keys in tiles of `block_k`.

  A decode step is bound by memory: the grid is brought to at most `target_programs`
  (`round_down`; else at least), one wave of four programs per multiprocessor of an
  H100's or H200's 132, since a grid just past a wave leaves a tail of programs
  streaming alone (H100, 8 x 32K GQA: 385 us at 9 splits, 576 programs; 358 us at 8,
  512 programs). Where a wave would leave each split under `short_tiles` key tiles and
  one-tile splits fit in two waves, the cache is short enough that a split's chain of
  dependent tile loads, not bandwidth, bounds the step: every tile gets a split of its
  own (1 x 8K GQA in one run: 48.5 us at 64 splits of two tiles, 46.6 at 32 of four,
  36-37 us at 128 of one).
  The figures: experiments/results/decode_splits_h100/. More than one split writes
  float32 partials of T x N x H x 4 bytes each, which the merge reads back. At least 1
  (an empty grid or key range has nothing to split)."""
  if programs < 1 or S < 1:
    return 1
  tiles = -(-S // block_k)
  want = target_programs // programs if round_down else -(-target_programs // programs)
  splits = max(1, min(want, tiles))
  one_tile_each = tiles < short_tiles * splits and programs * tiles <= 2 * target_programs
  return tiles if one_tile_each else splits


def _decode_kernel(*refs, names, scale, soft_cap, is_causal, block_m, n_m, block_k, chunk, T, S,
                   H, G, page_size, acc, precision, fast_exp2):
  r = dict(zip(names, refs))
  split = pl.program_id(0)
  info = r["info"]
  q_len, kv_len, offset, cache_row = info[0], info[1], info[2], info[3]
  row0 = pl.program_id(2) % n_m * block_m
  rows_in = common.tail(row0, T * G, block_m)
  q = common.load_heads(r["q"], (slice(None),), rows_in, H)          # [block_m, H] pieces
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
  t = rows // G                                                     # query of each row
  pos = t + offset                                                  # its causal position
  # The split's keys [lo, hi), cut at the row's length and at the last query's causal
  # limit: tiles past them are never loaded.
  lo = split * chunk
  hi = jnp.minimum(lo + chunk, kv_len)
  if is_causal:
    last = jnp.minimum(row0 + block_m, T * G)
    hi = jnp.minimum(hi, jnp.minimum((last - 1) // G, q_len - 1) + offset + 1)
  n_tiles = jnp.maximum(hi - lo + block_k - 1, 0) // block_k

  def body(j, carry):
    o, m_i, l_i = carry
    col0 = lo + j * block_k
    if page_size is None:
      at = (cache_row, pl.ds(col0, block_k))
      kt = common.load_heads(r["k"], at, common.tail(col0, S, block_k), H)
      vt = common.load_heads(r["v"], at, common.tail(col0, S, block_k), H)
    else:
      # block_k divides the page: a tile lies inside one page.
      page = r["pages"][col0 // page_size]
      at = (page, pl.ds(col0 % page_size, block_k))
      kt = common.load_heads(r["k"], at, None, H)
      vt = common.load_heads(r["v"], at, None, H)
    # Keys at or past `hi` in the last tile are stale cache entries (anything, NaN
    # too): their logits are hidden below, and their values zeroed, since 0 * NaN in
    # P @ V would reach the row.
    live = col0 + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < hi
    vt = tuple(jnp.where(live, x, jnp.zeros((), x.dtype)) for x in vt)
    s = common.dot_heads(q, kt, acc=acc, precision=precision) * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    cols = col0 + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = cols < hi
    if is_causal:
      keep = keep & (cols <= pos[:, None])
    s = jnp.where(keep, s * common.LOG2E, -jnp.inf)     # base 2: exp2 is the instruction
    # -- update m_i and l_i; a row with nothing visible yet keeps m = -inf, so exp2 gets
    # a finite stand-in instead of (-inf) - (-inf).
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = common.exp2(m_i - m_safe, fast_exp2)
    p = common.exp2(s - m_safe[:, None], fast_exp2)
    l_i = alpha * l_i + jnp.sum(p, axis=1)
    pv = common.dot_into_heads(p, vt, acc=acc, precision=precision)
    o = tuple(alpha[:, None] * o_h + pv_h for o_h, pv_h in zip(o, pv))
    return o, m_new, l_i

  o = tuple(jnp.zeros(x.shape, acc) for x in q)
  m_i = jnp.full((block_m,), -jnp.inf, acc)
  l_i = jnp.zeros((block_m,), acc)
  o, m_i, l_i = lax.fori_loop(0, n_tiles, body, (o, m_i, l_i))
  # A row that saw no key here (l = 0 exactly; a NaN logit makes l NaN and is kept) or
  # lies past the query length gives out = 0 and lse = -inf: no weight in the merge.
  has = (l_i != 0) & (t < q_len)
  l_safe = jnp.where(has, l_i, 1.0)
  common.store_heads(r["out"], [jnp.where(has[:, None], o_h / l_safe[:, None], 0.0) for o_h in o],
                     rows_in, H)
  common.store(r["lse"], jnp.where(has, (m_i + jnp.log2(l_safe)) * common.LN2, -jnp.inf),
               rows_in)


def merge_splits(out, lse):
  """Partial results [..., splits, M, H] and lse [..., splits, M] (float32) -> the
  attention over all keys: lse = logsumexp_s lse_s, out = sum_s exp(lse_s - lse) out_s.
  Rows no split saw stay out = 0, lse = -inf; a NaN reaches both."""
  m = jnp.max(lse, axis=-2, keepdims=True)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m_safe)                                          # [..., splits, M]
  total = jnp.sum(w, axis=-2, keepdims=True)
  has = total != 0
  t_safe = jnp.where(has, total, 1.0)
  o = jnp.sum(out * (w / t_safe)[..., None], axis=-3)
  lse_all = jnp.where(has, m_safe + jnp.log(t_safe), -jnp.inf)[..., 0, :]
  return o, lse_all


def decode_forward(q, k, v, info, *, scale: float, is_causal: bool = False,
                   soft_cap: float | None = None, block_tables=None,
                   blocks: DecodeBlocks | None = None, interpret: bool | None = None):
  """q [B, T, N, H]; k, v [R, S, K, H] cache rows, or pages [P, page_size, K, H] with
  `block_tables` [B, max_pages] int32; `info` [B, 8] int32 per batch row: q_len,
  kv_len, query offset (position of query 0 for the causal rule), the cache row it
  reads (contiguous caches; b for R = B), then zeros.
  Returns out [B, T, N, H] (q's dtype) and lse [B, N, T] float32 (natural log).
  Rows past q_len give zeros and lse = -inf; keys at or past kv_len are hidden."""
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  blocks = blocks or DecodeBlocks()
  paged = block_tables is not None
  if paged:
    page_size = k.shape[1]
    S = block_tables.shape[1] * page_size
    bk = min(blocks.block_k, page_size)
    if page_size % bk or bk & (bk - 1) or bk < 16:
      raise ValueError(f"page_size={page_size} must be a multiple of a power-of-two "
                       f"key tile >= 16 (block_k={blocks.block_k})")
  else:
    page_size = None
    S = k.shape[1]
    bk = common.fit_block(blocks.block_k, S)
  M = T * G
  bm = min(MAX_BLOCK_M, max(16, 1 << (M - 1).bit_length()))
  n_m = -(-M // bm)
  splits = blocks.num_splits or default_splits(B * K * n_m, S, bk)
  chunk = common.round_up(-(-S // splits), bk)
  splits = -(-S // chunk)
  Hp = padded_head_dim(H)
  acc = common.acc_dtype(q.dtype)
  interp = common.use_interpret(interpret)
  # [B, K, T * G, H]: a GQA group's rows side by side (row t * G + g); q is small.
  qg = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)
  names = ["q", "k", "v", "info"] + (["pages"] if paged else []) + ["out", "lse"]
  if paged:
    P = k.shape[0]
    kv_spec = pl.BlockSpec((P, page_size, None, Hp), lambda s, b, p: (0, 0, p // n_m, 0))
    mp = max(16, 1 << (block_tables.shape[1] - 1).bit_length())
    extra_specs = [pl.BlockSpec((None, mp), lambda s, b, p: (b, 0))]
    extra = [jnp.pad(block_tables.astype(jnp.int32),
                     ((0, 0), (0, mp - block_tables.shape[1])))]
  else:
    kv_spec = pl.BlockSpec((k.shape[0], common.round_up(S, bk), None, Hp),
                           lambda s, b, p: (0, 0, p // n_m, 0))
    extra_specs, extra = [], []
  kernel = functools.partial(
      _decode_kernel, names=names, scale=scale, soft_cap=soft_cap, is_causal=is_causal,
      block_m=bm, n_m=n_m, block_k=bk, chunk=chunk, T=T, S=S, H=H, G=G, page_size=page_size,
      acc=acc, precision=common.dot_precision(q.dtype), fast_exp2=common.fast_exp2_enabled(interp))
  out, lse = pl.pallas_call(
      kernel,
      grid=(splits, B, K * n_m),   # Triton grids have three axes
      in_specs=[
          pl.BlockSpec((None, None, bm, Hp), lambda s, b, p: (b, p // n_m, p % n_m, 0)),
          kv_spec,
          kv_spec,
          pl.BlockSpec((None, 8), lambda s, b, p: (b, 0)),
          *extra_specs,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, bm, Hp), lambda s, b, p: (b, p // n_m, s, p % n_m, 0)),
          pl.BlockSpec((None, None, None, bm), lambda s, b, p: (b, p // n_m, s, p % n_m)),
      ],
      out_shape=[common.out_type((B, K, splits, M, H), q.dtype if splits == 1 else acc, qg, k,
                                 v, info, *extra),
                 common.out_type((B, K, splits, M), acc, qg, k, v, info, *extra)],
      compiler_params=common.triton_params(blocks.num_warps, blocks.num_stages),
      interpret=interp,
      name="jflash_decode",
  )(qg, k, v, info, *extra)
  if splits == 1:
    # One split's (out, lse) are the result: written in q's dtype, no merge pass.
    out, lse = out[:, :, 0], lse[:, :, 0]
  else:
    out, lse = merge_splits(out, lse)                 # [B, K, M, H], [B, K, M]
  out = out.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
  lse = lse.reshape(B, K, T, G).transpose(0, 1, 3, 2).reshape(B, N, T)
  return out.astype(q.dtype), lse
