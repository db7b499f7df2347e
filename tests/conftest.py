"""Shared pytest configuration for the whole test tree."""

import os

from hypothesis import HealthCheck, settings

# Hypothesis profiles (DESIGN.md section 9). Pick one with HYPOTHESIS_PROFILE (default "ci"):
#   ci       : few examples, derandomized so CI runs are reproducible; no deadline (the dense
#              float64 oracle and first-call warm-up make per-example times uneven).
#   thorough : many examples, random, for local or nightly runs:
#              HYPOTHESIS_PROFILE=thorough python -m pytest tests/kernels -m "not gpu"
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=400,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
