"""Prefill once, evaluate every configuration.

Long-context evaluation on a CPU is dominated by the prompt's prefill (minutes per prompt at 16-32k tokens),
while decoding one configuration costs seconds. Every method whose prefill is exact causal attention followed
by :meth:`~icecache.kv.KVMethod.store` fills its cache from the same per-layer post-RoPE K/V, so one exact
prefill of a prompt serves them all:

- :class:`Prefill` is one captured prefill: per-layer K/V ``[H_kv, n, d]``, the prompt's last query per layer
  ``[H_q, 1, d]`` and the last position's logits. :meth:`Prefill.replay` fills a cache in its prefill phase
  through :meth:`icecache.kv.KVCache.replay_prefill` (the method's ``store`` + ``finish_prefill``, layer by
  layer, as the live prefill does after attention), so decoding, stopping rules and scores are unchanged.
- :class:`PrefillStore` keeps captured prefills on disk (``prefill_cache=DIR``), one safetensors file per
  prompt, named by a key of the model (its name and a fingerprint of its weights), dtype, device and the
  exact prompt token ids. A file is written atomically (a temporary file, fsynced, then renamed: a killed
  capture leaves only a ``.*.tmp`` file, which is never read, and two processes racing on one prompt write
  the same bytes), carries the key, shapes, dtype and a sha256 of its tensor bytes in its header, and is
  verified on every read: a corrupt or mismatched file is refused in one line that names it, never used.
  The directory is bounded (``prefill_cache_max_gb``): a capture that would exceed it fails before writing.

Which methods replay (:func:`replay_refusal`): those whose ``prefill`` is the base class's (exact attention,
then ``store``), and those whose own prefill reads no query but the prompt's last one (MagicPIG's calibration
query, ArkVale's page selection), which then runs on the stored last query (its attention output discarded).
Methods that compute statistics of every prompt query during prefill attention (H2O's column sums, SnapKV's
observation-window votes), that read each layer's input hidden states through model hooks (kvpress), or that
time the live prefill (PQCache with ``kmeans_iters=0``, its adaptive k-means) run live, with a one-line
notice; every generation records which it was (``timing.prefill``: replayed or live).

A replayed generation's TTFT and TT2T exclude the prefill: use live runs for prefill latency.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from icecache.kv import KVCache, KVMethod, compat

from .config import ConfigError, check_writable_dir
from .registry import METHODS, method_class

FORMAT = "icecache-prefill/1"
DEFAULT_MAX_GB = 50.0
FINGERPRINT_VALUES = 4096  # evenly spaced values of every parameter and buffer in the weights fingerprint
REPO_ROOT = Path(__file__).resolve().parents[1]

# what a method computes during prefill attention that K/V and the last query cannot give back
PREFILL_STATISTICS = {
    "h2o": "the attention column sums of every prompt query",
    "snapkv": "observation-window votes: its last window_size queries over every prompt key",
}
# methods whose own prefill reads no query but the prompt's last one (then stores the exact K/V)
LAST_QUERY_METHODS = ("magicpig", "arkvale")
# methods whose finish_prefill reads the wall time of the live prefill in one setting: (option, value, what)
PREFILL_TIMED = {
    "pqcache": ("kmeans_iters", 0, "sizes its k-means by each layer's measured prefill time (kmeans_iters=0)"),
}


class PrefillCacheError(ConfigError):
    """A prefill file that cannot be used (corrupt, another key) or a directory over its size bound."""


def replay_refusal(method: KVMethod | type[KVMethod]) -> str | None:
    """None when a captured prefill fills the cache of ``method`` exactly as a live prefill would, else one line
    saying why it must run live. A class is judged by its prefill alone; an instance also by its settings
    (:data:`PREFILL_TIMED`)."""
    cls = method if isinstance(method, type) else type(method)
    if cls.attach is not KVMethod.attach:
        return (f"{cls.name} reads each layer's input hidden states through model hooks during the prefill "
                "forward: run it live")
    if cls.prefill is KVMethod.prefill or reads_last_query_only(cls):
        return None if isinstance(method, type) else _timed_refusal(method)
    owner = _prefill_of(cls, PREFILL_STATISTICS)
    what = PREFILL_STATISTICS[owner] if owner else f"in {cls.__name__}.prefill"
    return f"{cls.name} computes statistics during prefill attention ({what}): run it live"


def _timed_refusal(method: KVMethod) -> str | None:
    """Why ``method``, in its current setting, must see the live prefill's duration (a replay takes none), or
    None (:data:`PREFILL_TIMED`)."""
    for name, (option, value, what) in PREFILL_TIMED.items():
        if (name in METHODS and type(method).finish_prefill is method_class(name).finish_prefill
                and getattr(method, option, None) == value):
            return f"{method.name} {what}: run it live (or set cache.{option} to a fixed bound)"
    return None


def reads_last_query_only(cls: type[KVMethod]) -> bool:
    """Whether ``cls``'s prefill is that of one of :data:`LAST_QUERY_METHODS` (their registered classes and
    subclasses that keep it; one that overrides it is not)."""
    return _prefill_of(cls, LAST_QUERY_METHODS) is not None


def _prefill_of(cls: type[KVMethod], names) -> str | None:
    """The registered method among ``names`` whose ``prefill`` function ``cls`` uses, or None."""
    return next((name for name in names if name in METHODS and method_class(name).prefill is cls.prefill), None)


@dataclass(frozen=True)
class _CaptureFull(KVMethod):
    """The full cache, keeping each layer's last prompt query (``st.last_query``) as well."""

    name: ClassVar[str] = "full"
    needs_budget: ClassVar[bool] = False

    def prefill(self, st, q, k, v):
        st.last_query = q[:, -1:].clone()
        return super().prefill(st, q, k, v)


@dataclass
class Prefill:
    """One prompt's exact prefill: per-layer post-RoPE K/V ``[H_kv, n, d]``, per-layer last query ``[H_q, 1, d]``
    and the last position's logits. Also a prefill source for :func:`evals.runner.generate` (``prefilled=``)."""

    prompt_ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    last_queries: list[torch.Tensor]
    logits: torch.Tensor

    @classmethod
    @torch.inference_mode()
    def capture(cls, model, prompt_ids: list[int]) -> "Prefill":
        """Runs the exact full-attention prefill of ``prompt_ids`` once and keeps what replay needs."""
        cache = KVCache.for_model(_CaptureFull(), model)
        try:
            cache.begin_prefill()
            ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
            logits = model(ids, use_cache=True, logits_to_keep=1, **compat.cache_kwargs(cache)).logits
            kv = [(st.k.clone(), st.v.clone()) for st in cache.states]
            queries = [st.last_query for st in cache.states]
        finally:
            cache.close()
        return cls(list(prompt_ids), kv, queries, logits)

    def prefill_for(self, model, method: KVMethod, prompt_ids: list[int]) -> "Prefill":
        """This prefill, checked for ``prompt_ids`` and ``method`` (a ValueError when either does not fit)."""
        self._check(method, prompt_ids)
        return self

    def replay(self, cache: KVCache, prompt_ids: list[int]) -> torch.Tensor:
        """Fills ``cache`` (in its prefill phase) as a live prefill of ``prompt_ids`` would; returns the logits."""
        self._check(cache.method, prompt_ids)
        last = self.last_queries if type(cache.method).prefill is not KVMethod.prefill else None
        cache.replay_prefill(self.kv, last)
        return self.logits

    def _check(self, method: KVMethod, prompt_ids: list[int]) -> None:
        if list(prompt_ids) != self.prompt_ids:
            raise ValueError("Prefill.replay: the prompt differs from the captured one")
        reason = replay_refusal(method)
        if reason is not None:
            raise ValueError(reason)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named CPU tensors of its file (:class:`PrefillStore`)."""
        out = {"logits": self.logits, "prompt_ids": torch.tensor(self.prompt_ids, dtype=torch.int64)}
        for i, ((k, v), q) in enumerate(zip(self.kv, self.last_queries)):
            out[f"k.{i}"], out[f"v.{i}"], out[f"q.{i}"] = k, v, q
        return {name: t.detach().contiguous().cpu() for name, t in out.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], device: torch.device) -> "Prefill":
        n_layers = sum(name.startswith("k.") for name in tensors)
        kv = [(tensors[f"k.{i}"].to(device), tensors[f"v.{i}"].to(device)) for i in range(n_layers)]
        queries = [tensors[f"q.{i}"].to(device) for i in range(n_layers)]
        return cls(tensors["prompt_ids"].tolist(), kv, queries, tensors["logits"].to(device))


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and raw bytes of ``tensors`` (CPU, contiguous), in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def prompt_digest(prompt_ids: list[int]) -> str:
    return hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).hexdigest()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of the model type and, for every parameter and buffer, its name, shape, dtype and
    :data:`FINGERPRINT_VALUES` evenly spaced values: another checkpoint (a fine-tune, another seed of a random
    model, another RoPE base) gives another fingerprint, at the cost of reading a few values per tensor."""
    digest = hashlib.sha256(str(getattr(model.config, "model_type", "")).encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        flat = t.detach().reshape(-1)
        m = min(flat.numel(), FINGERPRINT_VALUES)
        idx = torch.arange(m, device=flat.device) * max(flat.numel() - 1, 0) // max(m - 1, 1)  # exact, in int64
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(flat[idx].double().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


class PrefillStore:
    """Captured prefills on disk, one verified safetensors file per (model, dtype, device, prompt); a prefill
    source for :func:`evals.runner.generate` (``prefilled=``). ``captures`` and ``loads`` count its work."""

    def __init__(self, directory: str | Path, max_gb: float = DEFAULT_MAX_GB, model_id: str = ""):
        self.directory = Path(directory).expanduser()
        self.max_gb = float(max_gb)
        self.model_id = model_id
        self.captures = self.loads = 0
        self._noted: set[str] = set()
        self._fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def prefill_for(self, model, method: KVMethod, prompt_ids: list[int]) -> Prefill | None:
        """The prompt's prefill (read and verified, or captured and written), or None (with a notice once per
        method) when ``method`` must run its prefill live."""
        reason = replay_refusal(method)
        if reason is not None:
            if method.name not in self._noted:
                self._noted.add(method.name)
                print(f"note: {reason} (prefill_cache={self.directory})", file=sys.stderr, flush=True)
            return None
        key = self.key(model, prompt_ids)
        path = self.path_for(key)
        if path.exists():
            self.loads += 1
            return read_prefill(path, key, next(model.parameters()).device)
        prefill = Prefill.capture(model, prompt_ids)
        self.captures += 1
        self.write(path, key, prefill)
        return prefill

    def key(self, model, prompt_ids: list[int]) -> dict:
        """What identifies a prefill: the model (name, weights fingerprint), dtype, device and prompt."""
        if model not in self._fingerprints:
            self._fingerprints[model] = weights_fingerprint(model)
        param = next(model.parameters())
        return {"format": FORMAT, "model": self.model_id, "weights": self._fingerprints[model],
                "dtype": str(param.dtype).removeprefix("torch."), "device": param.device.type,
                "n_tokens": len(prompt_ids), "prompt_sha256": prompt_digest(prompt_ids)}

    def path_for(self, key: dict) -> Path:
        return self.directory / f"{hashlib.sha256(_canonical(key).encode()).hexdigest()[:32]}.safetensors"

    def write(self, path: Path, key: dict, prefill: Prefill) -> None:
        """Writes ``prefill`` to ``path`` atomically, after checking the size bound."""
        tensors = prefill.tensors()
        k = tensors["k.0"]
        meta = {"format": FORMAT, "key": _canonical(key), "sha256": tensor_digest(tensors),
                "dtype": str(k.dtype).removeprefix("torch."), "n_layers": str(len(prefill.kv)),
                "n_tokens": str(len(prefill.prompt_ids)),
                "shapes": json.dumps({"k": list(k.shape), "q": list(tensors["q.0"].shape),
                                      "logits": list(tensors["logits"].shape)})}
        data = safetensors_bytes(tensors, metadata=meta)
        self._check_room(len(data), len(prefill.prompt_ids))
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.stem}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide the file from colleagues
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def used_bytes(self) -> int:
        """Bytes of the files in the directory (stray ``.tmp`` files of killed captures included)."""
        total = 0
        for entry in (self.directory.iterdir() if self.directory.is_dir() else ()):
            try:
                total += entry.stat().st_size if entry.is_file() else 0
            except FileNotFoundError:  # removed meanwhile (another process's temporary file)
                pass
        return total

    def _check_room(self, n_bytes: int, n_tokens: int) -> None:
        used = self.used_bytes()
        if used + n_bytes > self.max_gb * 1e9:
            raise PrefillCacheError(
                f"prefill_cache={self.directory} holds {used / 1e9:.2f} GB, and this {n_tokens}-token prompt's "
                f"prefill ({n_bytes / 1e9:.3f} GB) would bring it over prefill_cache_max_gb={self.max_gb:g}; raise "
                f"the bound (prefill_cache_max_gb=...) or delete files from {self.directory}")


def read_prefill(path: Path, key: dict, device: torch.device) -> Prefill:
    """The verified prefill in ``path`` (its format, key and sha256 checked), else a :class:`PrefillCacheError`."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a torn or garbled file
        raise _refused(path, f"unreadable: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    if meta.get("format") != FORMAT:
        raise _refused(path, f"not a prefill file of format {FORMAT}")
    if meta.get("key") != _canonical(key):
        raise _refused(path, f"its key differs from the prompt's ({_key_difference(meta.get('key'), key)})")
    if meta.get("sha256") != tensor_digest(tensors):
        raise _refused(path, "its tensors do not match their sha256 checksum")
    return Prefill.from_tensors(tensors, device)


def _refused(path: Path, why: str) -> PrefillCacheError:
    return PrefillCacheError(f"prefill_cache: refusing {path}: {why}; delete the file and rerun (the prefill is "
                             "captured again)")


def _key_difference(stored: str | None, key: dict) -> str:
    try:
        other = json.loads(stored or "")
    except ValueError:
        return "unreadable key"
    fields = sorted(k for k in set(key) | set(other if isinstance(other, dict) else {})
                    if not isinstance(other, dict) or other.get(k) != key.get(k))
    return "fields " + ", ".join(fields)


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def from_config(cfg: dict) -> tuple[dict, PrefillStore | None]:
    """``cfg`` without the top-level ``prefill_cache``/``prefill_cache_max_gb`` keys, and the store they name
    (None without ``prefill_cache``). The keys are not part of a run's identity: a replayed prefill generates
    what a live one does, and each row records which it was. A relative path resolves against the repository
    root, as ``results_dir``."""
    cfg = dict(cfg)
    directory = cfg.pop("prefill_cache", None)
    max_gb = cfg.pop("prefill_cache_max_gb", DEFAULT_MAX_GB)
    if isinstance(max_gb, bool) or not isinstance(max_gb, (int, float)) or not max_gb > 0:
        raise ConfigError(f"prefill_cache_max_gb must be a positive number of GB, got {max_gb!r}")
    if directory is None:
        return cfg, None
    if not isinstance(directory, str) or not directory:
        raise ConfigError(f"prefill_cache must be a directory path, got {directory!r}")
    path = Path(directory).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    check_writable_dir(path, "prefill_cache")
    return cfg, PrefillStore(path, max_gb, model_id=str((cfg.get("model") or {}).get("name", "")))


def prefill_counts(rows: list[dict]) -> dict[str, int]:
    """``{"replayed": n, "live": m}`` over ``rows`` (rows written before the record existed ran live)."""
    counts = {"replayed": 0, "live": 0}
    for row in rows:
        mode = (row.get("timing") or {}).get("prefill", "live")
        counts[mode] = counts.get(mode, 0) + 1
    return counts
