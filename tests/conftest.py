import faulthandler
import os
import sys

import pytest

# XLA's CPU client runs host callbacks on its Eigen thread pool, one thread per core
# unless PJRT_NPROC says otherwise. Mosaic GPU's interpreter runs each warpgroup (and
# each program of a persistent grid) as its own computation whose barrier waits are
# callbacks that block their thread: with two cores, two blocked waits can hold the
# whole pool while the warpgroup that would release them waits for a thread (seen as
# an intermittent hang of the interpreted persistent-grid test on a loaded two-core
# machine: 1 run of 4, none of 6 with a larger pool). Every test process and the
# scripts it starts get a pool larger than the most waits a test holds at once.
os.environ.setdefault("PJRT_NPROC", "16")

# Most of the suite's time is XLA's CPU compiler, not the programs it compiles (small
# shapes; Pallas and Mosaic GPU interpreted as large programs of ops and callbacks).
# These two flags lower LLVM's effort on the generated code (test_pallas.py +
# test_nan.py on two cores: 187 s -> 136 s). Level 1, not 0: level 0 changed XLA's
# elementwise results (the gradient of 5 tanh(x / 5) at x = 50: 3.6e-7 against 0 at
# the default level, and a NaN in the plain implementation's float32 soft-cap
# gradient); level 1 gave the default's results there, and the suite passes with it.
# Set before jax starts in this process; the scripts tests start inherit them.
XLA_TEST_FLAGS = ("--xla_backend_optimization_level=1",
                  "--xla_llvm_disable_expensive_passes=true")
_own_flags = os.environ.get("XLA_FLAGS", "")    # a flag set there keeps its value
os.environ["XLA_FLAGS"] = " ".join(
    [_own_flags, *(f for f in XLA_TEST_FLAGS if f.split("=")[0] not in _own_flags)]).strip()


def _compile_each_interpreted_program_once():
  """Mosaic GPU's interpreter (jax 0.10) runs each warpgroup and program of a kernel as
  a thread that lowers and compiles the same jaxpr for itself (`thread_map._run_jaxpr`):
  one call of a kernel with 3 warpgroups on 3 programs compiled its program 9 times,
  about 1.4 s each, most of an interpreted test's time. Here every thread given the
  same jaxpr object shares one executable: the first compiles, the others wait for it
  (6.0 s -> 1.4 s for that call). Each thread still runs it with its own arguments, as
  before. Left alone unless the interpreter's function is the one this replaces."""
  import collections
  import inspect
  import threading
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return
  original = getattr(thread_map, "_run_jaxpr", None)
  try:
    source = inspect.getsource(original)
  except (TypeError, OSError):
    return
  if not all(line in source for line in (
      "def _run_jaxpr(jaxpr, consts, *args):",
      "traced = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args)",
      "traced.lower().compile()(consts, *args)")):
    return
  import jax
  from jax._src import core as jax_core

  def run(jaxpr, consts, *args):
    jax_core.eval_jaxpr(jaxpr, consts, *args)

  lock = threading.Lock()
  # id(jaxpr) -> [jaxpr, Event set once compiled, executable]; the 16 latest compiled
  executables = collections.OrderedDict()

  def run_jaxpr(jaxpr, consts, *args):
    with lock:
      entry = executables.get(id(jaxpr))
      first = entry is None or entry[0] is not jaxpr
      if first:
        entry = executables[id(jaxpr)] = [jaxpr, threading.Event(), None]
        while len(executables) > 16:
          executables.popitem(last=False)
    if first:
      try:
        entry[2] = jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
      except BaseException:
        with lock:              # the next call compiles again and raises its own error
          if executables.get(id(jaxpr)) is entry:
            del executables[id(jaxpr)]
        raise
      finally:
        entry[1].set()
    else:
      entry[1].wait()
    if entry[2] is None:
      raise RuntimeError("the interpreted program failed to compile in another thread")
    entry[2](consts, *args)

  thread_map._run_jaxpr = run_jaxpr


_compile_each_interpreted_program_once()

# The repository root on sys.path so tests can import `tests.*` and `experiments.*`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A test still running after this long is taken as hung: every thread's stack is printed
# and its process exits (the run stops, or under pytest-xdist that worker, and the test
# fails), instead of waiting out CI's limit. (Mosaic GPU's interpreter runs
# each warpgroup as a thread; one that raises leaves the others waiting on a barrier.
# The slowest step, the ring tests' 8-device worker, took 90-120 s on two cores.)
HANG_S = 900


@pytest.fixture(autouse=True)
def _hang_watchdog():
  faulthandler.dump_traceback_later(HANG_S, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()
