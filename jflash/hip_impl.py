""""hip": the gfx906 (MI50) FlashAttention kernels through XLA FFI custom calls.

Forward and backward are the HIP kernels in hip_ffi/csrc (also built with nvcc for
sm_90, which is how their logic is checked on NVIDIA hardware): `jax.grad` runs the
delta, dQ and dK/dV kernels, nothing else.

Masks: causal, local window, sequence lengths and segment ids reach the kernels as
the per-tile ranges of pallas_kernels.masking (skip / full / boundary), computed here
for the kernels' tile sizes, and a soft cap as an attribute; dense mask, bias and
dropout are refused.

bfloat16: gfx906 has no bf16 arithmetic, and its fp16 dot2 runs at twice the fp32
FMA rate, so bf16 operands are converted to fp16 before the kernels (exact for
|x| in [2^-14, 65504]: bf16 carries 8 significand bits, fp16 11). The range risk of
the conversion sits in v and in the output gradient (bf16 gradients are often far
below fp16's 2^-24): both are scaled by a power of two (exact) that puts their
largest |x| in [1, 2) and the results are scaled back. q and k are converted as they
are: a |q| or |k| above 65504 becomes inf and the output NaN (never a silent zero).

`supports` raises `NotImplementedError` when the call cannot run here: no built
library (`python -m hip_ffi.build`), no device of a platform the library serves, or
an input the kernels lack (hip_ffi.check_inputs, the one place of those rules). To
lower for ROCm on a machine without an AMD GPU (to inspect the custom calls), trace
inside `lowering_for("rocm")`; to run the kernels on CPU fibers (tests), inside
`hip_ffi.emulated()`.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

import hip_ffi
from hip_ffi import build
from jflash.config import HipConfig
from jflash.derivatives import first_order_only
from jflash.masks import Masks, kernel_records
from pallas_kernels.masking import build_ranges

DTYPES = (jnp.float16, jnp.bfloat16)

_LOWERING_FOR: contextvars.ContextVar[frozenset] = contextvars.ContextVar(
    "jflash_hip_lowering_for", default=frozenset())


@contextlib.contextmanager
def lowering_for(*platforms: str):
  """Lets `supports` accept a platform with no device in this process.

  For `jax.jit(f).trace(...).lower(lowering_platforms=("rocm",))` on a CPU machine:
  the traced program calls the custom calls; nothing runs here.
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
  """Row of the forward tile table: 0 by default, else the one matching the HipConfig."""
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


# What the kernels take from `Masks`; the rest of its fields raise NotImplementedError.
SUPPORTED_MASKS = ("is_causal", "causal_alignment", "window", "soft_cap", "q_lengths",
                   "kv_lengths", "q_segment_ids", "kv_segment_ids")


def supports(q, k, v, cfg, masks: Masks) -> None:
  lacking = [name for name in masks.in_use() if name not in SUPPORTED_MASKS]
  if lacking:
    raise NotImplementedError(f"the hip kernels have no {', '.join(lacking)} (causal "
                              "either aligned, lengths, window, segment ids and soft cap "
                              "are supported)")
  try:
    hip_ffi.check_inputs(q, k, v, scale=cfg.scale, is_causal=masks.is_causal, tile=0,
                         window=masks.window, soft_cap=masks.soft_cap, dtypes=DTYPES)
  except ValueError as e:  # an input the kernels lack: another implementation may run it
    raise NotImplementedError(str(e)) from None
  _tile(q, cfg)
  if hip_ffi.emulating():
    if build.compiler("emulate") is None:
      raise NotImplementedError("hip_ffi.emulated() needs a C++ compiler (g++)")
    return
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


# -- masks as ranges -------------------------------------------------------------------

def _ranges(q, k, masks: Masks, block_q, block_k, transpose=False):
  """[B, n, 8] int32 ranges per query tile (per key tile with `transpose`): the same
  per-tile schedule as the Pallas kernels, for the HIP kernels' tile sizes."""
  B, T, S = q.shape[0], q.shape[1], k.shape[1]
  opts, ops = kernel_records(masks, B=B, T=T, S=S)
  return build_ranges(ops, opts, B=B, T=T, S=S, block_q=block_q, block_k=block_k,
                      transpose=transpose)


def _mask_kwargs(cfg, masks: Masks):
  return dict(q_seg=masks.q_segment_ids, kv_seg=masks.kv_segment_ids, scale=cfg.scale,
              is_causal=masks.is_causal, window=masks.window, soft_cap=masks.soft_cap)


# -- dtype handling ----------------------------------------------------------------------

def _pow2_exponent(x):
  """e with max|x| * 2^e in [1, 2); 0 for an all-zero or non-finite x (nothing to fix,
  and a NaN or inf must pass through unchanged)."""
  m = jnp.max(jnp.abs(x)).astype(jnp.float32)
  _, exp = jnp.frexp(m)  # m = f * 2^exp, f in [0.5, 1)
  return jnp.where(jnp.isfinite(m) & (m > 0), 1 - exp, 0).astype(jnp.int32)


def _to_f16(x, e=None):
  """x * 2^e as float16 (exact scaling in float32, one rounding to fp16)."""
  if x.dtype == jnp.float16 and e is None:
    return x
  x = x.astype(jnp.float32)
  return (x if e is None else jnp.ldexp(x, e)).astype(jnp.float16)


def _from(x, e, dtype):
  """x * 2^-e in `dtype`."""
  x = x.astype(jnp.float32) if e is None else jnp.ldexp(x.astype(jnp.float32), -e)
  return x.astype(dtype)


def _scaled(x):
  """(fp16 operand, exponent or None): bf16 gets the power-of-two range fix."""
  if x.dtype == jnp.float16:
    return x, None
  e = _pow2_exponent(x)
  return _to_f16(x, e), e


def _add(a, b):
  return b if a is None else a if b is None else a + b


# -- forward and backward ----------------------------------------------------------------

def forward(q, k, v, cfg, masks: Masks):
  tile = _tile(q, cfg)
  bq, bk, _ = hip_ffi.tile_table()[q.shape[-1]][tile]

  def fwd(q, k, v, masks):
    v16, ev = _scaled(v)
    out, lse = hip_ffi.flash_forward(_to_f16(q), _to_f16(k), v16,
                                     _ranges(q, k, masks, bq, bk),
                                     tile=tile, **_mask_kwargs(cfg, masks))
    return _from(out, ev, q.dtype) if ev is not None else out, lse

  return first_order_only(fwd, "the hip forward kernel")(q, k, v, masks)


def backward(q, k, v, out, lse, dout, dlse, cfg, masks: Masks):
  bq, bkv, _ = hip_ffi.bwd_tile_table()[q.shape[-1]]

  def bwd(q, k, v, out, lse, dout, dlse, masks):
    # With v and dO scaled by 2^ev and 2^ed, dP, delta and dS scale by 2^(ed + ev),
    # dQ and dK with them, dV by 2^ed; P is unchanged (FlashAttention-2, Algorithm 2).
    v16, ev = _scaled(v)
    do16, ed = _scaled(dout)
    eds = _add(ed, ev)
    o16 = _to_f16(out, ev)
    dlse = dlse.astype(jnp.float32)
    if eds is not None:
      dlse = jnp.ldexp(dlse, eds)
    q16, k16 = _to_f16(q), _to_f16(k)
    delta = hip_ffi.flash_backward_delta(o16, do16, dlse)
    kw = _mask_kwargs(cfg, masks)
    dq = hip_ffi.flash_backward_dq(q16, k16, v16, do16, lse, delta,
                                   _ranges(q, k, masks, bq, bkv), **kw)
    dk, dv = hip_ffi.flash_backward_dkdv(q16, k16, v16, do16, lse, delta,
                                         _ranges(q, k, masks, bq, bkv, transpose=True),
                                         **kw)
    return _from(dq, eds, q.dtype), _from(dk, eds, k.dtype), _from(dv, ed, v.dtype)

  return first_order_only(bwd, "the hip backward kernels")(q, k, v, out, lse, dout, dlse,
                                                           masks)
