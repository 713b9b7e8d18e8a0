"""The zero-GPU planner: memory per rank, communication, bubble, checkpoint interval and goodput, before submit.

`arith` holds the pure arithmetic (numbers and `ModelConfig` in, numbers out); `gate` runs the real
`parallelize()` on a fake process group and turns the figures into readiness checks; `search` ranks
every feasible mesh (`plan.search=true`).
"""

__all__ = ["arith", "gate", "search"]
