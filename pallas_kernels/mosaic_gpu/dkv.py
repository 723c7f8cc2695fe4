"""The backward's dK/dV kernel (FlashAttention-2, Algorithm 2, with FlashAttention-3's
warp specialisation): grid over (key tiles, key heads, batch), or with `group_splits` > 1
(key tiles, key heads, splits, batch), or a persistent grid over those items. Each
program holds its keys' K and V in shared memory and loops over the query heads of its
GQA group and, inside, over the query tiles of the transposed per-tile schedule
(`build_ranges(..., transpose=True)`), computing S^T = K Q^T and dP^T = V dO^T so that
P^T and dS'^T enter dV += P^T dO and dK += dS'^T Q as register operands straight from
the accumulator; dK and dV sum in accumulator registers (no atomics, deterministic).
Above head_dim 128 the two consumers split the work by output (`_dkv_by_role`).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.masking import MaskOptions, structured_keep, visit_tiles
from pallas_kernels.mosaic_gpu.common import (ROWS, import_plgpu, layouts, load_vector,
                                              tile_ds, tile_p, tile_row)
from pallas_kernels.mosaic_gpu.configs import by_role
from pallas_kernels.mosaic_gpu.pipeline import (Pipeline, Products, kernel_refs, load_fixed,
                                                load_tile, producer_and_consumers,
                                                run_persistent, store_outputs, store_tile,
                                                warp_specialised)
from pallas_kernels.mosaic_gpu.scheduler import count_after, counted_from, item_coords


def _along_queries(ref, bq, interpret):
  """A per-query vector [bq] (in global or shared memory) broadcast along the keys of
  the dK/dV kernels' [keys, queries] tiles."""
  _, _, query_layout = layouts(interpret, (ROWS, bq))
  return lax.broadcast_in_dim(load_vector(ref, query_layout, interpret), (ROWS, bq), [1])


def _dkv_keep(r, b, i, rows, masked, kv_seg, *, bq, key0, opts, kv_len, interpret):
  """The structured mask of query tile i (its `rows`) in the dK/dV kernels' [keys,
  queries] tiles of keys [key0, key0 + 64), or None on a FULL tile."""
  if not masked:
    return None
  iota = layouts(interpret, (ROWS, bq))[0]
  q_seg = None
  if kv_seg is not None:
    q_seg = _along_queries(r["q_seg"].at[b, rows], bq, interpret)
  return structured_keep(i * bq + iota(1), key0 + iota(0), opts, kv_len=kv_len,
                         q_seg=q_seg, kv_seg=kv_seg)


def _dkv_query_side(r, b, n, i, masked, kv_seg, *, bq, key0, opts, kv_len, interpret):
  """(lse2, delta, keep) of query tile i of query head n in the dK/dV kernels' [keys,
  queries] tiles of keys [key0, key0 + 64): the per-query statistics broadcast along
  the keys, loaded from global memory, and the structured mask (`_dkv_keep`)."""
  rows = pl.ds(i * bq, bq)
  lse2 = _along_queries(r["lse2"].at[b, n, rows], bq, interpret)
  delta = _along_queries(r["delta"].at[b, n, rows], bq, interpret)
  return lse2, delta, _dkv_keep(r, b, i, rows, masked, kv_seg, bq=bq, key0=key0,
                                opts=opts, kv_len=kv_len, interpret=interpret)


def _produce_query_tiles(pipe, ranges, b, j, own, base=None):
  """The producer of the dK/dV kernels: the visited query tiles of key tile j, for each
  of the program's `own` query heads in turn (the consumers' loop order). `base`: the
  tiles the program streamed before this work item (persistent), whose count goes on
  and whose last slots the caller drains; returned with this item's added."""
  lo, _, _, hi = tile_row(ranges, b, j)
  per_head = hi - lo
  counted = counted_from(base)

  def load(t, _):
    pipe.produce(counted(t), lo + lax.rem(t, per_head), lax.div(t, per_head))
  total = own * per_head
  lax.fori_loop(0, total, load, None)
  if base is None:
    pipe.drain(total)
  return count_after(base, lambda: total)


def dkv_kernel(*refs, names, opts: MaskOptions, scale, bq, group, interpret, consumers,
                stages, rows_view, group_splits=1, persistent=None, stats_streamed=False,
                p_under_dp=False):
  """dK, dV of 2 x 64 keys of one key head, summed over the group's heads (or the
  program's share of them, `group_splits`) and the visited query tiles (S^T = K Q^T, so
  each tile is [keys, queries]): each consumer warpgroup owns 64 keys, and a producer
  warpgroup streams the query tiles both read (`Pipeline`). `persistent` (a
  `PersistentGrid`): each program loops over work items (key tile, key head, split,
  batch) of the grid it stands for; `stats_streamed`: as `BackwardConfig`'s,
  `p_under_dp` as its `dkv_p_under_dp`; `rows_view`: the tile buffers' (`kernel_refs`)."""
  r = kernel_refs(names, refs, rows_view)
  bk = ROWS
  H = r["q_smem"].mma.shape[-1]
  mm = Products(interpret, r.get("acc"))
  _, key_layout, _ = layouts(interpret, (bk, bq))
  own = group // group_splits       # query heads per program
  ranges = r["ranges"]

  def item_at(j, kv_head, split, b):
    """The work item of key tile j of key head kv_head (the split()-th share of its GQA
    group) in batch b: (j, kv_head, b, head, srcs, key_segments, consume)."""
    return _dkv_program(r, mm, j, kv_head, split, b, own=own, bk=bk, bq=bq, H=H,
                        key_layout=key_layout, group=group, group_splits=group_splits,
                        interpret=interpret, opts=opts, scale=scale,
                        stats_streamed=stats_streamed, p_under_dp=p_under_dp)

  if persistent is None:
    j, kv_head, b, head, srcs, key_segments, consume = item_at(
        lax.axis_index("kv"), lax.axis_index("heads"), lambda: lax.axis_index("split"),
        lax.axis_index("batch"))
    if by_role(H):
      _dkv_by_role(r, mm, ranges, b, j, kv_head, head, own, srcs, key_segments, opts=opts,
                   scale=scale, bq=bq, stages=stages, interpret=interpret)
      return

  streamed = ("q_smem", "do_smem") + (("lse_smem", "delta_smem") if stats_streamed else ())
  pipe, slots, consume_as = producer_and_consumers(
      r, ("k_smem", "v_smem"), streamed, consumers=consumers, stages=stages, rows=bk,
      generic_reads=interpret or stats_streamed)
  if persistent is None:
    warp_specialised(lax.axis_index("wg"), consumers,
                      lambda: _produce_query_tiles(pipe(srcs), ranges, b, j, own),
                      lambda wg: consume_as(wg, j, consume))
    return

  # Config validation keeps the persistent grid off the head dims split by role.
  assert not by_role(H), H

  def item_of(w):
    coords = item_coords(w, persistent.sizes, opts.is_causal, persistent.l2_group)
    if group_splits == 1:       # the grid (key tiles, key heads, batch)
      j, kv_head, b = coords
      return item_at(j, kv_head, None, b)
    j, kv_head, split, b = coords
    return item_at(j, kv_head, lambda: split, b)

  def produce(item, count):
    return _produce_query_tiles(pipe(item.srcs), ranges, item.b, item.j, own, base=count)

  def consume(wg, item, count):
    return consume_as(wg, item.j, item.consume, count)
  run_persistent(persistent, slots, item_of, produce, consume, snake=opts.is_causal)


def _dkv_program(r, mm, j, kv_head, split, b, *, own, bk, bq, H, key_layout, group,
                 group_splits, interpret, opts, scale, stats_streamed=False,
                 p_under_dp=False):
  """The closures of one dK/dV work item (see `dkv_kernel`; `split` returns the
  item's group split where there are several): (j, kv_head, b, head, srcs,
  key_segments, consume)."""
  ranges = r["ranges"]

  def head(g):
    """The query head that is the program's g-th (g < own): program `split` of its key
    tile's group_splits runs the group's heads [split * own, (split + 1) * own)."""
    if group_splits > 1:
      g = split() * own + g
    return kv_head * group + g
  # Query tiles stream in the loop order: every visited tile of the program's first
  # head, then of its second, ...
  srcs = [lambda i, g: r["q"].at[b, pl.ds(i * bq, bq), head(g)],
          lambda i, g: r["do"].at[b, pl.ds(i * bq, bq), head(g)]]
  if stats_streamed:      # the tile's lse and delta beside them
    srcs += [lambda i, g: r["lse2"].at[b, head(g), pl.ds(i * bq, bq)],
             lambda i, g: r["delta"].at[b, head(g), pl.ds(i * bq, bq)]]

  def key_segments(keys):
    if "kv_seg" not in r:
      return None
    return lax.broadcast_in_dim(
        load_vector(r["kv_seg"].at[b, keys], key_layout, interpret), (bk, bq), [0])

  def consume(wg, k_tiles, v_tiles, fixed_loaded, key0, tiles, count=None):
    """dK, dV of keys [key0, key0 + 64). `tiles` = (start(lo), before(t, i, g, lo, hi),
    acquire(t), release(t)) hand over the query tiles in loop order (t counts them,
    from `count` on in a persistent program); start and before are None when a
    producer streams them. Returns the count after this item's tiles."""
    start, before, acquire, release = tiles
    counted = counted_from(count)
    keys = pl.ds(key0, bk)
    load_fixed([(r["k"].at[b, keys, kv_head], k_tiles, fixed_loaded[0]),
                 (r["v"].at[b, keys, kv_head], v_tiles, fixed_loaded[1])])
    k_smem, v_smem = k_tiles.mma, v_tiles.mma
    lo, full_lo, full_hi, hi = tile_row(ranges, b, j)
    kv_seg = key_segments(keys)
    tile = dict(bq=bq, key0=key0, opts=opts, kv_len=ranges[b, j, 5], interpret=interpret)
    query_side = functools.partial(_dkv_query_side, r, b, **tile)
    keep_of = functools.partial(_dkv_keep, r, b, **tile)   # stats_streamed: the mask alone
    if start is not None:
      pl.when(hi > lo)(lambda: start(lo))

    def body(i, carry, g, masked, dk_acc, dv_acc):
      n = head(g)
      t = counted(g * (hi - lo) + i - lo)
      if before is not None:
        before(t, i, g, lo, hi)
      rows = pl.ds(i * bq, bq)
      if stats_streamed:     # lse and delta read from the slot where they are used
        keep = keep_of(i, rows, masked, kv_seg)
        q_smem, do_smem, lse_smem, delta_smem = acquire(t)
      else:
        lse2, delta, keep = query_side(n, i, masked, kv_seg)
        q_smem, do_smem = acquire(t)

      def probabilities(s_t):
        lse = _along_queries(lse_smem, bq, interpret) if stats_streamed else lse2
        return tile_p(s_t, lse, opts=opts, scale=scale, keep=keep)
      if p_under_dp:
        # S^T = K Q^T and dP^T = V dO^T back to back, P^T under the second; then dV +=
        # P^T dO, with dS'^T computed under it.
        (p_t, c), dp_t = mm.fresh_pair(k_smem, q_smem, v_smem, do_smem, (bk, bq), b_t=True,
                                       under_second=probabilities)
        mm.issue(dv_acc, p_t.astype(do_smem.dtype), do_smem)
      else:
        p_t, c = probabilities(mm.fresh(k_smem, q_smem, (bk, bq), b_t=True))  # S^T = K Q^T
        # dP^T = V dO^T, then dV += P^T dO issued behind it: dS'^T is computed under
        # the dV product, and dK += dS'^T Q follows it on the tensor cores.
        dp_t = mm.fresh_under(v_smem, do_smem, (bk, bq), b_t=True,
                              then=(dv_acc, p_t.astype(do_smem.dtype), do_smem))
      if stats_streamed:
        delta = _along_queries(delta_smem, bq, interpret)
      ds_t = tile_ds(p_t, c, dp_t, delta).astype(q_smem.dtype)
      mm.issue(dk_acc, ds_t, q_smem)
      mm.wait()          # this tile's slot is refilled once its products are done
      if release is not None:
        release(t)
      return carry

    # The program's query heads run as a loop of the program (its size does not grow
    # with the group); their dK/dV sum in the same accumulators.
    def heads(dk_acc, dv_acc):
      lax.fori_loop(0, own, lambda g, c: visit_tiles(
          (lo, full_lo, full_hi, hi),
          functools.partial(body, g=g, dk_acc=dk_acc, dv_acc=dv_acc), c), 0)

    dk, dv = mm.accumulators((bk, H), 2, heads, wg)
    if group_splits == 1:
      store_outputs([(dk * scale, k_tiles, r["dk"].at[b, keys, kv_head]),
                      (dv, v_tiles, r["dv"].at[b, keys, kv_head])])
    else:
      # Partial sums over the program's heads, summed over the splits by flash_backward:
      # float32 through a float32 tile, so that only the total is rounded to the input
      # dtype (k_smem and v_smem would round each partial).
      this_split, partial = split(), r["partial_smem"].at[wg]
      store_tile(dk * scale, partial, r["dk"].at[b, this_split, keys, kv_head])
      store_tile(dv, partial, r["dv"].at[b, this_split, keys, kv_head])
    return count_after(count, lambda: own * (hi - lo))

  return _DkvItem(j, kv_head, b, head, srcs, key_segments, consume)


class _DkvItem(NamedTuple):
  """One dK/dV work item's coordinates and closures (`_dkv_program`)."""
  j: jax.Array
  kv_head: jax.Array
  b: jax.Array
  head: Callable
  srcs: list
  key_segments: Callable
  consume: Callable


# The two consumers of the dK/dV kernel at head dims split by role (`by_role`).
DK_ROLE, DV_ROLE = 0, 1


def _dkv_by_role(r, mm, ranges, b, j, kv_head, head, own, srcs, key_segments, *, opts, scale,
                 bq, stages, interpret):
  """dK and dV of the 64 keys of key tile j, split by output between two consumers
  (`by_role`), two matrix products each per tile, with a producer warpgroup streaming
  the query tiles both read (`Pipeline`):
  - DK_ROLE (holds K): S^T = K Q^T, P^T, which it writes (in the input dtype) to one of
    two "p" slots for the other consumer, then, with that consumer's dP^T, dS'^T and
    dK += dS'^T Q from registers;
  - DV_ROLE (holds V): dP^T = V dO^T, issued as the other issues S^T, which it writes
    in float32 to the "dp" slot (dS' = P (dP - delta) subtracts two close numbers:
    rounded first, dP would lose the difference), then dV += P^T dO from the p slot.
  Each slot's "ready" barrier completes when written and its "free" barrier when read;
  every completion is waited on once."""
  plgpu = import_plgpu()
  bk, H = ROWS, r["q_smem"].mma.shape[-1]
  keys = pl.ds(j * bk, bk)
  lo, full_lo, full_hi, hi = tile_row(ranges, b, j)
  per_head = hi - lo
  total = own * per_head
  pipe = Pipeline(srcs, [r["q_smem"], r["do_smem"]], r["loaded"], r["consumed"], stages,
                  generic_reads=interpret)
  p_smem, p_ready, p_free = r["p_smem"], r["p_ready"], r["p_free"]
  dp_smem, dp_ready, dp_free = r["dp_smem"], r["dp_ready"], r["dp_free"]
  fixed = r["fixed_loaded"]

  def dk_consumer():
    load_tile(r["k"].at[b, keys, kv_head], r["k_smem"], fixed.at[0])
    k_smem = r["k_smem"].mma
    kv_seg = key_segments(keys)
    query_side = functools.partial(_dkv_query_side, r, b, bq=bq, key0=j * bk, opts=opts,
                                   kv_len=ranges[b, j, 5], interpret=interpret)

    def body(i, carry, g, masked, dk_acc):
      t = g * per_head + i - lo
      lse2, delta, keep = query_side(head(g), i, masked, kv_seg)
      q_smem, _ = pipe.acquire(t)
      p_t, c = tile_p(mm.fresh(k_smem, q_smem, (bk, bq), b_t=True), lse2, opts=opts,
                       scale=scale, keep=keep)                      # S^T = K Q^T
      slot = lax.rem(t, 2)
      pl.when(t >= 2)(lambda: plgpu.barrier_wait(p_free.at[slot]))   # read two tiles ago
      p_smem.at[slot][...] = p_t.astype(q_smem.dtype)
      plgpu.commit_smem()          # visible to the tensor cores' reads
      plgpu.barrier_arrive(p_ready.at[slot])
      plgpu.barrier_wait(dp_ready.at[0])
      dp_t = dp_smem[...]
      plgpu.barrier_arrive(dp_free.at[0])
      mm.issue(dk_acc, tile_ds(p_t, c, dp_t, delta).astype(q_smem.dtype), q_smem)
      mm.wait()                    # this tile's slot is refilled once its products are done
      pipe.release(t)
      return carry

    (dk,) = mm.accumulators((bk, H), 1, lambda dk_acc: lax.fori_loop(
        0, own, lambda g, c: visit_tiles((lo, full_lo, full_hi, hi), functools.partial(
            body, g=g, dk_acc=dk_acc), c), 0), DK_ROLE)
    lax.fori_loop(jnp.maximum(0, total - 2), total,     # the last two tiles' "p_free"
                  lambda t, _: plgpu.barrier_wait(p_free.at[lax.rem(t, 2)]), None)
    store_tile(dk * scale, r["k_smem"], r["dk"].at[b, keys, kv_head])

  def dv_consumer():
    load_tile(r["v"].at[b, keys, kv_head], r["v_smem"], fixed.at[1])
    v_smem = r["v_smem"].mma

    def body(t, _, dv_acc):
      _, do_smem = pipe.acquire(t)
      dp_t = mm.fresh(v_smem, do_smem, (bk, bq), b_t=True)         # dP^T = V dO^T
      pl.when(t >= 1)(lambda: plgpu.barrier_wait(dp_free.at[0]))    # the last one read
      dp_smem[...] = dp_t
      plgpu.barrier_arrive(dp_ready.at[0])
      slot = lax.rem(t, 2)
      plgpu.barrier_wait(p_ready.at[slot])
      mm.issue(dv_acc, p_smem.at[slot], do_smem)
      mm.wait()
      plgpu.barrier_arrive(p_free.at[slot])
      pipe.release(t)

    (dv,) = mm.accumulators((bk, H), 1, lambda dv_acc: lax.fori_loop(
        0, total, functools.partial(body, dv_acc=dv_acc), None), DV_ROLE)
    pl.when(total >= 1)(lambda: plgpu.barrier_wait(dp_free.at[0]))  # the last tile's
    store_tile(dv, r["v_smem"], r["dv"].at[b, keys, kv_head])

  def consume(wg):
    pl.when(wg == DK_ROLE)(dk_consumer)
    pl.when(wg == DV_ROLE)(dv_consumer)
  warp_specialised(lax.axis_index("wg"), 2, lambda: _produce_query_tiles(
      pipe, ranges, b, j, own), consume)
