"""`tierflow capacity`: the largest model of each family that can train on a box, with and without its SSDs.

A model "fits" when the most memory-frugal plan fits every tier: vertical schedule, micro-batch 1, no deferred
optimizer step, weights / optimizer states / checkpoints on the SSD array when there is one (else in CPU
memory). The answer is checked by simulating that plan for the winning model (the memory model's closed form,
tierflow.planner.search.explain.min_requirements, decides what fits; the simulator is the judge).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.lora import LoraConfig
from tierflow.planner.core.models import SHAPE_LIMITS, ModelSpec, get_model
from tierflow.planner.core.schedules import make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.search.explain import frugal_placement, min_requirements
from tierflow.planner.search.problem import Problem

# family name -> (template model, widths to try as (hidden, heads), ffn multiplier or None for the template's)
FAMILIES = {
    "gpt": ("gpt3-125m", [(768, 12), (1024, 16), (1536, 16), (2048, 16), (2560, 32), (4096, 32), (5120, 40),
                          (6144, 48), (8192, 64), (10240, 80), (12288, 96), (16384, 128)]),
    "llama": ("llama2-7b", [(2048, 16), (3072, 24), (4096, 32), (5120, 40), (6656, 52), (8192, 64),
                            (12288, 96)]),
}


@dataclass
class CapacityAnswer:
    family: str
    with_ssd: bool
    model: ModelSpec | None
    params: int
    requirements: dict[str, float]
    verified: SimResult | None
    note: str = ""


def shape(family: str, hidden: int, heads: int, layers: int, seq: int | None = None) -> ModelSpec:
    template, _ = FAMILIES[family]
    base = get_model(template)
    if seq:
        base = replace(base, seq_len=seq,
                       max_positions=max(base.max_positions, seq) if base.max_positions else 0)
    if family == "gpt":
        return replace(base, name=f"gpt-{layers}x{hidden}", num_layers=layers, hidden=hidden, num_heads=heads,
                       num_kv_heads=heads, head_dim=hidden // heads, ffn_hidden=4 * hidden)
    ffn = 256 * ((int(8 * hidden / 3) + 255) // 256)  # LLaMA's 8/3 h rounded up to a multiple of 256
    kv = heads if hidden < 8192 else 8
    return replace(base, name=f"llama-{layers}x{hidden}", num_layers=layers, hidden=hidden, num_heads=heads,
                   num_kv_heads=kv, head_dim=hidden // heads, ffn_hidden=ffn)


def fits(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, with_ssd: bool, gpus: int = 1,
         nodes: int = 1) -> bool:
    """Does the most frugal plan fit every tier? With `gpus` ranks per box on `nodes` boxes (`batch` the
    global batch), each rank's shard in its share of its box."""
    problem = Problem(model, hw, batch, seq, allow_ssd=with_ssd, gpus=gpus, nodes=nodes)
    need, caps = min_requirements(problem), problem.capacity_bytes
    return all(need[t] <= caps[t] for t in need)


def frugal_config(model: ModelSpec, hw: HardwareProfile, batch: int, seq: int, with_ssd: bool, gpus: int = 1,
                  nodes: int = 1):
    placement = frugal_placement(Problem(model, hw, batch, seq, allow_ssd=with_ssd, gpus=gpus, nodes=nodes))
    return make_schedule("vertical", model, hw, batch=batch, micro_batch=1, seq=seq, placement=placement,
                         alpha=0.0, gpus=gpus, nodes=nodes)


def largest(family: str, hw: HardwareProfile, batch: int, seq: int, with_ssd: bool, verify: bool = True,
            gpus: int = 1, nodes: int = 1, optimizer_states: str | None = None,
            lora: LoraConfig | None = None) -> CapacityAnswer:
    """The largest model of `family` that fits, its optimizer states in format `optimizer_states`
    (tierflow.planner.core.optstates; None: fp32), fine-tuned with LoRA adapters `lora` (None: full)."""
    _, widths = FAMILIES[family]

    def sized(hidden: int, heads: int, layers: int) -> ModelSpec:
        m = shape(family, hidden, heads, layers, seq)
        return m.with_optimizer_states(optimizer_states).with_lora(lora)

    fitting: list[ModelSpec] = []
    for hidden, heads in widths:
        lo, hi = 0, SHAPE_LIMITS["num_layers"]
        while lo < hi:  # largest layer count that fits at this width (up to tierflow's shape limit)
            mid = (lo + hi + 1) // 2
            if fits(sized(hidden, heads, mid), hw, batch, seq, with_ssd, gpus, nodes):
                lo = mid
            else:
                hi = mid - 1
        if lo:
            fitting.append(sized(hidden, heads, lo))
    fitting.sort(key=lambda m: -m.total_params())
    hw_run = hw if with_ssd else hw.with_overrides({"ssd.count": 0})

    def answer(m: ModelSpec, res: SimResult | None, note: str = "") -> CapacityAnswer:
        req = min_requirements(Problem(m, hw, batch, seq, allow_ssd=with_ssd, gpus=gpus, nodes=nodes))
        return CapacityAnswer(family, with_ssd, m, m.total_params(), req, res, note)

    def simulated(m: ModelSpec) -> SimResult:
        return simulate_config(m, hw_run, frugal_config(m, hw_run, batch, seq, with_ssd, gpus, nodes))

    refused: list[str] = []  # the simulator's refusals, widest candidate first
    for m in fitting[:4]:
        if not verify:
            return answer(m, None)
        try:
            return answer(m, simulated(m))
        except CapacityError as e:
            refused.append(str(e))
    if fitting and verify:  # the simulator refused the closed form's answer at every width tried
        top = fitting[0]
        found = _fewer_layers(top.num_layers, lambda k: sized(top.hidden, top.num_heads, k), simulated)
        if found is not None:
            m, res = found
            return answer(m, res, note=f"the closed form's {top.num_layers} layers refused by the simulator "
                                       f"({refused[0]}); {m.num_layers} verified")
    why = refused[-1] if refused else "nothing fits"
    return CapacityAnswer(family, with_ssd, None, 0, {}, None, note=why)


def _fewer_layers(layers: int, sized, simulated) -> tuple[ModelSpec, SimResult] | None:
    """The model `sized(k)` with the most layers k < `layers` whose frugal plan the simulator accepts, with
    its simulation; None when not even one layer is accepted. Bisection: fewer layers keep less on the GPU for
    the whole run (LoRA's adapters and their states grow with them), so the simulator's refusal of the closed
    form's answer by a few MB (LoRA on the Fuyou box: 15-60 MB in a backward) goes away a layer or a few
    below it."""
    lo, hi, best = 0, layers - 1, None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        m = sized(mid)
        try:
            best, lo = (m, simulated(m)), mid
        except CapacityError:
            hi = mid - 1
    return best


def _largest_light(args: tuple) -> CapacityAnswer:
    """largest() for a worker process: the answer without the simulated task graph (only its summary
    travels)."""
    a = largest(*args)
    if a.verified is not None:
        a.verified = a.verified.summary_only()
    return a


def largest_all(hw: HardwareProfile, batch: int, seq: int, *, families: tuple[str, ...] = tuple(FAMILIES),
                workers: int | None = None, on_answer=None, gpus: int = 1,
                nodes: int = 1, optimizer_states: str | None = None,
                lora: LoraConfig | None = None) -> list[CapacityAnswer]:
    """`largest` for every family, with and without the SSDs (when the box has them), each in its own process
    (up to `workers`, default the machine's cores, at most 2 when they share a small box): the answers are
    independent and each ends in one large simulation. `on_answer(answer)` is called as each one arrives."""
    # the answers with SSDs are the largest models and the longest simulations: start them first
    jobs = [(fam, hw, batch, seq, with_ssd, True, gpus, nodes, optimizer_states, lora)
            for with_ssd in (True, False) for fam in families if not (with_ssd and hw.ssd.count == 0)]
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    answers: dict[int, CapacityAnswer] = {}
    if workers > 1 and "fork" in mp.get_all_start_methods():
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as pool:
            futures = {pool.submit(_largest_light, job): i for i, job in enumerate(jobs)}
            for f in as_completed(futures):
                answers[futures[f]] = f.result()
                if on_answer:
                    on_answer(answers[futures[f]])
    else:
        for i, job in enumerate(jobs):
            answers[i] = _largest_light(job)
            if on_answer:
                on_answer(answers[i])
    return [answers[i] for i in range(len(jobs))]
