"""Do two trees compile the same Mosaic GPU kernels? Answered on a CPU, without a GPU.

A timing that moves between two runs is either the kernels or the runs. Here the
forward and backward of `pallas_kernels.mosaic_gpu` of each tree are lowered for CUDA
(`lower(lowering_platforms=("cuda",))` runs on any machine) for one cell, at the
backward config jflash's adapter takes (`call_config`), and each Mosaic GPU module (the
custom calls carry them as MLIR bytecode) is printed and compared as text: a kernel
printed the same compiles to the same code; for one that differs, the lines that differ
(SSA names replaced, to line them up) are counted and the first shown.

  python -m experiments.tools.compare_lowered /tmp/base --seq 16384 --head-dim 128 --heads 16
"""
from __future__ import annotations

import argparse
import difflib
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from experiments import common
from experiments.tools.ab_kernels import TREE, load_modules, package
from experiments.tools.lowered import mosaic_modules, normalized

KERNELS = ("pallas_kernels.masking", "pallas_kernels.mosaic_gpu.forward",
           "pallas_kernels.mosaic_gpu.backward")


def lowered_kernels(modules: dict, B, T, N, K, H, causal, num_sms=132) -> dict[str, list[str]]:
  """{"forward": [...], "backward": [...]}: the printed Mosaic GPU modules of one call."""
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
  lse = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  with package(modules):
    masking, fwd, bwd = (modules[name] for name in KERNELS)
    opts = masking.MaskOptions(is_causal=causal)
    config = bwd.call_config(q.shape, kv.shape, 2, causal=causal)
    forward = functools.partial(fwd.flash_forward, scale=H ** -0.5, opts=opts,
                                num_sms=num_sms)
    backward = functools.partial(bwd.flash_backward, scale=H ** -0.5, opts=opts,
                                 config=config,
                                 **(dict(num_sms=num_sms) if config.persistent else {}))
    lower = lambda f, *args: jax.jit(f).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    return {"forward": mosaic_modules(lower(forward, q, kv, kv)),
            "backward": mosaic_modules(lower(backward, q, kv, kv, q, lse, q))}


def compare(a: dict, b: dict) -> list[dict]:
  """One row per kernel: equal or not, and the differing lines."""
  rows = []
  for part in a:
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
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("base", type=Path, help="the other tree (holding pallas_kernels/)")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seq", type=int, default=16384)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=None)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--causal", action="store_true")
  p.add_argument("--out-dir", default=str(common.DEFAULT_OUT))
  p.add_argument("--name", default="compare_lowered")
  args = p.parse_args(argv)
  shape = (args.batch, args.seq, args.heads, args.kv_heads or args.heads, args.head_dim,
           args.causal)
  this, base = (lowered_kernels(load_modules(t.resolve(), KERNELS), *shape)
                for t in (TREE, args.base))
  rows = compare(base, this)
  for r in rows:
    common.log(f"{r['kernel']}: {'same' if r['same'] else 'DIFFERENT'} "
               f"({r.get('differing_lines', r.get('note'))})")
    for line in r.get("first", []):
      common.log(f"    {line[:160]}")
  path = common.write_result(args.name, vars(args), rows,
                             extra={"trees": {"this": str(TREE), "base": str(args.base.resolve())}},
                             out_dir=args.out_dir)
  common.log(f"wrote {path}")


if __name__ == "__main__":
  main()
