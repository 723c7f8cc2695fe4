"""FlashAttention backward on Pallas Mosaic GPU for Hopper: (q, k, v, out, lse, dO) ->
(dq, dk, dv): the launcher of the dK/dV kernel (dkv.py) and the dQ kernel (dq.py).
Checked against float64 by tests/test_mosaic_backward.py: on a CPU lowered and run by
Mosaic GPU's own interpreter, on a Hopper GPU compiled (tests/mosaic_support.py).

The math is the Triton backward's (pallas_kernels.backward; FlashAttention-2,
Algorithm 2): P = exp2(s * c - lse2) is recomputed from the base-2 log-sum-exp,
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dS' = dS * (1 - tanh^2) under a soft
cap, dK = scale dS'^T Q, dQ = scale dS' K, with delta = rowsum(dO * O) minus the lse
cotangent (`backward_statistics`, shared with the Triton kernels).

Two kernels, each program two or three consumer warpgroups and a producer
(warp-specialised; M = 64 rows of every warpgroup matrix product per consumer) that
loads its tiles with bulk tensor copies (TMA): the program's fixed operands once, the
streamed ones through `stages` slots; the dQ kernel also as one warpgroup that streams
its own tiles (double buffering) where two consumers' rows do not fit shared memory:

- dK/dV: grid over (key tiles, key heads, batch). K and V of the tile stay in shared
  memory; a runtime loop over the query heads of the GQA group and, inside, over the
  query tiles of the transposed per-tile schedule (`build_ranges(..., transpose=True)`)
  computes S^T = K Q^T and dP^T = V dO^T, so that P^T and dS'^T enter dV += P^T dO and
  dK += dS'^T Q as register operands straight from the accumulator. The dV product
  runs while dS'^T is computed (FlashAttention-3's backward overlap): issued right
  behind dP^T, or with `dkv_p_under_dp` (the default on d = 64's tiles) after P^T is
  computed under the dP^T product. dK/dV sum in accumulator registers: no atomics,
  deterministic.
  With `BackwardConfig.group_splits` > 1 the grid is (key tiles, key heads,
  group_splits, batch): each of a key tile's programs loops over its own share of the
  group's query heads and writes float32 partial dK, dV, summed after the kernel.
- dQ: grid over (query tiles, query heads, batch; causal: the heaviest query tiles
  first, `query_block_order`), looping over the visited key tiles: S = Q K^T and
  dP = dO V^T issued back to back, then dQ += dS' K.

Above head_dim 128 (`by_role`) the dK/dV kernel's two consumers share 64 keys and split
the work by output, S^T and dK on one, dP^T and dV on the other, P^T and dP^T passing
between them through shared memory (`_dkv_by_role`); the dQ kernel runs two consumers
and a producer there where their rows fit shared memory beside key tiles of 64
(`call_config`, d 144-224), else one warpgroup (`dq_consumers_of`).

Both skip whole tiles for causal, window, lengths and segment ids alike (the schedule
of `pallas_kernels.masking`, as the forward), and launch a grid's tiles of each (batch,
head) side by side where the forward does (`launch_side_by_side`). Under the
interpreter (`interpret=True`) the products are plain dots: it has no transposed or
in-register matrix-product operands and no layout casts; loads, barriers, schedule and
masks are the kernel's own but tails are padded to whole tiles (`map_rows`): reading
them in place runs on the GPU only.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from pallas_kernels.backward import backward_statistics
from pallas_kernels.common import out_type, round_up
from pallas_kernels.masking import FILL, MaskOperands, MaskOptions, build_ranges
from pallas_kernels.mosaic_gpu.common import (ROWS, check_launch, compiler_params, device_sms,
                                              import_plgpu, map_rows, pad_axis,
                                              rows_are_swizzle_rows, smem_layout, tile_smem)
from pallas_kernels.mosaic_gpu.configs import (BackwardConfig, by_role, check_backward,
                                               dkv_keys, dq_consumers_of, stream_slots)
from pallas_kernels.mosaic_gpu.dkv import dkv_kernel
from pallas_kernels.mosaic_gpu.dq import dq_kernel
from pallas_kernels.mosaic_gpu.heuristics import launched_grid
from pallas_kernels.mosaic_gpu.scheduler import PersistentGrid


def flash_backward(q, k, v, out, lse, dout, dlse=None, *, scale: float,
                   opts: MaskOptions | None = None, ops: MaskOperands | None = None,
                   config: BackwardConfig | None = None, interpret: bool = False,
                   num_sms: int | None = None):
  """Gradients (dq, dk, dv) of attention from the forward's residuals: q [B, T, N, H],
  k/v [B, S, K, H] (bf16/fp16), out [B, T, N, H], lse [B, N, T] in natural log, the
  output cotangent dout and optionally the lse cotangent dlse [B, N, T]. Same contract
  as pallas_kernels.backward.flash_backward for the structured masks (no dense mask,
  bias or dropout). Tails are read and written in place as in the forward (`map_rows`:
  only lengths off the tensor maps' 8-row tiling are padded in HBM, and those only
  where a row is not one swizzle row (head dims other than 16, 32 and 64), and everything
  under the interpreter); the per-row statistics and segment ids, read by plain loads,
  are padded to whole tiles.
  `num_sms`: programs of the persistent grids (`BackwardConfig.persistent`), and what a
  causal launched grid's order follows (`launch_side_by_side`); default: the device's
  multiprocessors, 2 when interpreted (`device_sms`)."""
  plgpu = import_plgpu()
  opts = opts or MaskOptions()
  ops = ops or MaskOperands()
  if opts.dropout_rate or ops.mask is not None or ops.bias is not None:
    raise NotImplementedError("the Mosaic GPU backward has no dense mask, bias or dropout")
  config = config or BackwardConfig()
  check_backward(q, k, v, config)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  group = N // K
  lse2, delta = backward_statistics(lse, out, dout, dlse)      # [B, N, T] float32
  # Q, K, V, dO and the gradients move as plain rows where a row is one swizzle row
  # (`tile_smem`), over tensor maps of T and S rows; Mosaic GPU's interpreter has no
  # views of one buffer (and pads to whole tiles).
  rows_view = rows_are_swizzle_rows(H, q.dtype.itemsize) and not interpret

  def padded(bq, bk):
    """(Tp, Sp: whole tiles of the grid, T_map, S_map: the rows of the operands the tensor
    maps are built over, the operands). Query rows past T, zeros from HBM padding or from
    the copy engine, have lse2 = +inf (P = 0, read in whole tiles) and dO = 0; keys past
    S are masked in the last key tile (never FULL) by the key length; gradient rows past
    T or S are not stored."""
    Tp, Sp = round_up(T, bq), round_up(S, bk)
    T_map, S_map = map_rows(T, bq, interpret, rows_view), map_rows(S, bk, interpret, rows_view)
    x = dict(q=pad_axis(q, T_map, 1), k=pad_axis(k, S_map, 1), v=pad_axis(v, S_map, 1),
             do=pad_axis(dout, T_map, 1), lse2=pad_axis(lse2, Tp, 2, jnp.inf),
             delta=pad_axis(delta, Tp, 2))
    if ops.q_segment_ids is not None:   # padded with ids that match nothing
      x["q_seg"] = pad_axis(ops.q_segment_ids, Tp, 1, FILL["q_seg"])
      x["kv_seg"] = pad_axis(ops.kv_segment_ids, Sp, 1, FILL["kv_seg"])
    return Tp, Sp, T_map, S_map, x

  # Every input-dtype tile in the head dim's swizzle, the [64, 64] ones passed between
  # consumers too (they enter products beside Q, K, V or dO); float32 tiles by their own
  # rows.
  swizzled = smem_layout(H, q.dtype.itemsize)
  f32_layout = lambda cols: smem_layout(cols, 4)
  extra = {}
  if interpret:   # Mosaic GPU's own interpreter: simulated SMEM, barriers, TMA
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    extra["interpret"] = InterpretGPUParams()

  stages, roles = config.stages, by_role(H)

  def call(kernel, grid, grid_names, x, ranges, fixed, streamed, out_types,
           partials=False, C=2, shared_fixed=False, stats=False):
    """fixed / streamed: the names of the two operands each consumer keeps / the two
    that stream through the slots, with their rows. partials: the outputs are float32 partial sums (`group_splits`), stored
    from a float32 tile of each consumer's fixed rows. C: consumers; shared_fixed: the
    consumers split one program's fixed rows by role (`_dkv_by_role`): each holds one
    of the two fixed operands, and they pass each other P^T (two slots) and float32
    dP^T (one), each slot with its "ready" and "free" barriers. stats: the lse and
    delta of each streamed tile stream beside it (`stats_streamed`)."""
    (f1, f2), fixed_rows = fixed
    (s1, s2), stream_rows = streamed
    per_consumer = (fixed_rows, H) if C == 1 or shared_fixed else (C, fixed_rows, H)
    slots = stream_slots(C, stages)
    tiles = lambda shape: tile_smem(shape, q.dtype, rows_view)   # moved by bulk copies
    scratch = {f1: tiles(per_consumer), f2: tiles(per_consumer),
               s1: tiles((slots, stream_rows, H)), s2: tiles((slots, stream_rows, H)),
               "fixed_loaded": plgpu.Barrier(num_barriers=2 if shared_fixed else 2 * C),
               "loaded": plgpu.Barrier(num_barriers=(4 if stats else 2) * slots)}
    if stats:
      scratch["lse_smem"] = plgpu.SMEM((slots, stream_rows), jnp.float32)
      scratch["delta_smem"] = plgpu.SMEM((slots, stream_rows), jnp.float32)
    threads = {}
    if C > 1:      # consumers + the producer warpgroup
      scratch["consumed"] = plgpu.Barrier(num_arrivals=C, num_barriers=slots)
      threads = dict(num_threads=C + 1, thread_name="wg")
    if shared_fixed:    # the tiles `_dkv_by_role`'s consumers pass each other
      scratch["p_smem"] = plgpu.SMEM((2, fixed_rows, stream_rows), q.dtype, **swizzled)
      scratch["p_ready"] = plgpu.Barrier(num_barriers=2)
      scratch["p_free"] = plgpu.Barrier(num_barriers=2)
      scratch["dp_smem"] = plgpu.SMEM((fixed_rows, stream_rows), jnp.float32,
                                      **f32_layout(stream_rows))
      scratch["dp_ready"] = plgpu.Barrier(num_barriers=1)
      scratch["dp_free"] = plgpu.Barrier(num_barriers=1)
    if interpret:  # the float32 accumulators (dK and dV, or dQ) of each consumer
      scratch["acc"] = plgpu.SMEM((len(out_types), C, ROWS, H), jnp.float32)
    if partials:
      scratch["partial_smem"] = plgpu.SMEM((C, fixed_rows, H), jnp.float32, **f32_layout(H))
    in_names = ["q", "k", "v", "do", "lse2", "delta", "ranges",
                *(n for n in ("q_seg", "kv_seg") if n in x)]
    out_names = ["dq"] if len(out_types) == 1 else ["dk", "dv"]
    args = [x[n] for n in in_names if n != "ranges"]
    args.insert(in_names.index("ranges"), ranges)
    body = functools.partial(kernel, opts=opts, scale=scale, group=group,
                             interpret=interpret, consumers=C, stages=slots,
                             rows_view=rows_view)
    return plgpu.kernel(
        functools.partial(body, names=[*in_names, *out_names, *scratch]),
        out_type=out_types, scratch_types=list(scratch.values()), grid=grid,
        grid_names=grid_names, compiler_params=compiler_params(), **threads, **extra)(*args)

  # With `persistent`, each kernel's grid is one program per multiprocessor (axis "sm"),
  # looping over the work items of the grid it stands for; a causal launched grid's
  # order follows the multiprocessors' count too (`grid_of`).
  if config.persistent or opts.is_causal:
    num_sms = device_sms(num_sms, interpret)

  def persistent_grid(grid):
    """The kernel's `PersistentGrid` over `grid`, or None."""
    if not config.persistent:
      return None
    items = math.prod(grid)
    return PersistentGrid(items, min(num_sms, items), grid, config.l2_group)

  def grid_of(grid, grid_names):
    """The launch's grid and axis names: a launched grid ordered as the forward's
    (`launched_grid`); one split over the group's heads keeps its order."""
    if config.persistent:
      return (persistent_grid(grid).programs,), ("sm",)
    if "split" in grid_names:
      check_launch(grid, grid_names)
      return grid, grid_names
    return launched_grid(grid, grid_names, causal=opts.is_causal, num_sms=num_sms)

  # -- dK, dV: consumers x ROWS keys per program (ROWS when split by role), query tiles of
  # block_n rows
  bq, bk = config.block_n, dkv_keys(H, config)
  Tp, Sp, _, S_map, x = padded(bq, bk)
  # Both kernels load their ranges from `build_ranges`' table (a constant under static
  # rules), where the forward computes them (`StaticRanges`): computed here they measured
  # slower (docs/notes/mosaic.md, "Tile ranges computed in the kernels").
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk, transpose=True)
  splits = config.group_splits
  grid, grid_names = (Sp // bk, K, B), ("kv", "heads", "batch")
  kv_type = out_type((B, S_map, K, H), k.dtype, q, k, v, dout)
  if splits > 1:
    # A key tile's programs side by side, each with float32 partial dK and dV of its
    # own: [B, splits, Sp, K, H]. The batch stays the grid's last axis.
    grid, grid_names = (Sp // bk, K, splits, B), ("kv", "heads", "split", "batch")
    kv_type = out_type((B, splits, Sp, K, H), jnp.float32, q, k, v, dout)
  dk, dv = call(functools.partial(dkv_kernel, bq=bq, group_splits=splits,
                                  persistent=persistent_grid(grid),
                                  stats_streamed=config.stats_streamed,
                                  p_under_dp=config.dkv_p_under_dp),
                *grid_of(grid, grid_names),
                x, ranges, (("k_smem", "v_smem"), ROWS), (("q_smem", "do_smem"), bq),
                [kv_type, kv_type], partials=splits > 1, shared_fixed=roles,
                stats=config.stats_streamed)
  if splits > 1:      # in a fixed order, rounded once
    dk, dv = (d.sum(1).astype(k.dtype) for d in (dk, dv))

  # -- dQ: dq_consumers_of x ROWS query rows per program, key tiles of dq_block_n (or
  # block_n) rows
  dq_consumers = dq_consumers_of(H, config)
  bq, bk = dq_consumers * ROWS, config.dq_block_n or config.block_n
  Tp, Sp, T_map, _, x = padded(bq, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
  grid = (Tp // bq, N, B)
  (dq,) = call(functools.partial(dq_kernel, bk=bk, num_q_blocks=Tp // bq,
                                 rows_in_registers=config.dq_rows_in_registers,
                                 p_under_dp=config.dq_p_under_dp,
                                 persistent=persistent_grid(grid)),
               *grid_of(grid, ("q", "heads", "batch")), x, ranges, (("q_smem", "do_smem"), ROWS),
               (("k_smem", "v_smem"), bk),
               [out_type((B, T_map, N, H), q.dtype, q, k, v, dout)],
               C=dq_consumers)
  return dq[:, :T], dk[:, :S], dv[:, :S]
