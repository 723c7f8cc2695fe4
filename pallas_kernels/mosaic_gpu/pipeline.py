"""The backward kernels' shared machinery: warpgroup matrix products (or plain dots
under the interpreter), bulk-copy loads and stores, the shared-memory slots a producer
warpgroup streams to its consumers (FlashAttention-3's warp specialisation) or one
warpgroup double-buffers for itself, and the persistent program's loop over them.
Every shared-memory buffer a copy moves is passed as its `Tiles`: the copies move its
`copy` view, the products and register stores use its `mma` view.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.mosaic_gpu.common import Tiles, import_plgpu, register_split
from pallas_kernels.mosaic_gpu.configs import CONSUMER_REGISTERS
from pallas_kernels.mosaic_gpu.scheduler import PersistentGrid, persistent_items


# The backward's tile buffers of the input dtype (`tile_smem`: a rows view where rows are
# swizzle rows) and its other buffers that bulk copies move (float32, one view).
TILE_BUFFERS = ("q_smem", "do_smem", "k_smem", "v_smem")
PLAIN_BUFFERS = ("lse_smem", "delta_smem", "partial_smem")


def kernel_refs(names, refs, rows_view: bool) -> dict:
  """A kernel's refs by name, each buffer of TILE_BUFFERS and PLAIN_BUFFERS as its
  `Tiles`."""
  r = dict(zip(names, refs))
  for name in TILE_BUFFERS + PLAIN_BUFFERS:
    if name in r:
      r[name] = Tiles.of(r[name], rows_view and name in TILE_BUFFERS)
  return r


class Products:
  """Warpgroup matrix products, or plain dots under the interpreter. `a` is a value in
  registers or a shared-memory ref, `b` a shared-memory ref, used as b^T with `b_t` (a
  transposed view: no data moves). Running sums live in `accumulators` (float32 refs:
  the matrix-product accumulator registers on the GPU, shared memory under the
  interpreter) and are added to asynchronously by `issue`; `wait` waits for every
  product in flight."""

  def __init__(self, interpret, scratch=None):
    self.interpret = interpret
    self.scratch = scratch      # interpreter: [accumulator, consumer, rows, cols] float32

  @staticmethod
  def _dot(a, b, b_t):
    a, b = a[...], b[...]         # a ref or a value alike
    return jnp.dot(a, b.T if b_t else b, preferred_element_type=jnp.float32)

  @staticmethod
  def _t(ref, transposed):
    return ref.transpose((1, 0)) if transposed else ref

  def fresh(self, a, b, shape, *, b_t=False):
    """a @ b(^T) into a new float32 accumulator, waited for."""
    return self.fresh_pair(a, b, None, None, shape, b_t=b_t)[0]

  def fresh_pair(self, a1, b1, a2, b2, shape, *, b_t=False, under_second=None):
    """(a1 @ b1(^T), a2 @ b2(^T)), issued back to back, then both waited for (the
    second product's issue does not wait for the first's result). a2 None: one.
    `under_second`: a function of the first result, run after waiting for the first
    product alone, so that it runs under the second; (its value, the second) returned."""
    assert under_second is None or a2 is not None, "under_second runs under a second product"
    after = under_second or (lambda first: first)
    if self.interpret:
      return after(self._dot(a1, b1, b_t)), (None if a2 is None else self._dot(a2, b2, b_t))
    plgpu = import_plgpu()

    def run(acc1, acc2):
      plgpu.wgmma(acc1, a1, self._t(b1, b_t))
      if a2 is not None:
        plgpu.wgmma(acc2, a2, self._t(b2, b_t))
      if under_second is None:
        return acc1[...], (None if a2 is None else acc2[...])
      first = after(plgpu.wgmma_accumulator_load(acc1, wait_n=1))
      return first, plgpu.wgmma_accumulator_load(acc2, wait_n=0)
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))

  def fresh_under(self, a, b, shape, *, b_t, then):
    """a @ b(^T) into a new accumulator, with `then` = (acc, a2, b2), acc += a2 @ b2,
    issued right after it and left in flight: only the first is waited for, so the
    caller's next instructions run under the second (FlashAttention-3's overlap of
    dP^T with the dV product in the backward)."""
    acc, a2, b2 = then
    if self.interpret:
      acc[...] += self._dot(a2, b2, False)
      return self._dot(a, b, b_t)
    plgpu = import_plgpu()

    def run(fresh):
      plgpu.wgmma(fresh, a, self._t(b, b_t))
      plgpu.wgmma(acc, a2, b2)
      return plgpu.wgmma_accumulator_load(fresh, wait_n=1)
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

  def issue(self, acc, a, b):
    """acc += a @ b, left in flight on the GPU."""
    if self.interpret:
      acc[...] += self._dot(a, b, False)
    else:
      import_plgpu().wgmma(acc, a, b)

  def wait(self):
    if not self.interpret:
      import_plgpu().wgmma_wait(0)

  def accumulators(self, shape, count, body, consumer=0):
    """Runs body(*refs) with `count` zeroed float32 accumulators of `shape` and returns
    their final values. (The interpreter allocates shared memory only for all
    warpgroups at once, so there they are slices of the kernel's `scratch`.)"""
    plgpu = import_plgpu()
    if self.interpret:
      refs = [self.scratch.at[a, consumer] for a in range(count)]
      for ref in refs:
        ref[...] = jnp.zeros(shape, jnp.float32)
      body(*refs)
      return tuple(ref[...] for ref in refs)

    def run(*refs):     # ACC scratch starts at zero
      body(*refs)
      return tuple(plgpu.wgmma_accumulator_load(ref) for ref in refs)
    return pl.run_scoped(run, *[plgpu.ACC(shape, jnp.float32)] * count)


def load_tile(src, dst, barrier):
  load_tiles([(src, dst, barrier)])


def load_tiles(loads):
  """Copies each (src, dst, barrier) of `loads` to shared memory, all issued before the
  first is waited for: their latencies overlap."""
  plgpu = import_plgpu()
  for src, dst, barrier in loads:
    plgpu.copy_gmem_to_smem(src, dst.copy, barrier)
  for _, _, barrier in loads:
    plgpu.barrier_wait(barrier)


def load_fixed(loads):
  """A work item's fixed tiles, each (src, dst, barrier), one tile loaded and waited
  for at a time."""
  for load in loads:
    load_tiles([load])


def store_outputs(stores):
  """A work item's outputs, each (x, smem, dst) through its own tile, each stored and
  waited for in full."""
  for store in stores:
    store_tiles([store])


def store_tile(x, smem, dst, read_only=False):
  store_tiles([(x, smem, dst)], read_only)


def store_tiles(stores, read_only=False):
  """Stores each (x, smem, dst) of `stores` through its shared-memory tile, all copies
  issued before one wait: for their completion, or with `read_only` only until the
  copy engine has read shared memory, which may then be rewritten (the global writes
  complete with the kernel: CUTLASS's Hopper epilogues end on the same wait,
  `tma_store_wait<0>`, cp.async.bulk.wait_group.read, and so does JAX's persistent
  Mosaic GPU matmul, `hopper_matmul_mgpu.py`, which also reuses its output tile after
  it)."""
  plgpu = import_plgpu()
  for x, smem, _ in stores:
    smem.mma[...] = x.astype(smem.mma.dtype)
  plgpu.commit_smem()
  for _, smem, dst in stores:
    plgpu.copy_smem_to_gmem(smem.copy, dst)
  plgpu.wait_smem_to_gmem(0, wait_read_only=read_only)


class Stream:
  """Two streamed operands (Q and dO, or K and V) in two shared-memory slots: the tile
  after the current one is copied into the other slot while this one is computed on
  (double buffering). The other slot held the previous tile, whose products were all
  waited for (`Products.wait` at the end of each tile) before the next copy is issued. Each slot's
  barriers complete once per copy and are waited on once per tile."""

  def __init__(self, srcs, smems, loaded):
    self.srcs, self.smems, self.loaded = srcs, smems, loaded   # loaded: [operand, slot]

  def start(self, slot, *coords):
    plgpu = import_plgpu()
    for a, (src, smem) in enumerate(zip(self.srcs, self.smems)):
      plgpu.copy_gmem_to_smem(src(*coords), smem.copy.at[slot], self.loaded.at[2 * a + slot])

  def wait(self, slot):
    plgpu = import_plgpu()
    for a in range(len(self.srcs)):
      plgpu.barrier_wait(self.loaded.at[2 * a + slot])
    return tuple(smem.mma.at[slot] for smem in self.smems)


class Pipeline:
  """Streamed operands in `stages` shared-memory slots between a producer warpgroup,
  which only issues the bulk copies, and consumer warpgroups that all read every tile
  (FlashAttention-3, section 3.1): slot t % stages holds tile t; its "loaded" barriers
  complete when the copy engine has written it, its "consumed" barrier when every
  consumer has released it (one arrival each). Each completion is waited on exactly
  once: "loaded" by each consumer, "consumed" by the producer before it refills the
  slot, or in `drain` for the last tiles.

  The refill is a bulk copy, an async-proxy write, which a barrier orders after the
  consumers' async-proxy reads (the tensor cores') but not after their generic-proxy
  reads (loads into registers) without a proxy fence (PTX ISA, memory consistency
  model, "proxies"). With `generic_reads` (lse and delta loaded from their slots; under
  the interpreter, whose products are plain loads, always) each consumer fences
  (fence.proxy.async, `commit_smem`) before it releases a slot."""

  def __init__(self, srcs, smems, loaded, consumed, stages, generic_reads=False):
    self.srcs, self.smems, self.stages = srcs, smems, stages
    self.loaded, self.consumed = loaded, consumed          # loaded: [operand, slot]
    self.generic_reads = generic_reads

  def produce(self, t, *coords):
    plgpu = import_plgpu()
    slot = lax.rem(t, self.stages)

    @pl.when(t >= self.stages)        # the slot held tile t - stages: wait until released
    def _():
      plgpu.barrier_wait(self.consumed.at[slot])
    for a, (src, smem) in enumerate(zip(self.srcs, self.smems)):
      plgpu.copy_gmem_to_smem(src(*coords), smem.copy.at[slot],
                              self.loaded.at[a * self.stages + slot])

  def acquire(self, t):
    plgpu = import_plgpu()
    slot = lax.rem(t, self.stages)
    for a in range(len(self.smems)):
      plgpu.barrier_wait(self.loaded.at[a * self.stages + slot])
    return tuple(smem.mma.at[slot] for smem in self.smems)

  def release(self, t):
    plgpu = import_plgpu()
    if self.generic_reads:
      plgpu.commit_smem()
    plgpu.barrier_arrive(self.consumed.at[lax.rem(t, self.stages)])

  def drain(self, total):
    def wait(t, _):
      import_plgpu().barrier_wait(self.consumed.at[lax.rem(t, self.stages)])
    lax.fori_loop(jnp.maximum(0, total - self.stages), total, wait, None)


def warp_specialised(wg, consumers, produce, consume):
  """Warpgroup `consumers` runs `produce` with a small register file; the others run
  `consume(wg)` with the registers it gives up (setmaxnreg)."""
  plgpu = import_plgpu()
  consumer_registers, producer_registers = register_split(consumers,
                                                         CONSUMER_REGISTERS[consumers])

  @pl.when(wg == consumers)
  def _():
    plgpu.set_max_registers(producer_registers, action="decrease")
    produce()

  @pl.when(wg < consumers)
  def _():
    plgpu.set_max_registers(consumer_registers, action="increase")
    consume(wg)



def producer_and_consumers(r, fixed, streamed, *, consumers, stages, rows, generic_reads):
  """The plumbing of a kernel whose producer warpgroup streams `streamed` (the names of
  two refs, or four with `stats_streamed`; `generic_reads` as `Pipeline`'s) to
  consumers that each own 64 rows of `fixed` (two more): (pipe(srcs), the
  producer's side of the slots for sources `srcs`; slots, the consumers' side and the
  final drain; consume_as(wg, block, consume, count=None) -> count, which runs
  consume(wg, fixed tiles, their barriers, first row, tiles, count) for consumer wg of
  the program's block, its rows (block * consumers + wg) * rows on)."""
  loaded = r["fixed_loaded"]
  pipe = lambda srcs: Pipeline(srcs, [r[name] for name in streamed], r["loaded"],
                                r["consumed"], stages, generic_reads)
  slots = pipe(None)

  def consume_as(wg, block, consume, count=None):
    return consume(wg, *(r[name].at[wg] for name in fixed),
                   (loaded.at[2 * wg], loaded.at[2 * wg + 1]), (block * consumers + wg) * rows,
                   (None, None, slots.acquire, slots.release), count)
  return pipe, slots, consume_as


def run_persistent(persistent: PersistentGrid, pipe, item_of, produce, consume, snake,
                    consumers=2):
  """A persistent program of `consumers` consumers and a producer: the producer runs
  produce(item, count) -> count over this program's work items (`persistent_items`;
  item_of(w) gives item w) and then waits for the last slots' release; each consumer
  runs consume(wg, item, count) -> count over the same items."""
  num_items, num_ctas = persistent.items, persistent.programs

  def produce_all():
    pipe.drain(persistent_items(num_items, num_ctas,
                                lambda w, count, _: produce(item_of(w), count), snake))

  def consume_all(wg):
    persistent_items(num_items, num_ctas,
                     lambda w, count, _: consume(wg, item_of(w), count), snake)
  warp_specialised(lax.axis_index("wg"), consumers, produce_all, consume_all)
