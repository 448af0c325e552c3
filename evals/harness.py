"""Compose config -> validate (cheap, before any heavy work) -> model, cache, suite -> run -> results.

``run.py`` is the Hydra front end; this module takes a plain resolved config dict so tests, notebooks
and sweeps can call :func:`run_eval` directly.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from icecache.kv import BudgetError, KVMethod, make_method
from icecache.kv.registry import UnknownNameError
from icecache.models import ModelUnavailableError, dtype_record, load_model, load_tokenizer, model_entry, resolve_dtype

from . import results, wandb_log
from .base import DataError, resolve_budget
from .config_check import ConfigError, check_config, check_results_dir
from .registry import suite_class
from .runner import generate

REPO_ROOT = Path(__file__).resolve().parents[1]

# Errors caused by the user's input: reported in one line, without a traceback (run.py).
USER_ERRORS = (ConfigError, BudgetError, UnknownNameError, DataError, ModelUnavailableError,
               results.RunDirError, FileNotFoundError)
__all__ = ["ConfigError", "USER_ERRORS", "Plan", "plan", "run_eval"]


def resolve_path(p: str | None) -> Path | None:
    if p is None:
        return None
    path = Path(p)
    return path if path.is_absolute() else REPO_ROOT / path


def cache_options(cfg: dict) -> tuple[str, dict]:
    opts = dict(cfg["cache"])
    return opts.pop("name"), opts


@dataclass
class Plan:
    """A validated run: everything that can fail cheaply has been checked."""

    cfg: dict
    method_name: str
    method_options: dict
    suite_cls: type
    suite_options: dict
    run_dir: Path

    def method(self, n_prompt_tokens: int) -> KVMethod:
        return make_method(self.method_name, budget=resolve_budget(self.cfg.get("budget"), n_prompt_tokens),
                           debug=bool(self.cfg.get("debug")), **self.method_options)


def plan(cfg: dict) -> Plan:
    """Validates types, names, budget, limit, paths and data before loading anything heavy."""
    cfg = check_config(cfg)
    cfg["model"] = _model_settings(cfg["model"])
    budget = cfg.get("budget")
    name, options = cache_options(cfg)
    try:  # a bad name, budget or hyperparameter fails here, before any model is loaded
        make_method(name, budget=resolve_budget(budget, 1 << 20), **options)
    except (TypeError, ValueError) as err:
        if isinstance(err, (BudgetError, UnknownNameError)):
            raise
        raise ConfigError(f"cache '{name}': {err}") from None
    suite_opts = {k: v for k, v in cfg["eval"].items() if k != "name"}
    suite_cls = suite_class(cfg["eval"]["name"])
    data_dir = resolve_path(cfg.get("data_dir"))
    if getattr(suite_cls, "needs_data", False) and (data_dir is None or not data_dir.is_dir()):
        raise FileNotFoundError(f"eval '{cfg['eval']['name']}' needs its data, but data_dir={data_dir} is not a "
                                "directory; pass data_dir=/path/to/data (see ../shared/data/README.md)")
    results_dir = resolve_path(cfg.get("results_dir") or "results")
    check_results_dir(results_dir)
    cfg = dict(cfg, results_dir=str(results_dir), data_dir=None if data_dir is None else str(data_dir))
    return Plan(cfg, name, options, suite_cls, suite_opts, results.run_dir_for(cfg))


def _model_settings(model: dict) -> dict:
    """The model group with its name checked (a custom name needs ``model.path``), its local files
    checked, and, for an unregistered local model, the context length read from its ``config.json``."""
    path = model.get("path")
    if path is not None:
        path = str(resolve_path(path))
    entry = model_entry(model["name"], path)
    if entry.source == "local" and entry.max_length:
        model = dict(model, max_length=entry.max_length)
    return dict(model, path=path)


def run_eval(cfg: dict, config_yaml: str = "", on_row=None) -> Path:
    """Runs (or resumes) one evaluation and writes its run directory; returns its path."""
    p = plan(cfg)
    cfg = p.cfg
    tokenizer = load_tokenizer(cfg["model"]["name"], cfg["model"].get("path"))
    suite = _suite(p, tokenizer)
    samples = list(suite.samples())
    if not samples:
        raise DataError(f"eval '{cfg['eval']['name']}' has no samples (empty data file or task list); "
                        f"data_dir={cfg.get('data_dir')}")
    run = results.RunDir(p.run_dir, cfg, config_yaml or yaml.safe_dump(cfg, sort_keys=False))
    try:
        _run(p, suite, samples, run, on_row)
    except BaseException:
        run.discard_if_empty()
        raise
    finally:
        run.close()
    return p.run_dir


def _suite(p: Plan, tokenizer):
    cfg = p.cfg
    try:
        return p.suite_cls(tokenizer, data_dir=cfg["data_dir"], max_length=cfg["model"].get("max_length") or 8192,
                           seed=cfg.get("seed", 0), limit=cfg.get("limit"), **p.suite_options)
    except TypeError as err:
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None
    except ValueError as err:
        if isinstance(err, DataError):
            raise
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None


def _up_to_date(run_dir: Path, rows: list[dict]) -> bool:
    """metrics.json and timing.json exist and were computed from every row now in the directory."""
    try:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        json.loads((run_dir / "timing.json").read_text())
    except (OSError, ValueError):
        return False
    return metrics.get("n_samples") == len(rows)


def _run(p: Plan, suite, samples: list, run: results.RunDir, on_row) -> None:
    """Generates the samples not yet in ``run``, then (re)computes metrics and timing from all its rows."""
    cfg = p.cfg
    todo = [s for s in samples if s.id not in run.done_ids()]
    # Optional W&B logging (a no-op unless wandb.enabled=true): samples log as they finish, then the run's
    # summary and tables; a rerun of a finished directory logs its existing results.
    with wandb_log.session(cfg, p.run_dir) as wb:
        if todo or not _up_to_date(p.run_dir, run.rows):
            _generate_rows(p, suite, todo, run, _with_live_log(on_row, wb, len(run.rows)))
            results.write_json(p.run_dir / "metrics.json", suite.aggregate(run.rows))
            results.write_json(p.run_dir / "timing.json", summarize_timing(run.rows, cfg))
        if len(run.rows) > len(samples):
            print(f"note: {p.run_dir} holds {len(run.rows)} samples and its metrics cover all of them (limit="
                  f"{cfg.get('limit')} selects the first {len(samples)})", file=sys.stderr)
        wandb_log.log_run(cfg, p.run_dir, wb)


def _with_live_log(on_row, wb, done: int):
    """``on_row`` plus, when a W&B run is open, one W&B step per finished sample."""
    if wb is None:
        return on_row
    count = [done]

    def both(row: dict) -> None:
        count[0] += 1
        wb.log(wandb_log.sample_scalars(row, count[0]))
        if on_row is not None:
            on_row(row)
    return both


def _generate_rows(p: Plan, suite, todo: list, run: results.RunDir, on_row) -> None:
    if not todo:
        return
    cfg = p.cfg
    show = cfg.get("progress", "auto") is not False
    model = load_model(cfg["model"]["name"], cfg["model"].get("path"), cfg["model"].get("dtype", "auto"),
                       cfg["device"], seed=cfg.get("seed", 0), progress=show)
    tokenizer = suite.tokenizer
    judge = _judge(model, tokenizer, p.suite_options.get("judge_model"), cfg)
    segment = f"{socket.gethostname()}:{os.getpid()}:{time.time():.0f}"  # this process's part of the run
    for sample in _progress(todo, cfg, p.run_dir):
        torch.manual_seed(cfg.get("seed", 0))
        gen = generate(model, tokenizer, p.method(len(sample.prompt_ids)), sample.prompt_ids,
                       sample.max_new_tokens, decode_ids=sample.decode_ids, stop=sample.stop,
                       ignore_eos=sample.ignore_eos, stop_token_ids=sample.stop_token_ids,
                       min_new_tokens=sample.min_new_tokens, profile=bool(cfg.get("profile")),
                       sampling=sample.sampling, eos_token_ids=sample.eos_token_ids)
        timing = dict(gen.timing(), peak_memory_bytes=peak_memory_bytes(), segment=segment)
        row = {"id": sample.id, "task": sample.task, "prediction": gen.text, "reference": sample.reference,
               "scores": suite.score(sample, gen.text, judge), "meta": sample.meta, "timing": timing}
        run.append(row)
        if on_row is not None:
            on_row(row)


def _judge(model, tokenizer, judge_model: str | None, cfg: dict):
    """The judge for suites that need one (LongGenBench): by default the model under test, else the
    registered model ``judge_model`` (loaded on first use); always greedy with the full cache."""
    from baselines.full import FullCache

    loaded = {}

    def judge(text: str, max_new_tokens: int) -> str:
        if judge_model and judge_model != cfg["model"]["name"]:
            if not loaded:
                loaded["model"] = load_model(judge_model, device=cfg["device"])
                loaded["tokenizer"] = load_tokenizer(judge_model)
            m, tok = loaded["model"], loaded["tokenizer"]
        else:
            m, tok = model, tokenizer
        return generate(m, tok, FullCache(), tok(text)["input_ids"], max_new_tokens).text
    return judge


def _progress(items, cfg, run_dir):
    """A tqdm bar on a TTY; otherwise (cluster logs) a plain line at most every 60 s. ``progress=false``
    silences both."""
    show = cfg.get("progress", "auto")
    if show is False or show == "false":
        return items
    label = "/".join(run_dir.parts[-3:])
    if sys.stderr.isatty() or show is True:
        from tqdm import tqdm
        return tqdm(items, desc=label, unit="sample")
    return _log_lines(items, label)


def _log_lines(items, label, every_s: float = 60.0):
    start = last = time.monotonic()
    for done, item in enumerate(items):
        yield item
        now = time.monotonic()
        if now - last >= every_s or done + 1 == len(items):
            eta = (now - start) / (done + 1) * (len(items) - done - 1)
            print(f"[{label}] {done + 1}/{len(items)} samples, ETA {eta / 60:.1f} min", file=sys.stderr, flush=True)
            last = now


def summarize_timing(rows: list[dict], cfg: dict) -> dict:
    """Pools per-sample timings: TT2T/TTFT means, TPOT over all tokens >= 3, breakdown per output token.
    Peak memory is the maximum over every process that wrote rows (each row records its process's peak)."""
    timings = [r["timing"] for r in rows if r.get("timing")]
    intervals = [x for t in timings for x in t["intervals_s"]]
    n_tok = len(intervals)
    breakdown: dict[str, float] = {}
    for t in timings:
        for phase, sec in t["breakdown_s"].items():
            breakdown[phase] = breakdown.get(phase, 0.0) + sec
    layers = [t["effective_tokens"] for t in timings if t.get("effective_tokens")]
    effective = [statistics.fmean(v) if (v := [l[i] for l in layers if l[i] is not None]) else None
                 for i in range(len(layers[0]))] if layers else []
    tt2t = [t["tt2t_s"] for t in timings if t["tt2t_s"] is not None]
    segments: dict[str, int] = {}
    for t in timings:
        if t.get("peak_memory_bytes"):
            key = t.get("segment")
            segments[key] = max(segments.get(key, 0), t["peak_memory_bytes"])
    return {
        "n_samples": len(timings),
        "ttft_s": statistics.fmean([t["ttft_s"] for t in timings]) if timings else None,
        "tt2t_s": statistics.fmean(tt2t) if tt2t else None,
        "tpot_s": statistics.fmean(intervals) if intervals else None,
        "tpot_p50_s": statistics.median(intervals) if intervals else None,
        "tpot_p90_s": statistics.quantiles(intervals, n=10)[-1] if n_tok >= 2 else None,
        "breakdown": {k: v / n_tok for k, v in breakdown.items()} if n_tok else {},
        "effective_tokens_per_layer": effective,
        "max_resident_tokens": max((t.get("max_resident_tokens", 0) for t in timings), default=0),
        "transfer_bytes_per_token": sum(t.get("transfer_bytes", 0) for t in timings) / n_tok if n_tok else None,
        "peak_memory_bytes": max(segments.values()) if segments else peak_memory_bytes(),
        "n_process_segments": len(segments),
        "environment": run_environment(cfg),
    }


def peak_memory_bytes() -> int:
    """CUDA max allocated when on a GPU, else the process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def environment(model) -> dict:
    """Where a loaded model runs: its device and dtype, library versions and the machine."""
    param = next(model.parameters())
    return {**_machine(), "device": str(param.device), "dtype": str(param.dtype),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def _machine() -> dict:
    import transformers
    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "processor": platform.processor() or platform.uname().machine, "cpu_count": os.cpu_count()}


def run_environment(cfg: dict) -> dict:
    """Where the run executed: the resolved device (``device=auto`` recorded as cpu or cuda) and dtype,
    library versions and the machine."""
    device, dtype = cfg["device"], cfg["model"].get("dtype", "auto")
    return {**_machine(), "device": device, **dtype_record(dtype, device),  # the rule behind model.dtype=auto
            "dtype": str(resolve_dtype(dtype, device)),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}
