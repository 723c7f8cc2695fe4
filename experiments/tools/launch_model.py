"""A model of how a launched causal grid's programs spread over the multiprocessors.

Mosaic GPU reverses a Pallas grid onto CUDA's block indices (the forward's (query
blocks, heads, batch) has batch on x), and blocks start about in linear order, x
fastest; each multiprocessor (one program of the forward at a time: its three
warpgroups fill the register file) starts the next program as its last one ends. A
program costs its visited key tiles plus a fixed `fill` for its loads and store. The
model gives, for an order of the programs:
- how long after the mean work per multiprocessor the launch ends (its imbalance);
- how many (batch, head) pairs each round of `sms` consecutive programs reads (their
  K and V stream through L2 together: fewer pairs, more reuse).
It is a model, not a measurement (docs/notes/mosaic_notes.md, "Launch order of the causal grids",
has the H200's timings beside it).

  python -m experiments.tools.launch_model            # the notes' cells
"""
from __future__ import annotations

import argparse
import heapq


def grid_order(blocks: int, heads: int, batch: int):
  """(level, head, batch) in the order the hardware starts a launched causal grid:
  batch fastest, then heads, level (0: the heaviest block) slowest."""
  return [(q, h, b) for q in range(blocks) for h in range(heads) for b in range(batch)]


def head_group_order(blocks: int, heads: int, batch: int, group: int):
  """The launch of the head-group remap measured on the H200 and removed: the program
  at grid position (q, h) took (level, head) from index q + blocks * h, in groups of
  `group` heads, level slowest inside a group."""
  g = min(group, heads)
  out = []
  for q, h, b in grid_order(blocks, heads, batch):
    index = q + blocks * h
    first = index // (blocks * g) * g
    width = min(g, heads - first)
    r = index - first * blocks
    out.append((r // width, first + r % width, b))
  return out


def tile_group_order(blocks: int, heads: int, batch: int, group: int):
  """The persistent grid's `l2_group` order over the launch, from the kernels' own
  `item_coords`: levels in groups of `group`, the level fastest inside a group, then
  heads, then batch."""
  import jax.numpy as jnp
  from pallas_kernels.mosaic_gpu.scheduler import item_coords
  n = blocks * heads * batch
  coords = item_coords(jnp.arange(n, dtype=jnp.int32), (blocks, heads, batch), True, group)
  return list(zip(*(map(int, c) for c in coords)))


def imbalance(order, blocks: int, tiles_per_block: float, fill: float = 3.0,
              sms: int = 132) -> float:
  """When the launch ends, over the mean work per multiprocessor (1.0: perfect)."""
  cost = lambda level: (blocks - level) * tiles_per_block + fill
  ends = [0.0] * sms
  for level, _, _ in order:
    heapq.heappush(ends, heapq.heappop(ends) + cost(level))
  return max(ends) / (sum(cost(level) for level, _, _ in order) / sms)


def pairs_per_round(order, sms: int = 132) -> float:
  """Mean number of (batch, head) pairs in each round of `sms` consecutive programs."""
  rounds = [order[i:i + sms] for i in range(0, len(order), sms)]
  return sum(len({(h, b) for _, h, b in r}) for r in rounds) / (len(order) / sms)


# (name, query blocks, heads, batch, visited key tiles per block step): the forward
# table's causal tiles (4K d64: 256-row blocks over 64-key tiles; 16K d128: 192 rows
# over 128 keys; 4K d256: 128 rows over 64 keys).
CELLS = [("4K d64 causal", 16, 32, 4, 4.0), ("16K d128 causal", 86, 16, 1, 1.5),
         ("4K d256 causal", 32, 8, 4, 2.0)]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sms", type=int, default=132)
  args = p.parse_args(argv)
  for name, blocks, heads, batch, tiles in CELLS:
    orders = {"grid": grid_order(blocks, heads, batch)}
    orders.update({f"heads {g}": head_group_order(blocks, heads, batch, g) for g in (8, 16, 32)})
    orders.update({f"l2_group {g}": tile_group_order(blocks, heads, batch, g)
                   for g in (2, 4, 8)})
    print(name)
    for label, order in orders.items():
      print(f"  {label:12s} ends {imbalance(order, blocks, tiles, sms=args.sms):.3f} x the mean, "
            f"{pairs_per_round(order, args.sms):5.1f} pairs per round")


if __name__ == "__main__":
  main()
