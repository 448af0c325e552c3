"""Numba's on-disk kernel cache, one folder per version of the kernels' source.

Every numba kernel of the package is compiled with ``@njit(cache=True)``. Numba decides whether a cached
kernel is still valid from the modification time of the one file that defines it. A kernel that calls or
inlines a kernel of another file (``_search.search`` inlines ``_level0``, ``_walk`` and ``intrinsics``) would
keep its old machine code after only that other file changed, and run it without a warning. So the cache
lives in a folder named after a digest of every package file that imports numba
(:func:`kernel_source_digest`): any change to any kernel's source starts an empty folder, and the kernels
compile again once (``make setup`` and the runs' warm-up compile them before any clock starts).

The folder is ``$NUMBA_CACHE_DIR/icecache-<digest>`` when ``NUMBA_CACHE_DIR`` is set, else
``~/.cache/icecache/numba/<digest>``. :func:`use_versioned_cache` runs when :mod:`icecache` is imported, before
any kernel module; if the folder cannot be created, numba keeps its default (``__pycache__`` beside the
sources) and a warning says so.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent


def kernel_source_digest(root: Path = PACKAGE_ROOT) -> str:
    """SHA-256 (first 16 hex digits) of the path and contents of every ``.py`` file under ``root`` that imports
    numba, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        text = path.read_bytes()
        if b"from numba" in text or b"import numba" in text:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + text + b"\0")
    return digest.hexdigest()[:16]


def versioned_cache_dir(digest: str) -> Path:
    """Where the kernels of source version ``digest`` are cached (module docstring)."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        return Path(user) / f"icecache-{digest}"
    return Path.home() / ".cache" / "icecache" / "numba" / digest


def use_versioned_cache(root: Path = PACKAGE_ROOT) -> Path | None:
    """Points numba's cache at :func:`versioned_cache_dir` of the current source of the package at ``root``;
    returns the folder, or None (with a warning) when it cannot be created."""
    import numba

    folder = versioned_cache_dir(kernel_source_digest(root))
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        warnings.warn(f"numba kernel cache {folder} cannot be created ({err}); kernels are cached beside their "
                      "sources, where a kernel that inlines a changed file of another module is not recompiled. "
                      "Set NUMBA_CACHE_DIR to a writable folder.", stacklevel=2)
        return None
    numba.config.CACHE_DIR = str(folder)
    return folder
