"""ModelRunner: the only place that runs the model (mlx, mlx-lm modules).

Takes plain data from the scheduler (which rows compute which tokens) and returns sampled token ids.
- Prefill: one forward per row and chunk, evaluated before the next row's, so a step's transient is
  the largest single chunk's, never their sum. Only the prompt's last position reaches the LM head.
- Decode: every decoding row in one batched forward (`DecodeView`), one token each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.kv import DecodeView, RowKV
from engine.sampling import RequestSampler, sample_rows


@dataclass(frozen=True)
class PrefillWork:
    """Compute `token_ids` of one row at positions [start, start + len); sample if it ends the prompt."""

    request_id: str
    token_ids: list[int]
    start: int
    sample: bool


@dataclass(frozen=True)
class DecodeWork:
    request_id: str
    token_id: int  # the last sampled token, fed back


def _split_model(model: nn.Module):
    """(backbone, head) for mlx-lm models shaped Model(model=backbone, lm_head | tied embeddings)."""
    backbone = getattr(model, "model", None)
    if backbone is None or not hasattr(backbone, "layers"):
        raise ValueError(f"unsupported model {type(model).__name__}: expected model.model.layers")
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        head = backbone.embed_tokens.as_linear
    else:
        head = model.lm_head
    return backbone, head


def check_plain_kv_cache(model: nn.Module) -> None:
    """The runner stores KV per row; models whose cache is not a plain KVCache are refused."""
    if hasattr(model, "make_cache"):
        kinds = {type(c).__name__ for c in model.make_cache()}
        if kinds != {"KVCache"}:
            raise ValueError(f"model cache types {sorted(kinds)} are not supported (need KVCache only)")


class ModelRunner:
    def __init__(self, model: nn.Module, seed: int = 0):
        check_plain_kv_cache(model)
        self.model = model
        self._backbone, self._head = _split_model(model)
        self.num_layers = len(self._backbone.layers)
        attention = self._backbone.layers[0].self_attn
        self._kv_heads = attention.n_kv_heads
        self._head_dim = getattr(attention, "head_dim", None) or model.args.hidden_size // attention.n_heads
        proj = attention.k_proj  # quantized layers keep their float dtype in `scales`
        self._kv_dtype = proj.scales.dtype if hasattr(proj, "scales") else proj.weight.dtype
        self.seed = seed
        self.rows: dict[str, RowKV] = {}
        self.samplers: dict[str, RequestSampler] = {}
        self.num_forward_calls = 0  # counted so tests can check decode is one forward per step
        self.num_tokens_computed = 0

    # --- rows -----------------------------------------------------------------------------------
    def add_row(self, request_id: str, capacity: int, sampler: RequestSampler) -> None:
        self.rows[request_id] = RowKV(self.num_layers, capacity, self._kv_heads, self._head_dim,
                                      self._kv_dtype)
        self.samplers[request_id] = sampler

    def free_row(self, request_id: str) -> Optional[RowKV]:
        """Forget the row; returns its KV (the prefix cache may keep it)."""
        self.samplers.pop(request_id, None)
        return self.rows.pop(request_id, None)

    def copy_prefix(self, request_id: str, source: RowKV, num_tokens: int) -> None:
        """Start the row with the first `num_tokens` positions of `source`'s KV (a prefix-cache hit)."""
        row = self.rows[request_id]
        for dst, src in ((row.keys, source.keys), (row.values, source.values)):
            for layer in range(self.num_layers):
                dst[layer][..., :num_tokens, :] = src[layer][..., :num_tokens, :]  # [1, H_kv, n, D]
        mx.eval(row.arrays())
        row.offset = num_tokens

    @property
    def kv_used_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows.values())

    # --- compute --------------------------------------------------------------------------------
    def _forward(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens [B, T] -> final hidden states [B, T, D] (no LM head)."""
        self.num_forward_calls += 1
        self.num_tokens_computed += tokens.size
        return self._backbone(tokens, cache=cache)

    def prefill(self, work: PrefillWork) -> Optional[int]:
        row = self.rows[work.request_id]
        if row.offset != work.start:
            raise RuntimeError(f"{work.request_id}: KV holds {row.offset} tokens, chunk starts at {work.start}")
        hidden = self._forward(mx.array(work.token_ids)[None], row.layers())  # [1, T, D]
        if not work.sample:
            mx.eval(row.arrays())
            row.advance()
            return None
        logits = self._head(hidden[:, -1:, :])[:, 0, :]  # [1, V]: the prompt's last position only
        token = sample_rows(logits, [self.samplers[work.request_id]])[0]
        row.advance()
        return token

    def decode(self, work: list[DecodeWork]) -> list[int]:
        if not work:
            return []
        view = DecodeView([self.rows[w.request_id] for w in work])
        tokens = mx.array([w.token_id for w in work])[:, None]  # [B, 1]
        hidden = self._forward(tokens, view.layers())  # [B, 1, D]
        logits = self._head(hidden)[:, 0, :]  # [B, V]
        sampled = sample_rows(logits, [self.samplers[w.request_id] for w in work])
        view.advance()
        return sampled
