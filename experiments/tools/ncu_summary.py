"""The figures a kernel's limit is read from, out of an `ncu --page raw --csv` export.

  python -m experiments.tools.ncu_summary ncu_fwd_d64_raw.csv[.gz]

For each kernel (name and launch shape, registers and shared memory: Mosaic GPU names
every kernel alike), its last
launch (the warm one when the profiled program repeats its steps): time, launch shape, registers and shared memory, how busy the SM, its issue
slots and memory are, the busiest pipes (tensor = warpgroup matrix products, xu = the
multi-function unit that runs exp2, fma/alu = the float and integer pipes), and where
warps wait (stall reasons per issued instruction).
"""
from __future__ import annotations

import csv
import gzip
import sys

HEAD = {  # column -> label, printed when present
    "gpu__time_duration.sum": "time",
    "launch__grid_size": "blocks",
    "launch__block_size": "threads/block",
    "launch__registers_per_thread": "regs/thread",
    "launch__shared_mem_per_block_dynamic": "dyn smem/block",
    "launch__occupancy_limit_registers": "blocks/SM by regs",
    "launch__occupancy_limit_shared_mem": "blocks/SM by smem",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "SM throughput %",
    "sm__instruction_throughput.avg.pct_of_peak_sustained_active": "SM instr throughput %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue slots busy %",
    "sm__inst_executed.avg.per_cycle_active": "IPC",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": "memory throughput %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1/shared %",
}


def _num(s):
  try:
    return float(s.replace(",", ""))
  except (AttributeError, ValueError):
    return None


def summarize(path):
  with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", newline="") as f:
    rows = [r for r in csv.reader(f) if r and not r[0].startswith("==")]
  header, units, data = rows[0], rows[1], rows[2:]
  col = {h: i for i, h in enumerate(header)}
  last = {}
  for r in data:
    key = tuple(r[col[c]] for c in ("Kernel Name", "Grid Size", "Block Size",
                                    "launch__registers_per_thread",
                                    "launch__shared_mem_per_block_dynamic") if c in col)
    last[key] = r
  for key, r in last.items():
    print(f"\n### {key[0][:100]} {' '.join(key[1:])}")
    for c, label in HEAD.items():
      if c in col:
        print(f"  {label:<24}{r[col[c]]} {units[col[c]]}")
    pipes = [(h, _num(r[i])) for h, i in col.items()
             if ("pipe" in h and "pct_of_peak" in h and _num(r[i]) is not None)]
    print("  busiest pipes (% of peak, active cycles):")
    for h, v in sorted(pipes, key=lambda x: -x[1])[:12]:
      print(f"    {v:7.2f}  {h}")
    stalls = [(h, _num(r[i])) for h, i in col.items()
              if "issue_stalled" in h and h.endswith("per_warp_active.pct") and _num(r[i])]
    if not stalls:
      stalls = [(h, _num(r[i])) for h, i in col.items()
                if "issue_stalled" in h and "ratio" in h and _num(r[i])]
    print("  warp stalls (top):")
    for h, v in sorted(stalls, key=lambda x: -x[1])[:10]:
      print(f"    {v:9.3f}  {h}")


if __name__ == "__main__":
  for p in sys.argv[1:]:
    summarize(p)
