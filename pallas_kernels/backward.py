"""FlashAttention-2 backward: delta preprocess, a dK/dV kernel and a dQ kernel.

Both kernels recompute P = exp2(s - lse2) from the saved log-sum-exp instead of
reading a stored [T, S] matrix (FlashAttention-2, Algorithm 2), with
  dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dK = scale dS^T Q,  dQ = scale dS K
and delta = rowsum(dO * O) (minus the lse cotangent, if any).

The dK/dV kernel runs over key blocks and loops over the query blocks *and the
query heads of a GQA group*, so dK/dV of a shared key head are summed in registers
without repeating K/V. The dQ kernel runs over query blocks and loops over key blocks.
Splitting them avoids atomics on dQ (FlashAttention-2, section 3.2).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.tuning import BlockSizes, default_block_sizes, launch_params, padded_head_dim


def _probs(q, k, lse2, *, scale2, acc, precision, mask):
  s = common.dot(q, k, trans_b=True, acc=acc, precision=precision) * scale2
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  # lse2 is +inf on rows with no visible key and on padded rows: P = 0 there.
  return jnp.exp2(s - lse2[:, None])


def _causal_mask(row0, col0, shape):
  rows = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = col0 + lax.broadcasted_iota(jnp.int32, shape, 1)
  return rows >= cols


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale, scale2, is_causal, block_q, block_k, num_q_blocks, group, acc,
                precision):
  j = pl.program_id(0)
  k = k_ref[...]                                            # [bk, Hp]
  v = v_ref[...]
  dk = jnp.zeros(k.shape, acc)
  dv = jnp.zeros(v.shape, acc)

  def body(i, carry, g, masked):
    dk, dv = carry
    rows = pl.ds(i * block_q, block_q)
    q = q_ref[rows, g, :]
    do = do_ref[rows, g, :]
    lse2 = lse_ref[g, rows]
    delta = delta_ref[g, rows]
    mask = _causal_mask(i * block_q, j * block_k, (block_q, block_k)) if masked else None
    p = _probs(q, k, lse2, scale2=scale2, acc=acc, precision=precision, mask=mask)
    dv = dv + common.dot(p.astype(do.dtype).T, do, acc=acc, precision=precision)
    dp = common.dot(do, v, trans_b=True, acc=acc, precision=precision)
    ds = (p * (dp - delta[:, None])).astype(q.dtype)
    dk = dk + common.dot(ds.T, q, acc=acc, precision=precision)
    return dk, dv

  lo, n_mask = common.q_range(j, block_q=block_q, block_k=block_k,
                              num_q_blocks=num_q_blocks, is_causal=is_causal)
  carry = (dk, dv)
  for g in range(group):  # static: the query heads that share this key head
    carry = lax.fori_loop(lo, n_mask, functools.partial(body, g=g, masked=True), carry)
    carry = lax.fori_loop(n_mask, num_q_blocks, functools.partial(body, g=g, masked=False),
                          carry)
  dk, dv = carry
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, scale2,
               is_causal, block_q, block_k, num_k_blocks, acc, precision):
  i = pl.program_id(0)
  q = q_ref[...]
  do = do_ref[...]
  lse2 = lse_ref[...]
  delta = delta_ref[...]
  dq = jnp.zeros(q.shape, acc)

  def body(j, dq, masked):
    cols = pl.ds(j * block_k, block_k)
    k = k_ref[cols, :]
    v = v_ref[cols, :]
    mask = _causal_mask(i * block_q, j * block_k, (block_q, block_k)) if masked else None
    p = _probs(q, k, lse2, scale2=scale2, acc=acc, precision=precision, mask=mask)
    dp = common.dot(do, v, trans_b=True, acc=acc, precision=precision)
    ds = (p * (dp - delta[:, None])).astype(k.dtype)
    return dq + common.dot(ds, k, acc=acc, precision=precision)

  # Padded key columns need no mask here: K and V are zero-padded, so their dS column
  # multiplies a zero row of K.
  n_full, hi = common.kv_range(i, block_q=block_q, block_k=block_k,
                               num_k_blocks=num_k_blocks, kv_len=num_k_blocks * block_k,
                               is_causal=is_causal)
  dq = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq)
  dq = lax.fori_loop(n_full, hi, functools.partial(body, masked=True), dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def flash_backward(q, k, v, out, lse, dout, dlse=None, *, scale: float, is_causal: bool,
                   block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """Gradients of attention from the saved (q, k, v, out, lse) and the output cotangent.

  Returns (dq, dk, dv) in the input dtypes.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  blocks = block_sizes or default_block_sizes(H)
  Hp = padded_head_dim(H)
  acc = common.acc_dtype(q.dtype)
  precision = common.dot_precision(q.dtype)
  interp = common.use_interpret(interpret)
  warps, stages = launch_params(H, blocks, backward=True)

  # -- preprocess: delta = rowsum(dO * O) (one fused XLA reduction), lse in base 2 with
  # +inf where a row saw no key so that exp2(s - lse2) = 0 there.
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(acc), out.astype(acc))
  if dlse is not None:
    delta = delta - dlse.astype(acc)
  lse2 = jnp.where(jnp.isfinite(lse), lse.astype(acc) * common.LOG2E, jnp.inf)

  # -- dK, dV: grid over key blocks of each key head
  bq = common.fit_block(blocks.block_q_dkv, T)
  bk = common.fit_block(blocks.block_k_dkv, S)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  pad_q = lambda x: common.pad_to(common.pad_to(x, 3, Hp), 1, Tp)
  pad_k = lambda x: common.pad_to(common.pad_to(x, 3, Hp), 1, Sp)
  dk, dv = pl.pallas_call(
      functools.partial(
          _dkv_kernel, scale=scale, scale2=scale * common.LOG2E, is_causal=is_causal,
          block_q=bq, block_k=bk, num_q_blocks=Tp // bq, group=G, acc=acc,
          precision=precision),
      grid=(Sp // bk, B, K),
      in_specs=[
          pl.BlockSpec((None, Tp, G, Hp), lambda j, b, h: (b, 0, h, 0)),   # q, the group
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),  # k
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),  # v
          pl.BlockSpec((None, Tp, G, Hp), lambda j, b, h: (b, 0, h, 0)),   # dout
          pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0)),          # lse2
          pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0)),          # delta
      ],
      out_specs=[
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),
          pl.BlockSpec((None, bk, None, Hp), lambda j, b, h: (b, j, h, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((B, Sp, K, Hp), k.dtype),
                 jax.ShapeDtypeStruct((B, Sp, K, Hp), v.dtype)],
      compiler_params=common.triton_params(warps, stages),
      interpret=interp,
      name="jflash_bwd_dkv",
  )(pad_q(q), pad_k(k), pad_k(v), pad_q(dout), _pad_t(lse2, Tp, jnp.inf), _pad_t(delta, Tp, 0))

  # -- dQ: grid over query blocks of each query head
  bq = common.fit_block(blocks.block_q_dq, T)
  bk = common.fit_block(blocks.block_k_dq, S)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  pad_q = lambda x: common.pad_to(common.pad_to(x, 3, Hp), 1, Tp)
  pad_k = lambda x: common.pad_to(common.pad_to(x, 3, Hp), 1, Sp)
  dq = pl.pallas_call(
      functools.partial(
          _dq_kernel, scale=scale, scale2=scale * common.LOG2E, is_causal=is_causal,
          block_q=bq, block_k=bk, num_k_blocks=Sp // bk, acc=acc,
          precision=precision),
      grid=(Tp // bq, B, N),
      in_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),       # q
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),  # k
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),  # v
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),       # dout
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),              # lse2
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),              # delta
      ],
      out_specs=pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
      out_shape=jax.ShapeDtypeStruct((B, Tp, N, Hp), q.dtype),
      compiler_params=common.triton_params(warps, stages),
      interpret=interp,
      name="jflash_bwd_dq",
  )(common.pad_to(common.pad_to(q, 3, Hp), 1, Tp),
    common.pad_to(common.pad_to(k, 3, Hp), 1, Sp),
    common.pad_to(common.pad_to(v, 3, Hp), 1, Sp),
    common.pad_to(common.pad_to(dout, 3, Hp), 1, Tp),
    _pad_t(lse2, Tp, jnp.inf), _pad_t(delta, Tp, 0))
  return dq[:, :T, :, :H], dk[:, :S, :, :H], dv[:, :S, :, :H]


def _pad_t(x, size, fill):
  """Pads the last (query) axis of a [B, N, T] statistic."""
  return jnp.pad(x, ((0, 0), (0, 0), (0, size - x.shape[-1])), constant_values=fill)
