""""pallas_decode": the split-KV decode kernel (pallas_kernels/decode.py) for calls
with few query rows, forward; its gradient is the "pallas" backward kernels'.

Which calls run it: T <= MAX_QUERY_ROWS query rows, with no mask option beyond causal
(either alignment), sequence lengths and a soft cap; anything else raises
`NotImplementedError` saying what is missing, so `implementation=None` moves on to the
next implementation. The "pallas" implementation runs this kernel for its own forward
on such calls (unless a `PallasConfig` asks for its tiles); on Hopper, where
`implementation=None` tries "mosaic_gpu" before "pallas", this name comes first.

The backward pass of a decode call is the regular FlashAttention-2 backward of
"pallas" (dK/dV over key blocks, dQ over query blocks) from the saved (q, k, v, out,
lse): the decode kernel's out and lse are the same quantities as the forward kernel's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash.derivatives import first_order_only
from jflash.masks import Masks, offsets_of
from pallas_kernels import decode as _decode
from pallas_kernels.tuning import padded_head_dim

# Device kinds (jflash.platforms.device_kinds) where `implementation=None` tries it
# first: on Hopper, ahead of "mosaic_gpu", whose grid has one program per query block.
# Elsewhere "pallas" runs the same kernel for small T.
PREFERRED_ON = ("hopper",)

# Query rows (T) the split-KV kernel takes: decoding, speculative decoding, short
# chunks of a prefill. Each program holds T x (N / K) rows.
MAX_QUERY_ROWS = 64
MAX_HEAD_DIM = 256
SUPPORTED_MASKS = ("is_causal", "causal_alignment", "soft_cap", "q_lengths", "kv_lengths")


def supports(q, k, v, cfg, masks: Masks) -> None:
  T, H = q.shape[1], q.shape[-1]
  if T > MAX_QUERY_ROWS:
    raise NotImplementedError(
        f"the split-KV decode kernel takes T <= {MAX_QUERY_ROWS} query rows, got T={T}")
  if padded_head_dim(H) > MAX_HEAD_DIM:
    raise NotImplementedError(
        f"the split-KV decode kernel supports head_dim <= {MAX_HEAD_DIM}, got {H}")
  lacking = [name for name in masks.in_use() if name not in SUPPORTED_MASKS]
  if lacking:
    raise NotImplementedError(
        f"the split-KV decode kernel has no {', '.join(lacking)} (causal, "
        "causal_alignment, sequence lengths and soft cap are supported)")


def applies(q, k, v, cfg, masks: Masks) -> bool:
  """Whether `supports` accepts the call."""
  try:
    supports(q, k, v, cfg, masks)
  except NotImplementedError:
    return False
  return True


def row_info(masks: Masks, B: int, T: int, S: int, layer=None) -> jax.Array:
  """[B, 8] int32 per batch row: q_len, kv_len (clamped to [0, T], [0, S]), the query
  offset of the causal rule (`jflash.masks.offsets_of`), the cache row it reads (b, or
  layer * B + b in a stack of layers' caches seen as [L * B, S, K, H]), then zeros."""
  clamp = lambda x, n: (jnp.full((B,), n, jnp.int32) if x is None
                        else jnp.clip(x.astype(jnp.int32), 0, n))
  offset = jnp.broadcast_to(jnp.asarray(offsets_of(masks, T, S), jnp.int32), (B,))
  row = jnp.arange(B, dtype=jnp.int32)
  if layer is not None:
    row = row + jnp.asarray(layer, jnp.int32) * B
  cols = [clamp(masks.q_lengths, T), clamp(masks.kv_lengths, S), offset, row]
  return jnp.stack(cols + [jnp.zeros((B,), jnp.int32)] * 4, axis=1)


def forward(q, k, v, cfg, masks: Masks):
  def fwd(q, k, v, masks):
    info = row_info(masks, q.shape[0], q.shape[1], k.shape[1])
    return _decode.decode_forward(q, k, v, info, scale=cfg.scale, is_causal=masks.is_causal,
                                  soft_cap=masks.soft_cap)
  return first_order_only(fwd, "the split-KV decode kernel")(q, k, v, masks)


def forward_stacked(q, k_stack, v_stack, layer, cfg, masks: Masks):
  """`forward` over layer `layer` (a traced int32 scalar) of a stack of layers' caches
  k_stack, v_stack [L, B, S, K, H], read in place: the kernel indexes the stack's rows
  (`row_info`), so no copy of the layer is made."""
  def fwd(q, k_stack, v_stack, layer, masks):
    L, B, S, K, H = k_stack.shape
    info = row_info(masks, B, q.shape[1], S, layer=layer)
    rows = lambda x: x.reshape(L * B, S, K, H)       # a view: leading axes merged
    return _decode.decode_forward(q, rows(k_stack), rows(v_stack), info, scale=cfg.scale,
                                  is_causal=masks.is_causal, soft_cap=masks.soft_cap)
  return first_order_only(fwd, "the split-KV decode kernel")(q, k_stack, v_stack, layer, masks)
