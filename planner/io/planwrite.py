"""Plan files, writing: a plan (tierflow.planner.core.contract.Plan) as a versioned JSON document, validated
(tierflow.planner.io.planvalidate) before it reaches the disk. ``docs/plan-format.md`` documents every field.

    plan = plan_from_graph(model, hw, cfg, build_graph(model, hw, cfg))
    write_plan(plan, "plan.json")          # "plan.json.gz": gzip-compressed
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

from tierflow.hwprofiles import HardwareProfile
from tierflow.outputs import atomic_write_bytes
from tierflow.planner.core.contract import Plan, ScheduleConfig
from tierflow.planner.core.graph import LINKS, TIERS, Task, TaskGraph, gc_paused
from tierflow.planner.core.jsonio import gz_name, gzip_bytes, is_gzip_name
from tierflow.planner.core.models import ModelSpec, model_dict
from tierflow.planner.core.simulator import SimResult
from tierflow.planner.io.planvalidate import (
    PLAN_FORMAT,
    PLAN_VERSION,
    PlanError,
    plan_digest,
    validate_plan_dict,
)

# `tierflow plan -o` / `simulate --write-plan`: a plan whose JSON is larger is written compressed, to NAME.gz
# (a 175B plan is 34 MB of JSON, 2 MB gzipped; a 13B plan 4.2 MB stays plain).
LARGE_PLAN_BYTES = 16_000_000


def _created_by() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"tierflow {version('tierflow')}"
        except PackageNotFoundError:
            return "tierflow (not installed)"
    except ImportError:  # pragma: no cover
        return "tierflow"


def _jsonable(x: Any) -> Any:
    """Plain JSON values: numpy scalars become Python numbers, non-finite floats null, tuples lists."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item"):  # numpy scalar
        return _jsonable(x.item())
    return str(x)


def plan_from_graph(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, graph: TaskGraph,
                    predicted: dict | SimResult | None = None, solver: dict | None = None) -> Plan:
    """A plan of `graph` (built from `cfg` for `model` on `hw`); `predicted` is a SimResult or its
    to_dict()."""
    if predicted is not None and not isinstance(predicted, dict):
        predicted = predicted.to_dict()
    return Plan(model=model, hardware=hw, config=cfg, graph=graph,
                predicted=None if predicted is None else _jsonable(predicted),
                solver=None if solver is None else _jsonable(solver))


def _op_dict(t: Task, order: int) -> dict:
    """One op of the plan file (docs/plan-format.md); `_op_dicts` writes the same for every op at once."""
    return _op_dicts([t], {t.id: order})[0]


def _op_dicts(tasks: list[Task], position: dict[int, int]) -> list[dict]:
    """The ops of the plan file, one dict per task in `tasks`' order, `position` its place in its
    resource's queue: one straight loop, the same keys in the same order as the format gives them."""
    links, tiers = frozenset(LINKS), TIERS
    out = []
    append = out.append
    for t in tasks:
        r = t.resource
        mem_start, mem_end = t.mem_start, t.mem_end
        mem = [["start", tiers[i], float(b)] for i, b in mem_start] if mem_start else []
        if mem_end:
            mem += [["end", tiers[i], float(b)] for i, b in mem_end]
        append({"id": t.id, "kind": t.kind, "resource": r, "tensor": t.tensor, "block": t.block, "mb": t.mb,
                "iteration": t.iteration, ("bytes" if r in links else "seconds"): float(t.work),
                "deps": list(t.deps), "order": position[t.id], "mem": mem})
    return out


def plan_to_dict(plan: Plan) -> dict:
    """The JSON structure of `plan` (see docs/plan-format.md)."""
    g = plan.graph
    position: dict[int, int] = {}
    for ids in g.resource_order().values():
        position.update(zip(ids, range(len(ids))))
    d: dict[str, Any] = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "created_by": _created_by(),
        "model": model_dict(plan.model),
        "hardware": plan.hardware.to_dict(),
        "decisions": plan.config.to_dict(),
        "static_bytes": {t: float(g.static_bytes[t]) for t in TIERS},
        "capacity_bytes": {t: float(g.capacity_bytes[t]) for t in TIERS},
        "num_iterations": int(g.num_iterations),
        "num_blocks": int(g.num_blocks),
        "ops": _op_dicts(sorted(g.tasks, key=attrgetter("id")), position),
    }
    if plan.predicted is not None:
        d["predicted"] = _jsonable(plan.predicted)
    if plan.solver is not None:
        d["solver"] = _jsonable(plan.solver)
    d["digest"] = plan_digest(plan.model, plan.hardware, plan.config, d)
    return d


def dumps_plan_dict(d: dict) -> str:
    """JSON text of a plan dict: sections indented, one op per line (diff-friendly, strict JSON)."""
    parts = []
    for key, value in d.items():
        if key == "ops":
            text = _dumps_ops(value)
        else:
            text = json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  ")
        parts.append(f"  {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _dumps_ops(ops: list) -> str:
    """The ops' JSON, one op per line. Encoded in one call: the ops are flat objects (no object inside), so
    the text between two of them is "}, {"; when that occurs exactly len(ops) - 1 times (no op's string holds
    it), each occurrence is such a boundary and becomes a line break; else each op is encoded on its own."""
    if not ops:
        return "[]"
    text = json.dumps(ops, allow_nan=False)
    if text.count("}, {") == len(ops) - 1:
        return "[\n    " + text[1:-1].replace("}, {", "},\n    {") + "\n  ]"
    lines = ",\n    ".join(json.dumps(op, allow_nan=False) for op in ops)
    return f"[\n    {lines}\n  ]"


@dataclass(frozen=True)
class WrittenPlan:
    """Where `write_plan` put a plan: the path written, the bytes of its JSON and of the file."""

    path: Path
    json_bytes: int
    file_bytes: int
    requested: Path  # the path asked for (differs from `path` when a large plan was compressed to path + .gz)

    @property
    def compressed(self) -> bool:
        return is_gzip_name(self.path)

    def note(self) -> str | None:
        """One line when the plan went to another name than requested (else None)."""
        if self.path == self.requested:
            return None
        json_mb, limit_mb, file_mb = self.json_bytes / 1e6, LARGE_PLAN_BYTES / 1e6, self.file_bytes / 1e6
        return (f"the plan's JSON is {json_mb:,.1f} MB (over {limit_mb:,.0f} MB): wrote {self.path} (gzip, "
                f"{file_mb:,.1f} MB) instead of {self.requested}; every reader takes it as it is")


def write_plan(plan: Plan, path: str | os.PathLike[str], *,
               compress_over_bytes: int | None = None) -> WrittenPlan:
    """Write `plan` as JSON to `path`, atomically: the text goes to a temporary file in the same directory,
    which then replaces `path`. The plan is validated first, so an invalid plan never reaches the disk.
    A name ending in .gz is written gzip-compressed. With `compress_over_bytes` (the CLI passes
    LARGE_PLAN_BYTES), a plan whose JSON is larger goes to `path` + ".gz", compressed, instead; the returned
    WrittenPlan says where it went."""
    requested = Path(path)
    with gc_paused():  # ~10^6 dicts, lists and tasks, no cycles: the collector's passes only cost time
        d = plan_to_dict(plan)
        validate_plan_dict(d, str(requested), ops_digest_fresh=True)  # d's digest: of these very ops
        try:
            text = dumps_plan_dict(d)
        except ValueError as exc:  # a non-finite number outside the validated fields
            raise PlanError.at(str(requested), "(top level)", f"cannot write strict JSON: {exc}",
                       "fix the plan's values") from exc
        del d
    data = text.encode("utf-8")
    path = requested
    if compress_over_bytes is not None and len(data) > compress_over_bytes:
        path = gz_name(requested)
    payload = gzip_bytes(text) if is_gzip_name(path) else data
    atomic_write_bytes(path, payload)
    return WrittenPlan(path, len(data), len(payload), requested)
