"""Tables, targets and JSON of the benchmarks: everything a run prints and saves."""
from __future__ import annotations

import json
from pathlib import Path

from experiments import common
from experiments.bench import specs

STATUS_TEXT = {"wrong": "WRONG", "skipped": "skip", "error": "err", "unavailable": "n/a",
               "unchecked": "?"}


def by_cell(rows) -> dict:
  """{(case key, mode): {peer label: row}}, in the order the rows came."""
  cells = {}
  for r in rows:
    cells.setdefault((r["key"], r["mode"]), {})[r.get("peer", r["impl"])] = r
  return cells


def _tf(r) -> str:
  if r is None:
    return "-"
  if r.get("tflops") is not None:
    return f"{r['tflops']:.1f}"
  return STATUS_TEXT.get(r["status"], "?")


def print_tables(rows, labels):
  cells = by_cell(rows)
  w = {n: max(8, len(n)) + 2 for n in labels}
  kw = max([len(k) for k, _ in cells] + [4])
  dtypes = ",".join(sorted({r["dtype"] for r in rows if r.get("dtype")}))
  print(f"\nTF/s ({dtypes}; jax_mgpu fp16). "
        f"err/WRONG/skip/n/a: see the JSON rows' 'error'.", flush=True)
  print(f"{'case':{kw}} {'mode':>8} " + "".join(f"{n:>{w[n]}}" for n in labels))
  for (key, mode), c in cells.items():
    print(f"{key:{kw}} {mode:>8} " + "".join(f"{_tf(c.get(n)):>{w[n]}}" for n in labels))
  ours = [n for n in labels if n.startswith("jflash:")]
  others = [n for n in labels if not n.startswith("jflash:")]
  for j in ours:
    if not others:
      break
    print(f"\njflash / peer: {j} (TF/s ratio; > 1 means jflash is faster)")
    print(f"{'case':{kw}} {'mode':>8} " + "".join(f"{n:>{w[n]}}" for n in others))
    for (key, mode), c in cells.items():
      a = c.get(j)
      line = f"{key:{kw}} {mode:>8} "
      for n in others:
        b = c.get(n)
        ok = a and b and a["tflops"] and b["tflops"]
        line += f"{a['tflops'] / b['tflops']:>{w[n]}.2f}" if ok else f"{'-':>{w[n]}}"
      print(line, flush=True)


def print_summary(rows, labels, resolved=None):
  """The short table, one line per case: per peer TF/s of fwd and fwd+bwd, the first
  call of fwd+bwd in seconds (compile included) and its compiled temporaries in MiB;
  then what implementation=None resolves to."""
  cases = {}
  for r in rows:
    cases.setdefault((r["key"], r.get("case") or r["key"]), {})[
        (r.get("peer", r["impl"]), r["mode"])] = r
  labels = [n for n in labels if any((n, m) in c for c in cases.values() for m in specs.MODES)]
  kw = max([len(name) for _, name in cases] + [4])

  def cell(f, b):
    first = b and b.get("first_call_s")
    temp = b and b.get("temp_mib")
    return (f"{_tf(f):>6} {_tf(b):>6} {'-' if first is None else f'{first:.1f}':>5}"
            f" {'-' if temp is None else f'{temp:.0f}':>5}")
  print("\nSummary per peer: TF/s fwd, fwd+bwd | first call of fwd+bwd (s) | its temp (MiB)",
        flush=True)
  print(f"{'case':{kw}} " + " | ".join(f"{n[:26]:^26}" for n in labels) + " | None ->")
  for (key, name), c in cases.items():
    line = " | ".join(cell(c.get((n, "fwd")), c.get((n, "fwd+bwd"))) for n in labels)
    print(f"{name:{kw}} {line} | {(resolved or {}).get(key, '-')}", flush=True)


def memory_summary(mem_rows) -> dict:
  """jflash's temp bytes over JAX Pallas mha's, per seq."""
  by = {(r["impl"], r["s"]): r.get("temp_size_in_bytes") for r in mem_rows}
  return {"jflash_over_jax_pallas_mha": {
      str(s): b / by[("jax_pallas_mha", s)] for (impl, s), b in by.items()
      if impl == "jflash" and b is not None and by.get(("jax_pallas_mha", s))}}


def print_memory(mem_rows):
  seqs = sorted({r["s"] for r in mem_rows})
  labels = list(dict.fromkeys(r["peer"] for r in mem_rows))
  by = {(r["peer"], r["s"]): r for r in mem_rows}
  print("\nCompiled temp memory of fwd+bwd, MiB (batch 1)", flush=True)
  print(f"{'s':>6} " + "".join(f"{n:>20}" for n in labels))
  for s in seqs:
    vals = [by.get((n, s), {}).get("temp_mib") for n in labels]
    print(f"{s:>6} " + "".join(f"{'err' if v is None else f'{v:.1f}':>20}" for v in vals),
          flush=True)


# -- targets ------------------------------------------------------------------------------

def _baseline_index(baseline_rows):
  """Old rows by (s, d, causal, mode, implementation); rows without one were "pallas"."""
  return {(r["s"], r["d"], r["causal"], r["mode"], r.get("implementation", "pallas")): r
          for r in baseline_rows or () if r["impl"] == "jflash"}


def round_ratios(mine, peer) -> list[float] | None:
  """jflash's speed over the peer's round by round, where both were timed in the same
  alternating rounds (`experiments.common.time_alternating`): the spread of the ratio
  within one run."""
  mine, peer = mine or {}, peer or {}
  a, b = mine.get("ms_by_round"), peer.get("ms_by_round")
  if not a or not b or mine.get("timing_group") != peer.get("timing_group"):
    return None
  return [round(y / x, 4) for x, y in zip(a, b)]


def evaluate_targets(rows, resolved=None, mem_summary=None, baseline_rows=None) -> list[dict]:
  """Every target of specs.TARGETS whose jflash row this run has, with met True/False (or
  None when the row or what it is compared with is missing or failed)."""
  idx = {(r.get("peer", r["impl"]), r["key"], r["mode"]): r for r in rows}
  base = _baseline_index(baseline_rows)
  out = []
  for t in specs.TARGETS:
    label = f"jflash:{t.impl}"
    for case in t.cases:
      mine = idx.get((label, case.key(), t.mode))
      if mine is None and t.kind != "resolves":
        continue
      entry = dict(group=t.group, kind=t.kind, case=case.name, key=case.key(), mode=t.mode,
                   impl=t.impl, have=None, need=None, met=None)
      tf = mine and mine.get("tflops")
      if t.kind == "tflops":
        entry.update(target=f">= {t.value:.0f} TF/s", have=tf, need=t.value)
      elif t.kind == "vs_peer":
        p = idx.get((t.peer, case.key(), t.mode))
        entry.update(target=f">= {t.value}x {t.peer}", have=tf,
                     need=p["tflops"] * t.value if p and p.get("tflops") else None)
        ratios = round_ratios(mine, p)
        if ratios:
          entry["round_ratios"] = ratios
      elif t.kind == "vs_case":
        o = idx.get((label, t.other.key(), t.mode))
        entry.update(target=f">= {t.value}x {t.other.name}", have=tf,
                     need=o["tflops"] * t.value if o and o.get("tflops") else None)
      elif t.kind == "vs_baseline":
        o = base.get((case.s, case.d, case.causal, t.mode, t.impl))
        entry.update(target=f">= {t.value}x the baseline run", have=tf,
                     need=o["tflops"] * t.value if o and o.get("tflops") else None)
      elif t.kind == "compile_s":
        entry.update(target=f"first call <= {t.value:.0f} s", have=mine.get("first_call_s"),
                     need=t.value)
      elif t.kind == "temp_vs":
        o = idx.get((label, t.other.key(), t.mode))
        entry.update(target=f"temp <= {t.value}x {t.other.name}", have=mine.get("temp_mib"),
                     need=o["temp_mib"] * t.value if o and o.get("temp_mib") is not None else None)
      elif t.kind == "resolves":
        have = (resolved or {}).get(case.key())
        if have is None:
          continue
        entry.update(target=f"implementation=None -> {t.impl}", have=have, need=t.impl,
                     met=have == t.impl)
      if entry["have"] is not None and entry["need"] is not None and t.kind != "resolves":
        at_most = t.kind in ("compile_s", "temp_vs")
        entry["met"] = entry["have"] <= entry["need"] if at_most else entry["have"] >= entry["need"]
      elif t.kind != "resolves":
        entry["why"] = (mine or {}).get("error") or "a compared row is missing or failed"
      out.append(entry)
  ratio = (mem_summary or {}).get("jflash_over_jax_pallas_mha", {}).get(str(specs.MEMORY_TARGET[0]))
  if ratio is not None:
    out.append(dict(group="fa2_floors", kind="memory", key=f"s={specs.MEMORY_TARGET[0]}",
                    target=f"temp bytes <= {specs.MEMORY_TARGET[1]}x jax_pallas_mha",
                    have=ratio, need=specs.MEMORY_TARGET[1], met=ratio <= specs.MEMORY_TARGET[1]))
  return out


def print_targets(targets):
  if not targets:
    return
  met = {True: "met", False: "MISSED", None: "n/a"}
  print("\nTargets (jflash)", flush=True)
  for t in targets:
    fmt = lambda x: "-" if x is None else (f"{x:.2f}" if isinstance(x, float) else str(x))  # noqa: E731
    rounds = t.get("round_ratios")
    spread = f"  rounds {min(rounds):.3f}-{max(rounds):.3f}" if rounds else ""
    print(f"  {t['group']:18s} {t.get('impl', ''):10s} {t['key']:36s} {t.get('mode', ''):8s}"
          f" {fmt(t['have']):>9} vs {fmt(t['need']):>9}  ({t['target']})  {met[t['met']]}"
          f"{spread}", flush=True)
  counts = {m: sum(t["met"] is v for t in targets) for v, m in met.items()}
  print(f"  {counts['met']} met, {counts['MISSED']} missed, {counts['n/a']} not measurable")


# -- JSON ---------------------------------------------------------------------------------

def _merge(path: Path, rows, row_key):
  """Rows of an earlier run that this run did not redo, kept (a grid split over runs)."""
  if not path.exists():
    return rows
  new = {row_key(r) for r in rows}
  return [r for r in json.loads(path.read_text()).get("rows", []) if row_key(r) not in new] + rows


def row_key(r):
  return (r.get("peer", r["impl"]), r.get("key") or (r["s"], r["d"], r["causal"]), r["mode"],
          r.get("pass_"), str(r.get("swept")))


def save(name, config, rows, out_dir, extra=None, merge=False) -> Path:
  """results JSON: {environment, config, argv, rows, ...extra}; written after every case,
  so a run stopped early still leaves its rows."""
  out_dir = Path(out_dir)
  if merge:
    rows = _merge(out_dir / f"{name}.json", rows, row_key)
  extra = dict(extra or {}, elapsed_s=round(common.elapsed(), 1))
  return common.write_result(name, config, rows, extra=extra, out_dir=out_dir)


def load_rows(paths) -> tuple[list, dict, list]:
  """Rows, "resolved" and "memory" of several result JSONs, later files winning on the
  same row."""
  rows, resolved, memory = [], {}, []
  for p in paths:
    data = json.loads(Path(p).read_text())
    rows = _merge_rows(rows, data.get("rows", []))
    resolved.update(data.get("resolved", {}))
    memory += data.get("memory", [])
  return rows, resolved, memory


def _merge_rows(old, new):
  keys = {row_key(r) for r in new}
  return [r for r in old if row_key(r) not in keys] + new


def jflash_build_info() -> dict:
  """What jflash's Pallas kernels were built with (tile table, exp2 path), where the
  kernel package exposes it; recorded, never required."""
  info = {}
  try:
    from pallas_kernels import common as kernel_common, tuning
    info["jflash_tile_table"] = {str(d): row for d, row in tuning._TABLE.items()}
    info["jflash_fast_exp2"] = kernel_common.fast_exp2_enabled(kernel_common.use_interpret(None))
  except Exception as e:  # the kernel package moved these: say so, run on
    info["jflash_build_info_error"] = f"{type(e).__name__}: {e}"[:300]
  return info
