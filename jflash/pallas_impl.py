""""pallas": the Pallas kernels behind jflash's custom_vjp."""
from __future__ import annotations

import functools

from jflash.api import first_order_only
from jflash.masks import MaskArrays, data_tile_classes
from pallas_kernels import backward as _bwd
from pallas_kernels import forward as _fwd
from pallas_kernels.masking import MaskOperands
from pallas_kernels.tuning import padded_head_dim


def supports(q, k, v, cfg, extras=None):
  H = q.shape[-1]
  if padded_head_dim(H) > 256:
    raise NotImplementedError(f"pallas kernels support head_dim <= 256, got {H}")


def _operands(q, k, extras: MaskArrays | None) -> MaskOperands:
  if extras is None:
    return MaskOperands()
  schedule = None
  if extras.structured:
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    schedule = functools.partial(data_tile_classes, B=B, T=T, S=S, masks=extras)
  return MaskOperands(schedule=schedule, q_lengths=extras.q_lengths,
                      kv_lengths=extras.kv_lengths, q_segment_ids=extras.q_segment_ids,
                      kv_segment_ids=extras.kv_segment_ids, mask=extras.mask,
                      bias=extras.bias, dropout_seed=extras.dropout_seed)


def forward(q, k, v, cfg, extras=None):
  fwd = lambda q, k, v, extras: _fwd.flash_forward(
      q, k, v, scale=cfg.scale, opts=cfg.mask_options, ops=_operands(q, k, extras),
      block_sizes=cfg.block_sizes)
  return first_order_only(fwd, "the pallas forward kernel")(q, k, v, extras)


def backward(q, k, v, out, lse, dout, dlse, cfg, extras=None):
  bwd = lambda q, k, v, out, lse, dout, dlse, extras: _bwd.flash_backward(
      q, k, v, out, lse, dout, dlse, scale=cfg.scale, opts=cfg.mask_options,
      ops=_operands(q, k, extras), block_sizes=cfg.block_sizes)
  return first_order_only(bwd, "the pallas backward kernels")(
      q, k, v, out, lse, dout, dlse, extras)
