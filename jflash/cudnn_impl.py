""""cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN's fused
attention, as a jflash implementation, so it takes its place in a fallback chain
(`implementation=("mosaic_gpu", "cudnn")`) and in the models' configs.

JAX differentiates it (cuDNN's own backward). `supports` raises `NotImplementedError`
off a CUDA GPU and for what cuDNN lacks: segment ids, a soft cap, dropout, a right
window without the causal mask, a differentiable lse (`return_residuals`), and on the
GPU whatever JAX's cuDNN checks refuse for the call (dtype, head dim, capability).
Where the conventions differ it keeps jax.nn's: a query row that the masks leave
without a visible key gets no guarantee of zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash.masks import Masks
from jflash.platforms import device_capability

# Preferred nowhere: the jflash kernels run first where `implementation=None` chooses.
PREFERRED_ON = ()
DTYPES = (jnp.float16, jnp.bfloat16)
# The fields of `Masks` jax.nn passes to cuDNN; the others raise NotImplementedError.
SUPPORTED_MASKS = ("is_causal", "window", "bias", "mask", "q_lengths", "kv_lengths")


def direct(q, k, v, cfg, masks: Masks):
  """(out, None): jax.nn's lse is not differentiated, so none is returned (see supports)."""
  out = jax.nn.dot_product_attention(
      q, k, v, bias=masks.bias, mask=masks.mask, scale=cfg.scale,
      is_causal=masks.is_causal, query_seq_lengths=masks.q_lengths,
      key_value_seq_lengths=masks.kv_lengths, local_window_size=masks.window,
      implementation="cudnn")
  return out, None


def supports(q, k, v, cfg, masks: Masks) -> None:
  platform, capability = device_capability()
  if capability is None:
    raise NotImplementedError(f"cudnn needs a CUDA GPU; the default device is {platform}")
  lacking = [name for name in masks.in_use() if name not in SUPPORTED_MASKS]
  if lacking:
    raise NotImplementedError(f"cudnn (through jax.nn) has no {', '.join(lacking)}")
  if not any(q.dtype == d for d in DTYPES):
    raise NotImplementedError(f"cudnn takes float16 or bfloat16, got {q.dtype}")
  if masks.window is not None and masks.window[1] and not masks.is_causal:
    raise NotImplementedError(
        f"cudnn has no right window without the causal mask, got {masks.window}")
  try:  # JAX's own cuDNN checks (head dim, dtype, capability, cuDNN version), traced only
    jax.eval_shape(lambda q, k, v, masks: direct(q, k, v, cfg, masks)[0], q, k, v, masks)
  except (NotImplementedError, ValueError, RuntimeError) as e:
    raise NotImplementedError(f"cudnn refuses the call: {e}") from None
