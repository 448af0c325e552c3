"""What a run leaves behind and how it is read: result files and provenance (:mod:`~evals.output.results`,
:mod:`~evals.output.schema`), timing records (:mod:`~evals.output.timing`), the summary table
(:mod:`~evals.output.summary`), figures (:mod:`~evals.output.plots`) and W&B logging
(:mod:`~evals.output.wandb_log`)."""
