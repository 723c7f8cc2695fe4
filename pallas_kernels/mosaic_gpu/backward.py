"""FlashAttention backward on Pallas Mosaic GPU for Hopper: (q, k, v, out, lse, dO) ->
(dq, dk, dv). NOT YET RUN ON A GPU: verified by lowering to the Mosaic GPU dialect on a
CPU and by Mosaic GPU's own interpreter only (see experiments/results/mosaic_notes.md).

The math is the Triton backward's (pallas_kernels.backward; FlashAttention-2,
Algorithm 2): P = exp2(s * c - lse2) is recomputed from the base-2 log-sum-exp,
dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dS' = dS * (1 - tanh^2) under a soft
cap, dK = scale dS'^T Q, dQ = scale dS' K, with delta = rowsum(dO * O) minus the lse
cotangent (`backward_statistics`, shared with the Triton kernels).

Two kernels, each program one warpgroup (M = 64 rows of every warpgroup matrix
product; no warp specialisation yet) that loads its tiles with bulk tensor copies
(TMA): the program's fixed operands once, the streamed ones double-buffered (the next
tile's copies are issued before this tile's products):

- dK/dV: grid over (key tiles, key heads, batch). K and V of the tile stay in shared
  memory; a runtime loop over the query heads of the GQA group and, inside, over the
  query tiles of the transposed per-tile schedule (`build_ranges(..., transpose=True)`)
  computes S^T = K Q^T and dP^T = V dO^T, so that P^T and dS'^T enter dV += P^T dO and
  dK += dS'^T Q as register operands straight from the accumulator. dK/dV sum in
  registers: no atomics, deterministic.
- dQ: grid over (query tiles, query heads, batch), looping over the visited key tiles:
  S = Q K^T and dP = dO V^T back to back, then dQ += dS' K.

Both skip whole tiles for causal, window, lengths and segment ids alike (the schedule
of `pallas_kernels.masking`, as the forward). Under the interpreter (`interpret=True`)
the products are plain dots: it has no transposed or in-register matrix-product
operands and no layout casts; loads, barriers, schedule, masks and tails are the
kernel's own.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.backward import backward_statistics
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, build_ranges,
                                    structured_keep, visit_tiles)
from pallas_kernels.mosaic_gpu.forward import (LOG2E, SEMANTICS, _load_vector, _plgpu,
                                               check_head_dim_and_dtype, compiler_params,
                                               pad_axis)

HEAD_DIMS = (64, 128)   # d = 256: dK and dV accumulators alone would take 256 registers
ROWS = 64               # M of one warpgroup matrix product: key rows (dK/dV), query rows (dQ)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles and compile options of the Mosaic GPU backward.

  block_n: the N of each kernel's first products: query rows per tile in the dK/dV
    kernel (S^T is [64, block_n]), key rows per tile in the dQ kernel (S is
    [64, block_n]); a multiple of 64, <= 256.
  semantics: Mosaic GPU's lowering semantics, pinned as in the forward ("lane":
    explicit register layouts, as this kernel is written).
  """

  block_n: int = 64
  semantics: str = "lane"

  def __post_init__(self):
    if self.semantics not in SEMANTICS:
      raise ValueError(f"semantics={self.semantics!r} must be one of {SEMANTICS}")
    if not isinstance(self.block_n, int) or self.block_n % 64 or not 0 < self.block_n <= 256:
      raise ValueError(f"block_n={self.block_n!r} must be 64, 128, 192 or 256")


def check_supported(q, k, v):
  """Raises NotImplementedError naming what these kernels cannot run."""
  check_head_dim_and_dtype(q, HEAD_DIMS, "backward")


class _Products:
  """Warpgroup matrix products, or plain dots under the interpreter. `fresh` takes `a`
  from shared memory, `add` from registers; `b` is a shared-memory ref, used as b^T
  with `b_t` (a transposed view: no data moves)."""

  def __init__(self, interpret):
    self.interpret = interpret

  @staticmethod
  def _dot(a, b, b_t):      # a: a value, b: a shared-memory ref
    b = b[...]
    return jnp.dot(a, b.T if b_t else b, preferred_element_type=jnp.float32)

  def fresh(self, a, b, shape, *, b_t=False):
    """a @ b(^T) into a new float32 accumulator."""
    if self.interpret:
      return self._dot(a[...], b, b_t)
    plgpu = _plgpu()

    def run(acc_ref):
      plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b, (1, 0)) if b_t else b)
      return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

  def add(self, acc, a, b):
    """acc + a @ b, accumulated in place."""
    if self.interpret:
      return acc + self._dot(a, b, False)
    plgpu = _plgpu()
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(acc))


def _logits(s, opts: MaskOptions, scale):
  """(s, t, c): base-2 logits are s * c; t = tanh of the soft cap (for its derivative)
  or None. As in the forward, a soft cap or a scale <= 0 is applied to s first."""
  if opts.soft_cap is not None:
    t = jnp.tanh(s * (scale / opts.soft_cap))
    return opts.soft_cap * t, t, LOG2E
  if scale * LOG2E > 0:
    return s, None, scale * LOG2E
  return s * scale, None, LOG2E


def _tile_ds(s, dp, lse2, delta, *, opts, scale, keep):
  """(P, dS') of one tile from the raw product s, dP and per-query lse2 / delta
  (already broadcast to the tile). A hidden key has P = 0 even on a row whose lse is
  NaN, so a NaN reaches only the gradients of the keys its row sees."""
  s, t, c = _logits(s, opts, scale)
  if keep is not None:
    s = jnp.where(keep, s, -jnp.inf)
  p = jnp.exp2(s * c - lse2)      # lse2 = +inf on rows with no visible key: P = 0
  if keep is not None:
    p = jnp.where(keep, p, 0.0)
  ds = p * (dp - delta)
  if t is not None:
    ds = ds * (1.0 - t * t)       # d(cap tanh(x / cap)) / dx
  return p, ds


def _layouts(interpret, shape):
  """(cast, iota, row layout, column layout) of a [rows, cols] accumulator tile."""
  if interpret:
    return (lambda x, layout: x), (lambda d: lax.broadcasted_iota(jnp.int32, shape, d)), None, None
  plgpu = _plgpu()
  wgmma = plgpu.Layout.WGMMA
  return (plgpu.layout_cast,
          lambda d: plgpu.broadcasted_iota(jnp.int32, shape, d, layout=wgmma),
          wgmma.reduce(1), wgmma.reduce(0))


def _row(ranges, b, i):
  """(lo, full_lo, full_hi, hi) of one block's row of the per-tile schedule."""
  return tuple(ranges[b, i, t] for t in range(4))


def _load_tile(src, dst, barrier):
  plgpu = _plgpu()
  plgpu.copy_gmem_to_smem(src, dst, barrier)
  plgpu.barrier_wait(barrier)


class _Stream:
  """Two streamed operands (Q and dO, or K and V) in two shared-memory slots: the tile
  after the current one is copied into the other slot while this one is computed on
  (double buffering). The other slot held the previous tile, whose products were all
  waited for (its accumulators were read) before the next copy is issued. Each slot's
  barriers complete once per copy and are waited on once per tile."""

  def __init__(self, srcs, smems, loaded):
    self.srcs, self.smems, self.loaded = srcs, smems, loaded   # loaded: [operand, slot]

  def start(self, slot, *coords):
    plgpu = _plgpu()
    for a, (src, smem) in enumerate(zip(self.srcs, self.smems)):
      plgpu.copy_gmem_to_smem(src(*coords), smem.at[slot], self.loaded.at[2 * a + slot])

  def wait(self, slot):
    plgpu = _plgpu()
    for a in range(len(self.srcs)):
      plgpu.barrier_wait(self.loaded.at[2 * a + slot])
    return tuple(smem.at[slot] for smem in self.smems)


def _store_tile(x, smem, dst):
  plgpu = _plgpu()
  smem[...] = x.astype(smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, dst)
  plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(*refs, names, opts: MaskOptions, scale, bq, group, interpret):
  """One key tile of one key head: dK, dV summed over the group's heads and the
  visited query tiles (S^T = K Q^T, so the tile is [keys, queries])."""
  r = dict(zip(names, refs))
  bk = ROWS
  j, kv_head, b = lax.axis_index("kv"), lax.axis_index("heads"), lax.axis_index("batch")
  k_smem, v_smem = r["k_smem"], r["v_smem"]
  H = k_smem.shape[-1]
  mm = _Products(interpret)
  cast, iota, key_layout, query_layout = _layouts(interpret, (bk, bq))
  keys = pl.ds(j * bk, bk)
  _load_tile(r["k"].at[b, keys, kv_head], k_smem, r["fixed_loaded"].at[0])
  _load_tile(r["v"].at[b, keys, kv_head], v_smem, r["fixed_loaded"].at[1])
  ranges = r["ranges"]
  lo, full_lo, full_hi, hi = _row(ranges, b, j)
  kv_len = ranges[b, j, 5]
  kv_seg = None
  if "kv_seg" in r:
    kv_seg = lax.broadcast_in_dim(
        _load_vector(r["kv_seg"].at[b, keys], key_layout, interpret), (bk, bq), [0])
  along_queries = lambda x: lax.broadcast_in_dim(x, (bk, bq), [1])
  head = lambda g: kv_head * group + g
  # Query tiles stream in the loop order: every visited tile of head 0, then head 1, ...
  stream = _Stream([lambda i, g: r["q"].at[b, pl.ds(i * bq, bq), head(g)],
                    lambda i, g: r["do"].at[b, pl.ds(i * bq, bq), head(g)]],
                   [r["q_smem"], r["do_smem"]], r["loaded"])
  pl.when(hi > lo)(lambda: stream.start(0, lo, 0))

  def body(i, carry, g, masked):
    dk, dv = carry
    n = head(g)
    slot = lax.rem(g * (hi - lo) + i - lo, 2)
    pl.when(i + 1 < hi)(lambda: stream.start(1 - slot, i + 1, g))
    pl.when((i + 1 == hi) & (g + 1 < group))(lambda: stream.start(1 - slot, lo, g + 1))
    rows = pl.ds(i * bq, bq)
    lse2 = along_queries(_load_vector(r["lse2"].at[b, n, rows], query_layout, interpret))
    delta = along_queries(_load_vector(r["delta"].at[b, n, rows], query_layout, interpret))
    keep = None
    if masked:
      q_seg = None
      if kv_seg is not None:
        q_seg = along_queries(_load_vector(r["q_seg"].at[b, rows], query_layout, interpret))
      keep = structured_keep(i * bq + iota(1), j * bk + iota(0), opts, kv_len=kv_len,
                             q_seg=q_seg, kv_seg=kv_seg)
    q_smem, do_smem = stream.wait(slot)
    s_t = mm.fresh(k_smem, q_smem, (bk, bq), b_t=True)       # S^T = K Q^T
    dp_t = mm.fresh(v_smem, do_smem, (bk, bq), b_t=True)     # dP^T = V dO^T
    p_t, ds_t = _tile_ds(s_t, dp_t, lse2, delta, opts=opts, scale=scale, keep=keep)
    dv = mm.add(dv, p_t.astype(do_smem.dtype), do_smem)      # dV += P^T dO
    dk = mm.add(dk, ds_t.astype(q_smem.dtype), q_smem)       # dK += dS'^T Q
    return dk, dv

  # The group's query heads run as a loop of the program (its size does not grow with
  # the group); their dK/dV sum in the same registers.
  def one_head(g, carry):
    return visit_tiles((lo, full_lo, full_hi, hi), functools.partial(body, g=g), carry)

  zeros = cast(jnp.zeros((bk, H), jnp.float32), _plgpu().Layout.WGMMA if not interpret else None)
  dk, dv = lax.fori_loop(0, group, one_head, (zeros, zeros))
  _store_tile(dk * scale, k_smem, r["dk"].at[b, keys, kv_head])
  _store_tile(dv, v_smem, r["dv"].at[b, keys, kv_head])


def _dq_kernel(*refs, names, opts: MaskOptions, scale, bk, group, interpret):
  """One query tile of one query head: dQ over the visited key tiles."""
  r = dict(zip(names, refs))
  bq = ROWS
  i, n, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
  q_smem, do_smem = r["q_smem"], r["do_smem"]
  H = q_smem.shape[-1]
  mm = _Products(interpret)
  cast, iota, query_layout, key_layout = _layouts(interpret, (bq, bk))
  rows = pl.ds(i * bq, bq)
  kv_head = lax.div(n, jnp.int32(group))
  ranges = r["ranges"]
  lo, full_lo, full_hi, hi = _row(ranges, b, i)
  stream = _Stream([lambda j: r["k"].at[b, pl.ds(j * bk, bk), kv_head],
                    lambda j: r["v"].at[b, pl.ds(j * bk, bk), kv_head]],
                   [r["k_smem"], r["v_smem"]], r["loaded"])
  pl.when(hi > lo)(lambda: stream.start(0, lo))
  _load_tile(r["q"].at[b, rows, n], q_smem, r["fixed_loaded"].at[0])
  _load_tile(r["do"].at[b, rows, n], do_smem, r["fixed_loaded"].at[1])
  along_keys = lambda x: lax.broadcast_in_dim(x, (bq, bk), [0])
  lse2 = along_keys(_load_vector(r["lse2"].at[b, n, rows], query_layout, interpret))
  delta = along_keys(_load_vector(r["delta"].at[b, n, rows], query_layout, interpret))
  kv_len = ranges[b, i, 5]
  q_seg = None
  if "q_seg" in r:
    q_seg = along_keys(_load_vector(r["q_seg"].at[b, rows], query_layout, interpret))

  def body(j, dq, masked):
    slot = lax.rem(j - lo, 2)
    pl.when(j + 1 < hi)(lambda: stream.start(1 - slot, j + 1))
    keep = None
    if masked:
      kv_seg = None
      if q_seg is not None:
        kv_seg = lax.broadcast_in_dim(_load_vector(
            r["kv_seg"].at[b, pl.ds(j * bk, bk)], key_layout, interpret), (bq, bk), [1])
      keep = structured_keep(i * bq + iota(0), j * bk + iota(1), opts, kv_len=kv_len,
                             q_seg=q_seg, kv_seg=kv_seg)
    k_smem, v_smem = stream.wait(slot)
    s = mm.fresh(q_smem, k_smem, (bq, bk), b_t=True)          # S = Q K^T
    dp = mm.fresh(do_smem, v_smem, (bq, bk), b_t=True)        # dP = dO V^T
    _, ds = _tile_ds(s, dp, lse2, delta, opts=opts, scale=scale, keep=keep)
    return mm.add(dq, ds.astype(k_smem.dtype), k_smem)        # dQ += dS' K

  dq = cast(jnp.zeros((bq, H), jnp.float32), _plgpu().Layout.WGMMA if not interpret else None)
  dq = visit_tiles((lo, full_lo, full_hi, hi), body, dq)
  _store_tile(dq * scale, q_smem, r["dq"].at[b, rows, n])


def flash_backward(q, k, v, out, lse, dout, dlse=None, *, scale: float,
                   opts: MaskOptions | None = None, ops: MaskOperands | None = None,
                   config: BackwardConfig | None = None, interpret: bool = False):
  """Gradients (dq, dk, dv) of attention from the forward's residuals: q [B, T, N, H],
  k/v [B, S, K, H] (bf16/fp16), out [B, T, N, H], lse [B, N, T] in natural log, the
  output cotangent dout and optionally the lse cotangent dlse [B, N, T]. Same contract
  as pallas_kernels.backward.flash_backward for the structured masks (no dense mask,
  bias or dropout). T and S are padded to whole tiles here and the padding dropped."""
  plgpu = _plgpu()
  opts = opts or MaskOptions()
  ops = ops or MaskOperands()
  if opts.dropout_rate or ops.mask is not None or ops.bias is not None:
    raise NotImplementedError("the Mosaic GPU backward has no dense mask, bias or dropout")
  check_supported(q, k, v)
  config = config or BackwardConfig()
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  group = N // K
  lse2, delta = backward_statistics(lse, out, dout, dlse)      # [B, N, T] float32

  def padded(bq, bk):
    """Whole tiles in memory. Padded query rows have lse2 = +inf (P = 0) and dO = 0;
    padded keys are masked in the last key tile (never FULL) by the key length."""
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    x = dict(q=pad_axis(q, Tp, 1), k=pad_axis(k, Sp, 1), v=pad_axis(v, Sp, 1),
             do=pad_axis(dout, Tp, 1), lse2=pad_axis(lse2, Tp, 2, jnp.inf),
             delta=pad_axis(delta, Tp, 2))
    if ops.q_segment_ids is not None:   # padded with ids that match nothing
      x["q_seg"] = pad_axis(ops.q_segment_ids, Tp, 1, FILL["q_seg"])
      x["kv_seg"] = pad_axis(ops.kv_segment_ids, Sp, 1, FILL["kv_seg"])
    return Tp, Sp, x

  swizzled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
  extra = {}
  if interpret:   # Mosaic GPU's own interpreter: simulated SMEM, barriers, TMA
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    extra["interpret"] = InterpretGPUParams()

  def call(kernel, grid, grid_names, x, ranges, tiles, out_type):
    # tiles: name -> (slots, rows); the streamed ones have two slots.
    scratch = dict(**{name: plgpu.SMEM((rows, H) if slots == 1 else (slots, rows, H), q.dtype,
                                       **swizzled)
                      for name, (slots, rows) in tiles.items()},
                   fixed_loaded=plgpu.Barrier(num_barriers=2),
                   loaded=plgpu.Barrier(num_barriers=4))
    in_names = ["q", "k", "v", "do", "lse2", "delta", "ranges",
                *(n for n in ("q_seg", "kv_seg") if n in x)]
    out_names = ["dq"] if len(out_type) == 1 else ["dk", "dv"]
    names = [*in_names, *out_names, *scratch]
    args = [x[n] for n in in_names if n != "ranges"]
    args.insert(in_names.index("ranges"), ranges)
    return plgpu.kernel(
        functools.partial(kernel, names=names, opts=opts, scale=scale, group=group,
                          interpret=interpret),
        out_type=out_type, scratch_types=list(scratch.values()), grid=grid,
        grid_names=grid_names, compiler_params=compiler_params(config.semantics), **extra)(*args)

  # -- dK, dV: key tiles of ROWS rows, query tiles of block_n rows
  bq, bk = config.block_n, ROWS
  Tp, Sp, x = padded(bq, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk, transpose=True)
  kv_type = jax.ShapeDtypeStruct((B, Sp, K, H), k.dtype)
  dk, dv = call(functools.partial(_dkv_kernel, bq=bq), (Sp // bk, K, B),
                ("kv", "heads", "batch"), x, ranges,
                dict(k_smem=(1, bk), v_smem=(1, bk), q_smem=(2, bq), do_smem=(2, bq)), [kv_type, kv_type])

  # -- dQ: query tiles of ROWS rows, key tiles of block_n rows
  bq, bk = ROWS, config.block_n
  Tp, Sp, x = padded(bq, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
  (dq,) = call(functools.partial(_dq_kernel, bk=bk), (Tp // bq, N, B),
               ("q", "heads", "batch"), x, ranges,
               dict(q_smem=(1, bq), do_smem=(1, bq), k_smem=(2, bk), v_smem=(2, bk)),
               [jax.ShapeDtypeStruct((B, Tp, N, H), q.dtype)])
  return dq[:, :T], dk[:, :S], dv[:, :S]
