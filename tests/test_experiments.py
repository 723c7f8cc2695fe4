"""Every experiment script runs end to end on CPU in its --tiny configuration, writing to
a temporary folder (the committed results/ stay untouched).

Each runs as `python -m experiments.<name>`, exactly as a user would, in a subprocess
with XLA's CPU backend optimisation turned down: these programs run for milliseconds
and compile for seconds, so optimising them is wasted time.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


REPO = Path(__file__).resolve().parents[1]


def run_script(name, out_dir, *extra):
  # (XLA_FLAGS: conftest's compile-time flags, inherited.)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", f"experiments.{name}", "--tiny", "--out-dir",
       str(out_dir), *extra], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
  return proc


def load(out_dir, stem):
  payload = json.loads((Path(out_dir) / f"{stem}.json").read_text())
  for key in ("environment", "config", "rows"):
    assert key in payload, f"{stem}.json lacks {key!r}"
  assert payload["environment"]["backend"] == "cpu"
  return payload


def test_seq_scaling_tiny(tmp_path):
  run_script("seq_scaling", tmp_path)
  res = load(tmp_path, "seq_scaling_cpu_tiny")
  assert (tmp_path / "seq_scaling_cpu_tiny.png").stat().st_size > 0
  rows = res["rows"]
  att = [r for r in rows if r["part"] == "attention" and r["status"] == "ok"]
  assert {r["impl"] for r in att} == {"standard", "jflash"}       # no cudnn on CPU
  assert all(r["memory"]["total_bytes"] > 0 for r in att)
  assert any(r.get("timed") for r in att) and any(not r.get("timed") for r in att)
  lm = [r for r in rows if r["part"] == "lm"]
  assert lm and all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in lm), lm
  assert any(r["remat"] for r in lm)
  assert res["config"]["preset"] == "tiny"


def test_seq_scaling_records_oom_instead_of_crashing(tmp_path):
  """A memory budget below the standard path's need is an OOM row, and doubling stops."""
  # ~420 KB: T=64 fits; T=128 fits forward only; T=256 fits neither.
  run_script("seq_scaling", tmp_path, "--parts", "attention", "--impls", "standard",
             "--seq-max", "256", "--memory-budget-gb", "0.0004")
  rows = load(tmp_path, "seq_scaling_cpu_tiny_attention")["rows"]
  status = {(r["mode"], r["seq"]): r["status"] for r in rows}
  assert "oom" in status.values(), status
  assert status == {("fwd", 64): "ok", ("fwd+bwd", 64): "ok", ("fwd", 128): "ok",
                    ("fwd+bwd", 128): "oom", ("fwd", 256): "oom",
                    ("fwd+bwd", 256): "skipped"}, status


def test_numerics_tiny(tmp_path):
  run_script("numerics", tmp_path)
  res = load(tmp_path, "numerics_cpu_tiny")
  ok = [r for r in res["rows"] if r["status"] == "ok"]
  assert {r["input"] for r in ok} == {"normal", "all-equal", "logit1e4"}
  for r in ok:
    assert r["nonfinite"] == 0
    # float16 attention is good to ~1e-2 of unit-scale outputs; far worse means a bug.
    assert r["vs_float64"]["max_abs"] < 5e-2, r
  assert (tmp_path / "numerics_cpu_tiny.png").stat().st_size > 0


def test_bandwidth_tiny(tmp_path):
  run_script("bandwidth", tmp_path)
  res = load(tmp_path, "bandwidth_cpu_tiny")
  assert res["ceilings"]["copy_GBps"] > 0 and res["ceilings"]["matmul_TFps"] > 0
  ok = [r for r in res["rows"] if r["status"] == "ok"]
  assert {r["impl"] for r in ok} == {"standard", "jflash"}
  assert all(r["effective_GBps"] > 0 and r["TFps"] > 0 for r in ok)


def test_train_lm_tiny_and_resume(tmp_path):
  proc = run_script("train_lm", tmp_path)
  # No terminal here: plain progress lines, not a bar's carriage returns.
  assert "\r" not in proc.stderr and "text/jflash: 6/6" in proc.stderr, proc.stderr[-2000:]
  res = load(tmp_path, "train_lm_cpu_tiny")
  assert {r["impl"] for r in res["rows"]} == {"standard", "jflash"}
  for r in res["rows"]:
    assert len(r["history"]["train_loss"]) == 6
  # Same weights, same batches: the two curves differ only by attention rounding.
  assert res["agreement"]["text"]["max_abs_train_loss_gap"] < 1e-3
  assert (tmp_path / "train_lm_cpu_tiny.png").stat().st_size > 0
  # Resume one implementation from its step-6 checkpoint and run to step 8.
  proc = run_script("train_lm", tmp_path, "--resume", "--steps", "8", "--impls", "jflash")
  assert "resumed text/jflash" in proc.stdout + proc.stderr
  row = load(tmp_path, "train_lm_cpu_tiny")["rows"][0]
  assert row["resumed_from"] == 6
  assert row["history"]["step"] == list(range(1, 9))


def test_pallas_check_tiny(tmp_path):
  run_script("pallas_check", tmp_path)
  rows = load(tmp_path, "pallas_check_cpu_tiny")["rows"]
  assert len(rows) == 5 and all(r["ok"] for r in rows), rows


def test_ring_memory_tiny(tmp_path):
  run_script("ring_memory", tmp_path)
  row, = load(tmp_path, "ring_memory_cpu_tiny")["rows"]
  assert row["ring_bytes_match"], row
  # Sharded over 8 devices, the same loss and gradients to float32 rounding.
  assert row["check"]["grad_max_rel_diff"] < 1e-4, row["check"]


def _experiment_sources():
  return {p.stem: p.read_text() for p in (REPO / "experiments").glob("*.py")}


def test_every_experiment_has_one_smoke_flag_and_each_default_once_in_its_help():
  """Each script's parser comes from `experiments.common` (the one help formatter);
  its --help lists --tiny and never shows a default twice (the formatter's appended
  "(default: X)" beside a help text that already states one)."""
  sources = _experiment_sources()
  assert [n for n, s in sources.items() if "ArgumentParser(" in s] == ["common"]
  scripts = sorted(n for n, s in sources.items() if "common.parser(" in s
                   or "common.preset_parser(" in s)
  assert len(scripts) >= 12, scripts
  helps = subprocess.run(
      [sys.executable, "-c", HELP_OF_EACH, *scripts], cwd=REPO, capture_output=True,
      text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert helps.returncode == 0, helps.stderr[-3000:]
  for name, text in json.loads(helps.stdout.splitlines()[-1]).items():
    assert "--tiny" in text, f"{name} has no --tiny"
    options = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    for option in (" ".join(o.split()) for o in options):
      assert not re.search(r"default.*\(default: [^)]*\)$", option), f"{name}: {option}"


# Each named script's --help, in one process (the imports once), as one JSON line.
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
helps = {}
for name in sys.argv[1:]:
  sys.argv, out = [name, "--help"], io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
    runpy.run_module(f"experiments.{name}", run_name="__main__")
  helps[name] = out.getvalue()
print(json.dumps(helps))
"""


def test_mi50_preset_times_ten_warm_up_and_fifty_measured_runs():
  # 10 warm-up runs and 50 measured, float16 (gfx906 has no bf16 arithmetic), the HIP
  # kernels against standard attention, a 12-layer LM up to 16K tokens.
  from experiments import seq_scaling
  args = seq_scaling.parse_args(["--preset", "mi50"])
  assert (args.warmup, args.iters, args.lm_iters) == (10, 50, 50)
  assert args.dtype == args.lm_dtype == "float16"
  assert args.lm_impls == "standard,hip" and args.lm_layers == 12 and args.seq_max == 16384


def test_ring_gpu_tiny(tmp_path):
  # Two CPU devices stand in for two GPUs: the ring's forward and gradients within the
  # 2x rule of the single device's error, and the speed/memory rows it records.
  run_script("ring_gpu", tmp_path, "--parts", "check,speed", "--name", "ring_tiny")
  res = load(tmp_path, "ring_tiny")
  assert res["ring_size"] == 2
  checks = res["check"]["rows"]
  assert len(checks) == 8 and all(r["ok"] for r in checks), checks
  speed = res["speed"]
  assert speed and all(r["status"] == "ok" and r["scaling_efficiency"] > 0 for r in speed)
  assert "lm" not in res


def test_profile_step_sums_the_steps_ops_from_the_profiler(tmp_path):
  # On a CPU the trace's XLA ops are the host's; the step's module only.
  run_script("tools.profile_step", tmp_path, "--hlo", "--name", "ps")
  res = load(tmp_path, "ps")
  rows = res["rows"]
  assert rows and all(r["ms"] >= 0 and r["calls"] > 0 for r in rows)
  assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
  assert abs(sum(r["ms"] for r in rows) - res["total_ms_per_step"]) < 1e-3 * len(rows)
  with gzip.open(tmp_path / res["hlo"], "rt") as f:
    hlo = f.read()
  assert "HloModule jit_step" in hlo
  # The model's matmuls are in it: a dot, or a fusion holding one (XLA:CPU's YNNPACK
  # fusions from jaxlib 0.12.1).
  assert any(_computes_a_dot(hlo, r["op"]) for r in rows), [r["op"] for r in rows]


def _computes_a_dot(hlo: str, op: str) -> bool:
  """Whether HLO instruction `op` is a dot or a fusion whose computation holds one."""
  line = next((l for l in hlo.splitlines() if re.match(rf"\s*(ROOT )?%?{re.escape(op)} = ", l)),
              "")
  if " dot(" in line:
    return True
  called = re.search(r"calls=%?([\w.\-]+)", line)
  body = called and re.search(rf"\n%?{re.escape(called.group(1))} [^\n]*\{{\n(.*?)\n\}}", hlo,
                              re.S)
  return bool(body) and " dot(" in body.group(1)


def test_profile_step_of_one_attention_cell(tmp_path):
  # --cell: one attention forward + backward (here the plain "xla" path) instead of the LM.
  run_script("tools.profile_step", tmp_path, "--cell", "tiny causal", "--impl", "xla", "--hlo",
             "--name", "pc")
  res = load(tmp_path, "pc")
  assert res["rows"] and res["config"]["cell"]["name"] == "tiny causal"
  assert (res["config"]["implementation"], res["config"]["backward"]) == ("xla", None)
  assert abs(sum(r["ms"] for r in res["rows"]) - res["total_ms_per_step"]) < 1e-3 * len(res["rows"])
  # The timeline: every event, in order of start; the span covers them all.
  order = res["timeline"]
  assert len(order) == round(sum(r["calls"] for r in res["rows"]) * res["config"]["steps"])
  assert [r["start_ms"] for r in order] == sorted(r["start_ms"] for r in order)
  assert all(0 <= r["start_ms"] <= r["end_ms"] for r in order)
  assert max(r["end_ms"] for r in order) <= res["span_ms_per_step"] * res["config"]["steps"] + 1e-3
  with gzip.open(tmp_path / res["hlo"], "rt") as f:
    assert "HloModule jit_step" in f.read()
  with pytest.raises(ValueError, match="--config is for --cell"):
    from experiments.tools import profile_step
    profile_step.main(["--tiny", "--config", "{}"])


def test_compare_lowered_tells_equal_kernels_from_changed_ones(tmp_path):
  # This tree against a copy of its packages: every Mosaic GPU module the same, and the
  # same backward picked; with the copy's exp2 constant changed, the forward differs
  # (the lowering needs no GPU). Each tree lowers in a process of its own.
  copy_packages(tmp_path / "base")
  env = dict(os.environ, JAX_PLATFORMS="cpu")

  def compare(name):
    subprocess.run(
        [sys.executable, "-m", "experiments.tools.compare_lowered", str(tmp_path / "base"),
         "--seq", "256", "--heads", "2", "--head-dim", "64", "--causal", "--out-dir",
         str(tmp_path), "--name", name], cwd=REPO, env=env, check=True, timeout=300,
        capture_output=True)
    return {r["kernel"]: r for r in json.loads((tmp_path / f"{name}.json").read_text())["rows"]}
  rows = compare("same")
  assert set(rows) == {"forward 0", "backward 0", "backward 1", "backward_kind"}
  assert all(r["same"] for r in rows.values())
  common = tmp_path / "base" / "pallas_kernels" / "mosaic_gpu" / "common.py"
  text = common.read_text()
  assert "\nLOG2E = " in text
  common.write_text(text.replace("\nLOG2E = ", "\nLOG2E = 1.0001 * ", 1))
  rows = compare("changed")
  assert not rows["forward 0"]["same"] and rows["forward 0"]["differing_lines"] > 0


def test_compare_lowered_sees_operands_rewired():
  # Two modules that differ only in which values an op reads are not the same kernel.
  from experiments.tools.compare_lowered import compare
  a = {"forward": ["%0 = arith.addf %1, %2 : f32\n%3 = arith.mulf %0, %2 : f32"]}
  b = {"forward": ["%0 = arith.addf %1, %2 : f32\n%3 = arith.mulf %1, %2 : f32"]}
  assert compare(a, a)[0]["same"]
  assert not compare(a, b)[0]["same"]


def test_ab_kernels_selects_cells_by_name():
  from experiments.tools import ab_kernels
  names = [c.name for c in ab_kernels.select_cases("fa2 16K d128 causal,LM")]
  assert names == ["fa2 16K d128 causal", "LM 4K d128 causal"]
  assert ab_kernels.select_cases(None) == ab_kernels.specs.FA2_QUICK
  with pytest.raises(ValueError, match="names none"):
    ab_kernels.select_cases("no such cell")
  with pytest.raises(ValueError, match="leave out --cells"):
    ab_kernels.select_cases("LM", tiny=True)


def test_config_candidates_records_each_candidate_beside_the_peers(tmp_path):
  # Off a GPU every mosaic_gpu row is "unavailable" with the implementation's reason;
  # the peer is checked and timed.
  run_script("tools.config_candidates", tmp_path, "--cells", "smoke", "--peers", "xla",
             "--modes", "fwd", "--candidates", '{"consumers": 3}', '{"persistent": true}',
             "--name", "cand")
  rows = load(tmp_path, "cand")["rows"]
  assert [r["peer"] for r in rows] == [
      "xla", "jflash:mosaic_gpu", "jflash:mosaic_gpu[consumers=3]",
      "jflash:mosaic_gpu[persistent=True]"]
  assert rows[0]["status"] == "ok" and rows[0]["tflops"] > 0
  assert all(r["status"] == "unavailable" and "Hopper" in r["error"] for r in rows[1:])


def test_config_candidates_refuses_a_field_the_config_lacks():
  from experiments.tools import config_candidates
  with pytest.raises(TypeError, match="block_m"):
    config_candidates.candidate_peer({"block_m": 64})


def test_profile_step_counts_only_the_innermost_events():
  # A host while loop's event spans its body's op events on the same line.
  from types import SimpleNamespace as E
  from experiments.tools.profile_step import leaves
  loop, a, b, after = E(start_ns=0, duration_ns=100), E(start_ns=10, duration_ns=20), \
      E(start_ns=40, duration_ns=30), E(start_ns=100, duration_ns=5)
  assert leaves([b, loop, after, a]) == [a, b, after]


def copy_packages(tree):
  """A copy of this tree's packages (as another commit's worktree would hold them)."""
  import shutil
  from experiments.tools import ab_kernels
  for name in ab_kernels.PACKAGES:
    shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))


def test_ab_kernels_times_another_trees_kernels_beside_this_ones(tmp_path):
  # A copy of this tree's packages stands in for another commit's.
  copy_packages(tmp_path / "base")
  run_script("tools.ab_kernels", tmp_path, str(tmp_path / "base"), "--rounds", "2",
             "--warm-ms", "0", "--name", "ab_tiny", "--config", '{"block_q": 32}')
  res = load(tmp_path, "ab_tiny")
  assert res["trees"]["base"] == str((tmp_path / "base").resolve())
  assert [r["mode"] for r in res["rows"]] == ["fwd", "fwd+bwd"]
  assert all(r["config"] == {"block_q": 32} for r in res["rows"])
  assert all(r["this_ms"] > 0 and r["base_ms"] > 0 and r["this_over_base"] > 0
             for r in res["rows"])


AB_OWN_HELPERS = """
import sys
from pathlib import Path
import jax.numpy as jnp
import pytest
from experiments.tools import ab_kernels
from experiments.bench import specs
base = Path(sys.argv[1])
case = specs.Case(64, 16, True, 1, 1, name="tiny")
x = jnp.zeros((1, 64, 1, 16), jnp.bfloat16)
ab_kernels.programs(ab_kernels.load_tree(ab_kernels.TREE), case, "fwd", (x,) * 4)
with pytest.raises(RuntimeError, match="base helper"):
  ab_kernels.programs(ab_kernels.load_tree(base), case, "fwd", (x,) * 4)
import pallas_kernels.common
assert Path(pallas_kernels.common.__file__).parent == ab_kernels.TREE / "pallas_kernels"
print("ok")
"""


def test_ab_kernels_traces_each_tree_with_its_own_helpers(tmp_path):
  # The kernels import some helpers while they are traced: the other tree's must be
  # traced with its own. Its copy here raises from one of them. (A process of its own:
  # the check swaps packages in sys.modules.)
  base = tmp_path / "base"
  copy_packages(base)
  with open(base / "pallas_kernels" / "common.py", "a") as f:
    f.write("\n\ndef dot_heads(*args, **kwargs):\n  raise RuntimeError('base helper')\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", AB_OWN_HELPERS, str(base)], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_profile_kernels_runs_the_steps_it_names(capsys):
  # The program ncu profiles (experiments/tools/profile_h200.sh): on a CPU with a plain-JAX
  # implementation, forward+backward and forward only, inputs made on the host.
  from experiments.tools import profile_kernels
  for extra in ([], ["--forward-only"]):
    profile_kernels.main(["--seq", "64", "--head-dim", "16", "--heads", "2", "--kv-heads", "1",
                          "--batch", "1", "--implementation", "xla_chunked", "--steps", "1",
                          *extra])
  out = capsys.readouterr().out
  assert "(1, 64, 2, 1, 16) non-causal xla_chunked fwd+bwd (auto)" in out
  assert "xla_chunked forward" in out


def test_ncu_summary_keeps_each_kernels_last_launch(tmp_path, capsys):
  # An `ncu --page raw --csv` export in miniature (header, units, one row per launch):
  # two launches of one kernel and another kernel of the same name but another launch
  # shape (Mosaic GPU names its kernels alike); read plain and gzipped.
  import gzip
  from experiments.tools import ncu_summary
  header = ['"Kernel Name"', '"Grid Size"', '"Block Size"', '"gpu__time_duration.sum"',
            '"sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"',
            '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"']
  rows = [",".join(header), '"","","","ms","%",""',
          '"k","(132, 1, 1)","(384, 1, 1)","9.0","10.0","1.0"',
          '"k","(132, 1, 1)","(384, 1, 1)","1.5","49.5","1.6"',
          '"k","(1, 16, 256)","(128, 1, 1)","6.3","77.0","1.4"']
  text = "==PROF== Connected\n" + "\n".join(rows) + "\n"
  (tmp_path / "raw.csv").write_text(text)
  with gzip.open(tmp_path / "raw.csv.gz", "wt") as f:
    f.write(text)
  for name in ("raw.csv", "raw.csv.gz"):
    ncu_summary.summarize(tmp_path / name)
    out = capsys.readouterr().out
    assert out.count("### k") == 2
    assert "time                    1.5 ms" in out and "9.0" not in out
    assert "49.50  sm__pipe_tensor_cycles_active" in out and "77.00" in out
    assert "1.600  smsp__average_warps_issue_stalled_wait" in out


def test_sass_summary_reads_a_mosaic_gpu_dump(tmp_path, capsys):
  # A `MOSAIC_GPU_DUMP_TO` directory in miniature: one kernel with ptxas's log (the
  # committed one of the fused dQ kernel), its PTX and its SASS; another with the log only.
  import shutil
  from experiments.tools import sass_summary
  logs = REPO / "experiments/results/ptxas_h200"
  shutil.copy(logs / "bwd_d128_fused2/_dkv_kernel_1.ptxas", tmp_path / "k.ptxas")
  (tmp_path / "k.ptx").write_text(
      ".maxntid 384, 1, 1\n.minnctapersm 1\n\tsetmaxnreg.dec.sync.aligned.u32 40;\n"
      "\tsetmaxnreg.inc.sync.aligned.u32 232;\n")
  (tmp_path / "k.sass").write_text(
      "        /*0010*/                   USETMAXREG.DEALLOC.CTAPOOL 0x28 ;\n"
      "        /*0020*/              @!P0 STL [R1], R2 ;\n"
      "        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;\n"
      "        /*0040*/              @UP0 LDL.64 R2, [R1] ;\n")
  shutil.copy(logs / "fwd_d64/anonymous_0.ptxas", tmp_path / "m.ptxas")
  sass_summary.summarize(tmp_path)
  out = capsys.readouterr().out
  assert out.count("### ") == 2
  assert "'USETMAXREG': 1, 'LDL': 1, 'STL': 1, 'HGMMA': 1" in out
  assert "USETMAXREG.DEALLOC.CTAPOOL 0x28 ;" in out
  assert "C7512" in out and "488 bytes spill stores" in out
  assert "'.minnctapersm 1'" in out and "setmaxnreg.inc.sync.aligned.u32 232" in out
  assert "0 bytes spill stores" in out            # the forward's log, read alone


class PowerCappedCard:
  """A simulated card whose calls slow as it works: every call takes `cold` seconds
  until `heat_s` seconds of work are done, then `hot` seconds (a clock brought down by
  a power limit). Its clock is the timers' `time.perf_counter`."""

  def __init__(self, cold=1.0, hot=1.25, heat_s=30.0):
    self.now, self.busy, self.calls = 0.0, 0.0, []
    self.cold, self.hot, self.heat_s = cold, hot, heat_s

  def program(self, label):
    def call():
      cost = self.hot if self.busy >= self.heat_s else self.cold
      self.now += cost
      self.busy += cost
      self.calls.append(label)
    return call, ((),), lambda out: out


def test_alternating_timing_gives_identical_programs_identical_times(monkeypatch):
  from experiments import common
  card = PowerCappedCard()
  monkeypatch.setattr(common.time, "perf_counter", lambda: card.now)
  # One after another, the second program is timed on a hotter card than the first.
  first = common.time_calls(*card.program("a")[:2], rounds=5, round_s=4.0)
  second = common.time_calls(*card.program("b")[:2], rounds=5, round_s=4.0)
  assert second["median_s"] > first["median_s"]
  # Warmed and alternated, both see the card held under load: equal to the last bit.
  card = PowerCappedCard()
  monkeypatch.setattr(common.time, "perf_counter", lambda: card.now)
  times = common.time_alternating({"a": card.program("a"), "b": card.program("b")},
                                  rounds=5, round_s=4.0, warm_s=40.0)
  assert times["a"]["median_s"] == times["b"]["median_s"] == card.hot
  # Calls per round counted again from the warm rounds: 4 s of the held card's 1.25 s calls.
  assert times["a"]["s_by_round"] == [card.hot] * 5 and times["a"]["calls_per_round"] == 3


def test_alternating_timing_counts_calls_per_round_from_the_warm_rounds(monkeypatch):
  from experiments import common
  card = PowerCappedCard(heat_s=1e9)
  monkeypatch.setattr(common.time, "perf_counter", lambda: card.now)
  calls = []

  def first_call_slow():    # its one estimating call catches the card at its idle clock
    card.now += 20.0 if not calls else 1.0
    calls.append(1)
  times = common.time_alternating({"a": (first_call_slow, ((),), lambda o: o)},
                                  rounds=3, round_s=10.0, warm_s=5.0, warmup=1)
  assert times["a"]["calls_per_round"] == 10 and times["a"]["s_by_round"] == [1.0] * 3


def test_alternating_timing_balances_the_order_of_the_programs(monkeypatch):
  from experiments import common
  card = PowerCappedCard()
  monkeypatch.setattr(common.time, "perf_counter", lambda: card.now)
  programs = {n: card.program(n) for n in "abc"}
  common.time_alternating(programs, rounds=6, round_s=1.0, warm_s=0.0, warmup=1)
  # One estimating call each, then each round's calls: rotated, every other round reversed.
  assert "".join(card.calls) == "abc" + "abc" + "cba" + "bca" + "acb" + "cab" + "bac"
  assert "".join("".join(common.round_order("ab", r)) for r in range(4)) == "abbabaab"


def test_a_program_that_fails_while_timed_leaves_the_others_timed(monkeypatch):
  from experiments import common
  card = PowerCappedCard()
  monkeypatch.setattr(common.time, "perf_counter", lambda: card.now)
  calls = []

  def flaky():
    card.now += 1.0
    calls.append(1)
    if len(calls) > 3:          # its estimate and two rounds, then the third round
      raise RuntimeError("device lost")
  times = common.time_alternating({"a": card.program("a"), "b": (flaky, ((),), lambda o: o)},
                                  rounds=4, round_s=1.0, warm_s=0.0, warmup=1)
  assert times["b"] == {"error": "RuntimeError: device lost"}
  assert times["a"]["rounds"] == 4
  assert common.time_alternating({}) == {}


def test_launch_model_orders_are_the_grid_and_balance_as_stated():
  # Every order is a permutation of the grid's programs; the head-group remap with
  # groups of one is the grid's own order; the grid's level-by-level launch is
  # longest-first, so it ends within 1% of the mean work (4K d64 causal), and a single
  # round of programs then holds every (batch, head) pair it can.
  from experiments.tools import launch_model as lm
  blocks, heads, batch = 16, 32, 4
  grid = lm.grid_order(blocks, heads, batch)
  for order in (lm.head_group_order(blocks, heads, batch, 32),
                lm.tile_group_order(blocks, heads, batch, 4)):
    assert sorted(order) == sorted(grid)
  assert lm.head_group_order(blocks, heads, batch, 1) == grid
  assert lm.imbalance(grid, blocks, 4.0) < 1.01
  assert lm.pairs_per_round(grid) > 128 - 1
  assert lm.pairs_per_round(lm.tile_group_order(blocks, heads, batch, 4)) == 33.0
  # one program per multiprocessor: the launch ends with the heaviest program
  assert lm.imbalance([(0, 0, 0)] * 3, 1, 1.0, fill=0.0, sms=3) == 1.0


def test_compile_time_measures_each_variant_in_a_fresh_process(tmp_path):
  run_script("compile_time", tmp_path, "--repeat", "2", "--forward-first", "--name", "ct")
  rows = load(tmp_path, "ct")["rows"]
  assert [r["repeat"] for r in rows] == [0, 1] and all(r["status"] == "ok" for r in rows), rows
  assert rows[0]["pid"] != rows[1]["pid"]
  for r in rows:
    for step in ("fwd_train", "fwd+bwd"):
      t = r[step]
      assert t["compile_s"] > 0 and t["first_call_s"] >= t["lower_s"] + t["compile_s"] - 0.02


def test_compile_time_records_a_failed_process_and_goes_on(tmp_path):
  from experiments import compile_time
  path = compile_time.main(["--shape", "1,64,2,32", "--implementation", "no_such_impl",
                            "--repeat", "2", "--out-dir", str(tmp_path), "--name", "ct"])
  rows = json.loads(path.read_text())["rows"]
  assert [r["status"] for r in rows] == ["error", "error"], rows
  assert "no_such_impl" in rows[0]["error"]
  with pytest.raises(SystemExit):
    compile_time.parse_args(["--variants", "[{"])
