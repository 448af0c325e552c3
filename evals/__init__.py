"""The evaluation harness, in lm-evaluation-harness's shape.

Core: :mod:`evals.task` (the suite base class), :mod:`evals.registry` (methods and suites by name),
:mod:`evals.config` (the run configuration and its check), :mod:`evals.harness` (config -> run -> results),
:mod:`evals.runner` (the decoding loop and its timing), :mod:`evals.prefill_cache` (captured prefills replayed
into any method), :mod:`evals.models` (model loading and installation) and :mod:`evals.demo`.
Packages: :mod:`evals.tasks` (one module or package per suite), :mod:`evals.output` (result files, timing,
summary tables, plots, W&B) and :mod:`evals.bench` (benchmarks).
"""
