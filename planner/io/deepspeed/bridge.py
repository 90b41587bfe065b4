"""The DeepSpeed bridge's runs (the mapping itself is planner/io/deepspeed/config.py): the DeepSpeed run a
config describes, simulated on a box, tierflow's own plan for the same model, box and batch beside it
(`tierflow simulate --ds-config`), and the nearest DeepSpeed config written for a chosen plan (`tierflow plan
--emit-ds-config`). The command's flags and output are tierflow/cli/config.py."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, TextIO

from tierflow.hwprofiles import HardwareProfile
from tierflow.planner.core.contract import ScheduleConfig
from tierflow.planner.core.models import ModelSpec
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.io.deepspeed.config import DsConfig, ds_config_for_plan, write_ds_config
from tierflow.planner.io.progress import Progress

if TYPE_CHECKING:
    from tierflow.planner.search.plan_search import Evaluated

DS_COLUMN = "deepspeed"
PLAN_COLUMN = "tierflow plan"
# a modest search: the plan beside a DeepSpeed run, not the best plan found in 60 s
DEFAULT_PLAN_TIME_LIMIT_S = 20.0


def simulate_ds(model: ModelSpec, hw: HardwareProfile, ds: DsConfig,
                iterations: int) -> tuple[ScheduleConfig, SimResult | CapacityError]:
    """The schedule the DeepSpeed config runs on `hw` and its simulated result (its CapacityError when it does
    not fit), `model` trained in the config's precision."""
    model = ds.trained(model)  # a CPU device's profile is in real bytes too (tierflow calibrate --device cpu)
    cfg = ds.schedule(model, hw, seq=model.seq_len, iterations=iterations)
    try:
        return cfg, simulate_config(model, hw, cfg)
    except CapacityError as e:
        return cfg, e


def plan_beside(model: ModelSpec, hw: HardwareProfile, batch: int, time_limit_s: float,
                allow_ssd: bool) -> Evaluated:
    """tierflow's plan for the same model, box and batch, as `tierflow plan` makes it (the one planning
    function; its window check skipped: it reports, it does not choose); the best verified candidate (its
    `result`, `config` and `candidate`)."""
    from tierflow.planner.io.planning import PlanOptions, make_plan

    prog = Progress(1, "planning")
    opts = PlanOptions(time_limit_s=time_limit_s, allow_ssd=allow_ssd, window=False)
    planned = make_plan(model, hw, batch, model.seq_len, opts, progress=prog.update)
    prog.finish()
    return planned.search.best


def emit_ds_config(path: str, model: ModelSpec, cfg: ScheduleConfig, stream: TextIO | None = None) -> None:
    """`tierflow plan --emit-ds-config FILE`: write the nearest DeepSpeed config for the chosen plan and say,
    in a few lines, which of its decisions DeepSpeed cannot express."""
    stream = sys.stdout if stream is None else stream
    emitted = ds_config_for_plan(model, cfg)
    write_ds_config(path, emitted)
    nvme = "; set nvme_path to your NVMe mount" if "nvme" in json.dumps(emitted.config) else ""
    print(f"wrote DeepSpeed config {path}: {emitted.summary()}{nvme}", file=stream)
    if emitted.inexpressible:
        print("DeepSpeed cannot express these decisions of the plan:", file=stream)
        for item in emitted.inexpressible:
            print(f"  - {item}", file=stream)
