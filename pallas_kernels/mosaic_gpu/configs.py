"""The kernels' own records: the forward's `MosaicConfig` and the backward's
`BackwardConfig`, each validated as built (ValueError naming the field), their shared
memory, and what a call's shapes cannot run at a config (NotImplementedError).

Which config a call takes is the heuristics' (`heuristics`); these records say only
what each field means and which combinations exist.
"""
from __future__ import annotations

import dataclasses

from pallas_kernels.common import round_up
from pallas_kernels.mosaic_gpu.common import (DEFAULT_CONSUMER_REGISTERS, MAX_BARRIERS,
                                              MIN_REGISTERS, ROWS, SMEM_ALIGN, SMEM_BYTES,
                                              SMEM_SLACK, check_head_dim_and_dtype,
                                              check_shared_memory,
                                              launch_registers, register_split,
                                              table_head_dim)
from pallas_kernels.mosaic_gpu.scheduler import check_l2_group

CONSUMER_COUNTS = (2, 3)            # the forward's consumer warpgroups per program


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles and compile options of the Mosaic GPU forward.

  block_q: query rows per consumer warpgroup (a program owns consumers * block_q
    rows); a multiple of 64, the M of one warpgroup matrix product.
  block_k: key/value rows per pipeline slot (the N of S = Q K^T, <= 256).
  stages: shared-memory slots of K and V in flight.
  persistent: one program per multiprocessor looping over the (query block, head,
    batch) items, so that one item's pipeline fill and output store overlap the
    next item's loads (its Q too, where two Q slots fit: `forward_q_slots`), and no
    partial last wave is launched.
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
    return register_split(self.consumers, self.consumer_registers)


def forward_smem_bytes(head_dim: int, itemsize: int, config: MosaicConfig,
                       q_slots: int = 1) -> int:
  """Shared memory of one program: `q_slots` slots of Q (reused for O), the K/V slots,
  lse rows, slack. (The compile reserves no reduction scratch: `compiler_params`.)"""
  q = q_slots * config.consumers * config.block_q * head_dim * itemsize
  kv = 2 * config.stages * config.block_k * head_dim * itemsize
  return q + kv + config.consumers * config.block_q * 4 + SMEM_SLACK


def forward_q_slots(head_dim: int, itemsize: int, config: MosaicConfig) -> int:
  """Slots of each consumer's Q (and O) in shared memory: two in a persistent program
  where they fit, so that each consumer loads its next item's Q while it computes this
  one (its wait for that load otherwise opens every item); one otherwise."""
  if config.persistent and forward_smem_bytes(head_dim, itemsize, config, 2) <= SMEM_BYTES:
    return 2
  return 1


def check_forward(q, k, v, config: MosaicConfig):
  """Raises NotImplementedError naming what the forward cannot run at `config`."""
  check_head_dim_and_dtype(q, "forward")
  if config.consumers == 3:
    # A launch of four warpgroups has 128 registers per thread, and ptxas held the
    # consumers' matrix products to that although setmaxnreg raises them to 160: at
    # d = 256 it refused the 64 x 256 float32 accumulator ("Insufficient registers
    # (128) ... register target of 158 or higher").
    # Three take 64-row consumers, key tiles <= 128, d <= 128.
    H = q.shape[-1]
    if H > 128 or config.block_q != 64 or config.block_k > 128:
      raise NotImplementedError(
          f"three consumer warpgroups support head_dim <= 128, block_q=64 and "
          f"block_k <= 128 (their products must fit 128 registers per thread); got "
          f"head_dim={H}, {config}")
  check_shared_memory(config, q.shape[-1], forward_smem_bytes(q.shape[-1], q.dtype.itemsize, config))


# Registers per consumer thread of the warp-specialised kernels after setmaxnreg:
# FlashAttention-3's backward split, 240 / 240 / 24 (the producer keeps setmaxnreg's
# floor). A dK/dV consumer holds dK and dV (64 + 64 registers at d = 128) beside the
# tile's S^T, dP^T and their bf16 copies, which ptxas spills at the forward's 232. Three
# consumers (the dQ kernel's `dq_consumers=3`) take FlashAttention-3's three-consumer
# split, 160 / 160 / 160 / 32, the most a launch of four warpgroups leaves them beside
# the producer's floor (`launch_registers`).
CONSUMER_REGISTERS = {2: 240, 3: DEFAULT_CONSUMER_REGISTERS[3]}


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
  """Tiles and compile options of the Mosaic GPU backward. The dK/dV kernel's programs
  run two consumer warpgroups, each owning 64 keys, and a producer warpgroup that
  streams the query tiles both read through `stages` slots (FlashAttention-3's warp
  specialisation), the consumers at CONSUMER_REGISTERS[2]; above head_dim 128 the two
  share 64 keys by role (`by_role`).

  block_n: the N of each kernel's first products: query rows per tile in the dK/dV
    kernel (S^T is [64, block_n]), key rows per tile in the dQ kernel (S is
    [64, block_n]) unless `dq_block_n` sets those; a multiple of 64, <= 256.
  stages: shared-memory slots of the tiles a producer warpgroup streams (a dQ program
    of one warpgroup double-buffers its own).
  group_splits: programs per key tile of the dK/dV kernel, each looping over its own
    share of the GQA group's G query heads (program s of group_splits = n runs heads
    [s G / n, (s + 1) G / n)): a causal dK/dV grid of few programs then fills the GPU,
    where one wave lasts as long as its heaviest program. Each program stores float32
    partial dK and dV and flash_backward sums them in a fixed order (deterministic).
    Must divide the call's group (NotImplementedError otherwise, `check_supported`).
  dq_block_n: key rows per tile of the dQ kernel (the N of its S and dP), where it
    differs from the dK/dV kernel's block_n; None: block_n.
  dq_consumers: the dQ kernel's consumer warpgroups (`dq_consumers_of`): None takes
    two, or one at the head dims split by role (dQ alone holds d / 2 registers per
    thread, and at d = 256 two consumers' Q and dO beside two K/V slots exceed shared
    memory). 1: one warpgroup streams its own key tiles. 2 or 3: a producer
    warpgroup streams K and V to consumers of 64 query rows each; three at
    CONSUMER_REGISTERS[3], up to head_dim 128.
  dq_rows_in_registers: the dQ kernel's consumers hold their fixed Q and dO rows in
    registers, as the A operands of S = Q K^T and dP = dO V^T, so that those products
    read only K and V from shared memory: a product m64nNk16 with both operands in
    shared memory reads (64 + N) x 16 x 2 bytes per 64 N 16 multiply-adds, at N = 64
    all of shared memory's 128 bytes per cycle (32 banks of 4 bytes) at the tensor
    cores' dense rate; with A in registers, half of it.
  persistent: each kernel launches one program per multiprocessor, which loops over
    the work items (key tiles of the dK/dV kernel, query blocks of the dQ kernel, by
    head and batch; `scheduler.item_coords` orders them), so that the producer's loads
    of the next item's streamed tiles overlap this item's last products and its
    stores, and no partial last wave is launched. Under jax.vmap the launch's batching
    rule adds a grid axis: one persistent grid per mapped problem. Not with
    dq_consumers=1, not at the head dims split by role.
  stats_streamed: the dK/dV kernel's producer also streams each query tile's lse and
    delta ([block_n] float32 each) into shared-memory slots beside Q and dO, and the
    consumers read lse after S^T's product and delta after dP^T's (JAX's Mosaic GPU
    kernel), in place of loading both at the tile's start, where they stay live in
    registers through the tile's products. Not at the head dims split by role.
  dkv_p_under_dp: the dK/dV kernel issues dP^T = V dO^T right behind S^T = K Q^T and
    waits for S^T alone, so that P^T's exponentials run under the dP^T product; dV +=
    P^T dO is issued once both are waited for, and dS'^T computed under it
    (FlashAttention-3's order). False issues dP^T after P^T, with dV behind it
    (tokamax's order). Not at the head dims split by role.
  dq_p_under_dp: the dQ kernel waits for S = Q K^T alone of the two products it issues
    back to back, so that P's exponentials run under dP = dO V^T; False waits for both.
  l2_group: with `persistent` and a causal mask, each kernel's tiles (key tiles of the
    dK/dV kernel, query blocks of the dQ kernel) go to the programs in groups of this
    many consecutive ones of one head (`scheduler.item_coords`), so that programs
    running at once share that head's streamed tiles in L2; 1: one head per program of
    a round. No other grid reads it.
  """

  block_n: int = 64
  stages: int = 2
  group_splits: int = 1
  dq_block_n: int | None = None
  dq_consumers: int | None = None
  dq_rows_in_registers: bool = False
  persistent: bool = False
  stats_streamed: bool = False
  dkv_p_under_dp: bool = False
  dq_p_under_dp: bool = False
  l2_group: int = 1

  def __post_init__(self):
    if not isinstance(self.block_n, int) or self.block_n % 64 or not 0 < self.block_n <= 256:
      raise ValueError(f"block_n={self.block_n!r} must be 64, 128, 192 or 256")
    if not isinstance(self.stages, int) or self.stages < 2:
      raise ValueError(f"stages={self.stages!r} must be an int >= 2")
    if self.dq_block_n is not None and (not isinstance(self.dq_block_n, int)
                                        or self.dq_block_n % 64 or not 0 < self.dq_block_n <= 256):
      raise ValueError(f"dq_block_n={self.dq_block_n!r} must be None, 64, 128, 192 or 256")
    for name in ("dq_rows_in_registers", "persistent", "stats_streamed", "dkv_p_under_dp",
                 "dq_p_under_dp"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
    if isinstance(self.group_splits, bool) or not isinstance(self.group_splits, int) \
        or self.group_splits < 1:
      raise ValueError(f"group_splits={self.group_splits!r} must be a positive int")
    if self.dq_consumers is not None and (isinstance(self.dq_consumers, bool)
                                          or self.dq_consumers not in (1, 2, 3)):
      raise ValueError(f"dq_consumers={self.dq_consumers!r} must be None, 1, 2 or 3")
    check_l2_group(self.l2_group)
    if self.persistent and self.dq_consumers == 1:
      raise ValueError("persistent=True runs programs of a producer and consumers: "
                       "dq_consumers=1 needs persistent=False")
    barriers = loaded_barriers(self.stages, self.stats_streamed)
    if barriers > MAX_BARRIERS:
      why = "four per slot with stats_streamed" if self.stats_streamed else "two per slot"
      raise ValueError(f"stages={self.stages} needs {barriers} \"loaded\" barriers ({why}); "
                       f"Mosaic GPU allocates at most {MAX_BARRIERS} in a group")


def loaded_barriers(stages: int, stats_streamed: bool) -> int:
  """The "loaded" barriers of a backward kernel's slots: two per slot (the tile and its
  partner), four with stats_streamed (lse and delta beside them)."""
  return (4 if stats_streamed else 2) * stages


def by_role(head_dim: int) -> bool:
  """Whether the dK/dV kernel splits its work by output (`_dkv_by_role`): at the head
  dims that take d = 256's tiles (`table_head_dim`: above 128) a consumer's
  dK and dV of 64 keys would take 2 x 64 x d float32 / 128 threads = d registers (256
  at d = 256, more than a thread has), so one consumer holds dK and the other dV of
  the same keys; the dQ kernel (dQ alone takes d / 2) runs two consumers there where
  their rows fit shared memory (`call_config`), else one warpgroup (`dq_consumers_of`)."""
  return table_head_dim(head_dim) == 256


def stream_slots(consumers: int, stages: int) -> int:
  """Shared-memory slots of a kernel's streamed tiles: `stages` behind a producer
  warpgroup, two (double buffering) for one warpgroup that streams its own."""
  return 2 if consumers == 1 else stages


def dq_consumers_of(head_dim: int, config: BackwardConfig) -> int:
  """The dQ kernel's consumer warpgroups: `dq_consumers`, or by default two, and one at
  the head dims split by role (`BackwardConfig.dq_consumers`)."""
  if config.dq_consumers is not None:
    return config.dq_consumers
  return 1 if by_role(head_dim) else 2


def dkv_keys(head_dim: int, config: BackwardConfig) -> int:
  """Keys per dK/dV program: 64 per consumer, or 64 shared by the two split by role."""
  return ROWS if by_role(head_dim) else 2 * ROWS


def dkv_programs(B: int, K: int, S: int, head_dim: int, config: BackwardConfig) -> int:
  """Programs of the dK/dV grid: batch x key heads x key tiles x group splits."""
  return B * K * -(-S // dkv_keys(head_dim, config)) * config.group_splits


def backward_smem_bytes(head_dim: int, itemsize: int, config: BackwardConfig) -> int:
  """Shared memory of the larger of the two kernels' programs: each consumer's two
  fixed 64-row tiles and the two streamed operands' slots (block_n rows in the dK/dV
  kernel, `dq_block_n` in the dQ kernel, whose consumers `dq_consumers_of` counts),
  plus the forward's slack for barriers and alignment; with `group_splits` > 1, each
  consumer's float32 tile of partial dK, then dV, on the way to global memory; with
  `stats_streamed`, the lse and delta slots."""
  slots = config.stages
  tile = ROWS * head_dim * itemsize
  streamed = lambda rows, slots=slots: slots * 2 * rows * head_dim * itemsize
  dq_rows = config.dq_block_n or config.block_n
  partial = 2 * ROWS * head_dim * 4 if config.group_splits > 1 else 0
  dq_c = dq_consumers_of(head_dim, config)
  # dQ: each consumer's Q and dO, and the K, V slots.
  dq = dq_c * 2 * tile + streamed(dq_rows, stream_slots(dq_c, config.stages))
  if by_role(head_dim):
    # dK/dV: K and V once (one consumer each), two slots of the P^T tile and one of the
    # float32 dP^T tile they pass each other.
    passed = ROWS * config.block_n * (2 * itemsize + 4)
    dkv = 2 * tile + streamed(config.block_n) + passed + partial
    return max(dkv, dq) + SMEM_SLACK
  fixed = 2 * 2 * tile
  if config.stats_streamed:    # lse and delta slots beside Q and dO, each buffer aligned
    fixed += 2 * round_up(slots * config.block_n * 4, SMEM_ALIGN)
  dkv = fixed + streamed(config.block_n) + partial
  return max(dkv, dq) + SMEM_SLACK


def by_role_error(head_dim: int, config: BackwardConfig) -> str | None:
  """Why the backward cannot run `config` at `head_dim`, or None: split by role
  (`by_role`), the dK/dV kernel runs no group split (its float32 partial tiles of
  64 x 256 would not fit shared memory either), no persistent grid and its own tile
  loop."""
  if by_role(head_dim) and (config.group_splits != 1 or config.dq_rows_in_registers
                            or config.persistent or config.stats_streamed
                            or config.dkv_p_under_dp):
    return (f"the Mosaic GPU backward at head_dim={head_dim} runs two consumers, one "
            f"holding dK and one dV, no group split, no fixed rows in registers, no "
            f"persistent grid and its own tile loop: got "
            f"group_splits={config.group_splits}, "
            f"dq_rows_in_registers={config.dq_rows_in_registers}, "
            f"persistent={config.persistent}, stats_streamed={config.stats_streamed}, "
            f"dkv_p_under_dp={config.dkv_p_under_dp}")
  return None


def group_split_error(group: int, splits: int) -> str | None:
  """Why `splits` programs cannot share a GQA group of `group` query heads, or None:
  each program runs group / splits of them."""
  if group % splits:
    return f"group_splits={splits} does not divide the GQA group of {group}"
  return None


def check_backward(q, k, v, config: BackwardConfig):
  """Raises NotImplementedError naming what the backward cannot run at `config`."""
  check_head_dim_and_dtype(q, "backward")
  if config.dq_consumers == 3 and q.shape[-1] > 128:
    # As the forward's three consumers (`check_forward`): ptxas holds their
    # products to a launch of four warpgroups' 128 registers per thread, and only what
    # compiles with three is taken, up to head_dim 128.
    raise NotImplementedError(f"dq_consumers=3 supports head_dim <= 128, got "
                              f"head_dim={q.shape[-1]}")
  why = by_role_error(q.shape[-1], config)
  if why:
    raise NotImplementedError(why)
  why = group_split_error(q.shape[2] // k.shape[2], config.group_splits)
  if why:
    raise NotImplementedError(f"{why} query heads per key head ({q.shape[2]} query heads, "
                              f"{k.shape[2]} key heads)")
  check_shared_memory(config, q.shape[-1], backward_smem_bytes(q.shape[-1], q.dtype.itemsize, config))
