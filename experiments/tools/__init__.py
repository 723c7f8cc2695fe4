"""Investigation tools: profilers, lowered-module comparisons, A/B timing of two trees,
the device run. Run from the repository root as `python -m experiments.tools.<name>`."""
