"""scripts/bench_memory_grid.py's parts: the grid's shapes and terms (shapes), its measurements (grids,
measure), the fits of its coefficients (fit, backend_fit, predict), replays of recorded prefill runs
(replay) and checks of recorded grids (checks)."""
