"""One forward+backward of the Pallas kernels, for a hardware-counter profiler.

  ncu --clock-control none --kernel-name regex:jflash --launch-skip 3 --launch-count 3 \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      python -m experiments.profile_kernels --seq 4096 --head-dim 64 --causal

Two warm-up steps compile and load the kernels; the third is the one to profile.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jflash


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim (FA-2 grid)")
  p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq (FA-2 grid)")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--steps", type=int, default=3)
  args = p.parse_args(argv)
  B, N = args.tokens // args.seq, args.hidden // args.head_dim
  shape = (B, args.seq, N, args.head_dim)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q, k, v, do = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)

  @jax.jit
  def step(q, k, v, do):
    out, vjp = jax.vjp(lambda q, k, v: jflash.attention(
        q, k, v, is_causal=args.causal, implementation="pallas"), q, k, v)
    return out, vjp(do)

  for _ in range(args.steps):
    jax.block_until_ready(step(q, k, v, do))
  print("done", shape, "causal" if args.causal else "non-causal")


if __name__ == "__main__":
  main()
