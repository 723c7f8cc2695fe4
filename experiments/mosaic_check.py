"""The Hopper forward ("mosaic_gpu") on the GPU: correctness against float64, dispatch,
and forward time against cuDNN.

Correctness: out and lse of `implementation="mosaic_gpu"` against the float64 NumPy
reference, under the test suite's rule (error <= 2x the error of the plain same-dtype
implementation, `implementation="xla"`, plus a few roundings of the dtype), over head
dims 64/128/256 and off the table 16/32/48/80/96/160/192, MHA/GQA/MQA, causal and not,
T != S, T and S off the tile, window, segments, lengths (0 included) and fully masked
rows; one gradient through the Triton backward; one NaN. Dispatch: which
implementation `implementation=None` picks for a supported call. Timing: forward TFLOP/s of mosaic_gpu, cuDNN (jax.nn) and jflash's
Triton "pallas" in one process, bf16 (FLOPs 4 B S^2 N H, halved when causal).

  python -m experiments.mosaic_check                 # everything, on an H100/H200
  python -m experiments.mosaic_check --no-timing     # correctness and dispatch only
  python -m experiments.mosaic_check --sweep         # also tiles of the kernel per cell
  python -m experiments.mosaic_check --sweep --no-check --cells "4K d64" --variants overlap
  python -m experiments.mosaic_check --config '{"overlap": true}' --no-timing
                                                     # the cases with MosaicGPUConfig(**JSON)

With `--backward`, the Mosaic GPU backward (forced: `MosaicGPUConfig(backward=
"mosaic_gpu")`) instead: dq, dk, dv against the float64 closed form under the same 2x
rule (dtype roundings plus float32 roundings of the longest sum: S for dq, T x group
for dk and dv) over the forward's head dims, MHA/GQA/MQA, causal and not, off-tile T and
S, window + segments + soft cap + lengths (0 included); a NaN in one query row; vmap
against the same calls one by one; then
fwd+bwd TFLOP/s against cuDNN and against "mosaic_gpu" with the Triton backward
(FLOPs 3.5x the forward's: 14 B S^2 N H, halved when causal). `--backward-configs`
checks and times other variants of the Mosaic GPU backward (MosaicGPUConfig backward
fields, one dict per variant), e.g. the warp-specialised kernels or dQ in the dK/dV kernel;
a variant with backward_group_splits leaves out the checks whose GQA group it does not
divide (listed under "left_out" in the result).

  python -m experiments.mosaic_check --backward                    # on an H100/H200
  python -m experiments.mosaic_check --backward --backward-configs \
      '[{"backward_fused_dq": true}, {"backward_fused_dq": true, "backward_consumers": 2}]'
  python -m experiments.mosaic_check --backward --tiny                 # smoke run on the CPU
"""
from __future__ import annotations

import json
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jflash
from experiments import common
from experiments.common import block, write_result
from jflash.reference import error_floor, max_err

IMPL = "mosaic_gpu"


# -- correctness -----------------------------------------------------------------------

def cases():
  """(name, shape (B, T, S, N, K, H), dtype, kwargs of jflash.attention)."""
  bf16, f16 = jnp.bfloat16, jnp.float16
  out = []
  for H in (64, 128, 256):
    for causal in (False, True):
      out.append((f"mha d{H}" + (" causal" if causal else ""), (1, 1024, 1024, 4, 4, H), bf16,
                  dict(is_causal=causal)))
  out.append(("mha d128 fp16 causal", (1, 1024, 1024, 4, 4, 128), f16, dict(is_causal=True)))
  out.append(("gqa 8/2 d128 causal, T=S=1000 off tile", (1, 1000, 1000, 8, 2, 128), bf16,
              dict(is_causal=True)))
  out.append(("mqa 4/1 d64, T=300 S=777", (1, 300, 777, 4, 1, 64), bf16, {}))
  out.append(("mqa 4/1 d256 causal, T=200 S=700", (1, 200, 700, 4, 1, 256), bf16,
              dict(is_causal=True)))
  out.append(("gqa d128 causal, T=700 S=200 (rows past S see all)", (1, 700, 200, 4, 2, 128),
              bf16, dict(is_causal=True)))
  out.append(("window (128, 0) d128", (1, 1024, 1024, 4, 4, 128), bf16,
              dict(local_window_size=(128, 0))))
  out.append(("window (64, 32) d64 causal off tile", (1, 999, 999, 4, 2, 64), bf16,
              dict(is_causal=True, local_window_size=(64, 32))))
  seg = np.repeat(np.arange(5), 205)[None, :1024]
  out.append(("segments + soft cap d128 causal", (1, 1024, 1024, 4, 4, 128), bf16,
              dict(is_causal=True, segment_ids=jnp.asarray(seg, jnp.int32), logits_soft_cap=20.0)))
  seg2 = np.repeat(np.repeat(np.arange(5), 205)[None, :1000], 2, axis=0)
  out.append(("window + segments + soft cap + kv lengths d256 fp16 causal",
              (2, 1000, 1000, 4, 2, 256), f16,
              dict(is_causal=True, local_window_size=(300, 0), logits_soft_cap=20.0,
                   segment_ids=jnp.asarray(seg2, jnp.int32),
                   key_value_seq_lengths=jnp.asarray([1000, 777], jnp.int32))))
  out.append(("lengths q [0, 700] kv [513, 1000] d128", (2, 1000, 1000, 4, 2, 128), bf16,
              dict(query_seq_lengths=jnp.asarray([0, 700], jnp.int32),
                   key_value_seq_lengths=jnp.asarray([513, 1000], jnp.int32))))
  out.append(("kv length 0 d64 causal", (2, 256, 256, 2, 2, 64), bf16,
              dict(is_causal=True, key_value_seq_lengths=jnp.asarray([0, 100], jnp.int32))))
  # Query segment 9 has no key: its rows are fully masked (zeros, lse = -inf).
  q_seg = np.concatenate([np.zeros(300), np.full(212, 9)])[None].astype(np.int32)
  kv_seg = np.zeros((1, 640), np.int32)
  out.append(("fully masked rows (segment with no key) d128", (1, 512, 640, 4, 4, 128), bf16,
              dict(segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))))
  # Lengths under one tile: the tensor maps (8-row multiples, read in place) are
  # shorter than one copy's box.
  out.append(("under one tile: gqa 8/2 d96 causal, T=S=40", (1, 40, 40, 8, 2, 96), bf16,
              dict(is_causal=True)))
  out.append(("under one tile: mha d128, T=16 S=72", (2, 16, 72, 4, 4, 128), bf16, {}))
  # Head dims between the table's (`forward.table_head_dim`): each swizzle width (32
  # bytes at d16, d48 and d80, 64 at d32, d96 and d160, 128 at d192) and both sides of
  # the backward's `by_role` (d160, d192).
  out.append(("off-table mha d96 causal", (1, 1024, 1024, 4, 4, 96), bf16, dict(is_causal=True)))
  out.append(("off-table gqa 8/2 d80, T=S=1000", (1, 1000, 1000, 8, 2, 80), bf16, {}))
  out.append(("off-table mqa 4/1 d192 causal, T=200 S=700", (1, 200, 700, 4, 1, 192), bf16,
              dict(is_causal=True)))
  out.append(("off-table window (64, 32) + kv lengths d32 fp16 causal", (2, 999, 999, 4, 2, 32),
              f16, dict(is_causal=True, local_window_size=(64, 32),
                        key_value_seq_lengths=jnp.asarray([999, 500], jnp.int32))))
  out.append(("off-table mha d16 causal, T=S=300", (1, 300, 300, 4, 4, 16), bf16,
              dict(is_causal=True)))
  out.append(("off-table gqa 4/2 d48, T=200 S=500", (1, 200, 500, 4, 2, 48), bf16, {}))
  out.append(("off-table segments + soft cap d160 fp16 causal", (1, 1024, 1024, 4, 4, 160), f16,
              dict(is_causal=True, segment_ids=jnp.asarray(seg, jnp.int32), logits_soft_cap=20.0)))
  # Rows whose max rises past the lazy rescale's threshold after O holds values
  # (`_case_inputs`): the rescale's branch with O non-zero (d128 causal at 2048 rows:
  # three consumers; d256: two, ping-ponged, with scores_ahead).
  out.append(("rising logits d128 causal (keys x4 from 384)", (1, 2048, 2048, 4, 4, 128), bf16,
              dict(is_causal=True, rising_keys=(384, 4.0))))
  out.append(("rising logits d256 (keys x4 from 384)", (1, 1024, 1024, 4, 4, 256), bf16,
              dict(rising_keys=(384, 4.0))))
  return out


def _inputs(shape, dtype, seed):
  B, T, S, N, K, H = shape
  r = np.random.default_rng(seed)
  q = r.standard_normal((B, T, N, H))
  k = r.standard_normal((B, S, K, H))
  v = r.standard_normal((B, S, K, H))
  return [jnp.asarray(x, dtype) for x in (q, k, v)]


def _case_inputs(shape, dtype, seed, kw):
  """q, k, v of a case and its jflash.attention kwargs. `rising_keys` (first, factor):
  the keys from `first` on scaled by `factor`, so that rows' max logit rises past the
  lazy rescale's threshold (`forward.RESCALE_THRESHOLD`) mid-row, which the standard
  normal inputs alone do not do after a row's first tile (in a CPU replay of the MHA
  cases' inputs no row did)."""
  kw = dict(kw)
  q, k, v = _inputs(shape, dtype, seed)
  rise = kw.pop("rising_keys", None)
  if rise is not None:
    k = k.at[:, rise[0]:].multiply(rise[1])
  return q, k, v, kw


def check_case(name, shape, dtype, kw, seed, config=None):
  row = {"name": name, "shape": shape, "dtype": jnp.dtype(dtype).name, "ok": False}
  try:
    q, k, v, kw = _case_inputs(shape, dtype, seed, kw)
    run = lambda impl: jax.jit(lambda q, k, v: jflash.attention(
        q, k, v, implementation=impl, return_residuals=True,
        config=config if impl == IMPL else None, **kw))(q, k, v)
    t0 = time.perf_counter()
    out, lse = run(IMPL)
    block(out)
    row["first_call_s"] = round(time.perf_counter() - t0, 2)
    p_out, p_lse = run("xla")
    ref_kw = {a: (np.asarray(b) if hasattr(b, "shape") else
                  tuple(np.asarray(x) for x in b) if a == "segment_ids" and isinstance(b, tuple)
                  else b) for a, b in kw.items()}
    r_out, r_lse = jflash.attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                          **ref_kw)
    H = shape[-1]
    finite = np.isfinite(r_lse)
    out_err, out_plain = max_err(out, r_out), max_err(p_out, r_out)
    lse_err, lse_plain = (max_err(np.asarray(lse)[finite], r_lse[finite]),
                          max_err(np.asarray(p_lse)[finite], r_lse[finite]))
    out_bound = 2 * out_plain + error_floor(dtype, r_out, H)
    lse_bound = 2 * lse_plain + error_floor(jnp.float32, r_lse[finite], H)
    lse_np = np.asarray(lse)
    empty_rows = ~finite                       # [B, N, T] rows that see no key
    empty_out_zero = bool(np.all(np.asarray(out, np.float64).transpose(0, 2, 1, 3)[empty_rows] == 0))
    row.update(
        out={"err": out_err, "plain_err": out_plain, "bound": out_bound},
        lse={"err": lse_err, "plain_err": lse_plain, "bound": lse_bound},
        empty_rows=int(empty_rows.sum()),
        empty_rows_zero_and_neg_inf=bool(empty_out_zero and np.all(lse_np[empty_rows] == -np.inf)),
        ok=bool(np.all(np.isfinite(np.asarray(out, np.float32))) and out_err <= out_bound
                and lse_err <= lse_bound and empty_out_zero
                and np.all(lse_np[empty_rows] == -np.inf) and np.all(np.isfinite(lse_np[finite]))))
  except Exception as e:  # recorded, so one failing case does not hide the others
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
    traceback.print_exc()
  return row


def check_gradient(seed=7):
  """dq, dk, dv of mosaic_gpu (Triton backward on this forward's residuals), GQA causal."""
  shape, dtype = (1, 512, 512, 4, 2, 128), jnp.bfloat16
  row = {"name": "gradient (Triton backward) gqa d128 causal", "shape": shape, "ok": False}
  try:
    q, k, v = _inputs(shape, dtype, seed)
    do = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), dtype)

    def grads(impl):
      config = jflash.MosaicGPUConfig(backward="pallas") if impl == IMPL else None
      f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation=impl,
                                           config=config)
      out, vjp = jax.vjp(f, q, k, v)
      return vjp(do)
    got = jax.jit(lambda q, k, v: grads(IMPL))(q, k, v)
    plain = jax.jit(lambda q, k, v: grads("xla"))(q, k, v)
    ref = jflash.attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)), is_causal=True,
                                 dout=np.asarray(do, np.float64))[2:5]
    row["ok"] = True
    for n, g, p, t in zip(("dq", "dk", "dv"), got, plain, ref):
      err, perr = max_err(g, t), max_err(p, t)
      bound = 2 * perr + error_floor(dtype, t, 128)
      row[n] = {"err": err, "plain_err": perr, "bound": bound}
      row["ok"] &= bool(err <= bound)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
    traceback.print_exc()
  return row


def check_nan():
  """A NaN in one visible query row reaches that row's output and no other row's."""
  row = {"name": "NaN in one query row", "ok": False}
  try:
    q, k, v = _inputs((1, 256, 256, 2, 2, 64), jnp.bfloat16, 3)
    q = q.at[0, 70, 1, 5].set(jnp.nan)
    out = np.asarray(jax.jit(lambda q, k, v: jflash.attention(
        q, k, v, implementation=IMPL))(q, k, v), np.float32)
    bad = ~np.isfinite(out).all(-1)            # [B, T, N]
    row.update(nan_rows=np.argwhere(bad).tolist(), ok=bool(bad[0, 70, 1] and bad.sum() == 1))
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
  return row


def check_dispatch():
  """The name `implementation=None` resolves to for a supported bf16 d=128 call."""
  from jflash import api
  q, k, v = _inputs((1, 256, 256, 2, 2, 128), jnp.bfloat16, 0)
  cfg, masks = jflash.prepare(q, k, v, is_causal=True)
  impl = api.resolve_implementation(None, lambda impl: impl.supports(q, k, v, cfg, masks))
  return {"default_order": list(api.default_implementation()), "resolved": impl.name,
          "ok": impl.name == IMPL,
          "compute_capability": str(getattr(jax.devices()[0], "compute_capability", None))}


# -- timing ------------------------------------------------------------------------------

CELLS = [  # (name, B, S, N, H)
    ("16K d128", 1, 16384, 16, 128),
    ("4K d64", 4, 4096, 32, 64),
    ("4K d256", 4, 4096, 8, 256),
    ("4K d96", 4, 4096, 16, 96),       # off the table (`forward.table_head_dim`)
    ("4K d80", 4, 4096, 16, 80),
    ("4K d192", 4, 4096, 8, 192),
]


def cell_patterns(text: str) -> list[str]:
  """--cells' comma-separated regular expressions, each checked before any compile."""
  cells = [c for c in text.split(",") if c]
  for c in cells:
    try:
      re.compile(c)
    except re.error as e:
      raise ValueError(f"--cells pattern {c!r} is not a regular expression: {e}") from None
  return cells


def timed_rows(name, cells) -> list[bool]:
  """The causal flags of cell `name`'s rows that `cells` selects: regular expressions
  searched in a row's name (the cell's, with " causal" for its causal row, so "d64
  causal" takes that row alone and "d128$" the rows of d128 cells without a mask);
  none: both rows."""
  return [causal for causal in (False, True) if not cells or any(
      re.search(c, name + (" causal" if causal else "")) for c in cells)]


def time_together(fns, sets_of, flops, rounds, row, check=None, round_s=0.2):
  """TF/s of every program of `fns` {label: jitted} into row["tflops"], timed together
  (`common.time_alternating`: the same sustained load, alternating rounds of >= round_s
  seconds); `sets_of(label)` is its list of argument tuples, rotated from call to call.
  Each program's first call (its compile, row["compile_s"]) goes to `check(label,
  out)`; a program that fails it, or fails while timed, is recorded under
  row["errors"] (the others are still timed)."""
  ok = {}
  for label, fn in fns.items():
    try:
      t0 = time.perf_counter()
      out = block(fn(*sets_of(label)[0]))
      row.setdefault("compile_s", {})[label] = round(time.perf_counter() - t0, 1)
      if check is not None:
        check(label, out)
      ok[label] = (fn, sets_of(label), block)
    except Exception as e:
      row["tflops"][label] = None
      row.setdefault("errors", {})[label] = f"{type(e).__name__}: {e}"[:1500]
  times = common.time_alternating(ok, rounds=rounds, round_s=round_s) if ok else {}
  for label, t in times.items():
    if "error" in t:
      row["tflops"][label] = None
      row.setdefault("errors", {})[label] = t["error"][:1500]
    else:
      row["tflops"][label] = round(flops / t["median_s"] / 1e12, 1)


def forward_fns(causal, peers):
  att = lambda impl: jax.jit(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=causal, implementation=impl))
  fns = {IMPL: att(IMPL)}
  if "cudnn" in peers:
    fns["cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
  if "pallas" in peers:
    fns["pallas"] = att("pallas")
  if "jax_mgpu" in peers:   # JAX's own Mosaic GPU kernel at the same tiles, both dtypes
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                         causal=causal)
    mgpu = lambda q, k, v: attention_mgpu.attention(q * q.shape[-1] ** -0.5, k, v, config)
    fns["jax_mgpu"] = jax.jit(mgpu)
    fns["jax_mgpu fp16"] = fns["jax_mgpu"]        # labels with "fp16" get fp16 inputs
    fns[f"{IMPL} fp16"] = fns[IMPL]
  return fns


def time_cells(rounds, sweep, peers, cells, variants=(), over_table=(), input_sets=1,
               round_s=0.2):
  """Forward TF/s per cell of mosaic_gpu and `peers`; with `sweep` also the kernel's
  tile variants (`sweep_configs`, filtered by `variants`); `over_table`: dicts of
  MosaicConfig fields, each timed over the table's config of the cell. `input_sets`
  (rotated from call to call) and `round_s`: as the benchmark's (`--as-benchmark`)."""
  import dataclasses
  from pallas_kernels.masking import MaskOptions
  from pallas_kernels.mosaic_gpu import forward as mf
  rows = []
  for name, B, S, N, H in CELLS:
    timed = timed_rows(name, cells)
    if not timed:
      continue
    sets = [_inputs((B, S, S, N, N, H), jnp.bfloat16, seed) for seed in range(input_sets)]
    for causal in timed:
      flops = 4 * B * S * S * N * H / (2 if causal else 1)
      row = {"cell": name + (" causal" if causal else ""), "B": B, "S": S, "N": N, "H": H,
             "causal": causal, "tflops": {}}
      fns = dict(forward_fns(causal, peers))
      # Over-table variants run through flash_forward; so does the table's config beside
      # them (the row's IMPL goes through jflash.attention), for a like-for-like ratio.
      table = mf.default_config(H, causal, S)
      configs = {f"{IMPL} table": table} if over_table else {}
      for fields in over_table:
        label = f"{IMPL} " + ",".join(f"{a}={b}" for a, b in fields.items())
        try:
          config = dataclasses.replace(table, **fields)
        except ValueError as e:     # not a config over this cell's table entry
          row.setdefault("not_configs", {})[label] = str(e)
          continue
        same = [a for a, c in configs.items() if c == config]
        if same:                    # e.g. the table's own value of the field
          row.setdefault("same_config_as", {})[label] = same[0]
        else:
          configs[label] = config
      if sweep:
        for config in sweep_configs(H):
          label = (f"{IMPL} {config.block_q}/{config.block_k}x{config.stages}" + ("" if config.pv_in_place else
                   " fresh") + ("" if config.semantics == "lane" else " warpgroup")
                   + (" persistent" if config.persistent else "")
                   + (" overlap" if config.overlap else "")
                   + (f" consumers{config.consumers}" if config.consumers != 2 else "")
                   + ("" if config.ping_pong or config.consumers != 2 else " no-ping-pong")
                   + (f" regs{config.consumer_registers}" if config.consumer_registers else ""))
          if variants and not any(v in label for v in variants):
            continue
          configs[label] = config
      for label, config in configs.items():
        fns[label] = jax.jit(lambda q, k, v, config=config: mf.flash_forward(
            q, k, v, scale=H ** -0.5, opts=MaskOptions(is_causal=causal), config=config)[0])
      half = [tuple(x.astype(jnp.float16) for x in one) for one in sets]
      ref = {}

      def check(impl, out):
        """A sanity check of every variant timed: its output against cuDNN's."""
        if impl == "cudnn":
          ref["out"] = np.asarray(out, np.float32)
        elif (sweep or over_table) and impl.startswith(IMPL) and "out" in ref:
          row.setdefault("max_diff_vs_cudnn", {})[impl] = float(
              np.abs(np.asarray(out, np.float32) - ref["out"]).max())
      time_together(fns, lambda impl: half if "fp16" in impl else sets, flops, rounds,
                    row, check, round_s)
      t = row["tflops"]
      if t.get(IMPL) and t.get("cudnn"):
        row["ratio_vs_cudnn"] = round(t[IMPL] / t["cudnn"], 3)
      print(row, flush=True)
      rows.append(row)
  return rows


# Tiles worth timing per head_dim (block_q, block_k, stages), after the first sweep on
# the H200 (mosaic_sweep_h200.json), which also had key tiles of 64 and 192 in 2-4
# slots at every head_dim: those were all slower than 128 in 2 slots.
SWEEP_TILES = {64: [(64, 128, 2), (64, 128, 3), (128, 64, 2), (128, 64, 3), (128, 128, 2)],
               128: [(64, 128, 2), (64, 128, 3), (64, 192, 2)],
               256: [(64, 64, 2)]}


def sweep_configs(H):
  """Each of SWEEP_TILES with and without the persistent grid, and the table's two
  configs with the in-warpgroup overlap, with FlashAttention-3's register split
  (240 per consumer) and without the ping-pong, and three-consumer configs, where they
  fit shared memory (the table's configs are among them)."""
  import dataclasses
  from pallas_kernels.mosaic_gpu.forward import (SMEM_BYTES, MosaicConfig, default_config,
                                                 smem_bytes, table_head_dim)
  cands = [MosaicConfig(bq, bk, st, persistent=p) for bq, bk, st in SWEEP_TILES[table_head_dim(H)]
           for p in (False, True)]
  # the table's configs with two consumers (it may hold 3), on the loop every variant has
  two = [dataclasses.replace(default_config(H, c).with_consumers(2), consumer_ranges=False)
         for c in (False, True)]
  cands += [dataclasses.replace(c, overlap=True) for c in two]
  cands += [dataclasses.replace(c, consumer_registers=240) for c in two]
  # Three consumers, unsynchronised (FlashAttention-3's choice at head_dim 64), and two
  # without the ping-pong.
  if H <= 128:
    cands += [MosaicConfig(64, bk, st, persistent=p, consumers=3)
              for bk, st in ((128, 2), (64, 2)) for p in (False, True)]
  cands += [dataclasses.replace(c, ping_pong=False) for c in two]
  return [c for c in cands if smem_bytes(H, 2, c) <= SMEM_BYTES]


# -- the Mosaic GPU backward -----------------------------------------------------------------

def mosaic_backward(fields=None):
  """The config that forces the Mosaic GPU backward, with the MosaicGPUConfig backward
  fields `fields` (e.g. {"backward_consumers": 2})."""
  return jflash.MosaicGPUConfig(backward="mosaic_gpu", **(fields or {}))


def check_backward_variants(variants):
  """ValueError unless `variants` is a non-empty list of dicts of MosaicGPUConfig
  backward fields (each a config the library takes) with distinct labels."""
  if not isinstance(variants, list) or not variants or \
      not all(isinstance(f, dict) for f in variants):
    raise ValueError(f"--backward-configs={variants!r} must be a non-empty JSON list of objects")
  for fields in variants:
    other = [k for k in fields if not k.startswith("backward_")]
    if other:
      raise ValueError(f"--backward-configs: {other} are not backward fields "
                       "(MosaicGPUConfig.backward_*)")
    mosaic_backward(fields)
  labels = [backward_label(f) for f in variants]
  if len(set(labels)) != len(labels):
    raise ValueError(f"--backward-configs repeats a variant: {labels}")


def resolved_backward(q, k, v, fields, **kw):
  """The BackwardConfig the Mosaic GPU backward runs for this call with `fields` (the
  kernel's per-call default under them), as text for the result."""
  from jflash import mosaic_impl
  return str(mosaic_impl.backward_config(
      q, k, *jflash.prepare(q, k, v, config=mosaic_backward(fields), **kw)))


def backward_label(fields):
  """"bwd=mosaic_gpu" and the fields set, e.g. "bwd=mosaic_gpu consumers=2 fused_dq"."""
  return " ".join(["bwd=mosaic_gpu", *_field_parts(fields)])


def backward_suffix(fields):
  """What a check's name gains for a variant: its fields set, e.g. " consumers=2"."""
  return "".join(" " + part for part in _field_parts(fields))


def _field_parts(fields):
  return [k.removeprefix("backward_") + ("" if v is True else f"={v}")
          for k, v in sorted((fields or {}).items())]


def leaves_out(fields, shape):
  """Why a variant leaves out a check of `shape` (..., B, T, S, N, K, H), or None: the
  kernels refuse the variant's config for that call (NotImplementedError: e.g. a GQA
  group N / K that its backward_group_splits does not divide, or one consumer at a head
  dim split by role), which is the variant's limit, not a failed check."""
  from pallas_kernels.mosaic_gpu import backward as mb
  B, T, S, N, K, H = shape[-6:]
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
  try:
    mb.check_supported(q, k, k, mb.call_config(
        q.shape, k.shape, 2, causal=False, **mosaic_backward(fields).backward_fields()))
  except NotImplementedError as e:
    return str(e)
  return None


def selected(only, name) -> bool:
  """Whether case `name` runs under --only (comma-separated substrings; None: all)."""
  return not only or any(part in name for part in only.split(","))


def backward_cases():
  """The forward's cases: the same shapes, dtypes and masks (a key length of 0 and fully
  masked rows included, their gradients held to the rule like every other)."""
  return [("bwd " + name, shape, dtype, kw) for name, shape, dtype, kw in cases()]


def check_backward_case(name, shape, dtype, kw, seed, fields=None):
  row = {"name": name, "shape": shape, "dtype": jnp.dtype(dtype).name, "ok": False}
  try:
    q, k, v, kw = _case_inputs(shape, dtype, seed, kw)
    do = jnp.asarray(np.random.default_rng(seed + 100).standard_normal(q.shape), dtype)

    def grads(impl, config=None):
      f = lambda q, k, v: jflash.attention(q, k, v, implementation=impl, config=config, **kw)
      return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))(q, k, v, do)
    row["config"] = resolved_backward(q, k, v, fields, **kw)
    t0 = time.perf_counter()
    got = grads(IMPL, mosaic_backward(fields))
    block(got)
    row["first_call_s"] = round(time.perf_counter() - t0, 2)
    plain = grads("xla")
    ref_kw = {a: (np.asarray(b) if hasattr(b, "shape") else
                  tuple(np.asarray(x) for x in b) if a == "segment_ids" and isinstance(b, tuple)
                  else b) for a, b in kw.items()}
    ref = jflash.attention_numpy(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                 dout=np.asarray(do, np.float64), **ref_kw)[2:5]
    B, T, S, N, K, H = shape
    row["ok"] = True
    for n, g, p, t, length in zip(("dq", "dk", "dv"), got, plain, ref,
                                  (S, T * (N // K), T * (N // K))):
      err, perr = max_err(g, t), max_err(p, t)
      bound = 2 * perr + error_floor(dtype, t, length)
      row[n] = {"err": err, "plain_err": perr, "bound": bound}
      row["ok"] &= bool(err <= bound and np.isfinite(np.asarray(g, np.float32)).all())
  except Exception as e:  # recorded, so one failing case does not hide the others
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
    traceback.print_exc()
  return row


BACKWARD_VMAP_SHAPE = (2, 1, 1000, 1000, 4, 2, 64)    # the vmapped axis, then B, T, S, N, K, H
BACKWARD_NAN_SHAPE = (1, 256, 256, 2, 2, 64)


def allowance_share(diff, allowed):
  """Each element's difference over its allowance: 0 where both are 0, infinite where it
  differs with nothing allowed or is NaN, so the largest share names the worst element."""
  diff, allowed = np.broadcast_arrays(np.asarray(diff, np.float64), allowed)
  share = np.divide(diff, allowed, out=np.where(diff <= 0, 0.0, np.inf), where=allowed > 0)
  return np.where(np.isnan(share), np.inf, share)


def check_backward_vmap(shape=BACKWARD_VMAP_SHAPE, fields=None):
  """The backward under jax.vmap (leading axis of `shape`) against the same calls one by
  one: equal to the last bit, except dq with fused_dq (whose launch has its own
  batching rule). There the copy engine's float32 adds into dQ land in a varying
  order: each element sums n <= ceil(S / 64) partial products (one per consumer's 64
  keys), the same in both calls, and a float32 sum of n terms moves by at most
  n 2^-24 sum|terms| from the exact one whatever the order (Higham, section 4.2), so two
  orders differ by at most 2 n 2^-24 sum|terms|, where sum|terms| <= |s| |dS| |K| (taken
  from the float64 reference's dS, which the kernel's rounded dS' follows closely);
  rounding each sum to bf16 adds at most 2^-7 of the larger magnitude (half a bf16 ulp
  each). `worst` records, where any element differs, the one whose difference takes the
  largest share of its allowance."""
  from pallas_kernels.mosaic_gpu import backward as mb
  row = {"name": "bwd vmapped", "ok": False}
  try:
    V, *problem = shape
    q, k, v = (jnp.stack(xs) for xs in zip(*(_inputs(tuple(problem), jnp.bfloat16, 5 + i)
                                              for i in range(V))))
    do = jnp.ones_like(q)
    f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation=IMPL,
                                         config=mosaic_backward(fields))
    grads = lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)
    mapped = jax.jit(jax.vmap(grads))(q, k, v, do)
    looped = [jax.jit(grads)(q[i], k[i], v[i], do[i]) for i in range(V)]
    unordered = {0} if (fields or {}).get("backward_fused_dq") else set()
    if unordered:
      adds = -(-problem[2] // mb.ROWS)        # S / 64
      terms = np.stack([jflash.attention_numpy(
          *(np.asarray(x[i], np.float64) for x in (q, k, v)), is_causal=True,
          dout=np.asarray(do[i], np.float64), dq_abs_terms=True)[-1] for i in range(V)])
    diff, ok = [], True
    for g, m in enumerate(mapped):
      m = np.asarray(m, np.float32)
      one = np.stack([np.asarray(x[g], np.float32) for x in looped])
      d = np.abs(m - one)
      allow = 0.0
      if g in unordered:
        allow = 2.0 ** -7 * np.maximum(np.abs(m), np.abs(one)) + 2 * adds * 2.0 ** -24 * terms
        share = allowance_share(d, allow)
        at = np.unravel_index(np.argmax(share), d.shape)
        if share[at] > 0:              # some element differs
          row["worst"] = {"vmapped": float(m[at]), "one_by_one": float(one[at]),
                          "diff": float(d[at]), "allowed": float(allow[at]),
                          "share": float(share[at])}
      diff.append(float(d.max()))
      ok &= bool((d <= allow).all())
    row.update(max_abs_diff=dict(zip(("dq", "dk", "dv"), diff)), ok=ok)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
    traceback.print_exc()
  return row


def check_backward_nan(shape=BACKWARD_NAN_SHAPE, fields=None):
  """A NaN in one visible query row (causal): dq NaN in that row only; dv NaN exactly
  for the keys that row sees (a hidden key keeps P = 0)."""
  row = {"name": "bwd NaN in one query row", "ok": False}
  try:
    q, k, v = _inputs(shape, jnp.bfloat16, 3)
    t_bad = min(70, shape[1] // 2)
    q = q.at[0, t_bad, 1, 5].set(jnp.nan)
    do = jnp.ones_like(q)
    f = lambda q, k, v: jflash.attention(q, k, v, is_causal=True, implementation=IMPL,
                                         config=mosaic_backward(fields))
    dq, dk, dv = (np.asarray(g, np.float32) for g in
                  jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](do))(q, k, v))
    dq_rows = np.argwhere(~np.isfinite(dq).all(-1)).tolist()       # [b, t, n]
    dv_keys = np.flatnonzero(~np.isfinite(dv[0, :, 1 // (shape[3] // shape[4])]).all(-1))
    row.update(dq_nan_rows=dq_rows, dv_nan_keys=dv_keys.tolist(),
               ok=bool(dq_rows == [[0, t_bad, 1]] and dv_keys.tolist() == list(range(t_bad + 1))))
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {e}"[:3000]
    traceback.print_exc()
  return row


BACKWARD_CELLS = [  # (name, B, S, N, K, H)
    ("16K d128", 1, 16384, 16, 16, 128),
    ("4K d128 LM", 4, 4096, 8, 8, 128),    # the decoder LM's attention (seq_scaling --parts lm)
    ("2K d128", 8, 2048, 16, 16, 128),     # MHA_MIN_SEQ of the "auto" backward rule
    ("8K d128 8 heads", 1, 8192, 8, 8, 128),  # causal: a dK/dV grid of 512 programs
    ("1K d128", 16, 1024, 16, 16, 128),
    ("4K d64", 4, 4096, 32, 32, 64),
    ("GQA 32/8 4K d64", 4, 4096, 32, 8, 64),   # grouped heads at d = 64's tiles
    ("2K d64", 8, 2048, 32, 32, 64),          # D64_MIN_SEQ's lengths
    ("1K d64", 16, 1024, 32, 32, 64),
    # d = 64 without a mask from 4K to 16K: the lengths at which the fused row split
    # (backward_fused_dq_row_split) is timed against the two-kernel backward
    ("8K d64", 2, 8192, 32, 32, 64),
    ("16K d64", 1, 16384, 32, 32, 64),        # also a long causal grid at d = 64's tiles
    ("4K d256", 4, 4096, 8, 8, 256),
    ("1K d256", 16, 1024, 8, 8, 256),
    ("GQA 16/4 4K d256", 2, 4096, 16, 4, 256),
    ("GQA 32/8 8K d128", 1, 8192, 32, 8, 128),
    ("MQA 16/1 16K d128", 1, 16384, 16, 1, 128),
    ("3000 d128 tails", 4, 3000, 16, 16, 128),   # tails read in place (not whole tiles)
    ("4K d96", 4, 4096, 16, 16, 96),      # off the table (`forward.table_head_dim`)
    ("4K d80", 4, 4096, 16, 16, 80),
    ("4K d192", 4, 4096, 8, 8, 192),
    ("GQA 32/8 8K d96", 1, 8192, 32, 8, 96),  # grouped heads off the table
    ("1K d96", 16, 1024, 16, 16, 96),         # MHA_PERSISTENT_MIN_SEQ off the table
    # The persistent grids' last round: with 33 heads the dK/dV kernel's 128-key items
    # number 32 x 132 (the H200's multiprocessors), every round full, where 16 heads at
    # 16K (2048 items) and 4 x 32 at 4K (4096) leave the last round 52% and 3% full.
    ("16K d128 33 heads", 1, 16384, 33, 33, 128),
    ("4K d64 33 heads", 4, 4096, 33, 33, 64),
]


def time_backward_cells(rounds, cells, variants=({},), peers=("cudnn", "pallas"),
                        input_sets=1, round_s=0.2):
  """fwd+bwd TFLOP/s (one jitted vjp with a fixed output cotangent) of mosaic_gpu with
  the Mosaic GPU backward (each of `variants`: MosaicGPUConfig backward fields) and of
  `peers`: "pallas", mosaic_gpu with the Triton backward, and "cudnn".
  ratio_vs_cudnn is the first variant's."""
  rows = []
  for name, B, S, N, K, H in BACKWARD_CELLS:
    timed = timed_rows(name, cells)
    if not timed:
      continue
    sets = []
    for seed in range(input_sets):
      q = _inputs((B, S, S, N, K, H), jnp.bfloat16, 2 * seed)[0]
      k, v = _inputs((B, S, S, K, K, H), jnp.bfloat16, 2 * seed + 1)[1:]
      sets.append((q, k, v, jnp.ones_like(q)))
    q, k, v, _ = sets[0]
    for causal in timed:
      flops = 14 * B * S * S * N * H / (2 if causal else 1)
      row = {"cell": name + (" causal" if causal else ""), "B": B, "S": S, "N": N, "K": K,
             "H": H, "causal": causal, "tflops": {}}

      def vjp_of(f):
        return jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do))
      fns = {f"{IMPL} {backward_label(fields)}": vjp_of(
          lambda q, k, v, fields=fields: jflash.attention(
              q, k, v, is_causal=causal, implementation=IMPL,
              config=mosaic_backward(fields))) for fields in variants}
      first = next(iter(fns))
      row["configs"] = {f"{IMPL} {backward_label(fields)}": resolved_backward(
          q, k, v, fields, is_causal=causal) for fields in variants}
      if "pallas" in peers:
        fns[f"{IMPL} bwd=pallas"] = vjp_of(lambda q, k, v: jflash.attention(
            q, k, v, is_causal=causal, implementation=IMPL,
            config=jflash.MosaicGPUConfig(backward="pallas")))
      if "cudnn" in peers:
        fns["cudnn"] = vjp_of(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
      time_together(fns, lambda impl: sets, flops, rounds, row, round_s=round_s)
      t = row["tflops"]
      if t.get(first) and t.get("cudnn"):
        row["ratio_vs_cudnn"] = round(t[first] / t["cudnn"], 3)
      print(row, flush=True)
      rows.append(row)
  return rows


def dry_run_cpu(variants=({},)):
  """The --backward checks on a CPU: tiny shapes, the kernels under Mosaic GPU's
  interpreter (the adapter interprets off the GPU), the device check bypassed. It
  tests this script, not the GPU."""
  from jflash import mosaic_impl
  mosaic_impl.device_capability = lambda device=None: ("gpu", "9.0")
  rows = []
  for fields in variants:
    dry = [((1, 70, 90, 4, 2, 64), lambda shape: check_backward_case(
               "dry gqa 4/2 d64 causal, T=70 S=90", shape, jnp.bfloat16, dict(is_causal=True),
               seed=0, fields=fields)),
           ((1, 64, 64, 2, 2, 64), lambda shape: check_backward_nan(shape, fields=fields)),
           ((2, 1, 70, 70, 2, 1, 64), lambda shape: check_backward_vmap(shape, fields=fields))]
    for shape, check in dry:
      why = leaves_out(fields, shape)
      if why:
        print(f"left out {shape}{backward_suffix(fields)}: {why}")
        continue
      rows.append(check(shape))
      rows[-1]["name"] += backward_suffix(fields)
  for r in rows:
    print(r, flush=True)
  return 0 if all(r["ok"] for r in rows) else 1


def backward_checks(variants, only):
  """Each variant's backward cases (those `only` selects), then its NaN row and vmap
  checks; returns (checks, left_out), a left-out case with the reason."""
  checks, left_out = [], []
  for fields in variants:
    suffix = backward_suffix(fields)
    for i, (case, shape, dtype, kw) in enumerate(backward_cases()):
      if not selected(only, case):
        continue
      why = leaves_out(fields, shape)
      if why:
        left_out.append(f"{case}{suffix}: {why}")
        continue
      checks.append(check_backward_case(case + suffix, shape, dtype, kw, seed=i,
                                        fields=fields))
      print(checks[-1], flush=True)
    for check, shape in ((check_backward_nan, BACKWARD_NAN_SHAPE),
                         (check_backward_vmap, BACKWARD_VMAP_SHAPE)):
      why = leaves_out(fields, shape)
      if why:
        left_out.append(f"{check.__name__}{suffix}: {why}")
        continue
      checks.append(check(shape, fields=fields))
      checks[-1]["name"] += suffix
      print(checks[-1], flush=True)
  return checks, left_out


def timing_method(args) -> dict:
  """time_cells' and time_backward_cells' input sets and round length: with
  --as-benchmark the benchmark's (experiments/bench/specs.py: N_INPUT_SETS rotated, so
  no call reads the previous call's inputs from L2, and rounds of ROUND_S), else one
  input set and rounds of 0.2 s."""
  if not args.as_benchmark:
    return {}
  from experiments.bench import specs
  return dict(input_sets=specs.N_INPUT_SETS, round_s=specs.ROUND_S)


def main_backward(args):
  # --backward-configs JSON: a list of MosaicGPUConfig backward-field dicts, each checked
  # (case names gain its label) and timed.
  variants = json.loads(args.backward_configs)
  check_backward_variants(variants)    # a bad variant fails here, before any compile
  peers = [p for p in args.peers.split(",") if p]
  if unknown := set(peers) - {"cudnn", "pallas"}:
    raise ValueError(f"--peers {sorted(unknown)}: the backward's peers are cudnn and pallas")
  if args.tiny:
    return dry_run_cpu(variants)
  name = args.name
  if name == "mosaic_check_h200":      # the default: the default backward's own
    # '[{}]' runs the backward's per-call defaults (two consumers; a causal call's group
    # split when its dK/dV grid is small), as the committed result under this name.
    # Refused before any device time is spent.
    if variants != [{}]:
      raise ValueError("--backward-configs other than '[{}]' needs --name: the default "
                       "name is the default backward's committed result")
    name = "mosaic_backward_check_h200"
  checks, left_out = ([], []) if args.no_check else backward_checks(variants, args.only)
  timing = [] if args.no_timing else time_backward_cells(
      args.rounds, cell_patterns(args.cells), variants, peers=peers,
      **timing_method(args))
  path = write_result(name, vars(args), checks, extra={"timing": timing, "left_out": left_out},
                      out_dir=args.out_dir)
  bad = [c["name"] for c in checks if not c["ok"]]
  print(f"\n{len(checks) - len(bad)}/{len(checks)} backward checks within the rule; failed: {bad}")
  for reason in left_out:
    print("left out:", reason)
  for r in timing:
    print(r["cell"], r["tflops"], r.get("ratio_vs_cudnn"))
  print(f"-> {path}")
  return 1 if bad else 0


def main(argv=None):
  p = common.parser(__doc__)
  p.add_argument("--out-dir", default=None, help="where the JSON goes (default experiments/results)")
  p.add_argument("--name", default="mosaic_check_h200")
  p.add_argument("--no-check", action="store_true", help="skip the correctness cases")
  p.add_argument("--no-timing", action="store_true", help="skip the timing")
  p.add_argument("--sweep", action="store_true", help="time the kernel's tile variants too")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--as-benchmark", action="store_true",
                 help="time with the benchmark's rotated input sets and round length")
  p.add_argument("--only", default=None,
                 help="run only the cases whose name contains one of these (comma-separated)")
  p.add_argument("--peers", default="cudnn,pallas", help="timed beside mosaic_gpu")
  p.add_argument("--cells", default="",
                 help="comma-separated regular expressions searched in the names of the rows "
                 "to time (a cell's name, with \" causal\" for its causal row: \"d128$\" takes "
                 "the d128 cells' rows without a mask)")
  p.add_argument("--variants", default="",
                 help="with --sweep: comma-separated substrings of the variant labels to time")
  p.add_argument("--over-table", default="[]",
                 help="a JSON list of MosaicConfig field dicts, each timed over the table's "
                      'config of every cell, e.g. \'[{"stages": 3}, {"persistent": false}]\'')
  p.add_argument("--config", default=None,
                 help='check the forward with MosaicGPUConfig(**JSON), e.g. '
                      '\'{"consumers": 3, "ping_pong": false}\'')
  p.add_argument("--backward", action="store_true",
                 help="check and time the Mosaic GPU backward instead")
  p.add_argument("--backward-configs", default="[{}]",
                 help="with --backward: a JSON list of MosaicGPUConfig backward fields, "
                      "each checked and timed, e.g. "
                      '\'[{"backward_consumers": 2, "backward_fused_dq": true}]\'')
  common.add_tiny(p, "with --backward, small interpreted checks")
  args = p.parse_args(argv)
  cell_patterns(args.cells)      # a bad pattern fails here, before any device time
  if args.backward:
    return main_backward(args)
  result = {"dispatch": check_dispatch()}
  print("dispatch", result["dispatch"], flush=True)
  # --config JSON: with those MosaicGPUConfig fields.
  config = jflash.MosaicGPUConfig(**json.loads(args.config)) if args.config else None
  checks = []
  if not args.no_check:
    for i, (name, shape, dtype, kw) in enumerate(cases()):
      if not selected(args.only, name):
        continue
      checks.append(check_case(name, shape, dtype, kw, seed=i, config=config))
      print({k: checks[-1].get(k) for k in ("name", "ok", "out", "lse", "empty_rows",
                                             "first_call_s", "error")}, flush=True)
    for extra in (check_gradient(), check_nan()):
      checks.append(extra)
      print(extra, flush=True)
  timing = [] if args.no_timing else time_cells(args.rounds, args.sweep, args.peers.split(","),
                                                   cell_patterns(args.cells),
                                                   [v for v in args.variants.split(",") if v],
                                                   json.loads(args.over_table),
                                                   **timing_method(args))
  path = write_result(args.name, vars(args), checks, extra={**result, "timing": timing},
                      out_dir=args.out_dir)
  bad = [c["name"] for c in checks if not c["ok"]]
  print(f"\n{len(checks) - len(bad)}/{len(checks)} checks within the rule; failed: {bad}")
  print(f"implementation=None -> {result['dispatch']['resolved']}")
  if timing:
    print(f"{'cell':<18}{IMPL:>12}{'cudnn':>10}{'pallas':>10}{'ratio':>8}")
    for r in timing:
      t = r["tflops"]
      print(f"{r['cell']:<18}{t.get(IMPL)!s:>12}{t.get('cudnn')!s:>10}{t.get('pallas')!s:>10}"
            f"{r.get('ratio_vs_cudnn')!s:>8}")
  print(f"-> {path}")
  return 1 if bad or not result["dispatch"]["ok"] else 0


if __name__ == "__main__":
  sys.exit(main())
