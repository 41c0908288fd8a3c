"""MatmulWorkspace: what a forward's matmuls allocate beside their products, by rows (no mlx import).

MLX's CUDA matmuls (0.32, gemms/cublas_gemm.cpp) let cuBLASLt's heuristics pick an algorithm with up to
32 MiB of workspace on Hopper (4 MiB before) and allocate what the chosen one needs through MLX's
allocator, as a temporary of the committed batch. At a few rows the heuristics pick split-K algorithms
whose workspace holds their float partial products: on an H200 the 8B llama's down projection asks some
70 KB a row up to 256 rows and its output projection 40 KB a row up to 48 (docs/memory_cuda.md). The
runner measures each of a layer's projections and the LM head at every decode row count when it starts
(engine/model/matmul_workspace.py); the memory model counts one layer's for every layer of a decode,
since these live and die with the decode's other temporaries and no fit of how many layers' coexist
covers them (MemoryModel.decode_phases).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MatmulWorkspace:
    """Bytes by rows (index r - 1 for r rows): `per_layer`, all of one layer's projections together
    (the largest over the model's layers); `head`, the LM head's. A row count past a table counts the
    table's largest. Empty: none measured (the CPU backend's matmuls allocate none)."""

    per_layer: tuple[int, ...] = ()
    head: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("per_layer", "head"):
            values = getattr(self, name)
            if any(not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"MatmulWorkspace.{name}: byte counts must be ints >= 0, got {values!r}")

    @staticmethod
    def _at(table: tuple[int, ...], rows: int) -> int:
        if not table or rows < 1:
            return 0
        return table[rows - 1] if rows <= len(table) else max(table)

    def layer_bytes(self, rows: int) -> int:
        """One layer's projections' workspace at `rows` rows."""
        return self._at(self.per_layer, rows)

    def head_bytes(self, rows: int) -> int:
        """The LM head's workspace at `rows` rows."""
        return self._at(self.head, rows)

    def __bool__(self) -> bool:
        return bool(self.per_layer or self.head)
