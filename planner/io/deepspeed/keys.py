"""What each DeepSpeed config key does to the time of a training step, as DeepSpeed 0.19.8's code runs it:
the classes the bridge (config.py) sorts a config's keys into, each key with its reason and a code
reference, and the key-by-key table of docs/deepspeed.md generated from them (`key_table`).

- MODELLED_KEYS: simulated by `runtime: deepspeed` (the mechanism named);
- ASSUMED_DEFAULTS: simulated at DeepSpeed's default value; another value is named as not modelled;
- NO_STEP_EFFECT: read by DeepSpeed, but the work of a step is the same whatever their value (accepted
  quietly, as the learning rate or logging keys of config.NO_EFFECT);
- ONE_GPU_NO_EFFECT: collectives or layouts among ranks: nothing to do on one GPU, which the bridge simulates;
  named in the warning line for a config of several GPUs;
- NOT_MODELLED: named in the warning line whenever present, with what would settle them here.

File references are to deepspeed/ of DeepSpeed 0.19.8 (runtime/zero/stage3.py unless another file is named).
"""

from __future__ import annotations

from dataclasses import dataclass

Z = "zero_optimization."
OP = Z + "offload_param."
OO = Z + "offload_optimizer."

# Keys the simulation reads and what it does with them (the batch and device keys: config.MODELLED).
MODELLED_KEYS: dict[str, str] = {
    Z + "reduce_bucket_size": (
        "gradients leave for the host in buckets of this many elements, the last after the backward, and the "
        "host waits on the oldest bucket when too many are in flight (__reduce_and_partition_ipg_grads, "
        "max_param_reduce_events); with contiguous_gradients the GPU holds a bucket of this size"),
    Z + "contiguous_gradients": (
        "the GPU bucket buffer of reduce_bucket_size elements exists only with it "
        "(DeepSpeedZeroOptimizer_Stage3.__init__: `if self.contiguous_gradients: bucket.buffer = "
        "torch.empty(...)`). The copy of each gradient into that buffer on the reduce stream "
        "(__add_grad_to_ipg_bucket) is not timed: 2 x the gradient's bytes of GPU memory traffic beside the "
        "backward, about 0.1 s a micro-batch for a 13B bf16 model at 1 TB/s"),
    OP + "buffer_size": (
        "the size of each parameter swap buffer (host memory, with buffer_count); a parameter larger than it "
        "stops DeepSpeed at start-up (partitioned_param_swapper.py get_buffer: 'More elements ... than "
        "buffer size'), so the bridge refuses a buffer_size below the model's largest parameter"),
    OP + "max_in_cpu": (
        "with parameters on NVMe, the leading whole sub-groups whose running total stays within max_in_cpu "
        "elements stay in pinned host memory for the whole run (_create_param_groups_fp16_flat_cpu_memory, "
        "_create_fp16_partitions_with_defragmentation): the placement's weights cpu fraction, those blocks "
        "fetched and prefetched as CPU-offloaded parameters, the rest read from NVMe on demand. Measured "
        "(results/ds_mechanisms.txt): at the default, none of a 2 x 1024 bf16 model's 23.2M parameters was "
        "on NVMe after start-up; with 0, 23.07M were"),
    Z + "stage3_prefetch_bucket_size": (
        "parameters in host memory are prefetched min(this, stage3_max_live_parameters) elements ahead, in "
        "whole decoder layers, one at least (DsConfig.prefetch_depth; fetch_sub_module's prefetch loop, "
        "partitioned_param_coordinator.py). On one GPU the prefetch is an async copy of the pinned partition "
        "(partition_parameters.py NoGatherCoalescedHandle) issued after the wait for the module's own "
        "parameters, and that wait synchronizes the whole all-gather stream (the handle's "
        "`current_stream().synchronize()` under `stream(allgather_stream)`): a layer's compute waits for "
        "the whole bucket issued at the hook before it, so a bucket deeper than a layer holds the compute "
        "instead of running ahead (runtimes/deepspeed.py _ds_drained_at_next_hook). Not modelled: each "
        "module hook "
        "issues up to a bucket of new elements, so the frontier can run past one bucket up to "
        "max_live_parameters; 0 (no prefetch) is named as not modelled"),
    Z + "stage3_max_live_parameters": (
        "bounds the prefetch with stage3_prefetch_bucket_size (`min(max_live - available, bucket)` elements "
        "a hook may issue, fetch_sub_module): the smaller of the two sets the prefetch depth in layers"),
    OO + "buffer_count": (
        "the optimizer swapper's pinned host buffers of the largest sub-group "
        "(swap_tensor/optimizer_utils.py SwapBufferManager), counted in host memory. Each sub-group in "
        "flight takes 4 of them (master, m, v and the gradient: partitioned_optimizer_swapper.py "
        "swap_in_optimizer_state); fewer than 4, or fewer than 8 with pipeline_read/write and several "
        "sub-groups, stops DeepSpeed at the first step and is refused; more add no overlap"),
}

# Keys simulated at DeepSpeed's default; any other value is named as not modelled, with the reason.
ASSUMED_DEFAULTS: dict[str, tuple[object, str]] = {
    Z + "stage3_max_reuse_distance": (1_000_000_000, (
        "the parameters kept on the GPU where the forward turns into the backward are counted at the "
        "default's 1e9 elements (memory.DS_MAX_REUSE_DISTANCE_ELEMS); another value changes which layers "
        "are fetched again at the turn (partitioned_param_coordinator.py __params_to_release): settles: "
        "per-parameter release in the weight-use model")),
    Z + "overlap_comm": (True, (
        "false runs the gradient reduce and copy on the compute stream, in series with the backward "
        "(__reduce_and_partition_ipg_grads); settles: a serialising variant of _ds_grad_bucket checked "
        "against a DeepSpeed trace on a GPU")),
    OO + "ratio": (1.0, (
        "below 1 part of the optimizer step stays on the GPU (ZeRO-Offload++ twin-flow); settles: a "
        "fractional master placement stepped on both devices, timed against DeepSpeed on a GPU")),
    OO + "pin_memory": (True, (
        "true (the default) page-locks the gradient partitions' host buffer through torch's caching host "
        "allocator, which rounds it up to a power of two, and holds it pageable and pinned at once while it "
        "copies (stage3.py `get_accelerator().pin_memory(torch.zeros(...))`; counted in host memory and "
        "checked at set-up on a CUDA box: dsruntime.deepspeed_setup_peak_bytes); "
        "false leaves the gradient partitions' host buffer pageable (`if self.offload_optimizer_pin_memory: "
        "... pin_memory(self.grad_partitions_flat_buffer)`), so every gradient copy runs at the pageable "
        "rate; settles: a pageable copy rate in the profile, measured by calibrate on the GPU box")),
}

# Read by DeepSpeed, no change to the work of a step (any number of GPUs).
NO_STEP_EFFECT: dict[str, str] = {
    OP + "pin_memory": (
        "the host copy of the parameters is pinned whatever its value: "
        "_create_param_groups_fp16_flat_cpu_memory pins the flat buffer unconditionally "
        "(get_accelerator().pin_memory) and the NVMe swap buffers are page-locked by the aio handle "
        "(partitioned_param_swapper.py new_cpu_locked_tensor)"),
    "gradient_clipping": (
        "with ZeRO or 16-bit training the optimizer computes the gradient norm and scales every gradient "
        "every step whatever the value (step: _get_norm_groups, unscale_and_clip_grads multiplies by "
        "1/combined_scale); the value only changes the factor. engine.py _take_model_step clips on its own "
        "only without ZeRO in fp32 (named as not modelled there)"),
    "fp16.loss_scale": (
        "the scale's value: the fp16 overflow check and the unscaling pass run every step whatever it is "
        "(_overflow_check_and_loss_scale_update, unscale_and_clip_grads); a step that overflows skips its "
        "optimizer, which depends on the data, not on the config"),
    "fp16.initial_scale_power": "as fp16.loss_scale: the dynamic scale's first value",
    "fp16.loss_scale_window": "as fp16.loss_scale: when the dynamic scale grows",
    "fp16.hysteresis": "as fp16.loss_scale: how many overflows before the dynamic scale shrinks",
    "fp16.consecutive_hysteresis": "as fp16.loss_scale: how the hysteresis is refilled",
    "fp16.min_loss_scale": "as fp16.loss_scale: the dynamic scale's floor",
    Z + "zero_quantized_nontrainable_weights": (
        "quantizes only parameters that do not train (partition_parameters.py _partition_param: `if not "
        "param.requires_grad and self.quantized_nontrainable_weights`); the simulation trains every "
        "parameter"),
}

# Collectives or layouts among ranks: nothing to do on the one GPU the bridge simulates.
ONE_GPU_NO_EFFECT: dict[str, str] = {
    Z + "reduce_scatter": (
        "how the ranks' gradients are summed (__avg_scatter_grads vs __avg_scatter_contiguous_grads); one "
        "rank keeps its own"),
    Z + "allgather_partitions": "ZeRO-1/2's parameter all-gather (runtime/utils.py all_gather_dp_groups "
                                "returns at dp_world_size == 1); ZeRO-3 does not read it",
    Z + "allgather_bucket_size": "the bucket of ZeRO-1/2's all-gather (runtime/utils.py all_gather_dp_groups "
                                 "returns at dp_world_size == 1)",
    Z + "round_robin_gradients": "ZeRO-1/2's assignment of gradient partitions to ranks "
                                 "(stage_1_and_2.py __init__)",
    Z + "use_multi_rank_bucket_allreduce": "ZeRO-1/2's bucketed all-reduce among ranks",
    Z + "stage3_use_all_reduce_for_fetch_params": (
        "an all-reduce instead of an all-gather to fetch parameters; with one rank no collective runs "
        "(partition_parameters.py all_gather_coalesced: `_partition_world_size(param) == 1` -> "
        "_no_gather_coalesced)"),
    Z + "stage3_allgather_sequential": "one all-gather per parameter instead of coalesced; with one rank "
                                       "none runs (all_gather_coalesced -> _no_gather_coalesced)",
    Z + "zero_quantized_weights": "quantized parameter all-gather (ZeRO++ qwZ); with one rank none runs "
                                  "(all_gather_coalesced -> _no_gather_coalesced)",
    Z + "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning: a secondary copy within a node of "
                                   "several GPUs",
    Z + "mics_shard_size": "MiCS: sharding within a group of GPUs",
    Z + "mics_hierarchical_params_gather": "MiCS: its hierarchical all-gather among GPUs",
    Z + "zeropp_loco_param": "ZeRO++ LoCo: error feedback of the quantized gradient reduce among ranks",
    "disable_allgather": "ZeRO-1/2's parameter all-gather among ranks",
    "sparse_gradients": "the sparse all-reduce of embedding gradients among ranks (engine.py "
                        "allreduce_gradients)",
    "seq_parallel_communication_data_type": "the dtype of sequence-parallel collectives among GPUs",
    "pipeline": "pipeline parallelism: stages on several GPUs (runtime/pipe)",
    "tensor_parallel": "tensor parallelism (AutoTP): a layer split over several GPUs",
    "expert_parallel": "experts of a mixture-of-experts model spread over several GPUs",
}

# Named in the warning line whenever present: why, and what would settle them here.
NOT_MODELLED: dict[str, str] = {
    OP + "buffer_count": (
        "its host memory is counted (the parameter swapper's pinned buffers, buffer_count x buffer_size "
        "elements: swap_tensor/partitioned_param_swapper.py __init__; 0 is refused), the read-ahead it "
        "allows is not: the simulator fetches NVMe parameters on demand. Measured "
        "(experiments/ds_mechanisms.py, results/ds_mechanisms.txt: 2 x 1024 bf16, max_in_cpu 0): with 10 "
        "buffers DeepSpeed's NVMe prefetch (partitioned_param_coordinator.py "
        "__prefetch_nvme_param_partitions) had up to 5 parameters in flight, in swap_in calls of up to 5; "
        "with the default 5 it stopped ('Not enough buffers 0 for swapping 1'). Settles: the in-flight count "
        "per module timed on a GPU box, to set a read-ahead depth"),
    "aio.block_size": (
        "with queue_depth and intra_op_parallelism, bounds the bytes DeepSpeed's NVMe reads and writes keep "
        "in flight (ops/aio aio_handle); also the smallest parameter swapped to NVMe "
        "(partitioned_param_swapper.py swappable_tensor: max(1 MiB, block_size)). Measured with DeepSpeed's "
        "own aio_handle on the dev machine's disk (experiments/bench_ds_aio.py, results/bench_ds_aio.csv: "
        "block_size 128 KiB-4 MiB x queue_depth 1-32 x 1-2 threads): from 512 KiB in flight (block_size x "
        "queue_depth x threads), reads 0.99-1.55 GB/s (median 1.09) and writes 2.03-3.07 (median 2.47) "
        "whatever the keys; only 128 KiB requests at depth 1-2 on one thread were slower (reads 0.72-0.88). "
        "An in-flight bound min(R, p q b / (L + b / R)) fitted at depths 1 and 32 predicts depths 2 and 8 "
        "within 5% (median; max 27% reads, 62% writes). So there a rate measured at DeepSpeed's defaults "
        "holds for every setting from 512 KiB in flight; settles: the same bench on the target box, whose "
        "drives may need more in flight"),
    "aio.queue_depth": "as aio.block_size",
    "aio.thread_count": "the aio handle's threads (as intra_op_parallelism): as aio.block_size",
    "aio.intra_op_parallelism": "each request split over this many threads: as aio.block_size",
    "aio.single_submit": "one request per submit call instead of a batch: as aio.block_size",
    "aio.overlap_events": "submits and completions overlapped: as aio.block_size",
    "aio.use_gds": "GPUDirect Storage: NVMe straight to the GPU, past host memory; settles: the box's GDS "
                   "rates",
    Z + "stage3_param_persistence_threshold": (
        "parameters below it stay on the GPU (parameter_offload.py mark_persistent_parameters): in a "
        "decoder layer its biases and norm weights, about 13 h of its 12 h^2 elements (0.02% at h = 5120), "
        "below what the simulation resolves; a threshold above a layer's matrices keeps whole layers on the "
        "GPU (at the default 1e5, every layer of a model of hidden size up to about 150, as tiny-gpt's). "
        "Settles: per-tensor sizes in the model description, so that the persistent share is exact"),
    Z + "stage3_model_persistence_threshold": "the cap on all persistent parameters: as "
                                              "stage3_param_persistence_threshold",
    Z + "stage3_module_granularity_threshold": (
        "modules below it are fetched as one leaf (hooks fewer, fetches larger); settles: per-module hook "
        "costs measured on a GPU"),
    Z + "stage3_partition_stream_chunk_size": "the chunking of partition copies; settles: a DeepSpeed trace",
    Z + "leaf_module": "modules fetched as one leaf: as stage3_module_granularity_threshold",
    Z + "memory_efficient_linear": "DeepSpeed's own linear autograd function (less saved, a recompute); "
                                   "settles: its kernels timed on a GPU",
    Z + "zero_quantized_gradients": "quantized gradient reduce (ZeRO++ qgZ); the quantize kernels may run on "
                                    "one rank too; settles: a trace on a GPU",
    Z + "legacy_stage1": "the old stage-1 implementation",
    Z + "override_module_apply": "wraps module.apply at start-up only; kept here as not modelled until read",
    Z + "save_muon_momentum_buffer_in_memory": "the Muon optimizer, which the simulation does not have",
    Z + "zenflow": "ZenFlow's selective CPU updates: a different optimizer schedule",
    OO + "super_offload": "SuperOffload's CPU optimizer schedule: a different optimizer schedule",
    OO + "convert_grad_on_cpu": "the gradients' dtype conversion on the CPU instead of the GPU; settles: "
                                "the conversion's CPU rate",
    OO + "cpuadam_cores_perc": "the share of cores DeepSpeedCPUAdam uses; the profile's Adam rate is one "
                               "figure; settles: calibrate's Adam rate per thread count",
    "prescale_gradients": "divides each gradient before the reduce: an elementwise GPU pass per micro-batch "
                          "(engine.py / __avg_scatter_grads)",
    "gradient_predivide_factor": "as prescale_gradients (ZeRO-3 with reduce_scatter refuses a factor != 1: "
                                 "DeepSpeedZeroOptimizer_Stage3.__init__)",
    "communication_data_type": (
        "each gradient is cast to it before the reduce even on one rank (__avg_scatter_grads: "
        "g.to(communication_data_type)): a GPU pass, and on several ranks the wire bytes"),
    "data_types": "grad_accum_dtype: the gradient partitions' dtype (bytes of the host buffer and copies)",
    "amp": "NVIDIA apex AMP: a different mixed-precision path",
    "torch_autocast": "torch.autocast: the GEMMs' dtype chosen per op",
    "compile": "torch.compile of the model: kernel fusion",
    "sparse_attention": "a different attention kernel",
    "compression_training": "quantization / pruning during training: different kernels",
    "data_efficiency": "data sampling and routing: changes the tokens per step",
    "curriculum_learning": "changes the sequence length per step",
    "weight_quantization": "quantized weights: different bytes and kernels",
    "hybrid_engine": "RLHF generation engine: a different step",
    "activation_checkpointing.partition_activations": (
        "splits checkpoints over model-parallel ranks; on one GPU the checkpoint is kept whole but copied "
        "(activation_checkpointing/checkpointing.py); settles: its copies timed on a GPU"),
    "activation_checkpointing.contiguous_memory_optimization": "copies checkpoints into one buffer: a device "
                                                               "copy per checkpoint",
    "activation_checkpointing.number_checkpoints": "sizes the contiguous buffer above",
    "activation_checkpointing.synchronize_checkpoint_boundary": "a device synchronize at each checkpoint "
                                                                 "boundary",
    "activation_checkpointing.profile": "timers around each checkpoint (synchronizes)",
    "fp16.auto_cast": "casts the inputs to fp16 (engine.py _cast_inputs_half)",
    "fp16.fp16_master_weights_and_grads": "master weights and gradients in 2 B instead of 4 B",
    "bf16.immediate_grad_update": "BF16_Optimizer's gradient update order (ZeRO 0-1)",
    "bfloat16.immediate_grad_update": "as bf16.immediate_grad_update",
    "bf16.bf16_master_weights_and_grads": "master weights and gradients in 2 B instead of 4 B",
    "bf16.bf16_optimizer_states": "Adam m and v in 2 B instead of 4 B",
    "bf16.check_grad_overflow": "an overflow check pass over the bf16 gradients",
}


@dataclass(frozen=True)
class KeyRow:
    """One key of the table: its class and why."""

    key: str
    verdict: str  # "modelled" | "no effect on a step" | "no effect on one GPU" | "not modelled"
    why: str


def key_rows() -> list[KeyRow]:
    """Every classified key, in the order of the table: modelled, at the default, no effect, one GPU, not
    modelled."""
    rows = [KeyRow(k, "modelled", v) for k, v in MODELLED_KEYS.items()]
    rows += [KeyRow(k, "modelled at DeepSpeed's default", f"default {_value(d)}; another value is not "
                    f"modelled: {why}") for k, (d, why) in ASSUMED_DEFAULTS.items()]
    rows += [KeyRow(k, "no effect on a step", v) for k, v in NO_STEP_EFFECT.items()]
    rows += [KeyRow(k, "no effect on one GPU", v) for k, v in ONE_GPU_NO_EFFECT.items()]
    rows += [KeyRow(k, "not modelled", v) for k, v in NOT_MODELLED.items()]
    return rows


def key_table() -> str:
    """The key-by-key table of docs/deepspeed.md (tests/planner/io/test_dsconfig.py checks the page holds
    it)."""
    lines = ["| key | verdict | mechanism, as DeepSpeed 0.19.8's code runs it |", "|---|---|---|"]
    lines += [f"| `{r.key}` | {r.verdict} | {r.why.replace('|', '/')} |" for r in key_rows()]
    return "\n".join(lines)


def _value(v: object) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int) and v >= 10**6:
        return f"{v:.0e}".replace("+0", "").replace("+", "")
    return str(v)
