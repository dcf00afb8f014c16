"""optimization_results.yaml: what hydra-optuna-sweeper writes at the end of a sweep, in its shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def stock_results(
    directions: Sequence[str], best_trials: Sequence[Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """optimization_results.yaml in hydra-optuna-sweeper's shape, plus gpuopt keys."""
    if len(directions) < 2:
        best = best_trials[0] if best_trials else None
        out: dict[str, Any] = {
            "name": "optuna",
            "best_params": dict(best.params) if best else {},
            "best_value": best.value if best else None,
        }
    else:
        out = {
            "name": "optuna",
            "solutions": [
                {"params": dict(t.params), "values": list(t.values)} for t in best_trials
            ],
        }
    out.update(extra)
    return out
