"""Benchmarks (scripts run with python -m icecache.bench.<name>)."""
