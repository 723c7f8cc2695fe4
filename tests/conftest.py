import os
import sys

# The repository root on sys.path so tests can import `tests.*` and `experiments.*`.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
