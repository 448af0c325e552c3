"""The run configuration: its ``cache`` and ``eval`` groups generated from the dataclasses, and the check of a
resolved config before anything heavy is loaded.

Groups, generated from the dataclasses (each default is written once, in Python; Hydra structured configs,
https://hydra.cc/docs/tutorials/structured_config/intro/).

- ``cache=<name>``: the method's hyperparameters, the init fields of its ``@dataclass`` with their defaults
  (``budget`` and ``debug`` are top-level settings). A method whose class extends another registered method
  extends that method's config through Hydra's defaults list (``icecache_reuse`` = ``icecache`` + its own
  fields), so an override of the parent reaches the child.
- ``eval=<name>``: the suite's ``Options`` dataclass, then its ``model_links`` (options that follow the model
  group, e.g. LongBench's ``chat_format: ${model.prompt.longbench}``). ``conf/eval/*.yaml`` holds presets
  only, which extend a suite through the defaults list and write nothing but their overrides.

:func:`register` stores these nodes in Hydra's ConfigStore; ``run.py`` calls it before composing.

Validation (:func:`check_config`): the pass over a resolved run config, before anything heavy is loaded.

Every type, range and enum mistake in the top-level settings and the ``model`` group is one
:class:`ConfigError` line; ``cache.*`` and ``eval.*`` options are checked against the type of their
Python default (the method's dataclass field, the suite's ``Options``: :func:`defaults`; a boolean option
takes ``true``/``false`` only, a whole-number option a whole number), and an option whose field only takes a list (``list[int]``, ``Sequence[int] | None``) or
a mapping must be given one (``eval.lengths=[1024]``, not ``eval.lengths=1024``); the methods and suites check
their own ranges and enums. Returns a canonical copy:
whole floats become ints (``budget=64.0`` is ``budget=64``) and ``device=auto`` is resolved.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

import torch

from .output.results import canonical
from .registry import METHODS, SUITES, method_class, suite_class
from .task import ConfigError
from .threads import check_thread_settings

TOP_LEVEL = ("budget", "debug")  # KVMethod fields set by the top-level config, not the cache group


def _plain(value):
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _field_defaults(cls, exclude=()) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _plain(f.default_factory())
    return out


def _parent_method(cls) -> str | None:
    """The registered method whose class ``cls`` directly extends, if any."""
    for name in METHODS:
        if method_class(name) is cls.__mro__[1]:
            return name
    return None


def method_defaults(name: str) -> dict:
    """``{"name": name, hyperparameter: default, ...}`` of method ``name`` (its dataclass fields)."""
    return {"name": name, **_field_defaults(method_class(name), TOP_LEVEL)}


def suite_defaults(name: str) -> dict:
    """``{"name": name, option: default, ...}`` of suite ``name`` (its ``Options`` dataclass)."""
    return {"name": name, **_field_defaults(suite_class(name).Options)}


def defaults(group: str, name: str) -> dict:
    """The Python defaults behind ``<group>=<name>`` (``cache`` or ``eval``); ``{}`` for an unknown name."""
    table, build = (METHODS, method_defaults) if group == "cache" else (SUITES, suite_defaults)
    return build(name) if name in table else {}


def method_node(name: str) -> dict:
    cls = method_class(name)
    parent = _parent_method(cls)
    if parent is None:
        return method_defaults(name)
    inherited = _field_defaults(cls.__mro__[1])
    own = {k: v for k, v in method_defaults(name).items() if k not in inherited or inherited[k] != v}
    return {"defaults": [parent, "_self_"], **own}


def suite_node(name: str) -> dict:
    return {**suite_defaults(name), **suite_class(name).model_links}


def register() -> None:
    """Stores ``cache/<method>`` and ``eval/<suite>`` for every registered name (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name in METHODS:
        store.store(group="cache", name=name, node=method_node(name))
    for name in SUITES:
        store.store(group="eval", name=name, node=suite_node(name))


def compose_config(overrides=(), resolve: bool = True):
    """The run config of ``python run.py <overrides>``: a plain dict (``resolve=False``: the DictConfig, for
    its YAML with interpolations)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True) if resolve else cfg


# ------------------------------------------------------------ validation
DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    check_writable_dir(path, "results_dir")


def check_writable_dir(path: Path, key: str) -> None:
    """The setting ``key`` names a directory, or one that can be made, that this user can write."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key}={path} is a file, not a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key}={path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {existing} is not writable")


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


_LISTS = ("list", "tuple", "Sequence", "List", "Tuple", "typing.Sequence", "typing.List", "typing.Tuple",
          "collections.abc.Sequence")
_MAPPINGS = ("dict", "Dict", "Mapping", "typing.Dict", "typing.Mapping", "collections.abc.Mapping")
_ELEMENTS = {"int": ("whole numbers", _is_int), "float": ("numbers", _is_number),
             "str": ("text", lambda v: isinstance(v, str))}


def _split(text: str) -> list[str]:
    """The top-level ``|`` parts of an annotation: ``"list[int] | None"`` -> ``["list[int]", "None"]``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


def _shape_of(annotation: str) -> tuple[str, str | None] | None:
    """``("list", element)`` when an annotation admits only a list (or None), ``("mapping", None)`` when only a
    mapping (or None), else None (e.g. ``int | list[float]``: a count or a list)."""
    shapes = set()
    for part in _split(annotation):
        base, _, inner = part.partition("[")
        inner = inner[:-1].strip() if inner.endswith("]") else ""
        if base == "None":
            continue
        if base in ("Optional", "typing.Optional") and inner:
            shape = _shape_of(inner)
            if shape is None:
                return None
            shapes.add(shape)
        elif base in _LISTS:
            element = inner if base.split(".")[-1] not in ("tuple", "Tuple") else ""
            shapes.add(("list", element if element in _ELEMENTS else None))
        elif base in _MAPPINGS:
            shapes.add(("mapping", None))
        else:
            return None
    return shapes.pop() if len(shapes) == 1 else None


def _annotation_text(tp) -> str:
    """An annotation as source text (``from __future__ import annotations`` keeps them as text already)."""
    if isinstance(tp, str):
        return tp
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return " | ".join(_annotation_text(a) for a in args)
    base = getattr(origin or tp, "__name__", str(tp))
    return f"{base}[{', '.join(_annotation_text(a) for a in args)}]" if args else base


def shapes(group: str, name: str) -> dict[str, tuple[str, str | None]]:
    """The options of ``<group>=<name>`` whose dataclass field only takes a list or a mapping (and null), with
    the list's element type when it is int, float or str: ``{"lengths": ("list", "int"), ...}``."""
    table, lookup = ((METHODS, method_class) if group == "cache"
                     else (SUITES, lambda n: suite_class(n).Options))
    if name not in table:
        return {}
    out = {}
    for f in dataclasses.fields(lookup(name)):
        shape = _shape_of(_annotation_text(f.type)) if f.init else None
        if shape is not None:
            out[f.name] = shape
    return out


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _shaped(key: str, value, shape: tuple[str, str | None]):
    """``value`` of an option that takes a list (of ``shape[1]``) or a mapping."""
    kind, element = shape
    if kind == "mapping":
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, e.g. '{key}={{name: value}}' (got {value!r})")
        return value
    if not isinstance(value, list):
        raise ConfigError(f"{key} must be a list, e.g. '{key}=[{_text(value)}]' (got {value!r})")
    if element is not None and not all(_ELEMENTS[element][1](v) for v in value):
        raise ConfigError(f"{key} must be a list of {_ELEMENTS[element][0]}, got {value!r}")
    return value


def _typed_like(key: str, value, default, shape: tuple[str, str | None] | None = None):
    """``value`` checked against the type of its scalar default (a None default accepts anything), or against
    ``shape`` (:func:`shapes`) for an option that only takes a list or a mapping; a list or mapping given to any
    other option is left to the suite or method (``eval.depths`` takes a count or a list of depths)."""
    if shape is None and isinstance(default, list):
        shape = ("list", None)
    if shape is not None and value is not None:
        return _shaped(key, value, shape)
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


def _group(group: str, options: dict, prefix: str | None = None) -> dict:
    name = options.get("name")
    known = defaults(group, name) if isinstance(name, str) else {}
    kinds = shapes(group, name) if isinstance(name, str) else {}
    prefix = f"{group}." if prefix is None else prefix
    return {k: _typed_like(f"{prefix}{k}", v, known.get(k), kinds.get(k)) for k, v in options.items()}


def check_method_options(name: str, options: dict, prefix: str = "cache.") -> dict:
    """``options`` of method ``name`` checked as ``cache.<key>=...`` is in a run (:func:`_typed_like`), outside a
    run config (the benchmarks' ``name:key=value`` options); errors name each key as ``<prefix><key>``."""
    return {k: v for k, v in _group("cache", {"name": name, **options}, prefix).items() if k != "name"}


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
    check_thread_settings(cfg)
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
