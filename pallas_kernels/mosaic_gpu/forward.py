"""FlashAttention forward on Pallas Mosaic GPU for Hopper: (q, k, v) -> (out, lse).

One program per work item (batch, head, block of consumers * block_q query rows), or
with `persistent` one per multiprocessor looping over the items, runs a producer and
two (or three) consumer warpgroups (FlashAttention-3, section 3.1, warp specialisation):

- a producer warpgroup that only issues bulk tensor copies (TMA) of K and V tiles into
  `stages` shared-memory slots, each slot guarded by a "loaded" barrier (completed by
  the copy engine) and a "consumed" barrier (one arrival per consumer);
- the consumer warpgroups, each owning block_q query rows (a warpgroup matrix product
  has M = 64 rows per warpgroup), that compute S = Q K^T and O += P V with `wgmma` and
  the online softmax in registers.

Two consumers are staggered by one "schedule" barrier of two arrivals (FlashAttention-3,
section 3.1, ping-pong scheduling): while one warpgroup runs its softmax (exp2 on the
multi-function unit) the other's matrix products own the tensor cores. Three consumers
run unsynchronised (more warps per scheduler to hide the softmax's latencies, as
FlashAttention-3 does at head_dim 64). The producer shrinks its register file
(`setmaxnreg`) so the consumers can grow theirs.

Which key tiles a block visits comes from the same per-tile schedule as the Triton
kernels (`pallas_kernels.masking.build_ranges`, for the consumers * block_q rows the
consumers share): [lo, hi) is visited, [full_lo, full_hi) with no element-wise mask.
Under the static rules alone each program computes its row from the block index
(`StaticRanges`), otherwise loads it from the table. Producer and consumers take the
same row, so every slot barrier completes exactly as often as it is waited on; with
`consumer_ranges` a consumer computes only its own block_q rows' range inside it (a
second row) and idles through the others with the same barrier operations. Logits stay
in base 2 with scale * log2(e) folded into the one FMA before exp2; lse is returned in
natural log.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import out_type, round_up
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, StaticRanges,
                                    build_ranges, query_block_order, structured_keep)
from pallas_kernels.mosaic_gpu.common import (LN2, LOG2E, compiler_params,
                                              device_sms, import_plgpu, kv_length, load_vector,
                                              map_rows, pad_axis, rows_are_swizzle_rows,
                                              tile_row, tile_smem, Tiles)
from pallas_kernels.mosaic_gpu.configs import MosaicConfig, check_forward, forward_q_slots
from pallas_kernels.mosaic_gpu.heuristics import default_config, launched_grid
from pallas_kernels.mosaic_gpu.scheduler import item_coords, persistent_items

# Lazy rescaling (FlashAttention-4's conditional rescaling). The online softmax's
# result does not depend on the max its exponentials are taken against, only its range
# does: with a stale max m' <= m the probabilities are at most 2^(m - m'). A row keeps
# m' until a tile's max exceeds it by more than RESCALE_THRESHOLD (base-2 logits), so P
# <= 2^8, well inside bf16, fp16 and float32, and once a row's max settles, O (a
# [block_q, head_dim] float32 accumulator) is rescaled only in the rare tile that
# moves it.
RESCALE_THRESHOLD = 8.0


def lazy_max(m_i, m_new):
  """The row max P is taken against under `lazy_rescale`: the stale m_i unless the
  tile's running max m_new passes it by more than RESCALE_THRESHOLD. A row that has
  seen nothing (m_i = -inf) takes m_new; a NaN fails the comparison and keeps m_i (its
  exponentials and sum are NaN all the same)."""
  return jnp.where(m_new > m_i + RESCALE_THRESHOLD, m_new, m_i)


def scale_moved_rows(acc, alpha):
  """acc * alpha by rows (alpha is 1.0 exactly in a row whose max did not move), the
  multiplies skipped in each warp where no row moved: a row of alpha 1.0 multiplied or
  not is the same. The test is a warp vote (`vote.sync.any`, PTX ISA), so the branch
  is uniform across the warp's lanes; the rows a warp holds in the accumulator layout
  are its own (WGMMA_LAYOUT: 16 of each 64). (The interpreter, which has no in-place
  accumulator, multiplies every row with P V's: `pv_product`.)"""
  plgpu = import_plgpu()
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout, layout.reduce(1)),
                     return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=layout))
  def scaled(_, acc, alpha):
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    one = arith.constant(f32, 1.0)
    moved = None               # this thread's rows: any alpha != 1 (unordered: NaN too)
    for reg in alpha.registers.flat:
      values = [reg]
      if isinstance(reg.type, ir.VectorType):
        values = [vector.extract(reg, dynamic_position=[],
                                 static_position=ir.DenseI64ArrayAttr.get([i]))
                  for i in range(ir.VectorType(reg.type).shape[0])]
      for x in values:
        ne = arith.cmpf(arith.CmpFPredicate.UNE, x, one)
        moved = ne if moved is None else arith.ori(moved, ne)
    any_moved = llvm.inline_asm(
        i32, [arith.extui(i32, moved)],
        "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; "
        "selp.u32 $0, 1, 0, p; }", "=r,r", has_side_effects=True)
    regs = list(acc.registers.flat)
    branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, any_moved, arith.constant(i32, 0)),
                      [r.type for r in regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scf.yield_(list((acc * alpha.broadcast_minor(acc.shape[1])).registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(regs)
    out = np.empty(acc.registers.shape, dtype=object)
    out.flat[:] = list(branch.results)
    return type(acc)(_registers=out, _layout=acc.layout, _is_signed=None)
  return scaled(acc, alpha)


def _kernel(*refs, names, static_ranges, opts: MaskOptions, scale, config: MosaicConfig,
            group, items_grid, num_ctas, rows_view, dtype, interpret):
  plgpu = import_plgpu()
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout, col_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
  r = dict(zip(names, refs)) | static_ranges
  # Each tile buffer as the products read it and as the copies move it (`Tiles`).
  (qo_smem, qo_rows), (k_smem, k_rows), (v_smem, v_rows) = (
      Tiles.of(r[name], rows_view) for name in ("qo_smem", "k_smem", "v_smem"))
  lse_smem = r["lse_smem"]
  k_loaded, v_loaded, q_loaded = r["k_loaded"], r["v_loaded"], r["q_loaded"]
  k_consumed, v_consumed, schedule = r["k_consumed"], r["v_consumed"], r["schedule"]
  bq, bk, stages, C = config.block_q, config.block_k, config.stages, config.consumers
  q_slots, H = qo_smem.shape[0], qo_smem.shape[-1]
  wg = lax.axis_index("wg")
  # Register layouts: the tile layout of the matrix-product accumulator and its rows
  # and columns. The interpreter keeps plain arrays and has no layout casts.
  if interpret:
    cast = lambda x, layout: x
    iota = lambda dim: lax.broadcasted_iota(jnp.int32, (bq, bk), dim)
  else:
    cast = plgpu.layout_cast
    iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=wgmma_layout)

  # The launched grid: (query blocks, heads, batch), or (batch, heads, query blocks)
  # with a causal mask where `launch_side_by_side`. Mosaic GPU reverses a grid
  # onto CUDA's block indices (jax/_src/pallas/mosaic_gpu/lowering.py), and the
  # hardware starts blocks about in linear order, x fastest (CUDA promises no order):
  # level by level, every (batch, head)'s heaviest block (`query_block_order`) before
  # any's next one; side by side, each pair's blocks, heaviest first, before the next
  # pair's.
  num_q_blocks = items_grid[0]
  block_of = query_block_order(num_q_blocks, opts)

  def for_each_item(item):
    """Runs `item((query block, head, batch), tiles, k, following)` over this program's
    work items; `tiles` counts the key tiles the program has passed through its slots
    so far (None in a program of one item; from 0 in a persistent one), so every
    warpgroup derives the same slot and barrier phase for each tile; k is the item's
    place in the program's sequence and `following` (whether the program has another
    item, its coordinates), None in a program of one item. Returns the count after the
    last item. A persistent program runs its items through `persistent_items`, in
    snake order with a causal mask."""
    if num_ctas is None:     # one item per program
      coords = (block_of(lax.axis_index("q")), lax.axis_index("heads"), lax.axis_index("batch"))
      return item(coords, None, 0, None)

    def coords_of(w):
      level, head, batch = item_coords(w, items_grid, opts.is_causal)
      return block_of(level), head, batch

    return persistent_items(
        math.prod(items_grid), num_ctas,
        lambda w, tiles, step: item(coords_of(w), tiles, step.k,
                                    (step.has_next, coords_of(step.next_item))),
        opts.is_causal)

  def schedule_arrive():
    if config.ping_pong:
      plgpu.barrier_arrive(schedule)

  def schedule_wait():
    if config.ping_pong:
      plgpu.barrier_wait(schedule)

  def schedule_turn():
    schedule_arrive()
    schedule_wait()

  def tile_range(i, b):
    return tile_row(r["ranges"], b, i) + (kv_length(r["ranges"], b, i),)

  def own_tile_range(i, b, lo, hi):
    """(lo, full_lo, full_hi, hi) of this consumer's own rows (`consumer_ranges`),
    clamped into the program's [lo, hi), whose tiles the producer streams."""
    own_lo, own_full_lo, own_full_hi, own_hi = tile_row(r["own_ranges"], b, i * C + wg)
    a = jnp.clip(own_lo, lo, hi)
    d = jnp.clip(own_hi, a, hi)
    full_lo = jnp.clip(own_full_lo, a, d)
    return a, full_lo, jnp.clip(own_full_hi, full_lo, d), d

  def release(consumed):
    """A consumer's arrival on a K or V slot's consumed barrier, after which the
    producer refills the slot by a bulk copy, an async-proxy write. The tensor cores'
    reads are async-proxy too; the interpreter's products are plain loads (generic
    proxy), which only a proxy fence orders before that write (PTX ISA, memory
    consistency model, "proxies"; `pipeline.Pipeline` likewise)."""
    if interpret:
      plgpu.commit_smem()
    plgpu.barrier_arrive(consumed)

  consumer_registers, producer_registers = config.register_split()
  lazy = config.lazy_rescale
  pv_in_place = not interpret   # the interpreter has no in-place accumulator

  @pl.when(wg < C)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")

    def first_row(i):
      return i * (C * bq) + wg * bq

    def load_q(coords, q_slot):
      i, n, b = coords
      plgpu.copy_gmem_to_smem(r["q"].at[b, pl.ds(first_row(i), bq), n],
                              qo_rows.at[q_slot, wg], q_loaded.at[q_slot * C + wg])

    def item(coords, tiles, k, following):
      i, n, b = coords
      lo, full_lo, full_hi, hi, kv_len = tile_range(i, b)
      passed = lambda j: j - lo if tiles is None else tiles + j - lo
      slot_of = lambda j: lax.rem(passed(j), stages)
      row0 = first_row(i)
      # Q's slots (`forward_q_slots`): with two, item k's Q was loaded during item k - 1
      # (the first item's here), and item k + 1's goes into the other slot once item
      # k - 1's O and lse, stored from it, have been read out of shared memory.
      q_slot = 0 if q_slots == 1 else lax.rem(k, 2)
      q_smem, q_rows = qo_smem.at[q_slot, wg], qo_rows.at[q_slot, wg]
      if q_slots == 1:
        load_q(coords, q_slot)
      else:
        pl.when(k == 0)(lambda: load_q(coords, q_slot))
      q_seg = None
      if "q_seg" in r:
        q_seg = load_vector(r["q_seg"].at[b, pl.ds(row0, bq)], row_layout, interpret)
        q_seg = lax.broadcast_in_dim(q_seg, (bq, bk), [0])
      plgpu.barrier_wait(q_loaded.at[q_slot * C + wg])
      if q_slots == 2:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        has_next, next_coords = following
        pl.when(has_next)(lambda: load_q(next_coords, 1 - q_slot))

      m_i = cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
      l_i = cast(jnp.zeros((bq,), jnp.float32), row_layout)
      acc = cast(jnp.zeros((bq, H), jnp.float32), wgmma_layout)

      def online_softmax(s, j, masked, m_i, l_i):
        """(P in the input dtype, the rescale factor alpha, the new row max and row sum)
        of key tile j from its raw scores s."""
        s, m_new, m_use, alpha = new_max(s, j, masked, m_i)
        p16, l_i = probabilities(s, m_use, alpha, l_i)
        return p16, alpha, m_new, l_i

      # Base-2 logits are s * c. The row max commutes with c only for c > 0; a soft cap
      # or a scale <= 0 is applied to s first (`new_max`).
      scale_first = not scale * LOG2E > 0
      c = LOG2E if opts.soft_cap is not None or scale_first else scale * LOG2E

      def new_max(s, j, masked, m_i):
        """(s with the soft cap or scale and the mask applied, the new row max, the max
        P is taken against, the rescale factor alpha) of key tile j from its raw scores."""
        if opts.soft_cap is not None:
          s = opts.soft_cap * jnp.tanh(s * (scale / opts.soft_cap))
        elif scale_first:
          s = s * scale
        if masked:
          rows = row0 + iota(0)
          cols = j * bk + iota(1)
          kv_seg = None
          if q_seg is not None:
            kv_seg = load_vector(r["kv_seg"].at[b, pl.ds(j * bk, bk)], col_layout, interpret)
            kv_seg = lax.broadcast_in_dim(kv_seg, (bq, bk), [1])
          keep = structured_keep(rows, cols, opts, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
          s = jnp.where(keep, s, -jnp.inf)
        # Online softmax in base 2 (FlashAttention-2, Algorithm 1). In a masked tile a
        # row may have seen nothing yet (m = -inf): 0 stands in so that exp2 never sees
        # (-inf) - (-inf). A NaN logit makes its row's sum NaN, and so its output.
        m_new = jnp.maximum(m_i, s.max(axis=1) * c)
        if lazy:
          m_new = lazy_max(m_i, m_new)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m_i - m_use)
        if lazy:           # exactly 1 where the max stayed (`scale_moved_rows`)
          alpha = jnp.where(m_new == m_i, 1.0, alpha)
        return s, m_new, m_use, alpha

      def probabilities(s, m_use, alpha, l_i):
        """(P in the input dtype, the new row sum) from `new_max`'s s, m_use, alpha."""
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        return p.astype(dtype), l_i

      def sequential(acc, m_i, l_i):
        """The key tiles, each consumer's products and softmax one after the other; with
        `ping_pong` the two consumers staggered by the schedule barrier so that one's
        softmax runs under the other's products (FlashAttention-3, 3.1). With
        `scores_ahead` a tile's P V product and the next tile's S = Q K^T are issued back
        to back and waited for together, so the tensor cores go from one to the other
        without the wait for P V, the loop's turn and a new issue between them; tile j's
        S is then computed in tile j - 1's step and reaches tile j through the carry."""
        # The tile classes: masked, unmasked, masked (`build_ranges`); with
        # `consumer_ranges` this consumer's own, between tiles it idles through (None).
        classes = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
        if config.consumer_ranges:
          mine = own_tile_range(i, b, lo, hi)
          classes = ((lo, mine[0], None), (mine[0], mine[1], True), (mine[1], mine[2], False),
                     (mine[2], mine[3], True), (mine[3], hi, None))
        zero_scores = lambda: cast(jnp.zeros((bq, bk), jnp.float32), wgmma_layout)

        def issue_scores(s_ref, j):
          plgpu.wgmma(s_ref, q_smem, k_smem.at[slot_of(j)].transpose((1, 0)))

        def scores(j):
          """S of tile j (its K slot awaited), after the turn that hands the tensor
          cores to the other consumer."""
          if interpret:      # the interpreter's wgmma takes no transposed operand
            s = jnp.dot(q_smem[...], k_smem[slot_of(j)].T, preferred_element_type=jnp.float32)
            schedule_turn()
            return s

          def qk(s_ref):
            issue_scores(s_ref, j)
            schedule_turn()              # hand the tensor cores to the other consumer
            return s_ref[...]
          return pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))

        def softmax_then_turn(j, s, masked, acc, m_i, l_i):
          """Tile j's softmax, then this consumer's turn at the tensor cores with V_j in."""
          # On the GPU O is rescaled here, under the other consumer's products (the
          # interpreter's `pv_product` rescales it): lazily, (rarely) before P's
          # exp2, or every tile after it.
          s, m_new, m_use, alpha = new_max(s, j, masked, m_i)
          if pv_in_place and lazy:
            acc = scale_moved_rows(acc, alpha)
          p16, l_i = probabilities(s, m_use, alpha, l_i)
          if pv_in_place and not lazy:
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          # Keep the softmax on this side of the barriers (the references found the order
          # matters for how the two consumers overlap).
          acc, l_i, m_new, p16, alpha = lax.optimization_barrier((acc, l_i, m_new, p16, alpha))
          schedule_arrive()                         # softmax done
          plgpu.barrier_wait(v_loaded.at[slot_of(j)])
          schedule_wait()                           # the other consumer left the tensor cores
          return acc, p16, alpha, m_new, l_i

        def wait_k(j):     # K of tile j, if the item has it (called under P V of j - 1)
          pl.when(j < hi)(lambda: plgpu.barrier_wait(k_loaded.at[slot_of(j)]))

        def pv_product(j, acc, p16, alpha, then=lambda: None):
          """O + P V of tile j, in place (`softmax_then_turn` rescaled O), or under the
          interpreter O rescaled by alpha here; `then()` runs while the product is in
          flight."""
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(j)])
            then()
          if interpret:      # the interpreter's wgmma takes no register operand
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + jnp.dot(
                p16, v_smem[slot_of(j)], preferred_element_type=jnp.float32)
            then()
            return acc
          return pl.run_state(pv)(plgpu.ACC.init(acc))   # O += P V inside the accumulator

        def body(j, carry, masked):
          acc, m_i, l_i = carry
          s = scores(j)
          release(k_consumed.at[slot_of(j)])
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          acc = pv_product(j, acc, p16, alpha, then=lambda: wait_k(j + 1))
          release(v_consumed.at[slot_of(j)])
          return acc, m_new, l_i

        def idle_tile(j, carry):
          """Tile j outside this consumer's rows' range: `body`'s barrier arrivals and
          waits in `body`'s order and nothing else, so that the slots' consumed
          barriers and the ping-pong's schedule barrier complete as for a computed tile."""
          schedule_turn()
          release(k_consumed.at[slot_of(j)])
          schedule_arrive()
          plgpu.barrier_wait(v_loaded.at[slot_of(j)])
          schedule_wait()
          wait_k(j + 1)
          release(v_consumed.at[slot_of(j)])
          return carry

        def body_ahead(j, carry, masked):
          """Tile j < hi - 1 with its S in the carry; returns tile j + 1's."""
          acc, m_i, l_i, s = carry
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          if interpret:
            acc = pv_product(j, acc, p16, alpha, then=lambda: wait_k(j + 1))
            s = scores(j + 1)
          else:
            def products(refs):
              acc_ref, s_ref = refs
              plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(j)])
              plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)])
              issue_scores(s_ref, j + 1)
              schedule_turn()
            acc, s = pl.run_state(products)((plgpu.ACC.init(acc), plgpu.ACC.init(zero_scores())))
          release(v_consumed.at[slot_of(j)])
          release(k_consumed.at[slot_of(j + 1)])
          return acc, m_new, l_i, s

        def last_ahead(carry, masked):
          """Tile hi - 1 with its S in the carry: P V alone."""
          acc, m_i, l_i, s = carry
          j = hi - 1
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          acc = pv_product(j, acc, p16, alpha)
          release(v_consumed.at[slot_of(j)])
          return acc, m_new, l_i

        if not config.scores_ahead:
          pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_loaded.at[slot_of(lo)]))
        pl.when(wg == 1)(schedule_turn)   # stagger: consumer 1 starts one half-step late
        if not config.scores_ahead:
          carry = (acc, m_i, l_i)
          for a, z, masked in classes:
            step = idle_tile if masked is None else functools.partial(body, masked=masked)
            carry = lax.fori_loop(a, z, step, carry)
        else:
          def first():
            plgpu.barrier_wait(k_loaded.at[slot_of(lo)])
            s = scores(lo)
            release(k_consumed.at[slot_of(lo)])
            return s
          carry = (acc, m_i, l_i, lax.cond(hi > lo, first, zero_scores))
          end = jnp.maximum(lo, hi - 1)           # tiles lo .. hi - 2, in their classes
          for a, z, masked in classes:
            carry = lax.fori_loop(jnp.minimum(a, end), jnp.minimum(z, end),
                                  functools.partial(body_ahead, masked=masked), carry)
          last_masked = (hi - 1 < full_lo) | (hi - 1 >= full_hi)
          carry = lax.switch(jnp.where(hi > lo, jnp.where(last_masked, 1, 2), 0),
                             [lambda c: c[:3], functools.partial(last_ahead, masked=True),
                              functools.partial(last_ahead, masked=False)], carry)
        pl.when(wg == 0)(schedule_turn)   # balance the stagger
        return carry

      acc, m_i, l_i = sequential(acc, m_i, l_i)

      # Normalise once (FlashAttention-2, section 3.1.1). A row that saw no key returns
      # 0 and lse = -inf; a NaN sum stays NaN.
      empty = l_i == 0.0
      inv = 1.0 / jnp.where(empty, 1.0, l_i)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      out = jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0, out)
      lse = jnp.where(empty, -jnp.inf, m_i * LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
      q_smem[...] = out.astype(dtype)             # Q is no longer needed: O goes there
      lse_smem.at[wg][...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_rows, r["out"].at[b, pl.ds(row0, bq), n])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], r["lse"].at[b, n, pl.ds(row0, bq)])
      if q_slots == 1:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # Q's slot is free for the next item
      return passed(hi)

    for_each_item(item)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == C)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    def item(coords, tiles, k, following):
      i, n, b = coords
      lo, _, _, hi, _ = tile_range(i, b)
      kv_head = lax.div(n, jnp.int32(group))

      def load(j, _):
        t = j - lo if tiles is None else tiles + j - lo   # tiles through the slots before it
        slot = lax.rem(t, stages)
        rows = pl.ds(j * bk, bk)

        @pl.when(t >= stages)            # the slot held tile t - stages: wait until used
        def _():
          plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(r["k"].at[b, rows, kv_head], k_rows.at[slot], k_loaded.at[slot])

        @pl.when(t >= stages)
        def _():
          plgpu.barrier_wait(v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(r["v"].at[b, rows, kv_head], v_rows.at[slot], v_loaded.at[slot])
      lax.fori_loop(lo, hi, load, None)
      return hi - lo if tiles is None else tiles + hi - lo

    total = for_each_item(item)

    def drain(t, _):   # the last tiles' consumption: every barrier phase is observed
      plgpu.barrier_wait(k_consumed.at[lax.rem(t, stages)])
      plgpu.barrier_wait(v_consumed.at[lax.rem(t, stages)])
    lax.fori_loop(jnp.maximum(0, total - stages), total, drain, None)


def flash_forward(q, k, v, *, scale: float, opts: MaskOptions | None = None,
                  ops: MaskOperands | None = None, config: MosaicConfig | None = None,
                  interpret: bool = False, num_sms: int | None = None):
  """q [B, T, N, H], k/v [B, S, K, H] (bf16/fp16) -> out [B, T, N, H], lse [B, N, T]
  float32 natural log. Rows past `ops.q_lengths` are left to the caller (the kernel
  treats every row < T as a query). `num_sms`: the multiprocessors the programs run on,
  the persistent grid's programs and what a causal launch's order counts on
  (`heuristics.launch_side_by_side`); default: the device's, 2 when interpreted
  (`common.device_sms`)."""
  plgpu = import_plgpu()
  opts = opts or MaskOptions()
  ops = ops or MaskOperands()
  if opts.dropout_rate or ops.mask is not None or ops.bias is not None:
    raise NotImplementedError("the Mosaic GPU forward has no dense mask, bias or dropout")
  config = config or default_config(q.shape[-1], opts.is_causal, q.shape[1])
  check_forward(q, k, v, config)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  bq, bk = config.block_q, config.block_k
  C = config.consumers
  rows_per_program = C * bq
  Tp = round_up(T, rows_per_program)
  Sp = round_up(S, bk)
  # Tails. Q, K, V and O move as 2-D boxes of a [B, T|S, N|K, H] tensor map (Mosaic GPU
  # takes that path for every copy of a swizzled buffer, as these are), whose copies the
  # copy engine bounds per axis (`map_rows`). Keys past S are then zeros, masked in the
  # last tile (its class is never FULL); query rows past T are computed on zeros and
  # dropped by the store. Where a row is one swizzle row (`rows_are_swizzle_rows`) the
  # copies move plain rows and the map spans T and S as they are; otherwise Mosaic GPU
  # builds it over the shared-memory tiling of 8 rows, so only lengths off multiples of
  # TMA_ROWS are padded in HBM (a copy), up to the next multiple. The lse rows go out by
  # a plain bulk copy, bounded only by the whole array's end (rows past T of one head
  # would land in the next), so lse is written in whole tiles ([B, N, Tp], 4 bytes a
  # row) and cut to T.
  # T_map, S_map: the lengths of the arrays the kernel's tensor maps are built over.
  # (Mosaic GPU's interpreter has no views of one buffer, and pads tails to whole tiles.)
  rows_view = rows_are_swizzle_rows(H, q.dtype.itemsize) and not interpret
  T_map = map_rows(T, rows_per_program, interpret, rows_view)
  S_map = map_rows(S, bk, interpret, rows_view)
  qp, kp, vp = pad_axis(q, T_map, 1), pad_axis(k, S_map, 1), pad_axis(v, S_map, 1)
  # The programs' ranges and, with `consumer_ranges`, a row per consumer's block_q rows
  # (empty past T): tables the kernel loads, or the static rules' closed form it computes.
  ranges = {"ranges": build_ranges(ops, opts, B=B, T=T, S=S, block_q=rows_per_program,
                                   block_k=bk, closed_form=True)}
  if config.consumer_ranges:
    ranges["own_ranges"] = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk,
                                        closed_form=True)
  static_ranges = {n: x for n, x in ranges.items() if isinstance(x, StaticRanges)}
  tables = {n: x for n, x in ranges.items() if n not in static_ranges}
  if "own_ranges" in tables:
    tables["own_ranges"] = pad_axis(tables["own_ranges"], Tp // bq, 1)
  seg = {}
  if ops.q_segment_ids is not None:
    # Read by plain loads, which nothing bounds: padded with ids that match nothing.
    seg = {"q_seg": pad_axis(ops.q_segment_ids, Tp, 1, FILL["q_seg"]),
           "kv_seg": pad_axis(ops.kv_segment_ids, Sp, 1, FILL["kv_seg"])}
  in_names = ["q", "k", "v", *tables, *seg]
  stages = max(2, min(config.stages, Sp // bk))
  config = dataclasses.replace(config, stages=stages)
  num_q_blocks = Tp // rows_per_program
  q_slots = forward_q_slots(H, q.dtype.itemsize, config)
  scratch = dict(
      qo_smem=tile_smem((q_slots, C, bq, H), q.dtype, rows_view),
      k_smem=tile_smem((stages, bk, H), q.dtype, rows_view),
      v_smem=tile_smem((stages, bk, H), q.dtype, rows_view),
      lse_smem=plgpu.SMEM((C, bq), jnp.float32),
      k_loaded=plgpu.Barrier(num_barriers=stages),
      v_loaded=plgpu.Barrier(num_barriers=stages),
      q_loaded=plgpu.Barrier(num_barriers=q_slots * C),
      k_consumed=plgpu.Barrier(num_arrivals=C, num_barriers=stages),
      v_consumed=plgpu.Barrier(num_arrivals=C, num_barriers=stages),
      schedule=plgpu.Barrier(num_arrivals=2),        # the ping-pong pair (unused otherwise)
  )
  names = [*in_names, "out", "lse", *scratch]
  items_grid = (num_q_blocks, N, B)
  if config.persistent or opts.is_causal:
    num_sms = device_sms(num_sms, interpret)
  if config.persistent:
    num_ctas = min(num_sms, math.prod(items_grid))
    grid, grid_names = (num_ctas,), ("sm",)
  else:
    num_ctas = None
    grid, grid_names = launched_grid(items_grid, ("q", "heads", "batch"),
                                     causal=opts.is_causal, num_sms=num_sms)
  kernel = functools.partial(
      _kernel, names=names, static_ranges=static_ranges, opts=opts, scale=scale,
      config=config, group=N // K, items_grid=items_grid, num_ctas=num_ctas,
      rows_view=rows_view, dtype=q.dtype, interpret=interpret)
  extra = {}
  if interpret:   # Mosaic GPU's own interpreter: simulated SMEM, barriers, TMA, warpgroups
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    extra["interpret"] = InterpretGPUParams()
  out, lse = plgpu.kernel(
      kernel,
      out_type=[out_type((B, T_map, N, H), q.dtype, q, k, v),
                out_type((B, N, Tp), jnp.float32, q, k, v)],
      scratch_types=list(scratch.values()),
      grid=grid,
      grid_names=grid_names,
      num_threads=C + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      **extra,
  )(qp, kp, vp, *tables.values(), *seg.values())
  # XLA's dynamic-slice fusion (jax 0.11) folds a dynamic-update-slice of a custom
  # call's result (a scan stacking this output as a residual for the backward) into a
  # fusion around the call, and keeps the original call for the output's other users:
  # the kernel runs twice. The barrier hides the call from that rewrite and moves no
  # data; it can go once the XLA in use reroutes those users (openxla/xla#45799).
  out, lse = lax.optimization_barrier((out, lse))
  return out[:, :T], lse[:, :, :T]
