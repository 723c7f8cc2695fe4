"""What every experiment shares: the FLOP count, the timing loop, the compiled-memory
reading, the device tag, the environment record and the JSON writer."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

# The committed results. The scripts' --out-dir defaults to results/local/, which git
# ignores, so trying a script never changes the tree; --out-dir experiments/results
# refreshes the committed files.
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "local"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
  """The description as written; each option's default shown once: appended unless its
  help already states it, or there is none to show (None, a flag's False)."""

  def _get_help_string(self, action):
    text = action.help or ""
    if "default" in text or action.default in (None, False):
      return text
    return super()._get_help_string(action)


def parser(doc: str, whole: bool = False) -> argparse.ArgumentParser:
  """An experiment's parser, described by its docstring's first paragraph (`whole`: all
  of it, usage lines included)."""
  return argparse.ArgumentParser(description=doc if whole else doc.split("\n\n")[0],
                                 formatter_class=_HelpFormatter)


def add_tiny(p: argparse.ArgumentParser, what: str):
  """--tiny, every experiment's smoke run (seconds on a CPU; the tests run it)."""
  p.add_argument("--tiny", action="store_true", help=f"smoke run on the CPU: {what}")


def preset_parser(doc: str, presets: dict, preset_help: str) -> argparse.ArgumentParser:
  """An experiment's parser with --preset (auto or one of `presets`) and --tiny; see
  `apply_preset`."""
  p = parser(doc)
  p.add_argument("--preset", choices=["auto", *presets], default="auto", help=preset_help)
  add_tiny(p, "same as --preset tiny")
  return p


def add_preset_options(p: argparse.ArgumentParser, options):
  """One --option per (name, type, why) whose default (None) comes from the preset."""
  for name, typ, why in options:
    p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None,
                   help=why + " (default: the preset's)")


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


_T0 = time.perf_counter()


def elapsed() -> float:
  """Seconds since this process imported the experiments."""
  return time.perf_counter() - _T0


def log(msg: str):
  print(f"[{elapsed():7.1f}s] {msg}", flush=True)


class _Lines:
  """`progress` where stderr is no terminal (a log file, CI): one line per finished
  step, at most one every LINE_S seconds, and the last; a bar's carriage returns would
  pile up on one line there."""
  LINE_S = 10.0

  def __init__(self, iterable, desc):
    self.iterable, self.desc, self.postfix = iterable, desc, ""
    self.total = len(iterable) if hasattr(iterable, "__len__") else None

  def __iter__(self):
    start = last = time.perf_counter()
    i = 0
    for i, item in enumerate(self.iterable, 1):
      yield item
      now = time.perf_counter()
      if now - last >= self.LINE_S or i == self.total:
        last = now
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc}: {i}{of} {self.postfix} [{now - start:.0f} s]".rstrip(),
              file=sys.stderr, flush=True)

  def set_postfix_str(self, text: str):
    self.postfix = text

  def set_postfix(self, **values):
    self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())


def progress(iterable, desc: str, unit: str, leave: bool = True):
  """A tqdm bar over `iterable` on a terminal, plain lines elsewhere (`_Lines`)."""
  if not sys.stderr.isatty():
    return _Lines(iterable, desc)
  from tqdm import tqdm
  return tqdm(iterable, desc=desc, unit=unit, leave=leave)


def note(msg: str):
  """A line printed beside a progress bar without breaking it."""
  from tqdm import tqdm
  tqdm.write(msg)


# -- FLOPs ---------------------------------------------------------------------------
# QK^T and PV cost 2 * H multiply-adds each per visible (query, key) pair: 4 * H FLOPs.
# The backward does 2.5 forwards' worth of matrix products (recomputed QK^T, dV, dP,
# dQ, dK), so forward + backward counts 3.5x the forward (FlashAttention-2, section 4).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def dense_pairs(T: int, S: int, causal: bool) -> float:
  """(query, key) pairs of a T x S attention; causal counts half the square, the
  FlashAttention-2 convention (not the exact T(T+1)/2), so TF/s compare with its tables."""
  return T * S * (0.5 if causal else 1.0)


def attention_flops(batch: int, heads: int, head_dim: int, pairs: float, mode: str = "fwd") -> float:
  """FLOPs of attention over `pairs` visible (query, key) pairs per (batch, head)."""
  return 4.0 * batch * heads * head_dim * pairs * MODE_FLOP_FACTOR[mode]


# -- timing --------------------------------------------------------------------------

def _calls_to_fill(round_s: float, one: float) -> int:
  """How many back-to-back calls of `one` seconds fill `round_s`: at least 1 and at most
  500, so that launch gaps do not count."""
  return int(min(max(1, round_s / max(one, 1e-6)), 500))


def _calls_for(fn, sets, warmup: int, round_s: float, sync) -> tuple[int, float]:
  """`warmup` calls, the last one timed as an estimate: (`_calls_to_fill` for it, the
  estimate in seconds)."""
  n = len(sets)
  one = 0.0
  for i in range(max(1, warmup)):
    t = time.perf_counter()
    sync(fn(*sets[(i + 1) % n]))
    one = time.perf_counter() - t
  return _calls_to_fill(round_s, one), one


def _round(fn, sets, calls: int, sync) -> float:
  """Seconds per call of `calls` back-to-back calls over the rotated argument tuples
  `sets` (so no call finds the previous call's inputs in cache), completion awaited
  once: one stream runs in order, so the last call done means all are."""
  t = time.perf_counter()
  for i in range(calls):
    out = fn(*sets[i % len(sets)])
  sync(out)
  return (time.perf_counter() - t) / calls


def _summary(times, calls: int) -> dict:
  """A program's record: the median over rounds of seconds per call, and the rounds."""
  return {"median_s": statistics.median(times), "min_s": min(times), "rounds": len(times),
          "calls_per_round": calls, "s_by_round": times}


def time_calls(fn, sets=((),), *, rounds: int = 5, round_s: float = 0.0, warmup: int = 1,
               budget_s: float | None = None, sync=block) -> dict:
  """Seconds per call of an already compiled `fn`: the median over `rounds` rounds of
  back-to-back calls (`_calls_for`, `_round`); with `budget_s`, slow calls get fewer
  rounds (at least 1). Programs compared with each other are timed with
  `time_alternating`."""
  calls, one = _calls_for(fn, sets, warmup, round_s, sync)
  if budget_s is not None:
    rounds = max(1, min(rounds, int(budget_s / max(one * calls, 1e-9))))
  return _summary([_round(fn, sets, calls, sync) for _ in range(rounds)], calls)


def round_order(labels, r: int) -> list:
  """The programs' order in round r: rotated by r // 2, and reversed in odd rounds, so
  that over the rounds each program runs first and last alike and after each of the
  others (two programs: A B, B A, B A, A B, ...)."""
  k = (r // 2) % len(labels)
  order = list(labels[k:]) + list(labels[:k])
  return order[::-1] if r % 2 else order


def time_alternating(programs: dict, *, rounds: int = 7, round_s: float = 0.05,
                     warm_s: float = 1.0, warmup: int = 2) -> dict:
  """Seconds per call of several compiled programs compared with each other:
  {label: (fn, sets, sync)} -> {label: time_calls' record, or {"error": text} for a
  program that raised (it leaves the rounds; the others go on)}.

  An H200 running attention back to back is held at its power limit, its SM clock set
  by the energy drawn: 1440-1980 MHz (mean 1852) in the samples drawing over 400 W
  beside a backward comparison (`gpu_clocks_backward_variants_h200.csv`, in git history
  at 939d587), 1980 idle, while the benchmark tables' samples, which fell mostly between
  their short rounds, dipped to 1620-1725 MHz (the burst-timed runs'
  `gpu_clocks_bench_a_*_h200.csv`, there too). After an idle stretch (a
  compile) a program starts at the boost clock and slows as the draw reaches the cap.
  Timed one after another in short bursts, two programs see different clocks: the same
  kernels moved 8% between two runs of the table while cuDNN beside them moved 0-3%.
  So every program is timed under the same sustained load: first `warm_s` seconds of
  back-to-back calls cycling through all programs (the load a training step holds),
  then `rounds` rounds in which each program runs its calls back to back (`round_s`
  long), in the order `round_order` gives. The median over rounds of each program is
  its time; the rounds are kept (`s_by_round`) so a ratio can be read round by round
  too. A program's calls per round are counted from one timed call (`_calls_for`), then
  again from each of its warm rounds: a single call can catch the card at its idle
  clock, and a round of too few calls then measures its wait for completion more than
  the calls."""
  records, live, calls = {}, [], {}
  for n, (fn, sets, sync) in programs.items():
    try:
      calls[n] = _calls_for(fn, sets, warmup, round_s, sync)[0]
      live.append(n)
    except Exception as e:
      records[n] = {"error": f"{type(e).__name__}: {e}"}
  times = {n: [] for n in live}

  def run(n, record):
    fn, sets, sync = programs[n]
    try:
      t = _round(fn, sets, calls[n], sync)
    except Exception as e:
      records[n] = {"error": f"{type(e).__name__}: {e}"}
      live.remove(n)
      return
    if record:
      times[n].append(t)
    else:
      calls[n] = _calls_to_fill(round_s, t)

  t_end = time.perf_counter() + warm_s
  while live and time.perf_counter() < t_end:
    for n in list(live):
      run(n, record=False)
  for r in range(rounds):
    for n in round_order(list(live), r) if live else ():
      if n in live:
        run(n, record=True)
  for n in live:
    records[n] = _summary(times[n], calls[n])
  return {n: records[n] for n in programs}


def time_fn(fn, *args, warmup: int = 2, iters: int = 10) -> dict:
  """`time_calls` for one argument tuple, one call per round."""
  return time_calls(fn, (args,), rounds=iters, warmup=warmup)


# -- compiled memory -----------------------------------------------------------------

def compile_with_memory(jitted, *args) -> tuple[object, dict]:
  """Lowers and compiles once; returns (executable, memory dict in bytes).

  `total_bytes` = arguments + outputs + temporaries - donated aliases: what must be
  resident while the program runs (the number XLA itself checks against the device).
  """
  compiled = jitted.lower(*args).compile()
  m = compiled.memory_analysis()
  mem = {}
  if m is not None:
    for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes"):
      if hasattr(m, k):
        mem[k] = int(getattr(m, k))
    mem["total_bytes"] = (mem.get("temp_size_in_bytes", 0) + mem.get("argument_size_in_bytes", 0)
                          + mem.get("output_size_in_bytes", 0) - mem.get("alias_size_in_bytes", 0))
  return compiled, mem


def compiled_memory(fn, *args) -> dict:
  """Compiled memory (see `compile_with_memory`) of `jax.jit(fn)` for these arguments."""
  return compile_with_memory(jax.jit(fn), *args)[1]


def device_tag() -> str:
  """Short name of device 0 for result files: "h200" on an H200, "cpu" on the CPU,
  else the device kind without vendor words as a slug."""
  if jax.default_backend() == "cpu":
    return "cpu"
  kind = getattr(jax.devices()[0], "device_kind", jax.default_backend()).lower()
  if "h200" in kind:
    return "h200"
  kind = re.sub(r"\b(nvidia|amd|radeon|instinct)\b", "", kind)
  return re.sub(r"[^a-z0-9]+", "_", kind).strip("_") or jax.default_backend()


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
  """Writes `{environment, config, rows, ...}` as JSON to <out_dir>/<name>.json. The
  scripts' --out-dir defaults to DEFAULT_OUT; without one (the GPU check scripts, whose
  results are committed as they come from the device) it is RESULTS."""
  out_dir = Path(out_dir) if out_dir else RESULTS
  out_dir.mkdir(parents=True, exist_ok=True)
  if dataclasses.is_dataclass(config):
    config = dataclasses.asdict(config)
  elif hasattr(config, "__dict__") and not isinstance(config, dict):
    config = vars(config)
  payload = {"environment": environment(), "config": config, "argv": sys.argv, "rows": rows}
  payload.update(extra or {})
  path = out_dir / f"{name}.json"
  # Written whole, then renamed: a run killed mid-write leaves the previous file intact.
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
  os.replace(tmp, path)
  return path
