"""Typed config schemas: the dataclasses Hydra's ConfigStore holds (`gpuopt_schema`, so OmegaConf
rejects wrong types and unknown keys) and the validated `TrialSpec` a trial is built from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
EMPTY_CACHE_POLICIES = ("never", "trial_end", "every_n_steps")
OPTIMIZERS = ("sgd", "adamw")
# hf_*: Hugging Face-format dict batches (gpuopt.workload.data.SyntheticDataset, conf/model/hf_*).
HF_INPUT_KINDS = ("hf_causal_lm", "hf_masked_lm", "hf_images")
# Built-in losses; `model`: the model returns its own (outputs.loss, the Hugging Face convention).
# A user loss function is `loss: {_target_: mypkg.fn}` (gpuopt.engines._loss.model_loss).
LOSSES = ("cross_entropy", "mse", "model")
ENGINES = ("native", "lightning")
DISTRIBUTED_KINDS = ("none", "ddp", "fsdp2")
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")  # auto: nccl on CUDA, gloo on CPU
# FSDP2's MixedPrecisionPolicy dtypes; null: the parameters' own dtype.
SHARD_DTYPES = ("fp32", "bf16", "fp16")
LR_SCALING_RULES = ("none", "linear", "sqrt")
# Lightning 2.x `Trainer(precision=...)` strings (engine.precision overrides the precision group).
LIGHTNING_PRECISIONS = (
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
)
LIGHTNING_INSTALL_HINT = 'pip install "gpuopt[lightning]"'
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

# Keys of a model config that describe the model to gpuopt and are not constructor arguments.
MODEL_META_KEYS = ("input", "input_shape", "num_classes", "channels_last")
# Keys of a data config for gpuopt only, never passed to the dataset's constructor: `epoch_steps`,
# the user's real steps per epoch.
DATA_GPUOPT_KEYS = ("epoch_steps",)

# `_target_`s any config may instantiate. Everything else must be trusted explicitly with the
# top-level `trust` list (e.g. `trust=[mypkg.*]`), so a shared YAML cannot run arbitrary code.
BUILTIN_TRUSTED_TARGETS = ("gpuopt.*", "torch.nn.*", "torch.utils.data.*", "torchvision.*")


@dataclass
class LoaderConf:
    batch_size: int = 32
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None  # None: PyTorch's default (2) when num_workers > 0
    persistent_workers: bool = False
    drop_last: bool = True
    non_blocking: bool = False  # host-to-device copies with non_blocking=True


@dataclass
class PrecisionConf:
    mode: str = "fp32"  # fp32 | tf32 | fp16 (autocast + GradScaler) | bf16 (autocast)


@dataclass
class CompileConf:
    mode: str = "off"  # off | default | reduce-overhead | max-autotune
    fullgraph: bool = False
    dynamic: bool | None = None


@dataclass
class CacheConf:
    empty_cache: str = "never"  # never | trial_end | every_n_steps
    every_n_steps: int = 100
    cuda_alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True
    cudnn_benchmark: bool = True
    cpu_thp: bool = False  # THP_MEM_ALLOC_ENABLE=1: transparent huge pages for CPU tensors


@dataclass
class OptimizerConf:
    name: str = "adamw"  # sgd | adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    foreach: bool | None = None  # None: PyTorch's choice
    fused: bool | None = None
    # lr x (global_batch / reference_batch) (linear) or its square root (sqrt); none: lr as given.
    lr_scaling: str = "none"
    # The global batch `lr` was tuned for; None: the composed global batch (the sweeper sets the
    # baseline's for every trial).
    reference_batch: int | None = None


@dataclass
class TrainConf:
    """What one optimizer step trains on. `global_batch` samples per optimizer step, in
    global_batch / loader.batch_size accumulated micro-batches; None: loader.batch_size."""

    global_batch: int | None = None


@dataclass
class GuardConf:
    """The numerics guard: K seeded optimizer steps compared with an fp32 reference."""

    enabled: bool = True
    steps: int = 8  # K optimizer steps
    loss_tolerance: float = 0.05  # the largest loss_drift still "the same training"
    # The global batch the guard checks a trial's math changes at when the trial's own differs
    # and it accumulates nothing (a sweep sets the baseline's: numerics.guarded_spec); None: its own.
    global_batch: int | None = None


@dataclass
class DeviceConf:
    type: str = "auto"  # auto (cuda, then mps, then cpu) | cpu | cuda | cuda:N | mps
    num_threads: int | None = None  # torch.set_num_threads; None: PyTorch's default


@dataclass
class MeasureConf:
    warmup_steps: int = 5
    min_steps: int = 10
    max_steps: int = 500
    time_budget_s: float = 8.0  # timed window ends after this, stable or not
    min_time_s: float = 2.0  # the stability stop waits at least this long (capped at the budget)
    stability_target: float = 0.03  # stop once the 95% CI half-width of throughput is below this
    ceiling: bool = True  # replay one on-device batch to measure the compute-only ceiling
    ceiling_steps: int = 20
    count_flops: bool = True  # torch.utils.flop_counter on one step, for MFU
    nvml_interval_s: float = 0.1
    peak_probe: bool = True  # a matmul probe of this machine's peak (cached): mfu_achievable
    loader_cost: bool = True  # price the input pipeline per sample: limit_throughput


@dataclass
class ProfileConf:
    """The profiled window: a few steps under torch.profiler after the timed window, never timed."""

    enabled: bool = False
    steps: int = 5  # profiled steps (each recorded op costs host time: keep it small)
    # ...fewer when the timed window's steps are slow: about this many seconds of them (at least
    # one; null: always `steps`). Not in a distributed trial (its ranks must profile alike).
    max_s: float | None = 2.0
    warmup_steps: int = 1  # steps the profiler records and discards (its own start-up)
    top_ops: int = 10  # operators listed by self time


@dataclass
class EngineConf:
    """Which training loop runs the trial. The Lightning-only knobs are ignored by `native`."""

    name: str = "native"  # native | lightning
    precision: str | None = None  # Lightning precision string overriding the precision group
    strategy: str = "auto"  # Trainer(strategy=...)
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None


@dataclass
class DistributedConf:
    """One trial over several ranks, started by the trial's own process (torch's elastic launcher).
    The DDP knobs are ignored by fsdp2 and the FSDP2 knobs by ddp."""

    kind: str = "none"  # none | ddp (DistributedDataParallel) | fsdp2 (fully_shard)
    nproc_per_node: int = 1  # ranks on this node (one per GPU on CUDA)
    nnodes: int = 1  # nodes per trial (several: rdzv_endpoint, or a SLURM job of one task per node)
    rdzv_endpoint: str | None = None  # host:port of the rendezvous; null: localhost, a free port
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: float = 60.0  # rendezvous and collective timeout: a hung rank fails the trial
    # DDP (torch.nn.parallel.DistributedDataParallel)
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    # FSDP2 (torch.distributed.fsdp.fully_shard)
    reshard_after_forward: bool = True
    param_dtype: str | None = None  # fp32 | bf16 | fp16 | null (the parameters' dtype)
    reduce_dtype: str | None = None  # gradient reduce-scatter dtype; null: param_dtype
    # Child modules sharded (and checkpointed) one by one, by class name or fnmatch pattern, e.g.
    # [Block] or ["*Block"]; the root is always sharded. Empty: only the root. An entry matching
    # no submodule is the trial's one-line error, naming the classes the model has.
    shard_modules: list[str] = field(default_factory=list)
    checkpoint_modules: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return 1 if self.kind == "none" else self.nproc_per_node * self.nnodes


@dataclass
class GpuoptConf:
    """The whole trial config. `model` and `data` stay untyped: they carry user `_target_` kwargs."""

    model: Any = None
    data: Any = None
    engine: EngineConf = field(default_factory=EngineConf)
    loader: LoaderConf = field(default_factory=LoaderConf)
    precision: PrecisionConf = field(default_factory=PrecisionConf)
    compile: CompileConf = field(default_factory=CompileConf)
    cache: CacheConf = field(default_factory=CacheConf)
    optimizer: OptimizerConf = field(default_factory=OptimizerConf)
    device: DeviceConf = field(default_factory=DeviceConf)
    measure: MeasureConf = field(default_factory=MeasureConf)
    profile: ProfileConf = field(default_factory=ProfileConf)
    train: TrainConf = field(default_factory=TrainConf)
    guard: GuardConf = field(default_factory=GuardConf)
    distributed: DistributedConf = field(default_factory=DistributedConf)
    # cross_entropy | mse | model, or {_target_: mypkg.fn} (a user loss function; Any: str or dict)
    loss: Any = "cross_entropy"
    seed: int = 0
    trust: list[str] = field(default_factory=list)
    output_dir: str = "outputs"


# Schemas of gpuopt's own workloads, applied by `_target_` (a user's model or dataset stays
# untyped: its keys are its constructor's). Every int field must be >= 1, except `seed`.
@dataclass
class ModelMetaConf:
    _target_: str = ""
    input: str = "any"
    input_shape: list[int] = field(default_factory=list)
    num_classes: int = 1
    channels_last: bool = False
    activation_checkpointing: bool = False


@dataclass
class MLPConf(ModelMetaConf):
    in_features: int = 1
    out_features: int = 1
    width: int = 512
    depth: int = 3


@dataclass
class CNNConf(ModelMetaConf):
    in_channels: int = 3
    out_features: int = 1
    width: int = 32
    depth: int = 2


@dataclass
class GPTConf(ModelMetaConf):
    vocab_size: int = 1
    seq_len: int = 1
    width: int = 128
    depth: int = 2
    heads: int = 4


@dataclass
class SyntheticDataConf:
    _target_: str = ""
    kind: str = "vectors"
    shape: list[int] = field(default_factory=list)
    num_classes: int = 1
    size: int = 4096
    sample_cost: float = 1.0
    seed: int = 0
    epoch_steps: int | None = None  # gpuopt key (DATA_GPUOPT_KEYS): the real epoch length


BUILTIN_WORKLOAD_SCHEMAS: dict[str, type] = {
    "gpuopt.workload.models.MLP": MLPConf,
    "gpuopt.workload.models.CNN": CNNConf,
    "gpuopt.workload.models.GPT": GPTConf,
    "gpuopt.workload.data.SyntheticDataset": SyntheticDataConf,
}
# Dimensions of one sample per input kind (vectors (F,), images (C, H, W), tokens (T,)).
INPUT_RANKS = {
    "vectors": 1,
    "images": 3,
    "tokens": 1,
    "hf_causal_lm": 1,
    "hf_masked_lm": 1,
    "hf_images": 3,
}
INPUT_KINDS = (*INPUT_RANKS, "any")
# gpuopt's Hugging Face builder (gpuopt.workload.hf) needs the optional extra.
HF_TARGET_PREFIX = "gpuopt.workload.hf."
HF_INSTALL_HINT = 'pip install "gpuopt[hf]"'
# loader.num_workers and device.num_threads: at most this many per usable CPU core (or the floor),
# so a typo (1000) cannot start a thousand processes; PyTorch itself suggests <= the core count.
PER_CPU_LIMIT = 4
PER_CPU_LIMIT_FLOOR = 8


def register_schemas() -> None:
    ConfigStore.instance().store(name="gpuopt_schema", node=GpuoptConf, replace=True)


@dataclass(frozen=True)
class TrialSpec:
    """A validated trial configuration: what `run_trial` builds and measures."""

    model: dict[str, Any]
    data: dict[str, Any]
    loader: LoaderConf
    precision: PrecisionConf
    compile: CompileConf
    cache: CacheConf
    optimizer: OptimizerConf
    device: DeviceConf
    measure: MeasureConf
    loss: str | dict[str, Any]  # a LOSSES name, or a user loss function's config (`_target_`)
    seed: int
    trusted_targets: tuple[str, ...]
    engine: EngineConf = field(default_factory=EngineConf)
    profile: ProfileConf = field(default_factory=ProfileConf)
    train: TrainConf = field(default_factory=TrainConf)
    guard: GuardConf = field(default_factory=GuardConf)
    distributed: DistributedConf = field(default_factory=DistributedConf)

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward (the DataLoader's batch)."""
        return self.loader.batch_size

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step and rank: train.global_batch / (micro-batch x world
        size), else Lightning's own engine.accumulate_grad_batches."""
        if self.train.global_batch is not None:
            return max(1, self.train.global_batch // (self.micro_batch * self.world_size))
        return self.engine.accumulate_grad_batches if self.engine.name == "lightning" else 1

    @property
    def world_size(self) -> int:
        """Ranks training together (1 without `distributed`)."""
        return self.distributed.world_size

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over every rank: micro-batch x accumulation x world size."""
        return self.micro_batch * self.accumulation_steps * self.world_size

    @property
    def lr_scale(self) -> float:
        """The factor `optimizer.lr_scaling` applies to `optimizer.lr`: global / reference batch for
        linear, its square root for sqrt, 1.0 for none (a single run's reference is its own global
        batch)."""
        ratio = self.global_batch / (self.optimizer.reference_batch or self.global_batch)
        return {"linear": ratio, "sqrt": ratio**0.5}.get(self.optimizer.lr_scaling, 1.0)
