"""Evaluation suites (one module each), their metrics, the runner and the results writer."""
