"""The suites, one module or package each, registered by name in :data:`evals.registry.SUITES`."""
