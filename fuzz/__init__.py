"""Corruption fuzzing helpers: ``mutators`` (used by tests/test_fuzz.py) and the atheris harness."""
