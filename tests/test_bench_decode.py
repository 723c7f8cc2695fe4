"""`python -m experiments.bench_decode --tiny` runs end to end on the CPU and writes its
JSON: the machinery (correctness gate, device-read ceiling, timing, generate loop),
never the numbers (tests do not assert on time)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tiny_cpu_smoke(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "experiments.bench_decode", "--tiny",
                         "--out-dir", str(tmp_path)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  data = json.loads((tmp_path / "decode_cpu.json").read_text())
  rows = data["rows"]
  cells = {(r["batch"], r["T"], r["S"]) for r in rows}
  assert len(cells) == 2
  for cell in cells:
    peers = {r["peer"]: r for r in rows if (r["batch"], r["T"], r["S"]) == cell}
    for name in ("jflash", "xla", "pallas_decode:bk16,w4,s2,x2"):
      r = peers[name]
      assert r["status"] == "ok", r
      assert r["us"] > 0 and r["tb_s"] > 0 and r["hbm_fraction"] > 0 and r["bytes"] > 0
      if name != "xla":
        assert r["rel_err"] <= 2e-2, r
    assert peers["jflash"]["implementation"] == "xla_chunked"     # the CPU default
    for name in ("cudnn", "jax_pallas_decode"):                    # recorded with a reason
      assert peers[name]["status"] in ("unavailable", "error") and peers[name]["error"]
  gen = {r["peer"]: r for r in data["generate"]}
  assert set(gen) == {"jflash", "plain_jax"}
  assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in gen.values())
  assert gen["jflash"]["speedup_vs_plain_jax"] > 0
  assert gen["jflash"]["same_tokens_as_plain_jax"]
