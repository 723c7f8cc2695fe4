"""FlashAttention forward on Pallas Mosaic GPU for Hopper: (q, k, v) -> (out, lse).

One program per work item (batch, head, block of consumers * block_q query rows), or
with `persistent` one per multiprocessor looping over the items, runs a producer and
two (or three) consumer warpgroups (FlashAttention-3, section 3.1, warp specialisation):

- a producer warpgroup that only issues bulk tensor copies (TMA) of K and V tiles into
  `stages` shared-memory slots, each slot guarded by a "loaded" barrier (completed by
  the copy engine) and a "consumed" barrier (one arrival per consumer);
- the consumer warpgroups, each owning block_q query rows (a warpgroup matrix product
  has M = 64 rows per warpgroup), that compute S = Q K^T and O += P V with `wgmma` and
  the online softmax in registers.

Two consumers are staggered by one "schedule" barrier of two arrivals (FlashAttention-3,
section 3.1, ping-pong scheduling): while one warpgroup runs its softmax (exp2 on the
multi-function unit) the other's matrix products own the tensor cores. Three consumers
run unsynchronised (more warps per scheduler to hide the softmax's latencies, as
FlashAttention-3 does at head_dim 64). The producer shrinks its register file
(`setmaxnreg`) so the consumers can grow theirs.

Which key tiles a block visits comes from the same per-tile schedule as the Triton
kernels (`pallas_kernels.masking.build_ranges`, computed for the consumers * block_q
rows the consumers share): [lo, hi) is visited, [full_lo, full_hi) with no element-wise mask.
Producer and consumers read the same row of that table, so every slot barrier
completes exactly as often as it is waited on; with `consumer_ranges` a consumer
computes only its own block_q rows' range inside it (a second table) and idles through
the others with the same barrier operations. Logits stay in base 2 with
scale * log2(e) folded into the one FMA before exp2; lse is returned in natural log.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import round_up
from pallas_kernels.masking import (FILL, MaskOperands, MaskOptions, build_ranges,
                                    query_block_order, structured_keep)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Head dims: multiples of HEAD_DIM_STEP up to MAX_HEAD_DIM. Q, K, V and O sit in shared
# memory as atoms of 8 rows by one swizzle width (128, 64 or 32 bytes), the layout the
# copy engine writes and the tensor cores read (PTX ISA, wgmma: matrix descriptors and
# swizzling modes), and a row of head_dim elements must fill whole atoms: 16 elements at
# 2 bytes is the narrowest (`smem_layout`). 256 is the largest N of one warpgroup product
# (O += P V is [64, head_dim]).
HEAD_DIM_STEP, MAX_HEAD_DIM = 16, 256
# The head dims the config table was tuned at; another takes the entry of the next one
# up (`table_head_dim`), whose registers and shared memory it needs at most.
TABLE_HEAD_DIMS = (64, 128, 256)
SWIZZLES = (128, 64, 32)            # bytes per row of a swizzle atom, widest first
DTYPES = (jnp.bfloat16, jnp.float16)
CONSUMER_COUNTS = (2, 3)            # consumer warpgroups per program
SMEM_BYTES = 227 * 1024             # shared memory a Hopper block may use
# Mosaic GPU allocates a kernel's barriers in groups of at most 32 (its BarrierRef): a
# pipeline's per-slot barriers of one kind are one group.
MAX_BARRIERS = 32


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles and compile options of the Mosaic GPU forward.

  block_q: query rows per consumer warpgroup (a program owns consumers * block_q
    rows); a multiple of 64, the M of one warpgroup matrix product.
  block_k: key/value rows per pipeline slot (the N of S = Q K^T, <= 256).
  stages: shared-memory slots of K and V in flight.
  persistent: one program per multiprocessor looping over the (query block, head,
    batch) items, so that one item's pipeline fill and output store overlap the
    next item's loads, and no partial last wave is launched.
  consumers: consumer warpgroups per program, 2 or 3. Two are staggered by the
    schedule barrier (ping-pong, FlashAttention-3 section 3.1); three run
    unsynchronised (more warps per scheduler to hide the softmax's latencies).
  consumer_registers: registers per thread of each consumer warpgroup after
    `setmaxnreg`; the producer keeps the rest of the launch's pool (`register_split`).
    None: 232 with two consumers (the JAX and tokamax kernels), 160 with three
    (FlashAttention-3).
  consumer_ranges: each consumer computes only the key tiles its own block_q rows
    see, with their own mask classes (`build_ranges` at block_q rows), and idles
    through the rest of the program's tiles with the barrier arrivals and waits alone:
    with a causal mask a program's earlier consumers otherwise compute the diagonal's
    tiles that only its later consumers' rows see, fully masked. Not with
    `scores_ahead` (ValueError).
  scores_ahead: issue each tile's P V product and the next tile's S = Q K^T back to
    back and wait for both at once, where otherwise P V is waited for before the next
    S is issued.
  lazy_rescale: keep a row's running max, the one its exponentials are taken against,
    until a tile's max exceeds it by more than RESCALE_THRESHOLD, and skip the
    rescale of O in each warp none of whose rows moved (`scale_moved_rows`).
  """

  block_q: int = 64
  block_k: int = 128
  stages: int = 2
  persistent: bool = False
  consumers: int = 2
  consumer_registers: int | None = None
  scores_ahead: bool = False
  lazy_rescale: bool = False
  consumer_ranges: bool = False

  def __post_init__(self):
    if not isinstance(self.consumer_ranges, bool):
      raise ValueError(f"consumer_ranges={self.consumer_ranges!r} must be a bool")
    if self.consumer_ranges and self.scores_ahead:
      raise ValueError("consumer_ranges=True is built into the loop without scores_ahead; "
                       f"got scores_ahead={self.scores_ahead!r}")
    if not isinstance(self.scores_ahead, bool):
      raise ValueError(f"scores_ahead={self.scores_ahead!r} must be a bool")
    if not isinstance(self.lazy_rescale, bool):
      raise ValueError(f"lazy_rescale={self.lazy_rescale!r} must be a bool")
    if not isinstance(self.block_q, int) or self.block_q % 64 or self.block_q <= 0:
      raise ValueError(f"block_q={self.block_q!r} must be a positive multiple of 64")
    if not isinstance(self.block_k, int) or self.block_k % 64 or not 0 < self.block_k <= 256:
      raise ValueError(f"block_k={self.block_k!r} must be 64, 128, 192 or 256")
    if not isinstance(self.stages, int) or not 2 <= self.stages <= MAX_BARRIERS:
      raise ValueError(f"stages={self.stages!r} must be an int in [2, {MAX_BARRIERS}] "
                       "(one barrier of each kind per slot)")
    if type(self.consumers) is not int or self.consumers not in CONSUMER_COUNTS:
      raise ValueError(f"consumers={self.consumers!r} must be one of {CONSUMER_COUNTS}")
    c, launch = self.register_split()[0], launch_registers(self.consumers)
    most = (launch * (self.consumers + 1) - MIN_REGISTERS) // self.consumers // 8 * 8
    if type(c) is not int or c % 8 or not launch <= c <= most:
      raise ValueError(f"consumer_registers={c!r} must be a multiple of 8 in "
                       f"[{launch}, {most}] with {self.consumers} consumers")

  def with_consumers(self, consumers: int) -> "MosaicConfig":
    """These tiles with `consumers` consumer warpgroups and that count's own register
    default."""
    return dataclasses.replace(self, consumers=consumers, consumer_registers=None)

  @property
  def ping_pong(self) -> bool:
    """Two consumers are staggered by the schedule barrier; three are not."""
    return self.consumers == 2

  def register_split(self) -> tuple[int, int]:
    """(registers per consumer thread, per producer thread) after `setmaxnreg`."""
    c = self.consumer_registers
    if c is None:
      c = DEFAULT_CONSUMER_REGISTERS[self.consumers]
    return c, launch_registers(self.consumers) * (self.consumers + 1) - self.consumers * c


def check_l2_group(l2_group):
  """ValueError unless l2_group is a positive int. (It orders the work items of a
  grid with a causal mask, `item_coords`.)"""
  if type(l2_group) is not int or l2_group < 1:
    raise ValueError(f"l2_group={l2_group!r} must be a positive int")


# Registers per thread: a launch of n warpgroups gets 65536 / (128 n) each, rounded down
# to the allocation unit of 8 (168 for three warpgroups, 128 for four), and `setmaxnreg`
# only moves registers between warpgroups inside that pool; it can raise a count only
# above the launch's, and the producer, which issues copies and waits on barriers, keeps
# at least 24, setmaxnreg's lower bound (PTX ISA, setmaxnreg). The JAX and tokamax
# kernels split 232/232/40; FlashAttention-3 (hopper/flash_fwd_kernel_sm90.h) 240/240/24
# with two consumers and 160/160/160/32 with three.
MIN_REGISTERS = 24
DEFAULT_CONSUMER_REGISTERS = {2: 232, 3: 160}


def launch_registers(consumers: int) -> int:
  return 65536 // (128 * (consumers + 1)) // 8 * 8


# Per (head_dim, causal), from the tile sweep on the H200 (bf16, jax 0.11.2;
# experiments/results/mosaic_sweep_h200.json and mosaic_sweep2_h200.json, forward TF/s
# against cuDNN in the same process):
# - without a causal mask every work item costs the same, and the persistent grid wins
#   at every head_dim (16K d128 0.95 -> 0.99x cuDNN, 4K d64 0.85 -> 0.99x, 4K d256
#   0.88 -> 0.93x): the next item's K/V loads run under this item's last tiles and
#   output store, and there is no partial last wave;
# - with one, items differ in cost up to T / (2 block_q) times; the hardware's dynamic
#   block scheduler over a heaviest-first grid balanced them better than the static
#   split of the persistent grid at 16K d128 (1.04x against 0.97x) and with the d = 64
#   table tiles (0.92x against 0.85x; with 64 x 128 tiles the persistent grid was the
#   faster, 0.90x against 0.88x), and still in the snake order of `item_schedule`
#   (mosaic_fwd_causal_persistent_snake_h200.json: 16K d128 543 against 615 TF/s, 4K
#   d64 332 against 362);
# - key tiles of 128 at d <= 128: 64 was slower in every cell (0.71-0.89x), 192 level
#   at best (16K d128 persistent 607 against 604 TF/s) and slower elsewhere; 64 at
#   d = 256, where a 128-row K and V slot pair alone would take 128 KiB of the 227 KiB;
#   at d = 64 causal with two consumers, 128 query rows each with key tiles of 64 (0.92x
#   against 0.87x): twice the rows per barrier round trip, the same 64 x 64 S tile in
#   registers (the entry below 2048 query rows, `TWO_CONSUMER_ENTRIES`);
# - at d = 128, three unsynchronised consumers in place of the ping-ponged two, in the
#   same process (mosaic_sweep_consumers_h200.json): 611 against 599 TF/s at 16K
#   (persistent), 589 against 565 causal (with 64 x 128 tiles both; 64-key tiles,
#   0.85-0.93x cuDNN, lose). At d = 64 three were level then (433 against 429), and
#   with today's kernel they win without a causal mask: 4K d64 459.4 against 418.8
#   TF/s, cuDNN 439.5 (mosaic_d64_three_time_h200.json; 457.3 against 427.9 in the call
#   before, mosaic_d64_three_lazy_time_h200.json); with one they are level or slower
#   (342.0 launched, 349.7 persistent in groups of 16, against the table's 348.2);
#   two consumers without the ping-pong were slower at d = 64 and 128 (0.92-0.94x) and
#   level at d = 256;
# - with a causal mask, each consumer on its own rows' key tiles (`consumer_ranges`),
#   in one process timed the benchmark's way (mosaic_consumer_ranges_time_h200.json,
#   TF/s): 4K d64 three consumers of 64 rows on 128-key tiles 382.6 against the
#   previous entry's 346.6 (two of 128 rows on 64-key tiles; 346.3 with it) and cuDNN's
#   372.0 (with 64-key tiles 307.4); 4K d96 on d = 128's entry 447.8 against 427.9
#   (cuDNN 339.4); 16K d128 609.6 against 607.3-622.2 (the entry twice, level). A
#   program's earlier consumers otherwise compute the diagonal's key tiles that only
#   its later consumers' rows see, fully masked (2.8% of the consumers' tiles at 4K
#   with 192-row programs, 0.8% at 16K), and every consumer masks element-wise each
#   tile the program's rows cross the diagonal in, where its own rows cross fewer.
_TABLE = {(64, False): MosaicConfig(64, 128, 2, persistent=True, consumers=3),
          (64, True): MosaicConfig(64, 128, 2, consumers=3, consumer_ranges=True),
          (128, False): MosaicConfig(64, 128, 2, persistent=True, consumers=3),
          (128, True): MosaicConfig(64, 128, 2, consumers=3, consumer_ranges=True),
          (256, False): MosaicConfig(64, 64, 2, persistent=True),
          (256, True): MosaicConfig(64, 64, 2)}

# Below THREE_CONSUMERS_MIN_SEQ query rows, two-consumer entries on other tiles than
# the three's: d = 64 causal on its entry before three consumers took it (two of 128
# rows on 64-key tiles, from the tile sweep above), with `consumer_ranges` (level with
# it at 4K: 346.3 against 346.6 TF/s, mosaic_consumer_ranges_time_h200.json); the
# three's 64 x 128 tiles were not timed with two consumers there.
TWO_CONSUMER_ENTRIES = {(64, True): MosaicConfig(128, 64, 2, consumer_ranges=True)}

# The head dims whose default issues each P V with the next tile's S (`scores_ahead`).
# At d = 256, in one process (mosaic_scores_ahead_time_h200.json): 593.8 against 580.6
# TF/s, causal 519.2 against 488.9 (cuDNN 617.6, 505.3); in the next benchmark run
# 625.9 and 566.2 against 599-617 and 550-553 in the four before. There the products
# dominate a tile (tensor pipe 74% busy, mosaic_notes.md's counters) and each wait for
# P V before the next S is issued left the tensor cores idle. Where the softmax is as
# long as the products it was slower in the same process: 4K d64 375.7 against 432.0,
# causal 330.1 against 359.6, 16K d128 529.2 against 614.9 (588.8 with two consumers);
# and so, across benchmark runs, was d = 192 on d = 256's tiles (557.4 against
# 577-590 TF/s). 160-240 other than 192 were not timed with it.
SCORES_AHEAD_HEAD_DIMS = (256,)

# The table entries whose default skips O's rescale where no row's max moved
# (`lazy_rescale`): head dims 80-256. In one process each, forward TF/s against the
# table without it (mosaic_lazy_order_h200.json): 16K d128 645.6 against 628.3, causal
# 635.2 against 609.6; 4K d256 624.7 against 602.3, causal 567.3 against 510.6. At
# d = 64 it was slower: 390.7 against 433.6, causal 335.2 against 369.1, as it was with
# the rescale after P's exponentials, and with a branch per thread in place of the warp
# vote (mosaic_lazy_variants_h200.json): there the vote holds the ping-pong's "softmax
# done" arrive, which ptxas otherwise issues ahead of the softmax, behind it (freed, the
# arrive won back most of the loss without a causal mask, little with one), and the
# multiplies it skips are off the critical path (mosaic_notes.md, the SASS); with three
# unsynchronised consumers, 453.6 against 457.3 (mosaic_d64_three_lazy_time_h200.json).
LAZY_RESCALE_TABLE_DIMS = (128, 256)


# Query lengths below which the table's three consumers give way to two: a program of
# 3 x 64 rows spreads its fixed costs (Q in, O out, the pipeline's fill) over fewer key
# tiles and leaves a larger last-program tail. In one benchmark run
# (bench_a_three_consumers_h200.json) three consumers ran 1K d128 (batch 16) at 394.6
# TF/s, where two had run 524.6 in the run before (bench_attention_h200.json at commit
# 610024c, as are 470 and 585 below), while from 3K up three were level or faster
# (T 3072 causal 526 against 470, 16K causal 655 against 585). With two below it, 1K
# d128 ran 546.5 (bench_attention_h200.json). The d = 64 entry's three (no causal mask)
# ran 2K, 8K and 16K at 449.1, 484.7 and 495.8 TF/s against cuDNN's 419.8, 443.6 and
# 449.5 (bench_d64_three_lengths_h200.json); below 2K they were not timed, nor were the
# causal d = 64 entry's three (timed at 4K) at other lengths.
THREE_CONSUMERS_MIN_SEQ = 2048


def head_dim_error(head_dim: int, what: str = "forward") -> str | None:
  """Why the Mosaic GPU kernel called `what` cannot run `head_dim`, or None."""
  if head_dim % HEAD_DIM_STEP or not 0 < head_dim <= MAX_HEAD_DIM:
    return (f"the Mosaic GPU {what} supports head_dim a multiple of {HEAD_DIM_STEP} up to "
            f"{MAX_HEAD_DIM}, got {head_dim}")
  return None


def table_head_dim(head_dim: int) -> int:
  """The tuned head dim whose table entry `head_dim` takes: the next one up."""
  why = head_dim_error(head_dim)
  if why:
    raise NotImplementedError(why)
  return next(d for d in TABLE_HEAD_DIMS if d >= head_dim)


def swizzle_bytes(cols: int, itemsize: int) -> int:
  """The widest swizzle whose rows a row of `cols` elements fills whole (`SWIZZLES`)."""
  row = cols * itemsize
  for swizzle in SWIZZLES:
    if row % swizzle == 0:
      return swizzle
  raise NotImplementedError(f"rows of {cols} x {itemsize} bytes fill no swizzle of {SWIZZLES}")


def smem_layout(cols: int, itemsize: int) -> dict:
  """The transforms of a shared-memory tile whose rows hold `cols` elements: tiles of
  TMA_ROWS rows by one swizzle row (`swizzle_bytes`). The two shared-memory operands of
  one warpgroup product must share the swizzle, so every tile a product reads beside
  Q, K, V or dO takes the head dim's (a [64, 64] tile fits any of them)."""
  plgpu = _plgpu()
  swizzle = swizzle_bytes(cols, itemsize)
  return dict(transforms=(plgpu.TilingTransform((TMA_ROWS, swizzle // itemsize)),
                          plgpu.SwizzleTransform(swizzle)))


def default_config(head_dim: int, causal: bool = False, seq_q: int | None = None) -> MosaicConfig:
  """The table's config for (head_dim, causal) (`table_head_dim`), with `scores_ahead`
  at SCORES_AHEAD_HEAD_DIMS, `lazy_rescale` on LAZY_RESCALE_TABLE_DIMS' entries and two
  consumers in place of three when the query length `seq_q` is below
  THREE_CONSUMERS_MIN_SEQ (TWO_CONSUMER_ENTRIES' tiles where it has the entry, else
  the same tiles)."""
  key = table_head_dim(head_dim), bool(causal)
  config = _TABLE[key]
  if config.consumers == 3 and seq_q is not None and seq_q < THREE_CONSUMERS_MIN_SEQ:
    config = TWO_CONSUMER_ENTRIES.get(key) or config.with_consumers(2)
  if head_dim in SCORES_AHEAD_HEAD_DIMS:
    config = dataclasses.replace(config, scores_ahead=True)
  if key[0] in LAZY_RESCALE_TABLE_DIMS:
    config = dataclasses.replace(config, lazy_rescale=True)
  return config


# Shared memory beside the tiles: the mbarriers (8 bytes each) and the alignment of
# each swizzled buffer to its swizzle atom (1024 bytes at the widest swizzle).
SMEM_SLACK = 1024


def smem_bytes(head_dim: int, itemsize: int, config: MosaicConfig) -> int:
  """Shared memory of one program: Q (reused for O), the K/V slots, lse rows, slack.
  (The compile reserves no reduction scratch: `compiler_params`.)"""
  q = config.consumers * config.block_q * head_dim * itemsize
  kv = 2 * config.stages * config.block_k * head_dim * itemsize
  return q + kv + config.consumers * config.block_q * 4 + SMEM_SLACK


def check_head_dim_and_dtype(q, what: str):
  """NotImplementedError naming a head_dim the kernel called `what` cannot run
  (`head_dim_error`) or a dtype other than bf16/fp16."""
  why = head_dim_error(q.shape[-1], what)
  if why:
    raise NotImplementedError(why)
  if not any(q.dtype == d for d in DTYPES):
    raise NotImplementedError(
        f"the Mosaic GPU {what} supports bfloat16 and float16, got {q.dtype}")


# Rows of the shared-memory tiling (one swizzle atom per 8 rows, `smem_layout`) that
# Mosaic GPU lays a tensor map's box over: the map's row count must be a
# multiple of it.
TMA_ROWS = 8


def map_rows(n: int, tile: int, interpret: bool) -> int:
  """The rows an operand of n rows is padded to in HBM before the kernel's tensor maps
  are built over it: the next multiple of TMA_ROWS, for the copy engine bounds the
  copies past it (a box's rows past the end load as zeros and are not stored; CUDA
  programming guide, tensor memory access), or, under Mosaic GPU's interpreter, which
  does not model those bounds (and hangs on such a copy), whole tiles of `tile` rows."""
  return round_up(n, tile) if interpret else round_up(n, TMA_ROWS)


def pad_axis(x, n: int, axis: int, fill=0):
  """x zero-padded (or `fill`-padded) along `axis` to length n (no copy when it has n)."""
  if x.shape[axis] == n:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths, constant_values=fill)


def check_shared_memory(config, head_dim: int, need: int):
  """NotImplementedError naming a config whose programs need more than SMEM_BYTES."""
  if need > SMEM_BYTES:
    raise NotImplementedError(
        f"{config} at head_dim={head_dim} needs {need} bytes of shared memory (> {SMEM_BYTES})")


def check_supported(q, k, v, config: MosaicConfig):
  """Raises NotImplementedError naming what this kernel cannot run (shapes, dtypes)."""
  check_head_dim_and_dtype(q, "forward")
  if config.consumers == 3:
    # A launch of four warpgroups has 128 registers per thread, and ptxas held the
    # consumers' matrix products to that although setmaxnreg raises them to 160: at
    # d = 256 it refused the 64 x 256 float32 accumulator ("Insufficient registers
    # (128) ... register target of 158 or higher", mosaic_sweep_consumers_h200.log).
    # Only what ran on the H200 with three is taken: 64-row consumers, key tiles
    # <= 128, d <= 128.
    H = q.shape[-1]
    if H > 128 or config.block_q != 64 or config.block_k > 128:
      raise NotImplementedError(
          f"three consumer warpgroups support head_dim <= 128, block_q=64 and "
          f"block_k <= 128 (their products must fit 128 registers per thread); got "
          f"head_dim={H}, {config}")
  check_shared_memory(config, q.shape[-1], smem_bytes(q.shape[-1], q.dtype.itemsize, config))


def _plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # imported where it is used
  return plgpu


def _load_vector(ref, layout, interpret):
  """A 1-D slice of a GMEM (or SMEM) ref in a register layout. The interpreter has no
  `plgpu.load`; the plain read gives the same values there."""
  if interpret:
    return ref[...]
  plgpu = _plgpu()
  if "idx" in inspect.signature(plgpu.load).parameters and \
      inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout, optimized=False)   # jax 0.10: idx positional
  # optimized=False: plain loads (the optimized path reads SMEM only, in its own layouts).
  return plgpu.load(ref, layout=layout, optimized=False)


# Lazy rescaling (FlashAttention-4's conditional rescaling). The online softmax's
# result does not depend on the max its exponentials are taken against, only its range
# does: with a stale max m' <= m the probabilities are at most 2^(m - m'). A row keeps
# m' until a tile's max exceeds it by more than RESCALE_THRESHOLD (base-2 logits), so P
# <= 2^8, well inside bf16, fp16 and float32, and once a row's max settles, O (a
# [block_q, head_dim] float32 accumulator) is rescaled only in the rare tile that
# moves it.
RESCALE_THRESHOLD = 8.0


def lazy_max(m_i, m_new):
  """The row max P is taken against under `lazy_rescale`: the stale m_i unless the
  tile's running max m_new passes it by more than RESCALE_THRESHOLD. A row that has
  seen nothing (m_i = -inf) takes m_new; a NaN fails the comparison and keeps m_i (its
  exponentials and sum are NaN all the same)."""
  return jnp.where(m_new > m_i + RESCALE_THRESHOLD, m_new, m_i)


def scale_moved_rows(acc, alpha):
  """acc * alpha by rows (alpha is 1.0 exactly in a row whose max did not move), the
  multiplies skipped in each warp where no row moved: a row of alpha 1.0 multiplied or
  not is the same. The test is a warp vote (`vote.sync.any`, PTX ISA), so the branch
  is uniform across the warp's lanes; the rows a warp holds in the accumulator layout
  are its own (WGMMA_LAYOUT: 16 of each 64). (The interpreter, which has no in-place
  accumulator, multiplies every row with P V's: `pv_product`.)"""
  plgpu = _plgpu()
  layout = plgpu.Layout.WGMMA

  @plgpu.inline_mgpu(arg_types=(layout, layout.reduce(1)),
                     return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=layout))
  def scaled(_, acc, alpha):
    import numpy as np
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
    f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
    one = arith.constant(f32, 1.0)
    moved = None               # this thread's rows: any alpha != 1 (unordered: NaN too)
    for reg in alpha.registers.flat:
      values = [reg]
      if isinstance(reg.type, ir.VectorType):
        values = [vector.extract(reg, dynamic_position=[],
                                 static_position=ir.DenseI64ArrayAttr.get([i]))
                  for i in range(ir.VectorType(reg.type).shape[0])]
      for x in values:
        ne = arith.cmpf(arith.CmpFPredicate.UNE, x, one)
        moved = ne if moved is None else arith.ori(moved, ne)
    any_moved = llvm.inline_asm(
        i32, [arith.extui(i32, moved)],
        "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.any.pred p, p, 0xffffffff; "
        "selp.u32 $0, 1, 0, p; }", "=r,r", has_side_effects=True)
    regs = list(acc.registers.flat)
    branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, any_moved, arith.constant(i32, 0)),
                      [r.type for r in regs], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      scf.yield_(list((acc * alpha.broadcast_minor(acc.shape[1])).registers.flat))
    with ir.InsertionPoint(branch.else_block):
      scf.yield_(regs)
    out = np.empty(acc.registers.shape, dtype=object)
    out.flat[:] = list(branch.results)
    return type(acc)(_registers=out, _layout=acc.layout, _is_signed=None)
  return scaled(acc, alpha)


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


def persistent_items(num_items: int, num_ctas: int, item, snake: bool = False):
  """The persistent grid's loop (the forward's and both backward kernels'): this
  program (axis "sm") runs its work items (`item_schedule`) as item(w, count) -> count,
  the count (of tiles streamed through its slots) going on from one item to the next
  from 0; returns the last. Every item goes through one traced body: a first item
  traced on its own would be a second copy of the kernel's code for ptxas to compile
  (1.9-3.6 s of a 4K d256 fwd+bwd's first call on the H200, compile_time_h200.json)."""
  steps, item_index = item_schedule(lax.axis_index("sm"), num_items, num_ctas, snake)
  return lax.fori_loop(0, steps, lambda k, count: item(item_index(k), count),
                       jnp.int32(0))


def item_coords(w, sizes, causal: bool, l2_group: int = 1):
  """The grid coordinates of work item w of a persistent program (the forward's and
  both backward kernels'), or of the forward's launched causal program at launch index
  w with `l2_group`, over a grid of `sizes` (tiles, then heads, ..., batch).
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


def _kernel(*refs, names, opts: MaskOptions, scale, config: MosaicConfig, group,
            items_grid, num_ctas, dtype, interpret):
  plgpu = _plgpu()
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout, col_layout = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
  r = dict(zip(names, refs))
  qo_smem, k_smem, v_smem, lse_smem = r["qo_smem"], r["k_smem"], r["v_smem"], r["lse_smem"]
  k_loaded, v_loaded, q_loaded = r["k_loaded"], r["v_loaded"], r["q_loaded"]
  k_consumed, v_consumed, schedule = r["k_consumed"], r["v_consumed"], r["schedule"]
  bq, bk, stages, C = config.block_q, config.block_k, config.stages, config.consumers
  H = qo_smem.shape[-1]
  wg = lax.axis_index("wg")
  # Register layouts: the tile layout of the matrix-product accumulator and its rows
  # and columns. The interpreter keeps plain arrays and has no layout casts.
  if interpret:
    cast = lambda x, layout: x
    iota = lambda dim: lax.broadcasted_iota(jnp.int32, (bq, bk), dim)
  else:
    cast = plgpu.layout_cast
    iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, (bq, bk), dim, layout=wgmma_layout)

  # The launched grid: (query blocks, heads, batch). Mosaic GPU reverses a grid onto
  # CUDA's block indices (batch is x; jax/_src/pallas/mosaic_gpu/lowering.py), and the
  # hardware starts blocks about in linear order, x fastest (CUDA promises no order), so
  # a causal launch goes out level by level: every (batch, head)'s heaviest block
  # (`query_block_order`) before any's next one.
  num_q_blocks = items_grid[0]
  block_of = query_block_order(num_q_blocks, opts)

  def for_each_item(item):
    """Runs `item((query block, head, batch), tiles)` over this program's work items;
    `tiles` counts the key tiles the program has passed through its slots so far (None
    in a program of one item; from 0 in a persistent one), so every warpgroup derives
    the same slot and barrier phase for each tile. Returns the count after the last
    item."""
    if num_ctas is None:     # one item per program
      coords = (block_of(lax.axis_index("q")), lax.axis_index("heads"), lax.axis_index("batch"))
      return item(coords, None)
    # persistent: this program's items (`persistent_items`)
    def coords_of(w):
      level, head, batch = item_coords(w, items_grid, opts.is_causal)
      return block_of(level), head, batch

    return persistent_items(math.prod(items_grid), num_ctas,
                            lambda w, tiles: item(coords_of(w), tiles), opts.is_causal)

  def schedule_arrive():
    if config.ping_pong:
      plgpu.barrier_arrive(schedule)

  def schedule_wait():
    if config.ping_pong:
      plgpu.barrier_wait(schedule)

  def schedule_turn():
    schedule_arrive()
    schedule_wait()

  def tile_range(i, b):
    ranges = r["ranges"]
    return tuple(ranges[b, i, t] for t in range(4)) + (ranges[b, i, 5],)

  def own_tile_range(i, b, lo, hi):
    """(lo, full_lo, full_hi, hi) of this consumer's own rows (`consumer_ranges`),
    clamped into the program's [lo, hi), whose tiles the producer streams."""
    own, row = r["own_ranges"], i * C + wg
    a = jnp.clip(own[b, row, 0], lo, hi)
    d = jnp.clip(own[b, row, 3], a, hi)
    full_lo = jnp.clip(own[b, row, 1], a, d)
    return a, full_lo, jnp.clip(own[b, row, 2], full_lo, d), d

  consumer_registers, producer_registers = config.register_split()
  lazy = config.lazy_rescale
  pv_in_place = not interpret   # the interpreter has no in-place accumulator

  @pl.when(wg < C)
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    q_smem = qo_smem.at[wg]

    def item(coords, tiles):
      i, n, b = coords
      lo, full_lo, full_hi, hi, kv_len = tile_range(i, b)
      passed = lambda j: j - lo if tiles is None else tiles + j - lo
      slot_of = lambda j: lax.rem(passed(j), stages)
      row0 = i * (C * bq) + wg * bq
      plgpu.copy_gmem_to_smem(r["q"].at[b, pl.ds(row0, bq), n], q_smem, q_loaded.at[wg])
      q_seg = None
      if "q_seg" in r:
        q_seg = _load_vector(r["q_seg"].at[b, pl.ds(row0, bq)], row_layout, interpret)
        q_seg = lax.broadcast_in_dim(q_seg, (bq, bk), [0])
      plgpu.barrier_wait(q_loaded.at[wg])

      m_i = cast(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
      l_i = cast(jnp.zeros((bq,), jnp.float32), row_layout)
      acc = cast(jnp.zeros((bq, H), jnp.float32), wgmma_layout)

      def online_softmax(s, j, masked, m_i, l_i):
        """(P in the input dtype, the rescale factor alpha, the new row max and row sum)
        of key tile j from its raw scores s."""
        s, m_new, m_use, alpha = new_max(s, j, masked, m_i)
        p16, l_i = probabilities(s, m_use, alpha, l_i)
        return p16, alpha, m_new, l_i

      # Base-2 logits are s * c. The row max commutes with c only for c > 0; a soft cap
      # or a scale <= 0 is applied to s first (`new_max`).
      scale_first = not scale * LOG2E > 0
      c = LOG2E if opts.soft_cap is not None or scale_first else scale * LOG2E

      def new_max(s, j, masked, m_i):
        """(s with the soft cap or scale and the mask applied, the new row max, the max
        P is taken against, the rescale factor alpha) of key tile j from its raw scores."""
        if opts.soft_cap is not None:
          s = opts.soft_cap * jnp.tanh(s * (scale / opts.soft_cap))
        elif scale_first:
          s = s * scale
        if masked:
          rows = row0 + iota(0)
          cols = j * bk + iota(1)
          kv_seg = None
          if q_seg is not None:
            kv_seg = _load_vector(r["kv_seg"].at[b, pl.ds(j * bk, bk)], col_layout, interpret)
            kv_seg = lax.broadcast_in_dim(kv_seg, (bq, bk), [1])
          keep = structured_keep(rows, cols, opts, kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
          s = jnp.where(keep, s, -jnp.inf)
        # Online softmax in base 2 (FlashAttention-2, Algorithm 1). In a masked tile a
        # row may have seen nothing yet (m = -inf): 0 stands in so that exp2 never sees
        # (-inf) - (-inf). A NaN logit makes its row's sum NaN, and so its output.
        m_new = jnp.maximum(m_i, s.max(axis=1) * c)
        if lazy:
          m_new = lazy_max(m_i, m_new)
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m_i - m_use)
        if lazy:           # exactly 1 where the max stayed (`scale_moved_rows`)
          alpha = jnp.where(m_new == m_i, 1.0, alpha)
        return s, m_new, m_use, alpha

      def probabilities(s, m_use, alpha, l_i):
        """(P in the input dtype, the new row sum) from `new_max`'s s, m_use, alpha."""
        p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        return p.astype(dtype), l_i

      def sequential(acc, m_i, l_i):
        """The key tiles, each consumer's products and softmax one after the other; with
        `ping_pong` the two consumers staggered by the schedule barrier so that one's
        softmax runs under the other's products (FlashAttention-3, 3.1). With
        `scores_ahead` a tile's P V product and the next tile's S = Q K^T are issued back
        to back and waited for together, so the tensor cores go from one to the other
        without the wait for P V, the loop's turn and a new issue between them; tile j's
        S is then computed in tile j - 1's step and reaches tile j through the carry."""
        # The tile classes: masked, unmasked, masked (`build_ranges`); with
        # `consumer_ranges` this consumer's own, between tiles it idles through (None).
        classes = ((lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True))
        if config.consumer_ranges:
          mine = own_tile_range(i, b, lo, hi)
          classes = ((lo, mine[0], None), (mine[0], mine[1], True), (mine[1], mine[2], False),
                     (mine[2], mine[3], True), (mine[3], hi, None))
        zero_scores = lambda: cast(jnp.zeros((bq, bk), jnp.float32), wgmma_layout)

        def issue_scores(s_ref, j):
          plgpu.wgmma(s_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot_of(j)], (1, 0)))

        def scores(j):
          """S of tile j (its K slot awaited), after the turn that hands the tensor
          cores to the other consumer."""
          if interpret:      # the interpreter's wgmma takes no transposed operand
            s = jnp.dot(q_smem[...], k_smem[slot_of(j)].T, preferred_element_type=jnp.float32)
            schedule_turn()
            return s

          def qk(s_ref):
            issue_scores(s_ref, j)
            schedule_turn()              # hand the tensor cores to the other consumer
            return s_ref[...]
          return pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))

        def softmax_then_turn(j, s, masked, acc, m_i, l_i):
          """Tile j's softmax, then this consumer's turn at the tensor cores with V_j in."""
          # On the GPU O is rescaled here, under the other consumer's products (the
          # interpreter's `pv_product` rescales it): lazily, (rarely) before P's
          # exp2, or every tile after it.
          s, m_new, m_use, alpha = new_max(s, j, masked, m_i)
          if pv_in_place and lazy:
            acc = scale_moved_rows(acc, alpha)
          p16, l_i = probabilities(s, m_use, alpha, l_i)
          if pv_in_place and not lazy:
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          # Keep the softmax on this side of the barriers (the references found the order
          # matters for how the two consumers overlap).
          acc, l_i, m_new, p16, alpha = lax.optimization_barrier((acc, l_i, m_new, p16, alpha))
          schedule_arrive()                         # softmax done
          plgpu.barrier_wait(v_loaded.at[slot_of(j)])
          schedule_wait()                           # the other consumer left the tensor cores
          return acc, p16, alpha, m_new, l_i

        def wait_k(j):     # K of tile j, if the item has it (called under P V of j - 1)
          pl.when(j < hi)(lambda: plgpu.barrier_wait(k_loaded.at[slot_of(j)]))

        def pv_product(j, acc, p16, alpha, then=lambda: None):
          """O + P V of tile j, in place (`softmax_then_turn` rescaled O), or under the
          interpreter O rescaled by alpha here; `then()` runs while the product is in
          flight."""
          def pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(j)])
            then()
          if interpret:      # the interpreter's wgmma takes no register operand
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + jnp.dot(
                p16, v_smem[slot_of(j)], preferred_element_type=jnp.float32)
            then()
            return acc
          return pl.run_state(pv)(plgpu.ACC.init(acc))   # O += P V inside the accumulator

        def body(j, carry, masked):
          acc, m_i, l_i = carry
          s = scores(j)
          plgpu.barrier_arrive(k_consumed.at[slot_of(j)])
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          acc = pv_product(j, acc, p16, alpha, then=lambda: wait_k(j + 1))
          plgpu.barrier_arrive(v_consumed.at[slot_of(j)])
          return acc, m_new, l_i

        def idle_tile(j, carry):
          """Tile j outside this consumer's rows' range: `body`'s barrier arrivals and
          waits in `body`'s order and nothing else, so that the slots' consumed
          barriers and the ping-pong's schedule barrier complete as for a computed tile."""
          schedule_turn()
          plgpu.barrier_arrive(k_consumed.at[slot_of(j)])
          schedule_arrive()
          plgpu.barrier_wait(v_loaded.at[slot_of(j)])
          schedule_wait()
          wait_k(j + 1)
          plgpu.barrier_arrive(v_consumed.at[slot_of(j)])
          return carry

        def body_ahead(j, carry, masked):
          """Tile j < hi - 1 with its S in the carry; returns tile j + 1's."""
          acc, m_i, l_i, s = carry
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          if interpret:
            acc = pv_product(j, acc, p16, alpha, then=lambda: wait_k(j + 1))
            s = scores(j + 1)
          else:
            def products(refs):
              acc_ref, s_ref = refs
              plgpu.wgmma(acc_ref, p16, v_smem.at[slot_of(j)])
              plgpu.barrier_wait(k_loaded.at[slot_of(j + 1)])
              issue_scores(s_ref, j + 1)
              schedule_turn()
            acc, s = pl.run_state(products)((plgpu.ACC.init(acc), plgpu.ACC.init(zero_scores())))
          plgpu.barrier_arrive(v_consumed.at[slot_of(j)])
          plgpu.barrier_arrive(k_consumed.at[slot_of(j + 1)])
          return acc, m_new, l_i, s

        def last_ahead(carry, masked):
          """Tile hi - 1 with its S in the carry: P V alone."""
          acc, m_i, l_i, s = carry
          j = hi - 1
          acc, p16, alpha, m_new, l_i = softmax_then_turn(j, s, masked, acc, m_i, l_i)
          acc = pv_product(j, acc, p16, alpha)
          plgpu.barrier_arrive(v_consumed.at[slot_of(j)])
          return acc, m_new, l_i

        if not config.scores_ahead:
          pl.when(hi > lo)(lambda: plgpu.barrier_wait(k_loaded.at[slot_of(lo)]))
        pl.when(wg == 1)(schedule_turn)   # stagger: consumer 1 starts one half-step late
        if not config.scores_ahead:
          carry = (acc, m_i, l_i)
          for a, z, masked in classes:
            step = idle_tile if masked is None else functools.partial(body, masked=masked)
            carry = lax.fori_loop(a, z, step, carry)
        else:
          def first():
            plgpu.barrier_wait(k_loaded.at[slot_of(lo)])
            s = scores(lo)
            plgpu.barrier_arrive(k_consumed.at[slot_of(lo)])
            return s
          carry = (acc, m_i, l_i, lax.cond(hi > lo, first, zero_scores))
          end = jnp.maximum(lo, hi - 1)           # tiles lo .. hi - 2, in their classes
          for a, z, masked in classes:
            carry = lax.fori_loop(jnp.minimum(a, end), jnp.minimum(z, end),
                                  functools.partial(body_ahead, masked=masked), carry)
          last_masked = (hi - 1 < full_lo) | (hi - 1 >= full_hi)
          carry = lax.switch(jnp.where(hi > lo, jnp.where(last_masked, 1, 2), 0),
                             [lambda c: c[:3], functools.partial(last_ahead, masked=True),
                              functools.partial(last_ahead, masked=False)], carry)
        pl.when(wg == 0)(schedule_turn)   # balance the stagger
        return carry

      acc, m_i, l_i = sequential(acc, m_i, l_i)

      # Normalise once (FlashAttention-2, section 3.1.1). A row that saw no key returns
      # 0 and lse = -inf; a NaN sum stays NaN.
      empty = l_i == 0.0
      inv = 1.0 / jnp.where(empty, 1.0, l_i)
      out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      out = jnp.where(lax.broadcast_in_dim(empty, acc.shape, [0]), 0.0, out)
      lse = jnp.where(empty, -jnp.inf, m_i * LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
      q_smem[...] = out.astype(dtype)             # Q is no longer needed: O goes there
      lse_smem.at[wg][...] = lse
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, r["out"].at[b, pl.ds(row0, bq), n])
      plgpu.copy_smem_to_gmem(lse_smem.at[wg], r["lse"].at[b, n, pl.ds(row0, bq)])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # Q's slot is free for the next item
      return passed(hi)

    for_each_item(item)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == C)
  def _producer():
    plgpu.set_max_registers(producer_registers, action="decrease")

    def item(coords, tiles):
      i, n, b = coords
      lo, _, _, hi, _ = tile_range(i, b)
      kv_head = lax.div(n, jnp.int32(group))

      def load(j, _):
        t = j - lo if tiles is None else tiles + j - lo   # tiles through the slots before it
        slot = lax.rem(t, stages)
        rows = pl.ds(j * bk, bk)

        @pl.when(t >= stages)            # the slot held tile t - stages: wait until used
        def _():
          plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.copy_gmem_to_smem(r["k"].at[b, rows, kv_head], k_smem.at[slot], k_loaded.at[slot])

        @pl.when(t >= stages)
        def _():
          plgpu.barrier_wait(v_consumed.at[slot])
        plgpu.copy_gmem_to_smem(r["v"].at[b, rows, kv_head], v_smem.at[slot], v_loaded.at[slot])
      lax.fori_loop(lo, hi, load, None)
      return hi - lo if tiles is None else tiles + hi - lo

    total = for_each_item(item)

    def drain(t, _):   # the last tiles' consumption: every barrier phase is observed
      plgpu.barrier_wait(k_consumed.at[lax.rem(t, stages)])
      plgpu.barrier_wait(v_consumed.at[lax.rem(t, stages)])
    lax.fori_loop(jnp.maximum(0, total - stages), total, drain, None)


def compiler_params():
  """approx_math: exp2 and tanh from the multi-function unit's approximations; the
  "lane" lowering semantics pinned (explicit register layouts, as these kernels are
  written; jax 0.11 made "warpgroup" the default); no shared-memory scratch for
  reductions: every reduction here is along the rows of a warpgroup matrix-product
  tile, whose elements sit in the four lanes of one quad (PTX ISA, wgmma register
  fragments), so it needs only warp shuffles."""
  plgpu = _plgpu()
  return plgpu.CompilerParams(approx_math=True,
                              lowering_semantics=plgpu.LoweringSemantics.Lane,
                              reduction_scratch_bytes=0)


def flash_forward(q, k, v, *, scale: float, opts: MaskOptions | None = None,
                  ops: MaskOperands | None = None, config: MosaicConfig | None = None,
                  interpret: bool = False, num_sms: int | None = None):
  """q [B, T, N, H], k/v [B, S, K, H] (bf16/fp16) -> out [B, T, N, H], lse [B, N, T]
  float32 natural log. Rows past `ops.q_lengths` are left to the caller (the kernel
  treats every row < T as a query). `num_sms`: programs of the persistent grid (default:
  the device's multiprocessors; 2 when interpreted)."""
  plgpu = _plgpu()
  opts = opts or MaskOptions()
  ops = ops or MaskOperands()
  if opts.dropout_rate or ops.mask is not None or ops.bias is not None:
    raise NotImplementedError("the Mosaic GPU forward has no dense mask, bias or dropout")
  config = config or default_config(q.shape[-1], opts.is_causal, q.shape[1])
  check_supported(q, k, v, config)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  bq, bk = config.block_q, config.block_k
  C = config.consumers
  rows_per_program = C * bq
  Tp = round_up(T, rows_per_program)
  Sp = round_up(S, bk)
  # Tails. Q, K, V and O move as 2-D boxes of a [B, T|S, N|K, H] tensor map (Mosaic GPU
  # takes that path for every copy of a swizzled buffer, as these are), whose copies the
  # copy engine bounds per axis (`map_rows`). Keys past S are then zeros, masked in the
  # last tile (its class is never FULL); query rows past T are computed on zeros and
  # dropped by the store. Mosaic GPU builds the map over the shared-memory tiling of 8
  # rows, so T and S must be multiples of TMA_ROWS: only other lengths are padded in HBM
  # (a copy), up to the next multiple. The lse rows go out by a plain bulk copy, bounded
  # only by the whole array's end (rows past T of one head would land in the next), so
  # lse is written in whole tiles ([B, N, Tp], 4 bytes a row) and cut to T.
  # T_map, S_map: the lengths of the arrays the kernel's tensor maps are built over.
  T_map, S_map = map_rows(T, rows_per_program, interpret), map_rows(S, bk, interpret)
  qp, kp, vp = pad_axis(q, T_map, 1), pad_axis(k, S_map, 1), pad_axis(v, S_map, 1)
  ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=rows_per_program, block_k=bk)
  per_consumer = {}
  if config.consumer_ranges:     # a row per consumer's block_q rows, empty past T
    own_ranges = build_ranges(ops, opts, B=B, T=T, S=S, block_q=bq, block_k=bk)
    per_consumer = {"own_ranges": pad_axis(own_ranges, Tp // bq, 1)}
  seg = {}
  if ops.q_segment_ids is not None:
    # Read by plain loads, which nothing bounds: padded with ids that match nothing.
    seg = {"q_seg": pad_axis(ops.q_segment_ids, Tp, 1, FILL["q_seg"]),
           "kv_seg": pad_axis(ops.kv_segment_ids, Sp, 1, FILL["kv_seg"])}
  in_names = ["q", "k", "v", "ranges", *per_consumer, *seg]
  stages = max(2, min(config.stages, Sp // bk))
  config = dataclasses.replace(config, stages=stages)
  num_q_blocks = Tp // rows_per_program
  swizzled = smem_layout(H, q.dtype.itemsize)
  scratch = dict(
      qo_smem=plgpu.SMEM((C, bq, H), q.dtype, **swizzled),
      k_smem=plgpu.SMEM((stages, bk, H), q.dtype, **swizzled),
      v_smem=plgpu.SMEM((stages, bk, H), q.dtype, **swizzled),
      lse_smem=plgpu.SMEM((C, bq), jnp.float32),
      k_loaded=plgpu.Barrier(num_barriers=stages),
      v_loaded=plgpu.Barrier(num_barriers=stages),
      q_loaded=plgpu.Barrier(num_barriers=C),
      k_consumed=plgpu.Barrier(num_arrivals=C, num_barriers=stages),
      v_consumed=plgpu.Barrier(num_arrivals=C, num_barriers=stages),
      schedule=plgpu.Barrier(num_arrivals=2),        # the ping-pong pair (unused otherwise)
  )
  names = [*in_names, "out", "lse", *scratch]
  items_grid = (num_q_blocks, N, B)
  grid, grid_names, num_ctas = items_grid, ("q", "heads", "batch"), None
  if config.persistent:
    if num_sms is None:
      num_sms = 2 if interpret else getattr(jax.devices()[0], "core_count", None)
    if num_sms is None:
      raise ValueError("num_sms is needed for the persistent grid off a GPU (lowering only)")
    num_ctas = min(num_sms, math.prod(items_grid))
    grid, grid_names = (num_ctas,), ("sm",)
  kernel = functools.partial(
      _kernel, names=names, opts=opts, scale=scale, config=config, group=N // K,
      items_grid=items_grid, num_ctas=num_ctas,
      dtype=q.dtype, interpret=interpret)
  extra = {}
  if interpret:   # Mosaic GPU's own interpreter: simulated SMEM, barriers, TMA, warpgroups
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    extra["interpret"] = InterpretGPUParams()
  out, lse = plgpu.kernel(
      kernel,
      out_type=[jax.ShapeDtypeStruct((B, T_map, N, H), q.dtype),
                jax.ShapeDtypeStruct((B, N, Tp), jnp.float32)],
      scratch_types=list(scratch.values()),
      grid=grid,
      grid_names=grid_names,
      num_threads=C + 1,
      thread_name="wg",
      compiler_params=compiler_params(),
      **extra,
  )(qp, kp, vp, ranges, *per_consumer.values(), *seg.values())
  # XLA's dynamic-slice fusion (jax 0.11) folds a dynamic-update-slice of a custom
  # call's result (a scan stacking this output as a residual for the backward) into a
  # fusion around the call, and keeps the original call for the output's other users:
  # the kernel runs twice. The barrier hides the call from that rewrite and moves no
  # data; it can go once the XLA in use reroutes those users (openxla/xla#45799).
  out, lse = lax.optimization_barrier((out, lse))
  return out[:, :T], lse[:, :, :T]
