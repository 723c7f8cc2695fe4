"""FlashAttention-2 backward: delta preprocess, a dK/dV kernel and a dQ kernel.

Both kernels recompute P = exp2(s - lse2) from the saved log-sum-exp instead of
reading a stored [T, S] matrix (FlashAttention-2, Algorithm 2), with
  dV = P~^T dO,  dP = (dO V^T) * Z,  dS = P * (dP - delta),  dK = scale dS'^T Q,
  dQ = scale dS' K,  where P~ = P * Z (Z the dropout multiplier, 1 without dropout),
  dS' = dS * (1 - tanh^2) under a soft cap, and delta = rowsum(dO * O) (minus the lse
  cotangent, if any). The bias gradient is dS.

The dK/dV kernel runs over key blocks and loops over the query heads of a GQA group
and, inside, over the query blocks, so dK/dV of a shared key head are summed in
registers without repeating K/V. The head loop runs at run time, so the kernel's size
does not depend on the group; where key blocks alone leave the GPU short of programs
(MQA, short sequences), a group is split over several programs whose float32 partial
sums are added afterwards. It works on the transposed tile S^T = K Q^T, so P~^T and
dS'^T enter dV += P~^T dO and dK += dS'^T Q straight from the accumulator. The dQ kernel
runs over query blocks and loops over key blocks. Splitting them avoids atomics on dQ
(FlashAttention-2, section 3.2).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.forward import key_tile, mask_inputs
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, build_ranges, dropout_scale,
                                    kernel_operands, query_block_order, query_offset,
                                    tile_scores, times, visit_tiles)
from pallas_kernels.tuning import BlockSizes, default_block_sizes, launch_params, padded_head_dim


def _tile_grads(q, k, v, do, lse2, delta, *, opts, scale, acc, precision, row0, col0, masked,
                kv_len, q_offset, q_seg, kv_seg, mask_tile, bias_tile, seed, batch, head, num_heads,
                fast_exp2, transposed=False):
  """(P~, dS, dS') of one tile: P~ feeds dV, dS the bias gradient, dS' feeds dQ and dK.

  [bq, bk] tiles, or [bk, bq] with `transposed`: the dK/dV kernel computes S^T = K Q^T
  directly, so P~^T and dS'^T enter its matmuls as they come out of the accumulator,
  where transposing a computed register tile would cost a round trip through shared
  memory per tile.
  """
  s, t, c = tile_scores(q, k, scale=scale, opts=opts, acc=acc, precision=precision, row0=row0,
                        col0=col0, masked=masked, kv_len=kv_len, q_offset=q_offset,
                        q_seg=q_seg, kv_seg=kv_seg, mask_tile=mask_tile, bias_tile=bias_tile, transposed=transposed)
  per_row = (lambda x: x[None, :]) if transposed else (lambda x: x[:, None])
  # lse2 is +inf on rows with no visible key and on rows past T: P = 0 there.
  p = common.exp2(times(s, c) - per_row(lse2), fast_exp2)
  if masked or mask_tile is not None:
    # A hidden key has P = 0 even on a row whose lse is NaN (exp2(-inf - NaN) is NaN):
    # the NaN of that row reaches the gradients of the keys it sees, not of every key.
    p = jnp.where(s == -jnp.inf, 0.0, p)
  if transposed:
    dp = common.dot_heads(v, do, acc=acc, precision=precision)
  else:
    dp = common.dot_heads(do, v, acc=acc, precision=precision)
  p_out = p
  if seed is not None:
    z = dropout_scale(seed, batch, head, row0, col0, s.shape, opts.dropout_rate, num_heads,
                      transposed=transposed)
    p_out = p * z
    dp = dp * z
  ds = p * (dp - per_row(delta))
  ds_logits = ds if t is None else ds * (1.0 - t * t)  # d(c tanh(x / c)) / dx
  return p_out, ds, ds_logits


def _add(acc, parts):
  """Head-dim pieces of a running sum plus those of one tile's product."""
  return tuple(a + b for a, b in zip(acc, parts, strict=True))


def _dkv_kernel(*refs, names, opts, scale, block_q, block_k, T, S, H, group, num_heads, acc,
                precision, head_blocked, fast_exp2):
  r = dict(zip(names, refs))
  # Program axis 2 runs over blocks of `group` query heads (a whole GQA group, or a
  # part of it when the group is split over programs); they share one key head.
  j, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  col0 = j * block_k
  cols_in = common.tail(col0, S, block_k)          # the last key block may overrun S
  k = common.load_heads(r["k"], (slice(None),), cols_in, H)        # [bk, H] in head-dim pieces
  v = common.load_heads(r["v"], (slice(None),), cols_in, H)
  ranges = r["ranges"]
  kv_len, q_offset = ranges[5], query_offset(ranges, opts)
  kv_seg = common.load(r["kv_seg"], cols_in, other=FILL["kv_seg"]) if "kv_seg" in r else None
  seed = r["seed"][0] if "seed" in r else None
  dk = tuple(jnp.zeros(x.shape, acc) for x in k)
  dv = tuple(jnp.zeros(x.shape, acc) for x in v)

  def body(i, carry, g, masked, overruns=False):
    dk, dv = carry
    row0 = i * block_q
    rows = pl.ds(row0, block_q)
    # Only the block that `overruns` T (`visit_query_blocks`) masks its query-side
    # loads. Rows past T read q = dO = delta = 0 and lse2 = +inf: P = 0 and dS = 0 there.
    rows_in = common.tail(row0, T, block_q) if overruns else None
    q = common.load_heads(r["q"], (rows, g), rows_in, H)
    do = common.load_heads(r["do"], (rows, g), rows_in, H)

    def dense(name):
      if name not in r:
        return None
      ref = r[name].at[g, rows, :] if head_blocked[name] else r[name].at[rows, :]
      return common.load(ref, rows_in, cols_in, other=FILL[name])

    p_t, _, ds_t = _tile_grads(           # [bk, bq]: P~^T and dS'^T
        q, k, v, do, common.load(r["lse2"].at[g, rows], rows_in, other=jnp.inf),
        common.load(r["delta"].at[g, rows], rows_in), opts=opts, scale=scale,
        acc=acc, precision=precision, row0=row0, col0=col0, masked=masked,
        kv_len=kv_len, q_offset=q_offset,
        q_seg=(common.load(r["q_seg"].at[rows], rows_in, other=FILL["q_seg"])
               if "q_seg" in r else None),
        kv_seg=kv_seg, mask_tile=dense("mask"), bias_tile=dense("bias"), seed=seed,
        batch=b, head=h * group + g, num_heads=num_heads, fast_exp2=fast_exp2,
        transposed=True)
    dv = _add(dv, common.dot_into_heads(p_t, do, acc=acc, precision=precision))
    dk = _add(dk, common.dot_into_heads(ds_t, q, acc=acc, precision=precision))
    return dk, dv

  # The query heads that share this key head run as a loop of the program, not as
  # copies of its body, so the kernel's size does not grow with the group; their dK/dV
  # sum in the same registers (no repeated K/V, no atomics).
  def one_head(g, carry):
    return visit_query_blocks(ranges, functools.partial(body, g=g), carry, T=T,
                              block_q=block_q)

  if group == 1:  # an int32 index: interpret mode's masked load rejects a Python int
    dk, dv = one_head(jnp.int32(0), (dk, dv))
  else:
    # A trip count traced from the program id keeps this a while loop (lowered to
    # scf.for as the tile loops are) instead of a scan: JAX 0.10's Pallas interpreter
    # re-evaluates a scan with the varying operands of shard_map(check_vma=True) and
    # rejects its carry, whose types were fixed when the kernel was traced.
    dk, dv = lax.fori_loop(0, group + 0 * h, one_head, (dk, dv))
  common.store_heads(r["dk"], [x * scale for x in dk], cols_in, H)
  common.store_heads(r["dv"], dv, cols_in, H)


def visit_query_blocks(ranges, body, carry, *, T, block_q):
  """`visit_tiles` over the query blocks of a dK/dV program, with the block that
  overruns T (when T is not whole blocks) visited last and on its own as
  `body(i, carry, masked=True, overruns=True)`. A block's class says which of its
  elements a mask may hide, not whether its rows run past T, so without this every
  visited block would pay for masked query loads (T = 3000: 46 of 47 blocks of 64 rows
  are whole)."""
  if T % block_q == 0:
    return visit_tiles(ranges, body, carry)
  whole = T // block_q                       # blocks [0, whole) lie inside T
  lo, full_lo, full_hi, hi = (jnp.minimum(ranges[t], whole) for t in range(4))
  carry = visit_tiles((lo, full_lo, full_hi, hi), body, carry)
  # `masked` is always correct, and the overrunning block is one iteration at most.
  return lax.fori_loop(jnp.maximum(ranges[0], whole), ranges[3],
                       functools.partial(body, masked=True, overruns=True), carry)


def _dq_kernel(*refs, names, opts, scale, block_q, block_k, T, S, H, num_k_blocks, num_heads,
               acc, precision, q_order, fast_exp2):
  r = dict(zip(names, refs))
  i, b, n = q_order(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
  row0 = i * block_q
  rows_in = common.tail(row0, T, block_q)
  q = common.load_heads(r["q"], (slice(None),), rows_in, H)
  do = common.load_heads(r["do"], (slice(None),), rows_in, H)
  lse2 = common.load(r["lse2"], rows_in, other=jnp.inf)
  delta = common.load(r["delta"], rows_in)
  ranges = r["ranges"]
  lo, hi, kv_len, q_offset = ranges[0], ranges[3], ranges[5], query_offset(ranges, opts)
  q_seg = common.load(r["q_seg"], rows_in, other=FILL["q_seg"]) if "q_seg" in r else None
  seed = r["seed"][0] if "seed" in r else None
  dq = tuple(jnp.zeros(x.shape, acc) for x in q)

  def body(j, dq, masked):
    t = key_tile(r, j, block_k=block_k, S=S, H=H, rows_in=rows_in, masked=masked)
    _, ds, ds_logits = _tile_grads(
        q, t.k, t.v, do, lse2, delta, opts=opts, scale=scale, acc=acc, precision=precision,
        row0=row0, col0=t.col0, masked=masked, kv_len=kv_len, q_offset=q_offset, q_seg=q_seg,
        kv_seg=t.kv_seg,
        mask_tile=t.mask, bias_tile=t.bias, seed=seed, batch=b, head=n,
        num_heads=num_heads, fast_exp2=fast_exp2)
    if "dbias" in r:
      common.store(r["dbias"].at[:, t.cols], ds.astype(r["dbias"].dtype), rows_in, t.cols_in)
    return _add(dq, common.dot_into_heads(ds_logits, t.k, acc=acc, precision=precision))

  if "dbias" in r:  # tiles never visited have a zero bias gradient
    def zero(j, _):
      col0 = j * block_k
      common.store(r["dbias"].at[:, pl.ds(col0, block_k)],
                   jnp.zeros((block_q, block_k), r["dbias"].dtype),
                   rows_in, common.tail(col0, S, block_k))
      return _
    lax.fori_loop(0, lo, zero, 0)
    lax.fori_loop(hi, num_k_blocks, zero, 0)
  dq = visit_tiles(ranges, body, dq)
  common.store_heads(r["dq"], [x * scale for x in dq], rows_in, H)


def _group_inputs(ops: MaskOperands, *, G, Tp, bk):
  """Mask operands for the dK/dV kernel: all query rows, the key block, `G` query heads."""
  x = kernel_operands(ops)
  specs = {
      "q_seg": pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
      "kv_seg": pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
      "seed": pl.BlockSpec((1,), lambda *g: (0,)),
  }
  head_blocked = {}
  for name in ("mask", "bias"):
    if name in x:
      bb, nb = x[name].shape[0] > 1, x[name].shape[1] > 1
      head_blocked[name] = nb
      if nb:
        specs[name] = pl.BlockSpec((None, G, Tp, bk),
                                   lambda j, b, h, bb=bb: (b if bb else 0, h, 0, j))
      else:
        specs[name] = pl.BlockSpec((None, None, Tp, bk),
                                   lambda j, b, h, bb=bb: (b if bb else 0, 0, 0, j))
  names = list(x)
  return names, [x[n] for n in names], [specs[n] for n in names], head_blocked


# Programs the dK/dV grid should have before a GQA group is split over several: about
# three per multiprocessor of an H100/H200 (132), which at the kernel's two resident
# programs per multiprocessor leaves room for causal programs of unequal length to even
# out (`flash_backward(dkv_split=...)` sets the split of one call).
DKV_MIN_PROGRAMS = 3 * 132
# Causal groups up to this size are split into one query head per program whatever the
# program count: a causal dK/dV program's work falls with its key block's distance from
# the end, and with the group's heads in one program the heaviest are `group` times
# longer. The partial sums cost float32 dK and dV per query head, B x S x N x H x 8
# bytes; past four heads a further split gains little for many times the partials, so
# larger groups keep the program rule (the timings: docs/performance.md, "GQA splits").
CAUSAL_FULL_SPLIT_MAX_GROUP = 4


def dkv_splits(group: int, programs: int, interpret: bool, causal: bool = False) -> int:
  """Parts each GQA group is split into over dK/dV programs (FlashAttention-2 sums
  per-head dK/dV; here a part sums its heads in registers and the parts are added in
  float32 afterwards): one per head for causal groups of up to
  CAUSAL_FULL_SPLIT_MAX_GROUP heads, else the fewest that reach DKV_MIN_PROGRAMS,
  dividing the group."""
  if interpret:
    return 1
  if causal and group <= CAUSAL_FULL_SPLIT_MAX_GROUP:
    return group
  for p in range(1, group + 1):
    if group % p == 0 and programs * p >= DKV_MIN_PROGRAMS:
      return p
  return group


def backward_statistics(lse, out, dout, dlse=None):
  """(lse2, delta) [B, N, T]: the log-sum-exp in base 2 and delta = rowsum(dO * O)
  (minus the lse cotangent, if any), one fused XLA reduction each.

  A row that masks emptied has lse = -inf; its lse2 is +inf so that P = exp2(s - lse2)
  = 0 there. Only -inf is mapped: a NaN lse (a NaN that reached a visible logit) stays
  NaN so that it reaches every gradient of that row.
  """
  acc = common.acc_dtype(out.dtype)
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(acc), out.astype(acc))
  if dlse is not None:
    delta = delta - dlse.astype(acc)
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(acc) * common.LOG2E)
  return lse2, delta


def flash_backward(q, k, v, out, lse, dout, dlse=None, *, scale: float,
                   opts: MaskOptions | None = None, ops: MaskOperands | None = None,
                   block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                   is_causal: bool | None = None, dkv_split: int | None = None):
  """Gradients of attention from the saved (q, k, v, out, lse) and the output cotangent.

  Returns (dq, dk, dv), and dbias (shaped like `ops.bias`) when a bias is given. As in
  the forward, no input is padded or copied: tails of T, S and H are masked loads.
  `dkv_split` splits each GQA group over that many dK/dV programs (None: `dkv_splits`).
  """
  opts = opts or MaskOptions(is_causal=bool(is_causal))
  ops = ops or MaskOperands()
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  blocks = block_sizes or default_block_sizes(H)
  Hp = padded_head_dim(H)
  acc = common.acc_dtype(q.dtype)
  precision = common.dot_precision(q.dtype)
  interp = common.use_interpret(interpret)
  fast_exp2 = common.fast_exp2_enabled(interp)
  lse2, delta = backward_statistics(lse, out, dout, dlse)
  sizes = dict(T=T, S=S, H=H, num_heads=N, acc=acc, precision=precision, fast_exp2=fast_exp2)

  # -- dK, dV: grid over key blocks of each key head (and, split, of parts of its group)
  bq = common.fit_block(blocks.block_q_dkv, T)
  bk = common.fit_block(blocks.block_k_dkv, S)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  P = dkv_splits(G, Sp // bk * B * K, interp, opts.is_causal) if dkv_split is None else dkv_split
  if not isinstance(P, int) or P < 1 or G % P:
    raise ValueError(f"dkv_split={P!r} must be a positive divisor of the group size {G} "
                     f"(= {N} // {K})")
  Gp = G // P   # query heads per program
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk, transpose=True)
  x_names, x_arrays, x_specs, head_blocked = _group_inputs(ops, G=Gp, Tp=Tp, bk=bk)
  names = ["q", "k", "v", "do", "lse2", "delta", "ranges", *x_names, "dk", "dv"]
  operands = (q, k, v, dout, lse2, delta, ranges, *x_arrays)
  if P == 1:
    out_specs = [pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0))] * 2
    out_shape = [common.out_type(k.shape, k.dtype, *operands),
                 common.out_type(v.shape, v.dtype, *operands)]
  else:
    # Each part of a group writes its own float32 partial sums, added up below.
    out_specs = [pl.BlockSpec((None, None, bk, None, Hp),
                              lambda j, b, h: (h % P, b, j, h // P, 0))] * 2
    out_shape = [common.out_type((P, *k.shape), acc, *operands)] * 2
  kv_head = lambda h: h // P
  dk, dv = pl.pallas_call(
      functools.partial(
          _dkv_kernel, names=names, opts=opts, scale=scale, block_q=bq, block_k=bk,
          group=Gp, head_blocked=head_blocked, **sizes),
      grid=(Sp // bk, B, K * P),
      in_specs=[
          pl.BlockSpec((None, Tp, Gp, Hp), lambda j, b, h: (b, 0, h, 0)),           # q
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, kv_head(h), 0)),  # k
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, kv_head(h), 0)),  # v
          pl.BlockSpec((None, Tp, Gp, Hp), lambda j, b, h: (b, 0, h, 0)),           # dout
          pl.BlockSpec((None, Gp, Tp), lambda j, b, h: (b, h, 0)),                  # lse2
          pl.BlockSpec((None, Gp, Tp), lambda j, b, h: (b, h, 0)),                  # delta
          pl.BlockSpec((None, None, 8), lambda j, b, h: (b, j, 0)),                 # ranges
          *x_specs,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.triton_params(*launch_params(H, blocks, "dkv")),
      interpret=interp,
      name="jflash_bwd_dkv",
  )(*operands)
  if P > 1:
    dk, dv = dk.sum(0).astype(k.dtype), dv.sum(0).astype(v.dtype)

  # -- dQ (and dbias): grid over query blocks of each query head
  bq = common.fit_block(blocks.block_q_dq, T)
  bk = common.fit_block(blocks.block_k_dq, S)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
  qo = query_block_order(Tp // bq, opts)
  x_names, x_arrays, x_specs = mask_inputs(
      ops, Sp=Sp, bq=bq, q_index=lambda i, b, n: (b, n, qo(i)))
  operands = (q, k, v, dout, lse2, delta, ranges, *x_arrays)
  out_names = ["dq"]
  out_specs = [pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, qo(i), n, 0))]
  out_shape = [common.out_type(q.shape, q.dtype, *operands)]
  if ops.bias is not None:
    # The bias is the caller's own [B|1, N|1, T, S] input; its gradient is written per
    # (batch, head) and summed over broadcast axes below.
    out_names.append("dbias")
    out_specs.append(pl.BlockSpec((None, None, bq, Sp), lambda i, b, n: (b, n, qo(i), 0)))
    out_shape.append(common.out_type((B, N, T, S), acc, *operands))
  names = ["q", "k", "v", "do", "lse2", "delta", "ranges", *x_names, *out_names]
  res = pl.pallas_call(
      functools.partial(
          _dq_kernel, names=names, opts=opts, scale=scale, block_q=bq, block_k=bk,
          num_k_blocks=Sp // bk, q_order=qo, **sizes),
      grid=(Tp // bq, B, N),
      in_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, qo(i), n, 0)),   # q
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),  # k
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),  # v
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, qo(i), n, 0)),   # dout
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, qo(i))),          # lse2
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, qo(i))),          # delta
          pl.BlockSpec((None, None, 8), lambda i, b, n: (b, qo(i), 0)),           # ranges
          *x_specs,
      ],
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=common.triton_params(*launch_params(H, blocks, "dq")),
      interpret=interp,
      name="jflash_bwd_dq",
  )(*operands)
  grads = (res[0], dk, dv)
  if ops.bias is None:
    return grads
  dbias = res[1]
  axes = tuple(a for a in (0, 1) if ops.bias.shape[a] == 1)
  if axes:
    dbias = dbias.sum(axis=axes, keepdims=True)
  return (*grads, dbias.astype(ops.bias.dtype))
