"""Block sweep: jflash's Pallas tile candidates per (head_dim, causal, kernel).

Each candidate sets one kernel's tile fields (specs.SWEPT_FIELDS) and keeps the others at
jflash's table; the forward is timed as "fwd", the dK/dV and dQ kernels as "bwd" (the
pullback alone). Every candidate goes through the runner: checked, and then the checked
candidates of one (case, kernel) timed together (`Runner.time_rows`).
"""
from __future__ import annotations

import time

from experiments import common
from experiments.bench import specs
from experiments.bench.peers import default_tiles, jflash_peer
from experiments.bench.runner import Runner


def candidate_tiles(pass_: str, cand, head_dim: int) -> dict:
  """All tile fields for one candidate: the swept kernel's from `cand`, the others at
  jflash's table."""
  fields = default_tiles(head_dim)
  fields.update(zip(specs.SWEPT_FIELDS[pass_], cand))
  return fields


def fmt_swept(swept) -> str:
  if swept == "default":
    return "default (jflash's table)"
  return "dict(" + ", ".join(f"{k}={v}" for k, v in swept.items()) + ")"


def run_sweep(runner: Runner, impl: str, cases, passes, budget_s: float,
              smoke: bool = False) -> tuple[list, dict]:
  """(rows, best per "d=.. causal=.. pass") over `cases` (specs.Case). Each (case, pass)
  gets an even share of what is left of `budget_s`, so a slow one cuts its own least
  promising candidates rather than the later ones."""
  rows, best = [], {}
  slots_left = len(cases) * len(passes)
  end = time.perf_counter() + budget_s
  common.log(f"block sweep of jflash {impl!r} over {[c.key() for c in cases]} "
             f"(budget {budget_s:.0f}s)")
  for case in cases:
    s, d, causal = case.s, case.d, case.causal
    for pass_ in passes:
      cands = specs.SMOKE_SWEEP_CANDIDATES if smoke else specs.SWEEP_CANDIDATES[pass_][d]
      mode = "fwd" if pass_ == "fwd" else "bwd"
      ref = runner.reference(case, mode)
      slot_end = time.perf_counter() + max(0.0, end - time.perf_counter()) / slots_left
      slots_left -= 1
      slot, checked = [], []
      for i, cand in enumerate((None,) + tuple(cands)):  # None: jflash's own table
        tiles = None if cand is None else candidate_tiles(pass_, cand, d)
        swept = "default" if cand is None else dict(zip(specs.SWEPT_FIELDS[pass_], cand))
        extra = dict(pass_=pass_, swept=swept, block_sizes=tiles or "default")
        if cand is not None and time.perf_counter() > slot_end:
          slot.append(dict(impl="jflash", implementation=impl, key=case.key(), s=s, d=d,
                           causal=causal, mode=mode, status="skipped", tflops=None, ms=None,
                           error=f"share of the sweep budget ({budget_s:.0f} s) spent", **extra))
          continue
        peer = jflash_peer(impl, tag=f"{pass_}{i}", tiles=tiles)
        row, got = runner.check_one(peer, case, mode, ref)
        row.update(extra)
        slot.append(row)
        if got is not None:
          checked.append((row, got))
      runner.time_rows(case, checked)   # the slot's candidates timed together
      for row in slot:
        common.log(f"sweep {case.key()} {pass_:3s} {fmt_swept(row['swept'])}: {row['status']}")
      rows += slot
      ok = [r for r in slot if r["ms"] is not None]
      if ok:
        b = min(ok, key=lambda r: r["ms"])
        default = next((r for r in ok if r["block_sizes"] == "default"), None)
        best[f"d={d} causal={causal} {pass_}"] = dict(
            d=d, causal=causal, pass_=pass_, swept=b["swept"], block_sizes=b["block_sizes"],
            ms=b["ms"], tflops=b["tflops"], default_ms=default and default["ms"],
            speedup_over_default=default and default["ms"] / b["ms"])
    runner.forget(case)
  return rows, best


def print_best(best: dict):
  print("\nBest jflash tiles per (head_dim, causal, pass); paste into pallas_kernels/tuning.py:")
  for v in best.values():
    vs = "" if not v["default_ms"] else f", {v['speedup_over_default']:.2f}x the default"
    print(f"  ({v['d']}, {v['causal']}, {v['pass_']!r}): {fmt_swept(v['swept'])},"
          f"  # {v['ms']:.3f} ms, {v['tflops']:.1f} TF/s{vs}", flush=True)
