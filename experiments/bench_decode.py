"""Decoding: one attention step over a KV cache at the memory-bandwidth limit, and
`DecoderLM.generate`'s decode loop against the same model on plain-JAX attention.

Attention cells (B, T, S, heads q/kv; d = 128, bf16 on the GPU): T new queries per
row after S - T cached keys, causal aligned bottom-right (every query sees the cache).
A step must read K and V once: bytes = K + V + Q + O, and

  TB/s          = bytes / time,
  hbm_fraction  = TB/s / the TB/s of a plain device read of the same K and V (a float32
                  sum over both, timed in the same run beside the peers).

Peers, checked against "xla" before they are timed, timed together in rounds
(`experiments.common.time_alternating`):
  jflash            jflash.attention(implementation=None): the split-KV decode kernel
                    on GPUs (the resolved implementation is recorded)
  xla               jax.nn.dot_product_attention(implementation="xla"), the window
                    (S, S - T) giving the bottom-right causal mask
  cudnn             the same with implementation="cudnn" (where cuDNN takes the shape)
  jax_pallas_decode JAX's Pallas decode kernel (jax.experimental.pallas.ops.gpu.
                    decode_attention.gqa; T = 1 only)
  pallas_decode:... the split-KV kernel at other tiles and split rules
                    (`DECODE_CANDIDATES`: `pallas_kernels.decode.default_splits` with
                    other targets), to show where its defaults stand

Generate: decode tokens/s of `jflash.generate.decode_tokens` (one jitted loop of
`--gen-steps` steps for each batch in `--gen-batches`, from a cache holding each
length in `--gen-contexts` of random keys per row), the same model (same weights) with
attention_implementation None (jflash) and "xla" (plain JAX: the scores materialised,
as jax.nn computes them). `--skip-attention` runs this part alone.

Writes <out-dir>/decode_<device>.json.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments import common

PEERS = ("jflash", "xla", "cudnn", "jax_pallas_decode")
# The decode kernel's tiles and split rules timed beside its defaults (GPU preset):
# (block_k, warps, stages, target programs, rounding of the splits "up" or "down",
# short_tiles), the last three `default_splits`' arguments.
DECODE_CANDIDATES = ((64, 4, 3, 528, "up", 0), (64, 4, 3, 1056, "down", 4),
                     (128, 4, 3, 528, "down", 4), (64, 4, 4, 528, "down", 4))
# (B, T, S, N, K): the cells, then MHA and one long sequence at 8K and 512K.
GPU_CELLS = ((8, 1, 32768, 32, 8), (1, 1, 131072, 32, 8), (64, 1, 4096, 32, 8),
             (8, 16, 32768, 32, 8), (8, 1, 32768, 32, 32), (1, 1, 8192, 32, 8),
             (1, 1, 524288, 32, 8))
PRESETS = {
    "gpu": dict(cells=GPU_CELLS, head_dim=128, dtype="bfloat16", rounds=7, round_ms=50.0,
                warm_ms=500.0, candidates=DECODE_CANDIDATES, gen_contexts=(4096, 32768),
                gen_batches=(1, 8), gen_steps=64,
                gen_model=dict(vocab_size=32000, num_layers=4, hidden=2048, num_heads=16,
                               num_kv_heads=4, head_dim=128, dtype="bfloat16",
                               param_dtype="bfloat16")),
    "tiny": dict(cells=((2, 1, 256, 4, 2), (1, 4, 200, 4, 4)), head_dim=16, dtype="float32",
                 rounds=2, round_ms=1.0, warm_ms=0.0, candidates=((16, 4, 2, 8, "up", 1),),
                 gen_contexts=(32,), gen_batches=(2,),
                 gen_steps=3, gen_model=dict(vocab_size=64, num_layers=1, hidden=32,
                                             num_heads=4, num_kv_heads=2)),
}
PRESETS["cpu"] = PRESETS["tiny"]
REL_TOL = 2e-2   # a sanity gate against "xla": bf16 rounding, not a wrong kernel


def parse_args(argv=None):
  p = common.preset_parser(__doc__, PRESETS, "auto = cpu (the tiny cells) on a CPU, else gpu")
  p.add_argument("--peers", default=",".join(PEERS))
  p.add_argument("--no-candidates", action="store_true",
                 help="time the decode kernel at its default tiles only")
  p.add_argument("--skip-attention", action="store_true",
                 help="time the generate loop only (no attention cells)")
  p.add_argument("--skip-generate", action="store_true")
  p.add_argument("--out-dir", type=Path, default=common.DEFAULT_OUT)
  common.add_preset_options(p, [
      ("gen_contexts", _positive_ints, "comma-separated cached keys per row for generate"),
      ("gen_batches", _positive_ints, "comma-separated sequences per generate loop"),
      ("gen_steps", _positive_int, "decode steps per generate loop")])
  p.set_defaults(**{k: None for k in PRESETS["gpu"]})
  args = common.apply_preset(p.parse_args(argv), PRESETS, "gpu")
  args.peers = tuple(p for p in args.peers.split(",") if p)
  if args.no_candidates:
    args.candidates = ()
  return args


def _positive_int(text: str) -> int:
  n = int(text)
  if n < 1:
    raise ValueError(f"expected an int >= 1, got {text!r}")
  return n


def _positive_ints(text: str) -> tuple[int, ...]:
  return tuple(_positive_int(x) for x in text.split(","))


# -- attention cells -----------------------------------------------------------------

def _peer(name, B, T, S, N, K, H):
  """f(q, k, v) -> out of one peer, or raises NotImplementedError saying why not."""
  import jflash
  if name == "jflash":
    return lambda q, k, v: jflash.attention(q, k, v, is_causal=True,
                                            causal_alignment="bottom_right")
  if name in ("xla", "cudnn"):
    # Query t sits at S - T + t: it sees keys j <= S - T + t, i.e. the window (S, S - T).
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, local_window_size=(S, S - T) if T > 1 else None, implementation=name)
  if name.startswith("pallas_decode:"):
    return _decode_candidate(name, B, T, S, N, K, H)
  if name == "jax_pallas_decode":
    if T != 1:
      raise NotImplementedError("JAX's Pallas decode kernel takes one query per row")
    from jax.experimental.pallas.ops.gpu import decode_attention
    return lambda q, k, v: decode_attention.gqa(q[:, 0], k, v)[:, None]
  raise ValueError(f"unknown peer {name!r}")


def _candidate_name(bk, warps, stages, target, rounding, short_tiles) -> str:
  return f"pallas_decode:bk{bk},w{warps},s{stages},p{target},{rounding},t{short_tiles}"


def _decode_candidate(name, B, T, S, N, K, H):
  """The split-KV kernel with one candidate's tiles (`_candidate_name`)."""
  import jflash
  from jflash import decode_impl
  from pallas_kernels import decode as dk
  bk, warps, stages, target, rounding, short = name.split(":")[1].split(",")
  bk, warps, stages, target, short = (int(x.lstrip("bkwspt"))
                                      for x in (bk, warps, stages, target, short))
  n_m = -(-(T * (N // K)) // dk.MAX_BLOCK_M)
  splits = dk.default_splits(B * K * n_m, S, bk, target_programs=target,
                             round_down=rounding == "down", short_tiles=short)
  blocks = dk.DecodeBlocks(block_k=bk, num_splits=splits, num_warps=warps, num_stages=stages)

  def f(q, k, v):
    cfg, masks = jflash.prepare(q, k, v, is_causal=True, causal_alignment="bottom_right")
    info = decode_impl.row_info(masks, B, T, S)
    return dk.decode_forward(q, k, v, info, scale=cfg.scale, is_causal=True, blocks=blocks)[0]
  return f


def _resolved(B, T, S, N, K, H, dtype) -> str:
  import jflash
  from jflash import api
  x = lambda n, L: jax.ShapeDtypeStruct((B, L, n, H), dtype)
  cfg, masks = jflash.prepare(x(N, T), x(K, S), x(K, S), is_causal=True,
                              causal_alignment="bottom_right")
  return api.resolve_implementation(
      None, lambda impl: impl.supports(x(N, T), x(K, S), x(K, S), cfg, masks)).name


def _read_program(k, v):
  """A plain device read of K and V: the bandwidth a decode step is bounded by."""
  return jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)


def attention_rows(args) -> list[dict]:
  rows = []
  dtype = jnp.dtype(args.dtype)
  for B, T, S, N, K in args.cells:
    H = args.head_dim
    cell = dict(batch=B, T=T, S=S, heads=N, kv_heads=K, head_dim=H, dtype=args.dtype)
    item = dtype.itemsize
    kv_bytes = 2 * B * S * K * H * item
    nbytes = kv_bytes + 2 * B * T * N * H * item
    try:
      keys = jax.random.split(jax.random.key(0), 3)
      q = jax.random.normal(keys[0], (B, T, N, H), dtype)
      k = jax.random.normal(keys[1], (B, S, K, H), dtype)
      v = jax.random.normal(keys[2], (B, S, K, H), dtype)
      jax.block_until_ready((q, k, v))
    except Exception as e:   # a cell past the device's memory
      rows.append(dict(cell, peer="all", status="skipped", error=common_err(e)))
      common.log(f"{cell} skipped: {common_err(e)[:120]}")
      continue
    programs, checked = {}, {}
    read = jax.jit(_read_program)
    programs["read"] = (read, [(k, v)], jax.block_until_ready)
    ref = None
    names = ("xla",) + tuple(p for p in args.peers if p != "xla")
    names += tuple(_candidate_name(*c) for c in args.candidates)
    for name in names:
      row = dict(cell, peer=name, bytes=nbytes, status="ok")
      if name == "jflash":
        row["implementation"] = _resolved(B, T, S, N, K, H, dtype)
      try:
        fn = jax.jit(_peer(name, B, T, S, N, K, H))
        t = time.perf_counter()
        out = jax.block_until_ready(fn(q, k, v))
        row["first_call_s"] = round(time.perf_counter() - t, 3)
        if name == "xla":
          ref = out.astype(jnp.float32)
        elif ref is not None:
          err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
          row["rel_err"] = err
          if not err <= REL_TOL:
            row.update(status="wrong", error=f"rel_err={err:.3g} against xla: not timed")
            rows.append(row)
            continue
        programs[name] = (fn, [(q, k, v)], jax.block_until_ready)
      except Exception as e:
        row.update(status="unavailable" if isinstance(e, NotImplementedError) else "error",
                   error=common_err(e))
        common.log(f"{cell} {name}: {row['error'][:160]}")
      checked[name] = row
    times = common.time_alternating(programs, rounds=args.rounds, round_s=args.round_ms / 1e3,
                                    warm_s=args.warm_ms / 1e3)
    read_t = times["read"].get("median_s")
    read_tbs = kv_bytes / read_t / 1e12 if read_t else None
    for name, row in checked.items():
      t = times.get(name, {})
      if "median_s" in t:
        tbs = nbytes / t["median_s"] / 1e12
        row.update(us=t["median_s"] * 1e6, tb_s=tbs, read_tb_s=read_tbs,
                   hbm_fraction=None if not read_tbs else tbs / read_tbs)
        common.log(f"B={B} T={T} S={S} {N}/{K} {name:18s} {row['us']:10.1f} us "
                   f"{tbs:6.3f} TB/s  hbm_fraction {row['hbm_fraction']:.3f}")
      elif "error" in t:
        row.update(status="error", error=f"timing: {t['error']}")
      rows.append(row)
    del q, k, v, programs
  return rows


def common_err(e) -> str:
  return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


# -- generate --------------------------------------------------------------------------

def generate_rows(args) -> list[dict]:
  from jflash import generate, nn
  from jflash.kv_cache import KVCache
  rows = []
  for context in args.gen_contexts:
    for batch in args.gen_batches:
      programs, built = {}, {}
      for impl in (None, "xla"):
        label = "jflash" if impl is None else "plain_jax"
        row = dict(peer=label, attention_implementation=impl, context=context, batch=batch,
                   steps=args.gen_steps, model=args.gen_model, status="ok")
        rows.append(row)
        try:
          loop, inputs = _decode_loop(nn, generate, KVCache, args, impl, context, batch)
          t = time.perf_counter()
          built[label] = (row, np.asarray(jax.block_until_ready(loop(*inputs))))
          row["first_call_s"] = round(time.perf_counter() - t, 3)
          # The compiled loop's scratch beside the cache it carries. The cache is not
          # donated (every round reuses it), so this holds one copy of it made at the
          # loop's entry; only the difference between the two loops is the attention's.
          row["temp_bytes"] = loop.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
          row["cache_bytes"] = inputs[1].k.nbytes + inputs[1].v.nbytes
          programs[label] = (loop, [inputs], jax.block_until_ready)
        except Exception as e:
          row.update(status="error", error=common_err(e))
          common.log(f"generate ctx={context} B={batch} {label}: {row['error'][:160]}")
      times = common.time_alternating(programs, rounds=args.rounds,
                                      round_s=args.round_ms / 1e3, warm_s=args.warm_ms / 1e3)
      for label, (row, _) in built.items():
        t = times[label]
        if "median_s" not in t:
          row.update(status="error", error=f"timing: {t.get('error')}")
          continue
        row.update(s=t["median_s"], tokens_per_s=batch * args.gen_steps / t["median_s"])
        common.log(f"generate ctx={context} B={batch} {label:9s} "
                   f"{row['tokens_per_s']:10.1f} tokens/s")
      ok = {k: r for k, (r, _) in built.items() if "tokens_per_s" in r}
      if len(ok) == 2:
        ok["jflash"]["speedup_vs_plain_jax"] = (ok["jflash"]["tokens_per_s"]
                                                / ok["plain_jax"]["tokens_per_s"])
        ok["jflash"]["same_tokens_as_plain_jax"] = bool(
            np.array_equal(built["jflash"][1], built["plain_jax"][1]))
  return rows


def _decode_loop(nn, generate, KVCache, args, impl, context, batch):
  """(jitted loop, its inputs): `args.gen_steps` greedy decode steps of the model on
  `impl` from a cache holding `context` random keys per row."""
  from flax import nnx
  cfg = nn.LMConfig(**args.gen_model, attention_implementation=impl,
                    seq_len=context + args.gen_steps)
  model = nn.DecoderLM(cfg, rngs=nnx.Rngs(0))             # same seed: same weights
  graphdef, state = nnx.split(model)
  L, K, H = cfg.num_layers, cfg.kv_heads, cfg.dim_per_head
  dt = jnp.dtype(cfg.dtype)
  shape = (L, batch, context + args.gen_steps, K, H)
  key = jax.random.key(1)
  cache = KVCache(jax.random.normal(key, shape, dt),
                  jax.random.normal(jax.random.fold_in(key, 1), shape, dt),
                  jnp.full((L, batch), context, jnp.int32))
  token = jnp.zeros((batch,), jnp.int32)
  positions = jnp.full((batch,), context, jnp.int32)
  pick = functools.partial(generate.sample, temperature=0.0, top_k=None)

  @jax.jit
  def loop(state, cache, token, positions):
    m = nnx.merge(graphdef, state)
    return generate.decode_tokens(m, cache, token, positions, args.gen_steps, pick=pick,
                                  rng=jax.random.key(0))[0]
  return loop, (state, cache, token, positions)


def main(argv=None):
  args = parse_args(argv)
  rows = [] if args.skip_attention else attention_rows(args)
  gen = [] if args.skip_generate else generate_rows(args)
  config = {k: v for k, v in vars(args).items() if k != "out_dir"}
  path = common.write_result(f"decode_{common.device_tag()}", config, rows,
                             extra={"generate": gen}, out_dir=args.out_dir)
  common.log(f"wrote {path}")
  return path


if __name__ == "__main__":
  main()
