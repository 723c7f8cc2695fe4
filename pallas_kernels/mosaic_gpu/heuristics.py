"""Which config a call takes: the forward's per-head_dim table and the backward's call
config, each rule with its one-line reason (FlashAttention-3's `tile_size.h` plays this
part). The measurements behind the rules (bf16 on an H200 unless said, fwd+bwd or
forward TF/s against the alternatives in one process) are in docs/notes/mosaic.md; a
rule changes with a new measurement there, not here.

A caller's field always wins over these choices (`jflash.mosaic_impl`); the records
(`configs`) check what a combination may be.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.mosaic_gpu.common import (CUDA_GRID_YZ, MAX_BARRIERS, ROWS, SMEM_BYTES,
                                              check_launch, table_head_dim)
from pallas_kernels.mosaic_gpu.configs import (BackwardConfig, MosaicConfig,
                                               backward_smem_bytes, by_role,
                                               dkv_programs, dq_consumers_of,
                                               loaded_barriers)

# -- the forward ----------------------------------------------------------------------------

# Per (tier head_dim, causal):
# - persistent without a causal mask (items cost alike: the next item's loads run under
#   this item's last tiles, and no partial last wave); launched with one (items differ up
#   to T / (2 block_q) times, and the hardware's block scheduler over a heaviest-first
#   grid balances them better than a static split);
# - key tiles of 128 up to d = 128 (64 slower, 192 level at best); 64 at d = 256, where a
#   128-row K and V slot pair alone would take 128 KiB of the 227 KiB;
# - three unsynchronised consumers up to d = 128 (more warps to hide the softmax's
#   latencies); two ping-ponged at d = 256, where three do not fit 128 registers a thread;
# - with a causal mask each consumer on its own rows' key tiles (`consumer_ranges`): a
#   program's earlier consumers otherwise compute the diagonal's tiles fully masked.
TABLE = {(64, False): MosaicConfig(64, 128, 2, persistent=True, consumers=3),
         (64, True): MosaicConfig(64, 128, 2, consumers=3, consumer_ranges=True),
         (128, False): MosaicConfig(64, 128, 2, persistent=True, consumers=3),
         (128, True): MosaicConfig(64, 128, 2, consumers=3, consumer_ranges=True),
         (256, False): MosaicConfig(64, 64, 2, persistent=True),
         (256, True): MosaicConfig(64, 64, 2)}

# Below this many query rows three consumers give way to two: two 192-row programs
# would be half padding at 197 rows (ViT-B/16), where two 128-row ones are a quarter.
# From 512 rows three ran ahead on an H100 in every cell timed on the table's tiles,
# their programs' extra padded rows included (512 and 576 at d = 64, 1K at d = 64, 1K
# at d = 128 causal and not); d = 64 causal, where they did not, keeps its entry below.
THREE_CONSUMERS_MIN_SEQ = 512
# Tiers with their own two-consumer entry, used below their own length: at d = 64
# causal two consumers of 128 rows on 64-key tiles (twice the rows per barrier round
# trip, the same 64 x 64 S tile in registers), level with or ahead of three at 1K and 4K.
TWO_CONSUMER_ENTRIES = {(64, True): (MosaicConfig(128, 64, 2, consumer_ranges=True), 2048)}
# Each P V issued back to back with the next tile's S (`scores_ahead`) where the products
# dominate a tile (d = 256: the tensor cores otherwise idle through each wait for P V);
# slower where the softmax is as long as the products (d <= 192).
SCORES_AHEAD_HEAD_DIMS = (256,)
# O rescaled only where a row's max moved (`lazy_rescale`) at the tiers whose
# [64, head_dim] rescale is long (128, 256); at 64 the vote it waits on holds the
# ping-pong's arrive behind the softmax, and the multiplies it skips are off the
# critical path.
LAZY_RESCALE_TABLE_DIMS = (128, 256)


def default_config(head_dim: int, causal: bool = False, seq_q: int | None = None) -> MosaicConfig:
  """The forward's config for (head_dim, causal): TABLE's entry of its tier
  (`table_head_dim`), with two consumers in place of three below THREE_CONSUMERS_MIN_SEQ
  query rows (TWO_CONSUMER_ENTRIES' tiles, below their own length, where the tier has
  one), `scores_ahead` at SCORES_AHEAD_HEAD_DIMS and `lazy_rescale` at
  LAZY_RESCALE_TABLE_DIMS' tiers."""
  key = table_head_dim(head_dim), bool(causal)
  config = TABLE[key]
  if config.consumers == 3 and seq_q is not None:
    entry, below = TWO_CONSUMER_ENTRIES.get(key, (None, THREE_CONSUMERS_MIN_SEQ))
    if seq_q < below:
      config = entry or config.with_consumers(2)
  if head_dim in SCORES_AHEAD_HEAD_DIMS:
    config = dataclasses.replace(config, scores_ahead=True)
  if key[0] in LAZY_RESCALE_TABLE_DIMS:
    config = dataclasses.replace(config, lazy_rescale=True)
  return config


def launch_side_by_side(*, causal: bool, persistent: bool, batch: int, heads: int,
                        tiles: int, num_sms: int | None) -> bool:
  """Whether a launched grid of (tiles, heads, batch) (the forward's over query blocks,
  each backward kernel's over its own tiles) is reversed to (batch, heads, tiles), so
  that each (batch, head)'s tiles, heaviest first, launch side by side rather than one
  level (a tile of each pair) at a time. Mosaic GPU maps a grid's last axis to CUDA's
  x (up to 2^31 - 1 blocks) and its first to z (up to CUDA_GRID_YZ), so: where the
  level-by-level grid cannot launch (more than CUDA_GRID_YZ tiles: past 8.4M rows in
  tiles of 128) and the reversed one can (batch <= CUDA_GRID_YZ); and under a causal
  mask where a level-by-level round of num_sms programs would hold a different pair in
  each (batch x heads >= num_sms). Side by side, a pair's programs read its streamed tiles
  through L2 together, where level by level each program of such a round streams its
  own pair's from HBM: at 1K d128 causal (batch 16 x 16 heads, 256 pairs on 132 SMs)
  the forward 346.5 TF/s against 284.2 on an H100 (ab_l2_order_h100.json), the Mosaic
  GPU backward's forward+backward 291.9 against 249.6 (ab_bwd_order_h100.json). With
  fewer pairs a round already holds several tiles of each, and side by side the last
  pairs' heaviest tiles run on after the rest of the launch: forward, 16K d128 causal
  (16 pairs) 582.5 against 635.4, GQA 32/8 8K causal (64) 572.2 against 618.1. A
  persistent grid orders its items itself (`scheduler.item_coords`)."""
  if persistent or batch > CUDA_GRID_YZ:
    return False
  return tiles > CUDA_GRID_YZ or (causal and batch * heads >= num_sms)


def launched_grid(grid, names, *, causal: bool, num_sms: int | None):
  """The launch of a grid of (tiles, heads, batch), as axis sizes and names: reversed
  where `launch_side_by_side`, and within CUDA's limits (`check_launch`)."""
  size = dict(zip(names, grid))
  if launch_side_by_side(causal=causal, persistent=False, batch=size["batch"],
                         heads=size["heads"], tiles=grid[0], num_sms=num_sms):
    grid, names = grid[::-1], names[::-1]
  check_launch(grid, names)
  return grid, names


# -- the backward ---------------------------------------------------------------------------

# A causal dK/dV grid of fewer programs splits its GQA group over more (`group_splits`):
# a causal program's work grows with its key tile's distance from the end, and one wave
# of a few hundred programs lasts as long as the heaviest.
CAUSAL_MIN_PROGRAMS = 512
# Above head_dim 128 the dQ kernel's consumers where they fit shared memory beside key
# tiles of 64 (d <= 224 at two stages): two consumers share one producer's K and V stream
# where one warpgroup loads its tiles between its own products.
DQ_CONSUMERS_ABOVE_128 = 2
# At the 128 tier without a causal mask, three dQ consumers (192 rows read each K and V
# tile once, against 128 for two); with a causal mask two (three were level or slower).
DQ_CONSUMERS_AT_128 = 3
# At head_dim 64: tiles of 128 in both kernels with lse and delta streamed (JAX's Mosaic
# GPU kernel's tiles): twice the rows per tile halve the slot barriers and product waits
# per unit of work, and the 128-row dK/dV tile fits the consumers' 240 registers only
# with lse and delta read from shared memory where used (at d = 128 they lose).
BLOCK_N_AT_64 = 128
# Both kernels' score products issued before the softmax (P's exponentials under dP's
# product) on d = 64's tiles, where the softmax is as long as the products; slower at 128.
P_UNDER_DP = ("dkv_p_under_dp", "dq_p_under_dp")
# A causal persistent grid at d = 64 with this many (batch, key head) pairs or more takes
# its tiles in groups of L2_GROUP per head (Triton's grouped ordering): a round of 132
# programs then shares each head's streamed tiles through L2 instead of streaming 132
# heads'; with fewer pairs a round already holds several items of each.
L2_GROUP, L2_GROUP_MIN_PAIRS = 8, 128


def persistent_wins(*, causal: bool, group: int, head_dim: int) -> bool:
  """Where the backward's persistent grids are the default: one key head per query head
  without a causal mask (items cost alike), and at head_dim 64 groups of up to 4, causal
  or not (short items, whose fixed loads and stores weigh most). With grouped heads at
  d >= 80 a dK/dV item runs the group's heads and long items leave the last round
  uneven; with a causal mask at d >= 80 the hardware's scheduler balances a
  heaviest-first launched grid better."""
  return (not causal and group == 1) or (head_dim == 64 and group <= 4)


def where_it_fits(config: BackwardConfig, head_dim: int, itemsize: int,
                  **changes) -> BackwardConfig:
  """`config` with `changes` where that fits shared memory, else `config`."""
  changed = dataclasses.replace(config, **changes)
  return changed if backward_smem_bytes(head_dim, itemsize, changed) <= SMEM_BYTES else config


def tiles_at_64(config: BackwardConfig, itemsize: int) -> BackwardConfig:
  """`config` with d = 64's default tiles (BLOCK_N_AT_64): both kernels' with lse and
  delta streamed where that form runs (the caller's stages within its "loaded"
  barriers and shared memory), else the dQ kernel's alone."""
  if loaded_barriers(config.stages, stats_streamed=True) <= MAX_BARRIERS:
    streamed = dataclasses.replace(config, block_n=BLOCK_N_AT_64, stats_streamed=True)
    if backward_smem_bytes(64, itemsize, streamed) <= SMEM_BYTES:
      return streamed
  return dataclasses.replace(config, dq_block_n=BLOCK_N_AT_64)


def call_config(q_shape, k_shape, itemsize: int, *, causal: bool, **fields) -> BackwardConfig:
  """The backward's config for a call of q [B, T, N, H] and k [B, S, K, H]: the caller's
  BackwardConfig `fields`, and for every field the caller did not set:
  - at head_dim 64 (unless block_n, dq_block_n or stats_streamed is set): BLOCK_N_AT_64's
    tiles (`tiles_at_64`) and, where both kernels take them, P_UNDER_DP;
  - above head_dim 128: DQ_CONSUMERS_ABOVE_128 dQ consumers where they fit;
  - at the 128 tier without a causal mask: DQ_CONSUMERS_AT_128 where they fit;
  - the dQ kernel's Q and dO rows in registers where it runs two consumers (half the
    shared-memory reads of its first two products);
  - the persistent grids where `persistent_wins` and both kernels have a producer;
  - a causal persistent grid at d = 64 of L2_GROUP_MIN_PAIRS pairs: tiles in L2_GROUP;
  - a causal call whose dK/dV grid has fewer than CAUSAL_MIN_PROGRAMS programs: the
    fewest splits of its GQA group that reach it, or the most that fit shared memory.
  (Under jax.vmap, B is one problem's batch: the grid is then larger than counted.)"""
  B, S, K, H = k_shape
  group = q_shape[2] // K
  config = BackwardConfig(**fields)
  if (H == 64
      and not {"block_n", "dq_block_n", "stats_streamed"} & set(fields)):
    config = tiles_at_64(config, itemsize)
    if config.stats_streamed:      # both kernels on d = 64's tiles, as timed
      config = dataclasses.replace(
          config, **{f: True for f in P_UNDER_DP if f not in fields})
  if (by_role(H) and "dq_consumers" not in fields
      and (config.dq_block_n or config.block_n) == ROWS):
    config = where_it_fits(config, H, itemsize, dq_consumers=DQ_CONSUMERS_ABOVE_128)
  if (table_head_dim(H) == 128 and not causal
      and not {"dq_consumers", "dq_rows_in_registers"} & set(fields)):
    config = where_it_fits(config, H, itemsize, dq_consumers=DQ_CONSUMERS_AT_128)
  if (dq_consumers_of(H, config) == 2 and not by_role(H)
      and "dq_rows_in_registers" not in fields):
    config = dataclasses.replace(config, dq_rows_in_registers=True)
  if (persistent_wins(causal=causal, group=group, head_dim=H)
      and dq_consumers_of(H, config) >= 2 and not by_role(H)
      and "persistent" not in fields):
    config = dataclasses.replace(config, persistent=True)
  if (causal and config.persistent and H == 64 and "l2_group" not in fields
      and B * K >= L2_GROUP_MIN_PAIRS):
    config = dataclasses.replace(config, l2_group=L2_GROUP)
  if causal and "group_splits" not in fields and not by_role(H):
    for splits in (d for d in range(2, group + 1) if group % d == 0):
      if dkv_programs(B, K, S, H, config) >= CAUSAL_MIN_PROGRAMS:
        break
      split = dataclasses.replace(config, group_splits=splits)
      if backward_smem_bytes(H, itemsize, split) > SMEM_BYTES:
        break
      config = split
  return config


# Query and key lengths from which the Mosaic GPU backward runs ahead of the Triton one
# (fwd+bwd on the H200, bf16, both timed in one process; docs/notes/mosaic.md has the
# figures). Shorter calls spread each program's fixed loads, pipeline fill and stores
# over fewer tiles.
MHA_MIN_SEQ = 2048              # one key head per query head, head_dim 80-128, launched grids
MHA_PERSISTENT_MIN_SEQ = 1024   # ... on the persistent grids (no partial last wave)
# ... on causal grids launched side by side (`launch_side_by_side`: each pair's tiles
# share L2), from one H100 cell, 1K d128 causal at batch 16 x 16 heads: 291.9 TF/s
# fwd+bwd against the Triton backward's 264.1 (ab_bwd_order_h100.json,
# short_backward_h100.json); d 80-112 and the H200 follow d128 on the H100 untimed.
MHA_SIDE_BY_SIDE_MIN_SEQ = 1024
BY_ROLE_MIN_SEQ = 1024          # head dims split by role (above 128): the shortest timed
D64_MIN_SEQ = 1024              # head_dim 64, one key head per query head
D64_CAUSAL_MIN_SEQ = 4096       # ... with a causal mask (shorter, the Triton one leads)
D64_GROUPED_MIN_SEQ = 4096      # ... grouped heads: the length timed


def mosaic_backward_wins(q_shape, k_shape, *, causal: bool, config: BackwardConfig,
                         num_sms: int | None = None) -> bool:
  """Whether the Mosaic GPU backward at `config` (the call's `call_config`) runs ahead of
  the Triton backward for a call of q [B, T, N, H] and k [B, S, K, H]:
  - not when the call is causal and its dK/dV grid has fewer than CAUSAL_MIN_PROGRAMS
    programs: a causal program's work grows with its key tile's distance from the end,
    and one wave of a few hundred programs lasts as long as the heaviest;
  - above head_dim 128 (split by role) from BY_ROLE_MIN_SEQ rows;
  - at head dims that take d = 64's tiles only at 64 itself (the 128-row tiles have not
    run below it), from D64_MIN_SEQ, D64_CAUSAL_MIN_SEQ or D64_GROUPED_MIN_SEQ rows;
  - at 80-128 always for grouped heads (the dK/dV program runs the group's query heads
    against K and V held in shared memory), and for one key head per query head from
    MHA_MIN_SEQ rows (MHA_PERSISTENT_MIN_SEQ on the persistent grids,
    MHA_SIDE_BY_SIDE_MIN_SEQ on causal grids launched side by side on a device of
    `num_sms` multiprocessors, `launch_side_by_side`; None: as level by level). The
    (batch, key head) pairs counted are the dK/dV grid's; the dQ grid's, B x N, are
    the same there (one key head per query head), the only branch that reads them."""
  B, S, K, H = k_shape
  T, grouped = q_shape[1], q_shape[2] > K
  if causal and dkv_programs(B, K, S, H, config) < CAUSAL_MIN_PROGRAMS:
    return False
  if by_role(H):
    return min(T, S) >= BY_ROLE_MIN_SEQ
  if table_head_dim(H) == 64:
    min_seq = (D64_GROUPED_MIN_SEQ if grouped else
               D64_CAUSAL_MIN_SEQ if causal else D64_MIN_SEQ)
    return H == 64 and min(T, S) >= min_seq
  # The order's performance rule alone (tiles=0): a grid too long for level by level
  # comes only far above MHA_MIN_SEQ.
  side_by_side = (causal and num_sms is not None and config.group_splits == 1
                  and launch_side_by_side(causal=causal, persistent=config.persistent,
                                          batch=B, heads=K, tiles=0, num_sms=num_sms))
  min_seq = (MHA_PERSISTENT_MIN_SEQ if config.persistent else
             MHA_SIDE_BY_SIDE_MIN_SEQ if side_by_side else MHA_MIN_SEQ)
  return grouped or min(T, S) >= min_seq
