"""README.md's library example ("Using a cache in your own code") runs as written on the embedded SmolLM2."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from evals.models import ModelUnavailableError
from icecache.kv import compat

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Using a cache in your own code"


def library_example() -> str:
    """The first Python code block of the README's library section."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no section '{SECTION}'"
    section = text[text.index(SECTION):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, f"README.md's '{SECTION}' has no ```python block"
    return block.group(1)


def test_the_library_example_runs_as_written(capsys):
    namespace: dict = {}
    try:
        exec(compile(library_example(), f"{README}:{SECTION}", "exec"), namespace)
    except ModelUnavailableError as err:
        pytest.skip(f"embedded model unavailable: {err}")
    prompt_len = namespace["inputs"]["input_ids"].shape[1]
    generated = namespace["out"].shape[1] - prompt_len
    assert prompt_len > 64 and 1 <= generated <= 8  # a prompt past the budget of 64, a few new tokens
    assert namespace["model"].config._attn_implementation == compat.ATTN_IMPLEMENTATION  # through the cache
    assert capsys.readouterr().out.strip()  # the example prints the continuation
