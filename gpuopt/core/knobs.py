"""THE knob catalogue: one record per config key gpuopt searches (or per group of keys alike), with
all the package asks of a knob. Its poor-choice rules judge values on the facts `python -m
gpuopt.env` measures, so the sweeper's trimming, a trial's warnings and the env command's table
read the same rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuopt.core.spec import TrialSpec

Facts = Mapping[str, Any]  # python -m gpuopt.env --json (gpuopt.trial.devices.detect_capabilities)
GLOBAL_BATCH = "global batch"  # samples per optimizer step: micro-batch x accumulation x ranks
NUMERICS = "numerics"  # the same math in another order or precision: the numerics guard checks it
LR = "lr"  # the learning rate the optimizer steps with
WHAT = "what is trained"  # another model or optimizer: never the same training
FACTOR, TOTAL = "factor", "total"  # Knob.batch: how a GLOBAL_BATCH key makes the global batch
# A low precision whose measured matmul peak is under this many times fp32's buys no compute here.
LOW_PRECISION_GAIN = 1.2
NO = (False, None)  # a fact that is false or missing
CPU, CUDA, NOT_CUDA = {"device": ("cpu",)}, {"device": ("cuda",)}, {"device": ("cpu", "mps")}


def _derived(facts: Facts) -> dict[str, Any]:
    """The facts, with each low precision's measured matmul peak against fp32's (`bf16_slow`)."""
    out = dict(facts)
    peaks = facts.get("peak_flops") or {}
    for mode in ("bf16", "fp16"):
        if peaks.get("fp32") and peaks.get(mode):
            out[f"{mode}_gain"] = gain = peaks[mode] / peaks["fp32"]
            out[f"{mode}_slow"] = gain < LOW_PRECISION_GAIN
            out[f"{mode}_tflops"] = peaks[mode] / 1e12
    return out


@dataclass(frozen=True)
class Rule:
    """One poor choice: `values` (override strings), or every count `above` a fact (`cpus`), cost
    a sweep trials for nothing on a machine whose facts match `when`, because `why`."""

    values: tuple[str, ...]
    when: Mapping[str, tuple[Any, ...]]
    why: str
    above: str = ""

    def reason(self, facts: Facts, value: str | None = None) -> str | None:
        """Why `value` (None: the rule's values) is poor on this machine; None where it is not."""
        known, limit = _derived(facts), facts.get(self.above) or 0
        counted = self.above and value and value.isdigit() and int(value) > limit
        if value is not None and value not in self.values and not counted:
            return None
        applies = all(known.get(name) in allowed for name, allowed in self.when.items())
        return self.why.format(**known) if applies and (limit or not self.above) else None

    def shown(self, facts: Facts) -> str:
        """The values as the env command's row names them: `bf16`, `> 2`."""
        return " | ".join(self.values) or f"> {facts[self.above]}"


@dataclass(frozen=True)
class Knob:
    """A config key (`loader.pin_memory`) or, ending in a dot, the keys of a group without a record
    of their own (`model.`). `group`: the config group whose options set the key."""

    key: str
    shareable: bool = False  # may differ within one measuring process (race, confirmation)
    training: tuple[str, ...] = ()  # how it changes the training (GLOBAL_BATCH, ...); (): not
    poor: tuple[Rule, ...] = ()  # values that cost a sweep trials for nothing, per device facts
    tip: str | None = None  # the setting a diagnosis's "Try:" line names (it says why)
    group: str | None = None
    # How a GLOBAL_BATCH key makes the global batch: FACTOR (it multiplies in: the micro-batch,
    # the ranks) or TOTAL (set, it is the global batch itself: train.global_batch).
    batch: str | None = None
    # A NUMERICS key's check by the numerics guard: the math change a trial makes with it, as the
    # guard names it ("precision bf16"), None where it keeps the fp32 reference's math.
    numerics: Callable[[TrialSpec], str | None] | None = None

    def __post_init__(self) -> None:
        if (NUMERICS in self.training) != (self.numerics is not None):
            raise ValueError(f"{self.key}: a NUMERICS key has the guard's check, no other key")


# The guard's checks (`Knob.numerics`) several keys share, each against the fp32 reference's way.
def _accumulation(spec: TrialSpec) -> str | None:
    """Micro-batches accumulated into the global batch: another summation order."""
    steps = spec.accumulation_steps
    return f"accumulation {steps} x {spec.micro_batch}" if steps > 1 else None


def _kernels(spec: TrialSpec) -> str | None:
    """The optimizer's fused or multi-tensor kernels, not PyTorch's default choice."""
    fused, foreach = spec.optimizer.fused, spec.optimizer.foreach
    kernels = f"optimizer kernels fused={fused} foreach={foreach}"
    return kernels if fused or foreach is not None else None


def _distributed(spec: TrialSpec) -> str | None:
    """Gradients reduced over ranks (another summation order), and FSDP2's mixed-precision policy:
    `fsdp2 x 2 ranks (param bf16)`."""
    dist = spec.distributed
    if dist.kind == "none":
        return None
    policy = [
        f"{name} {value}"
        for name, value in (("param", dist.param_dtype), ("reduce", dist.reduce_dtype))
        if dist.kind == "fsdp2" and value is not None
    ]
    return f"{dist.kind} x {dist.world_size} ranks" + (f" ({', '.join(policy)})" if policy else "")


def _slower_than_fp32(mode: str) -> Rule:
    """Measured, not read off CPU flags: a CPU can have native fp16 instructions (AVX512-FP16) and
    no faster fp16 matrix math (AMX-FP16 is a later chip), where fp16 autocast only adds rounding,
    and its convolutions have no fast kernel (a 3x3 conv's forward and backward took 2.2 s in fp16
    vs 60 ms in fp32 on a 2-core Xeon: docs/searching.md, "Device-aware choices")."""
    why = f"measured matmul peak {{{mode}_tflops:.3g}} TFLOP/s, {{{mode}_gain:.2f}}x fp32's: "
    why += "no faster math here to pay for its rounding"
    return Rule((mode,), {f"{mode}_slow": (True,)}, why)


# fmt: off
_NO_TF32 = "TF32 needs an NVIDIA GPU with compute capability >= 8.0"
_PRECISION_RULES = (
    Rule(("tf32",), NOT_CUDA, _NO_TF32),
    Rule(("tf32",), {**CUDA, "tf32": NO}, _NO_TF32 + " ({compute_capability} here)"),
    Rule(("bf16",), {**CPU, "bf16_native": NO}, "this CPU has no native bf16 (no AVX512-BF16/AMX): "
         "autocast emulates it, measured 3-15x slower than fp32"),
    Rule(("bf16",), {**CUDA, "bf16_native": NO}, "no native bf16 below compute capability 8.0 "
         "(this GPU: {compute_capability}): emulated, slow"),
    Rule(("fp16",), {**CPU, "fp16_native": NO}, "this CPU has no native fp16 math (no AMX-FP16): "
         "fp16 autocast plus loss scaling is slower than fp32"),
    _slower_than_fp32("bf16"),
    _slower_than_fp32("fp16"),
)
_COMPILE_RULES = (
    Rule(("default",), CPU, "torch.compile costs ~30 s cold per process on CPU (measured 27-38 s "
         "on 2 cores) and gave no measurable speed-up for these models"),
    Rule(("reduce-overhead",), NOT_CUDA, "CUDA graphs: needs a CUDA device to pay off"),
    Rule(("max-autotune",), NOT_CUDA, "autotunes GPU kernels: needs a CUDA device to pay off"),
)
_NO_BF16 = (Rule(("bf16",), {"bf16_native": NO}, "no native bf16 on this device: bf16 shards run "
                 "emulated, slowly"),)
_CORES = "only {cpus} usable CPU core(s): more "

MICRO_BATCH = Knob("loader.batch_size", True, (GLOBAL_BATCH, NUMERICS),
                   tip="larger loader.batch_size", batch=FACTOR, numerics=_accumulation)
WORKERS = Knob("loader.num_workers", True,
               poor=(Rule((), {}, _CORES + "workers than cores compete with compute", "cpus"),),
               tip="loader.num_workers")
PIN_MEMORY = Knob("loader.pin_memory", True,
                  poor=(Rule(("true",), CPU, "no accelerator: pinned memory is a no-op here "
                             "(PyTorch warns)"),),
                  tip="loader.pin_memory=true loader.non_blocking=true")
NON_BLOCKING = Knob("loader.non_blocking", True,
                    poor=(Rule(("true",), CPU, "no accelerator: there is no host-to-device copy"),))
PERSISTENT_WORKERS = Knob("loader.persistent_workers", True, tip="loader.persistent_workers=true")
PRECISION = Knob("precision.mode", True, (NUMERICS,), _PRECISION_RULES, "precision=bf16 (or fp16)",
                 group="precision", numerics=lambda spec: None if spec.precision.mode == "fp32"
                 else f"precision {spec.precision.mode}")
COMPILE = Knob("compile.mode", False, (NUMERICS,), _COMPILE_RULES, "compile=reduce-overhead",
               group="compile", numerics=lambda spec: None if spec.compile.mode == "off"
               else f"compile {spec.compile.mode}")
THREADS = Knob("device.num_threads", True,
               poor=(Rule((), {}, _CORES + "threads than cores oversubscribe", "cpus"),),
               tip="tune loader.num_workers and device.num_threads together")
ACCUMULATION = Knob("train.global_batch", True, (GLOBAL_BATCH, NUMERICS), batch=TOTAL,
                    numerics=_accumulation)
FUSED = Knob("optimizer.fused", training=(NUMERICS,), tip="optimizer.fused=true", numerics=_kernels)
CHANNELS_LAST = Knob("model.channels_last", training=(NUMERICS,), tip="model.channels_last=true",
                     numerics=lambda spec: "channels_last" if spec.model.get("channels_last")
                     else None)
NPROC = Knob("distributed.nproc_per_node", training=(GLOBAL_BATCH, NUMERICS),
             poor=(Rule((), NOT_CUDA, "only {cpus} usable CPU core(s): one rank each", "cpus"),
                   Rule((), CUDA, "only {gpu_count} GPU(s): one rank each", "gpu_count")),
             batch=FACTOR, numerics=_distributed)

KNOBS: tuple[Knob, ...] = (
    MICRO_BATCH, WORKERS, PIN_MEMORY, NON_BLOCKING, PERSISTENT_WORKERS,
    Knob("loader.", True),
    PRECISION, COMPILE, THREADS,
    Knob("device.type"), Knob("cache.cudnn_benchmark"), Knob("cache."),
    ACCUMULATION,
    Knob("optimizer.lr", True, (LR,)),
    Knob("optimizer.lr_scaling", True, (LR,)),
    Knob("optimizer.reference_batch", False, (LR,)),
    FUSED,
    Knob("optimizer.foreach", training=(NUMERICS,), numerics=_kernels),
    Knob("optimizer.", training=(WHAT,)),
    Knob("model.activation_checkpointing", True),
    CHANNELS_LAST,
    Knob("model.", training=(WHAT,)),
    Knob("engine.precision", training=(NUMERICS,), numerics=lambda spec: None
         if spec.engine.name != "lightning" or spec.engine.precision in (None, "32-true")
         else f"engine.precision {spec.engine.precision}"),
    Knob("distributed.kind", False, (NUMERICS,), group="distributed", numerics=_distributed),
    NPROC,
    Knob("distributed.backend", poor=(Rule(("nccl",), NOT_CUDA, "NCCL needs CUDA GPUs"),)),
    Knob("distributed.param_dtype", training=(NUMERICS,), poor=_NO_BF16, numerics=_distributed),
    Knob("distributed.reduce_dtype", training=(NUMERICS,), poor=_NO_BF16, numerics=_distributed),
    Knob("measure.", True),
    Knob("profile.", True),
)
# fmt: on


def find(key: str) -> Knob | None:
    """The record of a key (`+`/`~` prefixes ignored): its own, else its group's (`loader.` for
    loader.drop_last); a config group's name (`precision`) finds the key its options set."""
    name = key.lstrip("+~")
    best = None
    for knob in KNOBS:
        if name in (knob.key, knob.group):
            return knob
        if knob.key.endswith(".") and name.startswith(knob.key):
            best = knob
    return best


def shareable(key: str) -> bool:
    """Whether configurations differing in `key` may share one measuring process; a config group
    (`loader`, `precision`) when every key of it is shareable."""
    name = key.lstrip("+~")
    knob = find(name)
    if knob is None and "." not in name:
        under = [k for k in KNOBS if k.key.startswith(name + ".")]
        return bool(under) and all(k.shareable for k in under)
    return knob is not None and knob.shareable


def probed(key: str) -> bool:
    """Whether the env probe judges `key` or the keys of its group: a sweep of none of them need not
    run `python -m gpuopt.env` (a subprocess that imports torch)."""
    group = key.lstrip("+~").split(".", 1)[0]
    return any(k.poor and k.key.split(".", 1)[0] == group for k in KNOBS)


def keys(change: str) -> tuple[str, ...]:
    """The keys that change the training this way: `keys(GLOBAL_BATCH)` hold the global batch
    (micro-batch x accumulation x ranks), `keys(NUMERICS)` are what the guard checks."""
    return tuple(k.key for k in KNOBS if change in k.training)


def batch_keys(role: str) -> tuple[str, ...]:
    """The GLOBAL_BATCH keys with this role (FACTOR: they multiply into the global batch, the
    micro-batch first; TOTAL: set, the key is the global batch itself)."""
    return tuple(k.key for k in KNOBS if GLOBAL_BATCH in k.training and k.batch == role)


def canonical(value: Any) -> str:
    """A value as the rules name it: true, null, 4, bf16."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value).lower()


def judge(key: str, value: Any, facts: Facts) -> str | None:
    """Why `value` of `key` is a poor choice on a machine with these facts (the first rule that
    applies), or None; no facts, no reason."""
    knob = find(key)
    if knob is None or not facts.get("device"):
        return None
    text = canonical(value)
    return next((why for rule in knob.poor if (why := rule.reason(facts, text))), None)


def poor_rows(facts: Facts) -> list[dict[str, str]]:
    """The rules that apply on this machine, one row each: {key, values, why}."""
    rules = [(k, r) for k in KNOBS for r in k.poor] if facts.get("device") else []
    return [
        {"key": k.key, "values": r.shown(facts), "why": why}
        for k, r in rules
        if (why := r.reason(facts))
    ]
