""""pallas": the Pallas kernels behind jflash's custom_vjp.

The one adapter between jflash's vocabulary and the kernel package's own records:
`Masks` -> `pallas_kernels.masking.MaskOptions` (static) and `MaskOperands` (arrays and
the data-dependent tile schedule), through `jflash.masks.kernel_records`; `PallasConfig`
-> `pallas_kernels.tuning.BlockSizes`.

Calls of few query rows (T <= 64: decoding) without a `PallasConfig` run their forward
on the split-KV decode kernel (`jflash.decode_impl`, pallas_kernels/decode.py) when it
takes their masks; their backward is the same FlashAttention-2 backward as every
other call's, from the saved (q, k, v, out, lse). A `PallasConfig` asks for the
regular kernels' tiles, so it runs them.
"""
from __future__ import annotations

import dataclasses

from jflash import decode_impl
from jflash.config import PallasConfig
from jflash.derivatives import first_order_only
from jflash.masks import Masks, kernel_records
from pallas_kernels import backward as _bwd
from pallas_kernels import forward as _fwd
from pallas_kernels.tuning import BlockSizes, padded_head_dim

# The device kinds (jflash.platforms.device_kinds) where `implementation=None` tries
# this implementation: any GPU Triton compiles for.
PREFERRED_ON = ("gpu",)

# The largest padded head_dim with a tile table entry (pallas_kernels/tuning.py): one
# K/V tile row must fit the kernels' registers and shared memory next to the Q tile.
MAX_HEAD_DIM = 256


def supports(q, k, v, cfg, masks):
  H = q.shape[-1]
  if padded_head_dim(H) > MAX_HEAD_DIM:
    raise NotImplementedError(f"pallas kernels support head_dim <= {MAX_HEAD_DIM}, got {H}")


def _records(q, k, masks: Masks) -> dict:
  opts, ops = kernel_records(masks, B=q.shape[0], T=q.shape[1], S=k.shape[1])
  return dict(opts=opts, ops=ops)


def _block_sizes(cfg) -> BlockSizes | None:
  """The caller's PallasConfig as the kernels' tile record; None: the kernels' table."""
  own = cfg.backend_config(PallasConfig)
  return None if own is None else BlockSizes(**dataclasses.asdict(own))


def forward(q, k, v, cfg, masks):
  if cfg.backend_config(PallasConfig) is None and decode_impl.applies(q, k, v, cfg, masks):
    return decode_impl.forward(q, k, v, cfg, masks)
  fwd = lambda q, k, v, masks: _fwd.flash_forward(
      q, k, v, scale=cfg.scale, **_records(q, k, masks), block_sizes=_block_sizes(cfg))
  return first_order_only(fwd, "the pallas forward kernel")(q, k, v, masks)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks):
  bwd = lambda q, k, v, out, lse, dout, dlse, masks: _bwd.flash_backward(
      q, k, v, out, lse, dout, dlse, scale=cfg.scale, **_records(q, k, masks),
      block_sizes=_block_sizes(cfg))
  return first_order_only(bwd, "the pallas backward kernels")(
      q, k, v, out, lse, dout, dlse, masks)
