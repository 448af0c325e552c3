"""The numba kernel cache follows the kernels' source (icecache/kernel_cache.py): a kernel that inlines a
kernel of another file is recompiled when only that file changes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numba

import icecache  # noqa: F401  (points numba's cache at the versioned folder)
from icecache.kernel_cache import kernel_source_digest, versioned_cache_dir


def _write(path: Path, text: str) -> None:
    path.write_text(textwrap.dedent(text))


def test_digest_follows_the_files_that_import_numba_only(tmp_path):
    _write(tmp_path / "kernel.py", "from numba import njit\nX = 1\n")
    _write(tmp_path / "plain.py", "Y = 1\n")
    before = kernel_source_digest(tmp_path)
    _write(tmp_path / "plain.py", "Y = 2\n")
    assert kernel_source_digest(tmp_path) == before
    _write(tmp_path / "kernel.py", "from numba import njit\nX = 2\n")
    assert kernel_source_digest(tmp_path) != before


def test_the_cache_folder_is_named_after_the_digest(monkeypatch, tmp_path):
    assert numba.config.CACHE_DIR == str(versioned_cache_dir(kernel_source_digest()))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    assert versioned_cache_dir("abc") == tmp_path / "icecache-abc"
    monkeypatch.delenv("NUMBA_CACHE_DIR")
    assert versioned_cache_dir("abc") == Path.home() / ".cache" / "icecache" / "numba" / "abc"


def test_a_kernel_inlining_a_changed_file_is_recompiled(tmp_path):
    """Two cached kernels in two files, the outer one inlining the inner one; the inner file changes and the
    outer file does not: a fresh process runs the new inner code."""
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    _write(pkg / "__init__.py", """
        from pathlib import Path
        from icecache.kernel_cache import use_versioned_cache
        use_versioned_cache(Path(__file__).parent)
    """)
    _write(pkg / "outer.py", """
        from numba import njit
        from .inner import value
        @njit(cache=True)
        def outer():
            return value() + 0
    """)
    run = [sys.executable, "-c", "from kpkg.outer import outer; print(outer())"]
    env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).resolve().parents[1]}", "NUMBA_CACHE_DIR": str(tmp_path / "c"),
           "PATH": "/usr/bin:/bin"}
    results = []
    for value in (1, 2):
        _write(pkg / "inner.py", f"""
            from numba import njit
            @njit(cache=True, inline="always")
            def value():
                return {value}
        """)
        out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
        results.append(int(out.split()[-1]))
    assert results == [1, 2]
