"""FlashAttention-2 forward kernel: (q, k, v) -> (out, lse).

Grid (query block, batch, head): each program owns one [block_q, H] tile of Q and
loops over key/value blocks, keeping the running max `m_i`, running sum `l_i` and
the unnormalised output `acc` in float32 (FlashAttention-2, Algorithm 1). Logits are
kept in base 2 (`exp2`, scale folded with log2(e)); lse is returned in natural log.
No [T, S] array exists anywhere.

Each program reads its key-block range (lo, full_lo, full_hi, hi) from a small table:
tiles outside [lo, hi) are never loaded, tiles in [full_lo, full_hi) run without any
element-wise mask, and only the boundary tiles in between apply one.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, build_ranges, dropout_scale,
                                    kernel_operands, query_block_order, query_offset,
                                    tile_scores, times, visit_tiles)
from pallas_kernels.tuning import BlockSizes, default_block_sizes, launch_params, padded_head_dim


def _fwd_kernel(*refs, names, opts: MaskOptions, scale, block_q, block_k, T, S, H, num_heads,
                acc, precision, q_order, fast_exp2):
  r = dict(zip(names, refs))
  i, b, n = q_order(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
  row0 = i * block_q
  rows_in = common.tail(row0, T, block_q)          # the last query block may overrun T
  q = common.load_heads(r["q"], (slice(None),), rows_in, H)        # [bq, H] in head-dim pieces, resident
  ranges = r["ranges"]
  q_len, kv_len, q_offset = ranges[4], ranges[5], query_offset(ranges, opts)
  q_seg = common.load(r["q_seg"], rows_in, other=FILL["q_seg"]) if "q_seg" in r else None
  seed = r["seed"][0] if "seed" in r else None
  m_i = jnp.full((block_q,), -jnp.inf, acc)
  l_i = jnp.zeros((block_q,), acc)
  o = tuple(jnp.zeros(x.shape, acc) for x in q)

  def body(j, carry, masked):
    o, m_i, l_i = carry
    t = key_tile(r, j, block_k=block_k, S=S, H=H, rows_in=rows_in, masked=masked)
    k, v, col0 = t.k, t.v, t.col0
    s, _, c = tile_scores(
        q, k, scale=scale, opts=opts, acc=acc, precision=precision, row0=row0,
        col0=col0, masked=masked, kv_len=kv_len, q_offset=q_offset, q_seg=q_seg,
        kv_seg=t.kv_seg, mask_tile=t.mask, bias_tile=t.bias)
    # -- update m_i and l_i (base 2: the logits are s * c, c > 0). A row with nothing
    # visible yet has m = -inf; use 0 in its place so exp2 never sees (-inf) - (-inf).
    m_new = jnp.maximum(m_i, times(jnp.max(s, axis=1), c))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new).astype(acc)
    alpha = common.exp2(m_i - m_safe, fast_exp2)
    p = common.exp2(times(s, c) - m_safe[:, None], fast_exp2)  # one FMA per element
    l_i = alpha * l_i + jnp.sum(p, axis=1)   # the normaliser counts every visible key...
    if seed is not None:                     # ...only kept ones reach the output
      p = p * dropout_scale(seed, b, n, row0, col0, s.shape, opts.dropout_rate, num_heads)
    pv = common.dot_into_heads(p, v, acc=acc, precision=precision)
    o = tuple(alpha[:, None] * o_h + pv_h for o_h, pv_h in zip(o, pv))
    return o, m_new, l_i

  o, m_i, l_i = visit_tiles(ranges, body, (o, m_i, l_i))

  # -- normalise once at the end (FlashAttention-2, section 3.1.1). A row that saw no
  # key, or lies past the query length, returns 0 and lse = -inf. "Saw no key" is
  # l == 0 exactly: every visible key adds exp2(s - m) with one term equal to 1, while a
  # NaN logit makes l NaN, and NaN must reach out and lse. (Testing m instead would not
  # do: Triton lowers max to maxnumf, which drops NaN, so m can stay -inf beside a NaN.)
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  has = (l_i != 0) & (rows < q_len)
  l_safe = jnp.where(has, l_i, 1.0)
  common.store_heads(r["out"], [jnp.where(has[:, None], o_h / l_safe[:, None], 0.0) for o_h in o],
                     rows_in, H)
  common.store(r["lse"], jnp.where(has, (m_i + jnp.log2(l_safe)) * common.LN2,
                                   -jnp.inf).astype(r["lse"].dtype), rows_in)


class KeyTile(NamedTuple):
  col0: jax.Array          # first key of the tile
  cols: pl.Slice           # the tile's keys
  cols_in: jax.Array | None  # which of them exist (None: all, the tile ends inside S)
  k: tuple[jax.Array, ...]  # head-dim pieces (common.head_pieces)
  v: tuple[jax.Array, ...]
  kv_seg: jax.Array | None
  mask: jax.Array | None   # [bq, bk] of the dense mask, or None
  bias: jax.Array | None


def key_tile(r, j, *, block_k, S, H, rows_in, masked) -> KeyTile:
  """Key tile j of a kernel whose program owns one query tile (the forward, dQ): K, V
  and the per-key and per-element mask operands. Only masked tiles can hold the key
  tail (a FULL tile ends inside S), so only their loads are masked."""
  col0 = j * block_k
  cols = pl.ds(col0, block_k)
  cols_in = common.tail(col0, S, block_k) if masked else None
  k = common.load_heads(r["k"], (cols,), cols_in, H)
  v = common.load_heads(r["v"], (cols,), cols_in, H)
  kv_seg = (common.load(r["kv_seg"].at[cols], cols_in, other=FILL["kv_seg"])
            if "kv_seg" in r else None)
  dense = lambda name: (common.load(r[name].at[:, cols], rows_in, cols_in, other=FILL[name])
                        if name in r else None)
  return KeyTile(col0, cols, cols_in, k, v, kv_seg, dense("mask"), dense("bias"))


def mask_inputs(ops: MaskOperands, *, Sp, bq, q_index):
  """(names, arrays, specs) of the optional per-tile mask operands of a kernel whose
  grid runs over query blocks: `q_index(*grid point)` = (batch, head, query block)."""
  x = kernel_operands(ops)
  specs = {
      "q_seg": pl.BlockSpec((None, bq), lambda *g: (q_index(*g)[0], q_index(*g)[2])),
      "kv_seg": pl.BlockSpec((None, Sp), lambda *g: (q_index(*g)[0], 0)),
      "seed": pl.BlockSpec((1,), lambda *g: (0,)),
  }
  for name in ("mask", "bias"):
    if name in x:
      bb, nb = x[name].shape[0] > 1, x[name].shape[1] > 1

      def index(*g, bb=bb, nb=nb):
        b, n, i = q_index(*g)
        return (b if bb else 0, n if nb else 0, i, 0)
      specs[name] = pl.BlockSpec((None, None, bq, Sp), index)
  names = list(x)
  return names, [x[n] for n in names], [specs[n] for n in names]


def flash_forward(q, k, v, *, scale: float, opts: MaskOptions | None = None,
                  ops: MaskOperands | None = None, block_sizes: BlockSizes | None = None,
                  interpret: bool | None = None, is_causal: bool | None = None):
  """q [B, T, N, H], k/v [B, S, K, H] -> out [B, T, N, H], lse [B, N, T] (natural log).

  No input is copied: blocks are whole power-of-two tiles laid over the arrays as they
  are, and the loads and stores of tiles that overrun T, S or H are masked. A head dim
  that is not a power of two is split into power-of-two pieces (`common.head_pieces`),
  one matrix product each.
  """
  opts = opts or MaskOptions(is_causal=bool(is_causal))
  ops = ops or MaskOperands()
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  blocks = block_sizes or default_block_sizes(H)
  bq = common.fit_block(blocks.block_q, T)
  bk = common.fit_block(blocks.block_k, S)
  Hp = padded_head_dim(H)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  acc = common.acc_dtype(q.dtype)
  warps, stages = launch_params(H, blocks, "fwd")
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
  qo = query_block_order(Tp // bq, opts)
  extra_names, extra_arrays, extra_specs = mask_inputs(
      ops, Sp=Sp, bq=bq, q_index=lambda i, b, n: (b, n, qo(i)))
  names = ["q", "k", "v", "ranges", *extra_names, "out", "lse"]
  kernel = functools.partial(
      _fwd_kernel, names=names, opts=opts, scale=scale, block_q=bq, block_k=bk, T=T, S=S,
      H=H, num_heads=N, acc=acc, precision=common.dot_precision(q.dtype), q_order=qo,
      fast_exp2=common.fast_exp2_enabled(common.use_interpret(interpret)))
  return pl.pallas_call(
      kernel,
      grid=(Tp // bq, B, N),
      in_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, qo(i), n, 0)),
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
          pl.BlockSpec((None, None, 8), lambda i, b, n: (b, qo(i), 0)),
          *extra_specs,
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, qo(i), n, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, qo(i))),
      ],
      out_shape=[common.out_type((B, T, N, H), q.dtype, q, k, v, *extra_arrays),
                 common.out_type((B, N, T), acc, q, k, v, *extra_arrays)],
      compiler_params=common.triton_params(warps, stages),
      interpret=common.use_interpret(interpret),
      name="jflash_fwd",
  )(q, k, v, ranges, *extra_arrays)
