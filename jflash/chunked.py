""""xla_chunked": the FlashAttention algorithm in plain JAX.

Blockwise online softmax over `lax.scan` across key/value blocks, the same residuals
`(q, k, v, out, lse)` and the same recompute backward as the Pallas kernels. The
largest live intermediate is `[B, K, G, T, block_k]`, so memory is linear in the
sequence length. The default on CPU, and the fallback wherever Pallas cannot run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jflash.config import ChunkedConfig
from jflash.masks import hidden_logit, is_neg_inf, masked_logits
from jflash.platforms import ANY
from jflash.reference import stat_dtype

# The device kinds (jflash.platforms.device_kinds) where `implementation=None` tries
# this implementation: every device, after the kernels preferred there.
PREFERRED_ON = (ANY,)


def _blocks(x, block):
  """[B, S, K, H] -> [S/block, B, block, K, H], zero-padded along S."""
  B, S, K, H = x.shape
  nblk = -(-S // block)
  x = jnp.pad(x, ((0, 0), (0, nblk * block - S), (0, 0), (0, 0)))
  return x.reshape(B, nblk, block, K, H).transpose(1, 0, 2, 3, 4)


def _block_k(cfg, S):
  own = cfg.backend_config(ChunkedConfig) or ChunkedConfig()
  return min(own.block_k, S)


def forward(q, k, v, cfg, masks):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  acc = stat_dtype(q.dtype)
  bk = _block_k(cfg, S)
  qg = q.reshape(B, T, K, G, H)

  def step(carry, xs):
    m_i, l_i, o = carry
    kj, vj, j0 = xs
    raw = jnp.einsum("btkgh,bskh->bkgts", qg, kj, preferred_element_type=acc) * cfg.scale
    s, keep, _, drop = masked_logits(raw, j0 + jnp.arange(bk), masks, K=K, G=G, S=S)
    # -- update m_i and l_i. Hidden entries hold a finite logit (`hidden_logit`, also
    # the initial max) and are zeroed by `keep`, so no inf arises; only visible logits
    # of -inf can make m = -inf, and a finite stand-in keeps exp() free of
    # (-inf) - (-inf) there.
    m_new = jnp.maximum(m_i, s.max(-1))
    m_safe = jnp.where(is_neg_inf(m_new), 0, m_new)
    alpha = jnp.exp(m_i - m_safe)
    p = jnp.where(keep, jnp.exp(s - m_safe[..., None]), 0)
    l_i = alpha * l_i + p.sum(-1)  # the normaliser counts every visible key...
    if drop is not None:
      p = p * drop                 # ...but only kept ones reach the output
    o = alpha[..., None] * o + jnp.einsum(
        "bkgts,bskh->bkgth", p.astype(q.dtype), vj, preferred_element_type=acc)
    return (m_new, l_i, o), None

  # Carries built from q (not from constants) so they carry q's sharding/varying axes
  # inside shard_map (ring attention runs this per device).
  o0 = jnp.zeros_like(qg.transpose(0, 2, 3, 1, 4), acc)
  init = (jnp.full_like(o0[..., 0], hidden_logit(acc)), jnp.zeros_like(o0[..., 0]), o0)
  starts = jnp.arange(0, _blocks(k, bk).shape[0]) * bk
  # The step is a remat boundary: inside a differentiated outer lax.scan (a scanned
  # layer stack), partial evaluation of this nested scan would otherwise keep every
  # step's [T, block_k] masks and scores as residuals, i.e. T x S memory (measured:
  # 441 MiB instead of 249 at T = 8192 for two scanned layers).
  (m_i, l_i, o), _ = lax.scan(jax.checkpoint(step), init,
                              (_blocks(k, bk), _blocks(v, bk), starts))
  # A row the masks empty has l = 0 exactly (`keep` zeroes every p) and gives zeros
  # and lse = -inf. Any visible key adds exp(0) = 1 for the row maximum, so l >= 1; a
  # NaN or inf logit makes l NaN or inf, which must reach the output, so the test is
  # l != 0 (NaN != 0 holds), not l > 0.
  has = l_i != 0
  l_safe = jnp.where(has, l_i, 1)
  out = jnp.where(has[..., None], o / l_safe[..., None], 0)
  lse = jnp.where(has, m_i, 0) + jnp.log(l_i)  # log(0) = -inf for an empty row
  out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H).astype(q.dtype)
  return out, lse.reshape(B, N, T)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  acc = stat_dtype(q.dtype)
  bk = _block_k(cfg, S)
  qg = q.reshape(B, T, K, G, H)
  dog = dout.reshape(B, T, K, G, H)
  # delta_i = rowsum(dO_i * O_i) (FlashAttention-2, Algorithm 2, line 4), minus the
  # lse cotangent (d lse_i / d s_ij = P_ij).
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(acc), out.astype(acc))
  delta = (delta - dlse.astype(acc)).reshape(B, K, G, T)
  lse = lse.reshape(B, K, G, T)
  # A row with no key (lse = -inf) has no visible entry, so `keep` zeroes its P; the
  # finite stand-in keeps exp() free of inf. A NaN lse stays NaN.
  lse_safe = jnp.where(is_neg_inf(lse), 0, lse)
  bias = masks.bias

  def step(dq, xs):
    kj, vj, j0 = xs
    raw = jnp.einsum("btkgh,bskh->bkgts", qg, kj, preferred_element_type=acc) * cfg.scale
    s, keep, t, drop = masked_logits(raw, j0 + jnp.arange(bk), masks, K=K, G=G, S=S)
    p = jnp.where(keep, jnp.exp(s - lse_safe[..., None]), 0)  # recomputed P
    pd = p if drop is None else p * drop
    dv = jnp.einsum("bkgts,btkgh->bskh", pd.astype(q.dtype), dog, preferred_element_type=acc)
    dp = jnp.einsum("btkgh,bskh->bkgts", dog, vj, preferred_element_type=acc)
    if drop is not None:
      dp = dp * drop
    ds = p * (dp - delta[..., None])
    dbias = None
    if bias is not None:  # the bias enters after the soft cap: its gradient is dS
      dbias = _reduce_to_bias(ds, bias.shape).astype(bias.dtype)
    if t is not None:
      ds = ds * (1 - t * t)  # d(cap * tanh(x / cap)) / dx
    ds = (ds * cfg.scale).astype(q.dtype)
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, kj, preferred_element_type=acc)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, qg, preferred_element_type=acc)
    return dq, (dk.astype(k.dtype), dv.astype(v.dtype), dbias)

  starts = jnp.arange(0, _blocks(k, bk).shape[0]) * bk
  dq, (dk, dv, dbias) = lax.scan(step, jnp.zeros_like(qg, acc),
                                 (_blocks(k, bk), _blocks(v, bk), starts))
  unblock = lambda x: x.transpose(1, 0, 2, 3, 4).reshape(B, -1, K, H)[:, :S]
  grads = (dq.reshape(B, T, N, H).astype(q.dtype), unblock(dk), unblock(dv))
  if bias is None:
    return grads
  if bias.shape[-1] == 1:      # [nblk, Bb, Nb, Tb, 1]: a key-broadcast bias sums its blocks
    return (*grads, dbias.sum(0))
  # [nblk, Bb, Nb, Tb, bk] -> [Bb, Nb, Tb, S]
  nb = dbias.shape[0]
  dbias = dbias.transpose(1, 2, 3, 0, 4).reshape(*dbias.shape[1:4], nb * bk)[..., :S]
  return (*grads, dbias)


def _reduce_to_bias(ds, bias_shape):
  """[B, K, G, T, c] -> [B|1, N|1, T|1, c|1], summing the axes the bias broadcasts over."""
  B, K, G, T, c = ds.shape
  ds = ds.reshape(B, K * G, T, c)
  axes = tuple(i for i in range(4) if bias_shape[i] == 1)
  return ds.sum(axis=axes, keepdims=True) if axes else ds
