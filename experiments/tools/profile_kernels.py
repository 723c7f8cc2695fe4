"""Steps of one attention call, for a hardware-counter profiler.

  ncu --clock-control none --launch-skip-before-match 0 --csv --page details \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
      --section LaunchStats --section Occupancy \
      python -m experiments.tools.profile_kernels --seq 4096 --head-dim 64 --implementation mosaic_gpu

Shapes follow the FA-2 grid (heads = hidden / head_dim, batch = tokens / seq) unless
--heads / --batch are given. --forward-only profiles the forward alone; otherwise one
jitted vjp (forward, delta, the two backward kernels). --backward picks the backward of
"mosaic_gpu" (MosaicGPUConfig.backward), --config JSON more of its fields. Every
step runs the same kernels: the first compiles, so a profiler that skips the first
step's launches sees warm ones.

Under ncu, run with XLA_PYTHON_CLIENT_PREALLOCATE=false and XLA_PYTHON_CLIENT_ALLOCATOR=
platform: kernel replay saves and restores the memory a kernel may write, which with
JAX's default pool is most of the card, on every pass.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jflash


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq", type=int, default=4096)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--hidden", type=int, default=2048, help="heads = hidden / head_dim (FA-2 grid)")
  p.add_argument("--tokens", type=int, default=16384, help="batch = tokens / seq (FA-2 grid)")
  p.add_argument("--heads", type=int, default=None, help="query heads (overrides --hidden)")
  p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads)")
  p.add_argument("--batch", type=int, default=None, help="overrides --tokens")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--implementation", default="pallas", help="jflash implementation name")
  p.add_argument("--backward", default="auto", choices=("auto", "mosaic_gpu", "pallas"),
                 help='MosaicGPUConfig.backward, for --implementation mosaic_gpu')
  p.add_argument("--config", default=None,
                 help='more MosaicGPUConfig fields as JSON, e.g. \'{"backward_block_n": 128}\'')
  p.add_argument("--forward-only", action="store_true")
  p.add_argument("--steps", type=int, default=3)
  args = p.parse_args(argv)
  N = args.heads or args.hidden // args.head_dim
  K = args.kv_heads or N
  B = args.batch or max(1, args.tokens // args.seq)
  # Inputs made on the host, so that the attention steps are the only kernels launched.
  rng = np.random.default_rng(0)
  q, do = (jnp.asarray(rng.standard_normal((B, args.seq, N, args.head_dim)), jnp.bfloat16)
           for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((B, args.seq, K, args.head_dim)), jnp.bfloat16)
          for _ in range(2))
  if args.config and args.implementation != "mosaic_gpu":
    raise ValueError(f"--config is MosaicGPUConfig's fields: --implementation mosaic_gpu, "
                     f"not {args.implementation!r}")
  config = (jflash.MosaicGPUConfig(backward=args.backward, **json.loads(args.config or "{}"))
            if args.implementation == "mosaic_gpu" else None)

  def attn(q, k, v):
    return jflash.attention(q, k, v, is_causal=args.causal, implementation=args.implementation,
                            config=config)

  if args.forward_only:
    step = jax.jit(attn)
    call = lambda: step(q, k, v)
  else:
    step = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    call = lambda: step(q, k, v, do)
  for _ in range(args.steps):
    jax.block_until_ready(call())
  print("done", (B, args.seq, N, K, args.head_dim), "causal" if args.causal else "non-causal",
        args.implementation, "forward" if args.forward_only else f"fwd+bwd ({args.backward})")


if __name__ == "__main__":
  main()
