"""Builds the jflash HIP/CUDA shared library, cached by source hash; gfx906 ISA report.

  python -m hip_ffi.build                  # hipcc --offload-arch=gfx906 (nvcc if no hipcc)
  python -m hip_ffi.build --target cuda    # nvcc -arch=sm_90 (the H200 logic check)
  python -m hip_ffi.build --report         # per-kernel VGPR/SGPR/scratch/LDS/occupancy/dot2
  python -m hip_ffi.build --target emulate # g++: the kernel on CPU fibers, for tests

The library lands in hip_ffi/_build/<target>-<hash>/ (gitignored), where <hash> covers
the sources, the compiler flags, the compiler's version and the jaxlib version (the
FFI headers). A build
with the same hash is reused; a changed source builds into a new folder.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD_ROOT = HERE / "_build"
SOURCES = {  # what each target compiles (compat.h pulls emulate_cpu.h in only for "emulate")
    "rocm": ("compat.h", "flash_attn.hip"),
    "cuda": ("compat.h", "flash_attn.hip"),
    "emulate": ("compat.h", "flash_attn.hip", "emulate_cpu.h", "emulate_cpu.cc"),
}
MAIN_SOURCE = "flash_attn.hip"
EMULATE_SOURCE = "emulate_cpu.cc"
LIB_NAME = "libjflash_hip.so"
ASM_NAME = "flash_attn-gfx906.s"
TARGETS = ("rocm", "cuda", "emulate")
GFX_ARCH = "gfx906"
CUDA_ARCH = "sm_90"


class BuildError(RuntimeError):
  """The compiler is missing or failed; the message carries its output."""


def _include_dir() -> str:
  import jax.ffi
  return jax.ffi.include_dir()


def _jaxlib_version() -> str:
  try:
    from importlib.metadata import version
    return version("jaxlib")
  except Exception:  # jaxlib without metadata (source build): hash on the headers only
    return "unknown"


def compiler(target: str) -> str | None:
  """Path of the compiler for `target`, or None when it is not installed."""
  if target == "rocm":
    return shutil.which("hipcc")
  if target == "cuda":
    nvcc = shutil.which("nvcc")
    if nvcc is None and os.environ.get("CUDA_HOME"):
      cand = Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc"
      nvcc = str(cand) if cand.exists() else None
    return nvcc
  if target == "emulate":
    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
  raise ValueError(f"target={target!r} must be one of {TARGETS}")


def default_target() -> str:
  """hipcc (the product) when installed, else nvcc."""
  for t in ("rocm", "cuda"):
    if compiler(t):
      return t
  raise BuildError("neither hipcc nor nvcc is on PATH; install hipcc "
                   "(Debian: apt-get install hipcc libamdhip64-dev) or the CUDA toolkit")


def flags(target: str, include_dir: str) -> list[str]:
  common = ["-O3", "-std=c++17", "-shared", f"-I{include_dir}"]
  if target == "rocm":
    # -x hip: the .hip suffix is enough for hipcc, but be explicit; --save-temps keeps
    # the gfx906 assembly for the resource report. The XLA FFI headers trip
    # -Wreturn-type in switch-on-enum helpers: not our code.
    return ["-x", "hip", f"--offload-arch={GFX_ARCH}", "-fPIC", "--save-temps",
            "-Wno-return-type", *common]
  if target == "emulate":
    return ["-x", "c++", "-fPIC", "-Wno-return-type", *common]
  return ["-x", "cu", f"-arch={CUDA_ARCH}", "-Xcompiler", "-fPIC",
          "-Xcompiler", "-Wno-return-type", "-diag-suppress", "940,2473", *common]


def _env(target: str) -> dict:
  env = dict(os.environ)
  if target == "rocm":
    # hipcc picks the NVIDIA path when it finds nvcc on PATH; the product is AMD.
    env["HIP_PLATFORM"] = "amd"
  return env


@functools.cache
def compiler_version(target: str) -> str:
  """`<compiler> --version` output (empty without the compiler): part of the cache key,
  so a library built by another hipcc/nvcc/g++ (another ROCm on the MI50) is rebuilt."""
  cc = compiler(target)
  if cc is None:
    return ""
  try:
    proc = subprocess.run([cc, "--version"], env=_env(target), capture_output=True, text=True,
                          timeout=60)
  except (OSError, subprocess.TimeoutExpired) as e:
    return f"{cc}: {e}"
  return proc.stdout + proc.stderr


def source_hash(target: str) -> str:
  """Hash of the sources, the flags, the jaxlib version (FFI headers) and the compiler."""
  h = hashlib.sha256()
  for name in SOURCES[target]:
    h.update(name.encode())
    h.update((CSRC / name).read_bytes())
  h.update(" ".join(flags(target, "<inc>")).encode())
  h.update(_jaxlib_version().encode())
  h.update(compiler_version(target).encode())
  return h.hexdigest()[:16]


def build_dir(target: str) -> Path:
  return BUILD_ROOT / f"{target}-{source_hash(target)}"


def cached_library(target: str) -> Path | None:
  """The library built from the current sources, or None (never compiles)."""
  lib = build_dir(target) / LIB_NAME
  return lib if lib.exists() else None


def build(target: str | None = None, *, force: bool = False, verbose: bool = False) -> Path:
  """Compiles the library for `target` ("rocm" or "cuda") unless cached; returns its path."""
  target = target or default_target()
  out_dir = build_dir(target)
  lib = out_dir / LIB_NAME
  if lib.exists() and not force:
    return lib
  cc = compiler(target)
  if cc is None:
    tool = {"rocm": "hipcc", "cuda": "nvcc", "emulate": "g++"}[target]
    raise BuildError(f"{tool} not found on PATH (needed for target={target!r})")
  BUILD_ROOT.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=BUILD_ROOT, prefix=".tmp-") as tmp:
    tmp = Path(tmp)
    src = CSRC / (EMULATE_SOURCE if target == "emulate" else MAIN_SOURCE)
    cmd = [cc, *flags(target, _include_dir()), str(src), "-o", str(tmp / LIB_NAME)]
    if verbose:
      print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=tmp, env=_env(target), capture_output=True, text=True)
    if proc.returncode != 0 or not (tmp / LIB_NAME).exists():
      raise BuildError(f"compile failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                       f"{proc.stdout}\n{proc.stderr}")
    (tmp / "command.txt").write_text(" ".join(cmd) + "\n")
    if target == "rocm":
      asm = list(tmp.glob(f"*-hip-amdgcn-amd-amdhsa-{GFX_ARCH}.s"))
      if not asm:
        raise BuildError(f"hipcc --save-temps left no {GFX_ARCH} assembly in {tmp}")
      asm[0].rename(tmp / ASM_NAME)
    for f in tmp.iterdir():  # keep the library, the assembly and the command only
      if f.name not in (LIB_NAME, ASM_NAME, "command.txt"):
        f.unlink() if f.is_file() else shutil.rmtree(f)
    if force and out_dir.exists():
      shutil.rmtree(out_dir)
    try:
      tmp.rename(out_dir)  # atomic: a concurrent build of the same hash wins the race
      tmp.mkdir()  # TemporaryDirectory cleans up a path that must exist
    except OSError:
      if not lib.exists():
        raise
  return lib


LDS_PAD_HALVES = 8  # kPad in the kernel source: every LDS row is padded by 16 bytes


def conflict_free_128bit(row_stride_bytes: int) -> bool:
  """Whether 8 lanes reading 16 bytes each from 8 consecutive LDS rows hit 32 distinct
  banks (one phase of a 128-bit LDS read on GCN: 32 banks of 4 bytes)."""
  banks = [(r * row_stride_bytes // 4 + w) % 32 for r in range(8) for w in range(4)]
  return row_stride_bytes % 16 == 0 and len(set(banks)) == 32


def lds_row_strides() -> dict[str, int]:
  """Every LDS row stride (bytes) the kernels read with 128-bit loads, by name."""
  strides = {}
  for d, rows in tile_table().items():
    for t, (bq, bk, _) in enumerate(rows):
      strides[f"fwd d={d} tile {t}: Q/K rows"] = 2 * (d + LDS_PAD_HALVES)
      strides[f"fwd d={d} tile {t}: P/V^T rows"] = 2 * (bk + LDS_PAD_HALVES)
  for d, (bq, bkv, _) in bwd_tile_table().items():
    strides[f"bwd d={d}: Q/dO/K/V rows"] = 2 * (d + LDS_PAD_HALVES)
    strides[f"bwd d={d}: Q^T/dO^T/P^T/dS^T rows"] = 2 * (bq + LDS_PAD_HALVES)
    strides[f"bwd d={d}: K^T/dS rows"] = 2 * (bkv + LDS_PAD_HALVES)
  return strides


@functools.cache     # read once per process: every raw op's input check asks for it
def tile_table() -> dict[int, tuple[tuple[int, int, int], ...]]:
  """{head_dim: ((BQ, BK, threads) per `tile` index)}, read from FwdTileTable in the source."""
  text = (CSRC / MAIN_SOURCE).read_text()
  rows = re.findall(r"FwdTileTable<(\d+), (\d+)>\s*\{\s*static constexpr int "
                    r"BQ = (\d+),\s*BK = (\d+),\s*NT = (\d+);", text)
  table: dict[int, dict[int, tuple[int, int, int]]] = {}
  for d, t, bq, bk, nt in rows:
    table.setdefault(int(d), {})[int(t)] = (int(bq), int(bk), int(nt))
  return {d: tuple(v[i] for i in sorted(v)) for d, v in sorted(table.items())}


@functools.cache
def bwd_tile_table() -> dict[int, tuple[int, int, int]]:
  """{head_dim: (BQ, BKV, threads)}, read from BwdTileTable in the source."""
  text = (CSRC / MAIN_SOURCE).read_text()
  rows = re.findall(r"BwdTileTable<(\d+)>\s*\{\s*static constexpr int "
                    r"BQ = (\d+),\s*BKV = (\d+),\s*NT = (\d+);", text)
  return {int(d): (int(bq), int(bk), int(nt))
          for d, bq, bk, nt in sorted(rows, key=lambda r: int(r[0]))}


# -- the gfx906 resource report ---------------------------------------------------------

@dataclasses.dataclass
class KernelReport:
  name: str
  vgprs: int
  sgprs: int
  scratch_bytes: int
  lds_bytes: int
  workgroup_size: int
  waves_per_simd: int          # the compiler's occupancy (VGPR, SGPR and LDS limits)
  waves_per_simd_lds: int      # LDS alone: blocks per CU x waves per block / 4 SIMDs
  dot2: int                    # v_dot2_f32_f16 in the whole kernel
  dot2_in_loops: int           # ... inside loop bodies (the key-tile loop)
  global_loads: dict = dataclasses.field(default_factory=dict)  # mnemonic -> count


def _demangle(names: list[str]) -> list[str]:
  tool = shutil.which("c++filt") or shutil.which("llvm-cxxfilt")
  if not tool:
    return names
  out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
  lines = out.stdout.splitlines()
  return lines if out.returncode == 0 and len(lines) == len(names) else names


def parse_gfx906_asm(text: str) -> list[KernelReport]:
  """Per-kernel resources from the comments and metadata LLVM writes into the .s file."""
  funcs = re.findall(r"-- Begin function (\S+)\n(.*?)\n\.Lfunc_end", text, re.S)
  stats = {}
  for name, body in funcs:
    tail = text[text.index(body) + len(body):]
    tail = tail[:tail.find("-- Begin function")] if "-- Begin function" in tail else tail
    num = lambda key, src=tail: int(re.search(rf"; {key}: (\d+)", src).group(1))
    # A basic block starts at a label (".LBB0_3:" or "; %bb.3:"); LLVM marks loop
    # members on that line or on the comment-only lines right after it.
    in_loop, header, dot2, dot2_loop = False, False, 0, 0
    loads: dict[str, int] = {}
    for line in body.splitlines():
      op = re.match(r"^\s+((?:global|flat|buffer)_load_\w+)", line)
      if op:
        loads[op.group(1)] = loads.get(op.group(1), 0) + 1
      if re.match(r"^(\.LBB\d+_\d+:|; %bb\.\d+:)", line):
        in_loop, header = "Loop" in line, True
      elif header and re.match(r"^\s+;", line):
        in_loop = in_loop or "Loop" in line
      else:
        header = False
      if "v_dot2_f32_f16" in line:
        dot2 += 1
        dot2_loop += in_loop
    lds = int(re.search(r"; LDSByteSize: (\d+)", tail).group(1))
    stats[name] = dict(vgprs=num("NumVgprs"), sgprs=num("NumSgprs"),
                       scratch_bytes=num("ScratchSize"), lds_bytes=lds,
                       waves_per_simd=num("Occupancy"), dot2=dot2, dot2_in_loops=dot2_loop,
                       global_loads=loads)
  # The amdhsa metadata block lists each kernel's .name and .max_flat_workgroup_size.
  for m in re.finditer(r"\.max_flat_workgroup_size:\s*(\d+).*?\.name:\s*(\S+)", text, re.S):
    if m.group(2) in stats:
      stats[m.group(2)]["workgroup_size"] = int(m.group(1))
  reports = []
  pretty = _demangle(list(stats))
  for (name, st), shown in zip(stats.items(), pretty):
    wg = st.pop("workgroup_size", 64)
    waves_block = -(-wg // 64)
    lds_blocks = 65536 // st["lds_bytes"] if st["lds_bytes"] else 40
    st["waves_per_simd_lds"] = min(10, lds_blocks * waves_block // 4)
    reports.append(KernelReport(name=shown, workgroup_size=wg, **st))
  return reports


def report(lib: Path | None = None) -> list[KernelReport]:
  """Builds (or reuses) the gfx906 library and parses its assembly."""
  lib = lib or build("rocm")
  return parse_gfx906_asm((lib.parent / ASM_NAME).read_text())


def format_report(reports: list[KernelReport]) -> str:
  w = max([len("kernel")] + [len(r.name) for r in reports])
  head = (f"{'kernel':<{w}} {'VGPR':>5} {'SGPR':>5} {'scratch':>7} {'LDS':>6} {'wg':>4} "
          f"{'waves/SIMD':>10} {'(LDS)':>5} {'dot2':>5} {'in loops':>8}")
  rows = [head, "-" * len(head)]
  for r in reports:
    rows.append(f"{r.name:<{w}} {r.vgprs:>5} {r.sgprs:>5} {r.scratch_bytes:>7} "
                f"{r.lds_bytes:>6} {r.workgroup_size:>4} {r.waves_per_simd:>10} "
                f"{r.waves_per_simd_lds:>5} {r.dot2:>5} {r.dot2_in_loops:>8}")
  return "\n".join(rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m hip_ffi.build", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--target", choices=TARGETS, default=None,
                  help="rocm: hipcc for gfx906; cuda: nvcc for sm_90; emulate: g++, the "
                  "kernel on CPU fibers (default: rocm if hipcc exists, else cuda)")
  ap.add_argument("--report", action="store_true", help="print the gfx906 resource report")
  ap.add_argument("--force", action="store_true", help="rebuild even if cached")
  args = ap.parse_args(argv)
  try:
    target = "rocm" if args.report else (args.target or default_target())
    lib = build(target, force=args.force, verbose=True)
    print(f"built {lib}")
    if args.report:
      print(format_report(report(lib)))
  except BuildError as e:
    print(f"hip_ffi.build: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
