"""Latency without implementation artifacts: amortised appends into preallocated stores,
one contiguous transfer per bulk load, and no host syncs in the decode step beyond the index's own."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import build_tiny, generate_with, replace_hook

import icecache.kv.storage as storage
from evals.registry import make_cache
from icecache.kv.storage import HostKV, append_to_buffer, grown_capacity
from icecache.offload import OffloadStore

pytestmark = pytest.mark.usefixtures("one_thread")

D = 8


# ------------------------------------------------------------------------- amortised appends
def test_append_to_buffer_grows_geometrically_and_sizes_the_first_buffer_to_its_content():
    buffer, view = append_to_buffer(None, None, torch.randn(2, 1000, D))
    assert buffer.shape[1] == grown_capacity(1000) < 2 * 1000  # the prompt, not twice it
    chunks, buffers = [view.clone()], {buffer.data_ptr()}
    n = 5000
    for _ in range(n):
        new = torch.randn(2, 1, D)
        buffer, view = append_to_buffer(buffer, view, new)
        buffers.add(buffer.data_ptr())
        chunks.append(new)
    assert torch.equal(view, torch.cat(chunks, dim=1))
    assert len(buffers) <= 2 + np.log(6000 / 1000) / np.log(9 / 8)  # O(log n) growths, not O(n)


def test_positions_are_stored_in_a_growable_buffer_too():
    buffer, view = append_to_buffer(None, None, torch.arange(10), dim=0)
    ptr = buffer.data_ptr()
    for i in range(10, 40):
        buffer, view = append_to_buffer(buffer, view, torch.tensor([i]), dim=0)
    assert torch.equal(view, torch.arange(40)) and buffer.data_ptr() == ptr  # 40 < 64: no growth


@pytest.mark.parametrize("cls", [HostKV, OffloadStore])
def test_store_append_is_amortised_and_equals_a_concatenation(monkeypatch, cls):
    allocations = []
    real = storage.host_empty

    def counting(shape, dtype, pin):
        allocations.append(shape)
        return real(shape, dtype, pin)

    monkeypatch.setattr(storage, "host_empty", counting)
    k, v = torch.randn(3, 500, D), torch.randn(3, 500, D)
    store = HostKV.copy_of(k, v) if cls is HostKV else OffloadStore.copy_of(k, v, 0, "cpu", 4, 4)
    assert store.k_data.shape[1] < 2 * 500  # sized to the prompt (plus slack), not twice it
    start = len(allocations)
    ks, vs = [k], [v]
    n = 4000
    for _ in range(n):
        ks.append(torch.randn(3, 1, D))
        vs.append(torch.randn(3, 1, D))
        store.append(ks[-1], vs[-1])
    growths = (len(allocations) - start) // 2  # K and V grow together
    assert 1 <= growths <= 1 + np.log((500 + n) / 500) / np.log(9 / 8)
    assert torch.equal(store.keys(), torch.cat(ks, dim=1)) and torch.equal(store.values(), torch.cat(vs, dim=1))


def test_pqcache_appends_one_row_per_step_into_its_store():
    """PQCache's store stays one growable buffer (no per-token copy of the whole store) and holds every
    token's K/V, as a concatenation would."""
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(0))
    out, cache = generate_with(model, ids, 30, "pqcache", budget=24, n_sink=4)
    for st in cache.states:
        assert isinstance(st.store, HostKV) and st.store.n == st.n_seen == 80 + 29
        assert st.store.n <= st.store.k_data.shape[1] <= grown_capacity(st.store.n)  # sized to its content
        # the resident sinks and recent window equal the first and last stored rows
        window = st.k.shape[1] - 4
        assert torch.equal(st.store.keys()[:, :4], st.k[:, :4])
        assert torch.equal(st.store.keys()[:, -window:], st.k[:, 4:])
        assert torch.equal(st.store.values()[:, -window:], st.v[:, 4:])


# ------------------------------------------------------------------------------- bulk load
def test_bulk_load_copies_one_contiguous_transit_prefix(monkeypatch):
    k, v = torch.randn(2, 64, D), torch.randn(2, 64, D)
    store = OffloadStore.copy_of(k, v, first_pos=0, device="cpu", max_blocks=6, page_size=4)
    positions = np.array([[0, 1, 2, 3], [40, 41, -1, -1], [60, 5, 6, 7]])
    heads = np.array([1, 0, 1])
    prefix = store.transit_prefix(3)
    assert prefix.is_contiguous() and prefix.data_ptr() == store.transit.data_ptr()
    got_k, got_v = store.bulk_load(heads, positions)  # fewer pages than the transit buffer holds
    assert got_k.data_ptr() == store.transit.data_ptr()  # the packed prefix, all Ks then all Vs
    assert got_v.data_ptr() == got_k.data_ptr() + 3 * 4 * D * got_k.element_size()
    for b in range(3):
        ok = positions[b] >= 0
        torch.testing.assert_close(got_k[b][ok], k[heads[b], positions[b][ok]])
        torch.testing.assert_close(got_v[b][ok], v[heads[b], positions[b][ok]])
    assert got_k.shape == got_v.shape == (3, 4, D)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host-to-device copy needs CUDA")
def test_bulk_load_on_cuda_is_one_contiguous_copy(monkeypatch):  # pragma: no cover - GPU machines
    k, v = torch.randn(2, 64, D), torch.randn(2, 64, D)
    store = OffloadStore.copy_of(k, v, first_pos=0, device="cuda", max_blocks=6, page_size=4)
    copies = []
    real = torch.Tensor.copy_

    def spy(dst, src, non_blocking=False):
        copies.append((dst.is_cuda, src.is_cuda, dst.is_contiguous(), src.is_contiguous()))
        return real(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    got_k, _ = store.bulk_load(np.array([1, 0]), np.array([[0, 1, 2, 3], [9, 10, -1, -1]]))
    monkeypatch.undo()
    assert copies == [(True, False, True, True)]
    torch.testing.assert_close(got_k[0].cpu(), k[1, :4])


# ------------------------------------------------------------------------------ host syncs
SYNCS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")


class SyncCounter:
    """Counts calls of the tensor methods that force a device -> host sync on CUDA, per decode phase."""

    def __init__(self, monkeypatch, cache):
        self.calls: list[tuple[str, str]] = []
        self.cache, self.in_decode = cache, False
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        decode = cache.method.decode

        def counted_decode(*args, **kwargs):  # the whole step of one layer, accounting included
            self.in_decode = True
            try:
                return decode(*args, **kwargs)
            finally:
                self.in_decode = False
        replace_hook(cache.method, "decode", counted_decode)  # this test's own method object

    def _wrap(self, name, real):
        def counted(tensor, *args, **kwargs):
            if self.in_decode:
                self.calls.append((self.cache.timer.current or "between phases", name))
            return real(tensor, *args, **kwargs)
        return counted

    def outside(self, phase: str) -> list[tuple[str, str]]:
        return [c for c in self.calls if c[0] != phase]


def _decode(monkeypatch, method: str, budget: int, prompt: int = 150, steps: int = 40, **hp):
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    cache = make_cache(method, model, budget=budget, **hp)
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        cache.wait_background()
        counter = SyncCounter(monkeypatch, cache)
        for _ in range(steps):
            cache.begin_step()
            out = model(token, past_key_values=cache, use_cache=True)
            cache.end_step()
            token = out.logits[:, -1:].argmax(-1)
    monkeypatch.undo()
    cache.close()
    return cache, counter


@pytest.mark.parametrize("method", ["streaming_llm", "h2o", "snapkv_pinned"])
def test_one_token_eviction_reuses_the_leaving_slot_in_place(method):
    """StreamingLLM and H2O drop one token per step by moving the newest token into the leaving one's slot:
    after the first decode step the resident K/V stay views of the same buffers (no copy of the cache per
    step), every head keeps exactly ``budget`` tokens, and the kept positions are the method's (StreamingLLM:
    sinks + the most recent; H2O: the ``recent`` newest always among them; SnapKV (pinned): the observation
    window and the generated room, in order, after its prompt selection)."""
    model = build_tiny("tiny-llama", 2, 4)
    budget, prompt = 32, 100
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    cache = make_cache(method, model, budget=budget, **({"window_size": 8} if method == "snapkv_pinned" else {}))
    ptrs = set()
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True)
        for step in range(30):
            cache.begin_step()
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            cache.end_step()
            st = cache.states[2]
            if step:
                ptrs.add((st.k.data_ptr(), st.v.data_ptr(), st.pos.data_ptr()))
            n = st.n_seen
            kept = st.pos.sort(-1).values
            if method == "streaming_llm":
                assert kept.tolist() == list(range(4)) + list(range(n - budget + 4, n))
            elif method == "snapkv_pinned":
                newest = min(n - prompt, cache.method.room)  # the generated room slides, in order, at the end
                assert st.pos.shape[-1] == budget and (st.pos[:, -newest:] == torch.arange(n - newest, n)).all()
            else:
                recent = cache.method.recent_size
                assert kept.shape[-1] == budget and (kept[:, -recent:] == torch.arange(n - recent, n)).all()
    cache.close()
    assert len(ptrs) == 1


@pytest.mark.parametrize("method", ["icecache", "pqcache", "magicpig"])
def test_background_worker_exits_once_its_last_job_is_awaited(method, monkeypatch):
    """The prefill's background worker thread used to live until the end of the generation, with the OpenMP
    team its parallel work created; libgomp then counted more threads than cores and cut every team's spin-wait
    to ~1000 iterations, so each parallel op of the decode paid a thread wake-up (IceCache's and PQCache's
    ``other`` 10-40 ms per token above full's at 4k-8k on SmolLM2). After the first decode step none is left."""
    monkeypatch.setenv("ICECACHE_BACKGROUND", "thread")  # the worker thread (a CPU runs the jobs inline by default)
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = make_cache(method, model, budget=64)

    def workers():
        return [t for t in threading.enumerate() if t.name.startswith(f"{cache.method.name}_")]

    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True)
        assert workers(), "the prefill runs its jobs on a background worker"
        for _ in range(2):
            cache.begin_step()
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            cache.end_step()
            assert not workers() and cache.sequence.executor is None
    cache.close()


@pytest.mark.parametrize("method,budget", [("full", None), ("quest", 64), ("streaming_llm", 64), ("h2o", 64)])
def test_decode_step_issues_no_host_sync(monkeypatch, method, budget):
    cache, counter = _decode(monkeypatch, method, budget)
    assert counter.calls == []
    assert all(e is not None for e in cache.effective_tokens())


def test_quest_attended_count_from_shapes_equals_the_mask():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    _, cache = generate_with(model, ids, 8, "quest", budget=64, debug=True)
    method, st = cache.method, cache.states[3]
    pages = method.select(st, torch.randn(4, 1, 16))
    fetched = method.fetch(st, pages)
    n = st.k.shape[1]  # the current token (position n - 1) is not a past token; it is attended with its page
    current = ((pages[..., None] * 16 + torch.arange(16)) == n - 1).flatten(1).any(-1)  # [H_q]
    expected = (fetched.valid.sum(-1).float() - current.float()).mean()
    assert float(fetched.n_past) == pytest.approx(float(expected))


def test_icecache_decode_syncs_only_for_the_index(monkeypatch):
    """Outside the page selection (the index search moves the query to the host), IceCache's decode step
    copies only the evicted window page to the host, once per eviction (K and V in one copy) — no
    accounting ``.item()``, no second copy of the page for the index insert."""
    cache, counter = _decode(monkeypatch, "icecache", 64, page_size=8, n_dense_layers=2)
    budgeted = [s for s in cache.states if cache.method.is_budgeted(s)]
    assert budgeted and all(s.offloaded for s in budgeted)
    evictions = len(budgeted) * (40 // 8)  # one 8-token page leaves the window every 8 steps, per layer
    other = counter.outside("select")
    assert other == [("update", "cpu")] * len(other) and abs(len(other) - evictions) <= len(budgeted)
    effective = cache.effective_tokens()
    assert all(e <= 64 for s, e in zip(cache.states, effective) if cache.method.is_budgeted(s))


def test_icecache_host_count_of_attended_tokens_equals_the_mask():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    _, cache = generate_with(model, ids, 12, "icecache", budget=64, page_size=8)
    method, st = cache.method, cache.states[3]
    fetched = method.resident_kv(st)
    assert fetched.n_past == pytest.approx(float(fetched.valid.sum(-1).float().mean()) - 1)


# ------------------------------------------------------------------------- phase timing on CUDA
class FakeStream:
    """A device timeline: work queued on it finishes ``busy`` seconds after it was queued."""

    def __init__(self):
        self.now, self.syncs = 0.0, 0


class FakeEvent:
    def __init__(self, stream: FakeStream):
        self.stream, self.t = stream, None

    def record(self):
        self.t = self.stream.now

    def synchronize(self):
        self.stream.syncs += 1

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0


def test_event_timer_attributes_stream_time_per_phase_and_waits_once_per_step(monkeypatch):
    """With events the breakdown is the stream timeline between the span's events, resolved at the end
    of the step with one wait (no ``torch.cuda.synchronize`` inside the step); events are reused."""
    from icecache.kv.timing import PhaseTimer

    stream = FakeStream()
    made = []

    def factory():
        made.append(FakeEvent(stream))
        return made[-1]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("the event timer must not synchronise"))
    timer = PhaseTimer(event_factory=factory)
    for step in range(3):
        for phase, busy in (("select", 0.004), ("transfer", 0.001), ("attention", 0.002), ("update", 0.0005)):
            with timer.span(phase):
                assert timer.current == phase
                stream.now += busy
        stream.now += 0.010  # MLPs etc. between the spans: not attributed to any phase
        got = timer.reset()
        assert got == pytest.approx({"select": 0.004, "transfer": 0.001, "attention": 0.002, "update": 0.0005})
        assert stream.syncs == step + 1 and timer.current is None
    assert len(made) == 8  # one pair per span of the first step, reused afterwards


def test_cache_on_cuda_times_with_events_unless_profiling():
    from icecache.kv.timing import PhaseTimer

    assert PhaseTimer(device="cuda").use_events and not PhaseTimer(device="cpu").use_events
    assert not PhaseTimer(sync=True, device="cuda").use_events or not torch.cuda.is_available()


# ------------------------------------------------------------------------------ memory figures
def test_prefill_buffers_are_sized_to_the_prompt():
    model = build_tiny("tiny-llama", 2, 4)
    ids = torch.randint(0, model.config.vocab_size, (1, 500), generator=torch.Generator().manual_seed(0))
    _, cache = generate_with(model, ids, 4, "full")
    for st in cache.states:
        assert st.buffers["k"].shape[1] == st.buffers["v"].shape[1] == grown_capacity(500) < 2 * 500
        assert st.buffers["pos"].shape[0] == grown_capacity(500)
