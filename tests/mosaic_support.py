"""Helpers of the Mosaic GPU tests (tests/test_mosaic.py, tests/test_mosaic_backward.py).

The same tests run two ways. Off a GPU the kernels run under Mosaic GPU's own
interpreter (simulated shared memory, barriers, bulk copies and warpgroups) and the
implementation is let past its Hopper check (`on_hopper`); on a Hopper GPU nothing is
patched and the kernels are compiled and run:

  python -m pytest -q tests/test_mosaic.py tests/test_mosaic_backward.py

Lowering tests (`lowered`) lower for CUDA on any machine and run nothing.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

import jflash
from jflash.reference import error_floor, max_err

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU        # the kernels' `interpret` argument in these tests
off_gpu_only = pytest.mark.skipif(ON_GPU, reason="checks the refusal off a Hopper GPU")


@pytest.fixture
def on_hopper(monkeypatch):
  """jflash's "mosaic_gpu" runs here: off a GPU its Hopper check is told it runs on a
  compute capability 9.0 device, and the adapter interprets the kernels."""
  if not ON_GPU:
    from jflash import mosaic_impl
    monkeypatch.setattr(mosaic_impl, "device_capability", lambda device=None: ("gpu", "9.0"))


def watch_races(monkeypatch):
  """The interpreter's race detector (happens-before over the simulated shared memory
  and barriers) on for the kernels interpreted next; races are printed."""
  from jax._src.pallas.mosaic_gpu.interpret import params

  @dataclasses.dataclass(frozen=True)
  class Racing(params.InterpretGPUParams):
    detect_races: bool = True
  monkeypatch.setattr(params, "InterpretGPUParams", Racing)


def lowered(f, *args) -> str:
  """The text of `f` lowered for CUDA (no GPU needed)."""
  try:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  except ImportError as e:  # pragma: no cover - jaxlib without the Mosaic GPU bindings
    pytest.skip(f"this jaxlib cannot lower Mosaic GPU kernels: {e}")


def kernel_modules(text: str) -> list[str]:
  """Every Mosaic GPU module inside a lowered program, printed as text."""
  from experiments.tools.lowered import mosaic_modules
  return mosaic_modules(text)


def launch_grid(module: str) -> list[int]:
  """The (x, y, z) blocks of a lowered Mosaic GPU module's launch (constant operands)."""
  operands = re.search(r'"stable_mosaic_gpu.gpu.launch"\(%\w+, (%\w+), (%\w+), (%\w+)',
                       module).groups()
  return [int(re.search(re.escape(o) + r' = .*?value = (\d+)', module).group(1))
          for o in operands]


# Register reallocation and the waits for matrix products print as NVVM ops up to jax
# 0.11 ("nvvm.setmaxregister"() {... regCount = 240 ...}, "nvvm.wgmma.wait.group.sync.
# aligned"() {group = 1 ...}) and as the same PTX inline from jax 0.12 (llvm.inline_asm
# "setmaxnreg.inc.sync.aligned.u32 240;", "wgmma.wait_group.sync.aligned 1;"); both
# spellings are read.
_REGISTERS = re.compile(r"setmaxregister.*regCount = (\d+)"
                        r"|setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32 (\d+)")
_SCHEDULE = re.compile(r"(wgmma\.mma_async)"
                       r"|wgmma\.wait[._]group\.sync\.aligned(?:\"\(\) \{group = | )(\d)"
                       r"|(ex2\.approx)")


def register_counts(module: str) -> list[int]:
  """The register counts a Mosaic GPU module's warpgroups set (setmaxnreg), sorted."""
  return sorted(int(a or b) for a, b in _REGISTERS.findall(module))


def schedule(module: str) -> str:
  """A module's matrix products and waits in program order: "M" per issued product,
  "W0" / "W1" per wait for all / all but one group in flight, "e" per run of
  exponentials (ex2.approx)."""
  ops = _SCHEDULE.findall(module)
  return re.sub("e+", "e", "".join("M" if m else f"W{n}" if n else "e" for m, n, _ in ops))


def first_products_a(module: str, n: int) -> set[str]:
  """How the A operand of a module's m64 x n products is passed: "registers" (a brace
  list of registers) or "shared" (a shared-memory matrix descriptor)."""
  found = re.findall(rf"m64n{n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, (\{{|\$)", module)
  return {"registers" if a == "{" else "shared" for a in found}


def _f64(x):
  return np.asarray(x, np.float64) if hasattr(x, "shape") else x


def check_forward(q, k, v, out, lse, **kw):
  """out and lse against the float64 reference under the 2x rule (the plain "xla"
  implementation's error at the same dtype, plus the rounding floor); rows that see no
  key: lse = -inf and zeros. Returns the number of such rows."""
  ref_kw = {a: (tuple(_f64(x) for x in b) if isinstance(b, tuple) else _f64(b))
            for a, b in kw.items()}
  r_out, r_lse = jflash.attention_numpy(*(_f64(x) for x in (q, k, v)), **ref_kw)
  p_out, p_lse = jflash.attention(q, k, v, implementation="xla", return_residuals=True, **kw)
  H = q.shape[-1]
  err, plain = max_err(out, r_out), max_err(p_out, r_out)
  assert err <= 2 * plain + error_floor(q.dtype, r_out, H), (err, plain)
  live = np.isfinite(r_lse)
  lse = np.asarray(lse)
  np.testing.assert_array_equal(lse[~live], -np.inf)
  l_err = max_err(lse[live], r_lse[live])
  assert l_err <= 2 * max_err(np.asarray(p_lse)[live], r_lse[live]) + error_floor(
      np.float32, r_lse[live], H) + 4 * float(jax.numpy.finfo(q.dtype).eps), l_err
  rows_out = np.asarray(out, np.float64).transpose(0, 2, 1, 3)      # [B, N, T, H]
  np.testing.assert_array_equal(rows_out[~live], 0.0)
  return int((~live).sum())


def check_grads(got, q, k, v, do, **kw):
  """The 2x rule per gradient: error against the float64 closed form <= 2x that of the
  plain "xla" implementation at the same dtype, plus the rounding floor of its longest
  sum (S for dQ, T x group for dK and dV)."""
  ref_kw = {a: (tuple(_f64(x) for x in b) if isinstance(b, tuple) else _f64(b))
            for a, b in kw.items()}
  ref = jflash.attention_numpy(*(_f64(x) for x in (q, k, v)), dout=_f64(do), **ref_kw)[2:5]
  plain = jax.vjp(lambda q, k, v: jflash.attention(q, k, v, implementation="xla", **kw),
                  q, k, v)[1](do)
  T, S, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
  for name, g, p, t, n in zip(("dq", "dk", "dv"), got, plain, ref, (S, T * group, T * group)):
    err, err_plain = max_err(g, t), max_err(p, t)
    assert err <= 2 * err_plain + error_floor(q.dtype, t, n), (name, err, err_plain)
