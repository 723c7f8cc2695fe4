""""mosaic_gpu": the Hopper forward kernel on Pallas Mosaic GPU behind jflash's
custom_vjp. The backward is, by default, the Triton ("pallas") backward, which needs
only the residuals (q, k, v, out, lse) that this forward returns in the same form; with
`MosaicGPUConfig(backward="mosaic_gpu")` it is the Mosaic GPU backward kernels
(pallas_kernels/mosaic_gpu/backward.py: lowered and interpreted on a CPU, not yet run
on a GPU), fed the same mask records as the forward.

The one adapter between jflash's vocabulary and the kernel's own records: `Masks` ->
pallas_kernels.masking's MaskOptions / MaskOperands (through `kernel_records`, the
same per-tile schedule as the Triton kernels), `MosaicGPUConfig` ->
pallas_kernels.mosaic_gpu.forward.MosaicConfig.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jflash import pallas_impl
from jflash.api import first_order_only
from jflash.config import MosaicGPUConfig
from jflash.masks import Masks, kernel_records
from pallas_kernels.mosaic_gpu import backward as _bwd
from pallas_kernels.mosaic_gpu import forward as _fwd

# Fields of `Masks` the kernel takes; the others raise NotImplementedError.
UNSUPPORTED_MASKS = ("mask", "bias", "dropout_rate", "dropout_seed")


def device_capability(device=None) -> tuple[str, str | None]:
  """(platform, compute capability) of the default device, e.g. ("gpu", "9.0"); the
  capability is None off NVIDIA GPUs."""
  device = device or jax.devices()[0]
  if device.platform != "gpu" or "cuda" not in str(device.client.platform_version).lower():
    return device.platform, None
  return device.platform, str(getattr(device, "compute_capability", None))


def is_hopper(capability: str | None) -> bool:
  """Compute capability 9.x: the wgmma, TMA and setmaxnreg instructions this kernel uses."""
  return capability is not None and capability.startswith("9.")


def kernel_config(q, cfg) -> _fwd.MosaicConfig:
  """The caller's MosaicGPUConfig over the kernel's per-head_dim default."""
  config = _fwd.default_config(q.shape[-1])
  own = cfg.backend_config(MosaicGPUConfig)
  if own is None:
    return config
  fields = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)
            if f.name != "backward"}
  return dataclasses.replace(config, **{k: v for k, v in fields.items() if v is not None})


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
  _fwd.check_supported(q, k, v, kernel_config(q, cfg))
  if backward_kind(cfg) == "mosaic_gpu":
    _bwd.check_supported(q, k, v)


def backward_kind(cfg) -> str:
  """Which backward the caller chose: "pallas" (default) or "mosaic_gpu"."""
  own = cfg.backend_config(MosaicGPUConfig)
  return "pallas" if own is None else own.backward


def supports(q, k, v, cfg, masks: Masks):
  platform, capability = device_capability()
  check_call(q, k, v, cfg, masks, platform=platform, capability=capability)


def forward(q, k, v, cfg, masks: Masks):
  """(out, lse); interpreted by Mosaic GPU's own interpreter off the GPU (tests)."""
  interpret = jax.default_backend() != "gpu"
  config = kernel_config(q, cfg)

  def fwd(q, k, v, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    out, lse = _fwd.flash_forward(q, k, v, scale=cfg.scale, opts=opts, ops=ops,
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
  """(dq, dk, dv): the Triton backward, or the Mosaic GPU one when the config asks for
  it (interpreted by Mosaic GPU's own interpreter off the GPU, as the forward)."""
  if backward_kind(cfg) == "pallas":
    return pallas_impl.backward(q, k, v, out, lse, dout, dlse, cfg, masks)
  interpret = jax.default_backend() != "gpu"

  def bwd(q, k, v, out, lse, dout, dlse, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    return _bwd.flash_backward(q, k, v, out, lse, dout, dlse, scale=cfg.scale, opts=opts,
                               ops=ops, interpret=interpret)
  return first_order_only(bwd, "the mosaic_gpu backward kernels")(
      q, k, v, out, lse, dout, dlse, masks)
