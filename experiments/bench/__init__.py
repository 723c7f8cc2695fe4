"""Benchmark specs (data), peers, the check-then-time runner, the block sweep and reports."""
