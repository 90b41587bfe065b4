"""The one planning function (planner/io/planning.py): `tierflow plan` and `run --adapt`'s re-plan
(executor/decide.py `replan`) make the same plan on the same profile, with and without global clipping; the
CLI's flags become the same options."""

from __future__ import annotations

import json

import pytest

from tierflow.cli import main
from tierflow.executor.decide import AdaptOptions, replan, replan_options
from tierflow.hwprofiles import load_hw
from tierflow.planner.io.planning import PlanOptions
from tierflow.planner.io.planvalidate import load_plan
from tierflow.planner.io.planwrite import write_plan

# the laptop, where with its CPU Adam at the host model's 30 B rate `tierflow plan` and the re-plan of
# tiny-gpt differed in 4 of 8 runs on a loaded machine while CP-SAT ran two workers against the wall clock;
# now it solves with one worker, a fixed seed and deterministic time (planner/search/cpsat.py: 8 of 8 passed
# at load 3.5-8). The search's own limit is still wall-clock seconds: a limit no run reaches (the search takes
# 6-15 s here) keeps this a test of the search, not of the machine's load, and the plan says that no
# candidate was skipped
HW = "rtx2060-laptop"
TIME_LIMIT = "600"


def _without_clocks(x):
    """A plan file's JSON without its wall-clock fields (how long the search and its solves took)."""
    if isinstance(x, dict):
        return {k: _without_clocks(v) for k, v in x.items() if not k.endswith("wall_s")}
    if isinstance(x, list):
        return [_without_clocks(v) for v in x]
    return x


@pytest.mark.parametrize("clip", [False, True])
def test_adapts_replan_is_tierflow_plans_plan(tmp_path, clip, capsys):
    """The re-plan of a run on the profile it was planned on equals the plan `tierflow plan` wrote there:
    the same decisions, ops, prediction and solver report (but for wall-clock times)."""
    argv = ["plan", "--model", "tiny-gpt", "--hw", HW, "--batch", "8", "--time-limit", TIME_LIMIT,
            "-o", str(tmp_path / "plan.json")] + (["--clip-grad-norm", "1.0"] if clip else [])
    assert main(argv) == 0
    capsys.readouterr()
    planned = load_plan(tmp_path / "plan.json")
    opts = replan_options(planned, AdaptOptions(time_limit_s=float(TIME_LIMIT), clip=clip))
    assert opts == PlanOptions(time_limit_s=600.0, clip=clip)  # tierflow plan's defaults
    write_plan(replan(planned, load_hw(HW, None), opts), tmp_path / "replan.json")
    cli, adapt = (json.loads((tmp_path / f).read_text()) for f in ("plan.json", "replan.json"))
    assert cli["solver"]["skipped_by_time_limit"] == 0  # the whole search ran: nothing left to the clock
    assert _without_clocks(adapt) == _without_clocks(cli)


def test_the_cli_flags_are_the_options():
    """`tierflow plan`'s flags map one to one onto PlanOptions (--accept-states checked there)."""
    import argparse

    from tierflow.cli.plan import add_parser, plan_options
    from tierflow.planner.core.models import get_model

    sub = argparse.ArgumentParser().add_subparsers()
    args = add_parser(sub).parse_args(["--model", "tiny-gpt", "--hw", HW, "--time-limit", "7", "--no-ssd",
                                       "--no-baselines", "--no-window", "--micro-batch", "2",
                                       "--clip-grad-norm", "1", "--optimizer-states", "auto",
                                       "--accept-states", "8bit,fp32"])
    assert plan_options(args, get_model("tiny-gpt")) == PlanOptions(
        time_limit_s=7.0, micro_batches=(2,), allow_ssd=False, baselines=False, window=False, clip=True,
        auto_states=("8bit", "fp32"))
