"""`python -m experiments.bench_attention` runs end to end on the CPU and writes its JSON.

The smoke mode times jflash "xla_chunked" against "xla" at tiny sizes: it checks the
script's machinery (correctness gate, timing loop, memory table, block sweep, JSON),
never the numbers (tests do not assert on time).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.bench import report

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"impl", "s", "d", "causal", "mode", "tflops", "ms", "rel_err"}


def _run(out_dir, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attention", *flags, "--tiny", "--out-dir", str(out_dir)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_quick_tiny(tmp_path):
  out = _run(tmp_path, "--quick")
  data = json.loads((tmp_path / "bench_attention_cpu_tiny.json").read_text())
  rows = data["rows"]
  assert {r["impl"] for r in rows} == {"jflash", "xla"}
  assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
  for r in rows:
    assert ROW_KEYS <= set(r), r
    assert r["status"] == "ok", r
    assert r["tflops"] > 0 and r["ms"] > 0
    assert len(r["ms_by_round"]) == 2   # the smoke's rounds, timed alongside the cell's peers
    assert r["ref"] == "xla" and r["rel_err"] <= 2e-2  # bf16 chunked vs bf16 dense
  for (key, mode), cell in report.by_cell(rows).items():
    assert len({c["timing_group"] for c in cell.values()}) == 1, (key, mode)
  assert data["memory"] and all("temp_size_in_bytes" in m for m in data["memory"])
  assert data["environment"]["backend"] == "cpu"
  assert "jflash / peer" in out


def test_block_sweep_tiny(tmp_path):
  out = _run(tmp_path, "--block-sweep")
  data = json.loads((tmp_path / "bench_attention_block_sweep_cpu_tiny.json").read_text())
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


def test_unavailable_implementations_are_rows_not_crashes(tmp_path):
  # "hip" is registered but raises NotImplementedError for bf16 on a CPU; the other name
  # is not registered. Both become rows saying why; the run goes on and writes its JSON.
  _run(tmp_path, "--quick", "--skip-memory", "--modes", "fwd",
       "--jflash-impls", "xla_chunked,hip,no_such_implementation")
  data = json.loads((tmp_path / "bench_attention_cpu_tiny.json").read_text())
  by = {r["peer"]: r for r in data["rows"]}
  assert by["jflash:xla_chunked"]["status"] == "ok"
  assert by["jflash:hip"]["status"] == "unavailable" and "hip" in by["jflash:hip"]["error"]
  bad = by["jflash:no_such_implementation"]
  assert bad["status"] == "unavailable" and "not registered" in bad["error"]
  # What implementation=None resolves to on this device is recorded per case.
  assert set(data["resolved"].values()) == {"xla_chunked"}


def test_report_joins_runs_and_evaluates_targets(tmp_path):
  """Targets are evaluated from rows: a cell meets "vs_peer" exactly when jflash's TF/s
  reach the factor times the peer's, and a missing peer leaves it unmeasured."""
  from experiments.bench import report, specs
  mqa = specs.MQA

  def row(peer, tflops, mode="fwd+bwd", **kw):
    return dict(impl=peer.split(":")[0], peer=peer, key=mqa.key(), case=mqa.name, s=mqa.s,
                d=mqa.d, causal=mqa.causal, mode=mode, tflops=tflops, status="ok", **kw)
  rule = next(t for t in specs.TARGETS if t.kind == "vs_peer" and t.cases == (mqa,)
              and t.impl == "pallas")
  cudnn = 400.0
  for factor, met in ((rule.value * 1.01, True), (rule.value * 0.99, False)):
    rows = [row("jflash:pallas", cudnn * factor, first_call_s=1.0), row("cudnn", cudnn)]
    got = [t for t in report.evaluate_targets(rows) if t["kind"] == "vs_peer"
           and t["impl"] == "pallas" and t["key"] == mqa.key()]
    assert [t["met"] for t in got] == [met]
  rows = [row("jflash:pallas", 300.0, first_call_s=1.0)]
  got = {t["kind"]: t for t in report.evaluate_targets(rows) if t["impl"] == "pallas"}
  assert got["vs_peer"]["met"] is None and got["compile_s"]["met"] is True
  # The --report mode reads JSONs written by runs and prints the same evaluation.
  paths = []
  for i, rs in enumerate(([row("jflash:pallas", 300.0, first_call_s=1.0)], [row("cudnn", 500.0)])):
    paths.append(report.save(f"part{i}", {}, rs, tmp_path))
  out = subprocess.run(
      [sys.executable, "-m", "experiments.bench_attention", "--report", *map(str, paths),
       "--baseline", str(tmp_path / "none.json"), "--name", "joined", "--out-dir", str(tmp_path)],
      cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  joined = json.loads((tmp_path / "joined.json").read_text())
  assert len(joined["rows"]) == 2
  assert any(t["kind"] == "vs_peer" and t["met"] is False for t in joined["targets"])
  assert "MISSED" in out.stdout


def test_round_ratios_pair_the_rounds_two_peers_were_timed_in():
  mine = {"ms_by_round": [2.0, 4.0, 5.0], "timing_group": "a"}
  peer = {"ms_by_round": [3.0, 4.0, 4.0], "timing_group": "a"}
  assert report.round_ratios(mine, peer) == [1.5, 1.0, 0.8]   # peer's time over jflash's
  # Rounds timed apart (another cell, another process) are not paired.
  assert report.round_ratios(mine, dict(peer, timing_group="b")) is None
  assert report.round_ratios(mine, {"ms": 3.0}) is None
