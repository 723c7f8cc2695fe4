"""The gfx906 kernel on a machine without an AMD GPU: build, resource audit, lowering
for ROCm, and the host-side checks. Runs in CI (.ci/run installs hipcc and
libamdhip64-dev from Debian); with CI set, a missing hipcc is a failure, not a skip.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hip_ffi
import jflash
from hip_ffi import build
from jflash import hip_impl


def _need(target: str):
  tool = "hipcc" if target == "rocm" else "nvcc"
  if build.compiler(target) is None:
    if target == "rocm" and os.environ.get("CI"):
      pytest.fail("CI is set but hipcc is missing: apt-get install hipcc libamdhip64-dev")
    pytest.skip(f"{tool} is not installed")  # the gfx906 audit needs the ROCm compiler


@pytest.fixture(scope="module")
def rocm_lib():
  _need("rocm")
  return build.build("rocm")  # cached under hip_ffi/_build by source hash


@pytest.fixture(scope="module")
def reports(rocm_lib):
  return build.report(rocm_lib)


# -- gfx906 build and resource audit -------------------------------------------------------

def test_gfx906_build(rocm_lib):
  assert rocm_lib.exists() and (rocm_lib.parent / build.ASM_NAME).exists()
  assert "--offload-arch=gfx906" in (rocm_lib.parent / "command.txt").read_text()


def _kernel(r):
  """(kind, head_dim, tile or None) from a report's demangled name."""
  m = re.search(r"flash_(fwd|bwd_delta|bwd_dq|bwd_dkdv)_kernel<(\d+)(?:, (\d+))?>", r.name)
  assert m, r.name
  return m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3))


def test_every_kernel_is_in_the_report(reports):
  fwd, bwd = build.tile_table(), build.bwd_tile_table()
  want = {("fwd", d, t) for d in fwd for t in range(len(fwd[d]))}
  want |= {(kind, d, None) for d in bwd for kind in ("bwd_delta", "bwd_dq", "bwd_dkdv")}
  assert {_kernel(r) for r in reports} == want


def test_no_spills_lds_within_budget_two_waves(reports):
  for r in reports:
    assert r.scratch_bytes == 0, f"{r.name}: {r.scratch_bytes} bytes of scratch (spills)"
    assert r.lds_bytes <= 64 * 1024, f"{r.name}: LDS {r.lds_bytes} > 64 KiB"
    assert r.lds_bytes <= 48 * 1024, f"{r.name}: LDS {r.lds_bytes} > the 48 KiB budget"
    assert r.waves_per_simd >= 2, f"{r.name}: compiler occupancy {r.waves_per_simd}"
    assert r.waves_per_simd_lds >= 2, f"{r.name}: LDS allows {r.waves_per_simd_lds}"


def test_dot2_in_the_inner_loops(reports):
  # Every fp16 product of every kernel (QK^T, PV, dP, dV, dK, dQ, rowsum(dO * O)) is
  # v_dot2_f32_f16, and all of them sit inside the tile loops.
  for r in reports:
    assert r.dot2_in_loops > 0, f"{r.name}: no v_dot2_f32_f16 inside a loop"
    assert r.dot2_in_loops == r.dot2, f"{r.name}: dot2 outside the tile loops"


def test_fp16_tiles_load_128_bits_at_a_time(reports):
  # fp16 data is read only through 128-bit loads; the 32-bit loads are the fp32 lse /
  # delta and the int32 ranges and segment ids. No 8- or 16-bit global load anywhere.
  for r in reports:
    assert r.global_loads.get("global_load_dwordx4", 0) > 0, (r.name, r.global_loads)
    narrow = {op: n for op, n in r.global_loads.items()
              if re.search(r"byte|short|d16|dwordx2|dwordx3", op) or op.startswith("flat")}
    assert not narrow, (r.name, narrow)


def test_lds_rows_are_conflict_free_for_128_bit_reads():
  # Each row stride is padded by 16 bytes: 8 consecutive rows start 4 banks apart (mod
  # 32), so the 8 lanes of a 128-bit phase read 32 distinct banks. An unpadded stride
  # (or a 4-byte pad) would give 8- or 4-way conflicts; the check catches both.
  assert not build.conflict_free_128bit(128) and not build.conflict_free_128bit(132)
  for name, stride in build.lds_row_strides().items():
    assert build.conflict_free_128bit(stride), f"{name}: stride {stride} bytes conflicts"


def test_lds_matches_the_tile_tables(reports):
  pad = build.LDS_PAD_HALVES
  fwd, bwd = build.tile_table(), build.bwd_tile_table()
  for r in reports:
    kind, d, t = _kernel(r)
    if kind == "fwd":
      bq, bk, nt = fwd[d][t]
      halves = bq * (d + pad) + max(bk * (d + pad), bq * (bk + pad)) + d * (bk + pad)
      assert (r.lds_bytes, r.workgroup_size) == (2 * halves, nt), r.name
      continue
    bq, bkv, nt = bwd[d]
    ds, qts, kts = d + pad, bq + pad, bkv + pad
    if kind == "bwd_dq":
      want = 2 * (2 * bq * ds + 2 * bkv * ds + d * kts + bq * kts)
    elif kind == "bwd_dkdv":  # Q / Q^T and dO / dO^T share their LDS; lse and delta
      want = 2 * (2 * bkv * ds + 2 * max(bq * ds, d * qts) + 2 * bkv * qts) + 2 * 4 * bq
    else:
      want, nt = 0, 256
    assert (r.lds_bytes, r.workgroup_size) == (want, nt), r.name


def test_report_parser_on_a_synthetic_listing():
  asm = """\t.protected\tk1 ; -- Begin function k1
; %bb.0:
\tv_dot2_f32_f16 v0, v1, v2, v0
.LBB0_1:                                ; =>This Inner Loop Header: Depth=1
\tv_dot2_f32_f16 v0, v1, v2, v0
; %bb.2:                                ;   in Loop: Header=BB0_1 Depth=1
\tv_dot2_f32_f16 v0, v1, v2, v0
.LBB0_3:
\ts_endpgm
.Lfunc_end0:
; NumSgprs: 10
; NumVgprs: 20
; ScratchSize: 0
; LDSByteSize: 1024 bytes/workgroup (compile time only)
; Occupancy: 10
  - .max_flat_workgroup_size: 256
    .name:           k1
"""
  (r,) = build.parse_gfx906_asm(asm)
  assert (r.vgprs, r.sgprs, r.scratch_bytes, r.lds_bytes, r.waves_per_simd) == (20, 10, 0, 1024, 10)
  assert (r.dot2, r.dot2_in_loops, r.workgroup_size, r.waves_per_simd_lds) == (3, 2, 256, 10)
  assert r.global_loads == {}


def test_cuda_build_compiles():
  # The sm_90 path of compat.h (how the logic is run on an H200); compile only here.
  _need("cuda")
  lib = build.build("cuda")
  assert lib.exists() and "-arch=sm_90" in (lib.parent / "command.txt").read_text()


# -- lowering for ROCm on this CPU machine ----------------------------------------------

def _lower_rocm(fn, *avals):
  with hip_impl.lowering_for("rocm"):
    traced = jax.jit(fn).trace(*avals)
  return traced.lower(lowering_platforms=("rocm",)).as_text()


def _calls(text, target=None):
  lines = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
  return lines if target is None else [l for l in lines if f"@{target}(" in l]


TARGET = {op: name for op, (name, _) in hip_ffi.TARGETS.items()}


@pytest.mark.parametrize("H,is_causal", [(64, True), (80, True), (96, False), (128, False)])
def test_lowers_to_the_custom_call_for_rocm(rocm_lib, H, is_causal):
  B, T, S, N, K = 2, 97, 113, 8, 2
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float16)
  fn = lambda q, k, v: jflash.attention(q, k, v, scale=0.25, is_causal=is_causal,
                                        implementation="hip", return_residuals=True)
  text = _lower_rocm(fn, q, kv, kv)
  assert len(_calls(text)) == 1, _calls(text)
  (call,) = _calls(text, TARGET["forward"])
  bq = build.tile_table()[H][0][0]
  nq = -(-T // bq)
  # q, k, v, the ranges table and the (placeholder) segment ids; typed results.
  assert (f"(tensor<{B}x{T}x{N}x{H}xf16>, tensor<{B}x{S}x{K}x{H}xf16>, "
          f"tensor<{B}x{S}x{K}x{H}xf16>, tensor<{B}x{nq}x8xi32>, tensor<1x1xi32>, "
          f"tensor<1x1xi32>) -> (tensor<{B}x{T}x{N}x{H}xf16>, tensor<{B}x{N}x{T}xf32>)") in call
  assert f"is_causal = {str(is_causal).lower()}" in call
  assert "scale = 2.500000e-01 : f32" in call
  assert "tile = 0 : i32" in call and "has_segments = false" in call
  assert "window_left = -1 : i32" in call
  assert "soft_cap = 0.000000e+00 : f32" in call


def test_soft_cap_reaches_every_kernel_as_an_attribute(rocm_lib):
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float16)
  fn = lambda q, k, v: jax.grad(lambda q, k, v: jflash.attention(
      q, k, v, implementation="hip", logits_soft_cap=2.5).astype(jnp.float32).sum(),
      argnums=(0, 1, 2))(q, k, v)
  text = _lower_rocm(fn, q, q, q)
  for op in ("forward", "dq", "dkdv"):
    (call,) = _calls(text, TARGET[op])
    assert "soft_cap = 2.500000e+00 : f32" in call, op


def test_tile_attribute_follows_config(rocm_lib):
  bq, bk, _ = build.tile_table()[64][1]
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float16)
  fn = lambda q, k, v: jflash.attention(q, k, v, implementation="hip",
                                        config=jflash.HipConfig(bq, bk))
  assert "tile = 1 : i32" in _lower_rocm(fn, q, q, q)


@pytest.mark.parametrize("dtype,H", [(jnp.float16, 64), (jnp.bfloat16, 64),
                                     (jnp.float16, 96)])
def test_gradient_calls_only_the_hip_kernels(rocm_lib, dtype, H):
  # jax.grad through implementation="hip": the forward once, then delta, dQ and dK/dV,
  # and no other custom call (no xla_chunked or Pallas fallback in the backward).
  B, T, S, N, K = 1, 97, 80, 4, 2
  q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
  kv = jax.ShapeDtypeStruct((B, S, K, H), dtype)
  lens = jnp.array([70], jnp.int32)
  fn = lambda q, k, v: jax.grad(lambda q, k, v: jflash.attention(
      q, k, v, is_causal=True, local_window_size=(40, 3), key_value_seq_lengths=lens,
      implementation="hip").astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
  text = _lower_rocm(fn, q, kv, kv)
  assert {l.split("@")[1].split("(")[0] for l in _calls(text)} == set(TARGET.values())
  for op in TARGET.values():
    assert len(_calls(text, op)) == 1, op
  bq, bkv, _ = build.bwd_tile_table()[H]
  (dq,) = _calls(text, TARGET["dq"])
  (dkdv,) = _calls(text, TARGET["dkdv"])
  assert f"tensor<{B}x{-(-T // bq)}x8xi32>" in dq            # ranges per query tile
  assert f"tensor<{B}x{-(-S // bkv)}x8xi32>" in dkdv         # ranges per key tile
  assert f"-> tensor<{B}x{T}x{N}x{H}xf32>" in dq
  assert f"-> (tensor<{B}x{S}x{K}x{H}xf32>, tensor<{B}x{S}x{K}x{H}xf32>)" in dkdv
  assert "window_left = 40 : i32" in dkdv and "window_right = 3 : i32" in dkdv


def test_segment_ids_reach_the_kernels(rocm_lib):
  q = jax.ShapeDtypeStruct((2, 64, 2, 128), jnp.float16)
  seg = jnp.zeros((2, 64), jnp.int32)
  fn = lambda q: jflash.attention(q, q, q, segment_ids=seg, implementation="hip")
  (call,) = _calls(_lower_rocm(fn, q), TARGET["forward"])
  assert "has_segments = true" in call and "tensor<2x64xi32>, tensor<2x64xi32>" in call


def test_vmap_is_one_call_with_a_leading_batch_dim(rocm_lib):
  # vmap_method="broadcast_all": the vmapped axis becomes a leading (batch) dim of every
  # operand, which the handlers fold into B: one launch, not a loop.
  q = jax.ShapeDtypeStruct((3, 1, 40, 2, 64), jnp.float16)
  fn = jax.vmap(lambda q: jflash.attention(q, q, q, is_causal=True, implementation="hip"))
  calls = _calls(_lower_rocm(fn, q), TARGET["forward"])
  assert len(calls) == 1 and "tensor<3x1x40x2x64xf16>" in calls[0], calls
  assert "tensor<3x1x1x8xi32>" in calls[0]


# -- host-side checks -----------------------------------------------------------------------

def _aval(shape, dtype=jnp.float16):
  return jax.ShapeDtypeStruct(shape, dtype)


_R = jnp.zeros((1, 1, 8), jnp.int32)


@pytest.mark.parametrize("q,k,v,kw,match", [
    (_aval((1, 8, 2, 64), jnp.float32), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "q.dtype=float32"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64), jnp.bfloat16), _aval((1, 8, 2, 64)), {}, "k.dtype=bfloat16"),
    (_aval((8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "rank 4"),
    (_aval((1, 8, 3, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "N=3"),
    (_aval((1, 8, 2, 72)), _aval((1, 8, 2, 72)), _aval((1, 8, 2, 72)), {}, "head_dim=72"),
    (_aval((1, 8, 2, 64)), _aval((1, 9, 2, 64)), _aval((1, 8, 2, 64)), {}, "differ"),
    (_aval((1, 8, 2, 64)), _aval((2, 8, 2, 64)), _aval((2, 8, 2, 64)), {}, "batch"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"tile": 7}, "tile=7"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"scale": float("nan")}, "scale=nan"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"is_causal": 1}, "is_causal=1"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"window": (3, -1)}, "window=(3, -1)"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"soft_cap": 0.0}, "soft_cap=0.0"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"soft_cap": float("inf")}, "soft_cap=inf"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"soft_cap": 1e-50}, "soft_cap=1e-50"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"soft_cap": True}, "soft_cap=True"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"soft_cap": 1e-30, "scale": 1e10}, "scale / soft_cap"),
    (_aval((1, 8, 65536, 64)), _aval((1, 8, 1, 64)), _aval((1, 8, 1, 64)), {}, "<= 65535"),
], ids=["q-f32", "k-bf16", "rank", "gqa", "head-dim", "k-v", "batch", "tile", "scale", "causal",
        "window", "soft-cap-0", "soft-cap-inf", "soft-cap-tiny", "soft-cap-bool",
        "scale-over-cap", "grid"])
def test_raw_op_rejects_bad_inputs_before_the_call(q, k, v, kw, match):
  args = {"scale": 0.125, "is_causal": False, "tile": 0, **kw}
  with pytest.raises(ValueError, match=re.escape(match)):
    jax.eval_shape(lambda q, k, v: hip_ffi.flash_forward(q, k, v, _R, **args), q, k, v)


def test_raw_op_shapes():
  q, kv = _aval((2, 97, 8, 128)), _aval((2, 113, 2, 128))
  r = jnp.zeros((2, 2, 8), jnp.int32)
  out, lse = jax.eval_shape(
      lambda q, k, v: hip_ffi.flash_forward(q, k, v, r, scale=0.1, is_causal=True), q, kv, kv)
  assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, jnp.float16, (2, 8, 97), jnp.float32)
  dk, dv = jax.eval_shape(lambda q, k, v: hip_ffi.flash_backward_dkdv(
      q, k, v, q, jnp.zeros((2, 8, 97)), jnp.zeros((2, 8, 97)), r, scale=0.1, is_causal=True),
      q, kv, kv)
  assert dk.shape == dv.shape == kv.shape and dk.dtype == jnp.float32


@pytest.mark.parametrize("dtype,H,blocks,match", [
    (jnp.float32, 64, None, "float16, bfloat16"),
    (jnp.float16, 112, None, "head_dim=112"),
    (jnp.float16, 64, jflash.HipConfig(16, 16), "not a compiled tile"),
])
def test_unsupported_calls_raise_not_implemented(dtype, H, blocks, match):
  x = jnp.zeros((1, 16, 2, H), dtype)
  with pytest.raises(NotImplementedError, match=match):
    jflash.attention(x, x, x, implementation="hip", config=blocks)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only message")
def test_cpu_only_machine_raises_not_implemented_and_falls_back():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 33, 2, 64)), jnp.float16)
  with pytest.raises(NotImplementedError, match="hip: "):
    jflash.attention(x, x, x, implementation="hip")
  # Fallback is explicit and only on NotImplementedError.
  got = jflash.attention(x, x, x, implementation=("hip", "xla_chunked"))
  want = jflash.attention(x, x, x, implementation="xla_chunked")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_lowering_for_rejects_unknown_platforms():
  with pytest.raises(ValueError, match="tpu"):
    with hip_impl.lowering_for("tpu"):
      pass


def test_imports_need_no_compiler_and_hip_ffi_never_imports_jflash(tmp_path):
  import subprocess
  import sys
  from pathlib import Path
  root = Path(hip_ffi.__file__).resolve().parents[1]
  code = ("import sys, jflash, hip_ffi; "
          "assert not hip_ffi.registered_platforms(); "
          "assert 'jflash.hip_impl' not in sys.modules; print('ok')")
  env = {"PATH": str(tmp_path), "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}  # no compilers
  proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                        text=True)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
  for f in (root / "hip_ffi").glob("*.py"):
    text = f.read_text()
    assert "import jflash" not in text and "from jflash" not in text, f


def test_the_grid_limit_lives_in_one_python_place():
  root = Path(hip_ffi.__file__).resolve().parents[1]
  hits = [f for f in [*(root / "hip_ffi").glob("*.py"), root / "jflash" / "hip_impl.py"]
          if "65535" in f.read_text()]
  assert hits == [root / "hip_ffi" / "__init__.py"], hits


@pytest.mark.parametrize("kw,match", [
    ({"mask": np.ones((1, 1, 16, 16), bool)}, "mask"),
    ({"bias": np.zeros((1, 1, 16, 16), np.float16)}, "bias"),
    ({"dropout_rate": 0.1, "dropout_rng": jax.random.key(0)}, "dropout"),
])
def test_options_the_kernels_lack_raise_not_implemented(kw, match):
  x = jnp.zeros((1, 16, 2, 64), jnp.float16)
  with pytest.raises(NotImplementedError, match=match):
    jflash.attention(x, x, x, implementation="hip", **kw)


def test_build_cache_key_covers_the_compiler_version(monkeypatch):
  before = build.source_hash("emulate")
  monkeypatch.setattr(build, "compiler_version", lambda target: "g++ (other) 99.0")
  assert build.source_hash("emulate") != before


def test_emulation_compiles_where_the_compiler_fortifies():
  # Ubuntu's gcc sets _FORTIFY_SOURCE at -O1 and above, and a fortified _longjmp aborts
  # the process on the fibers' switch into their stacks: the emulation's source turns
  # it off (emulate_cpu.cc), and its guard (emulate_cpu.h) makes a fortified build an
  # error at compile time rather than an abort at run time.
  import subprocess

  import jax.ffi
  cc = build.compiler("emulate")
  if cc is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) for the CPU emulation")
  cmd = [cc, *build.flags("emulate", jax.ffi.include_dir()), "-D_FORTIFY_SOURCE=2",
         "-fsyntax-only", str(build.CSRC / build.EMULATE_SOURCE)]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
