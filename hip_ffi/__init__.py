"""The MI50 (gfx906) FlashAttention forward and backward as XLA FFI custom calls.

Nothing here compiles or loads a library at import time: `python -m hip_ffi.build`
(or `make hip`) builds it, `register()` dlopens whatever build matches the current
sources and registers the FFI targets, and `flash_forward`, `flash_backward_delta`,
`flash_backward_dq` and `flash_backward_dkdv` are the raw ops (float16 in). This
package never imports jflash; jflash/hip_impl.py is the glue (masks, bfloat16).
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import threading

import numpy as np

# op -> (FFI target name, handler symbol in the library)
TARGETS = {
    "forward": ("jflash_flash_fwd", "JflashFlashFwd"),
    "delta": ("jflash_flash_bwd_delta", "JflashFlashBwdDelta"),
    "dq": ("jflash_flash_bwd_dq", "JflashFlashBwdDq"),
    "dkdv": ("jflash_flash_bwd_dkdv", "JflashFlashBwdDkdv"),
}
TARGET_NAME = TARGETS["forward"][0]
# Grid dims y and z (heads, batch) of a launch are limited to 65535 on both vendors.
GRID_YZ_LIMIT = 65535
# jax platform name -> (build target, XLA platform name for register_ffi_target)
PLATFORMS = {"rocm": ("rocm", "ROCM"), "cuda": ("cuda", "CUDA")}

_lock = threading.Lock()
_registered: dict[str, str] = {}   # jax platform -> path of the library registered for it
_load_errors: dict[str, str] = {}  # jax platform -> why its library could not be used
_EMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar("hip_ffi_emulated",
                                                                 default=False)


@contextlib.contextmanager
def emulated():
  """Inside, the raw ops run the kernels on CPU fibers (hip_ffi/emulate.py) through
  `jax.pure_callback` instead of the custom calls: the whole jflash path (ranges, dtype
  handling, custom_vjp, vmap) runs on a machine without a GPU, for tests."""
  token = _EMULATED.set(True)
  try:
    yield
  finally:
    _EMULATED.reset(token)


def emulating() -> bool:
  return _EMULATED.get()


def head_dims() -> tuple[int, ...]:
  """The head dims the kernels are compiled for (the rows of the source's tile tables)."""
  return tuple(tile_table())


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
        handlers = {name: getattr(lib, symbol) for name, symbol in TARGETS.values()}
      except (OSError, AttributeError) as e:
        _load_errors[platform] = f"cannot load {lib_path}: {e}"
        continue
      import jax.ffi
      for name, handler in handlers.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform=xla_name)
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


def bwd_tile_table():
  """{head_dim: (BQ, BKV, threads)} of the backward kernels (dQ and dK/dV share it)."""
  from hip_ffi import build
  return build.bwd_tile_table()


def check_inputs(q, k, v, *, scale, is_causal, tile, window=None, soft_cap=None,
                 dtypes=(np.float16,)):
  """ValueError naming the bad value, for everything the kernels cannot take.

  The one place of these rules: the raw ops call it with float16 only, jflash's
  `supports` with the dtypes it converts and turns the error into NotImplementedError.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.dtype(x.dtype) not in [np.dtype(d) for d in dtypes]:
      names = ", ".join(np.dtype(d).name for d in dtypes)
      raise ValueError(f"{name}.dtype={x.dtype}: the hip kernels take {names}")
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
  if H not in head_dims():
    raise ValueError(f"head_dim={H} is not compiled; the hip kernels have {head_dims()}")
  if N > GRID_YZ_LIMIT or B > GRID_YZ_LIMIT:
    raise ValueError(f"heads N={N} and batch B={B} must be <= {GRID_YZ_LIMIT} "
                     "(grid y/z limits)")
  if not isinstance(is_causal, (bool, np.bool_)):
    raise ValueError(f"is_causal={is_causal!r} must be a bool")
  if not math.isfinite(float(scale)):
    raise ValueError(f"scale={scale!r} must be finite")
  if soft_cap is not None:
    # The kernels take the cap and scale / cap in float32, where 0 means "no cap".
    tiny, most = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if (isinstance(soft_cap, (bool, np.bool_))
        or not isinstance(soft_cap, (int, float, np.floating, np.integer))
        or not tiny <= float(soft_cap) <= most):
      raise ValueError(f"soft_cap={soft_cap!r} must be None or a number in "
                       f"[{tiny:.3g}, {most:.3g}] (float32, normal)")
    if not abs(float(scale)) / float(soft_cap) <= most:
      raise ValueError(f"scale / soft_cap = {scale!r} / {soft_cap!r} overflows float32")
  if window is not None and not (len(window) == 2 and all(
      isinstance(w, (int, np.integer)) and 0 <= w < 2**31 for w in window)):
    raise ValueError(f"window={window!r} must be a (left, right) pair of ints >= 0")
  n_tiles = len(tile_table()[H])
  if not isinstance(tile, (int, np.integer)) or not 0 <= tile < n_tiles:
    raise ValueError(f"tile={tile!r} must be an int in [0, {n_tiles}) for head_dim={H}")


def _call(op, results, *args, **attrs):
  """One raw op: the custom call, or the CPU emulation inside `emulated()`.

  vmap_method="broadcast_all": a vmapped call gets the batch axis on every operand;
  the kernels treat all leading dims as batch, so it runs as one launch.
  """
  import jax
  if emulating():
    from hip_ffi import emulate
    return jax.pure_callback(functools.partial(emulate.RUNNERS[op], **attrs), results, *args,
                             vmap_method="broadcast_all")
  return jax.ffi.ffi_call(TARGETS[op][0], results, vmap_method="broadcast_all")(*args, **attrs)


def _mask_attrs(scale, is_causal, window, soft_cap, q_seg):
  # numpy scalars fix the attribute types the handler decodes: f32, i1 (pred), i32.
  left, right = (-1, -1) if window is None else window
  return dict(scale=np.float32(scale), is_causal=np.bool_(is_causal),
              window_left=np.int32(left), window_right=np.int32(right),
              has_segments=np.bool_(q_seg is not None),
              soft_cap=np.float32(0.0 if soft_cap is None else soft_cap))


def _segments(q_seg, kv_seg):
  """The segment-id operands; a [1, 1] placeholder (never read) without segment ids."""
  import jax.numpy as jnp
  if q_seg is None:
    none = jnp.zeros((1, 1), jnp.int32)
    return none, none
  return jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32)


def flash_forward(q, k, v, ranges, q_seg=None, kv_seg=None, *, scale: float,
                  is_causal: bool, window=None, soft_cap=None, tile: int = 0):
  """Raw op: `(out [B, T, N, H] fp16, lse [B, N, T] f32)`.

  `ranges` [B, ceil(T / BQ), 8] int32 (pallas_kernels.masking.build_ranges for the
  forward tile's BQ x BK); `q_seg` [B, T], `kv_seg` [B, S] int32 or None; `soft_cap`
  None or c > 0 (logits -> c tanh(logits / c)). Checks the
  inputs (ValueError) before the call. XLA allocates buffers with at least 16-byte
  alignment, which the handler re-checks for its 128-bit loads.
  """
  import jax
  import jax.numpy as jnp
  check_inputs(q, k, v, scale=scale, is_causal=is_causal, tile=tile, window=window,
               soft_cap=soft_cap)
  B, T, N, H = q.shape
  results = (jax.ShapeDtypeStruct(q.shape, jnp.float16),
             jax.ShapeDtypeStruct((B, N, T), jnp.float32))
  return _call("forward", results, q, k, v, ranges, *_segments(q_seg, kv_seg),
               **_mask_attrs(scale, is_causal, window, soft_cap, q_seg), tile=np.int32(tile))


def flash_backward_delta(out, dout, dlse):
  """Raw op: delta [B, N, T] f32 = rowsum(dout * out) - dlse, out/dout fp16 [B, T, N, H]."""
  import jax
  import jax.numpy as jnp
  B, T, N, _ = out.shape
  return _call("delta", jax.ShapeDtypeStruct((B, N, T), jnp.float32), out, dout,
               jnp.asarray(dlse, jnp.float32))


def flash_backward_dq(q, k, v, dout, lse, delta, ranges, q_seg=None, kv_seg=None, *,
                      scale: float, is_causal: bool, window=None, soft_cap=None):
  """Raw op: dq [B, T, N, H] f32; `ranges` per query tile of the backward tile table."""
  import jax
  import jax.numpy as jnp
  check_inputs(q, k, v, scale=scale, is_causal=is_causal, tile=0, window=window,
               soft_cap=soft_cap)
  return _call("dq", jax.ShapeDtypeStruct(q.shape, jnp.float32), q, k, v, dout, lse, delta,
               ranges, *_segments(q_seg, kv_seg),
               **_mask_attrs(scale, is_causal, window, soft_cap, q_seg))


def flash_backward_dkdv(q, k, v, dout, lse, delta, ranges, q_seg=None, kv_seg=None, *,
                        scale: float, is_causal: bool, window=None, soft_cap=None):
  """Raw op: (dk, dv) [B, S, K, H] f32; `ranges` per key tile (build_ranges(transpose))."""
  import jax
  import jax.numpy as jnp
  check_inputs(q, k, v, scale=scale, is_causal=is_causal, tile=0, window=window,
               soft_cap=soft_cap)
  kv = jax.ShapeDtypeStruct(k.shape, jnp.float32)
  return _call("dkdv", (kv, kv), q, k, v, dout, lse, delta, ranges,
               *_segments(q_seg, kv_seg), **_mask_attrs(scale, is_causal, window, soft_cap, q_seg))
