"""The attention kernels every method shares.

Shapes (batch 1, squeezed): queries ``[H_q, n, d]``, keys/values ``[H, m, d]`` where ``H`` is the head
axis of a *selection*: 1 (one token set shared by all heads, OmniKV), ``H_kv`` (one set per KV head,
shared by its GQA group) or ``H_q`` (one set per query head). :func:`attend` handles all three.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional GPU extra: `pip install .[gpu]`
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - CPU machines
    flash_attn_func = None


def expand_heads(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """Repeats a ``[H, ...]`` tensor to ``[H_q, ...]`` (query head i reads head i // (H_q / H))."""
    h = x.shape[0]
    if h == n_q_heads:
        return x
    if n_q_heads % h:
        raise ValueError(f"head axis {h} does not divide the {n_q_heads} query heads")
    return x.repeat_interleave(n_q_heads // h, dim=0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Exact causal attention of ``n`` queries over ``n`` keys, never materialising an n x n matrix:
    flash-attn on CUDA when installed, else PyTorch sdpa (whose CPU kernel is a flash-style kernel)."""
    if flash_attn_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = flash_attn_func(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                              softmax_scale=scaling, causal=True)
        return out[0].transpose(0, 1)
    n_q = q.shape[0]
    return F.scaled_dot_product_attention(q[None], expand_heads(k, n_q)[None], expand_heads(v, n_q)[None],
                                          is_causal=True, scale=scaling)[0]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the current queries ``[H_q, n, d]`` over a selection ``k, v: [H, m, d]`` with ``H`` in
    {1, H_kv, H_q}. ``valid`` (``[H, m]`` bool) masks empty slots (e.g. IceCache's under-filled pages).

    Query head i reads head i // (H_q / H). The group's queries are folded into the query axis of their
    shared head, so keys and values are never copied per query head."""
    n_q, n, d = q.shape
    h = k.shape[0]
    if n_q % h:
        raise ValueError(f"head axis {h} does not divide the {n_q} query heads")
    grouped = q.reshape(h, (n_q // h) * n, d)
    mask = None if valid is None else valid[:, None, :]  # [H, 1, m], broadcast over the group's queries
    out = F.scaled_dot_product_attention(grouped[None], k[None], v[None],
                                         attn_mask=None if mask is None else mask[None], scale=scaling)[0]
    return out.reshape(n_q, n, d)


def attention_logits(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """Scaled scores ``[H_q, n, m]`` in fp32 of queries over keys with ``H`` in {1, H_kv, H_q} heads."""
    return torch.matmul(q.float(), expand_heads(k, q.shape[0]).float().transpose(-1, -2)) * scaling
