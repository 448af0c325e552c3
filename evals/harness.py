"""Compose config -> validate (cheap, before any heavy work) -> model, cache, suite -> run -> results.

``run.py`` is the Hydra front end; this module takes a plain resolved config dict so tests, notebooks
and sweeps can call :func:`run_eval` directly.
"""
from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from icecache.kv import BudgetError, KVMethod, make_method
from icecache.kv.registry import UnknownNameError
from icecache.models import MODELS, ModelUnavailableError, load_model, load_tokenizer

from . import results, wandb_log
from .base import DataError, resolve_budget
from .registry import suite_class
from .runner import generate

REPO_ROOT = Path(__file__).resolve().parents[1]


class ConfigError(ValueError):
    """A mistake in the run's configuration (bad option, value or combination)."""


# Errors caused by the user's input: reported in one line, without a traceback (run.py).
USER_ERRORS = (ConfigError, BudgetError, UnknownNameError, DataError, ModelUnavailableError,
               results.RunDirError, FileNotFoundError)


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
    """Validates names, budget, limit and data before loading anything heavy."""
    if cfg["model"]["name"] not in MODELS:
        raise UnknownNameError(f"unknown model '{cfg['model']['name']}'; valid: {', '.join(sorted(MODELS))}")
    limit = cfg.get("limit")
    if limit is not None and int(limit) < 1:
        raise ConfigError(f"limit must be >= 1 (max samples per task), got {limit}")
    budget = cfg.get("budget")
    if budget is not None and float(budget) <= 0:
        raise ConfigError(f"budget must be positive (tokens, or a fraction in (0, 1) of the prompt), got {budget}")
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
    cfg = dict(cfg, results_dir=str(resolve_path(cfg.get("results_dir", "results"))),
               data_dir=None if data_dir is None else str(data_dir))
    return Plan(cfg, name, options, suite_cls, suite_opts, results.run_dir_for(cfg))


def run_eval(cfg: dict, config_yaml: str = "", on_row=None) -> Path:
    """Runs (or resumes) one evaluation and writes its run directory; returns its path."""
    p = plan(cfg)
    tokenizer = load_tokenizer(cfg["model"]["name"], cfg["model"].get("path"))
    try:
        suite = p.suite_cls(tokenizer, data_dir=p.cfg["data_dir"], max_length=cfg["model"].get("max_length", 8192),
                            seed=cfg.get("seed", 0), limit=cfg.get("limit"), **p.suite_options)
    except TypeError as err:
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None
    except ValueError as err:
        if isinstance(err, DataError):
            raise
        raise ConfigError(f"eval '{cfg['eval']['name']}': {err}") from None
    samples = list(suite.samples())
    run = results.RunDir(p.run_dir, p.cfg, config_yaml or yaml.safe_dump(p.cfg, sort_keys=False))
    todo = [s for s in samples if s.id not in run.done_ids()]
    finished = run.done_ids() == {s.id for s in samples}  # (a larger earlier `limit` re-aggregates)
    if finished and (p.run_dir / "metrics.json").exists() and (p.run_dir / "timing.json").exists():
        return p.run_dir  # finished earlier: nothing to load, nothing to overwrite
    model = load_model(cfg["model"]["name"], cfg["model"].get("path"), cfg["model"].get("dtype", "auto"),
                       cfg.get("device", "cpu"), seed=cfg.get("seed", 0))
    judge = _judge(model, tokenizer, p.suite_options.get("judge_model"), cfg)
    for sample in _progress(todo, cfg, p.run_dir):
        torch.manual_seed(cfg.get("seed", 0))
        gen = generate(model, tokenizer, p.method(len(sample.prompt_ids)), sample.prompt_ids,
                       sample.max_new_tokens, decode_ids=sample.decode_ids, stop=sample.stop,
                       ignore_eos=sample.ignore_eos, stop_token_ids=sample.stop_token_ids,
                       min_new_tokens=sample.min_new_tokens, profile=bool(cfg.get("profile")))
        row = {"id": sample.id, "task": sample.task, "prediction": gen.text, "reference": sample.reference,
               "scores": suite.score(sample, gen.text, judge), "meta": sample.meta, "timing": gen.timing()}
        run.append(row)
        if on_row is not None:
            on_row(row)
    wanted = {s.id for s in samples}
    rows = [r for r in run.rows if r["id"] in wanted]
    metrics = suite.aggregate(rows)
    timing = summarize_timing(rows, model)
    results.write_json(p.run_dir / "metrics.json", metrics)
    results.write_json(p.run_dir / "timing.json", timing)
    # Optional W&B logging of the finished run directory (a no-op unless wandb.enabled=true).
    wandb_log.log_run(p.cfg, p.run_dir)
    return p.run_dir


def _judge(model, tokenizer, judge_model: str | None, cfg: dict):
    """The judge for suites that need one (LongGenBench): by default the model under test, else the
    registered model ``judge_model`` (loaded on first use); always greedy with the full cache."""
    from baselines.full import FullCache

    loaded = {}

    def judge(text: str, max_new_tokens: int) -> str:
        if judge_model and judge_model != cfg["model"]["name"]:
            if not loaded:
                loaded["model"] = load_model(judge_model, device=cfg.get("device", "cpu"))
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


def summarize_timing(rows: list[dict], model) -> dict:
    """Pools per-sample timings: TT2T/TTFT means, TPOT over all tokens >= 3, breakdown per output token."""
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
        "peak_memory_bytes": max((t["peak_memory_bytes"] for t in timings if t.get("peak_memory_bytes")),
                                 default=None) or peak_memory_bytes(),  # CUDA: per-generation peaks
        "environment": environment(model),
    }


def peak_memory_bytes() -> int:
    """CUDA max allocated when on a GPU, else the process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def environment(model) -> dict:
    import transformers
    param = next(model.parameters())
    return {"device": str(param.device), "dtype": str(param.dtype), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor() or platform.uname().machine,
            "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
