""""mosaic_gpu": the Hopper forward kernel on Pallas Mosaic GPU behind jflash's
custom_vjp. The backward is either the Mosaic GPU backward kernels (pallas_kernels/mosaic_gpu/
backward.py) or the Triton ("pallas") backward, both fed the residuals (q, k, v, out,
lse) this forward returns and the same mask records; `backward_kind` picks per call
(`MosaicGPUConfig(backward=...)` overrides).

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


def kernel_config(q, cfg, masks: Masks) -> _fwd.MosaicConfig:
  """The caller's MosaicGPUConfig over the kernel's default for (head_dim, causal,
  query length)."""
  config = _fwd.default_config(q.shape[-1], masks.is_causal, q.shape[1])
  own = cfg.backend_config(MosaicGPUConfig)
  if own is None:
    return config
  fields = {name: getattr(own, name) for name in own.forward_fields
            if getattr(own, name) is not None}
  if "consumers" in fields:   # the table's ping-pong and registers go with its own count
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
  _fwd.check_supported(q, k, v, kernel_config(q, cfg, masks))
  if backward_kind(q, k, cfg, masks) == "mosaic_gpu":
    _bwd.check_supported(q, k, v, backward_config(q, k, cfg))


def backward_config(q, k, cfg) -> _bwd.BackwardConfig:
  """The caller's backward fields over the Mosaic GPU backward's default for the call's
  GQA group (`pallas_kernels.mosaic_gpu.backward.default_config`)."""
  own = cfg.backend_config(MosaicGPUConfig)
  default = _bwd.default_config(q.shape[2] // k.shape[2])
  return dataclasses.replace(default, **({} if own is None else own.backward_fields()))


# The dK/dV grid size below which "auto" keeps a causal call on the Triton backward.
CAUSAL_DKV_PROGRAMS = 1024
# Query and key lengths from which "auto" takes the Mosaic GPU backward with one key
# head per query head: at 2K the two backwards ran level (419.1 against 420.1 TF/s
# fwd+bwd, causal 339.7 against 339.5; mosaic_ws_2k_time_h200.json), at 1K the Mosaic
# GPU one was slower, from 4K faster.
MHA_MIN_SEQ = 2048


def backward_kind(q, k, cfg, masks: Masks) -> str:
  """Which backward runs: the caller's choice, or with "auto" the faster one as measured
  on the H200 (bf16, fwd+bwd against the Triton backward in the same process;
  experiments/results/mosaic_backward_time_h200.json for one warpgroup per program,
  mosaic_fused_dq_cols_time_h200.json for two and a producer), at head_dim 128:
  - grouped heads (GQA, MQA): the Mosaic GPU backward (one warpgroup per program),
    whose dK/dV program runs the group's query heads against K and V held in shared
    memory (+7% GQA 32/8 8K, +12% MQA 16/1 16K, +22% GQA 32/8 8K causal);
  - one key head per query head, with the default backward fields (two consumer
    warpgroups and a producer, the config that was timed), query and key lengths
    from MHA_MIN_SEQ and whole tiles of the program's 128 rows: the Mosaic GPU
    backward (+5.4% and +7.0% at 4K, 8 heads, batch 4, the decoder LM's attention;
    +5.7% and +0.6% at 16K, causal second; level at 2K); shorter, the Triton backward
    (1K: 0.985x and 0.966x); off the tiles too, since the Mosaic GPU backward pads its
    inputs in HBM (T = S = 3000 causal ran 299.8 TF/s with it, bench_model_h200.json,
    where the Triton backward had run 335 the run before);
  - either way not when the call is causal and its dK/dV grid (batch x key heads x
    key tiles of 64 per consumer) has fewer than CAUSAL_DKV_PROGRAMS programs: a
    causal program's work grows with its key tile's distance from the end, and one
    wave of a few hundred programs lasts as long as the heaviest (MQA 16/1 16K causal:
    256 programs, 0.89x the Triton backward).
  head_dim 64 (0.88x) and 256 (not supported): the Triton backward."""
  own = cfg.backend_config(MosaicGPUConfig)
  if own is not None and own.backward != "auto":
    return own.backward
  B, S, K, H = k.shape
  T = q.shape[1]
  grouped = q.shape[2] > K
  config = backward_config(q, k, cfg)
  rows = config.consumers * _bwd.ROWS          # keys per dK/dV program
  filled = not masks.is_causal or B * K * -(-S // rows) >= CAUSAL_DKV_PROGRAMS
  # one key head per query head: only the timed config, on whole tiles (no HBM padding)
  timed_mha = (config == _bwd.default_config(1) and min(T, S) >= MHA_MIN_SEQ
               and T % rows == 0 and S % rows == 0)
  return "mosaic_gpu" if H == 128 and (grouped or timed_mha) and filled else "pallas"


def supports(q, k, v, cfg, masks: Masks):
  platform, capability = device_capability()
  check_call(q, k, v, cfg, masks, platform=platform, capability=capability)


def forward(q, k, v, cfg, masks: Masks):
  """(out, lse); interpreted by Mosaic GPU's own interpreter off the GPU (tests)."""
  interpret = jax.default_backend() != "gpu"
  config = kernel_config(q, cfg, masks)

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
  """(dq, dk, dv) from the backward `backward_kind` picks (the Mosaic GPU one is
  interpreted by Mosaic GPU's own interpreter off the GPU, as the forward)."""
  if backward_kind(q, k, cfg, masks) == "pallas":
    return pallas_impl.backward(q, k, v, out, lse, dout, dlse, cfg, masks)
  interpret = jax.default_backend() != "gpu"

  def bwd(q, k, v, out, lse, dout, dlse, masks):
    opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
    return _bwd.flash_backward(q, k, v, out, lse, dout, dlse, scale=cfg.scale, opts=opts,
                               ops=ops, config=backward_config(q, k, cfg), interpret=interpret)
  return first_order_only(bwd, "the mosaic_gpu backward kernels")(
      q, k, v, out, lse, dout, dlse, masks)
