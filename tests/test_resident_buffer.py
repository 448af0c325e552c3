"""IceCache's resident buffer and page table (icecache/resident.py) against a plain list model: after random
sequences of append / evict / assign + load / stale operations, the attended positions, the mask and the
K/V in the buffer equal what an explicit per-head list of (sink, slots, window) says."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from icecache.offload import OffloadStore
from icecache.resident import ResidentBuffer

H, D, S = 3, 8, 4


class ListModel:
    """The resident set as plain Python lists: sink positions, per head per slot a page id (or None) with
    its positions, the window positions in order."""

    def __init__(self, n_sink, n_slots, window):
        self.sink = list(range(n_sink))
        self.slots = [[None] * n_slots for _ in range(H)]
        self.tokens = [[[] for _ in range(n_slots)] for _ in range(H)]
        self.window = list(window)

    def assign(self, selection, table):
        loads = []
        for h in range(H):
            want = [p for p in selection[h] if p >= 0]
            for w, p in enumerate(self.slots[h]):
                if p is not None and p not in want:
                    self.slots[h][w], self.tokens[h][w] = None, []
            for p in want:
                if p in self.slots[h]:
                    continue
                w = self.slots[h].index(None)
                self.slots[h][w] = p
                self.tokens[h][w] = [t for t in table[h, p] if t >= 0]
                loads.append((h, p, w))
        return loads

    def stale(self, changed):
        for h in range(H):
            for w, p in enumerate(self.slots[h]):
                if p is not None and changed[h, p]:
                    self.slots[h][w], self.tokens[h][w] = None, []

    def attended(self, h):
        return sorted(self.sink + [t for ts in self.tokens[h] for t in ts] + self.window)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_list_model(seed):
    rng = np.random.default_rng(seed)
    n_sink, n_slots, n_window = S * int(rng.integers(0, 3)), int(rng.integers(1, 5)), 2
    total = 400
    keys, values = torch.randn(H, total, D), torch.randn(H, total, D)
    n0 = 60 + int(rng.integers(0, 20))
    w0 = (-(-n0 // S) - n_window) * S
    buf = ResidentBuffer(keys[:, :n0], values[:, :n0], n_sink, n_slots, S, n_window, w0)
    store = OffloadStore.copy_of(keys[:, n_sink:w0], values[:, n_sink:w0], n_sink, "cpu", H * n_slots, S)
    model = ListModel(n_sink, n_slots, range(w0, n0))
    n_pages = 12
    table = np.full((H, n_pages, S), -1, dtype=np.int64)

    def new_table():  # random pages of stored positions, under-filled pages padded at the end
        table[:] = -1
        for h in range(H):
            for p in range(n_pages):
                used = int(rng.integers(1, S + 1))
                table[h, p, :used] = rng.choice(np.arange(store.first_pos, store.end_pos), used, replace=False)

    new_table()
    n = n0
    for _ in range(120):
        op = rng.integers(0, 4)
        if op == 0 and n < total:  # a new token (evicting the oldest window page when full)
            if buf.window_full():
                k, v, positions = buf.evict_oldest_window_page()
                assert positions.tolist() == model.window[:S]
                torch.testing.assert_close(k, keys[:, positions])
                torch.testing.assert_close(v, values[:, positions])
                store.append(k, v)
                model.window = model.window[S:]
            buf.append(keys[:, n:n + 1], values[:, n:n + 1])
            model.window.append(n)
            n += 1
        elif op == 1:  # a selection: distinct pages per head, -1 padded
            width = int(rng.integers(1, n_slots + 1))
            selection = np.full((H, n_slots), -1, dtype=np.int64)
            for h in range(H):
                selection[h, :width] = rng.choice(n_pages, width, replace=False)
            expected = model.assign(selection, table)
            heads, pages, slots = buf.assign_slots(selection)
            assert list(zip(heads.tolist(), pages.tolist(), slots.tolist())) == expected
            moved = buf.load_pages(table, heads, pages, slots, store) if heads.size else 0
            assert moved == 2 * len(expected) * S * D * 4
            buf.refresh_mask()
        elif op == 2:  # an insert changed some pages
            changed = rng.random((H, n_pages)) < 0.2
            buf.mark_stale(changed)
            model.stale(changed)
            buf.refresh_mask()
        else:  # the index re-laid out its pages (only what is loaded from now on changes)
            new_table()
        attended = buf.attended_positions()
        assert buf.n_past() == pytest.approx(np.mean([len(model.attended(h)) for h in range(H)]) - 1)
        for h in range(H):
            got = attended[h]
            assert sorted(got[got >= 0].tolist()) == model.attended(h)
            assert torch.equal(buf.valid[h], got >= 0)
            ok = got >= 0
            torch.testing.assert_close(buf.k[h, ok], keys[h, got[ok]])
            torch.testing.assert_close(buf.v[h, ok], values[h, got[ok]])
        assert buf.resident_tokens() == n_sink + n_slots * S + len(model.window)


def test_load_outside_the_store_raises():
    keys = torch.randn(H, 40, D)
    buf = ResidentBuffer(keys, keys, S, 2, S, 2, 32)
    store = OffloadStore.copy_of(keys[:, S:32], keys[:, S:32], S, "cpu", H * 2, S)
    table = np.full((H, 1, S), 35, dtype=np.int64)  # position 35 is in the window, not in the store
    heads, pages, slots = buf.assign_slots(np.zeros((H, 1), dtype=np.int64))
    with pytest.raises(IndexError, match="not all in the offload store"):
        buf.load_pages(table, heads, pages, slots, store)


def test_bf16_buffers_are_copied_bytewise():
    keys = torch.randn(H, 40, D).bfloat16()
    buf = ResidentBuffer(keys, keys, S, 2, S, 2, 32)
    store = OffloadStore.copy_of(keys[:, S:32], keys[:, S:32], S, "cpu", H * 2, S)
    table = np.arange(S, S + 2 * S).reshape(1, 2, S).repeat(H, 0)
    heads, pages, slots = buf.assign_slots(np.array([[0, 1]] * H))
    buf.load_pages(table, heads, pages, slots, store)
    for h in range(H):
        assert torch.equal(buf.slot_k[h].reshape(-1, D), keys[h, S:3 * S])
