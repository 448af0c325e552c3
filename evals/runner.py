"""The one place where the model is driven: greedy decoding with explicit cache phases and per-token
timestamps (nanoGPT/gpt-fast style: the whole loop, top to bottom, in :func:`generate`).

Timing (PQCache's definitions, the TT2T/TPOT of the IceCache paper):
- TTFT: request start -> first generated token (prefill, plus any ``decode_ids`` fed through the decode
  path before generation).
- TT2T: request start -> second generated token. It includes the first decode step that uses the
  compressed/offloaded cache, hence any wait for background index builds started at prefill.
- TPOT: per-token intervals of tokens 3..N, i.e. ``(T_N - TT2T) / (N - 2)``; mean, p50 and p90.
- Breakdown: seconds per output token in select / transfer / attention / update (summed over layers,
  measured by the method base class) and ``other`` = step wall time minus their sum, over the same steps.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from icecache.kv import KVCache, KVMethod, compat
from icecache.kv.timing import PHASES


_WARM_MODELS: "weakref.WeakSet" = weakref.WeakSet()  # models that ran their untimed first generation here


def warm_model(model) -> None:
    """Once per model and process: an untimed generation of 3 tokens after a 16-token prompt with the full cache,
    so what only a process's first forward pays (lazy initialisation, the first-call set-up of torch's kernels and
    thread pools) stays out of every timed request, whichever method comes first."""
    if model in _WARM_MODELS:
        return
    _WARM_MODELS.add(model)
    from baselines.full import FullCache

    generate(model, None, FullCache(), [0] * 16, 3, ignore_eos=True)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    n_prompt_tokens: int
    ttft_s: float
    tt2t_s: float | None
    intervals_s: list[float] = field(default_factory=list)  # tokens 3..N
    breakdown_s: dict[str, float] = field(default_factory=dict)  # summed over the same steps
    effective_tokens: list[float | None] = field(default_factory=list)
    max_resident_tokens: int = 0
    transfer_bytes: int = 0  # bytes moved from offload stores over tokens 3..N
    peak_memory_bytes: int | None = None  # CUDA: max allocated during this generation (weights included)
    method_stats: dict[str, list[float | None]] = field(default_factory=dict)  # KVCache.method_stats
    recall: dict | None = None  # diagnostics=recall: RecallProbe.summary() (None without the probe)
    prefill: str = "live"  # "replayed": the prompt's K/V came from a captured prefill (evals/prefill_cache.py)
    memory: dict[str, int] = field(default_factory=dict)  # KVCache.memory_bytes after the last step
    budgeted_layers: list[int] = field(default_factory=list)  # KVCache.budgeted_layers
    method_bound: dict = field(default_factory=dict)  # the method's settings resolved from the model (Bound.settings)

    def timing(self) -> dict:
        return {"ttft_s": self.ttft_s, "tt2t_s": self.tt2t_s, "intervals_s": self.intervals_s,
                "breakdown_s": self.breakdown_s, "n_prompt_tokens": self.n_prompt_tokens,
                "effective_tokens": self.effective_tokens, "max_resident_tokens": self.max_resident_tokens,
                "transfer_bytes": self.transfer_bytes, "peak_memory_bytes": self.peak_memory_bytes,
                "method_stats": self.method_stats, "prefill": self.prefill, **self.memory}


def _stop_ids(model, tokenizer) -> set[int]:
    ids = model.generation_config.eos_token_id if model.generation_config else None
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return set(ids)


@torch.inference_mode()
def generate(model, tokenizer, method: KVMethod, prompt_ids: list[int], max_new_tokens: int,
             decode_ids: list[int] = (), stop: list[str] = (), ignore_eos: bool = False,
             stop_token_ids: list[int] = (), min_new_tokens: int = 0, profile: bool = False,
             sampling: dict | None = None, eos_token_ids: list[int] | None = None,
             prefilled=None, probe=None) -> Generation:
    """Greedy generation of one sample with a fresh cache of ``method`` (or nucleus sampling when
    ``sampling`` = ``{"temperature", "top_p", "seed"}`` is given: :func:`sample_token`). Generation ends at EOS
    or one of ``stop_token_ids`` (never before ``min_new_tokens`` tokens), a ``stop`` string, or
    ``max_new_tokens``. EOS is the generation config's EOS ids and the tokenizer's, or ``eos_token_ids`` when
    given (``model.generate(eos_token_id=[...])`` replaces the generation config's list the same way).
    ``prefilled`` is a prefill source (:mod:`evals.prefill_cache`: one captured
    :class:`~evals.prefill_cache.Prefill` or a :class:`~evals.prefill_cache.PrefillStore` on disk): ``prefilled.prefill_for(model, method, prompt_ids)``,
    called before the clock starts, returns an object whose ``replay(cache, prompt_ids)`` fills the cache and
    returns the logits instead of the prefill forward, or None to run the prefill live; ``Generation.prefill``
    records which ("replayed" or "live"), and a replayed TTFT excludes the prefill. ``probe`` (a
    :class:`~icecache.kv.recall.RecallProbe`, ``diagnostics=recall``) measures the attention-mass recall of every
    decode step; its time is the ``diagnostics`` entry of the breakdown. Before the clock starts the model
    (:func:`warm_model`, once per process) and the method warm up (:meth:`~icecache.kv.KVMethod.warm_up`: its numba
    kernels compiled or loaded for this model and prompt), so no request times a compilation; after the last step ``Generation.memory`` records the cache's
    :meth:`~icecache.kv.KVCache.memory_bytes`."""
    device = next(model.parameters()).device
    warm_model(model)
    replay = None if prefilled is None else prefilled.prefill_for(model, method, prompt_ids)
    cache = KVCache.for_model(method, model, profile=profile, probe=probe)
    method.warm_up(cache.spec, len(prompt_ids))
    kw = compat.cache_kwargs(cache)
    default_eos = _stop_ids(model, tokenizer) if eos_token_ids is None else set(eos_token_ids)
    eos = set(stop_token_ids) | (set() if ignore_eos else default_eos)
    rng = None
    if sampling:
        rng = torch.Generator(device=device).manual_seed(int(sampling.get("seed", 0)))

    def pick(logits: torch.Tensor, n_out: int) -> int:
        scores = logits[0, -1]
        if n_out < min_new_tokens and eos:
            scores = scores.clone()
            scores[list(eos)] = float("-inf")
        if sampling:
            return sample_token(scores, float(sampling["temperature"]), float(sampling["top_p"]), rng)
        return int(scores.argmax())
    if device.type == "cuda":  # per generation, not since the process started (earlier runs, other methods)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        start = _now(device)
        cache.begin_prefill()
        if replay is None:
            logits = model(torch.tensor([prompt_ids], device=device), use_cache=True, logits_to_keep=1, **kw).logits
        else:
            logits = replay.replay(cache, prompt_ids)
        for tok in decode_ids:  # e.g. the passkey question, answered by the query-aware cache
            cache.begin_step()
            logits = model(torch.tensor([[tok]], device=device), use_cache=True, **kw).logits
            cache.end_step()
        token = pick(logits, 0)
        phase_names = (*PHASES, "diagnostics") if probe is not None else PHASES
        stamps, out, breakdown = [_now(device)], [token], {p: 0.0 for p in (*phase_names, "other")}
        max_resident, moved = cache.max_budgeted_resident(), 0
        while len(out) < max_new_tokens and token not in eos and not _hits_stop(tokenizer, out, stop):
            step_start, bytes_before = _now(device), cache.bytes_moved()
            cache.begin_step()
            logits = model(torch.tensor([[token]], device=device), use_cache=True, **kw).logits
            phases = cache.end_step()
            token = pick(logits, len(out))
            out.append(token)
            stamps.append(_now(device))
            max_resident = max(max_resident, cache.max_budgeted_resident())
            if len(out) >= 3:  # TPOT and its breakdown cover tokens 3..N
                for p in phase_names:
                    breakdown[p] += phases.get(p, 0.0)
                breakdown["other"] += (stamps[-1] - step_start) - sum(phases.values())
                moved += cache.bytes_moved() - bytes_before
        if out[-1] in eos:
            out = out[:-1]
        text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else ""
        return Generation(
            token_ids=out, text=_cut_at_stop(text, stop), n_prompt_tokens=len(prompt_ids) + len(decode_ids),
            ttft_s=stamps[0] - start, tt2t_s=stamps[1] - start if len(stamps) > 1 else None,
            intervals_s=[b - a for a, b in zip(stamps[1:], stamps[2:])], breakdown_s=breakdown,
            effective_tokens=cache.effective_tokens(), max_resident_tokens=max_resident, transfer_bytes=moved,
            peak_memory_bytes=int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
            method_stats=cache.method_stats(), recall=None if probe is None else probe.summary(),
            prefill="live" if replay is None else "replayed", memory=cache.memory_bytes(),
            budgeted_layers=cache.budgeted_layers(), method_bound=cache.bound.settings())
    finally:
        cache.close()


def sample_token(scores: torch.Tensor, temperature: float, top_p: float, rng: torch.Generator) -> int:
    """Temperature then nucleus (top-p) sampling, as vLLM's ``SamplingParams(temperature, top_p)``: keep the
    smallest set of most likely tokens whose probability reaches ``top_p`` (the most likely one always),
    renormalise and draw with ``rng``. ``temperature == 0`` is greedy."""
    if temperature <= 0:
        return int(scores.argmax())
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before this token already reaches top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=rng)
    return int(order[choice])


def _hits_stop(tokenizer, out: list[int], stop) -> bool:
    if not stop or tokenizer is None:
        return False
    tail = tokenizer.decode(out[-16:], skip_special_tokens=True)
    return any(s in tail for s in stop)


def _cut_at_stop(text: str, stop) -> str:
    for s in stop:
        if s in text:
            text = text[: text.index(s)]
    return text
