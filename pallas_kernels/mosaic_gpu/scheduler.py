"""The work scheduler of the Hopper kernels (FlashAttention-3's tile scheduler): the
order in which a grid's work items go to programs, and the persistent grid's loop
(one program per multiprocessor looping over the items, `persistent_items`).

A work item is a (tile, head, ..., batch) coordinate: a query block of the forward or
the dQ kernel, a key tile of the dK/dV kernel. Items of a causal grid differ in cost, so
their order matters there (`item_coords`, `item_schedule`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax


def check_l2_group(l2_group):
  """ValueError unless l2_group is a positive int. (It orders the work items of a
  grid with a causal mask, `item_coords`.)"""
  if type(l2_group) is not int or l2_group < 1:
    raise ValueError(f"l2_group={l2_group!r} must be a positive int")


def item_schedule(cta, num_items: int, num_ctas: int, snake: bool):
  """(steps, item(k)): the number of work items of program `cta` of a persistent grid
  of num_ctas programs (the forward's and both backward kernels'; num_ctas <=
  num_items, so steps >= 1) and its k-th item: round k of num_ctas items gives it item
  k * num_ctas + cta. `snake`: odd rounds go backwards (item k * num_ctas + num_ctas -
  1 - cta). With items in falling cost (a causal grid's, `item_coords`) the plain
  order hands program 0 the heaviest item of every round, and the programs' sums drift
  apart round by round: in the backward on 132 multiprocessors the busiest program has
  6% more work than the mean at 16K d128 causal, 12% at 4 x 4K with 8 heads, and the
  kernel ends with it. The snake order pairs each round's heavier half with the next
  round's lighter half: within 0.3% of the mean in both."""
  rounds, rest = divmod(num_items, num_ctas)
  if not snake:
    return rounds + (cta < rest).astype(jnp.int32), lambda k: k * num_ctas + cta
  backwards = lambda k: lax.rem(k, jnp.int32(2)) == 1
  item = lambda k: k * num_ctas + jnp.where(backwards(k), num_ctas - 1 - cta, cta)
  return rounds + (item(jnp.int32(rounds)) < num_items).astype(jnp.int32), item


class Step(NamedTuple):
  """An item's place in its persistent program: the k-th of the program's items, and
  whether the program has another (`has_next`) and which (`next_item`; past the last,
  an index nothing may load from)."""
  k: object
  has_next: object
  next_item: object


def persistent_items(num_items: int, num_ctas: int, item, snake: bool = False):
  """The persistent grid's loop (the forward's and both backward kernels'): this
  program (axis "sm") runs its work items (`item_schedule`) as item(w, count, step) ->
  count, the count (of tiles streamed through its slots) going on from one item to the
  next from 0, `step` the item's `Step`; returns the last count. Every item goes
  through one traced body: a first item traced on its own would be a second copy of
  the kernel's code for ptxas to compile (seconds of a call's first compile)."""
  steps, item_index = item_schedule(lax.axis_index("sm"), num_items, num_ctas, snake)
  return lax.fori_loop(
      0, steps,
      lambda k, count: item(item_index(k), count, Step(k, k + 1 < steps, item_index(k + 1))),
      jnp.int32(0))


def item_coords(w, sizes, causal: bool, l2_group: int = 1):
  """The grid coordinates of work item w of a persistent program (the forward's and
  both backward kernels'), over a grid of `sizes` (tiles, then heads, ..., batch).
  Without a causal mask the tiles are the fastest axis: programs running at once read
  the same head's streamed tiles (shared through L2). With one, items differ in cost
  (a key tile's work falls with its index, a query block's rises), so the tiles are
  the slowest axis, taken heaviest first (key tiles ascending, query blocks through
  `query_block_order`), and `item_schedule`'s snake rounds balance the programs: with
  the tiles fastest one program would take the heaviest tile of every head and another
  the lightest. `l2_group` (causal only): the tiles go in groups of that many
  consecutive ones, the fastest axis inside a group (Triton's grouped ordering for L2
  reuse, its matmul tutorial), so that programs running at once share each head's
  streamed tiles l2_group ways, where with groups of one a round of 132 programs can
  stream as many (batch, head) pairs' tiles (at 4K d64 causal 128 pairs' K and V,
  1 MiB each, where L2 holds 50 MiB). A round's items then span l2_group tiles and
  no longer cost alike, which the snake balances less well (the busiest of 132
  programs 3% over the mean work of the 4K d64 dK/dV grid, against 0.2% in groups of
  one)."""
  order = list(range(1, len(sizes))) + [0] if causal else list(range(len(sizes)))
  coords = [None] * len(sizes)
  g = min(l2_group, sizes[0]) if causal else 1   # a group wider than the tiles: all
  if g > 1:          # the tile inside its group first; the other axes as without groups
    tiles, rest = sizes[0], math.prod(sizes[1:])
    first = lax.div(w, jnp.int32(g * rest)) * g           # the group's first tile
    width = jnp.minimum(jnp.int32(g), tiles - first)      # the last group may be narrower
    r = w - first * rest
    coords[0], w = first + lax.rem(r, width), lax.div(r, width)
    order = order[:-1]
  for axis in order[:-1]:
    coords[axis] = lax.rem(w, jnp.int32(sizes[axis]))
    w = lax.div(w, jnp.int32(sizes[axis]))
  coords[order[-1]] = w
  return tuple(coords)


class PersistentGrid(NamedTuple):
  """A kernel's persistent launch: `programs` programs looping over the `items` work
  items of the grid of `sizes` they stand for, in `item_coords`'s order with `l2_group`."""
  items: int
  programs: int
  sizes: tuple
  l2_group: int


def counted_from(count):
  """t -> the program's count of streamed tiles at an item's t-th: t itself in a
  program of one item (no index arithmetic added to a launched grid's program), count
  + t in a persistent one."""
  return (lambda t: t) if count is None else (lambda t: count + t)


def count_after(count, tiles):
  """The count after an item of `tiles` streamed tiles (persistent), or None in a
  program of one item, which computes nothing for it."""
  return None if count is None else count + tiles()
