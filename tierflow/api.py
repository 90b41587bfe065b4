"""The public Python API of tierflow. Nothing inside the package imports this module; it only gathers names.

    >>> from tierflow.api import simulate
    >>> res = simulate("gpt3-13b", "rtx4090-lohan", "vertical", batch=64, micro_batch=8, seq=1024)
    >>> round(res.tokens_per_s) > 0
    True
"""

from tierflow.hwprofiles import HardwareProfile, list_profiles, load_profile
from tierflow.planner.core.contract import Plan, ScheduleConfig
from tierflow.planner.core.families import FAMILIES
from tierflow.planner.core.models import ModelSpec, get_model, list_models
from tierflow.planner.core.placement import Placement, Split
from tierflow.planner.core.schedules import build_graph, make_schedule
from tierflow.planner.core.simulate import DEFAULT_FAMILIES, compare, resolve, simulate, simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult
from tierflow.planner.io.planfile import load_plan, plan_from_graph, simulate_plan, write_plan
from tierflow.planner.search.capacity import largest
from tierflow.planner.search.explain import explain, min_requirements
from tierflow.planner.search.plan_search import PlanningError, SearchResult, plan_search
from tierflow.planner.search.problem import Candidate, Problem

__all__ = [
    "Candidate", "Problem", "min_requirements", "DEFAULT_FAMILIES", "FAMILIES", "CapacityError",
    "HardwareProfile", "ModelSpec", "Placement", "Plan", "PlanningError", "ScheduleConfig", "SearchResult",
    "SimResult", "Split", "build_graph", "compare", "explain", "get_model", "largest", "list_models",
    "list_profiles", "load_plan", "load_profile", "make_schedule", "plan_from_graph", "plan_search",
    "resolve", "simulate", "simulate_config", "simulate_plan", "write_plan",
]
