import faulthandler
import os
import sys

import pytest

# The repository root on sys.path so tests can import `tests.*` and `experiments.*`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A test still running after this long is taken as hung: every thread's stack is printed
# and the run stops, instead of waiting out CI's limit. (Mosaic GPU's interpreter runs
# each warpgroup as a thread; one that raises leaves the others waiting on a barrier.
# The slowest test took 28 s in a clean-clone CI run on two cores.)
HANG_S = 900


@pytest.fixture(autouse=True)
def _hang_watchdog():
  faulthandler.dump_traceback_later(HANG_S, exit=True)
  yield
  faulthandler.cancel_dump_traceback_later()
