"""Do two trees compile the same Mosaic GPU kernels? Answered on a CPU, without a GPU.

A timing that moves between two runs is either the kernels or the runs. Here each tree's
forward and backward are lowered for CUDA (`lower(lowering_platforms=("cuda",))` runs on
any machine) for each cell, at the configs jflash's adapter takes for the call
(`jflash.mosaic_impl.kernel_config` and `backward_config`, and which backward
`backward_kind` picks), each tree in a process of its own (`PYTHONPATH` set to it), and
each Mosaic GPU module (the custom calls carry them as MLIR bytecode) is printed and
compared as text: a kernel printed the same compiles to the same code; for one that
differs, the lines that differ (SSA names replaced, to line them up) are counted and the
first shown.

  python -m experiments.tools.compare_lowered /tmp/base --seq 16384 --head-dim 128 --heads 16
  python -m experiments.tools.compare_lowered /tmp/base --defaults   # the benchmark's cells
"""
from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

TREE = Path(__file__).resolve().parents[2]
# The printing helpers beside this file, loaded by path: the process `lowered_in`
# starts imports the other tree's packages, which may not hold them.
_spec = importlib.util.spec_from_file_location("lowered", Path(__file__).with_name("lowered.py"))
lowered = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lowered)
mosaic_modules, normalized = lowered.mosaic_modules, lowered.normalized
# (batch, seq, heads, key heads, head_dim): the benchmark's Hopper cells (16K d=128, 4K
# d=64, 4K d=256), GQA 32/8 8K and MQA 16/1 16K, each causal and not.
DEFAULT_CELLS = tuple((*shape, causal) for shape in (
    (1, 16384, 16, 16, 128), (4, 4096, 32, 32, 64), (4, 4096, 8, 8, 256),
    (2, 8192, 32, 8, 128), (1, 16384, 16, 1, 128)) for causal in (False, True))
NUM_SMS = 132            # an H100's or H200's multiprocessors: the persistent grids' size


def lowered_kernels(B, T, N, K, H, causal, num_sms=NUM_SMS) -> dict:
  """{"forward": [...], "backward": [...], "backward_kind": ...}: the printed Mosaic GPU
  modules of one call through this process's jflash adapter (the Mosaic GPU backward's
  modules whichever backward `backward_kind` picks)."""
  import functools

  import jax
  import jax.numpy as jnp

  import jflash
  from jflash import mosaic_impl
  from jflash.masks import kernel_records
  from pallas_kernels.mosaic_gpu import backward, forward
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  cfg, masks = jflash.prepare(q, kv, kv, is_causal=causal)
  opts, _ = kernel_records(masks, B=B, T=T, S=T)
  fwd_config = mosaic_impl.kernel_config(q, cfg, masks)
  bwd_config = mosaic_impl.backward_config(q, kv, cfg, masks)
  fwd = functools.partial(forward.flash_forward, scale=cfg.scale, opts=opts,
                          config=fwd_config, num_sms=num_sms)
  bwd = functools.partial(backward.flash_backward, scale=cfg.scale, opts=opts,
                          config=bwd_config, num_sms=num_sms)
  lower = lambda f, *args: jax.jit(f).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  return {"forward": mosaic_modules(lower(fwd, q, kv, kv)),
          "backward": mosaic_modules(lower(bwd, q, kv, kv, q, lse, q)),
          "backward_kind": mosaic_impl.backward_kind(q, kv, cfg, masks, num_sms=num_sms)}


def lowered_in(tree: Path, cells) -> list[dict]:
  """`lowered_kernels` of each cell, computed by a process whose packages are `tree`'s."""
  env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cells)], cwd=tree,
                       env=env, check=True, capture_output=True, text=True)
  return json.loads(out.stdout.splitlines()[-1])


def compare(a: dict, b: dict) -> list[dict]:
  """One row per kernel: equal or not, and the differing lines."""
  rows = []
  for part in ("forward", "backward"):
    if part not in a:
      continue
    if len(a[part]) != len(b[part]):
      rows.append(dict(kernel=part, same=False,
                       note=f"{len(a[part])} against {len(b[part])} kernels"))
      continue
    for i, (x, y) in enumerate(zip(a[part], b[part])):
      same = x == y
      x, y = normalized(x), normalized(y)
      changed = [d for d in difflib.unified_diff(x, y, lineterm="", n=0)
                 if d[:1] in "+-" and d[:3] not in ("+++", "---")]
      rows.append(dict(kernel=f"{part} {i}", same=same, lines=[len(x), len(y)],
                       differing_lines=len(changed), first=changed[:4]))
  if "backward_kind" in a:
    rows.append(dict(kernel="backward_kind", same=a["backward_kind"] == b["backward_kind"],
                     kinds=[a["backward_kind"], b["backward_kind"]]))
  return rows


def main(argv=None):
  from experiments import common
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("base", type=Path, help="the other tree (holding jflash/, pallas_kernels/)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seq", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--defaults", action="store_true", help="every cell of DEFAULT_CELLS")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT))
  p.add_argument("--name", default="compare_lowered")
  args = p.parse_args(argv)
  cells = list(DEFAULT_CELLS) if args.defaults else [
      (args.batch, args.seq, args.heads, args.kv_heads or args.heads, args.head_dim,
       args.causal)]
  base, this = (lowered_in(t.resolve(), cells) for t in (args.base, TREE))
  rows = []
  for cell, a, b in zip(cells, base, this):
    name = "B={} T={} N={} K={} H={} causal={}".format(*cell)
    for r in compare(a, b):
      rows.append(dict(cell=name, **r))
      common.log(f"{name} {r['kernel']}: {'same' if r['same'] else 'DIFFERENT'} "
                 f"({r.get('differing_lines', r.get('note', r.get('kinds')))})")
      for line in r.get("first", []):
        common.log(f"    {line[:160]}")
  path = common.write_result(args.name, vars(args), rows,
                             extra={"trees": {"this": str(TREE), "base": str(args.base.resolve())},
                                    "all_same": all(r["same"] for r in rows)},
                             out_dir=args.out_dir)
  common.log(f"wrote {path}")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:       # `lowered_in`'s process, in the other tree
    print(json.dumps([lowered_kernels(*cell) for cell in json.loads(sys.argv[2])]))
  else:
    main()
