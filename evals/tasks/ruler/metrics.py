"""RULER's metrics (``scripts/eval/synthetic/constants.py``): post-processing, ``string_match_all`` and
``string_match_part``."""
from __future__ import annotations

import re


def postprocess(prediction: str) -> str:
    """The official prediction clean-up: strip, control characters -> newline, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references contained (case-insensitively) in the prediction."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is contained (case-insensitively) in the prediction."""
    return float(max(r.lower() in prediction.lower() for r in references))
