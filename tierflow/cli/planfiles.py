"""Writing a plan file from a command (`tierflow simulate --write-plan`, `tierflow plan -o`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tierflow.logs import logger

if TYPE_CHECKING:
    from tierflow.planner.core.contract import Plan
    from tierflow.planner.io.planfile import WrittenPlan


def write_plan_file(plan: Plan, path: str) -> WrittenPlan:
    """Write a plan for the CLI: large plans are compressed to PATH.gz (planwrite.LARGE_PLAN_BYTES), said in
    one line on stderr."""
    from tierflow.planner.io.planwrite import LARGE_PLAN_BYTES, write_plan

    written = write_plan(plan, path, compress_over_bytes=LARGE_PLAN_BYTES)
    if written.note():
        logger().warning(f"tierflow: {written.note()}")
    return written
