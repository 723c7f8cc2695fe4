""""mosaic_gpu": the Hopper forward kernel on Pallas Mosaic GPU behind jflash's
custom_vjp; the backward is the Triton ("pallas") backward, which needs only the
residuals (q, k, v, out, lse) that this forward returns in the same form."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jflash import pallas_impl
from jflash.api import first_order_only
from pallas_kernels.mosaic_gpu import forward as _fwd


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


def check_call(q, k, v, cfg, extras=None, *, platform: str, capability: str | None):
  """Raises NotImplementedError naming what this implementation lacks for the call."""
  if platform != "gpu" or capability is None:
    raise NotImplementedError(
        f"mosaic_gpu needs a CUDA GPU of compute capability 9.x (Hopper); the default "
        f"device is {platform}" + (" but not CUDA" if platform == "gpu" else ""))
  if not is_hopper(capability):
    raise NotImplementedError(
        f"mosaic_gpu needs compute capability 9.x (Hopper), the GPU has {capability}")
  _fwd.check_supported(q, k, v)
  if cfg.block_sizes is not None:
    raise NotImplementedError(
        "block_sizes are tiles of the Triton kernels; mosaic_gpu takes its own per head_dim")
  if cfg.dropout_rate > 0:
    raise NotImplementedError("mosaic_gpu has no dropout")
  if extras is not None and (extras.mask is not None or extras.bias is not None):
    raise NotImplementedError("mosaic_gpu has no dense mask or bias")


def supports(q, k, v, cfg, extras=None):
  platform, capability = device_capability()
  check_call(q, k, v, cfg, extras, platform=platform, capability=capability)


def forward(q, k, v, cfg, extras=None):
  """(out, lse); interpreted by Mosaic GPU's own interpreter off the GPU (tests)."""
  interpret = jax.default_backend() != "gpu"

  def fwd(q, k, v, extras):
    out, lse = _fwd.flash_forward(q, k, v, scale=cfg.scale, opts=cfg.mask_options,
                                  ops=pallas_impl._operands(q, k, extras), interpret=interpret)
    if extras is not None and extras.q_lengths is not None:
      # Rows past the query length return zeros and lse = -inf (jax.nn semantics); the
      # kernel's schedule skips whole query blocks past it, this clears the rest.
      live = jnp.arange(q.shape[1])[None, :] < extras.q_lengths[:, None]     # [B, T]
      out = jnp.where(live[:, :, None, None], out, jnp.zeros((), out.dtype))
      lse = jnp.where(live[:, None, :], lse, -jnp.inf)
    return out, lse
  return first_order_only(fwd, "the mosaic_gpu forward kernel")(q, k, v, extras)


backward = pallas_impl.backward
