"""experiments/bench_attention.py runs end to end on the CPU and writes its JSON.

The smoke mode times jflash "xla_chunked" against "xla" at tiny sizes: it checks the
script's machinery (correctness gate, timing loop, memory table, block sweep, JSON),
never the numbers (tests do not assert on time).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "bench_attention.py"
ROW_KEYS = {"impl", "s", "d", "causal", "mode", "tflops", "ms", "rel_err"}


def _run(out_dir, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, str(SCRIPT), *flags, "--cpu-smoke", "--out-dir", str(out_dir)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_quick_cpu_smoke(tmp_path):
  out = _run(tmp_path, "--quick")
  data = json.loads((tmp_path / "bench_attention_cpu_smoke.json").read_text())
  rows = data["rows"]
  assert {r["impl"] for r in rows} == {"jflash", "xla"}
  assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
  for r in rows:
    assert ROW_KEYS <= set(r), r
    assert r["status"] == "ok", r
    assert r["tflops"] > 0 and r["ms"] > 0
    assert r["ref"] == "xla" and r["rel_err"] <= 2e-2  # bf16 chunked vs bf16 dense
  assert data["memory"] and all("temp_size_in_bytes" in m for m in data["memory"])
  assert data["environment"]["backend"] == "cpu"
  assert "jflash / peer" in out


def test_block_sweep_cpu_smoke(tmp_path):
  out = _run(tmp_path, "--block-sweep")
  data = json.loads((tmp_path / "bench_attention_block_sweep_cpu_smoke.json").read_text())
  assert {(r["pass_"], r["mode"]) for r in data["rows"]} == {
      ("fwd", "fwd"), ("dkv", "bwd"), ("dq", "bwd")}
  assert all(r["status"] == "ok" for r in data["rows"]), data["rows"]
  assert {(v["d"], v["causal"], v["pass_"]) for v in data["best"].values()} == {
      (32, False, "fwd"), (32, False, "dkv"), (32, False, "dq")}
  # A candidate sets only its own kernel's fields; the others stay at jflash's table.
  swept = [r for r in data["rows"] if r["pass_"] == "dq" and r["swept"] != "default"]
  assert swept and all(r["block_sizes"]["num_warps_dq"] == 4 and r["block_sizes"]["num_warps"]
                       is None for r in swept)
  assert "paste into pallas_kernels/tuning.py" in out
