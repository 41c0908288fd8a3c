"""Measure what MLX's matmuls allocate beside their products, by rows: cuBLASLt's workspace on CUDA.

engine/core/memory/workspace.py says why the memory model needs it. `of_runner` measures the projections
a runner's decode forward calls, layer by layer (one measure per distinct set of weight shapes), and the
LM head, at every row count a decode can have, once when the engine starts: each product on zeros,
evaluated alone, MLX's peak over what was alive before less the product (0.04-0.09 s for an 8B model at
16 rows on an H200: a few milliseconds a row count, so a `max_num_seqs` in the thousands adds seconds to
the start). The engine measures on every GPU backend (CUDA; Metal's matmuls too, if they allocate any);
the CPU backend's matmuls write their product only: nothing to measure there.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.core.memory.workspace import MatmulWorkspace

logger = logging.getLogger(__name__)

# (the product's function, its input's last dimension)
Product = tuple[Callable[[mx.array], mx.array], int]


def allocated_beside(fn: Callable[[mx.array], mx.array], x: mx.array) -> int:
    """Bytes `fn(x)` allocates beside its result while it runs: MLX's peak over what was alive before,
    less the result (x evaluated already)."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    y = fn(x)
    mx.eval(y)
    mx.synchronize()
    return max(0, mx.get_peak_memory() - base - y.nbytes)


def by_rows(products: Sequence[Product], max_rows: int, dtype) -> tuple[int, ...]:
    """The bytes `products` allocate beside their results, added up, for each row count 1..max_rows (an
    input [r, 1, K], as a decode's). Each product runs once on a new shape before it is measured: a first
    call may set up what later ones reuse."""
    out = []
    for rows in range(1, max_rows + 1):
        total = 0
        for fn, k in products:
            x = mx.zeros((rows, 1, k), dtype)
            mx.eval(x)
            mx.eval(fn(x))
            total += allocated_beside(fn, x)
        out.append(total)
    return tuple(out)


def _module_products(layer: nn.Module) -> list[Product]:
    """A block's linear layers as mlx-lm's module forward calls them."""
    products = []
    for _, m in layer.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            products.append((m, m.weight.shape[-1] * 32 // m.bits))
        elif isinstance(m, nn.Linear):
            products.append((m, m.weight.shape[-1]))
    return products


def _bound_products(layer) -> list[Product]:
    """A bound layer's projections as the engine's decode loop calls them (fused q/k/v and gate/up; a
    sparse MLP's router; its experts' gathered products are not measured)."""
    projections = [p for p in (layer.qkv, layer.o, layer.gate_up, layer.down) if p is not None]
    if layer.moe is not None:
        projections.append(layer.moe.router)
    return [(p, p.weight_t.shape[0]) for p in projections]


def probe(layers: Sequence, head: Callable[[mx.array], mx.array], hidden_size: int, max_rows: int, dtype,
          bound: bool) -> MatmulWorkspace:
    """The workspace table of a model whose decode calls `layers`' projections (`bound`: BoundLayers of the
    engine's decode loop, else mlx-lm's blocks) and `head` ([r, 1, D] -> logits), for 1..max_rows rows."""
    start = time.perf_counter()
    distinct = {}
    for layer in layers:
        products = _bound_products(layer) if bound else _module_products(layer)
        key = tuple((k, tuple(_weight_shape(fn))) for fn, k in products)
        distinct.setdefault(key, products)
    tables = [by_rows(products, max_rows, dtype) for products in distinct.values()]
    per_layer = tuple(max(t[r] for t in tables) for r in range(max_rows)) if tables else ()
    result = MatmulWorkspace(per_layer, by_rows([(head, hidden_size)], max_rows, dtype))
    mx.clear_cache()
    logger.info("matmul workspace: %d layer shape(s) and the head at 1-%d rows in %.2f s: at most %d bytes a "
                "layer, %d the head", len(tables), max_rows, time.perf_counter() - start,
                max(result.per_layer, default=0), max(result.head, default=0))
    return result


def of_runner(runner, max_rows: int) -> MatmulWorkspace:
    """What `runner`'s decode forward (engine/model/runner.py: the engine's decode loop, else mlx-lm's
    modules) allocates beside its matmuls' products at 1..max_rows rows."""
    bound = runner.decode_path is not None
    backbone = runner.layout.backbone
    layers = runner.decode_path.layers if bound else backbone.layers
    hidden = backbone.layers[0].input_layernorm.weight.shape[-1]
    return probe(layers, runner.layout.head, hidden, max_rows, runner.layout.kv_dtype, bound)


def _weight_shape(fn) -> tuple:
    weight = getattr(fn, "weight_t", None)
    if weight is None:
        weight = getattr(fn, "weight", None)
    return tuple(weight.shape) if weight is not None else ()
