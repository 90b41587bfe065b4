"""The public entry points: simulate one schedule, or compare several, for a model on a box."""

from __future__ import annotations

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile, load_profile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.costmodel import CAUSAL_ATTENTION_WORK
from tierflow.planner.core.families import FAMILIES
from tierflow.planner.core.graph import TaskGraph
from tierflow.planner.core.models import ModelSpec, get_model
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulator import SimResult, simulate_graph
from tierflow.planner.core.workload import model_flops_per_token, recompute_flops_per_token

DEFAULT_FAMILIES = ("horizontal", "fuyou", "vertical")
# the largest graph simulated: block passes (iterations x micro-batches x blocks), ~10 KB of memory each
MAX_BLOCK_PASSES = 300_000
BYTES_PER_BLOCK_PASS = 10_000


def resolve(model: ModelSpec | str, hw: HardwareProfile | str) -> tuple[ModelSpec, HardwareProfile]:
    m = model if isinstance(model, ModelSpec) else get_model(model)
    h = hw if isinstance(hw, HardwareProfile) else load_profile(hw)
    return m, h


class GraphTooLarge(TierflowError):
    """A schedule whose task graph would not fit in this process's memory (one line, exit code 2)."""


def check_graph_size(model: ModelSpec, cfg: ScheduleConfig) -> None:
    """Refuse, before building it, a graph of more than MAX_BLOCK_PASSES block passes (iterations x
    micro-batches per rank x blocks): ops and their times grow with them, about 10 KB each (measured peak
    RSS of `tierflow simulate --model tiny-llama --seq 64 --batch 4096 --micro-batch 1 --json`, 73,728 block
    passes: horizontal 0.57 GB, vertical 0.60 GB, fuyou 0.75 GB)."""
    passes = cfg.iterations * cfg.num_micro_batches * (model.num_layers + 2)
    if passes > MAX_BLOCK_PASSES:
        raise GraphTooLarge(
            f"{cfg.num_micro_batches:,} micro-batches of {cfg.micro_batch} x {model.num_layers + 2} blocks x "
            f"{cfg.iterations} iterations = {passes:,} block passes to simulate, above the limit of "
            f"{MAX_BLOCK_PASSES:,} (about {MAX_BLOCK_PASSES * BYTES_PER_BLOCK_PASS / 1e9:.0f} GB); use "
            "larger micro-batches, a smaller batch or fewer --iterations")


def simulate_config(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig,
                    graph: TaskGraph | None = None) -> SimResult:
    """Build the task graph of `cfg` (unless given) and simulate it; fills in tokens and FLOPs. With several
    ranks the graph is one rank's and the tokens and FLOPs are the whole world's (the global batch). The CPU
    Adam steps at the rate of the implementation `cfg.runtime` runs (dsruntime.as_runtime_steps: build_graph
    times the adam ops so, simulate_graph runs the host at it from the graph's meta["runtime"], set here for
    a graph given without it, e.g. a plan file's)."""
    if graph is None:
        check_graph_size(model, cfg)
    graph = graph or build_graph(model, hw, cfg)
    graph.meta.setdefault("runtime", cfg.runtime)
    if cfg.world.ranks > 1:
        graph.meta["world"] = cfg.world.to_dict()
    res = simulate_graph(graph, hw, cfg.world)
    tokens = cfg.batch * cfg.seq
    res.tokens_per_iteration = tokens
    res.model_flops_per_iteration = tokens * model_flops_per_token(model, cfg.seq)
    res.hw_flops_per_iteration = tokens * hardware_flops_per_token(model, cfg.seq,
                                                                   cfg.recomputed_fraction(model.num_layers))
    res.meta.update({"model": model.name, "params": model.total_params(), "hw": hw.name,
                     "schedule": cfg.to_dict()})
    if model.lora is not None:  # what trains (left out for full fine-tuning, whose output stays as it was)
        res.meta.update({"lora": model.lora.to_dict(), "trainable_params": model.adapter_params()})
    return res


def hardware_flops_per_token(model: ModelSpec, seq: int, recomputed: float) -> float:
    """FLOPs per token the GPU executes: the model FLOPs plus the recompute forward of the `recomputed`
    fraction of layers, with attention counted as the kernel the cost model times runs it, the causal part
    only (costmodel.CAUSAL_ATTENTION_WORK of the score and value products). Model FLOPs keep the convention
    of counting the whole score matrix, so hardware TFLOPS, unlike model TFLOPS, never pass the GPU's
    peak."""
    attention = 12.0 * model.num_layers * model.q_dim * seq  # the attention part of model_flops_per_token
    recompute_attention = 4.0 * model.num_layers * model.q_dim * seq  # ... and of recompute_flops_per_token
    dense = model_flops_per_token(model, seq) - attention
    recompute_dense = recompute_flops_per_token(model, seq) - recompute_attention
    causal = CAUSAL_ATTENTION_WORK * (attention + recomputed * recompute_attention)
    return dense + recomputed * recompute_dense + causal


def simulate(model: ModelSpec | str = "gpt3-175b", hw: HardwareProfile | str = "rtx4090-lohan",
             schedule: str = "vertical", *, batch: int = 64, micro_batch: int = 4, seq: int | None = None,
             iterations: int = 3, **options) -> SimResult:
    """Simulate one schedule family with its defaults (options: placement, group, alpha, prefetch_depth,
    recompute, swap_layers). Returns the steady-state result (tierflow.planner.core.simulator: the iteration
    before the last)."""
    m, h = resolve(model, hw)
    cfg = make_schedule(schedule, m, h, batch=batch, micro_batch=micro_batch, seq=seq, iterations=iterations,
                        **options)
    return simulate_config(m, h, cfg)


def compare(model: ModelSpec | str, hw: HardwareProfile | str, families=DEFAULT_FAMILIES,
            **kw) -> dict[str, SimResult]:
    """Simulate several schedule families with the same arguments."""
    return {f: simulate(model, hw, f, **kw) for f in families}


__all__ = ["simulate", "simulate_config", "hardware_flops_per_token", "check_graph_size", "GraphTooLarge",
           "compare", "resolve", "FAMILIES",
           "DEFAULT_FAMILIES"]
