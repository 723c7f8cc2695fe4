"""Helpers for the scaling experiments: attention callables by name, the memory budget,
OOM-as-a-result, random inputs, plotting setup."""
from __future__ import annotations

import os
import traceback

import jax
import jax.numpy as jnp

import jflash
from experiments import common

# Labels of the attention paths compared everywhere. "standard" materialises the
# T x S scores; "jflash" is jflash's default for the platform; "cudnn" is jax.nn's.
IMPLEMENTATIONS = {"standard": "xla", "jflash": None, "cudnn": "cudnn", "hip": "hip"}


def attention_callable(label: str, is_causal: bool):
  """(q, k, v) -> out for a label of IMPLEMENTATIONS (or a raw jflash implementation name)."""
  impl = IMPLEMENTATIONS.get(label, label)
  if impl == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=is_causal,
                                                         implementation="cudnn")
  return lambda q, k, v: jflash.attention(q, k, v, is_causal=is_causal, implementation=impl)


def labels_for_backend(requested: list[str] | None = None) -> list[str]:
  """cuDNN attention exists only on NVIDIA GPUs and the HIP kernels only where their
  library serves a device; by default each is left out elsewhere, not faked (asked for
  by name, a label runs and its failure is recorded)."""
  device = jax.devices()[0]
  on_cuda = device.platform == "gpu" and "cuda" in str(device.client.platform_version).lower()
  on_rocm = device.platform == "gpu" and not on_cuda
  if requested:
    return [l for l in requested if l != "cudnn" or on_cuda]
  return [l for l in IMPLEMENTATIONS if (l != "cudnn" or on_cuda) and (l != "hip" or on_rocm)]


def memory_budget_bytes(override_gb: float | None) -> tuple[int | None, str]:
  """Device memory that a compiled program must fit in, and where the number came from."""
  if override_gb:
    return int(override_gb * 2**30), "--memory-budget-gb"
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # CPU clients may not implement memory_stats
    stats = {}
  if stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), "device bytes_limit"
  if jax.default_backend() == "cpu":
    try:
      return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM"
    except (ValueError, OSError, AttributeError):  # not POSIX
      pass
  return None, "unknown"


def failure(err: BaseException) -> dict:
  """An exception as a result row: OOM is a finding; anything else is recorded too, so
  one broken implementation does not hide the others' numbers."""
  text = f"{type(err).__name__}: {err}"
  if common.is_oom(err):
    return {"status": "oom", "error": text[:500]}
  return {"status": "error", "error": text[:500], "traceback": traceback.format_exc()[-1500:]}


def shape_struct(shape, dtype):
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def setup_matplotlib():
  import matplotlib
  matplotlib.use("Agg")  # files only; no display on servers
  import matplotlib.pyplot as plt
  return plt


def human_bytes(n) -> str:
  if n is None:
    return "-"
  for unit, div in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
    if n >= div:
      return f"{n / div:.1f} {unit}"
  return f"{n} B"


def seq_label(n: int) -> str:
  return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def seq_axis(ax, seqs):
  """Log2 x-axis ticked at exactly the measured sequence lengths (256, 1K, 2K, ...)."""
  seqs = sorted(set(seqs))
  ax.set_xscale("log", base=2)
  if seqs:
    ax.set_xticks(seqs)
    ax.set_xticklabels([seq_label(s) for s in seqs], fontsize=8)
  ax.xaxis.set_minor_locator(__import__("matplotlib").ticker.NullLocator())
  ax.set_xlabel("sequence length")


def load_average() -> list[float] | None:
  """1/5/15-minute load: a busy shared host slows CPU timings, so it is recorded."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except (OSError, AttributeError):  # not available on this platform
    return None


def random_arrays(seed: int, structs) -> list:
  """Standard-normal device arrays for these ShapeDtypeStructs, drawn on the device
  (host NumPy would spend seconds per GB at long sequences)."""
  keys = jax.random.split(jax.random.key(seed), len(structs))
  return [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
          for k, s in zip(keys, structs)]
