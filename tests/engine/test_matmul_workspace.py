"""engine/model/matmul_workspace.py: what a decode's matmuls allocate beside their products, measured on
real MLX forwards (the CPU backend's matmuls allocate none; a product with an intermediate shows it)."""

from __future__ import annotations

import mlx.core as mx

from engine.core.memory.workspace import MatmulWorkspace
from engine.model import matmul_workspace
from engine.model.runner import ModelRunner


def test_by_rows_measures_what_a_product_allocates_beside_its_result():
    w = mx.random.normal((256, 128), key=mx.random.key(0))
    mx.eval(w)
    doubled = matmul_workspace.by_rows([(lambda x: (x * 2) @ w.T, 128)], 4, mx.float32)
    plain = matmul_workspace.by_rows([(lambda x: x @ w.T, 128)], 4, mx.float32)
    for rows, (a, b) in enumerate(zip(doubled, plain), start=1):
        assert a >= rows * 128 * 4  # the intermediate x * 2, float32
        assert a > b
    both = matmul_workspace.by_rows([(lambda x: (x * 2) @ w.T, 128)] * 2, 4, mx.float32)
    assert all(t >= 2 * rows * 128 * 4 for rows, t in enumerate(both, start=1))  # a layer's products added


def test_the_runner_measures_its_decode_projections_and_head_at_every_row_count(tiny_parts):
    model = tiny_parts[0]
    for loops in (True, False):  # the engine's decode loop's fused projections, or mlx-lm's modules
        runner = ModelRunner(model, block_size=4, layer_loops=loops)
        ws = matmul_workspace.of_runner(runner, 5)
        assert isinstance(ws, MatmulWorkspace)
        assert len(ws.per_layer) == len(ws.head) == 5
        assert all(isinstance(v, int) and v >= 0 for v in ws.per_layer + ws.head)


def test_the_cpu_engine_measures_none(make_engine):
    """MLX's CPU matmuls write their product only: the engine does not measure there, and its memory model
    counts no workspace."""
    engine = make_engine()
    assert not engine.memory.matmul_workspace
