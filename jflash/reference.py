"""Reference attention: the "xla" baseline, a float64 NumPy truth, and the tiled
online-softmax algorithm written out in NumPy as an independent check of the kernels.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def stat_dtype(dtype):
  """Softmax statistics and accumulators: float32, or float64 for float64 inputs."""
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


# -- the accuracy rule ----------------------------------------------------------------
# An implementation's error against the float64 truth must be at most twice the error of
# the plain same-dtype implementation ("xla") against the same truth, plus this floor
# for results the plain implementation gets (nearly) exactly.

def max_err(x, ref) -> float:
  """Largest absolute difference from a float64 truth (0 for empty arrays)."""
  return float(np.max(np.abs(np.asarray(x, np.float64) - ref))) if np.size(ref) else 0.0


def error_floor(dtype, ref, length: int) -> float:
  """Two roundings to the output dtype plus a few float32 roundings of a sum of
  `length` terms (accumulators are float32: that error grows like sqrt(length) eps),
  relative to the result's size. `length` is the longest reduction behind the result:
  H for a dot product, S for out and dq, T x (N/K) for dk and dv (where, e.g. at S = 1,
  dS = dP - delta is zero in exact arithmetic and only rounding remains)."""
  eps_out, eps_acc = float(jnp.finfo(dtype).eps), float(jnp.finfo(jnp.float32).eps)
  if jnp.dtype(dtype) == jnp.float64:
    eps_acc = eps_out
  top = float(np.abs(ref).max()) if np.size(ref) else 0.0
  return (2 * eps_out + 4 * eps_acc * math.sqrt(length)) * max(1.0, top)


def sum_to_shape(x: np.ndarray, shape) -> np.ndarray:
  """The gradient of a broadcast: `x` summed over the axes along which an array of
  `shape` was broadcast to x's shape (leading axes it lacks, and its size-one axes)."""
  x = x.sum(axis=tuple(range(x.ndim - len(shape))))
  return x.sum(axis=tuple(i for i, d in enumerate(shape) if d == 1), keepdims=True)


def causal_mask(T: int, S: int) -> np.ndarray:
  """[T, S] bool, query i sees keys j <= i (top-left aligned, as jax.nn)."""
  return np.arange(T)[:, None] >= np.arange(S)[None, :]


# -- "xla": standard attention, materialises the [B, N, T, S] scores -------------

def attention_xla(q, k, v, *, scale: float, is_causal: bool = False, masks=None):
  """Standard attention in plain XLA ops; returns (out, lse).

  Scores are computed in the statistics dtype (float32 for half inputs): this is the
  usual "upcast the logits" implementation, and its memory is O(T x S) per head.
  `masks` (a `jflash.masks.Masks`) adds every mask option; without it, `is_causal`.
  """
  from jflash.masks import Masks, is_neg_inf, masked_logits
  if masks is None:
    masks = Masks(is_causal=is_causal)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  acc = stat_dtype(q.dtype)
  qg = q.reshape(B, T, K, G, H)
  raw = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=acc) * scale
  s, keep, _, drop = masked_logits(raw, jnp.arange(S), masks, K=K, G=G, S=S)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(is_neg_inf(m), 0, m)  # visible logits of -inf only: no (-inf) - (-inf)
  p = jnp.where(keep, jnp.exp(s - m), 0)  # hidden entries hold a finite logit: zeroed here
  l = jnp.sum(p, axis=-1, keepdims=True)
  # l = 0 only for a row the masks empty; NaN != 0, so a NaN logit reaches the output.
  has = l != 0
  inv = jnp.where(has, 1 / jnp.where(has, l, 1), 0)
  p = p * inv if drop is None else p * inv * drop
  out = jnp.einsum("bkgts,bskh->btkgh", p.astype(q.dtype), v, preferred_element_type=acc)
  lse = (jnp.where(has, m, 0) + jnp.log(l))[..., 0]  # log(0) = -inf for an empty row
  return out.reshape(B, T, N, H).astype(q.dtype), lse.reshape(B, N, T)


# -- float64 NumPy truth -------------------------------------------------------------

def attention_numpy(q, k, v, *, scale: float | None = None, is_causal: bool = False,
                    causal_alignment: str = "top_left", bias=None, mask=None, query_seq_lengths=None, key_value_seq_lengths=None,
                    segment_ids=None, local_window_size=None, logits_soft_cap=None,
                    dropout_rate=0.0, dropout_seed=None, dout=None, dq_abs_terms=False):
  """float64 reference with every option of `jflash.attention`.

  Returns (out, lse), or with `dout` (out, lse, dq, dk, dv) and dbias appended when a
  bias is given; with `dq_abs_terms` also |s| |dlogits| |K| last, the sum of the
  absolute terms of each dQ element (which bounds how far a float32 sum of them, or of
  partial sums of them, moves when the order of its adds changes: Higham, Accuracy and
  Stability of Numerical Algorithms, section 4.2). Gradients are the closed-form
  softmax backward:
    dV = P~^T dO, dP~ = dO V^T, dP = dP~ * Z/(1-r), dS = P * (dP - rowsum(dO * O)),
    dlogits = dS * (1 - tanh^2) with a soft cap, dQ = s dlogits K, dK = s dlogits^T Q,
  where P~ = P * Z/(1-r) is P after dropout with keep mask Z.
  """
  from jflash.masks import Masks, dense_keep_numpy
  from pallas_kernels.masking import dropout_keep_numpy
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1 / math.sqrt(H) if scale is None else scale
  if isinstance(local_window_size, int):
    local_window_size = (local_window_size, local_window_size)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
  keep = dense_keep_numpy(B, N, T, S, Masks(
      is_causal=is_causal, window=local_window_size, causal_alignment=causal_alignment, mask=mask, q_lengths=query_seq_lengths,
      kv_lengths=key_value_seq_lengths, q_segment_ids=q_seg, kv_segment_ids=kv_seg))
  kr = np.repeat(k, G, axis=2)  # query head n uses key head n // G
  vr = np.repeat(v, G, axis=2)
  raw = np.einsum("btnh,bsnh->bnts", q, kr, optimize=True) * scale
  s = raw
  if logits_soft_cap:
    t = np.tanh(raw / logits_soft_cap)
    s = logits_soft_cap * t
  if bias is not None:
    s = s + np.asarray(bias, np.float64)
  s = np.where(keep, s, -np.inf)
  m = s.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  p = np.exp(s - m)
  l = p.sum(-1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    # l = 0 only for a row the masks empty (zeros); a NaN logit stays NaN.
    p = np.where(l != 0, p / l, 0)
    lse = np.where(l[..., 0] != 0, m[..., 0] + np.log(l[..., 0]), -np.inf)
  zr = np.ones_like(p)
  if dropout_rate > 0:
    zr = dropout_keep_numpy(dropout_seed, B, N, T, S, dropout_rate) / (1 - dropout_rate)
  out = np.einsum("bnts,bsnh->btnh", p * zr, vr, optimize=True)
  if dout is None:
    return out, lse
  do = np.asarray(dout, np.float64)
  dvr = np.einsum("bnts,btnh->bsnh", p * zr, do, optimize=True)
  dp = np.einsum("btnh,bsnh->bnts", do, vr, optimize=True) * zr
  delta = np.einsum("btnh,btnh->bnt", do, out, optimize=True)[..., None]
  ds = p * (dp - delta)
  dlogits = ds * (1 - t ** 2) if logits_soft_cap else ds
  dq = np.einsum("bnts,bsnh->btnh", dlogits, kr, optimize=True) * scale
  dkr = np.einsum("bnts,btnh->bsnh", dlogits, q, optimize=True) * scale
  dk = dkr.reshape(B, S, K, G, H).sum(3)
  dv = dvr.reshape(B, S, K, G, H).sum(3)
  grads = (dq, dk, dv)
  if bias is not None:
    grads += (sum_to_shape(ds, np.shape(bias)),)
  if dq_abs_terms:
    abs_terms = np.einsum("bnts,bsnh->btnh", np.abs(dlogits), np.abs(kr), optimize=True)
    grads += (abs_terms * abs(scale),)
  return (out, lse) + grads


def attention_tiled_numpy(q, k, v, *, scale: float | None = None, is_causal: bool = False,
                          block_q: int = 32, block_k: int = 32):
  """The FlashAttention-2 forward as the kernels run it, in float64 NumPy.

  Outer loop over query blocks, inner loop over key blocks; a running max `m_i`,
  running sum `l_i` and unnormalised accumulator `acc`, rescaled whenever the max
  grows (FlashAttention-2, Algorithm 1). Causal key blocks past the diagonal are
  never visited. Returns (out, lse, visited) where `visited` counts key tiles.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1 / math.sqrt(H) if scale is None else scale
  out = np.zeros((B, T, N, H))
  lse = np.full((B, N, T), -np.inf)
  visited = 0
  for b in range(B):
    for n in range(N):
      kh, vh = k[b, :, n // G], v[b, :, n // G]
      for i0 in range(0, T, block_q):
        qi = q[b, i0:i0 + block_q, n]                    # [bq, H], the last one clipped
        rows = np.arange(i0, i0 + len(qi))
        m_i = np.full(len(qi), -np.inf)
        l_i = np.zeros(len(qi))
        acc = np.zeros((len(qi), H))
        k_end = min(S, rows[-1] + 1) if is_causal else S  # skip tiles above the diagonal
        for j0 in range(0, k_end, block_k):
          visited += 1
          s = qi @ kh[j0:j0 + block_k].T * scale
          if is_causal:
            s = np.where(rows[:, None] >= np.arange(j0, j0 + s.shape[1])[None], s, -np.inf)
          # -- update m_i and l_i; exp(m_old - m_new) rescales what was summed so far
          m_new = np.maximum(m_i, s.max(1))
          m_safe = np.where(np.isfinite(m_new), m_new, 0)
          alpha = np.exp(m_i - m_safe)
          p = np.exp(s - m_safe[:, None])
          l_i = alpha * l_i + p.sum(1)
          acc = alpha[:, None] * acc + p @ vh[j0:j0 + block_k]
          m_i = m_new
        with np.errstate(divide="ignore", invalid="ignore"):
          out[b, rows, n] = np.where(l_i[:, None] > 0, acc / l_i[:, None], 0)
          lse[b, n, rows] = np.where(l_i > 0, m_i + np.log(l_i), -np.inf)
  return out, lse, visited
