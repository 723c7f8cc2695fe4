"""Shared pieces of the Hopper kernels: hardware limits, shared-memory layouts, tails,
the compile options, register layouts and the per-tile softmax algebra of the backward.

Every other module of the package imports from here; this one imports none of them.
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.common import round_up
from pallas_kernels.masking import MaskOptions, StaticRanges

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Head dims: multiples of HEAD_DIM_STEP up to MAX_HEAD_DIM. Q, K, V and O sit in shared
# memory as atoms of 8 rows by one swizzle width (128, 64 or 32 bytes), the layout the
# copy engine writes and the tensor cores read (PTX ISA, wgmma: matrix descriptors and
# swizzling modes), and a row of head_dim elements must fill whole atoms: 16 elements at
# 2 bytes is the narrowest (`smem_layout`). 256 is the largest N of one warpgroup product
# (O += P V is [64, head_dim]).
HEAD_DIM_STEP, MAX_HEAD_DIM = 16, 256
# The tiers of tiles: a head dim takes the tiles of the next one up (`table_head_dim`),
# whose registers and shared memory it needs at most.
TABLE_HEAD_DIMS = (64, 128, 256)
SWIZZLES = (128, 64, 32)            # bytes per row of a swizzle atom, widest first
DTYPES = (jnp.bfloat16, jnp.float16)
SMEM_BYTES = 227 * 1024             # shared memory a Hopper block may use
CUDA_GRID_YZ = 65535                # blocks a launch's y or z grid axis may have (CUDA)
# Mosaic GPU allocates a kernel's barriers in groups of at most 32 (its BarrierRef): a
# pipeline's per-slot barriers of one kind are one group.
MAX_BARRIERS = 32
# Shared memory beside the tiles: the mbarriers (8 bytes each) and the alignment of
# each swizzled buffer to its swizzle atom (1024 bytes at the widest swizzle).
SMEM_SLACK = 1024
# Pallas places each shared-memory buffer at a 1024-byte boundary.
SMEM_ALIGN = 1024
ROWS = 64        # M of one warpgroup matrix product: a consumer's rows
# Rows of the shared-memory tiling (one swizzle atom per 8 rows, `smem_layout`) that
# Mosaic GPU lays a tensor map's box over: the map's row count must be a
# multiple of it.
TMA_ROWS = 8

# Registers per thread: a launch of n warpgroups gets 65536 / (128 n) each, rounded down
# to the allocation unit of 8 (168 for three warpgroups, 128 for four), and `setmaxnreg`
# only moves registers between warpgroups inside that pool; it can raise a count only
# above the launch's, and the producer, which issues copies and waits on barriers, keeps
# at least 24, setmaxnreg's lower bound (PTX ISA, setmaxnreg). The JAX and tokamax
# kernels split 232/232/40; FlashAttention-3 (hopper/flash_fwd_kernel_sm90.h) 240/240/24
# with two consumers and 160/160/160/32 with three.
MIN_REGISTERS = 24
DEFAULT_CONSUMER_REGISTERS = {2: 232, 3: 160}


def check_launch(grid, names):
  """NotImplementedError unless a launched grid fits CUDA's: Mosaic GPU puts its last
  axis on x (up to 2^31 - 1 blocks), the one before on y and the product of the rest
  on z (up to CUDA_GRID_YZ each)."""
  grid = (1,) * (3 - len(grid)) + tuple(grid)
  names = ("",) * (len(grid) - len(names)) + tuple(names)
  z, y, x = math.prod(grid[:-2]), grid[-2], grid[-1]
  if z > CUDA_GRID_YZ or y > CUDA_GRID_YZ or x > 2 ** 31 - 1:
    shape = ", ".join(f"{n}={g}" for n, g in zip(names, grid) if n)
    raise NotImplementedError(
        f"a launched grid of ({shape}) blocks: CUDA's grid takes at most {CUDA_GRID_YZ} "
        f"on y ({names[-2] or '-'}: {y}) and z ({' x '.join(n for n in names[:-2] if n) or '-'}: "
        f"{z}) and 2^31 - 1 on x")


def device_sms(num_sms: int | None, interpret: bool) -> int:
  """The multiprocessors a grid is laid out for (a persistent grid's programs, a causal
  launched grid's order): `num_sms` where given, else the device's, 2 when interpreted
  (grids of several programs). ValueError when lowering off a GPU without it, or for
  anything but a positive int."""
  if num_sms is None:
    num_sms = 2 if interpret else getattr(jax.devices()[0], "core_count", None)
    if num_sms is None:
      raise ValueError("num_sms is needed off a GPU (lowering only)")
  if isinstance(num_sms, bool) or not isinstance(num_sms, numbers.Integral) or num_sms < 1:
    raise ValueError(f"num_sms={num_sms!r} must be a positive int")
  return int(num_sms)


def launch_registers(consumers: int) -> int:
  return 65536 // (128 * (consumers + 1)) // 8 * 8


def register_split(consumers: int, consumer_registers: int | None = None) -> tuple[int, int]:
  """(registers per consumer thread, per producer thread) after `setmaxnreg` for
  `consumers` consumer warpgroups at `consumer_registers` (None: the default)."""
  c = DEFAULT_CONSUMER_REGISTERS[consumers] if consumer_registers is None else consumer_registers
  return c, launch_registers(consumers) * (consumers + 1) - consumers * c


def import_plgpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # imported where it is used
  return plgpu


def load_vector(ref, layout, interpret):
  """A 1-D slice of a GMEM (or SMEM) ref in a register layout. The interpreter has no
  `plgpu.load`; the plain read gives the same values there."""
  if interpret:
    return ref[...]
  plgpu = import_plgpu()
  if "idx" in inspect.signature(plgpu.load).parameters and \
      inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout, optimized=False)   # jax 0.10: idx positional
  # optimized=False: plain loads (the optimized path reads SMEM only, in its own layouts).
  return plgpu.load(ref, layout=layout, optimized=False)


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


def check_head_dim_and_dtype(q, what: str):
  """NotImplementedError naming a head_dim the kernel called `what` cannot run
  (`head_dim_error`) or a dtype other than bf16/fp16."""
  why = head_dim_error(q.shape[-1], what)
  if why:
    raise NotImplementedError(why)
  if not any(q.dtype == d for d in DTYPES):
    raise NotImplementedError(
        f"the Mosaic GPU {what} supports bfloat16 and float16, got {q.dtype}")


def check_shared_memory(config, head_dim: int, need: int):
  """NotImplementedError naming a config whose programs need more than SMEM_BYTES."""
  if need > SMEM_BYTES:
    raise NotImplementedError(
        f"{config} at head_dim={head_dim} needs {need} bytes of shared memory (> {SMEM_BYTES})")


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
  plgpu = import_plgpu()
  swizzle = swizzle_bytes(cols, itemsize)
  return dict(transforms=(plgpu.TilingTransform((TMA_ROWS, swizzle // itemsize)),
                          plgpu.SwizzleTransform(swizzle)))


def rows_are_swizzle_rows(cols: int, itemsize: int) -> bool:
  """Whether a row of `cols` elements is exactly one swizzle row (head dims 16, 32 and 64
  at 2 bytes): then a tile's 8-row atoms (`smem_layout`) hold its rows one after another,
  the same bytes as the rows untiled under the same swizzle, and the bulk copies can move
  the tile as plain rows (`tile_smem`), over a tensor map of any row count."""
  return cols * itemsize == swizzle_bytes(cols, itemsize)


def tile_smem(shape, dtype, rows_view: bool):
  """Shared memory for tiles of `shape`: tiled and swizzled (`smem_layout`), as the
  matrix products read them; with `rows_view` (`rows_are_swizzle_rows`) also as plain
  swizzled rows over the same bytes (a union of the two views, both at its start), which
  the bulk copies use (`Tiles`)."""
  plgpu = import_plgpu()
  itemsize = jnp.dtype(dtype).itemsize
  tiled = plgpu.SMEM(shape, dtype, **smem_layout(shape[-1], itemsize))
  if not rows_view:
    return tiled
  swizzle = swizzle_bytes(shape[-1], itemsize)
  rows = plgpu.SMEM(shape, dtype, transforms=(plgpu.SwizzleTransform(swizzle),))
  return plgpu.RefUnion(tiled, rows)


class Tiles(NamedTuple):
  """A shared-memory tile buffer as the kernels use it: `mma`, the view the matrix
  products read and registers are stored to, and `copy`, the view the bulk copies move
  (`tile_smem`'s rows view, or the same ref where it has none). `tiles.at[i]` indexes
  both, as a ref's `.at[i]` does."""
  mma: Any
  copy: Any

  @classmethod
  def of(cls, ref, rows_view: bool = False) -> "Tiles":
    return cls(*ref) if rows_view else cls(ref, ref)

  @property
  def at(self):
    return _TilesAt(self)


class _TilesAt(NamedTuple):
  tiles: Tiles

  def __getitem__(self, i) -> Tiles:
    return Tiles(self.tiles.mma.at[i], self.tiles.copy.at[i])


def map_rows(n: int, tile: int, interpret: bool, rows_view: bool = False) -> int:
  """The rows an operand of n rows is padded to in HBM before the kernel's tensor maps
  are built over it. The copy engine bounds a copy per axis (a box's rows past the end
  load as zeros and are not stored; CUDA programming guide, tensor memory access), so a
  map over n rows serves any n where the copies move plain rows (`rows_view`); a map over
  tiled rows Mosaic GPU builds over whole atoms, so there n is padded to the next
  multiple of TMA_ROWS. Mosaic GPU's interpreter does not model the bounds (it hangs on
  such a copy): there n is padded to whole tiles of `tile` rows."""
  if interpret:
    return round_up(n, tile)
  return n if rows_view else round_up(n, TMA_ROWS)


def pad_axis(x, n: int, axis: int, fill=0):
  """x zero-padded (or `fill`-padded) along `axis` to length n (no copy when it has n); a
  NumPy array (a constant, `build_ranges`) stays one."""
  if x.shape[axis] == n:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  xp = np if isinstance(x, np.ndarray) else jnp
  return xp.pad(x, widths, constant_values=fill)


def compiler_params():
  """approx_math: exp2 and tanh from the multi-function unit's approximations; the
  "lane" lowering semantics pinned (explicit register layouts, as these kernels are
  written; jax 0.11 made "warpgroup" the default); no shared-memory scratch for
  reductions: every reduction here is along the rows of a warpgroup matrix-product
  tile, whose elements sit in the four lanes of one quad (PTX ISA, wgmma register
  fragments), so it needs only warp shuffles."""
  plgpu = import_plgpu()
  return plgpu.CompilerParams(approx_math=True,
                              lowering_semantics=plgpu.LoweringSemantics.Lane,
                              reduction_scratch_bytes=0)


def layouts(interpret, shape):
  """(iota, row layout, column layout) of a [rows, cols] accumulator tile."""
  if interpret:
    return (lambda d: lax.broadcasted_iota(jnp.int32, shape, d)), None, None
  plgpu = import_plgpu()
  wgmma = plgpu.Layout.WGMMA
  return (lambda d: plgpu.broadcasted_iota(jnp.int32, shape, d, layout=wgmma),
          wgmma.reduce(1), wgmma.reduce(0))


def tile_row(ranges, b, i):
  """(lo, full_lo, full_hi, hi) of one block's row of the per-tile schedule: computed
  from the block index under the static rules alone (`StaticRanges`), else loaded from
  `build_ranges`' table."""
  if isinstance(ranges, StaticRanges):
    return ranges.row(i)
  return tuple(ranges[b, i, t] for t in range(4))


def kv_length(ranges, b, i):
  """The key length a block's element-wise masks clip to (slot 5 of its row)."""
  return ranges.S if isinstance(ranges, StaticRanges) else ranges[b, i, 5]


def logits(s, opts: MaskOptions, scale):
  """(s, t, c): base-2 logits are s * c; t = tanh of the soft cap (for its derivative)
  or None. As in the forward, a soft cap or a scale <= 0 is applied to s first."""
  if opts.soft_cap is not None:
    t = jnp.tanh(s * (scale / opts.soft_cap))
    return opts.soft_cap * t, t, LOG2E
  if scale * LOG2E > 0:
    return s, None, scale * LOG2E
  return s * scale, None, LOG2E


def tile_p(s, lse2, *, opts, scale, keep):
  """(P, t) of one tile from the raw product s and the per-query lse2 (broadcast to the
  tile); t is the soft cap's tanh (for dS') or None. A hidden key has P = 0 even on a
  row whose lse is NaN, so a NaN reaches only the gradients of the keys its row sees."""
  s, t, c = logits(s, opts, scale)
  if keep is not None:
    s = jnp.where(keep, s, -jnp.inf)
  p = jnp.exp2(s * c - lse2)      # lse2 = +inf on rows with no visible key: P = 0
  if keep is not None:
    p = jnp.where(keep, p, 0.0)
  return p, t


def tile_ds(p, t, dp, delta):
  """dS' = P * (dP - delta), times the soft cap's derivative 1 - tanh^2."""
  ds = p * (dp - delta)
  if t is not None:
    ds = ds * (1.0 - t * t)       # d(cap tanh(x / cap)) / dx
  return ds
