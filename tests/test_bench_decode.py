"""`python -m experiments.bench_decode --tiny` runs end to end on the CPU and writes its
JSON: the machinery (correctness gate, device-read ceiling, timing, generate loop),
never the numbers (tests do not assert on time)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    for name in ("jflash", "xla", "pallas_decode:bk16,w4,s2,p8,up,t1"):
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


def test_generate_alone_at_the_sizes_given(tmp_path):
  from experiments import bench_decode
  argv = ["--tiny", "--skip-attention", "--gen-contexts", "8,12", "--gen-batches", "1",
          "--gen-steps", "2", "--out-dir", str(tmp_path)]
  args = bench_decode.parse_args(argv)
  assert (args.gen_contexts, args.gen_batches, args.gen_steps) == ((8, 12), (1,), 2)
  assert args.gen_model == bench_decode.PRESETS["tiny"]["gen_model"]  # the rest: the preset's
  data = json.loads(bench_decode.main(argv).read_text())
  assert data["rows"] == []
  assert sorted((r["context"], r["peer"], r["steps"]) for r in data["generate"]) == [
      (8, "jflash", 2), (8, "plain_jax", 2), (12, "jflash", 2), (12, "plain_jax", 2)]
  assert all(r["status"] == "ok" for r in data["generate"])


@pytest.mark.parametrize("option, value", [("--gen-steps", "0"), ("--gen-contexts", "8,x"),
                                           ("--gen-batches", "-1")])
def test_bad_generate_size_is_refused(option, value, capsys):
  from experiments import bench_decode
  with pytest.raises(SystemExit):
    bench_decode.parse_args(["--tiny", option, value])
  assert value in capsys.readouterr().err
