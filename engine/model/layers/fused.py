"""Fused projections: the linear layers a block applies to the same input (attention's q, k and v;
the MLP's gate and up) become one matmul over their concatenated weights in the engine's decode forwards.

Only decode forwards (one token per row) use it: prompt chunks are bound by the GPU's arithmetic, and
their memory (docs/memory.md) is left as it was. Why: on MLX's CUDA backend each matmul of B > 1 rows is
a cuBLAS call captured into a CUDA graph, with its own launch and tail; an 8B llama has 7 per layer.
Fused, it has 4 (qkv, o, gate-up, down), and the weights are read in the same bytes (docs/benchmarks.md).
vLLM's llama does the same (QKVParallelLinear, MergedColumnParallelLinear).

How, without copying mlx-lm's model code: `fuse_projections(model)` replaces, in every layer, the
`nn.Linear` modules of a group by `FusedPart`s that share one `FusedLinear` (the concatenated weight,
the only copy, registered once in the parameter tree as e.g. `self_attn.qkv_proj`). The engine's own
layer loops (engine/model/layers/decode_path.py, mixed.py, through bound.py) call the group's product
explicitly; a `FusedPart` called as a module (mlx-lm's code running the same model object, in the engine
or elsewhere) multiplies by its own rows of the weight, which is exactly the original layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
          ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"))


class FusedLinear(nn.Module):
    """The concatenated weight (and bias) of a group of linear layers applied to the same input."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.weight = mx.concatenate([lin.weight for lin in linears])  # [sum N_i, K]
        if "bias" in linears[0]:
            self.bias = mx.concatenate([lin.bias for lin in linears])
        bounds, start = [], 0
        for lin in linears:
            bounds.append((start, start + lin.weight.shape[0]))
            start += lin.weight.shape[0]
        self._bounds = _Bounds(tuple(bounds))

    def bounds(self, index: int) -> tuple[int, int]:
        """Rows [a, b) of the concatenated weight that are part `index`'s."""
        return self._bounds.rows[index]

    def __call__(self, x: mx.array) -> mx.array:
        """The whole product, every part's columns: x @ W^T (+ b)."""
        return mx.addmm(self.bias, x, self.weight.T) if "bias" in self else x @ self.weight.T

    def alone(self, index: int, x: mx.array) -> mx.array:
        """Part `index`'s own product, the original layer: x @ W_i^T (+ b_i), a contiguous array."""
        a, b = self.bounds(index)
        if "bias" in self:
            return mx.addmm(self.bias[a:b], x, self.weight[a:b].T)
        return x @ self.weight[a:b].T


class _Bounds:
    """The parts' row bounds of a FusedLinear (a plain object, so not part of MLX's parameter tree)."""

    def __init__(self, rows: tuple):
        self.rows = rows


class _Ref:
    """Holds the shared FusedLinear out of the parameter tree (it is registered once, on the block)."""

    def __init__(self, fused: FusedLinear):
        self.fused = fused


class FusedPart(nn.Module):
    """Stands where one of the group's nn.Linear layers was."""

    def __init__(self, fused: FusedLinear, index: int):
        super().__init__()
        self._ref = _Ref(fused)
        self._index = index

    @property
    def weight(self) -> mx.array:
        a, b = self._ref.fused.bounds(self._index)
        return self._ref.fused.weight[a:b]

    def __call__(self, x: mx.array) -> mx.array:
        return self._ref.fused.alone(self._index, x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every layer's groups (GROUPS) whose members are all plain nn.Linear of the same input size
    and bias; idempotent. Returns the number of fused groups the model has (fused now or before)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    fused = 0
    for layer in layers:
        for block_name, names, fused_name in GROUPS:
            block = getattr(layer, block_name, None)
            if block is None:
                continue
            if fused_name in block:
                fused += 1
                continue
            linears = [getattr(block, n, None) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue  # quantized or custom layers: left as they are
            if len({lin.weight.shape[1] for lin in linears}) != 1 or len({"bias" in lin for lin in linears}) != 1:
                continue
            group = FusedLinear(linears)
            mx.eval(group.parameters())
            block[fused_name] = group
            for i, n in enumerate(names):
                setattr(block, n, FusedPart(group, i))
            fused += 1
    return fused
