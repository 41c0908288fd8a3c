"""MatmulWorkspace: what a forward's matmuls allocate beside their products, by rows (no mlx import).

MLX's CUDA matmuls (0.32, gemms/cublas_gemm.cpp) let cuBLASLt's heuristics pick an algorithm with up to
32 MiB of workspace on Hopper (4 MiB on earlier architectures) and allocate what the chosen one needs
through MLX's allocator, as a temporary of the committed batch. At a few rows the heuristics pick split-K
algorithms whose workspace holds their float partial products: on an H200 the 8B llama's down projection
asks 279 KB at 4 rows, 3.2 MB at 64 and 8.4 MB at 256, its output projection up to 1.6 MB below 56 rows
(docs/memory_cuda.md). The runner measures each of a layer's projections and the LM head at every decode
row count when it starts (engine/model/matmul_workspace.py); the memory model counts one layer's for
every layer of a decode, since these live and die with the decode's other temporaries and no fit of how
many layers' coexist covers them (MemoryModel.decode_phases).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate


@dataclass(frozen=True)
class MatmulWorkspace:
    """Bytes by rows (index r - 1 for r rows): `per_layer`, all of one layer's projections together
    (the largest over the model's layers); `head`, the LM head's. Empty: none measured (the CPU
    backend's matmuls allocate none). Looked up as the most at that many rows or fewer: the heuristics'
    choice goes up and down with the rows (the 8B's output projection asks 803 KB at 24 rows, none at 25),
    and the scheduler relies on more rows never needing less memory (`_fit_decodes`, the bound)."""

    per_layer: tuple[int, ...] = ()
    head: tuple[int, ...] = ()
    _layer_most: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _head_most: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for name in ("per_layer", "head"):
            values = getattr(self, name)
            if any(not isinstance(v, int) or v < 0 for v in values):
                raise ValueError(f"MatmulWorkspace.{name}: byte counts must be ints >= 0, got {values!r}")
        object.__setattr__(self, "_layer_most", tuple(accumulate(self.per_layer, max)))
        object.__setattr__(self, "_head_most", tuple(accumulate(self.head, max)))

    @staticmethod
    def _at(most: tuple[int, ...], rows: int) -> int:
        if not most or rows < 1:
            return 0
        return most[min(rows, len(most)) - 1]

    def layer_bytes(self, rows: int) -> int:
        """One layer's projections' workspace at `rows` rows or fewer (the most of them)."""
        return self._at(self._layer_most, rows)

    def head_bytes(self, rows: int) -> int:
        """The LM head's workspace at `rows` rows or fewer (the most of them)."""
        return self._at(self._head_most, rows)

    def __bool__(self) -> bool:
        return bool(self.per_layer or self.head)
