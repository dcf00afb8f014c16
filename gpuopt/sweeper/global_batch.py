"""Which configurations hold the baseline's global batch, known from their params before they run.

gpuopt's own task: the knob catalogue's GLOBAL_BATCH records (FACTOR keys multiply; a TOTAL key is
the global batch itself). An app: `hydra.sweeper.batch_keys`, the micro-batch first. Neither: no
rule (same training known only after the fact). Stored on the study (STUDY_BATCH_RULE) for the
seeding, the race and the summary."""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuopt.core import knobs
from gpuopt.core.errors import SweepConfigError
from gpuopt.study.keys import STUDY_BATCH_RULE

log = logging.getLogger("gpuopt.sweeper")

# The summary's hint to an app that declared no batch keys (the Lightning example's keys).
DECLARE_HINT = (
    "declare the keys whose product is your global batch, e.g. hydra.sweeper.batch_keys="
    "[data.batch_size,trainer.accumulate_grad_batches], and the sweep seeds, races and confirms "
    "(a) at it; without them (a) is read from the global batch each trial reports, after the fact"
)
MAX_COMBINATIONS = 4096  # assignments of the batch keys' choices tried (a categorical space's)


def _as_int(value: Any) -> int | None:
    """An int, or a string of digits (a fixed param: "128"); None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


@dataclass(frozen=True)
class BatchRule:
    """How a configuration's global batch follows from its keys (see the module docstring)."""

    factors: tuple[str, ...]  # their product is the global batch (the micro-batch first)
    total: str | None = None  # set, it is the global batch itself (gpuopt's train.global_batch)
    baseline: Mapping[str, Any] = field(default_factory=dict)  # the baseline's values of the keys

    @property
    def keys(self) -> tuple[str, ...]:
        return (*self.factors, self.total) if self.total else self.factors

    @property
    def micro(self) -> str:
        """The micro-batch's key: the one the memory axis and the overall seeds size."""
        return self.factors[0]

    def of(self, params: Mapping[str, Any]) -> int | None:
        """The global batch `params` sets over the baseline's values; None where a value is no integer
        or the micro-batches do not divide a TOTAL (it does not run)."""
        values = {**self.baseline, **{k: v for k, v in params.items() if k in self.keys}}
        product = 1
        for key in self.factors:
            if values.get(key) is None:
                continue  # not set here (distributed.nproc_per_node without distributed): 1
            factor = _as_int(values[key])
            if factor is None or factor < 1:
                return None
            product *= factor
        if self.total is None or values.get(self.total) is None:
            return product
        total = _as_int(values[self.total])
        return total if total is not None and total % product == 0 else None

    @property
    def held(self) -> int | None:
        """The baseline's global batch."""
        return self.of({})

    def holds(self, params: Mapping[str, Any]) -> bool:
        """Whether `params` train on the baseline's global batch."""
        batch = self.of(params)
        return batch is not None and batch == self.held

    def combinations(self, choices: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
        """Every assignment of the rule's searched keys that holds the baseline's global batch,
        the largest micro-batch first; the baseline's own among them."""
        searched = [k for k in self.keys if k in choices]
        if not searched or math.prod(len(choices[k]) for k in searched) > MAX_COMBINATIONS:
            return []
        found = [
            dict(zip(searched, values, strict=True))
            for values in itertools.product(*(choices[k] for k in searched))
        ]
        held = [p for p in found if self.holds(p)]
        return sorted(held, key=lambda p: -(_as_int({**self.baseline, **p}.get(self.micro)) or 0))

    def to_attr(self) -> dict[str, Any]:
        return {
            "factors": list(self.factors),
            "total": self.total,
            "baseline": dict(self.baseline),
        }

    @classmethod
    def from_attr(cls, value: Any) -> BatchRule | None:
        if not isinstance(value, Mapping) or not value.get("factors"):
            return None
        return cls(
            tuple(str(k) for k in value["factors"]),
            value.get("total"),
            dict(value.get("baseline") or {}),
        )


def keeps_training(rule: BatchRule, params: Mapping[str, Any], baseline: Mapping[str, Any]) -> bool:
    """Whether a configuration may be the same training as the baseline: its global batch, and no
    searched key that changes the learning rate or what is trained set otherwise."""
    if not rule.holds(params):
        return False
    for key, value in params.items():
        record = knobs.find(key)
        changes = record is not None and {knobs.LR, knobs.WHAT} & set(record.training)
        if changes and key not in rule.keys and baseline.get(key) != value:
            return False
    return True


def gpuopt_rule(baseline: Mapping[str, Any]) -> BatchRule:
    """gpuopt's own task's rule, from the knob catalogue; `baseline`: its keys' values."""
    total = knobs.batch_keys(knobs.TOTAL)
    return BatchRule(knobs.batch_keys(knobs.FACTOR), total[0] if total else None, dict(baseline))


_ABSENT = object()


def for_sweep(
    batch_keys: Sequence[str] | None,
    gpuopt_task: bool,
    config: Any,
    fixed: Mapping[str, Any],
    searched: Sequence[str] = (),
) -> BatchRule | None:
    """The sweep's rule (the app's `batch_keys`, else gpuopt's task's, else None) with the baseline's
    values. A declared key neither in the config nor searched is a SweepConfigError (a typo would
    make every configuration "hold" the global batch)."""
    from omegaconf import OmegaConf

    if not batch_keys and not gpuopt_task:  # the searched keys named like a batch and its steps
        from gpuopt.core.search_space import batch_keys_among

        batch_keys = batch_keys_among(searched)
        if batch_keys:
            log.info(
                "hydra.sweeper.batch_keys not set: %s (the searched keys named like a batch size "
                "and an accumulation count; set hydra.sweeper.batch_keys to name others)",
                batch_keys,
            )
    rule = BatchRule(tuple(batch_keys)) if batch_keys else gpuopt_rule({}) if gpuopt_task else None
    if rule is None:
        return None
    values = {}
    for key in rule.keys:
        value = OmegaConf.select(config, key, default=_ABSENT)
        if value is _ABSENT and key not in searched and key not in fixed and batch_keys:
            raise SweepConfigError(
                "hydra.sweeper.batch_keys",
                list(batch_keys),
                f"keys of the config ({key} is not one)",
            )
        values[key] = None if value is _ABSENT else value
    values.update({k: v for k, v in fixed.items() if k in rule.keys})
    return BatchRule(rule.factors, rule.total, values)


def read(study_attrs: Mapping[str, Any]) -> BatchRule | None:
    return BatchRule.from_attr(study_attrs.get(STUDY_BATCH_RULE))
