"""The backward's dQ kernel (FlashAttention-2, Algorithm 2): grid over (query tiles,
query heads, batch; causal: the heaviest query tiles first, `query_block_order`), or a
persistent grid over those items, looping over the visited key tiles: S = Q K^T and
dP = dO V^T issued back to back, then dQ += dS' K. One warpgroup streams its own key
tiles (double buffering), or a producer warpgroup streams them to two or three
consumers of 64 query rows each.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.masking import MaskOptions, query_block_order, structured_keep, visit_tiles
from pallas_kernels.mosaic_gpu.common import (ROWS, layouts, load_vector, tile_ds, tile_p,
                                              tile_row)
from pallas_kernels.mosaic_gpu.pipeline import (Products, Stream, kernel_refs, load_fixed,
                                                producer_and_consumers, run_persistent,
                                                store_outputs, warp_specialised)
from pallas_kernels.mosaic_gpu.scheduler import count_after, counted_from, item_coords


def dq_kernel(*refs, names, opts: MaskOptions, scale, bk, num_q_blocks, group, interpret,
               consumers, stages, rows_view, rows_in_registers=False, persistent=None,
               p_under_dp=False):
  """dQ of `consumers` x 64 query rows of one query head over the visited key tiles.
  One consumer streams its own key tiles (double buffering); two or three share the
  key tiles a producer warpgroup streams (`Pipeline`), each owning 64 query rows.
  `rows_in_registers`: Q and dO enter S and dP from registers
  (`BackwardConfig.dq_rows_in_registers`); `persistent` (a `PersistentGrid`): each
  program of a producer and its consumers loops over work items (query block, head,
  batch) of the grid it stands for; `p_under_dp`: as `BackwardConfig.dq_p_under_dp`;
  `rows_view`: the tile buffers' (`kernel_refs`)."""
  r = kernel_refs(names, refs, rows_view)
  bq = ROWS
  ranges = r["ranges"]
  block_of = query_block_order(num_q_blocks, opts)
  item_at = functools.partial(_dq_program, r, Products(interpret, r.get("acc")), bq=bq,
                              bk=bk, group=group, interpret=interpret, opts=opts,
                              scale=scale, rows_in_registers=rows_in_registers,
                              p_under_dp=p_under_dp)
  if persistent is None:
    i, b, srcs, consume = item_at(block_of(lax.axis_index("q")), lax.axis_index("heads"),
                                  lax.axis_index("batch"))
    if consumers == 1:
      stream = Stream(srcs, [r["k_smem"], r["v_smem"]], r["loaded"])

      def before(t, j, hi):                # copy the next tile into the other slot
        slot = lax.rem(t, 2)
        pl.when(j + 1 < hi)(lambda: stream.start(1 - slot, j + 1))
      fixed = r["fixed_loaded"]
      consume(0, r["q_smem"], r["do_smem"], (fixed.at[0], fixed.at[1]), i * bq,
              (lambda lo: stream.start(0, lo), before, lambda t: stream.wait(lax.rem(t, 2)),
               None))
      return

  pipe, slots, consume_as = producer_and_consumers(
      r, ("q_smem", "do_smem"), ("k_smem", "v_smem"), consumers=consumers, stages=stages,
      rows=bq, generic_reads=interpret)

  def produce(srcs, b, i, count=None):
    """The visited key tiles of query block i, counted from `count` on in a persistent
    program (whose caller drains the last slots); returns the count after them."""
    lo, _, _, hi = tile_row(ranges, b, i)
    counted = counted_from(count)
    lax.fori_loop(0, hi - lo, lambda t, _: pipe(srcs).produce(counted(t), lo + t), None)
    if count is None:
      pipe(srcs).drain(hi - lo)
    return count_after(count, lambda: hi - lo)

  if persistent is None:
    warp_specialised(lax.axis_index("wg"), consumers, lambda: produce(srcs, b, i),
                      lambda wg: consume_as(wg, i, consume))
    return

  assert consumers >= 2, consumers   # config validation: a producer and consumers

  def item_of(w):
    q, n, b = item_coords(w, persistent.sizes, opts.is_causal, persistent.l2_group)
    return item_at(block_of(q), n, b)

  run_persistent(persistent, slots, item_of,
                  lambda item, count: produce(item.srcs, item.b, item.i, count),
                  lambda wg, item, count: consume_as(wg, item.i, item.consume, count),
                  snake=opts.is_causal, consumers=consumers)


def _dq_program(r, mm, i, n, b, *, bq, bk, group, interpret, opts, scale,
                rows_in_registers, p_under_dp=False):
  """The closures of one dQ work item (see `dq_kernel`), query block i of query head
  n in batch b: (i, b, srcs, consume)."""
  ranges = r["ranges"]
  H = r["q_smem"].mma.shape[-1]
  iota, query_layout, key_layout = layouts(interpret, (bq, bk))
  kv_head = lax.div(n, jnp.int32(group))
  srcs = [lambda j: r["k"].at[b, pl.ds(j * bk, bk), kv_head],
          lambda j: r["v"].at[b, pl.ds(j * bk, bk), kv_head]]

  def consume(wg, q_tiles, do_tiles, fixed_loaded, row0, tiles, count=None):
    """dQ of query rows [row0, row0 + 64). `tiles` = (start(lo), before(t, j, hi),
    acquire(t), release(t)) hand over the key tiles (t counts them, from `count` on in
    a persistent program); start and before are None when a producer streams them.
    Returns the count after this item's tiles."""
    start, before, acquire, release = tiles
    counted = counted_from(count)
    rows = pl.ds(row0, bq)
    lo, full_lo, full_hi, hi = tile_row(ranges, b, i)
    if start is not None:
      pl.when(hi > lo)(lambda: start(lo))
    load_fixed([(r["q"].at[b, rows, n], q_tiles, fixed_loaded[0]),
                 (r["do"].at[b, rows, n], do_tiles, fixed_loaded[1])])
    q_smem, do_smem = q_tiles.mma, do_tiles.mma
    q_a, do_a = (q_smem[...], do_smem[...]) if rows_in_registers else (q_smem, do_smem)
    along_keys = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
    lse2 = along_keys(load_vector(r["lse2"].at[b, n, rows], query_layout, interpret))
    delta = along_keys(load_vector(r["delta"].at[b, n, rows], query_layout, interpret))
    kv_len = ranges[b, i, 5]
    q_seg = None
    if "q_seg" in r:
      q_seg = along_keys(load_vector(r["q_seg"].at[b, rows], query_layout, interpret))

    def body(j, carry, masked, dq_acc):
      t = counted(j - lo)
      if before is not None:
        before(t, j, hi)
      keep = None
      if masked:
        kv_seg = None
        if q_seg is not None:
          kv_seg = lax.broadcast_in_dim(load_vector(
              r["kv_seg"].at[b, pl.ds(j * bk, bk)], key_layout, interpret), (bq, bk), [1])
        keep = structured_keep(row0 + iota(0), j * bk + iota(1), opts, kv_len=kv_len,
                               q_seg=q_seg, kv_seg=kv_seg)
      k_smem, v_smem = acquire(t)
      probabilities = lambda s: tile_p(s, lse2, opts=opts, scale=scale, keep=keep)
      if p_under_dp:     # S = Q K^T, dP = dO V^T, P under the second
        (p, c), dp = mm.fresh_pair(q_a, k_smem, do_a, v_smem, (bq, bk), b_t=True,
                                   under_second=probabilities)
      else:
        s, dp = mm.fresh_pair(q_a, k_smem, do_a, v_smem, (bq, bk), b_t=True)
        p, c = probabilities(s)
      mm.issue(dq_acc, tile_ds(p, c, dp, delta).astype(k_smem.dtype), k_smem)  # dQ += dS' K
      mm.wait()          # this tile's slot is refilled once the product is done
      if release is not None:
        release(t)
      return carry

    (dq,) = mm.accumulators((bq, H), 1, lambda dq_acc: visit_tiles(
        (lo, full_lo, full_hi, hi), functools.partial(body, dq_acc=dq_acc), 0), wg)
    store_outputs([(dq * scale, q_tiles, r["dq"].at[b, rows, n])])
    return count_after(count, lambda: hi - lo)

  return _DqItem(i, b, srcs, consume)


class _DqItem(NamedTuple):
  """One dQ work item's coordinates and closures (`_dq_program`)."""
  i: jax.Array
  b: jax.Array
  srcs: list
  consume: Callable
