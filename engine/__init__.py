"""MLX inference engine: token-budgeted chunked-prefill scheduler, memory model and runner.

Nothing in this package imports ray (house rule): it is usable on its own.
"""
