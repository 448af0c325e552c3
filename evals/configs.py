"""The run configuration's ``cache`` and ``eval`` groups, generated from the dataclasses (each default is
written once, in Python; Hydra structured configs, https://hydra.cc/docs/tutorials/structured_config/intro/).

- ``cache=<name>``: the method's hyperparameters, the init fields of its ``@dataclass`` with their defaults
  (``budget`` and ``debug`` are top-level settings). A method whose class extends another registered method
  extends that method's config through Hydra's defaults list (``icecache_reuse`` = ``icecache`` + its own
  fields), so an override of the parent reaches the child.
- ``eval=<name>``: the suite's ``Options`` dataclass, then its ``model_links`` (options that follow the model
  group, e.g. LongBench's ``chat_format: ${model.prompt.longbench}``). ``conf/eval/*.yaml`` holds presets
  only, which extend a suite through the defaults list and write nothing but their overrides.

:func:`register` stores these nodes in Hydra's ConfigStore; ``run.py`` calls it before composing.
"""
from __future__ import annotations

import dataclasses

from .registry import METHODS, SUITES, method_class, suite_class

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
