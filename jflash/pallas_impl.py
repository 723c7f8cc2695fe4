""""pallas": the Pallas kernels behind jflash's custom_vjp."""
from __future__ import annotations

import functools

from jflash.api import first_order_only

from pallas_kernels import backward as _bwd
from pallas_kernels import forward as _fwd
from pallas_kernels.tuning import padded_head_dim


def supports(q, k, v, cfg):
  H = q.shape[-1]
  if padded_head_dim(H) > 256:
    raise NotImplementedError(f"pallas kernels support head_dim <= 256, got {H}")


def forward(q, k, v, cfg):
  fwd = functools.partial(_fwd.flash_forward, scale=cfg.scale, is_causal=cfg.is_causal,
                          block_sizes=cfg.block_sizes)
  return first_order_only(fwd, "the pallas forward kernel")(q, k, v)


def backward(q, k, v, out, lse, dout, dlse, cfg):
  bwd = functools.partial(_bwd.flash_backward, scale=cfg.scale, is_causal=cfg.is_causal,
                          block_sizes=cfg.block_sizes)
  return first_order_only(bwd, "the pallas backward kernels")(q, k, v, out, lse, dout, dlse)
