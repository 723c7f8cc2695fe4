"""What jflash needs to know about a device: its platform, an NVIDIA GPU's compute
capability, and the device kinds implementations declare themselves preferred on."""
from __future__ import annotations

import jax

# Every device has this kind: an implementation preferred on it runs anywhere.
ANY = "any"


def device_capability(device=None) -> tuple[str, str | None]:
  """(platform, compute capability) of the default device, e.g. ("gpu", "9.0"); the
  capability is None off NVIDIA GPUs."""
  device = device or jax.devices()[0]
  if device.platform != "gpu" or "cuda" not in str(device.client.platform_version).lower():
    return device.platform, None
  return device.platform, str(getattr(device, "compute_capability", None))


def is_hopper(capability: str | None) -> bool:
  """Compute capability 9.x: wgmma, TMA and setmaxnreg (the Hopper instructions)."""
  return capability is not None and capability.startswith("9.")


def device_kinds(device=None) -> tuple[str, ...]:
  """The kinds of the default device, most specific first: e.g. ("hopper", "cuda",
  "gpu", "any") on an H100, ("rocm", "gpu", "any") on an AMD GPU, ("cpu", "any")."""
  device = device or jax.devices()[0]
  platform, capability = device_capability(device)
  kinds = [platform]
  if platform == "gpu":
    vendor = "cuda" if capability is not None else (
        "rocm" if "rocm" in str(device.client.platform_version).lower() else None)
    kinds = ([vendor] if vendor else []) + kinds
    if is_hopper(capability):
      kinds = ["hopper"] + kinds
  return (*kinds, ANY)
