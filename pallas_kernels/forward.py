"""FlashAttention-2 forward kernel: (q, k, v) -> (out, lse).

Grid (query block, batch, head): each program owns one [block_q, H] tile of Q and
loops over key/value blocks, keeping the running max `m_i`, running sum `l_i` and
the unnormalised output `acc` in float32 (FlashAttention-2, Algorithm 1). Logits are
kept in base 2 (`exp2`, scale folded with log2(e)); lse is returned in natural log.
No [T, S] array exists anywhere.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import common
from pallas_kernels.tuning import BlockSizes, default_block_sizes, launch_params, padded_head_dim


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale2, is_causal, block_q,
                block_k, kv_len, num_k_blocks, acc, precision):
  i = pl.program_id(0)
  q = q_ref[...]                                            # [bq, Hp], stays resident
  m_i = jnp.full((block_q,), -jnp.inf, acc)
  l_i = jnp.zeros((block_q,), acc)
  o = jnp.zeros(q.shape, acc)

  def body(j, carry, masked):
    o, m_i, l_i = carry
    k = k_ref[pl.ds(j * block_k, block_k), :]
    v = v_ref[pl.ds(j * block_k, block_k), :]
    s = common.dot(q, k, trans_b=True, acc=acc, precision=precision) * scale2
    if masked:  # boundary tiles only: causal diagonal and the clipped last key tile
      cols = j * block_k + lax.broadcasted_iota(jnp.int32, s.shape, 1)
      keep = cols < kv_len
      if is_causal:
        rows = i * block_q + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        keep = keep & (rows >= cols)
      s = jnp.where(keep, s, -jnp.inf)
    # -- update m_i and l_i. A row with nothing visible yet has m = -inf; use 0 in its
    # place so exp2 never sees (-inf) - (-inf).
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new).astype(acc)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_i = alpha * l_i + jnp.sum(p, axis=1)
    o = alpha[:, None] * o + common.dot(p.astype(v.dtype), v, acc=acc, precision=precision)
    return o, m_new, l_i

  n_full, hi = common.kv_range(i, block_q=block_q, block_k=block_k,
                               num_k_blocks=num_k_blocks, kv_len=kv_len,
                               is_causal=is_causal)
  carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), (o, m_i, l_i))
  o, m_i, l_i = lax.fori_loop(n_full, hi, functools.partial(body, masked=True), carry)

  # -- normalise once at the end (FlashAttention-2, section 3.1.1); an empty row -> 0
  has = l_i > 0
  l_safe = jnp.where(has, l_i, 1.0)
  o_ref[...] = (o / l_safe[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has, (m_i + jnp.log2(l_safe)) * common.LN2, -jnp.inf).astype(lse_ref.dtype)


def flash_forward(q, k, v, *, scale: float, is_causal: bool,
                  block_sizes: BlockSizes | None = None, interpret: bool | None = None):
  """q [B, T, N, H], k/v [B, S, K, H] -> out [B, T, N, H], lse [B, N, T] (natural log)."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  blocks = block_sizes or default_block_sizes(H)
  bq = common.fit_block(blocks.block_q, T)
  bk = common.fit_block(blocks.block_k, S)
  Hp = padded_head_dim(H)
  Tp, Sp = common.round_up(T, bq), common.round_up(S, bk)
  # Zero padding: padded head columns add 0 to every dot product; padded keys are
  # masked in the last tile; padded query rows are computed and dropped.
  qp = common.pad_to(common.pad_to(q, 3, Hp), 1, Tp)
  kp = common.pad_to(common.pad_to(k, 3, Hp), 1, Sp)
  vp = common.pad_to(common.pad_to(v, 3, Hp), 1, Sp)
  acc = common.acc_dtype(q.dtype)
  warps, stages = launch_params(H, blocks, backward=False)
  kernel = functools.partial(
      _fwd_kernel, scale2=scale * common.LOG2E, is_causal=is_causal, block_q=bq,
      block_k=bk, kv_len=S, num_k_blocks=Sp // bk, acc=acc,
      precision=common.dot_precision(q.dtype))
  out, lse = pl.pallas_call(
      kernel,
      grid=(Tp // bq, B, N),
      in_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
          pl.BlockSpec((None, Sp, None, Hp), lambda i, b, n: (b, 0, n // G, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, Hp), lambda i, b, n: (b, i, n, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct((B, Tp, N, Hp), q.dtype),
                 jax.ShapeDtypeStruct((B, N, Tp), acc)],
      compiler_params=common.triton_params(warps, stages),
      interpret=common.use_interpret(interpret),
      name="jflash_fwd",
  )(qp, kp, vp)
  return out[:, :T, :, :H], lse[:, :, :T]
