""""hip": the gfx906 (MI50) FlashAttention forward through an XLA FFI custom call.

The forward is the HIP kernel in hip_ffi/csrc (also built with nvcc for sm_90, which
is how its logic is checked on NVIDIA hardware); the backward recomputes from the
saved `(q, k, v, out, lse)` through `jflash.chunked.backward`.

`supports` raises `NotImplementedError` when the call cannot run here: no built
library (`python -m hip_ffi.build`), no device of a platform the library serves,
a dtype or head_dim the kernel lacks. To lower for ROCm on a machine without an
AMD GPU (to inspect the custom call), trace inside `lowering_for("rocm")`.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

import hip_ffi
from jflash import chunked
from jflash.api import first_order_only
from jflash.config import HipConfig

_LOWERING_FOR: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "jflash_hip_lowering_for", default=frozenset())


@contextlib.contextmanager
def lowering_for(*platforms: str):
  """Lets `supports` accept a platform with no device in this process.

  For `jax.jit(f).trace(...).lower(lowering_platforms=("rocm",))` on a CPU machine:
  the traced program calls the custom call; nothing runs here.
  """
  bad = [p for p in platforms if p not in hip_ffi.PLATFORMS]
  if bad:
    raise ValueError(f"platforms {bad} must be among {sorted(hip_ffi.PLATFORMS)}")
  token = _LOWERING_FOR.set(_LOWERING_FOR.get() | frozenset(platforms))
  try:
    yield
  finally:
    _LOWERING_FOR.reset(token)


def _tile(q, cfg) -> int:
  """Row of the kernel's tile table: 0 by default, else the one matching the HipConfig."""
  H = q.shape[-1]
  rows = hip_ffi.tile_table()[H]
  own = cfg.backend_config(HipConfig)
  if own is None or own.block_q is None:
    return 0
  want = (own.block_q, own.block_k)
  for i, (bq, bk, _) in enumerate(rows):
    if (bq, bk) == want:
      return i
  raise NotImplementedError(
      f"(block_q, block_k)={want} is not a compiled tile for head_dim={H}; "
      f"available: {[r[:2] for r in rows]}")


def supports(q, k, v, cfg, masks) -> None:
  lacking = [name for name in masks.in_use() if name != "is_causal"]
  if lacking:
    raise NotImplementedError(f"the kernel has causal masking only, no {', '.join(lacking)}")
  if q.dtype != jnp.float16:
    raise NotImplementedError(
        f"the gfx906 kernel computes in float16 (v_dot2_f32_f16); got dtype={q.dtype}")
  H = q.shape[-1]
  if H not in hip_ffi.HEAD_DIMS:
    raise NotImplementedError(f"head_dim={H} is not compiled; have {hip_ffi.HEAD_DIMS}")
  B, N = q.shape[0], q.shape[2]
  if N > 65535 or B > 65535:
    raise NotImplementedError(f"heads N={N} and batch B={B} must be <= 65535")
  _tile(q, cfg)
  served = set(hip_ffi.register())
  if not served:
    reasons = "; ".join(f"{p}: {r}" for p, r in hip_ffi.load_errors().items())
    raise NotImplementedError(f"no usable hip_ffi library ({reasons})")
  here = set(hip_ffi.device_platforms()) | _LOWERING_FOR.get()
  if not served & here:
    raise NotImplementedError(
        f"the built library serves {sorted(served)} but this process has no such "
        f"device (jax backend: {jax.default_backend()}); to only lower the call, trace "
        "inside jflash.hip_impl.lowering_for('rocm')")


def forward(q, k, v, cfg, masks):
  # supports() refused every mask option but is_causal
  fwd = lambda q, k, v: hip_ffi.flash_forward(q, k, v, scale=cfg.scale,
                                              is_causal=masks.is_causal, tile=_tile(q, cfg))
  return first_order_only(fwd, "the hip forward kernel")(q, k, v)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks):
  # FlashAttention-2 recompute backward in plain JAX from the kernel's (out, lse).
  return chunked.backward(q, k, v, out, lse, dout, dlse, cfg, masks)
