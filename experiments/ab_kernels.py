"""Two trees' Triton kernels timed against each other in one process.

A "not slower" check between two benchmark runs mixes a kernel change with the spread
of the runs (clocks, the machine lent). Here the `pallas_kernels` package of another
tree (e.g. `git worktree add /tmp/base <commit>`) and this tree's are imported side by
side and timed on the FA-2 quick cells in alternating rounds, so both see the same
machine at the same time. TF/s (FLOPs as in the benchmark), the median of the rounds.

  python -m experiments.ab_kernels /tmp/base --out-dir experiments/results --name ab_fa2_h200
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import common
from experiments.bench import specs

TREE = Path(__file__).resolve().parent.parent


def _package_modules() -> list[str]:
  return [m for m in sys.modules if m.split(".")[0] == "pallas_kernels"]


@contextlib.contextmanager
def package(modules: dict):
  """`sys.modules` with `modules` as the `pallas_kernels` package, and the process's
  own put back after. Tracing needs it, not only importing: the kernels import some
  helpers when they are traced (`masking.tile_scores` takes `common`'s then), and those
  must come from the same tree."""
  saved = {name: sys.modules.pop(name) for name in _package_modules()}
  sys.modules.update(modules)
  try:
    yield
  finally:
    for name in _package_modules():
      del sys.modules[name]
    sys.modules.update(saved)


def load_kernels(tree: Path):
  """(flash_forward, flash_backward, modules) of the `pallas_kernels` package under
  `tree`, imported apart from the process's own (`package`)."""
  with package({}):
    sys.path.insert(0, str(tree))
    try:
      fwd = importlib.import_module("pallas_kernels.forward")
      bwd = importlib.import_module("pallas_kernels.backward")
    finally:
      sys.path.pop(0)
    modules = {name: sys.modules[name] for name in _package_modules()}
  if not Path(fwd.__file__).resolve().is_relative_to(tree):
    raise ValueError(f"{tree} has no pallas_kernels package (imported {fwd.__file__})")
  return fwd.flash_forward, bwd.flash_backward, modules


def programs(kernels, case, mode, inputs):
  """One tree's program for `mode`, traced and compiled under that tree's package."""
  ff, fb, modules = kernels
  kw = dict(scale=case.scale, is_causal=case.causal)

  def fwd(q, k, v, do):
    return ff(q, k, v, **kw)[0]

  def fwd_bwd(q, k, v, do):
    out, lse = ff(q, k, v, **kw)
    return fb(q, k, v, out, lse, do, **kw)
  with package(modules):
    return jax.jit(fwd if mode == "fwd" else fwd_bwd).lower(*inputs).compile()


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("base", type=Path, help="the other tree (holding pallas_kernels/)")
  p.add_argument("--rounds", type=int, default=7, help="rounds per program, alternating")
  p.add_argument("--round-ms", type=float, default=specs.ROUND_S * 1e3,
                 help="back-to-back calls per round to fill this long")
  p.add_argument("--tiny", action="store_true", help="one tiny interpreted cell (tests)")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT))
  p.add_argument("--name", default=f"ab_kernels_{common.device_tag()}")
  args = p.parse_args(argv)
  trees = {"this": TREE, "base": args.base.resolve()}
  kernels = {label: load_kernels(tree) for label, tree in trees.items()}
  cases = ((specs.Case(128, 32, True, 1, 2, name="tiny causal"),) if args.tiny
           else specs.FA2_QUICK)
  rows = []
  for case in cases:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, do = (jax.random.normal(key, (case.batch, case.s, case.heads, case.d), jnp.bfloat16)
             for key in keys[:2])
    k, v = (jax.random.normal(key, (case.batch, case.s, case.k_heads, case.d), jnp.bfloat16)
            for key in keys[2:])
    inputs = (q, k, v, do)
    for mode in specs.MODES:
      fns = {label: programs(kernels[label], case, mode, inputs) for label in trees}
      seconds = {label: [] for label in fns}
      # Alternating which goes first; each round starts with one untimed call.
      for r in range(args.rounds):
        for label in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
          seconds[label].append(common.time_calls(
              fns[label], (inputs,), rounds=1, round_s=args.round_ms / 1e3)["median_s"])
      flops = case.flops(mode)
      row = {"case": case.name, "key": case.key(), "mode": mode, "rounds": args.rounds}
      median = {label: statistics.median(ts) for label, ts in seconds.items()}
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
