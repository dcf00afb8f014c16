"""`gpuopt.HFMeasureCallback`: gpuopt's measurement of the Hugging Face `Trainer`'s own training
loop, as a `transformers.TrainerCallback` (the `[hf]` extra).

    meter = gpuopt.HFMeasureCallback(measure="quick")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[meter])
    result = meter.train(trainer)  # a TrialResult; never raises for a failing configuration

One timed step is one optimizer step (`on_step_end`), as in gpuopt's own trials. The Trainer
fetches all of a step's micro-batches at once (`Trainer.get_batch_samples`, which also moves them
to the device): that call's time is the data wait. Its `training_step` returns each micro-batch's
loss, which the Trainer's `logging_nan_inf_filter` would otherwise hide. Both methods are wrapped
on the trainer instance only while `train` runs (the one place this module reaches past the
callback API).

`auto_find_batch_size` may halve the batch after an OOM, changing the global batch without saying
so: the result reports the batch that trained, and a warning says it changed. Under torchrun every
rank's `train` returns the job's result (gpuopt.engines._user_job).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from gpuopt.core.checks import measure_conf
from gpuopt.core.result import TrialResult
from gpuopt.core.spec import MeasureConf
from gpuopt.engines._batches import batch_samples
from gpuopt.engines._meter import WindowMeter
from gpuopt.engines._user_job import UserLoop, job_result, world_size

ENGINE_NAME = "hf_trainer"
# The TrainingArguments a throughput sweep changes, recorded with the result (its `config`).
RECORDED_ARGS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "bf16",
    "fp16",
    "tf32",
    "torch_compile",
    "optim",
    "gradient_checkpointing",
    "auto_find_batch_size",
)


def peak_mode(args: Any) -> str:
    """The dtype whose documented peak MFU is read against."""
    if args.bf16:
        return "bf16"
    if args.fp16:
        return "fp16"
    return "tf32" if args.tf32 else "fp32"


class HFMeasureCallback(UserLoop, TrainerCallback):
    """`gpuopt.HFMeasureCallback`: add it to your `Trainer(callbacks=[...])` and train with
    `meter.train(trainer)` to measure the Trainer's own loop the way a gpuopt trial is measured;
    the stop rule ends the training. `measure`: a conf/measure/ preset name ("quick", "default"),
    a dict of its fields, or a MeasureConf. No compute ceiling (it needs the batch replayed
    outside the Trainer: gpuopt.measure_step measures one)."""

    engine_name = ENGINE_NAME

    def __init__(self, measure: MeasureConf | dict[str, Any] | str | None = None) -> None:
        self.measure = measure_conf(measure)
        self._micro_batch: int | None = None
        self._args: Any = None  # the TrainingArguments, once training began

    def train(self, trainer: Trainer, **train_kwargs: Any) -> TrialResult:
        """`trainer.train(**train_kwargs)` measured; a failing configuration comes back as the
        status (in a multi-rank job a failing rank raises `RankFailed` instead)."""
        started, self.result = time.time(), None
        fetch, train_step = trainer.get_batch_samples, trainer.training_step

        def get_batch_samples(*args: Any, **kwargs: Any) -> Any:
            if self.meter is not None:
                self.meter.fetch_started()
            batches, items = fetch(*args, **kwargs)  # a step's micro-batches
            counts = [batch_samples(batch) for batch in batches]
            if self._micro_batch is None and counts:
                self._micro_batch = counts[0]
            if self.meter is not None:
                self.meter.batch_fetched(sum(counts))
            return batches, items

        def training_step(*args: Any, **kwargs: Any) -> Any:
            loss = train_step(*args, **kwargs)
            if self.meter is not None and isinstance(loss, torch.Tensor):
                self.meter.nonfinite.update(loss)
            return loss

        trainer.get_batch_samples = get_batch_samples  # type: ignore[method-assign]
        trainer.training_step = training_step  # type: ignore[method-assign]
        try:
            result = self.run(lambda: trainer.train(**train_kwargs))
        finally:  # the instance's own methods back
            for name in ("get_batch_samples", "training_step"):
                trainer.__dict__.pop(name, None)
        return job_result(result, self.ranks, started)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        compile_mode = "default" if args.torch_compile else "off"
        measure = self.measure
        if args.torch_compile and measure.count_flops:  # a compiled step hides its kernels
            measure = dataclasses.replace(measure, count_flops=False)
        trial = self.start_trial(args.device, peak_mode(args), compile_mode, measure=measure)
        self.meter = WindowMeter(trial, self.ranks)
        self._micro_batch, self._args = None, args

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None:
            self.meter.step_started()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.meter is not None and self.meter.optimizer_stepped() is not None:
            control.should_training_stop = True
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None and self.result is None:
            self.result = self.measured(lambda: self._record_training(args))

    def _record_training(self, args: Any) -> None:
        """Global batch = the micro-batch that trained x gradient_accumulation_steps x world size."""
        accumulate = int(args.gradient_accumulation_steps)
        self.record_batch(self._micro_batch, accumulate, world_size(), args.learning_rate)
        if self._micro_batch not in (None, args.per_device_train_batch_size):
            self.trial.warnings.append(  # type: ignore[union-attr]
                f"trained at micro-batch {self._micro_batch}, not per_device_train_batch_size="
                f"{args.per_device_train_batch_size} (auto_find_batch_size after an OOM?): "
                "the global batch reported is the one that trained"
            )

    def described(self) -> dict[str, Any]:
        args = self._args
        return {
            "trainer": {name: getattr(args, name, None) for name in RECORDED_ARGS} if args else {}
        }
