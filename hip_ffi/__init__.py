"""The MI50 (gfx906) FlashAttention forward as an XLA FFI custom call.

Nothing here compiles or loads a library at import time: `python -m hip_ffi.build`
(or `make hip`) builds it, `register()` dlopens whatever build matches the current
sources and registers the FFI target, and `flash_forward` is the raw op. This
package never imports jflash; jflash/hip_impl.py is the glue.
"""
from __future__ import annotations

import ctypes
import math
import threading

TARGET_NAME = "jflash_flash_fwd"
HANDLER_SYMBOL = "JflashFlashFwd"
HEAD_DIMS = (64, 128)
# jax platform name -> (build target, XLA platform name for register_ffi_target)
PLATFORMS = {"rocm": ("rocm", "ROCM"), "cuda": ("cuda", "CUDA")}

_lock = threading.Lock()
_registered: dict[str, str] = {}   # jax platform -> path of the library registered for it
_load_errors: dict[str, str] = {}  # jax platform -> why its library could not be used


def tile_table():
  """{head_dim: ((block_q, block_k, threads) for tile 0, 1, ...)} of the kernel source."""
  from hip_ffi import build
  return build.tile_table()


def register() -> tuple[str, ...]:
  """Loads every built library that matches the sources; returns the platforms served.

  The hipcc build serves "rocm", the nvcc build "cuda". Registering for a platform
  only needs the handler's address, so a gfx906 build registers fine on a machine
  without an AMD GPU as long as libamdhip64 can be loaded (it is what the library
  links against).
  """
  from hip_ffi import build
  with _lock:
    for platform, (target, xla_name) in PLATFORMS.items():
      if platform in _registered:
        continue
      lib_path = build.cached_library(target)
      if lib_path is None:
        _load_errors[platform] = (f"no {target} build of the current sources; run "
                                  f"`python -m hip_ffi.build --target {target}`")
        continue
      try:
        lib = ctypes.CDLL(str(lib_path))
        handler = getattr(lib, HANDLER_SYMBOL)
      except (OSError, AttributeError) as e:
        _load_errors[platform] = f"cannot load {lib_path}: {e}"
        continue
      import jax.ffi
      jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(handler), platform=xla_name)
      _registered[platform] = str(lib_path)
      _load_errors.pop(platform, None)
    return tuple(_registered)


def device_platforms() -> tuple[str, ...]:
  """The platforms of PLATFORMS with a device in this process ("cuda" before "rocm")."""
  import jax
  found = []
  for platform in sorted(PLATFORMS):
    try:
      if jax.devices(platform):
        found.append(platform)
    except (RuntimeError, ValueError):  # this jaxlib has no such backend or device
      pass
  return tuple(found)


def registered_platforms() -> tuple[str, ...]:
  return tuple(_registered)


def load_errors() -> dict[str, str]:
  """Why each platform has no registered library (after `register()`)."""
  return dict(_load_errors)


def check_inputs(q, k, v, *, scale, is_causal, tile):
  """ValueError naming the bad value, for everything the kernel cannot take."""
  import numpy as np
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.dtype(x.dtype) != np.float16:
      raise ValueError(f"{name}.dtype={x.dtype}: the hip kernel takes float16 only")
    if len(x.shape) != 4:
      raise ValueError(f"{name}.shape={tuple(x.shape)} must be rank 4 [B, T|S, N|K, H]")
  B, T, N, H = q.shape
  if tuple(k.shape) != tuple(v.shape):
    raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} differ")
  Bk, S, K, Hk = k.shape
  if Bk != B or Hk != H:
    raise ValueError(f"q.shape={tuple(q.shape)} and k.shape={tuple(k.shape)} "
                     "disagree on batch or head_dim")
  if min(B, T, N, S, K) < 1:
    raise ValueError(f"empty dimension in q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
  if N % K:
    raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")
  if H not in HEAD_DIMS:
    raise ValueError(f"head_dim={H} is not compiled; the hip kernel has {HEAD_DIMS}")
  if N > 65535 or B > 65535:
    raise ValueError(f"N={N} and B={B} must be <= 65535 (grid y/z limits)")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal={is_causal!r} must be a bool")
  if not math.isfinite(float(scale)):
    raise ValueError(f"scale={scale!r} must be finite")
  n_tiles = len(tile_table()[H])
  if not isinstance(tile, (int, np.integer)) or not 0 <= tile < n_tiles:
    raise ValueError(f"tile={tile!r} must be an int in [0, {n_tiles}) for head_dim={H}")


def flash_forward(q, k, v, *, scale: float, is_causal: bool, tile: int = 0):
  """Raw op: `(out [B, T, N, H] fp16, lse [B, N, T] f32)` from the custom call.

  Checks the inputs (ValueError) before `jax.ffi.ffi_call`. XLA allocates buffers
  with at least 16-byte alignment, which the handler re-checks for its 128-bit loads.
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  check_inputs(q, k, v, scale=scale, is_causal=is_causal, tile=tile)
  B, T, N, H = q.shape
  call = jax.ffi.ffi_call(
      TARGET_NAME,
      (jax.ShapeDtypeStruct(q.shape, jnp.float16),
       jax.ShapeDtypeStruct((B, N, T), jnp.float32)))
  # numpy scalars fix the attribute types the handler decodes: f32, i1 (pred), i32.
  out, lse = call(q, k, v, scale=np.float32(scale), is_causal=np.bool_(is_causal),
                  tile=np.int32(tile))
  return out, lse
