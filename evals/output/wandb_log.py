"""Optional Weights & Biases logging of a finished run directory (``wandb.enabled=true``).

One W&B run per run directory, named so the comparison dashboard groups itself (docs/wandb.md):
project ``wandb.project``, group ``"<eval>/<model>"``, run name the run directory's name
(``"<cache>-b<budget>-<hash>"``, unique per resolved configuration) followed by the cache options that differ
from the method's defaults (``"icecache-b64-3f2a1b4c (page_size=8)"``), tags for the eval, model, cache and
budget. Each finished sample logs one history step; at the end the run summary (not the history) gets the
headline score and per-task scores, TTFT/TT2T/TPOT (mean, p50, p90) and the TPOT breakdown per phase, peak
memory and, for runs with ``diagnostics=recall``, the pooled attention-mass recall (``recall.json``); charts
and tables are logged once: the effective tokens attended per layer, the TPOT breakdown, the recall per
layer and the per-sample predictions (references as plain text, :func:`reference_text`).

Everything is read back from the run directory (``metrics.json``, ``timing.json``, ``predictions.jsonl``),
so ``python -m evals.output.wandb_log <results_dir>`` can also upload runs made without W&B, e.g. on a cluster
with no network. ``wandb`` is imported only when logging is enabled. Offline mode (``wandb.mode=offline``
or ``WANDB_MODE=offline``) writes the run under ``$WANDB_DIR/wandb/`` (default ``./wandb``) with no
network; ``wandb sync`` uploads it later. The W&B run id is derived from the run directory, so logging the
same directory again (a resumed sweep) updates that W&B run instead of creating a duplicate.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
from pathlib import Path

import yaml

from .results import load_predictions
from .schema import RECALL_SCALARS, TIMING_SCALARS, read_recall, read_results, recall_columns

# Config keys that describe where or how a run was executed, not what it computed.
NOT_LOGGED = ("wandb", "hydra")


def enabled(cfg: dict) -> bool:
    return bool((cfg.get("wandb") or {}).get("enabled"))


NAMED_OPTIONS = 3  # cache options spelled out in a run name; more are counted ("+2 more")


def run_names(cfg: dict, run_dir: Path) -> dict:
    """W&B project/entity/group/name/tags of a run (the dashboard's grouping keys). The name is the run
    directory's (``<cache>-b<budget>-<hash of the other settings>``: two configurations never share it) and the
    cache options that differ from the method's defaults (:func:`changed_cache_options`)."""
    wb = cfg.get("wandb") or {}
    ev, model, cache, budget = cfg["eval"]["name"], cfg["model"]["name"], cfg["cache"]["name"], cfg.get("budget")
    changed = changed_cache_options(cfg["cache"])
    if len(changed) > NAMED_OPTIONS:
        changed = [*changed[:NAMED_OPTIONS], f"+{len(changed) - NAMED_OPTIONS} more"]
    name = Path(run_dir).name + (f" ({', '.join(changed)})" if changed else "")
    return {"project": wb.get("project") or "icecache-bench", "entity": wb.get("entity"),
            "group": f"{ev}/{model}", "name": name, "tags": [ev, model, cache, f"budget={budget}"]}


def changed_cache_options(cache: dict) -> list[str]:
    """``key=value`` for each option of a ``cache`` group that differs from its method's defaults (overrides and
    a suite's official setting, conf/suite_cache/), in the group's order."""
    from ..config import defaults
    from .results import canonical

    base = defaults("cache", cache.get("name", ""))
    return [f"{key}={_text(value)}" for key, value in cache.items()
            if key != "name" and key in base and canonical(value) != canonical(base[key])]


def _text(value) -> str:
    """A config value as the command line spells it (``true``, ``null``, ``[1,2]``)."""
    return json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value


def run_id(run_dir: Path) -> str:
    """A stable W&B run id for a run directory (eval/model/run name + the stamped config hash)."""
    stamp = (run_dir / "config_hash").read_text().strip() if (run_dir / "config_hash").exists() else ""
    key = "/".join(run_dir.parts[-3:]) + ":" + stamp
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def scalars(metrics: dict, timing: dict) -> dict:
    """Flat numbers for the run summary: score, task/<t>, timing, breakdown/<phase>, memory, and for the
    latency suite length/<L>/<key>."""
    out = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out.update({f"task/{t}": v for t, v in metrics.get("tasks", {}).items()})
    for key in TIMING_SCALARS:
        if timing.get(key) is not None:
            out[key] = timing[key]
    out.update({f"breakdown/{p}": v for p, v in timing.get("breakdown", {}).items()})
    for length, at in metrics.get("lengths", {}).items():  # latency suite: timing per context length
        out.update({f"length/{length}/{k}": v for k, v in at.items() if isinstance(v, (int, float))})
        out.update({f"length/{length}/breakdown/{p}": v for p, v in at.get("breakdown", {}).items()})
    if timing.get("peak_memory_bytes"):
        out["peak_memory_gib"] = timing["peak_memory_bytes"] / 2**30
    effective = [v for v in timing.get("effective_tokens_per_layer", []) if v is not None]
    if effective:
        out["effective_tokens_mean"] = sum(effective) / len(effective)
    return out


def has_recall(recall: dict | None) -> bool:
    """A ``recall.json`` with per-layer recall (runs with ``diagnostics=recall``)."""
    return bool(recall) and "recall" in recall.get("per_layer", {})


def recall_chart(recall: dict | None) -> dict:
    """``diagnostics=recall`` runs: a recall-per-layer line plot (its pooled numbers go to the summary)."""
    if not has_recall(recall):
        return {}
    import wandb

    per_layer = recall["per_layer"]["recall"]
    table = wandb.Table(columns=["layer", "recall_mean", "recall_median", "recall_p10"],
                        data=[list(r) for r in zip(recall["layers"], per_layer["mean"], per_layer["median"],
                                                   per_layer["p10"])])
    return {"recall_per_layer": wandb.plot.line(table, "layer", "recall_mean",
                                                title="Attention-mass recall per layer")}


def reference_text(reference) -> str | None:
    """A sample's reference as the predictions table shows it: a string as it is, a list of strings or numbers
    as its items joined by `` | `` (``["25248"]`` shows ``25248``), anything else (a mapping) as JSON once."""
    if reference is None or isinstance(reference, str):
        return reference
    if isinstance(reference, (list, tuple)) and all(isinstance(v, (str, int, float)) for v in reference):
        return " | ".join(str(v) for v in reference)
    return json.dumps(reference, ensure_ascii=False, default=str)


def prediction_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Columns and rows of the per-sample predictions table."""
    columns = ["id", "task", "reference", "prediction", "score", "scores", "meta", "tt2t_s", "n_output_tokens"]
    data = []
    for r in rows:
        timing = r.get("timing") or {}
        data.append([r["id"], r["task"], reference_text(r.get("reference")), r["prediction"],
                     r["scores"].get("score"), json.dumps(r["scores"]), json.dumps(r.get("meta", {}), default=str),
                     timing.get("tt2t_s"), len(timing.get("intervals_s", [])) + 1 if timing else None])
    return columns, data


def sample_scalars(row: dict, done: int) -> dict:
    """What one finished sample logs while a run is going: its scores, TT2T/TPOT and the samples done."""
    timing = row.get("timing") or {}
    out = {f"sample/{k}": v for k, v in row["scores"].items() if isinstance(v, (int, float))}
    intervals = timing.get("intervals_s") or []
    out.update({f"sample/{k}": v for k, v in (row.get("recall") or {}).items() if k in RECALL_SCALARS})
    out.update({"sample/tt2t_s": timing.get("tt2t_s"), "samples_done": done,
                "sample/tpot_s": sum(intervals) / len(intervals) if intervals else None})
    return {k: v for k, v in out.items() if v is not None}


@contextlib.contextmanager
def session(cfg: dict, run_dir: Path):
    """The W&B run of a run directory, open for the whole evaluation (``None`` when W&B is disabled): samples
    log as they finish (:func:`sample_scalars`), then :func:`log_run` adds the summary and tables to it. An
    exception (Ctrl-C, a user error) marks the W&B run failed without W&B's traceback and footer."""
    if not enabled(cfg):
        yield None
        return
    import wandb

    run_dir = Path(run_dir)
    config = {k: v for k, v in cfg.items() if k not in NOT_LOGGED}
    wb = cfg.get("wandb") or {}
    run = wandb.init(**run_names(cfg, run_dir), id=run_id(run_dir), resume="allow", mode=wb.get("mode"),
                     job_type="eval", config={**config, "run_dir": str(run_dir)},
                     settings=wandb.Settings(console="off"))
    try:
        yield run
    except BaseException as err:  # Ctrl-C, a user error: the caller says it in one line, W&B adds nothing
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run.finish(exit_code=2 if isinstance(err, KeyboardInterrupt) else 1)
        raise
    run.finish()


def log_run(cfg: dict, run_dir: Path, run=None) -> str | None:
    """Logs one finished run directory to W&B when ``cfg["wandb"]["enabled"]`` -- into ``run`` (an open
    :func:`session`) or a session of its own: its numbers into the run summary, its charts and tables as one
    step; returns the W&B run id."""
    if not enabled(cfg):
        return None
    if run is None:
        with session(cfg, run_dir) as own:
            return log_run(cfg, run_dir, own)
    import wandb

    run_dir = Path(run_dir)
    metrics, timing = read_results(run_dir)
    layers = wandb.Table(columns=["layer", "effective_tokens"],
                         data=[[i, v] for i, v in enumerate(timing.get("effective_tokens_per_layer", []))])
    phases = wandb.Table(columns=["phase", "seconds_per_token"],
                         data=[[p, v] for p, v in timing.get("breakdown", {}).items()])
    columns, data = prediction_rows(load_predictions(run_dir / "predictions.jsonl"))
    recall = read_recall(run_dir)
    # numbers go to the run summary only: logged as a step, each would also become a one-point history chart
    run.summary.update({**scalars(metrics, timing), **(recall_columns(recall) if has_recall(recall) else {})})
    run.log({**recall_chart(recall),
             "effective_tokens_per_layer": wandb.plot.line(layers, "layer", "effective_tokens",
                                                           title="Effective tokens attended per layer"),
             "tpot_breakdown": wandb.plot.bar(phases, "phase", "seconds_per_token",
                                              title="TPOT breakdown (s per output token)"),
             "predictions": wandb.Table(columns=columns, data=data)})
    return run_id(run_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Logs every finished run directory under a results folder to W&B")
    parser.add_argument("results_dir", nargs="?", default="results")
    parser.add_argument("--project", default=None)
    parser.add_argument("--entity", default=None)
    parser.add_argument("--mode", default=None, choices=["online", "offline"])
    args = parser.parse_args(argv)
    for stamp in sorted(Path(args.results_dir).rglob("config_hash")):
        run_dir = stamp.parent
        if not (run_dir / "metrics.json").exists():
            print(f"skipped (incomplete): {run_dir}")
            continue
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        wb = dict(cfg.get("wandb") or {}, enabled=True)
        wb.update({k: v for k, v in (("project", args.project), ("entity", args.entity), ("mode", args.mode)) if v})
        print(f"logged {log_run(dict(cfg, wandb=wb), run_dir)}: {run_dir}")


if __name__ == "__main__":
    main()
