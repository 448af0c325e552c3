"""``make demo``: the default comparison on the embedded model.

Passkey retrieval at 2k and 4k tokens (4 depths each, to keep the demo short) with budget 64 for the full cache,
StreamingLLM and IceCache (the official configuration and the ``icecache_tuned`` variant) on SmolLM2-135M-Instruct;
prints a table and saves ``results/demo/passkey_demo.png``
(bars from 0 labelled with their values, each run's n in the legend below the axes, dtype and hardware in the footer).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from .config import compose_config
from .harness import REPO_ROOT, run_eval
from .output.summary import collect

METHODS = ("full", "streaming_llm", "icecache", "icecache_tuned")  # the official IceCache beside our variant


def run_demo(methods=METHODS, budget: int = 64, lengths=(2048, 4096), depths: int = 4,
             results_dir: Path = REPO_ROOT / "results" / "demo") -> Path:
    for method in methods:
        cfg = compose_config([f"cache={method}", f"budget={budget}", "eval=passkey",
                              f"eval.lengths=[{','.join(map(str, lengths))}]", f"eval.depths={depths}",
                              f"results_dir={results_dir}"], resolve=False)
        run_eval(OmegaConf.to_container(cfg, resolve=True), config_yaml=OmegaConf.to_yaml(cfg))
    frame = collect(results_dir)
    frame = frame[frame["status"] == "complete"]
    tasks = sorted(c for c in frame.columns if c.startswith("task/"))
    table = frame[["cache", "budget", *tasks, "n_samples", "tt2t_s", "tpot_s"]].copy()
    table["tt2t_s"] = (1000 * table["tt2t_s"]).round(1)
    table["tpot_s"] = (1000 * table["tpot_s"]).round(1)
    print(table.rename(columns={"n_samples": "n", "tt2t_s": "TT2T ms", "tpot_s": "TPOT ms"}).to_string(index=False))
    from .output.passkey_plots import passkey_accuracy_by_length

    models = ", ".join(sorted(set(frame["model"])))
    out = passkey_accuracy_by_length(frame, results_dir / "passkey_demo.png",
                                     f"Passkey retrieval per context length ({models}, budget {budget})")
    print(f"plot: {out}")
    return results_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--depths", type=int, default=4)
    args = parser.parse_args(argv)
    run_demo(tuple(args.methods), args.budget, depths=args.depths)


if __name__ == "__main__":
    main()
