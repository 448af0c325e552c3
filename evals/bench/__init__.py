"""Benchmarks (scripts that measure side by side and print ratios; not tests)."""
