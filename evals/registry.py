"""Suites found by name: ``"module:Class"``, imported only when used."""
from __future__ import annotations

import importlib

from icecache.kv.registry import UnknownNameError

SUITES: dict[str, str] = {
    "passkey": "evals.passkey:Passkey",
    "longbench": "evals.longbench:LongBench",
    "gsm8k": "evals.gsm8k:GSM8K",
    "ruler": "evals.ruler:Ruler",
    "longgenbench": "evals.longgenbench:LongGenBench",
    "latency": "evals.latency:Latency",
}


def suite_class(name: str):
    if name not in SUITES:
        raise UnknownNameError(f"unknown eval '{name}'; valid: {', '.join(sorted(SUITES))}")
    module, cls = SUITES[name].split(":")
    return getattr(importlib.import_module(module), cls)
