"""What ptxas made of each Mosaic GPU kernel, out of a `MOSAIC_GPU_DUMP_TO` directory.

  MOSAIC_GPU_DUMP_TO=DIR python -m experiments.tools.profile_kernels ...   # on the GPU
  python -m experiments.tools.sass_summary DIR

Per dumped module: ptxas's log (registers at entry, spill bytes, and its warnings: C7512
"wgmma.mma_async instructions are serialized due to insufficient register resources"
says a warpgroup's live values did not fit the registers `setmaxnreg` gave it; C7508
would say setmaxnreg was ignored), the PTX's launch directives and `setmaxnreg`
counts, and, where the SASS was written (by Mosaic GPU with nvdisasm on the path, or by
profile_h200.sh through the toolkit's ptxas and cuobjdump), its register reallocations
(`USETMAXREG`) and local-memory traffic (`LDL`/`STL`).
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

# SASS opcodes worth counting: register reallocation and local memory (spill) traffic.
OPCODES = ("USETMAXREG", "LDL", "STL", "HGMMA", "WARPGROUP.ARRIVE", "MUFU.EX2")


def opcode_counts(sass: str) -> dict[str, int]:
  counts = collections.Counter()
  for line in sass.splitlines():
    m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if not m:
      continue
    op = m.group(1)
    for want in OPCODES:
      if op == want or op.startswith(want + "."):
        counts[want] += 1
  return {op: counts.get(op, 0) for op in OPCODES}


def setmaxreg_lines(sass: str) -> list[str]:
  return [" ".join(l.split("*/", 1)[-1].split()) for l in sass.splitlines() if "USETMAXREG" in l]


def summarize(directory: pathlib.Path) -> None:
  bases = sorted({f.with_suffix("") for ext in ("sass", "ptxas", "ptx")
                  for f in directory.rglob(f"*.{ext}")})
  if not bases:
    print(f"{directory}: nothing dumped (was MOSAIC_GPU_DUMP_TO an existing directory?)")
  for base in bases:
    print(f"### {base.name}")
    sass = base.with_suffix(".sass")
    if sass.exists():      # nvdisasm beside ptxas, or profile_h200.sh's cuobjdump
      text = sass.read_text(errors="replace")
      print("  SASS opcodes:", opcode_counts(text))
      for line in setmaxreg_lines(text)[:8]:
        print("   ", line)
    log = base.with_suffix(".ptxas")
    if log.exists():
      for line in log.read_text(errors="replace").splitlines():
        if line.strip():
          print("  ptxas log:", line.strip()[:300])
    ptx = base.with_suffix(".ptx")
    if ptx.exists():
      text = ptx.read_text(errors="replace")
      directives = sorted(set(re.findall(r"\.(?:maxntid|reqntid|minnctapersm|maxnreg)[^\n]*", text)))
      print("  PTX directives:", directives, "| setmaxnreg:",
            sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32 \d+", text))))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("dirs", nargs="+", type=pathlib.Path)
  args = p.parse_args(argv)
  for d in args.dirs:
    summarize(d)
  sys.stdout.flush()


if __name__ == "__main__":
  main()
