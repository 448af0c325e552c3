"""The validation pass over a resolved run config, before anything heavy is loaded.

Every type, range and enum mistake in the top-level settings and the ``model`` group is one
:class:`ConfigError` line; ``cache.*`` and ``eval.*`` options are checked against the type of their
Python default (the method's dataclass field, the suite's ``Options``: :func:`evals.configs.defaults`) (a boolean option takes ``true``/``false`` only, a whole-number
option a whole number); the methods and suites check their own ranges and enums. Returns a canonical copy:
whole floats become ints (``budget=64.0`` is ``budget=64``) and ``device=auto`` is resolved.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import configs
from .results import canonical

DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A mistake in the run's configuration (bad option, value or combination)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _budget(v):
    if v is None:
        return None
    if not _is_number(v) or not (0 < v < 1 or (v >= 1 and v == int(v))):
        raise ConfigError(f"budget must be positive: a whole number of tokens (e.g. 64) or a fraction in (0, 1) "
                          f"of the prompt (e.g. 0.1), got {v!r}")
    return v


def _count(key: str, v, allow_none: bool, minimum: int = 1):
    if v is None and allow_none:
        return None
    if not _is_int(v) or v < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, a whole number{' or null' if allow_none else ''}, got {v!r}")
    return v


def _flag(key: str, v):
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    return v


def resolve_device(v) -> str:
    """``auto`` is CUDA when torch sees a GPU, else the CPU; ``cuda`` without a GPU is an error."""
    if v == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(v, str) or not (v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:<index>, got {v!r}")
    if v.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={v} but torch sees no CUDA device (torch {torch.__version__}); use device=cpu "
                          "or device=auto")
    if v.startswith("cuda:") and int(v[5:]) >= torch.cuda.device_count():
        raise ConfigError(f"device={v} but torch sees {torch.cuda.device_count()} CUDA device(s)")
    return v


def check_results_dir(path: Path) -> None:
    """``results_dir`` must be a directory (or creatable as one) that this user can write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"results_dir={path} is a file, not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"results_dir={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"results_dir={path}: {existing} is not writable")


def _model(model: dict) -> dict:
    if not isinstance(model.get("name"), str) or not model["name"]:
        raise ConfigError(f"model.name must be a name, got {model.get('name')!r}")
    if model.get("dtype", "auto") not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {model.get('dtype')!r}")
    if model.get("path") is not None and not isinstance(model["path"], str):
        raise ConfigError(f"model.path must be a directory, got {model['path']!r}")
    _count("model.max_length", model.get("max_length"), allow_none=True)
    return model


def _diagnostics(diag) -> dict:
    """``diagnostics=recall`` (conf/diagnostics/recall.yaml): its name and ``every`` (decode steps)."""
    if not isinstance(diag, dict) or diag.get("name") != "recall":
        raise ConfigError(f"diagnostics must be recall (diagnostics=recall) or absent, got {diag!r}")
    unknown = sorted(set(diag) - {"name", "every"})
    if unknown:
        raise ConfigError(f"diagnostics has no option(s) {unknown} (it takes diagnostics.every)")
    _count("diagnostics.every", diag.get("every", 1), allow_none=False)
    return diag


def _typed_like(key: str, value, default):
    """``value`` checked against the type of its scalar default (a None default accepts anything; a list or
    mapping is left to the suite or method, e.g. ``eval.depths`` takes a count or a list of depths)."""
    if default is None or value is None or isinstance(value, (list, dict)):
        return value
    if isinstance(default, bool):
        return _flag(key, value)
    if _is_int(default) and not _is_int(value):
        raise ConfigError(f"{key} must be a whole number, got {value!r}")
    if isinstance(default, float) and not _is_number(value):
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if isinstance(default, str) and not isinstance(value, str):
        raise ConfigError(f"{key} must be text, got {value!r}")
    return value


def _group(group: str, options: dict) -> dict:
    defaults = configs.defaults(group, options.get("name")) if isinstance(options.get("name"), str) else {}
    return {k: _typed_like(f"{group}.{k}", v, defaults.get(k)) for k, v in options.items()}


def check_config(cfg: dict) -> dict:
    """A validated, canonical copy of ``cfg`` (see the module docstring); raises :class:`ConfigError`."""
    cfg = canonical(dict(cfg))
    cfg["budget"] = _budget(cfg.get("budget"))
    cfg["limit"] = _count("limit", cfg.get("limit"), allow_none=True)
    if not _is_int(cfg.get("seed", 0)):
        raise ConfigError(f"seed must be a whole number, got {cfg.get('seed')!r}")
    for key in ("debug", "profile"):
        _flag(key, cfg.get(key, False))
    progress = cfg.get("progress", "auto")
    if not (progress == "auto" or isinstance(progress, bool)):
        raise ConfigError(f"progress must be auto, true or false, got {cfg.get('progress')!r}")
    cfg["device"] = resolve_device(cfg.get("device", "auto"))
    for key in ("results_dir", "data_dir"):
        if cfg.get(key) is not None and not isinstance(cfg[key], str):
            raise ConfigError(f"{key} must be a path, got {cfg[key]!r}")
    if cfg.get("diagnostics") is not None:
        cfg["diagnostics"] = _diagnostics(cfg["diagnostics"])
    cfg["model"] = _model(dict(cfg["model"]))
    cfg["cache"] = _group("cache", dict(cfg["cache"]))
    cfg["eval"] = _group("eval", dict(cfg["eval"]))
    for key in ("max_new_tokens", "new_tokens"):  # 0 new tokens would still generate one
        if cfg["eval"].get(key) is not None:
            _count(f"eval.{key}", cfg["eval"][key], allow_none=False)
    return cfg
