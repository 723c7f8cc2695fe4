"""The forward kernel run on CPU fibers (csrc/emulate_cpu.h), for tests without a GPU.

Same source, same tile table, same launch path as the FFI handler; the GPU constructs
(barriers, shuffles, LDS, dot2) are emulated with the arithmetic of the CUDA mapping.
It checks the kernel's logic, not its speed or the gfx906 code generation.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from hip_ffi import build


@functools.cache
def _lib():
  lib = ctypes.CDLL(str(build.build("emulate")))
  fn = lib.jflash_emulated_forward
  fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6 + [ctypes.c_float] + [ctypes.c_int] * 2
  fn.restype = ctypes.c_int
  return fn


def flash_forward(q, k, v, *, scale: float, is_causal: bool, tile: int = 0):
  """NumPy float16 in, `(out float16 [B, T, N, H], lse float32 [B, N, T])` out."""
  from hip_ffi import check_inputs
  check_inputs(q, k, v, scale=scale, is_causal=is_causal, tile=tile)
  q, k, v = (np.ascontiguousarray(x, np.float16) for x in (q, k, v))
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  out = np.empty_like(q)
  lse = np.empty((B, N, T), np.float32)
  rc = _lib()(q.ctypes.data, k.ctypes.data, v.ctypes.data, out.ctypes.data, lse.ctypes.data,
              B, T, S, N, K, H, float(scale), int(is_causal), int(tile))
  if rc != 0:
    raise ValueError(f"emulated kernel rejected q{q.shape} k{k.shape} tile={tile}")
  return out, lse
