"""The DeepSpeed bridge: read a DeepSpeed config (`ds_config.json`) as the schedule DeepSpeed runs, and write
the nearest DeepSpeed config for a tierflow plan. Pure parsing and mapping: no simulation, no torch.

Reading (`read_ds_config`): the documented keys of a DeepSpeed config become one `DsConfig`: ZeRO stage, where
parameters and optimizer states are offloaded, where activation checkpoints live, the batch split and the
prefetch bucket. `DsConfig.schedule` turns it into the `horizontal` schedule with `runtime="deepspeed"`
(ZeRO-3 as DeepSpeed's code runs it, docs/baselines-as-coded.md) and the placement the config implies:

- weights: `offload_param.device` nvme -> SSD, cpu -> CPU memory, none (or stage < 3) -> GPU;
- fp32 master, Adam m and v: `offload_optimizer.device` nvme -> SSD, cpu -> CPU memory, none -> GPU (a GPU
  optimizer); the fp32 gradients follow them (DeepSpeed writes them to NVMe with an NVMe optimizer,
  stage3.py `_offload_grad_partition_at_boundary`, docs/baselines-as-coded.md A4);
- activation checkpoints: `activation_checkpointing.cpu_checkpointing` -> CPU memory, else GPU;
- batch = `train_batch_size`, micro-batch = `train_micro_batch_size_per_gpu`, on one GPU;
- parameters on CPU memory are prefetched `min(stage3_prefetch_bucket_size, stage3_max_live_parameters)`
  elements ahead: that many whole decoder layers (at least one, as DeepSpeed prefetches a parameter larger
  than the bucket whole) become the schedule's prefetch depth. Parameters on NVMe are fetched on demand
  whatever the bucket (the deepspeed runtime).

The keys that size DeepSpeed's own buffers (reduce_bucket_size, contiguous_gradients, the swappers' buffer
sizes and counts, max_in_cpu) are read into `DsConfig` and refused where DeepSpeed itself would stop. Every
other key is sorted by keys.py's classes: no effect on the step time (learning rate, scheduler, logging,
saving, and the keys whose value changes no step's work), no effect on one GPU (named in the warning line for
several GPUs), not modelled (named in one warning line, `DsConfig.warning_line`), or unknown to DeepSpeed
(named in the same line). "auto" values, as Hugging Face's Trainer writes them, are resolved as the Trainer
resolves them where the config and the model allow (the batch keys from each other or from the command
line's batch and micro-batch, `reduce_bucket_size` = hidden^2, `stage3_prefetch_bucket_size` = 0.9 hidden^2,
`stage3_param_persistence_threshold` = 10 hidden: transformers `integrations/deepspeed.py`,
`HfTrainerDeepSpeedConfig`), else refused with one line.

Writing (`ds_config_for_plan`): a plan's placement, batch split and checkpoint tier as DeepSpeed keys, and the
decisions DeepSpeed cannot express (block and vertical orders, the optimizer overlapped with the backward,
alpha deferral, per-layer swap-vs-recompute, fractional placements).

Defaults are DeepSpeed's, read in deepspeedai/DeepSpeed:
`deepspeed/runtime/zero/config.py` (stage 0, sub_group_size 1e9, stage3_prefetch_bucket_size 5e7,
stage3_max_live_parameters 1e9, stage3_max_reuse_distance 1e9, reduce_bucket_size 5e8, overlap_comm True on
stage 3), `deepspeed/runtime/zero/offload_config.py` (device none; offload_param buffer_count 5, buffer_size
1e8, max_in_cpu 1e9, pin_memory True; offload_optimizer buffer_count 4, pipeline_read/pipeline_write False,
ratio 1.0), `deepspeed/runtime/swap_tensor/aio_config.py` with `swap_tensor/constants.py` (block_size 1048576,
queue_depth 8, thread_count / intra_op_parallelism 1, single_submit False, overlap_events True),
`deepspeed/runtime/activation_checkpointing/config.py` (cpu_checkpointing False, partition_activations False),
and `deepspeed/runtime/config.py` (the batch rules of `_set_batch_related_parameters` / `_batch_assertion`;
bf16 and fp16 may not both be enabled).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from tierflow.errors import TierflowError
from tierflow.hwprofiles.inputs import MIB, InputLimitError, loads_json_limited, read_limited_text
from tierflow.outputs import atomic_write_text
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.dsruntime import (
    DS_MAX_IN_CPU_ELEMS,
    DS_OPT_BUFFER_COUNT,
    DS_PARAM_BUFFER_COUNT,
    DS_PARAM_BUFFER_ELEMS,
    DS_REDUCE_BUCKET_ELEMS,
    DS_SUB_GROUP_ELEMS,
    ds_cached_elems,
)
from tierflow.planner.core.memory import blocks_of
from tierflow.planner.core.models import PRECISION_NAMES, ModelSpec
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.runtimes.deepspeed import ds_sub_groups
from tierflow.planner.core.schedules import make_schedule
from tierflow.planner.io.deepspeed.keys import (
    ASSUMED_DEFAULTS,
    MODELLED_KEYS,
    NO_STEP_EFFECT,
    NOT_MODELLED,
    ONE_GPU_NO_EFFECT,
)

WORLD_SIZE = 1  # tierflow simulates one GPU
# the most sequences a batch holds: --batch's limit (tierflow.cli.argtypes), and a config's batch keys' here;
# generous, but a graph past it would not fit in memory (ops grow with layers x micro-batches x iterations)
MAX_BATCH = 1 << 20
Z, OP, OO = "zero_optimization.", "zero_optimization.offload_param.", "zero_optimization.offload_optimizer."
DS_AIO_BLOCK_BYTES = 1_048_576  # aio.block_size (swap_tensor/constants.py)
DS_MIN_AIO_BYTES = 1024**2  # swap_tensor/utils.py MIN_AIO_BYTES: smaller parameters are not swapped to NVMe
DS_OPT_SWAP_TENSORS = 4  # swap buffers per sub-group in flight: master, m, v and the gradient
AUTO = "auto"

# DeepSpeed's defaults the simulation depends on (see the module docstring for the files)
DS_STAGE = 0
DS_PREFETCH_BUCKET_ELEMS = 50_000_000  # zero/config.py prefetch_bucket_size
                                       # (alias stage3_prefetch_bucket_size)
DS_MAX_LIVE_ELEMS = 1_000_000_000  # zero/config.py max_live_parameters
# bounds of what a config may say: the file's size, and the element counts of the ZeRO-3 keys (2^53: above
# it a JSON number is no longer an exact integer; the keys only cap prefetch, so any larger value means "all")
MAX_DS_CONFIG_BYTES = 4 * MIB
MAX_ELEMS = 1 << 53
DS_OFFLOAD_DEVICE = "none"  # offload_config.py OffloadDeviceEnum default
DS_DEVICES = ("none", "cpu", "nvme")
DEVICE_TIER = {"none": "gpu", "cpu": "cpu", "nvme": "ssd"}
TIER_WORDS = {"gpu": "on the GPU", "cpu": "in CPU memory", "ssd": "on the SSDs"}
ADAM_TYPES = ("adam", "adamw", "cpuadam", "fusedadam", "deepspeedcpuadam")
# an nvme_path for configs tierflow writes: DeepSpeed's own docs use this mount point
EMIT_NVME_PATH = "/local_nvme"

# Keys the simulation reads (handled one by one below; keys.MODELLED_KEYS: the buffer and bucket keys).
MODELLED = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "zero_optimization.stage", "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param",
    "activation_checkpointing.cpu_checkpointing", "bf16.enabled", "bfloat16.enabled", "fp16.enabled",
    "optimizer.type",
    # the optimizer swapper's overlap of sub-groups (ScheduleConfig.ds_pipeline_read / ds_pipeline_write)
    "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
    "zero_optimization.sub_group_size",  # the optimizer's unit of swapping and pipelining
} | set(MODELLED_KEYS)
# Documented keys that do not change the time of a training step (learning rate, logging, saving, paths).
NO_EFFECT = {
    "optimizer.params", "scheduler", "steps_per_print", "wall_clock_breakdown", "dump_state",
    "memory_breakdown",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "monitor_config",
    "checkpoint",
    "nebula", "elasticity", "autotuning", "dataloader_drop_last", "load_universal_checkpoint", "timers",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "optimizer.legacy_fusion",
    "zero_optimization.offload_param.nvme_path", "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    "zero_optimization.gather_16bit_weights_on_model_save",
    "zero_optimization.load_from_fp32_weights", "zero_optimization.elastic_checkpoint",
    "zero_optimization.log_trace_cache_warnings", "zero_optimization.enable_sanity_checks",
    "zero_optimization.ignore_unused_parameters", "zero_optimization.pipeline_loading_checkpoint",
    "zero_optimization.offload_optimizer.fast_init", "zero_optimization.cpu_offload_use_pin_memory",
} | set(NO_STEP_EFFECT)
# Sections whose keys are classified one by one (every other value is one leaf, whatever it holds).
SECTIONS = {"zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer",
            "aio", "activation_checkpointing", "bf16", "bfloat16", "fp16", "optimizer"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
HIDDEN_AUTO = {  # Hugging Face Trainer: the keys it fills from the model's hidden size h
    "zero_optimization.reduce_bucket_size": ("h^2", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("0.9 h^2", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("10 h", lambda h: 10 * h),
}
PRECISION_AUTO = {"bf16.enabled", "bfloat16.enabled", "fp16.enabled"}


class DsConfigError(TierflowError, ValueError):
    """A DeepSpeed config that cannot be read or simulated: one line, exit code 2."""


@dataclass(frozen=True)
class DsConfig:
    """What a DeepSpeed config asks for, as far as the simulator can express it."""

    source: str  # the file's name, for messages
    stage: int
    param_device: str  # where parameters are offloaded: none | cpu | nvme (none below stage 3)
    optimizer_device: str  # where optimizer states are offloaded: none | cpu | nvme
    cpu_checkpointing: bool
    batch: int
    micro_batch: int
    accumulation: int
    precision: str  # bf16 | fp16 | 16-bit (auto) | fp32 (ZeRO: a master copy) | fp32-inplace (stage 0)
    prefetch_bucket_elems: int
    max_live_elems: int
    not_modelled: tuple[str, ...] = ()
    pipeline_read: bool = False  # offload_optimizer.pipeline_read (NVMe optimizer offload)
    pipeline_write: bool = False  # offload_optimizer.pipeline_write
    sub_group_elems: int = DS_SUB_GROUP_ELEMS  # zero_optimization.sub_group_size
    reduce_bucket_elems: int = DS_REDUCE_BUCKET_ELEMS  # zero_optimization.reduce_bucket_size
    contiguous_gradients: bool = True
    param_buffer_count: int = DS_PARAM_BUFFER_COUNT  # offload_param.buffer_count
    param_buffer_elems: int = DS_PARAM_BUFFER_ELEMS  # offload_param.buffer_size
    max_in_cpu_elems: int = DS_MAX_IN_CPU_ELEMS  # offload_param.max_in_cpu
    opt_buffer_count: int = DS_OPT_BUFFER_COUNT  # offload_optimizer.buffer_count
    # offload_optimizer.pin_memory (True by default at 0.19.8): the host gradient buffers page-locked through
    # torch's caching host allocator on a CUDA box (dsruntime.DsKnobs.pin_memory)
    opt_pin_memory: bool = True
    # parameters on NVMe: the share of them max_in_cpu keeps in host memory (whole leading sub-groups)
    cached_fraction: float = 0.0
    cached_elems: int = 0
    one_gpu_only: tuple[str, ...] = ()  # keys with no effect on one GPU (keys.ONE_GPU_NO_EFFECT)
    no_effect: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    resolved: tuple[str, ...] = ()  # "auto" keys and what they became
    from_command_line: tuple[str, ...] = ()  # "auto" batch keys filled from --batch / --micro-batch

    def placement(self) -> Placement:
        w = _one(DEVICE_TIER[self.param_device])
        if self.param_device == "nvme" and self.cached_fraction > 0:  # max_in_cpu (dsruntime.ds_cached_elems)
            f = min(1.0, self.cached_fraction)
            w = Split(gpu=0.0, cpu=f, ssd=1.0 - f)
        states = _one(DEVICE_TIER[self.optimizer_device])
        grads = states  # fp32 gradients wait where the optimizer runs: GPU, host memory, or NVMe (A4)
        ckpt = _one("cpu" if self.cpu_checkpointing else "gpu")
        return Placement(weights=w, master=states, adam_m=states, adam_v=states, grads=grads,
                         checkpoints=ckpt)

    def prefetch_depth(self, model: ModelSpec) -> int:
        """Decoder layers fetched ahead of the one in use: DeepSpeed prefetches parameters up to
        min(prefetch bucket, max live parameters) elements ahead, one parameter at least
        (partitioned_param_coordinator.py, docs/baselines-as-coded.md A2). It matters only for parameters in
        CPU memory (max_in_cpu's too); on NVMe they are fetched on demand, on the GPU not at all."""
        if self.param_device == "none" or (self.param_device == "nvme" and self.cached_fraction == 0):
            return 1
        ahead = min(self.prefetch_bucket_elems, self.max_live_elems)
        return max(1, min(model.num_layers, ahead // max(1, model.layer_params())))

    def schedule(self, model: ModelSpec, hw, *, seq: int, iterations: int = 3) -> ScheduleConfig:
        """The schedule DeepSpeed runs for this config: horizontal, as DeepSpeed's ZeRO-3 code runs it."""
        cfg = make_schedule("horizontal", model, hw, batch=self.batch, micro_batch=self.micro_batch, seq=seq,
                            placement=self.placement(), prefetch_depth=self.prefetch_depth(model),
                            runtime="deepspeed", iterations=iterations)
        nvme = self.optimizer_device == "nvme"  # DeepSpeed pipelines the swapper only for NVMe states
        return replace(cfg, ds_pipeline_read=nvme and self.pipeline_read,
                       ds_pipeline_write=nvme and self.pipeline_write,
                       ds_sub_group_elems=self.sub_group_elems,
                       ds_reduce_bucket_elems=self.reduce_bucket_elems,
                       ds_contiguous_gradients=self.contiguous_gradients,
                       ds_opt_buffer_count=self.opt_buffer_count,
                       ds_param_buffer_count=self.param_buffer_count,
                       ds_param_buffer_elems=self.param_buffer_elems,
                       ds_param_swapper=self.param_device == "nvme" and self.cached_fraction >= 1.0,
                       ds_cached_elems=self.cached_elems if 0 < self.cached_fraction < 1 else 0,
                       ds_stage=3 if self.stage >= 3 else self.stage,
                       # DeepSpeed's CPU accelerator does not page-lock (cpu_accelerator.py pin_memory)
                       ds_pin_memory=self.opt_pin_memory and self.optimizer_device != "none"
                       and hw.gpu.host_cores is None)

    def trained(self, model: ModelSpec) -> ModelSpec:
        """`model` in the precision this config trains it in (bf16.enabled / fp16.enabled, else fp32, in place
        without ZeRO; "auto": 16-bit, simulated as bf16, whose bytes and peak are fp16's)."""
        return model.with_precision(self.precision if self.precision in PRECISION_NAMES else "bf16")

    def describe(self) -> str:
        ck = "in CPU memory" if self.cpu_checkpointing else "on the GPU"
        return (f"{self.source}: ZeRO stage {self.stage}, offload_param {self.param_device}, "
                f"offload_optimizer {self.optimizer_device}, activation checkpoints {ck}, {self.precision}; "
                f"batch {self.batch} = {self.accumulation} micro-batches of {self.micro_batch} "
                f"on {WORLD_SIZE} GPU")

    def warning_line(self, gpus: int = WORLD_SIZE) -> str | None:
        """The one line naming what the simulation leaves out, or None when it models every key; with
        several `gpus`, also the keys that have no effect on one GPU only (keys.ONE_GPU_NO_EFFECT)."""
        parts = []
        if self.not_modelled:
            parts.append(f"not modelled: {', '.join(self.not_modelled)}")
        if gpus > 1 and self.one_gpu_only:
            parts.append(f"not modelled on {gpus} GPUs (no effect on one): {', '.join(self.one_gpu_only)}")
        if self.unknown:
            parts.append(f"unknown to DeepSpeed (ignored): {', '.join(self.unknown)}")
        if not parts:
            return None
        return f"{self.source}: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {"source": self.source, "stage": self.stage, "offload_param": self.param_device,
                "offload_optimizer": self.optimizer_device, "cpu_checkpointing": self.cpu_checkpointing,
                "train_batch_size": self.batch, "train_micro_batch_size_per_gpu": self.micro_batch,
                "gradient_accumulation_steps": self.accumulation, "precision": self.precision,
                "prefetch_bucket_elems": self.prefetch_bucket_elems, "max_live_elems": self.max_live_elems,
                "pipeline_read": self.pipeline_read, "pipeline_write": self.pipeline_write,
                "sub_group_size": self.sub_group_elems, "reduce_bucket_size": self.reduce_bucket_elems,
                "contiguous_gradients": self.contiguous_gradients,
                "offload_param_buffers": [self.param_buffer_count, self.param_buffer_elems],
                "max_in_cpu": self.max_in_cpu_elems, "params_in_cpu_fraction": self.cached_fraction,
                "offload_optimizer_buffer_count": self.opt_buffer_count,
                "no_effect_on_one_gpu": list(self.one_gpu_only),
                "not_modelled": list(self.not_modelled), "no_effect": list(self.no_effect),
                "unknown": list(self.unknown), "resolved_auto": list(self.resolved),
                "from_command_line": list(self.from_command_line)}


def _one(tier: str) -> Split:
    return Split(**{t: 1.0 if t == tier else 0.0 for t in ("gpu", "cpu", "ssd")})


# ---- reading -----------------------------------------------------------------------------------------------


def read_ds_config(path: str | Path, model: ModelSpec, *, batch_hint: int | None = None,
                   micro_batch_hint: int | None = None) -> DsConfig:
    """Read a DeepSpeed config file. `batch_hint` / `micro_batch_hint` fill "auto" batch keys the config
    itself cannot resolve (the Trainer fills them from its arguments; here the command line's
    --batch / --micro-batch)."""
    name = Path(path).name
    try:  # bounded (hwprofiles.inputs): a regular file or a pipe of at most MAX_DS_CONFIG_BYTES
        text = read_limited_text(path, MAX_DS_CONFIG_BYTES)
    except InputLimitError as e:
        raise DsConfigError(f"{name}: {e}; a DeepSpeed config is a small JSON file") from None
    except UnicodeDecodeError:
        raise DsConfigError(f"{name}: not UTF-8 text; a DeepSpeed config is a JSON file") from None
    except OSError as e:
        raise DsConfigError(f"{name}: cannot read the DeepSpeed config ({e.strerror or e}); "
                            "check the path") from None
    try:
        data = loads_json_limited(text)
    except InputLimitError as e:
        raise DsConfigError(f"{name}: {e}; a DeepSpeed config nests a few levels") from None
    except json.JSONDecodeError as e:
        raise DsConfigError(f"{name}: not JSON ({e.msg} at line {e.lineno} column {e.colno}); a DeepSpeed "
                            "config is one JSON object") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise DsConfigError(f"{name}: not JSON that can be read ({e}); a DeepSpeed config is one JSON "
                            "object") from None
    return parse_ds_config(data, name, model, batch_hint=batch_hint, micro_batch_hint=micro_batch_hint)


def parse_ds_config(data: object, source: str, model: ModelSpec, *, batch_hint: int | None = None,
                    micro_batch_hint: int | None = None) -> DsConfig:
    if not isinstance(data, dict):
        raise DsConfigError(f"{source}: a DeepSpeed config is a JSON object ({{...}}), "
                            f"got {_json_kind(data)}")
    leaves = _flatten(data, "")
    zero = data.get("zero_optimization", {})
    if isinstance(zero, bool):  # the deprecated form "zero_optimization": true means stage 1
        leaves.pop("zero_optimization", None)
        leaves["zero_optimization.stage"] = 1 if zero else 0
    resolved: list[str] = []
    # "auto" values: resolvable ones are resolved, the batch keys below, any other that matters is refused
    for key, value in list(leaves.items()):
        if value != AUTO:
            continue
        if key in HIDDEN_AUTO:
            how, fn = HIDDEN_AUTO[key]
            leaves[key] = fn(model.hidden)
            resolved.append(f"{key}={leaves[key]} ({how}, h={model.hidden})")
        elif key in PRECISION_AUTO:
            resolved.append(f"{key} (16-bit, as the Trainer's --bf16/--fp16 sets it)")
        elif key in MODELLED and key not in BATCH_KEYS:
            raise DsConfigError(f"{source}: {key} is \"auto\", which only the batch keys, bf16/fp16.enabled "
                                "and the hidden-size keys can be (as Hugging Face's Trainer fills them); "
                                "set a value")
    not_modelled, no_effect, one_gpu, unknown = _classify(leaves)

    stage = _int(leaves, "zero_optimization.stage", DS_STAGE, source, lo=0, hi=3)
    if stage > 3:
        raise DsConfigError(f"{source}: zero_optimization.stage {stage}: "
                            "DeepSpeed's ZeRO stages are 0, 1, 2 and 3")
    param_device = _device(leaves, "zero_optimization.offload_param.device", source)
    optimizer_device = _device(leaves, "zero_optimization.offload_optimizer.device", source)
    if leaves.get("zero_optimization.cpu_offload") is True and optimizer_device == "none":
        optimizer_device = "cpu"  # deprecated spelling of offload_optimizer: {device: cpu} (zero/config.py)
    if leaves.get("zero_optimization.cpu_offload_param") is True and param_device == "none":
        param_device = "cpu"
    if param_device != "none" and stage != 3:
        raise DsConfigError(f"{source}: zero_optimization.offload_param.device {param_device} needs "
                            f"zero_optimization.stage 3, got stage {stage} (DeepSpeed offloads parameters in "
                            "ZeRO stage 3 only); set stage 3 or remove offload_param")
    if optimizer_device != "none" and stage == 0:
        raise DsConfigError(f"{source}: zero_optimization.offload_optimizer.device {optimizer_device} needs "
                            "ZeRO stage 1, 2 or 3, got stage 0; set a stage or remove offload_optimizer")
    if optimizer_device == "nvme" and stage != 3:
        raise DsConfigError(f"{source}: zero_optimization.offload_optimizer.device nvme with stage {stage}: "
                            "NVMe offload is ZeRO-Infinity, stage 3 (tierflow does not simulate it below); "
                            "set stage 3")
    if param_device != "none" and optimizer_device == "none":
        raise DsConfigError(f"{source}: offload_param.device {param_device} without offload_optimizer: "
                            "tierflow cannot simulate a GPU optimizer with the parameters off the GPU; "
                            "offload the optimizer too (offload_optimizer.device cpu or nvme)")

    bf16 = leaves.get("bf16.enabled", leaves.get("bfloat16.enabled", False))
    fp16 = leaves.get("fp16.enabled", False)
    if bf16 is True and fp16 is True:
        raise DsConfigError(f"{source}: bf16.enabled and fp16.enabled are both true; DeepSpeed refuses that "
                            "(pick one)")
    if bf16 is True:
        precision = "bf16"
    elif fp16 is True:
        precision = "fp16"
    elif AUTO in (bf16, fp16):
        precision = "16-bit (auto)"
    else:
        # 4-byte tensors, the fp32 GEMM peak. With ZeRO (stage >= 1) DeepSpeed's optimizer clones an fp32
        # master partition even of fp32 weights (stage_1_and_2.py:400-401, stage3.py:901-905: `.clone()
        # .float()`, DeepSpeed 0.16.5); without ZeRO the engine keeps the client optimizer unwrapped for fp32
        # (engine.py:1346 "optimizer_wrapper = None", 1398), which steps the weights in place
        precision = "fp32" if stage > 0 else "fp32-inplace"
    opt_type = leaves.get("optimizer.type")
    if opt_type is not None and str(opt_type).lower() not in ADAM_TYPES:
        not_modelled.append(f"optimizer.type={opt_type} (simulated as Adam)")

    cpu_ckpt = leaves.get("activation_checkpointing.cpu_checkpointing", False)
    if not isinstance(cpu_ckpt, bool):
        raise DsConfigError(f"{source}: activation_checkpointing.cpu_checkpointing {_show(cpu_ckpt)}: "
                            "expected true or false")
    bucket = _int(leaves, "zero_optimization.stage3_prefetch_bucket_size", DS_PREFETCH_BUCKET_ELEMS, source,
                  lo=0)
    max_live = _int(leaves, "zero_optimization.stage3_max_live_parameters", DS_MAX_LIVE_ELEMS, source, lo=0)
    if param_device == "cpu" and min(bucket, max_live) == 0:
        not_modelled.append("no parameter prefetch "
                            "(stage3_prefetch_bucket_size 0: simulated one layer ahead)")
    batch, micro, accum, from_cli = _batch_split(leaves, source, batch_hint, micro_batch_hint, resolved)
    pipeline = {k: _flag(leaves, f"zero_optimization.offload_optimizer.{k}", source)
                for k in ("pipeline_read", "pipeline_write")}
    sub_group = _int(leaves, "zero_optimization.sub_group_size", DS_SUB_GROUP_ELEMS, source, lo=1)
    if (leaves.get("gradient_clipping", 0) not in (0, None) and stage == 0 and precision == "fp32-inplace"
            and "gradient_clipping" in no_effect):  # the engine clips on its own (keys.NO_STEP_EFFECT)
        no_effect.remove("gradient_clipping")
        not_modelled.append("gradient_clipping (without ZeRO in fp32: engine.py clip_fp32_gradients)")
    buffers = _buffer_keys(leaves, source, model, param_device, optimizer_device,
                           (pipeline["pipeline_read"], pipeline["pipeline_write"]), sub_group, precision)
    return DsConfig(source=source, stage=stage, param_device=param_device, optimizer_device=optimizer_device,
                    **pipeline, sub_group_elems=sub_group, **buffers, one_gpu_only=tuple(one_gpu),
                    cpu_checkpointing=cpu_ckpt, batch=batch, micro_batch=micro, accumulation=accum,
                    precision=precision, prefetch_bucket_elems=bucket, max_live_elems=max_live,
                    not_modelled=tuple(not_modelled), no_effect=tuple(no_effect), unknown=tuple(unknown),
                    resolved=tuple(resolved), from_command_line=tuple(from_cli))


def _buffer_keys(leaves: dict, source: str, model: ModelSpec, param_device: str, optimizer_device: str,
                 pipelined: tuple[bool, bool], sub_group: int, precision: str) -> dict:
    """The keys that size DeepSpeed's own buffers (keys.MODELLED_KEYS) as DsConfig fields, refused where
    DeepSpeed itself stops; with parameters on NVMe, the share max_in_cpu keeps in host memory."""
    bucket = _int(leaves, Z + "reduce_bucket_size", DS_REDUCE_BUCKET_ELEMS, source, lo=0)
    out = {"reduce_bucket_elems": bucket,
           "contiguous_gradients": _flag(leaves, Z + "contiguous_gradients", source, default=True),
           "param_buffer_count": _int(leaves, OP + "buffer_count", DS_PARAM_BUFFER_COUNT, source, lo=0),
           "param_buffer_elems": _int(leaves, OP + "buffer_size", DS_PARAM_BUFFER_ELEMS, source, lo=0),
           "max_in_cpu_elems": _int(leaves, OP + "max_in_cpu", DS_MAX_IN_CPU_ELEMS, source, lo=0),
           "opt_buffer_count": _int(leaves, OO + "buffer_count", DS_OPT_BUFFER_COUNT, source, lo=0),
           # another value than false is DeepSpeed's default as far as the bridge goes (keys.py: modelled at
           # the default; false is named as not modelled for its copy rates)
           "opt_pin_memory": leaves.get(OO + "pin_memory", True) is not False}
    owned = [b.owned_params for b in blocks_of(model, 1, model.seq_len)]
    groups = ds_sub_groups(owned, sub_group)
    if param_device == "nvme":
        elem_bytes = 4 if precision.startswith("fp32") else 2
        block = _int(leaves, "aio.block_size", DS_AIO_BLOCK_BYTES, source, lo=0)
        largest = largest_param_elems(model)
        if out["param_buffer_count"] < 1:
            raise DsConfigError(f"{source}: {OP}buffer_count 0 with parameters on NVMe: DeepSpeed has no "
                                "buffer to swap a parameter into (partitioned_param_swapper.py get_buffer); "
                                "set 1 or more")
        if largest * elem_bytes >= max(DS_MIN_AIO_BYTES, block) and largest > out["param_buffer_elems"]:
            raise DsConfigError(
                f"{source}: {OP}buffer_size {out['param_buffer_elems']:,} is below {model.name}'s largest "
                f"parameter ({largest:,} elements): DeepSpeed stops at start-up "
                "(partitioned_param_swapper.py get_buffer: 'More elements ... than buffer size'); "
                f"set buffer_size to {largest:,} or more")
        out["cached_elems"] = ds_cached_elems(owned, groups, out["max_in_cpu_elems"])
        out["cached_fraction"] = out["cached_elems"] / sum(owned)
    if optimizer_device == "nvme":
        # with several sub-groups, pipeline_read holds the next one's buffers, pipeline_write the previous
        # one's until this one's swap-out (pipelined_optimizer_swapper.py swap_in/swap_out_optimizer_state)
        ahead = sum(pipelined) if max(groups) > 0 else 0
        need = DS_OPT_SWAP_TENSORS * (1 + ahead)
        if out["opt_buffer_count"] < need:
            why = " with pipeline_read/write and several sub-groups" if ahead else ""
            raise DsConfigError(
                f"{source}: {OO}buffer_count {out['opt_buffer_count']} is below the {need} swap buffers "
                f"DeepSpeed's optimizer swapper takes{why} (master, m, v and the gradient of each sub-group "
                "in flight: partitioned/pipelined_optimizer_swapper.py); it stops at the first step; "
                f"set {need} or more")
    return out


def largest_param_elems(model: ModelSpec) -> int:
    """The elements of the model's largest parameter tensor: the token embedding (or an untied head of its
    size), the position table, or an MLP matrix."""
    return max(model.vocab_size * (model.embed_proj_dim or model.hidden), model.max_positions * model.hidden,
               model.hidden * model.ffn_hidden)


def _classify(leaves: dict) -> tuple[list[str], list[str], list[str], list[str]]:
    """The config's keys as not modelled, without effect on a step, without effect on one GPU, and unknown to
    DeepSpeed (dskeys)."""
    not_modelled, no_effect, one_gpu, unknown = [], [], [], []
    for key, value in leaves.items():
        if key in ASSUMED_DEFAULTS:
            if not _same(value, ASSUMED_DEFAULTS[key][0]):
                not_modelled.append(f"{key}={_show(value)}")
        elif key in MODELLED:
            continue
        elif key in NO_EFFECT or any(key.startswith(k + ".") for k in NO_EFFECT):
            no_effect.append(key)
        elif key in ONE_GPU_NO_EFFECT:
            one_gpu.append(key)
        elif key in NOT_MODELLED:
            not_modelled.append(key)
        else:
            unknown.append(key)
    return not_modelled, no_effect, one_gpu, unknown


def _flag(leaves: dict, key: str, source: str, default: bool = False) -> bool:
    """A boolean key (`default` when absent, DeepSpeed's); DsConfigError for anything else."""
    value = leaves.get(key, default)
    if not isinstance(value, bool):
        raise DsConfigError(f"{source}: {key} {_show(value)}: expected true or false")
    return value


def _flatten(data: dict, prefix: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if v is None and key in SECTIONS:  # e.g. "offload_param": null, DeepSpeed's own default
            continue
        if isinstance(v, dict) and key in SECTIONS:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _json_kind(v: object) -> str:
    return {list: "a list", str: "a string", bool: "a boolean", type(None): "null", int: "a number",
            float: "a number"}.get(type(v), type(v).__name__)


def _show(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return json.dumps(v) if isinstance(v, (str, bool, list, dict)) or v is None else str(v)


def _same(a: object, b: object) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return a == b


def _int(leaves: dict, key: str, default: int, source: str, *, lo: int, hi: int = MAX_ELEMS) -> int:
    return _checked_int(leaves.get(key, default), key, source, lo, hi)


def _checked_int(v: object, key: str, source: str, lo: int, hi: int, also: str = "") -> int:
    """`v` as an integer within [lo, hi] (the bounds of the matching flag), else one line naming the file and
    the key (NaN, infinity and numbers past the bound included)."""
    ok = (not isinstance(v, bool) and isinstance(v, (int, float))
          and (not isinstance(v, float) or math.isfinite(v)) and lo <= v <= hi and v == int(v))
    if not ok:
        raise DsConfigError(f"{source}: {key} {_show(v)}: expected an integer from {lo} to {hi:,}{also}")
    return int(v)


def _device(leaves: dict, key: str, source: str) -> str:
    v = leaves.get(key, DS_OFFLOAD_DEVICE)
    if v is None:
        return "none"
    if not isinstance(v, str) or v.lower() not in DS_DEVICES:
        raise DsConfigError(f"{source}: {key} {_show(v)}: expected one of {', '.join(DS_DEVICES)}")
    return v.lower()


def _batch_split(leaves: dict, source: str, batch_hint: int | None, micro_hint: int | None,
                 resolved: list[str]) -> tuple[int, int, int, list[str]]:
    """train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps as DeepSpeed sets them
    (runtime/config.py `_set_batch_related_parameters`, then `_batch_assertion`), on one GPU, after resolving
    "auto" from the other two keys or, failing that, from the command line's batch and micro-batch."""
    tb, mb, ga = (leaves.get(k) for k in BATCH_KEYS)
    tb, mb, ga = (v if v is None or v == AUTO else _checked_int(v, key, source, 1, MAX_BATCH, ' or "auto"')
                  for key, v in zip(BATCH_KEYS, (tb, mb, ga)))
    autos = [k for k, v in zip(BATCH_KEYS, (tb, mb, ga)) if v == AUTO]
    from_cli: list[str] = []
    if (len(autos) == 1 and all(isinstance(v, int) for v in (tb, mb, ga) if v != AUTO)
            and None not in (tb, mb, ga)):
        # one "auto" between two numbers: the identity batch = micro x accumulation x world fixes it
        if tb == AUTO:
            tb = mb * ga * WORLD_SIZE
        elif mb == AUTO:
            mb = _exact(tb, ga * WORLD_SIZE, source, "train_micro_batch_size_per_gpu")
        else:
            ga = _exact(tb, mb * WORLD_SIZE, source, "gradient_accumulation_steps")
        resolved.append(f"{autos[0]}={ {BATCH_KEYS[0]: tb, BATCH_KEYS[1]: mb, BATCH_KEYS[2]: ga}[autos[0]] } "
                        "(from the other batch keys)")
    elif autos:
        # the Trainer fills these from its arguments; here from --micro-batch and --batch
        if mb == AUTO:
            if micro_hint is None:
                raise DsConfigError(f"{source}: train_micro_batch_size_per_gpu is \"auto\" and cannot be "
                                    "resolved; set it, or pass --micro-batch")
            mb = micro_hint
            from_cli.append(f"train_micro_batch_size_per_gpu={mb}")
        if tb == AUTO and isinstance(ga, int) and isinstance(mb, int):
            tb = mb * ga * WORLD_SIZE
            resolved.append(f"train_batch_size={tb} (from the other batch keys)")
        elif tb == AUTO:
            if batch_hint is None:
                raise DsConfigError(f"{source}: train_batch_size is \"auto\" and cannot be resolved; set it, "
                                    "or pass --batch")
            tb = batch_hint
            from_cli.append(f"train_batch_size={tb}")
        if ga == AUTO:
            if tb is None or mb is None:
                unset = "train_batch_size" if tb is None else "train_micro_batch_size_per_gpu"
                raise DsConfigError(f"{source}: gradient_accumulation_steps is \"auto\" but {unset} is not "
                                    "set, so it cannot be resolved; set both batch keys or a number")
            ga = _exact(tb, mb * WORLD_SIZE, source, "gradient_accumulation_steps")
            resolved.append(f"gradient_accumulation_steps={ga} (train_batch_size / micro-batch)")
    # DeepSpeed's rules for keys that are absent
    if tb is not None and mb is not None and ga is not None:
        pass
    elif tb is not None and mb is not None:
        ga = _exact(tb, mb * WORLD_SIZE, source, "gradient_accumulation_steps")
    elif tb is not None and ga is not None:
        mb = _exact(tb, ga * WORLD_SIZE, source, "train_micro_batch_size_per_gpu")
    elif mb is not None and ga is not None:
        tb = mb * ga * WORLD_SIZE
    elif tb is not None:
        mb, ga = tb // WORLD_SIZE, 1
    elif mb is not None:
        tb, ga = mb * WORLD_SIZE, 1
    else:
        raise DsConfigError(f"{source}: neither train_batch_size nor train_micro_batch_size_per_gpu is set; "
                            "DeepSpeed needs one of them")
    if mb * ga * WORLD_SIZE > MAX_BATCH:
        raise DsConfigError(f"{source}: train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps "
                            f"{ga} = {mb * ga * WORLD_SIZE:,} sequences, above the limit of {MAX_BATCH:,} "
                            "(as --batch's); lower them")
    if tb != mb * ga * WORLD_SIZE:
        raise DsConfigError(f"{source}: train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} x "
                            f"gradient_accumulation_steps {ga} x {WORLD_SIZE} GPU "
                            f"(= {mb * ga * WORLD_SIZE}); make them agree (tierflow simulates one GPU)")
    return tb, mb, ga, from_cli


def _exact(total: int, part: int, source: str, key: str) -> int:
    if total % part:
        raise DsConfigError(f"{source}: {key} would be {total} / {part}, not an integer; set the batch keys "
                            "so that train_batch_size = micro-batch x accumulation x 1 GPU")
    return total // part


# ---- writing -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmittedDsConfig:
    """The nearest DeepSpeed config for a plan, and what of the plan it cannot say."""

    config: dict
    inexpressible: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        z = self.config["zero_optimization"]
        dev = lambda k: z.get(k, {}).get("device", "none")  # noqa: E731
        return (f"ZeRO stage {z['stage']}, offload_param {dev('offload_param')}, offload_optimizer "
                f"{dev('offload_optimizer')}, cpu_checkpointing "
                f"{str(self.config['activation_checkpointing']['cpu_checkpointing']).lower()}, batch "
                f"{self.config['train_batch_size']} = {self.config['gradient_accumulation_steps']} x "
                f"{self.config['train_micro_batch_size_per_gpu']}")


def _device_of(*splits: Split) -> str:
    """One DeepSpeed device for tensors a plan may split over tiers: the slowest tier holding any part (the
    one that surely has the room for all of it)."""
    if any(s.ssd > 0 for s in splits):
        return "nvme"
    if any(s.cpu > 0 for s in splits):
        return "cpu"
    return "none"


def _fractions(name: str, s: Split) -> str | None:
    tiers = [f"{t} {getattr(s, t):.0%}" for t in ("gpu", "cpu", "ssd") if getattr(s, t) > 0]
    return f"{name} {' '.join(tiers)}" if len(tiers) > 1 else None


def ds_config_for_plan(model: ModelSpec, cfg: ScheduleConfig) -> EmittedDsConfig:
    """The nearest DeepSpeed config for schedule `cfg` of `model` (a plan's decisions), and the decisions
    DeepSpeed cannot express."""
    p = cfg.placement
    param_dev = _device_of(p.weights)
    opt_dev = _device_of(p.master, p.adam_m, p.adam_v)
    if param_dev != "none" and opt_dev == "none":  # cannot happen for a valid placement (GPU optimizer)
        opt_dev = "cpu"
    cpu_ckpt = p.checkpoints.gpu < 1.0
    zero: dict = {"stage": 3}
    if param_dev != "none":
        zero["offload_param"] = {"device": param_dev, "pin_memory": True}
        if param_dev == "nvme":
            # a swap buffer must hold the largest parameter (DeepSpeed stops otherwise), and max_in_cpu keeps
            # the plan's CPU share of the weights in host memory (DeepSpeed's default 1e9 would keep more)
            zero["offload_param"].update(nvme_path=EMIT_NVME_PATH,
                                         buffer_size=max(DS_PARAM_BUFFER_ELEMS, largest_param_elems(model)),
                                         max_in_cpu=int(p.weights.cpu * model.total_params()))
            if p.weights.cpu > 0:  # sub-groups of one layer, so that max_in_cpu can hold whole layers
                zero["sub_group_size"] = model.layer_params()
        else:  # prefetch as many layers ahead as the plan does
            zero["stage3_prefetch_bucket_size"] = cfg.prefetch_depth * model.layer_params()
    if opt_dev != "none":
        zero["offload_optimizer"] = {"device": opt_dev, "pin_memory": True}
        if opt_dev == "nvme":
            zero["offload_optimizer"]["nvme_path"] = EMIT_NVME_PATH
    config = {
        "train_batch_size": cfg.batch,
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": cfg.num_micro_batches,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "activation_checkpointing": {"cpu_checkpointing": cpu_ckpt},
    }
    out: list[str] = []
    if cfg.group > 1:
        order = "vertical" if cfg.group == cfg.num_micro_batches else "block"
        out.append(f"the {order} order ({cfg.group} micro-batches through a layer before the next; DeepSpeed "
                   "runs one micro-batch through every layer)")
    if cfg.optimizer_overlap:
        out.append("the optimizer overlapped with the backward (DeepSpeed steps it after the whole backward)")
    if cfg.alpha > 0:
        out.append(f"alpha deferral ({cfg.alpha:.0%} of each layer's Adam step in the next forward)")
    if cfg.recompute and cfg.swap_layers:
        out.append(f"per-layer swap-vs-recompute ({cfg.swap_layers} of {model.num_layers} layers keep their "
                   "activations; the model's code decides checkpointing, not the config)")
    if not cfg.recompute:
        out.append("no recompute (activation checkpointing is switched in the model's code, not the config)")
    fracs = [f for f in (_fractions(n, getattr(p, n)) for n in ("weights", "master", "adam_m", "adam_v",
                                                                 "checkpoints")) if f]
    if fracs:
        out.append(f"fractional placements ({'; '.join(fracs)}): written as offload_param {param_dev}, "
                   f"offload_optimizer {opt_dev}, cpu_checkpointing {str(cpu_ckpt).lower()}")
    if p.checkpoints.ssd > 0:
        out.append("activation checkpoints on the SSDs (DeepSpeed keeps them on the GPU or in CPU memory)")
    grads_dev = _device_of(p.grads) if p.grads.gpu < 1.0 else "none"
    if grads_dev != opt_dev:
        out.append(f"gradients {TIER_WORDS[DEVICE_TIER[grads_dev]]} (DeepSpeed keeps them with the optimizer "
                   f"states, {TIER_WORDS[DEVICE_TIER[opt_dev]]})")
    if p.weights.ssd > 0 and cfg.runtime != "deepspeed":
        out.append("weights read from the SSDs ahead of use (DeepSpeed fetches NVMe parameters on demand)")
    if p.master.ssd > 0 and cfg.runtime != "deepspeed":
        out.append("optimizer states streamed to and from the SSDs while Adam runs (DeepSpeed reads, steps "
                   "and writes one sub-group after the other)")
    return EmittedDsConfig(config=config, inexpressible=tuple(out))


def write_ds_config(path: str | Path, emitted: EmittedDsConfig) -> None:
    """The config as JSON, written atomically (tierflow.outputs)."""
    atomic_write_text(path, json.dumps(emitted.config, indent=2) + "\n")
