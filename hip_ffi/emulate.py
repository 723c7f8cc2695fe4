"""The kernels run on CPU fibers (csrc/emulate_cpu.h), for tests without a GPU.

Same source, same tile tables, same launch functions as the FFI handlers; the GPU
constructs (barriers, shuffles, LDS, dot2) are emulated with the arithmetic of the
CUDA mapping. It checks the kernels' logic, not their speed or the gfx906 code
generation. `RUNNERS` take and return NumPy arrays with the operands, results and
attributes of the custom calls (leading dims are batch, as in the handlers);
`hip_ffi.emulated()` routes the raw ops here through `jax.pure_callback`.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from hip_ffi import build

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


@functools.cache
def _lib():
  lib = ctypes.CDLL(str(build.build("emulate")))
  lib.jflash_emulated_forward.argtypes = ([_P] * 4 + [_I] + [_P] * 4 + [_I] * 6 + [_F]
                                         + [_I] * 3 + [_F, _I])
  lib.jflash_emulated_bwd_delta.argtypes = [_P] * 4 + [_I] * 4
  lib.jflash_emulated_bwd.argtypes = [_P] * 7 + [_I] + [_P] * 5 + [_I] * 6 + [_F] + [_I] * 3 + [_F]
  for fn in (lib.jflash_emulated_forward, lib.jflash_emulated_bwd_delta, lib.jflash_emulated_bwd):
    fn.restype = ctypes.c_int
  return lib


def _c(x, dtype):
  return np.ascontiguousarray(x, dtype)


def _ptr(x):
  return None if x is None else x.ctypes.data


def _dims(q, k):
  """(B, T, S, N, K, H) with all leading dims of q folded into B."""
  *lead, T, N, H = q.shape
  return int(np.prod(lead, dtype=np.int64)), T, k.shape[-3], N, k.shape[-2], H


def _mask(ranges, q_seg, kv_seg, is_causal, window_left, window_right, has_segments):
  ranges = _c(ranges, np.int32)
  segs = (_c(q_seg, np.int32), _c(kv_seg, np.int32)) if has_segments else (None, None)
  return ranges, segs, (int(is_causal), int(window_left), int(window_right))


def _check(rc, what):
  if rc != 0:
    raise ValueError(f"emulated {what} kernel rejected its operands (head_dim or tile)")


def forward(q, k, v, ranges, q_seg, kv_seg, *, scale, is_causal, window_left, window_right,
            has_segments, soft_cap, tile):
  q, k, v = (_c(x, np.float16) for x in (q, k, v))
  B, T, S, N, K, H = _dims(q, k)
  ranges, (qs, ks), flags = _mask(ranges, q_seg, kv_seg, is_causal, window_left, window_right,
                                  has_segments)
  out = np.empty_like(q)
  lse = np.empty((*q.shape[:-3], N, T), np.float32)
  _check(_lib().jflash_emulated_forward(
      _ptr(q), _ptr(k), _ptr(v), _ptr(ranges), ranges.shape[-2], _ptr(qs), _ptr(ks), _ptr(out),
      _ptr(lse), B, T, S, N, K, H, float(scale), *flags, float(soft_cap), int(tile)), "forward")
  return out, lse


def delta(out, dout, dlse):
  out, dout = _c(out, np.float16), _c(dout, np.float16)
  dlse = _c(dlse, np.float32)
  *lead, T, N, H = out.shape
  res = np.empty(dlse.shape, np.float32)
  _check(_lib().jflash_emulated_bwd_delta(_ptr(out), _ptr(dout), _ptr(dlse), _ptr(res),
                                          int(np.prod(lead, dtype=np.int64)), T, N, H), "delta")
  return res


def _backward(want_dq, q, k, v, dout, lse, delta_, ranges, q_seg, kv_seg, *, scale, is_causal,
              window_left, window_right, has_segments, soft_cap):
  q, k, v, dout = (_c(x, np.float16) for x in (q, k, v, dout))
  lse, delta_ = _c(lse, np.float32), _c(delta_, np.float32)
  B, T, S, N, K, H = _dims(q, k)
  ranges, (qs, ks), flags = _mask(ranges, q_seg, kv_seg, is_causal, window_left, window_right,
                                  has_segments)
  dq = np.empty(q.shape, np.float32) if want_dq else None
  dk = None if want_dq else np.empty(k.shape, np.float32)
  dv = None if want_dq else np.empty(k.shape, np.float32)
  _check(_lib().jflash_emulated_bwd(
      _ptr(q), _ptr(k), _ptr(v), _ptr(dout), _ptr(lse), _ptr(delta_), _ptr(ranges),
      ranges.shape[-2], _ptr(qs), _ptr(ks), _ptr(dq), _ptr(dk), _ptr(dv), B, T, S, N, K, H,
      float(scale), *flags, float(soft_cap)), "dq" if want_dq else "dk/dv")
  return dq if want_dq else (dk, dv)


RUNNERS = {
    "forward": forward,
    "delta": delta,
    "dq": functools.partial(_backward, True),
    "dkdv": functools.partial(_backward, False),
}
