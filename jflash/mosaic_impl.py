""""mosaic_gpu": the Hopper forward kernel on Pallas Mosaic GPU behind jflash's
custom_vjp. The backward is either the Mosaic GPU backward kernels (pallas_kernels/mosaic_gpu/
backward.py) or the Triton ("pallas") backward, both fed the residuals (q, k, v, out,
lse) this forward returns and the same mask records; `backward_kind` picks per call
(`MosaicGPUConfig(backward=...)` overrides).

The one adapter between jflash's vocabulary and the kernel's own records: `Masks` ->
pallas_kernels.masking's MaskOptions / MaskOperands (through `kernel_records`, the
same per-tile schedule as the Triton kernels), `MosaicGPUConfig` -> the forward's
`MosaicConfig` and the backward's `BackwardConfig` (pallas_kernels/mosaic_gpu/configs.py),
each the caller's fields over the heuristics' choices (heuristics.py).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflash import pallas_impl
from jflash.config import MosaicGPUConfig
from jflash.derivatives import first_order_only
from jflash.masks import Masks, kernel_records
from jflash.platforms import device_capability, is_hopper
from pallas_kernels.mosaic_gpu import configs, heuristics
from pallas_kernels.mosaic_gpu.backward import flash_backward
from pallas_kernels.mosaic_gpu.common import device_sms
from pallas_kernels.mosaic_gpu.forward import flash_forward

# The device kinds (jflash.platforms.device_kinds) where `implementation=None` tries
# this implementation, before those preferred on less specific kinds.
PREFERRED_ON = ("hopper",)

# Fields of `Masks` the kernel takes; the others raise NotImplementedError.
UNSUPPORTED_MASKS = ("mask", "bias", "dropout_rate", "dropout_seed", "causal_alignment")


def kernel_config(q, cfg, masks: Masks) -> configs.MosaicConfig:
  """The caller's MosaicGPUConfig forward fields over the heuristics' config for
  (head_dim, causal, query length)."""
  config = heuristics.default_config(q.shape[-1], masks.is_causal, q.shape[1])
  own = cfg.backend_config(MosaicGPUConfig)
  fields = own.forward_fields_set() if own is not None else {}
  if "consumers" in fields:   # the table's registers go with its own count
    config = config.with_consumers(fields.pop("consumers"))
  try:
    return dataclasses.replace(config, **fields)
  except ValueError as e:
    raise ValueError(f"{e} (over the default {config} at head_dim={q.shape[-1]} and "
                     f"{q.shape[1]} query rows; set consumers too)") from None


def check_call(q, k, v, cfg, masks: Masks, *, platform: str, capability: str | None):
  """Raises NotImplementedError naming what this implementation lacks for the call."""
  if platform != "gpu" or capability is None:
    raise NotImplementedError(
        f"mosaic_gpu needs a CUDA GPU of compute capability 9.x (Hopper); the default "
        f"device is {platform}" + (" but not CUDA" if platform == "gpu" else ""))
  if not is_hopper(capability):
    raise NotImplementedError(
        f"mosaic_gpu needs compute capability 9.x (Hopper), the GPU has {capability}")
  lacking = [name for name in masks.in_use() if name in UNSUPPORTED_MASKS]
  if lacking:
    raise NotImplementedError(f"mosaic_gpu has no {', '.join(lacking)}")
  configs.check_forward(q, k, v, kernel_config(q, cfg, masks))
  if backward_kind(q, k, cfg, masks) == "mosaic_gpu":
    configs.check_backward(q, k, v, backward_config(q, k, cfg, masks))


def backward_config(q, k, cfg, masks: Masks) -> configs.BackwardConfig:
  """The Mosaic GPU backward's config for the call: the caller's backward fields over
  the heuristics' choices for the call's shapes (`call_config`)."""
  own = cfg.backend_config(MosaicGPUConfig)
  fields = own.backward_fields() if own is not None else {}
  return heuristics.call_config(q.shape, k.shape, q.dtype.itemsize, causal=masks.is_causal,
                          **fields)


def backward_kind(q, k, cfg, masks: Masks, num_sms: int | None = None) -> str:
  """Which backward runs: the caller's `backward`; with "auto", the Mosaic GPU one
  wherever the caller set a backward field (it runs as set or raises), else where the
  heuristics find it the faster for the call (`mosaic_backward_wins`) on `num_sms`
  multiprocessors (default: the GPU's; off a GPU none, the grids' level-by-level
  rule)."""
  own = cfg.backend_config(MosaicGPUConfig)
  if own is not None and own.backward != "auto":
    return own.backward
  if own is not None and own.backward_fields():
    return "mosaic_gpu"
  try:      # the heuristics' config cannot run the call (head_dim, dtype): Triton's
    config = backward_config(q, k, cfg, masks)
    configs.check_backward(q, k, k, config)
  except NotImplementedError:
    return "pallas"
  if num_sms is None and jax.default_backend() == "gpu":
    num_sms = device_sms(None, interpret=False)
  wins = heuristics.mosaic_backward_wins(q.shape, k.shape, causal=masks.is_causal,
                                         config=config, num_sms=num_sms)
  return "mosaic_gpu" if wins else "pallas"


def supports(q, k, v, cfg, masks: Masks):
  platform, capability = device_capability()
  check_call(q, k, v, cfg, masks, platform=platform, capability=capability)


def forward(q, k, v, cfg, masks: Masks):
  """(out, lse); interpreted by Mosaic GPU's own interpreter off the GPU (tests)."""
  interpret = jax.default_backend() != "gpu"
  config = kernel_config(q, cfg, masks)

  def fwd(q, k, v, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    out, lse = flash_forward(q, k, v, scale=cfg.scale, opts=opts, ops=ops,
                                  config=config, interpret=interpret)
    if masks.q_lengths is not None:
      # Rows past the query length return zeros and lse = -inf (jax.nn semantics); the
      # kernel's schedule skips whole query blocks past it, this clears the rest.
      live = jnp.arange(q.shape[1])[None, :] < masks.q_lengths[:, None]     # [B, T]
      out = jnp.where(live[:, :, None, None], out, jnp.zeros((), out.dtype))
      lse = jnp.where(live[:, None, :], lse, -jnp.inf)
    return out, lse
  return first_order_only(fwd, "the mosaic_gpu forward kernel")(q, k, v, masks)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks: Masks):
  """(dq, dk, dv) from the backward `backward_kind` picks (the Mosaic GPU one is
  interpreted by Mosaic GPU's own interpreter off the GPU, as the forward)."""
  if backward_kind(q, k, cfg, masks) == "pallas":
    return pallas_impl.backward(q, k, v, out, lse, dout, dlse, cfg, masks)
  interpret = jax.default_backend() != "gpu"

  def bwd(q, k, v, out, lse, dout, dlse, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    return flash_backward(q, k, v, out, lse, dout, dlse, scale=cfg.scale, opts=opts,
                               ops=ops, config=backward_config(q, k, cfg, masks),
                               interpret=interpret)
  return first_order_only(bwd, "the mosaic_gpu backward kernels")(
      q, k, v, out, lse, dout, dlse, masks)
