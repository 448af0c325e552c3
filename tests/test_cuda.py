"""The CUDA path (``@pytest.mark.cuda``; skipped without a GPU, collected by ``make test``): every method
equals full attention in bf16 at a covering budget, IceCache's bulk load is one pinned host-to-device copy
per layer and step, offload stores are pinned, the background index build overlaps the next layer's
prefill, CUDA-event phase timings add up to the step time, peak memory is per generation, and the
flash-attn prefill path agrees with sdpa.

Run them on a GPU machine with ``pytest -m cuda`` (``scripts/gpu_check.sh`` does). With
``ICECACHE_CUDA_TESTS_DEVICE=cpu`` the device-independent ones (bf16 equality, phase sums, bulk-load
contents) run on the CPU in bf16, to check the tests themselves on a machine without a GPU; the CUDA-only
properties (pinned memory, copies, events, memory statistics, flash-attn) then skip.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import generate_reference, method_case, skip_without_requirement

from evals.registry import METHODS, make_cache, make_method
from evals.models import tiny_config

DEVICE = os.environ.get("ICECACHE_CUDA_TESTS_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA device")]
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="a CUDA-only property (ICECACHE_CUDA_TESTS_DEVICE=cpu)")

NEW = 8
# bf16 keeps 8 significant bits: two correct bf16 computations of the same logits that differ in kernels
# and summation order (sdpa vs. our gather-and-attend) differ by a few units in the last place, amplified
# through 4 layers and the LM head. The tolerance is relative to the largest reference logit (about 0.5
# for these models: a bf16 ulp there is 0.002). On the CPU in bf16 (ICECACHE_CUDA_TESTS_DEVICE=cpu) the
# worst difference over every method and both models was 1.2% of that scale.
BF16_RTOL = 0.03


def device() -> torch.device:
    return torch.device(DEVICE)


def build(name: str = "tiny-llama", n_kv: int = 2, n_q: int = 4, dtype=torch.bfloat16, seed: int = 0, **shape):
    """A tiny random model (tests/helpers.py's shapes) in ``dtype`` on the test device."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(name, n_kv_heads=n_kv, n_heads=n_q, **shape), dtype=dtype)
    return model.eval().to(device())


def random_ids(n: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed)).to(device())


@torch.inference_mode()
def teacher_forced_logits(model, cache, sequence: torch.Tensor, prompt_len: int) -> list[torch.Tensor]:
    """Next-token logits ``[1, V]`` after the prompt and after each following token of ``sequence``,
    through ``cache`` (its first forward pass is the prefill, every later one a decode step)."""
    out = [model(sequence[:, :prompt_len], past_key_values=cache, use_cache=True).logits[:, -1]]
    for i in range(prompt_len, sequence.shape[1] - 1):
        out.append(model(sequence[:, i:i + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return out


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2, dim=-1).values[0]
    return float(top[0] - top[1])


# ------------------------------------------------------------------ equality with full attention (bf16)
def covering(method: str) -> tuple[int | None, dict, int]:
    """(budget, hyperparameters, prompt length) covering the prompt + :data:`NEW` tokens: the contract case of
    every registered method (tests/helpers.py ``method_case``: its row, else the case derived from its class),
    which the CPU equality tests of each method use."""
    case = method_case(method)
    assert case.new_tokens == NEW, f"{method}: its contract case covers {case.new_tokens} new tokens, not {NEW}"
    return case.covering.get("budget"), {k: v for k, v in case.covering.items() if k != "budget"}, case.prompt_len


@pytest.mark.parametrize("method", sorted(METHODS))
def test_covering_case_of_every_method_configures_it(method):
    """Every registered method's covering case configures it (the bf16 equality below runs on each)."""
    budget, hp, _ = covering(method)
    skip_without_requirement(method)
    built = make_method(method, budget=budget, debug=True, **hp)
    assert built.budget == budget, f"{method}: built with budget {built.budget}, not its case's {budget}"


def decided_steps(ref, atol: float) -> int:
    """Leading steps of a reference generation whose top-1 logit leads the top-2 by more than ``2 * atol``:
    there a method within ``atol`` of the reference must pick the same token; at a closer step either token
    is a correct bf16 answer (random tiny models have near-uniform logits, so such steps are common)."""
    margins = [top2_margin(x) for x in ref.logits]
    return next((i for i, m in enumerate(margins) if m <= 2 * atol), len(margins))


def reference_with_most_decided_steps(model, prompt_len: int, seeds=range(16)):
    """The reference generation (transformers' cache, sdpa) of the prompt seed with the most decided steps."""
    best = None
    for seed in seeds:
        ids = random_ids(prompt_len, seed=seed)
        ref = generate_reference(model, ids, NEW)
        atol = BF16_RTOL * max(0.25, max(float(x.float().abs().max()) for x in ref.logits))
        if best is None or decided_steps(ref, atol) > best[3]:
            best = (ids, ref, atol, decided_steps(ref, atol))
        if best[3] == NEW:
            break
    return best


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("method", list(METHODS))
def test_covering_budget_equals_full_attention_in_bf16(method, model_name):
    """Along the reference's tokens the logits are within the bf16 tolerance of full attention's at every
    step, and free-running greedy generation through the method's cache gives the reference's tokens at
    every decided step (:func:`decided_steps`; the prompt is the one of 16 seeds with the most of them)."""
    budget, hp, prompt_len = covering(method)
    skip_without_requirement(method)
    model = build(model_name)
    ids, ref, atol, decided = reference_with_most_decided_steps(model, prompt_len)
    assert decided >= 1, "no prompt seed gives a decided greedy step: the token check would be vacuous"

    cache = make_cache(method, model, budget=budget, debug=True, **hp)
    try:
        got = teacher_forced_logits(model, cache, ref.sequences, prompt_len)
        budgeted = [s for s in cache.states if cache.method.is_budgeted(s)]
    finally:
        cache.close()
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.logits, got))
    assert worst <= atol, f"{method}/{model_name}: bf16 logits differ from full attention by {worst} > {atol}"
    if method in ("pqcache", "omnikv") or method.startswith("icecache"):  # the offload path really ran
        assert budgeted and all(s.bytes_moved > 0 for s in budgeted)

    cache = make_cache(method, model, budget=budget, **hp)
    try:
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, past_key_values=cache)
    finally:
        cache.close()
    n = prompt_len + decided + 1  # the prompt, the decided steps' tokens and the first undecided step's
    assert torch.equal(out[0, :n].cpu(), ref.sequences[0, :n].cpu()), \
        f"{method}/{model_name}: greedy tokens differ from full attention within the {decided} decided steps"


# --------------------------------------------------------------------------- IceCache bulk load
def icecache_after_prefill(prompt_len: int = 1200, budget: int = 64, steps: int = 3, method: str = "icecache"):
    """A bf16 tiny Llama with an IceCache cache after its prefill and ``steps`` decode steps (numba and the
    allocator warm), plus the next token to feed."""
    model = build("tiny-llama", 2, 4)
    cache = make_cache(method, model, budget=budget)
    ids = random_ids(prompt_len)
    with torch.inference_mode():
        token = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return model, cache, token


def offloaded_layers(cache):
    return [s for s in cache.states if getattr(s, "offloaded", False)]


def evict_resident_pages(cache) -> None:
    """Empties every layer's page slots (a cold resident set), so the next step loads all its pages."""
    with torch.inference_mode():  # the slot tables were made in the generation's inference mode
        for st in offloaded_layers(cache):
            st.slot_page[:] = -1
            st.slot_tokens[:] = -1


def test_bulk_loaded_pages_equal_a_direct_gather_from_the_store():
    """After every step the resident page slots hold exactly the store's K/V of the positions their page
    table names (the bulk load's packed copy and scatter lose or misplace nothing)."""
    model, cache, token = icecache_after_prefill()
    try:
        evict_resident_pages(cache)
        with torch.inference_mode():
            for _ in range(4):
                token = model(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                for st in offloaded_layers(cache):
                    tokens = st.slot_tokens.numpy()  # [H_kv, W, s] absolute positions, -1 = empty
                    h, w, s = tokens.shape
                    heads = np.broadcast_to(np.arange(h)[:, None], (h, w)).reshape(-1)
                    flat = tokens.reshape(h * w, s)
                    want_k, want_v = st.store.k_data, st.store.v_data
                    rows = np.where(flat >= 0, flat - st.store.base_pos, 0)
                    ok = torch.from_numpy(flat >= 0)
                    direct_k = want_k[torch.from_numpy(heads)[:, None], torch.from_numpy(rows)]  # [N, s, d]
                    direct_v = want_v[torch.from_numpy(heads)[:, None], torch.from_numpy(rows)]
                    got_k = st.slot_k.reshape(h * w, s, -1).cpu()
                    got_v = st.slot_v.reshape(h * w, s, -1).cpu()
                    assert ok.any(), "the test must load pages"
                    assert torch.equal(got_k[ok], direct_k[ok]) and torch.equal(got_v[ok], direct_v[ok])
    finally:
        cache.close()


@cuda_only
def test_bulk_load_is_one_contiguous_pinned_copy_per_loading_layer():
    """Within one decode step every copy from pinned host memory to the GPU is a bulk load: exactly one
    per layer that loads pages, of the contiguous transit prefix into the device transit buffer (counted
    on ``Tensor.copy_``, through which ``OffloadStore.bulk_load`` copies)."""
    model, cache, token = icecache_after_prefill()
    real_copy, real_load = torch.Tensor.copy_, type(offloaded_layers(cache)[0].store).bulk_load
    copies, loads = [], []

    def spy_copy(dst, src, non_blocking=False):
        if dst.is_cuda and not src.is_cuda:
            copies.append((src.is_pinned(), src.is_contiguous(), dst.is_contiguous(), dst.data_ptr(), src.data_ptr()))
        return real_copy(dst, src, non_blocking)

    def spy_load(store, heads, positions):
        loads.append(store)
        return real_load(store, heads, positions)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "copy_", spy_copy)
            mp.setattr(type(offloaded_layers(cache)[0].store), "bulk_load", spy_load)
            evict_resident_pages(cache)
            with torch.inference_mode():
                model(token, past_key_values=cache, use_cache=True)
            torch.cuda.synchronize()
    finally:
        cache.close()
    assert loads, "the step must load pages"
    pinned = [c for c in copies if c[0]]
    assert len(pinned) == len(loads)  # one host-to-device copy per loading layer, nothing else pinned
    for (_, src_contig, dst_contig, dst, src), store in zip(pinned, loads):
        assert src_contig and dst_contig
        assert src == store.transit.data_ptr() and dst == store.device_transit.data_ptr()  # the prefixes


def profiled_memcpy_names(prof) -> list[str]:
    """Names of the device-side memcpy activities the profiler recorded (CUPTI names them like
    ``Memcpy HtoD (Pinned -> Device)``)."""
    from torch.autograd import DeviceType

    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not any(n.startswith("Memcpy") for n in names):  # pragma: no cover - profiler internals of other versions
        names = [e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    return [n for n in names if n.startswith("Memcpy")]


@cuda_only
def test_profiler_sees_one_pinned_host_to_device_copy_per_loading_layer():
    """The same property from the device's side (CUPTI): the step's pinned HtoD memcpys number the layers
    that bulk-loaded pages; every other HtoD copy (page ids, the token) is small and pageable."""
    from torch.profiler import ProfilerActivity, profile

    model, cache, token = icecache_after_prefill()
    store_cls = type(offloaded_layers(cache)[0].store)
    real_load, loads = store_cls.bulk_load, []

    def spy_load(store, heads, positions):
        loads.append(len(positions))
        return real_load(store, heads, positions)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(store_cls, "bulk_load", spy_load)
            evict_resident_pages(cache)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with torch.inference_mode():
                    model(token, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
    finally:
        cache.close()
    names = profiled_memcpy_names(prof)
    pinned_htod = [n for n in names if "HtoD" in n and "Pinned" in n]
    assert loads and len(pinned_htod) == len(loads), names


def test_consecutive_bulk_loads_do_not_overwrite_a_load_in_flight():
    """Two loads in a row through one store: the first one's pages, consumed on the compute stream before
    the second load, are intact (the transit buffers are reused only after their copy finished)."""
    from icecache.offload import OffloadStore

    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 256, 16, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 256, 16, generator=g).to(torch.bfloat16)
    store = OffloadStore.copy_of(k.to(device()), v.to(device()), first_pos=0, device=device(), max_blocks=8,
                                 page_size=8)
    assert store.pin == ON_CUDA
    loads = [(np.array([0, 1, 1]), np.array([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, -1, -1, -1, -1],
                                             list(range(200, 208))])),
             (np.array([1, 0]), np.array([list(range(40, 48)), list(range(100, 108))]))]
    kept = []
    for heads, positions in loads:
        got_k, got_v = store.bulk_load(heads, positions)
        assert got_k.device.type == device().type
        kept.append((got_k.clone(), got_v.clone()))  # consumed on the current stream, as the scatter does
    for (heads, positions), (got_k, got_v) in zip(loads, kept):
        for b in range(len(heads)):
            ok = positions[b] >= 0
            assert torch.equal(got_k[b].cpu()[ok], k[heads[b], positions[b][ok]])
            assert torch.equal(got_v[b].cpu()[ok], v[heads[b], positions[b][ok]])


# ------------------------------------------------------------------------------- pinned memory
@cuda_only
@pytest.mark.parametrize("method", ["icecache", "icecache_reuse", "pqcache", "omnikv", "magicpig"])
def test_offload_stores_and_transit_buffers_are_pinned(method):
    """Every offload store is page-locked host memory on a CUDA run (so its copies are asynchronous DMA),
    IceCache's transit buffer too, and a store stays pinned when it grows."""
    budgets = {"icecache": 64, "icecache_reuse": 64, "pqcache": 64, "omnikv": 64, "magicpig": 128}
    model = build("tiny-llama", 2, 4, n_layers=8)
    cache = make_cache(method, model, budget=budgets[method])
    try:
        with torch.inference_mode():
            token = model(random_ids(1000), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            model(token, past_key_values=cache, use_cache=True)  # awaits the background jobs
        stores = []
        for st in cache.states:
            for name in ("store",):
                store = getattr(st, name, None)
                if store is not None:
                    stores += [store.k_data, store.v_data]
                    if hasattr(store, "transit"):
                        assert store.transit.is_pinned() and store.device_transit.is_cuda
            for name in ("store_k", "store_v"):  # OmniKV, MagicPIG
                if getattr(st, name, None) is not None:
                    stores.append(getattr(st, name))
        assert stores, f"{method}: no offload store found"
        assert all(not t.is_cuda and t.is_pinned() for t in stores)
        grown = next((getattr(st, "store") for st in cache.states if getattr(st, "store", None) is not None), None)
        if grown is not None:  # a store that grows stays pinned
            h, _, d = grown.k_data.shape
            extra = torch.zeros(h, grown.k_data.shape[1], d, dtype=grown.k_data.dtype, device=device())
            grown.append(extra, extra)
            assert grown.k_data.is_pinned() and grown.v_data.is_pinned()
    finally:
        cache.close()


# ------------------------------------------------------------------------- prefill pipeline
OVERLAP_PROMPT = 8192


@cuda_only
@pytest.mark.parametrize("method", ["icecache", "pqcache"])
def test_background_index_build_overlaps_the_next_layers_prefill(method):
    """The layer's offload job (store + index / codebook) runs on the background worker while the main
    thread prefills the following layers: host timestamps of each decoder layer's forward (synchronised
    with the GPU at its end, so they bound its kernels) and of each background job show the first job
    running while later layers prefill, on another thread (on the GPU a layer takes about a millisecond at
    8k tokens, a job tens of milliseconds)."""
    model = build("tiny-llama", 2, 8, n_layers=8, head_dim=64)  # hidden 512: milliseconds per layer at 8k
    intervals: dict[int, list[float]] = {}
    jobs: list[tuple[int, float, float, int]] = []
    main = threading.get_ident()

    def pre(module, args):  # the first forward of each layer is its prefill
        torch.cuda.synchronize()
        intervals.setdefault(module.self_attn.layer_idx, [time.perf_counter()])

    def post(module, args, output):
        torch.cuda.synchronize()
        span = intervals[module.self_attn.layer_idx]
        if len(span) == 1:
            span.append(time.perf_counter())

    hooks = [layer.register_forward_pre_hook(pre) for layer in model.model.layers]
    hooks += [layer.register_forward_hook(post) for layer in model.model.layers]
    cache = make_cache(method, model, budget=256)
    job_name = {"icecache": "offload_job", "pqcache": "build_codebook"}[method]
    real_job = getattr(cache.method, job_name)

    def timed_job(st, *args):
        t0 = time.perf_counter()
        try:
            return real_job(st, *args)
        finally:
            jobs.append((st.layer_idx, t0, time.perf_counter(), threading.get_ident()))

    object.__setattr__(cache.method, job_name, timed_job)
    try:
        with torch.inference_mode():
            token = model(random_ids(OVERLAP_PROMPT), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            prefill_done = time.perf_counter()
            model(token, past_key_values=cache, use_cache=True)
    finally:
        cache.close()
        for h in hooks:
            h.remove()
    assert jobs and all(thread != main for *_, thread in jobs)
    assert all(len(span) == 2 for span in intervals.values())
    layer, t0, t1, _ = min(jobs, key=lambda j: j[1])  # the first job: the worker is idle when it is submitted
    assert t0 < prefill_done  # started during the prefill, not at the first decode step
    during = [j for j, (a, b) in intervals.items() if j > layer and a < t1 and b > t0]
    assert during, f"job of layer {layer} [{t0}, {t1}] overlaps no later layer's prefill: {intervals}"


# --------------------------------------------------------------------------------- phase timing
@cuda_only
def test_event_phase_timings_add_up_to_the_step_time():
    """Known GPU work in each span (``torch.cuda._sleep``), nothing between spans: the CUDA-event phases
    sum to the step's synchronised wall time within 5%, and each phase gets its own work's time."""
    from icecache.kv.timing import PhaseTimer

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # the clocks ramp up under load: calibrate on the last of three
        torch.cuda.synchronize()
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
    cycles_per_ms = 20_000_000 / a.elapsed_time(b)
    work_ms = {"select": 8.0, "transfer": 4.0, "attention": 12.0, "update": 6.0}
    timer = PhaseTimer(device="cuda")
    assert timer.use_events
    for _ in range(2):  # the second step reuses the first step's events
        torch.cuda.synchronize()
        start = time.perf_counter()
        for phase, ms in work_ms.items():
            with timer.span(phase):
                torch.cuda._sleep(int(ms * cycles_per_ms))
        phases = timer.reset()
        wall = time.perf_counter() - start
        assert sum(phases.values()) == pytest.approx(wall, rel=0.05)
        for phase, ms in work_ms.items():
            assert phases[phase] == pytest.approx(ms / 1000, rel=0.15)  # the clock may still drift a little


@pytest.mark.parametrize("method,budget", [("full", None), ("quest", 64), ("pqcache", 64), ("icecache", 64)])
def test_decode_breakdown_adds_up_to_tpot(method, budget):
    """Through the runner on the test device: no phase is negative, the phases never exceed the step
    (``other`` >= 0: events attribute no time twice), and phases + other = TPOT within 5%."""
    from evals.runner import generate

    model = build("tiny-llama", 2, 4)
    gen = generate(model, None, make_method(method, budget=budget), random_ids(1000)[0].tolist(), 24, ignore_eos=True)
    tpot_sum = sum(gen.intervals_s)
    assert all(v >= 0 for p, v in gen.breakdown_s.items() if p != "other")
    assert gen.breakdown_s["other"] >= -1e-4 * len(gen.intervals_s)
    assert sum(gen.breakdown_s.values()) == pytest.approx(tpot_sum, rel=0.05)


# ----------------------------------------------------------------------------------------- memory
@cuda_only
def test_peak_memory_is_reset_per_generation():
    """Each generation reports its own peak: a short prompt after a long one reports less, a long one
    after that reports what the first did, and every peak includes the weights."""
    from evals.runner import generate

    model = build("tiny-llama", 2, 4, n_layers=4, head_dim=64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    runs = []
    for n in (6000, 100, 6000):
        ids = random_ids(n)[0].tolist()  # ids within the tiny vocabulary (264)
        runs.append(generate(model, None, make_method("full"), ids, 4, ignore_eos=True).peak_memory_bytes)
    long1, short, long2 = runs
    assert weights <= short < long1 and long2 == pytest.approx(long1, rel=0.05)


# ----------------------------------------------------------------------------------------- flash-attn
def _flash():
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@cuda_only
@pytest.mark.skipif(not _flash(), reason="flash-attn is not installed (pip install .[gpu])")
@pytest.mark.parametrize("n_kv,n_q", [(1, 4), (2, 8), (4, 4)])
def test_flash_attn_prefill_equals_sdpa_and_is_used(monkeypatch, n_kv, n_q):
    """``causal_attention`` takes flash-attn for bf16 CUDA prompts (GQA heads unexpanded) and agrees with
    sdpa within bf16 rounding; a model's prefill goes through it once per layer."""
    import torch.nn.functional as F

    from icecache.kv import attention
    from icecache.kv.attention import causal_attention, expand_heads

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n_q, 777, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(n_kv, 777, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(n_kv, 777, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = F.scaled_dot_product_attention(q[None].float(), expand_heads(k, n_q)[None].float(),
                                         expand_heads(v, n_q)[None].float(), is_causal=True, scale=0.125)[0]
    calls = []
    real = attention.flash_attn_func
    monkeypatch.setattr(attention, "flash_attn_func", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = causal_attention(q, k, v, 0.125)
    assert calls == [1]
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    model = build("tiny-llama", n_kv, n_q)
    calls.clear()
    cache = make_cache("full", model)
    with torch.inference_mode():
        model(random_ids(300), past_key_values=cache, use_cache=True)
    assert len(calls) == model.config.num_hidden_layers
