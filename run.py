"""Hydra entry point: ``python run.py eval=longbench cache=icecache budget=64``.

Composes the config, validates it (types, ranges, names, device, paths, data; evals/config_check.py)
before loading anything heavy, runs the suite and prints ``results: <run dir>`` as its last line. It
writes nothing outside the run directory (no ``outputs/`` folder; conf/config.yaml). User errors print one line and exit 2;
``debug=true`` or ``HYDRA_FULL_ERROR=1`` shows the traceback. In a sweep (``-m``) a user error is also raised,
so the launcher (basic or submitit) records that job as failed, the other jobs still run, and
Hydra reports the failed overrides at the end (exit status 1).
"""
from __future__ import annotations

import os
import sys

# OpenMP threads wait libgomp's default way (spin ~300k iterations, then sleep): passive waiting made every
# parallel op of a decode step pay a thread wake-up (full at 4k on SmolLM2: 36-39 -> 52 ms per token,
# docs/benchmarks.md). On a machine shared with other busy processes set OMP_WAIT_POLICY=PASSIVE yourself.
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from evals.configs import register

register()  # the cache/<method> and eval/<suite> groups, generated from the dataclasses


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> str:
    from evals.harness import USER_ERRORS, run_eval
    from evals.report import print_run

    plain = OmegaConf.to_container(cfg, resolve=True)
    debug = plain.get("debug") is True or os.environ.get("HYDRA_FULL_ERROR") == "1"
    try:
        run_dir = run_eval(plain)  # config.yaml records the validated config (device=auto resolved)
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the launcher records this job as failed; the sweep's other jobs still run
        sys.exit(2)
    print_run(run_dir)
    print(f"results: {run_dir}")
    return str(run_dir)


if __name__ == "__main__":
    main()
