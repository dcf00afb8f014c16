"""Batches of any structure (`move_batch`, `batch_samples`), gpuopt's DataLoader whose one epoch
lasts the whole trial (`build_loader`), and `BatchFeed`, the endless feed of a trial's loop.
torch is imported inside functions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gpuopt.core.spec import TrialSpec
from gpuopt.engines._window import InputWait

if TYPE_CHECKING:
    import torch

    from gpuopt.trial.context import Trial

# Batches beyond the trial's own needs in its one long epoch (a guard for off-by-one consumers).
EPOCH_MARGIN_STEPS = 2


def move_batch(
    batch: Any,
    device: torch.device,
    non_blocking: bool = False,
    pin_memory: bool = False,
    channels_last: bool = False,
) -> Any:
    """`batch` on `device`, its structure kept (a Hugging Face BatchEncoding too); non-tensors pass
    through. `pin_memory` page-locks host tensors first, so that `non_blocking` copies are truly
    asynchronous (CUDA only). `channels_last` formats 4-D float tensors NHWC."""
    pin = pin_memory and device.type == "cuda"
    return _moved(batch, device, non_blocking, pin, channels_last)


def _moved(
    item: Any, device: torch.device, non_blocking: bool, pin: bool, channels_last: bool
) -> Any:
    """A module function, not a closure: a recursive closure is a reference cycle per call,
    garbage only the cyclic GC frees (collections inside the window)."""
    import torch

    if isinstance(item, torch.Tensor):
        if pin and item.device.type == "cpu" and not item.is_pinned():
            item = item.pin_memory()
        item = item.to(device, non_blocking=non_blocking)
        if channels_last and item.dim() == 4 and item.is_floating_point():
            item = item.contiguous(memory_format=torch.channels_last)
        return item
    args = (device, non_blocking, pin, channels_last)
    if isinstance(item, Mapping):
        moved = {key: _moved(value, *args) for key, value in item.items()}
        try:
            return moved if type(item) is dict else type(item)(moved)  # type: ignore[call-arg]
        except Exception:
            return moved
    if isinstance(item, tuple) and hasattr(item, "_fields"):  # a namedtuple
        return type(item)(*(_moved(value, *args) for value in item))
    if isinstance(item, (tuple, list)):
        return type(item)(_moved(value, *args) for value in item)
    return item


def first_tensor(batch: Any) -> torch.Tensor | None:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (Mapping, tuple, list)):
        for value in batch.values() if isinstance(batch, Mapping) else batch:
            found = first_tensor(value)
            if found is not None:
                return found
    return None


SampleCount = int | Callable[[Any], int] | None


def batch_samples(batch: Any, samples: SampleCount = None) -> int:
    """How many samples `batch` holds: `samples` (a count, or a function of the batch) when given,
    else the batch dimension of its first tensor."""
    if callable(samples):
        return int(samples(batch))
    if samples is not None:
        return int(samples)
    tensor = first_tensor(batch)
    if tensor is None or tensor.dim() == 0:
        raise TypeError(
            f"cannot tell the sample count of a {type(batch).__name__} batch (no tensor with a "
            "batch dimension): give samples_per_batch"
        )
    return int(tensor.shape[0])


class BatchFeed:
    """Endless batches from `loader` (any re-iterable, restarted at each epoch end), each moved by
    `move`, with what waiting for them cost (`wait`) and how many samples they held."""

    def __init__(
        self,
        loader: Any,
        move: Callable[[Any], Any],
        device: torch.device,
        samples: SampleCount = None,
        accumulation_steps: int = 1,
    ) -> None:
        self.loader, self.move, self.sample_count = loader, move, samples
        self.accumulation_steps = accumulation_steps
        self.iterator: Any = None
        self.batches = self.samples = 0
        self.wait = InputWait(device)

    def reset_counters(self) -> None:
        self.batches = self.samples = 0
        self.wait.reset()

    def _fetch(self) -> Any:
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:  # epoch end: a new iterator (new workers unless persistent_workers)
            self.iterator = iter(self.loader)
        try:
            return next(self.iterator)
        except StopIteration:
            raise RuntimeError(
                f"the batches ran out after {self.batches} in the window: give a re-iterable "
                "(a DataLoader, a list), not a one-shot iterator, or more batches"
            ) from None

    def next(self) -> Any:
        self.wait.fetch_started()
        batch = self._fetch()
        self.wait.fetch_ended()
        self.batches += 1
        self.samples += batch_samples(batch, self.sample_count)
        self.wait.copy_started()
        batch = self.move(batch)
        self.wait.copy_ended()
        return batch

    def next_step(self) -> list[Any]:
        return [self.next() for _ in range(self.accumulation_steps)]

    def close(self) -> None:
        """Stop the worker processes (they would compete with the ceiling measurement)."""
        iterator, self.iterator = self.iterator, None
        stop_workers(iterator)


def stop_workers(iterator: Any) -> None:
    """Stop a DataLoader iterator's worker processes (a private torch method, where there is one)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def build_loader(
    spec: TrialSpec,
    dataset: Any,
    device: torch.device,
    warnings: list[str],
    seed: int | None = None,
) -> Any:
    """gpuopt's DataLoader over `dataset`, its order drawn from `seed` (default: `spec.seed`)."""
    import torch
    from torch.utils.data import DataLoader

    conf = spec.loader
    kwargs: dict[str, Any] = {}
    if conf.num_workers > 0:
        if conf.prefetch_factor is not None:
            kwargs["prefetch_factor"] = conf.prefetch_factor
        kwargs["persistent_workers"] = conf.persistent_workers
    else:
        ignored = [
            name for name in ("prefetch_factor", "persistent_workers") if getattr(conf, name)
        ]
        if ignored:
            warnings.append(f"loader.{' and loader.'.join(ignored)} ignored: loader.num_workers=0")
    generator = torch.Generator().manual_seed(spec.seed if seed is None else seed)
    return DataLoader(
        dataset,
        batch_size=conf.batch_size,
        sampler=steady_sampler(spec, dataset, generator),
        generator=generator,
        num_workers=conf.num_workers,
        # Page-locked host buffers: needed for truly asynchronous H2D copies. Without an
        # accelerator PyTorch ignores it (with a warning).
        pin_memory=conf.pin_memory and device.type != "cpu",
        drop_last=conf.drop_last,
        **kwargs,
    )


def steady_sampler(spec: TrialSpec, dataset: Any, generator: torch.Generator) -> Any:
    """A shuffling sampler whose one epoch lasts the whole trial (further random passes over a
    shorter dataset inside the same epoch), so the loader never restarts inside the timed window.
    None for a dataset without a length (an IterableDataset)."""
    from torch.utils.data import RandomSampler

    length = dataset_length(dataset)
    if length is None:
        return None
    steps = 1 + spec.measure.warmup_steps + spec.measure.max_steps + EPOCH_MARGIN_STEPS
    return RandomSampler(
        dataset, num_samples=max(length, steps * spec.global_batch), generator=generator
    )


def dataset_length(dataset: Any) -> int | None:
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return None
    try:
        return len(dataset)
    except TypeError:
        return None


def record_batches(trial: Trial) -> None:
    """What one optimizer step trains on, and the lr, into the trial's metrics."""
    m, spec = trial.metrics, trial.spec
    m.global_batch, m.micro_batch = spec.global_batch, spec.micro_batch
    m.accumulation_steps, m.lr_scale = spec.accumulation_steps, spec.lr_scale
    m.lr = spec.optimizer.lr * spec.lr_scale
