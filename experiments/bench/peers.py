"""The attention implementations a benchmark compares, and how each one is called.

A `Peer` gives, per case, a list of variants `(label, attn)` tried in order until one
runs; `attn(q, k, v) -> out` takes BSNH JAX arrays (torch peers: BNSH tensors). Every
peer is imported lazily, so a missing package is an error row of that peer alone.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments.bench import specs
from experiments.bench.specs import Case
from experiments.common import block


class PeerError(Exception):
  """A peer could not run a call; the message already names the causes."""


class Unavailable(PeerError):
  """The peer cannot run here at all (not registered, not supported for the case)."""


def err_text(e: BaseException, limit: int = 600) -> str:
  """Type and message, long compiler errors cut in the middle."""
  text = str(e) if isinstance(e, PeerError) else f"{type(e).__name__}: {e}".strip()
  if len(text) > limit:
    text = text[: limit // 2] + " ... " + text[-limit // 2:]
  return text


@dataclasses.dataclass
class Peer:
  name: str                        # the rows' "impl": "jflash", "cudnn", ...
  variants: Callable[[Case], list]
  implementation: str | None = None  # jflash's implementation name
  framework: str = "jax"
  dtype: str | None = None         # input dtype when not the benchmark's (Mosaic GPU: fp16)
  prescale_q: bool = False         # kernel lacks a scale argument: q * 1/sqrt(d) outside the call
  max_seq: int | None = None
  skip_reason: str = ""
  tag: str = ""                    # tells apart peers of one implementation (sweep candidates)

  @property
  def label(self) -> str:
    """Unique among peers: "jflash:<implementation>" for jflash, else the name."""
    label = f"{self.name}:{self.implementation}" if self.implementation else self.name
    return f"{label}[{self.tag}]" if self.tag else label


# -- jflash ----------------------------------------------------------------------------

def jflash_call(q, k, v, *, implementation, tiles: dict | None = None, **options):
  """jflash.attention with optional explicit Pallas tile fields (the swept ones); the one
  place that names jflash's tile-config keyword."""
  if tiles is not None:
    # xla_chunked reads only the key block; every other implementation that is swept
    # takes the Pallas tile record.
    options["config"] = (jflash.ChunkedConfig(tiles["block_k"]) if implementation == "xla_chunked"
                         else jflash.PallasConfig(**tiles))
  return jflash.attention(q, k, v, implementation=implementation, **options)


def default_tiles(head_dim: int) -> dict:
  """jflash's own Pallas tile fields for a head dim (the sweep's baseline)."""
  from pallas_kernels.tuning import default_block_sizes
  return dataclasses.asdict(default_block_sizes(head_dim))


def resolved_implementation(case: Case, dtype) -> str:
  """What `implementation=None` picks for this case on this device: jflash's dispatch
  tries its default order and moves on only on NotImplementedError (traced with
  eval_shape: nothing is compiled or run). The one place that names the dispatcher."""
  from jflash.api import resolve_implementation
  q = jax.ShapeDtypeStruct((case.batch, case.s, case.heads, case.d), jnp.dtype(dtype))
  kv = jax.ShapeDtypeStruct((case.batch, case.s, case.k_heads, case.d), jnp.dtype(dtype))

  def check(impl):
    jax.eval_shape(functools.partial(jflash.attention, is_causal=case.causal,
                                     implementation=impl.name), q, kv, kv)
  try:
    return resolve_implementation(None, check).name
  except Exception as e:  # recorded: the JSON says why nothing resolved
    return f"error: {err_text(e, 300)}"


def _jflash(implementation: str, **options):
  def variants(case: Case):
    if implementation not in jflash.available_implementations():
      raise Unavailable(f"implementation {implementation!r} is not registered here "
                        f"(registered: {', '.join(jflash.available_implementations())})")
    return [(implementation, functools.partial(
        jflash_call, implementation=implementation, is_causal=case.causal, **options))]
  return variants


def jflash_peer(implementation: str, variants=None, tag: str = "", **options) -> Peer:
  return Peer("jflash", variants or _jflash(implementation, **options),
              implementation=implementation, tag=tag)


# -- jax.nn ----------------------------------------------------------------------------

def _jax_nn(implementation):
  def variants(case: Case):
    return [(implementation, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=case.causal, implementation=implementation))]
  return variants


# -- JAX's Pallas kernels ----------------------------------------------------------------

def _mha_variants(case: Case):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # JAX 0.11 points users to tokamax
    from jax.experimental.pallas.ops.gpu import attention as mha_lib
  if case.k_heads != case.heads:
    raise Unavailable("mha takes as many key heads as query heads")
  blocks = mha_lib.BlockSizes(**specs.MHA_BLOCKS)
  return [(str(specs.MHA_BLOCKS), lambda q, k, v: mha_lib.mha(
      q, k, v, None, sm_scale=case.scale, causal=case.causal, block_sizes=blocks))]


def _dataclass_from(cls, fields: dict):
  """`cls(**fields)` keeping only the fields this JAX version's class has."""
  names = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in fields.items() if k in names})


def _mgpu_variants(case: Case):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  return [(str(cfg), functools.partial(
      mgpu.attention, config=_dataclass_from(mgpu.TuningConfig, dict(cfg, causal=case.causal))))
          for cfg in specs.MGPU_CONFIGS]


# -- tokamax ---------------------------------------------------------------------------

@functools.cache
def _tokamax():
  try:
    import tokamax
  except ModuleNotFoundError as e:
    if not (e.name or "").startswith("xprof"):
      raise
    # tokamax imports xprof (a 100 MiB profiler UI) only for its own benchmark helper,
    # which is not used here; an empty stand-in lets the kernels import.
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
      sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    import tokamax
  return tokamax


def _tokamax_variants(implementation):
  def variants(case: Case):
    tokamax = _tokamax()
    return [(implementation, lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=case.causal, implementation=implementation))]
  return variants


# -- PyTorch ---------------------------------------------------------------------------

@functools.cache
def torch_module():
  import torch
  if not torch.cuda.is_available():
    raise RuntimeError("torch sees no CUDA device")
  return torch


def _torch_variants(backend):
  def variants(case: Case):
    torch = torch_module()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    # enable_gqa exists from torch 2.5 on; passed only where the heads differ.
    gqa = {"enable_gqa": True} if case.k_heads != case.heads else {}

    def attn(q, k, v):  # BNSH, PyTorch's own layout (inputs transposed outside the timed call)
      with sdpa_kernel([chosen]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, scale=case.scale, **gqa)
    return [(backend, attn)]
  return variants


# -- the table ---------------------------------------------------------------------------

def make_peers(jflash_impls, xla_max_seq: int = specs.XLA_MAX_SEQ, smoke: bool = False,
               jflash_variants=None) -> dict[str, Peer]:
  """Every peer by label. `jflash_variants(implementation)` replaces jflash's variants
  (the mask benchmark passes its mask options that way)."""
  make = jflash_variants or _jflash
  peers = [jflash_peer(i, make(i)) for i in jflash_impls]
  # Not timed unless asked for; the reference of last resort when cuDNN and XLA cannot run.
  if "xla_chunked" not in jflash_impls:
    peers.append(jflash_peer("xla_chunked", make("xla_chunked")))
  if smoke:
    return {p.label: p for p in peers + [Peer("xla", _jax_nn("xla"))]}
  peers += [
      Peer("cudnn", _jax_nn("cudnn")),
      Peer("xla", _jax_nn("xla"), max_seq=xla_max_seq,
           skip_reason=f"seq > --xla-max-seq={xla_max_seq}: T x S logits"),
      Peer("jax_pallas_mha", _mha_variants),
      Peer("jax_mgpu", _mgpu_variants, dtype="float16", prescale_q=True),
      Peer("tokamax_mosaic", _tokamax_variants("mosaic")),
      Peer("tokamax_triton", _tokamax_variants("triton")),
      Peer("torch_flash", _torch_variants("flash"), framework="torch"),
      Peer("torch_cudnn", _torch_variants("cudnn"), framework="torch"),
  ]
  return {p.label: p for p in peers}


def select(peers: dict[str, Peer], names: str | None, default: list[str]) -> list[str]:
  """Labels from a comma-separated list; "jflash" stands for every timed jflash peer."""
  if not names:
    return default
  out = []
  for n in (x.strip() for x in names.split(",") if x.strip()):
    picked = [lbl for lbl in default if lbl.startswith("jflash:")] if n == "jflash" else [n]
    for lbl in picked:
      if lbl not in peers:
        raise SystemExit(f"unknown peer {lbl!r}; choose from {sorted(peers)}")
      if lbl not in out:
        out.append(lbl)
  return out


# -- inputs and outputs in each peer's form -------------------------------------------

def make_sets(case: Case, dtype, n: int, seed: int = 0):
  """n input sets (q, k, v, dout), BSNH, normal(0, 1)."""
  shape_q = (case.batch, case.s, case.heads, case.d)
  shape_kv = (case.batch, case.s, case.k_heads, case.d)
  sets = []
  for i in range(n):
    ks = jax.random.split(jax.random.key(seed * 1000 + i), 4)
    sets.append(tuple(jax.random.normal(kk, shape, jnp.float32).astype(dtype)
                      for kk, shape in zip(ks, (shape_q, shape_kv, shape_kv, shape_q))))
  return sets


def peer_inputs(peer: Peer, case: Case, sets):
  """The benchmark's input sets in the form and dtype this peer takes."""
  out = []
  for q, k, v, do in sets:
    if peer.prescale_q:
      q = q.astype(jnp.float32) * case.scale
    if peer.dtype:
      q, k, v, do = (x.astype(peer.dtype) for x in (q, k, v, do))
    if peer.framework == "torch":
      torch = torch_module()
      dtype = getattr(torch, str(q.dtype))  # same name in both: bfloat16, float16, float32
      q, k, v, do = (torch.from_numpy(np.asarray(x, np.float32)).to("cuda", dtype)
                     .permute(0, 2, 1, 3).contiguous() for x in (q, k, v, do))  # BSNH -> BNSH
    out.append((q, k, v, do))
  return out


def to_jax(peer: Peer, case: Case, result, mode):
  """A peer's result as float32 JAX arrays comparable to the reference's."""
  parts = (result,) if mode == "fwd" else tuple(result)
  if peer.framework == "torch":  # BNSH -> BSNH
    parts = tuple(jnp.asarray(p.float().permute(0, 2, 1, 3).cpu().numpy()) for p in parts)
  parts = tuple(p.astype(jnp.float32) for p in parts)
  if peer.prescale_q and mode != "fwd":
    parts = (parts[0] * case.scale,) + parts[1:]  # d/dq = scale * d/d(scale q)
  return parts


def sync(peer: Peer):
  """How to wait for this peer's device work."""
  if peer.framework == "torch":
    return lambda x: (torch_module().cuda.synchronize(), x)[1]
  return block
