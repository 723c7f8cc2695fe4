"""The gfx906 kernel on a machine without an AMD GPU: build, resource audit, lowering
for ROCm, and the host-side checks. Runs in CI (.ci/run installs hipcc and
libamdhip64-dev from Debian); with CI set, a missing hipcc is a failure, not a skip.
"""
from __future__ import annotations

import os
import re

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


def test_every_kernel_is_in_the_report(reports):
  table = build.tile_table()
  want = {(d, t, c) for d in table for t in range(len(table[d])) for c in (True, False)}
  got = set()
  for r in reports:
    m = re.search(r"flash_fwd_kernel<(\d+), (\d+), (true|false)>", r.name)
    assert m, r.name
    got.add((int(m.group(1)), int(m.group(2)), m.group(3) == "true"))
  assert got == want


def test_no_spills_lds_within_budget_two_waves(reports):
  for r in reports:
    assert r.scratch_bytes == 0, f"{r.name}: {r.scratch_bytes} bytes of scratch (spills)"
    assert r.lds_bytes <= 64 * 1024, f"{r.name}: LDS {r.lds_bytes} > 64 KiB"
    assert r.lds_bytes <= 48 * 1024, f"{r.name}: LDS {r.lds_bytes} > the 48 KiB budget"
    assert r.waves_per_simd >= 2, f"{r.name}: compiler occupancy {r.waves_per_simd}"
    assert r.waves_per_simd_lds >= 2, f"{r.name}: LDS allows {r.waves_per_simd_lds}"


def test_dot2_in_the_inner_loops(reports):
  for r in reports:
    assert r.dot2_in_loops > 0, f"{r.name}: no v_dot2_f32_f16 inside a loop"
    assert r.dot2_in_loops == r.dot2, f"{r.name}: dot2 outside the key-tile loop"


def test_lds_matches_the_tile_table(reports):
  pad = 8  # kPad in flash_fwd.hip
  table = build.tile_table()
  for r in reports:
    d, t = map(int, re.search(r"<(\d+), (\d+),", r.name).groups())
    bq, bk, nt = table[d][t]
    halves = bq * (d + pad) + max(bk * (d + pad), bq * (bk + pad)) + d * (bk + pad)
    assert r.lds_bytes == 2 * halves, r.name
    assert r.workgroup_size == nt, r.name


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


@pytest.mark.parametrize("H,is_causal", [(64, True), (128, False)])
def test_lowers_to_the_custom_call_for_rocm(rocm_lib, H, is_causal):
  B, T, S, N, K = 2, 97, 113, 8, 2
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float16)
  kv = jax.ShapeDtypeStruct((B, S, K, H), jnp.float16)
  fn = lambda q, k, v: jflash.attention(q, k, v, scale=0.25, is_causal=is_causal,
                                        implementation="hip", return_residuals=True)
  text = _lower_rocm(fn, q, kv, kv)
  calls = [l for l in text.splitlines() if "stablehlo.custom_call" in l]
  assert len(calls) == 1 and f"@{hip_ffi.TARGET_NAME}(" in calls[0], calls
  call = calls[0]
  assert re.search(r"@jflash_flash_fwd\(%\w+, %\w+, %\w+\)", call)  # q, k, v
  assert (f"(tensor<{B}x{T}x{N}x{H}xf16>, tensor<{B}x{S}x{K}x{H}xf16>, "
          f"tensor<{B}x{S}x{K}x{H}xf16>) -> (tensor<{B}x{T}x{N}x{H}xf16>, "
          f"tensor<{B}x{N}x{T}xf32>)") in call
  assert f"is_causal = {str(is_causal).lower()}" in call
  assert "scale = 2.500000e-01 : f32" in call
  assert "tile = 0 : i32" in call


def test_tile_attribute_follows_block_sizes(rocm_lib):
  bq, bk, _ = build.tile_table()[64][1]
  q = jax.ShapeDtypeStruct((1, 64, 2, 64), jnp.float16)
  fn = lambda q, k, v: jflash.attention(q, k, v, implementation="hip",
                                        block_sizes=jflash.BlockSizes(bq, bk))
  assert "tile = 1 : i32" in _lower_rocm(fn, q, q, q)


def test_gradient_recomputes_without_a_second_custom_call(rocm_lib):
  # The backward is jflash.chunked.backward from (q, k, v, out, lse): one forward call.
  q = jax.ShapeDtypeStruct((1, 97, 2, 64), jnp.float16)
  fn = lambda q, k, v: jax.grad(lambda q: jflash.attention(
      q, k, v, is_causal=True, implementation="hip").astype(jnp.float32).sum())(q)
  text = _lower_rocm(fn, q, q, q)
  assert text.count("stablehlo.custom_call @jflash_flash_fwd") == 1


# -- host-side checks -----------------------------------------------------------------------

def _aval(shape, dtype=jnp.float16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("q,k,v,kw,match", [
    (_aval((1, 8, 2, 64), jnp.float32), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "q.dtype=float32"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64), jnp.bfloat16), _aval((1, 8, 2, 64)), {}, "k.dtype=bfloat16"),
    (_aval((8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "rank 4"),
    (_aval((1, 8, 3, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {}, "N=3"),
    (_aval((1, 8, 2, 96)), _aval((1, 8, 2, 96)), _aval((1, 8, 2, 96)), {}, "head_dim=96"),
    (_aval((1, 8, 2, 64)), _aval((1, 9, 2, 64)), _aval((1, 8, 2, 64)), {}, "differ"),
    (_aval((1, 8, 2, 64)), _aval((2, 8, 2, 64)), _aval((2, 8, 2, 64)), {}, "batch"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"tile": 7}, "tile=7"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"scale": float("nan")}, "scale=nan"),
    (_aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), _aval((1, 8, 2, 64)), {"is_causal": 1}, "is_causal=1"),
], ids=["q-f32", "k-bf16", "rank", "gqa", "head-dim", "k-v", "batch", "tile", "scale", "causal"])
def test_raw_op_rejects_bad_inputs_before_the_call(q, k, v, kw, match):
  args = {"scale": 0.125, "is_causal": False, "tile": 0, **kw}
  with pytest.raises(ValueError, match=re.escape(match)):
    jax.eval_shape(lambda q, k, v: hip_ffi.flash_forward(q, k, v, **args), q, k, v)


def test_raw_op_shapes():
  q, kv = _aval((2, 97, 8, 128)), _aval((2, 113, 2, 128))
  out, lse = jax.eval_shape(
      lambda q, k, v: hip_ffi.flash_forward(q, k, v, scale=0.1, is_causal=True), q, kv, kv)
  assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, jnp.float16, (2, 8, 97), jnp.float32)


@pytest.mark.parametrize("dtype,H,blocks,match", [
    (jnp.float32, 64, None, "float16"),
    (jnp.bfloat16, 64, None, "float16"),
    (jnp.float16, 96, None, "head_dim=96"),
    (jnp.float16, 64, jflash.BlockSizes(16, 16), "not a compiled tile"),
])
def test_unsupported_calls_raise_not_implemented(dtype, H, blocks, match):
  x = jnp.zeros((1, 16, 2, H), dtype)
  with pytest.raises(NotImplementedError, match=match):
    jflash.attention(x, x, x, implementation="hip", block_sizes=blocks)


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


@pytest.mark.parametrize("kw,match", [
    ({"local_window_size": 4}, "window"),
    ({"logits_soft_cap": 30.0}, "soft_cap"),
    ({"mask": np.ones((1, 1, 16, 16), bool)}, "mask"),
])
def test_options_the_kernel_lacks_raise_not_implemented(kw, match):
  x = jnp.zeros((1, 16, 2, 64), jnp.float16)
  with pytest.raises(NotImplementedError, match=match):
    jflash.attention(x, x, x, implementation="hip", **kw)
