"""Expert seeds: the configurations a performance engineer would try right after the baseline.

A sampler starts blind (TPE's first trials are random). The baseline measured the loader's and
compute's cost per sample, the usable cores and what bounds the machine; from those a few
configurations are enqueued: cores split between loader and compute in proportion to their
costs, the largest micro-batches the space holds, native low precision and pinned memory. Those
change the global batch (answer (b), docs/same-training.md); answer (a) is looked for too:
same-training seeds, and SAME_SHARE of the trials with only the batch keys held.

Pure: facts in, a list of param dicts out (tests/test_seeding.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuopt.core import knobs
from gpuopt.sweeper.global_batch import BatchRule

WORKERS, THREADS, BATCH = knobs.WORKERS.key, knobs.THREADS.key, knobs.MICRO_BATCH.key
PRECISION, PIN_MEMORY = knobs.PRECISION.group, knobs.PIN_MEMORY.key  # the group presets search
LOW_PRECISION = "bf16"
DRIVER_CORES = 1  # as gpuopt.core.limits: the core that drives an accelerator does not load
MAX_SEEDS = 4  # of the default 10 trials: the baseline, 4 seeds, 2 same-training seeds, 3 more
MAX_SAME_SEEDS = 2  # same-training seeds: the baseline's global batch, the core splits
# The share of the sampler's trials enqueued at the baseline's global batch (batch keys fixed, the
# rest the sampler's): the default 10-trial sweep has 3 trials left after its seeds, 1 of them.
SAME_SHARE = 1 / 3
# A loader needing less of a core than this is also tried without workers: a worker process then
# idles most of a core the compute could use (measured: benchmarks/grid_cpu_cnn.json, where the
# optimum loads inline at a loader share of 0.36; docs/benchmarks.md, "Search efficiency").
INLINE_SHARE = 0.5


@dataclass(frozen=True)
class SeedFacts:
    """What the baseline trial and the env probe know about this workload on this machine."""

    device_type: str  # cpu | cuda | mps
    cores: int  # usable CPU cores
    loader_cost_us: float | None = None  # core-microseconds per sample of the input pipeline
    compute_cost_us: float | None = None  # CPU: core-microseconds per sample of the step
    ceiling_throughput: float | None = None  # accelerator: the compute ceiling, samples/s
    limit_bound: str | None = None  # cores | loader | compute (gpuopt.core.limits)
    native_low_precision: bool = False  # bf16 runs natively here (the env probe's capability)


@dataclass(frozen=True)
class Seed:
    """One configuration to enqueue, and why an engineer would try it."""

    params: dict[str, Any]
    why: str
    partial: bool = False  # only the batch keys fixed: the sampler chooses the rest


def loader_share(facts: SeedFacts) -> float | None:
    """Cores the input pipeline needs: CPU, its share of the cores by cost; accelerator, the cores
    that load as fast as the device computes. None without a measured loader cost."""
    loader = facts.loader_cost_us
    if not loader or loader <= 0:
        return None
    if facts.device_type == "cpu":
        compute = facts.compute_cost_us
        if not compute or compute <= 0:
            return None
        return facts.cores * loader / (loader + compute)
    loading = max(1, facts.cores - DRIVER_CORES)
    if facts.limit_bound == "loader" or not facts.ceiling_throughput:
        return float(loading)
    return min(float(loading), facts.ceiling_throughput * loader / 1e6)


def core_splits(facts: SeedFacts) -> list[tuple[int, int | None]]:
    """(workers, compute threads) to seed, best guess first; threads None on an accelerator. CPU:
    threads get the cores the loader leaves whole (an OpenMP thread sharing a core with a worker
    stalls the team at every barrier); a loader under INLINE_SHARE of a core is tried inline."""
    share = loader_share(facts)
    if share is None:
        return []
    workers = max(1, math.ceil(share - 1e-9))
    if facts.device_type != "cpu":
        return [(workers, None), (workers + 1, None)]
    threads = max(1, math.floor(facts.cores - share + 1e-9))
    other = (0, facts.cores) if share < INLINE_SHARE else (workers + 1, threads)
    return [(workers, threads), other]


def snap(value: Any, choices: Sequence[Any], down: bool = False) -> Any:
    """The choice nearest `value` (log scale for positive numbers); `down`: the largest choice not
    above it (the smallest choice when every one is above). Non-numbers must match exactly."""
    numbers = [c for c in choices if isinstance(c, (int, float)) and not isinstance(c, bool)]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not numbers:
        return value if value in choices else None
    if down:
        below = [c for c in numbers if c <= value]
        return max(below) if below else min(numbers)

    def distance(c: float) -> float:
        if value > 0 and c > 0:
            return abs(math.log(c / value))
        return abs(c - value) + (0.0 if c > 0 else 1e-3)  # ties: prefer the positive choice

    return min(numbers, key=distance)


def _batches(choices: Sequence[Any]) -> list[Any]:
    ordered = sorted(c for c in choices if isinstance(c, int) and not isinstance(c, bool))
    return ordered[-2:][::-1]  # the largest, then the one below it


def common_params(
    facts: SeedFacts, space: Mapping[str, Sequence[Any]], baseline: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """What every seed shares: the baseline's values, with native low precision and (on an
    accelerator) pinned memory where the space holds them; and the reasons."""
    params = {k: v for k, v in baseline.items() if k in space}
    why: list[str] = []
    if facts.native_low_precision and LOW_PRECISION in space.get(PRECISION, ()):
        params[PRECISION] = LOW_PRECISION
        why.append("native bf16")
    if facts.device_type != "cpu" and True in space.get(PIN_MEMORY, ()):
        params[PIN_MEMORY] = True
        why.append("pinned memory")
    return params, why


def as_run(
    facts: SeedFacts, space: Mapping[str, Sequence[Any]], baseline: Mapping[str, Any]
) -> dict[str, Any]:
    """The baseline as it ran: a CPU baseline that leaves the threads unset ran PyTorch's default
    (one per core), so a seed that only spells that out is the baseline again."""
    ran = dict(baseline)
    if facts.device_type == "cpu" and THREADS in space and THREADS not in ran:
        ran[THREADS] = snap(facts.cores, space[THREADS], down=True)
    return ran


def _space_splits(facts: SeedFacts, space: Mapping[str, Sequence[Any]]) -> list[tuple[Any, Any]]:
    """The core splits snapped to the space's choices, best guess first; [(None, None)] where
    there is none to seed (no measured costs, or neither key searched)."""
    if not core_splits(facts) or (WORKERS not in space and THREADS not in space):
        return [(None, None)]
    return list(
        dict.fromkeys(
            (
                snap(w, space[WORKERS]) if WORKERS in space else None,
                snap(t, space[THREADS], down=True) if t and THREADS in space else None,
            )
            for w, t in core_splits(facts)
        )
    )


def _seed(base: dict[str, Any], why: list[str], split: tuple[Any, Any], index: int) -> Seed:
    """`base` with a core split set, and why."""
    params, why = dict(base), list(why)
    workers, threads = split
    if workers is not None:
        params[WORKERS] = workers
        why.append(f"{workers} workers" + (" (the alternative split)" if index else ""))
    if threads is not None:
        params[THREADS] = threads
        why.append(f"{threads} threads")
    return Seed(params, ", ".join(why))


def expert_seeds(
    facts: SeedFacts,
    space: Mapping[str, Sequence[Any]],
    baseline: Mapping[str, Any],
    rule: BatchRule | None = None,
) -> list[Seed]:
    """Up to MAX_SEEDS configurations (the space's keys and choices), each different from the
    baseline and from each other. `rule`: which key is the micro-batch and which sizes run."""
    common, why_common = common_params(facts, space, baseline)
    micro = rule.micro if rule is not None else BATCH
    sizes = _batches([b for b in space.get(micro, ()) if rule is None or rule.of({micro: b})])
    batches = sizes or [None]
    seeds: list[Seed] = []
    seen = [dict(baseline), as_run(facts, space, baseline)]
    for batch in batches:
        base, why = dict(common), list(why_common)
        if batch is not None:
            base[micro] = batch
            why.append(f"batch {batch} (largest{'' if batch == batches[0] else ' but one'})")
        for index, split in enumerate(_space_splits(facts, space)):
            seed = _seed(base, why, split, index)
            if seed.params not in seen:
                seen.append(seed.params)
                seeds.append(seed)
    return seeds[:MAX_SEEDS]


def _held_assignments(
    rule: BatchRule, space: Mapping[str, Sequence[Any]], baseline: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The assignments of the searched batch keys that hold the baseline's global batch: the
    largest micro-batch first, the baseline's own next; [] when no batch key is searched."""
    found = rule.combinations(space)  # the largest micro-batch first
    own = [c for c in found if all(baseline.get(k) == v for k, v in c.items())]
    if not own:
        return found
    larger = found[: found.index(own[0])]  # fewer accumulation steps than the baseline's
    return [*larger[:1], *own, *larger[1:], *found[found.index(own[0]) + 1 :]]


def same_training_seeds(
    facts: SeedFacts,
    space: Mapping[str, Sequence[Any]],
    baseline: Mapping[str, Any],
    rule: BatchRule,
    taken: Sequence[Mapping[str, Any]] = (),
) -> list[Seed]:
    """Up to MAX_SAME_SEEDS configurations at the baseline's global batch, none equal to the
    baseline, its default threads or one of `taken`."""
    common, why_common = common_params(facts, space, baseline)
    held = _held_assignments(rule, space, baseline)
    seen = [dict(baseline), as_run(facts, space, baseline), *map(dict, taken)]
    seeds: list[Seed] = []
    for index, split in enumerate(_space_splits(facts, space)):
        for assignment in held:
            shown = " ".join(f"{k}={v}" for k, v in assignment.items())
            why = [f"same training (global batch {rule.held} held: {shown})"]
            seed = _seed({**common, **assignment}, why + why_common, split, index)
            if seed.params not in seen:
                seen.append(seed.params)
                seeds.append(seed)
    return seeds[:MAX_SAME_SEEDS]


def held_batch_trials(
    space: Mapping[str, Sequence[Any]], baseline: Mapping[str, Any], rule: BatchRule, count: int
) -> list[Seed]:
    """`count` trials with only the batch keys fixed at a held assignment (cycling through them,
    the baseline's own micro-batch first): the sampler chooses every other knob."""
    held = _held_assignments(rule, space, baseline)
    own = [c for c in held if all(baseline.get(k) == v for k, v in c.items())]
    cycle = [*own, *(c for c in held if c not in own)]
    why = f"same training (global batch {rule.held} held; the sampler chooses the rest)"
    return [Seed(dict(cycle[i % len(cycle)]), why, True) for i in range(count)] if cycle else []


def plan_seeds(
    facts: SeedFacts,
    space: Mapping[str, Sequence[Any]],
    baseline: Mapping[str, Any],
    rule: BatchRule | None,
    room: int | None = None,
) -> list[Seed]:
    """What is enqueued after the baseline, in order (a study with little room keeps the first): two
    overall seeds, the same-training seeds, the other overall seeds, then SAME_SHARE held batches."""
    overall = expert_seeds(facts, space, baseline, rule=rule)
    if rule is None:
        return overall[:room]
    same = same_training_seeds(facts, space, baseline, rule, [s.params for s in overall])
    seeds = [*overall[:2], *same, *overall[2:]][:room]
    left = 0 if room is None else room - len(seeds)
    return seeds + held_batch_trials(space, baseline, rule, math.ceil(SAME_SHARE * left - 1e-9))


def describe_split(facts: SeedFacts) -> str:
    """The reasoning behind the split, for the log."""
    share = loader_share(facts)
    if share is None:
        return "no measured loader/compute costs: seeds from the space only"
    if facts.device_type == "cpu":
        return (
            f"loader {facts.loader_cost_us:.0f} us/sample, compute {facts.compute_cost_us:.0f} "
            f"us/sample on {facts.cores} cores: the loader needs {share:.2f} of them"
        )
    return (
        f"loader {facts.loader_cost_us:.0f} us/sample feeding {facts.ceiling_throughput or 0:.0f} "
        f"samples/s ({facts.limit_bound or 'compute'}-bound): {share:.2f} loading cores"
    )
