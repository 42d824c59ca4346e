"""Helpers shared by test modules (not fixtures: those live in tests/conftest.py)."""
