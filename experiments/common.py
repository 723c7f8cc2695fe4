"""Helpers shared by the experiment scripts: environment record, timing, memory, output."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def preset_parser(doc: str, presets: dict, preset_help: str) -> argparse.ArgumentParser:
  """An experiment's parser, described by its docstring's first paragraph, with
  --preset (auto or one of `presets`) and --tiny; see `apply_preset`."""
  p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--preset", choices=["auto", *presets], default="auto", help=preset_help)
  p.add_argument("--tiny", action="store_true", help="same as --preset tiny (tests)")
  return p


def add_preset_options(p: argparse.ArgumentParser, options):
  """One --option per (name, type, why) whose default (None) comes from the preset."""
  for name, typ, why in options:
    p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None,
                   help=why + " (default: preset)")


def apply_preset(args, presets: dict, gpu_preset: str):
  """Resolves `--preset auto` (and `--tiny`) for the backend and fills every option left
  at None from the preset; the resolved values are what the results record."""
  preset = "tiny" if getattr(args, "tiny", False) else args.preset
  if preset == "auto":
    preset = "cpu" if jax.default_backend() == "cpu" else gpu_preset
  args.preset = preset
  for k, v in presets[preset].items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  return args


def environment() -> dict:
  """Device, versions and host: written beside every result."""
  dev = jax.devices()[0]
  env = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "backend": jax.default_backend(),
      "device": getattr(dev, "device_kind", str(dev)),
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
      "python": platform.python_version(),
      "numpy": np.__version__,
      "host": platform.machine(),
      "cpu_count": os.cpu_count(),
  }
  for pkg in ("flax", "optax", "tokamax", "torch", "triton"):
    v = _version(pkg)
    if v:
      env[pkg] = v
  return env


def _version(pkg):
  try:
    from importlib.metadata import version
    return version(pkg)
  except Exception:  # not installed
    return None


def block(x):
  return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn, *args, warmup: int = 2, iters: int = 10) -> dict:
  """Median wall time of a jitted call, completion awaited on the device (seconds)."""
  for _ in range(warmup):
    block(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    block(fn(*args))
    times.append(time.perf_counter() - t0)
  return {"median_s": statistics.median(times), "min_s": min(times), "iters": iters}


def compiled_memory(fn, *args) -> dict:
  """Compiled temp/argument/output bytes of `jax.jit(fn)` for these arguments."""
  compiled = jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  if m is None:
    return {}
  return {k: int(getattr(m, k)) for k in (
      "temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
      "generated_code_size_in_bytes") if hasattr(m, k)}


def peak_device_memory() -> int | None:
  """Peak bytes in use on device 0 since start, where the backend reports it."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # CPU backends may not implement memory_stats
    return None
  return None if not stats else stats.get("peak_bytes_in_use")


def is_oom(err: BaseException) -> bool:
  text = str(err)
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


def write_result(name: str, config, rows, extra: dict | None = None, out_dir: Path | None = None) -> Path:
  """Writes `{environment, config, rows, ...}` as JSON to results/<name>.json."""
  out_dir = Path(out_dir) if out_dir else RESULTS
  out_dir.mkdir(parents=True, exist_ok=True)
  if dataclasses.is_dataclass(config):
    config = dataclasses.asdict(config)
  elif hasattr(config, "__dict__") and not isinstance(config, dict):
    config = vars(config)
  payload = {"environment": environment(), "config": config, "argv": sys.argv, "rows": rows}
  payload.update(extra or {})
  path = out_dir / f"{name}.json"
  path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  return path
