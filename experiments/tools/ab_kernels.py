"""Two trees' jflash timed against each other in one process.

A "not slower" check between two benchmark runs mixes a kernel change with the spread
of the runs (clocks, the machine lent). Here the `jflash` and `pallas_kernels` packages
of another tree (e.g. `git worktree add /tmp/base <commit>`) and this tree's are
imported side by side and `jflash.attention(..., implementation=...)` of each is timed
on the same cells in alternating rounds (`common.time_alternating`), so both see the same
machine at the same time.
TF/s (FLOPs as in the benchmark), the median of the rounds.

  python -m experiments.tools.ab_kernels /tmp/base --out-dir experiments/results --name ab_fa2_h200
  python -m experiments.tools.ab_kernels /tmp/base --implementation mosaic_gpu \
      --cells "fa2 16K d128 causal,GQA" --modes fwd+bwd
  python -m experiments.tools.ab_kernels /tmp/base --implementation mosaic_gpu \
      --config '{"backward": "mosaic_gpu"}' --cells "fa2 1K d128 causal" --modes fwd+bwd
"""
from __future__ import annotations

import argparse
import contextlib
import json
import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import common
from experiments.bench import runner, specs

TREE = Path(__file__).resolve().parents[2]
PACKAGES = ("jflash", "pallas_kernels")   # what a tree contributes

# The benchmark's cells (the FA-2 grids, full included), and the decoder LM's attention
# (seq_scaling --parts lm).
LM = specs.Case(4096, 128, True, 4, 8, name="LM 4K d128 causal")
CELLS = {c.name: c for grid in ("quick", "hopper", "full", "d256", "model", "short")
         for c in specs.GRIDS[grid]}
CELLS[LM.name] = LM


def _package_modules() -> list[str]:
  return [m for m in sys.modules if m.split(".")[0] in PACKAGES]


@contextlib.contextmanager
def package(modules: dict):
  """`sys.modules` with `modules` as the tree's packages, and the process's own put
  back after. Tracing needs it, not only importing: the kernels import some helpers
  when they are traced (`masking.tile_scores` takes `common`'s then), and those must
  come from the same tree. Modules first imported inside join `modules`, so every
  later entry sees the same copies."""
  saved = {name: sys.modules.pop(name) for name in _package_modules()}
  sys.modules.update(modules)
  try:
    yield
  finally:
    for name in _package_modules():
      modules[name] = sys.modules.pop(name)
    sys.modules.update(saved)


class _TreeFinder(importlib.abc.MetaPathFinder):
  """Finds the top-level `PACKAGES` under `tree` (their submodules follow the package's
  own `__path__`); every other import resolves as usual."""

  def __init__(self, tree: Path):
    self.tree = str(tree)

  def find_spec(self, name, path, target=None):
    if path is None and name in PACKAGES:
      return importlib.machinery.PathFinder.find_spec(name, [self.tree])
    return None


def load_modules(tree: Path, names) -> dict:
  """The tree's packages with the modules `names` imported, apart from the process's
  own (`package`)."""
  modules = {}
  finder = _TreeFinder(tree)
  with package(modules):
    sys.meta_path.insert(0, finder)
    try:
      imported = [importlib.import_module(name) for name in names]
    finally:
      sys.meta_path.remove(finder)
  for module in imported:
    if not Path(module.__file__).resolve().is_relative_to(tree):
      raise ValueError(f"{tree} has no {module.__name__} (imported {module.__file__})")
  return modules


def load_tree(tree: Path):
  """(jflash.attention, modules) of the packages under `tree`."""
  modules = load_modules(tree, PACKAGES)
  return modules["jflash"].attention, modules


def select_cases(cells: str | None, tiny: bool = False) -> tuple:
  """The cells whose names contain one of the comma-separated `cells` (default: the
  FA-2 quick cells); `tiny`: one interpreted cell for the tests."""
  if tiny:
    if cells:
      raise ValueError("--tiny times its own cell; leave out --cells")
    return (specs.Case(128, 32, True, 1, 2, name="tiny causal"),)
  if not cells:
    return specs.FA2_QUICK
  wanted = cells.split(",")
  cases = tuple(c for name, c in CELLS.items() if any(w in name for w in wanted))
  if not cases:
    raise ValueError(f"--cells {cells!r} names none of: {', '.join(CELLS)}")
  return cases


def cell_inputs(case):
  """(q, k, v, do) of a cell, bf16 normal draws from a fixed key."""
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, do = (jax.random.normal(key, (case.batch, case.s, case.heads, case.d), jnp.bfloat16)
           for key in keys[:2])
  k, v = (jax.random.normal(key, (case.batch, case.s, case.k_heads, case.d), jnp.bfloat16)
          for key in keys[2:])
  return q, k, v, do


def programs(loaded, case, mode, inputs, implementation="pallas", config=None):
  """One tree's compiled program for `mode`, traced under that tree's packages; `config`:
  fields of the implementation's config, built from the config type that tree's
  registry gives it."""
  attention, modules = loaded
  with package(modules):
    options = {}
    if config:
      if implementation is None:
        raise ValueError("--config needs a named --implementation, not auto")
      config_type = modules["jflash.api"].get_implementation(implementation).config_type
      if config_type is None:
        raise ValueError(f"--config: implementation {implementation!r} takes no config")
      options["config"] = config_type(**config)
    attn = functools.partial(attention, is_causal=case.causal,
                             implementation=implementation, **options)
    f = (lambda q, k, v, do: attn(q, k, v)) if mode == "fwd" else runner.fwd_bwd(attn)
    return jax.jit(f).lower(*inputs).compile()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("base", type=Path, help="the other tree (holding jflash/, pallas_kernels/)")
  p.add_argument("--implementation", default="pallas",
                 help="jflash implementation timed (auto: implementation=None)")
  p.add_argument("--cells", default=None,
                 help="comma-separated substrings of cell names (default: the FA-2 quick "
                      f"cells); the cells: {', '.join(CELLS)}")
  p.add_argument("--modes", default=",".join(specs.MODES))
  p.add_argument("--config", type=json.loads, default=None,
                 help="JSON object of the implementation's config fields, set in both trees")
  p.add_argument("--rounds", type=int, default=specs.ROUNDS, help="rounds per program, alternating")
  p.add_argument("--round-ms", type=float, default=specs.ROUND_S * 1e3,
                 help="back-to-back calls per round to fill this long")
  p.add_argument("--warm-ms", type=float, default=specs.WARM_S * 1e3,
                 help="sustained calls through both programs before the timed rounds")
  p.add_argument("--tiny", action="store_true", help="one tiny interpreted cell (tests)")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT))
  p.add_argument("--name", default=f"ab_kernels_{common.device_tag()}")
  args = p.parse_args(argv)
  trees = {"this": TREE, "base": args.base.resolve()}
  cases = select_cases(args.cells, args.tiny)
  implementation = None if args.implementation == "auto" else args.implementation
  loaded = {label: load_tree(tree) for label, tree in trees.items()}
  modes = args.modes.split(",")
  if unknown := set(modes) - set(specs.MODES):
    raise ValueError(f"--modes: unknown {sorted(unknown)}; known: {specs.MODES}")
  rows = []
  for case in cases:
    inputs = cell_inputs(case)
    for mode in modes:
      fns = {label: programs(loaded[label], case, mode, inputs, implementation,
                             args.config)
             for label in trees}
      times = common.time_alternating(
          {label: (fn, (inputs,), common.block) for label, fn in fns.items()},
          rounds=args.rounds, round_s=args.round_ms / 1e3, warm_s=args.warm_ms / 1e3)
      flops = case.flops(mode)
      row = {"case": case.name, "key": case.key(), "mode": mode, "rounds": args.rounds,
             "implementation": args.implementation, "config": args.config}
      failed = {label: t["error"] for label, t in times.items() if "error" in t}
      if failed:
        raise RuntimeError(f"{case.name} {mode}: timing failed: {failed}")
      median = {label: t["median_s"] for label, t in times.items()}
      for label, t in median.items():
        row[label] = round(flops / t / 1e12, 1)
        row[f"{label}_ms"] = round(t * 1e3, 4)
      row["this_over_base"] = round(median["base"] / median["this"], 4)   # speed ratio
      common.log(str(row))
      rows.append(row)
  path = common.write_result(args.name, vars(args), rows,
                             extra={"trees": {label: str(tree) for label, tree in trees.items()}},
                             out_dir=args.out_dir)
  common.log(f"wrote {path}")


if __name__ == "__main__":
  main()
