"""Plan files, reading and validation: every check a plan file passes before the simulator or the executor
takes it (the format's constants, the digest that binds the ops to the model, hardware and decisions, and
`load_plan`). ``docs/plan-format.md`` documents every field; the writer is tierflow.planner.io.planwrite.

Every problem raises :class:`PlanError`, whose message is one line: ``"<file>: <where>: <problem> (<fix>)"``.
Only the standard library and the planner are imported here (never torch).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import reprlib
import typing
from collections import Counter
from dataclasses import dataclass
from typing import Any

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile, ProfileError, profile_from_dict, type_name
from tierflow.hwprofiles.inputs import (
    GIB,
    InputLimitError,
    InputTooCostly,
    loads_json_limited,
    reading,
    size_text,
)
from tierflow.planner.core.contract import Plan, ScheduleConfig
from tierflow.planner.core.families import FAMILIES, RUNTIMES
from tierflow.planner.core.graph import (
    LINKS,
    NET,
    RESOURCES,
    TIER_INDEX,
    TIERS,
    CycleError,
    Task,
    TaskGraph,
    gc_paused,
    topological_order,
)
from tierflow.planner.core.jsonio import is_gzip_file, read_text
from tierflow.planner.core.memory import static_bytes as placed_static_bytes
from tierflow.planner.core.models import ModelError, ModelSpec, model_dict
from tierflow.planner.core.opkinds import OP_KINDS
from tierflow.planner.core.placement import Placement, PlacementError
from tierflow.planner.core.schedules import build_graph
from tierflow.planner.core.world import rank_capacity_bytes

PLAN_FORMAT = "tierflow-plan"
PLAN_VERSION = 2  # 2: model.lora (LoRA's adapters, tierflow.planner.core.lora)
SUPPORTED_VERSIONS = (1, 2)

COMPUTE_RESOURCES = tuple(r for r in RESOURCES if r not in LINKS)  # gpu, cpu: ops carry "seconds"
MEM_WHEN = ("start", "end")
REQUIRED_KEYS = ("format", "version", "model", "hardware", "decisions", "static_bytes", "capacity_bytes",
                 "num_iterations", "num_blocks", "ops")
OPTIONAL_KEYS = ("created_by", "predicted", "solver", "digest")
OP_KEYS = ("id", "kind", "resource", "tensor", "block", "mb", "iteration", "deps", "order", "mem")
OP_WORK_KEYS = ("seconds", "bytes")
_MAX_MESSAGE = 200
MAX_PLAN_BYTES = GIB  # a GPT-3 175B plan of 32 micro-batches x 3 iterations is 20 MB
DIGEST_ALGORITHM = "sha256/16"  # the first 16 hex digits of a SHA-256


class PlanError(TierflowError, ValueError):
    """A plan file that cannot be read or is not valid. ``str(e)`` is one line:
    ``"<file>: <where>: <problem> (<fix>)"``."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))

    @classmethod
    def at(cls, source: str, where: str, problem: str, fix: str) -> PlanError:
        """The error ``"<source>: <where>: <problem> (<fix>)"``, its problem shortened to fit the line."""
        problem = " ".join(str(problem).split())
        room = _MAX_MESSAGE - len(source) - len(where) - len(fix) - 7
        if len(problem) > max(room, 60):
            problem = problem[: max(room, 60) - 3] + "..."
        return cls(f"{source}: {where}: {problem} ({fix})")


# ------------------------------------------------------------------------------------------------------------
# Digest: binds the ops to the model, hardware and decisions they were built from
# ------------------------------------------------------------------------------------------------------------


def _hash(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _digest_fields(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig) -> dict[str, str]:
    """One hash per field the ops were built from (model.*, decisions.*, hardware.<section>.*), from the
    rebuilt objects (so 0 and 0.0 hash alike), so that a mismatch names the field that was edited."""
    fields = {f"model.{k}": _hash(v) for k, v in model_dict(model).items()}
    fields.update({f"decisions.{k}": _hash(v) for k, v in cfg.to_dict().items()})
    hw_dict = hw.to_dict()
    for section, values in hw_dict.items():
        if isinstance(values, dict):
            fields.update({f"hardware.{section}.{k}": _hash(v) for k, v in values.items()})
    return fields


def _digest_ops(d: dict, fields: dict[str, str]) -> str:
    return _hash([fields, d["static_bytes"], d["capacity_bytes"], d["num_iterations"], d["num_blocks"],
                  d["ops"]])


def plan_digest(model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig, d: dict) -> dict:
    """The "digest" section of plan dict `d`: a hash per input field and one over the ops (and the fields)."""
    fields = _digest_fields(model, hw, cfg)
    return {"algorithm": DIGEST_ALGORITHM, "fields": fields, "ops": _digest_ops(d, fields)}


# ------------------------------------------------------------------------------------------------------------
# Reading and validation
# ------------------------------------------------------------------------------------------------------------


_err = PlanError.at


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _short(value: Any, n: int = 40) -> str:
    # bounded depth: no recursion
    text = _REPR.repr(value) if isinstance(value, (list, dict)) else repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


# the hwprofiles names; JSON's "object" for a dict
_json_type_name = functools.partial(type_name, mapping="object")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _unknown_key(source: str, where: str, key: str, known: typing.Iterable[str]) -> PlanError:
    known = list(known)
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(known)}"
    return _err(source, where, f"unknown key {_short(key, 30)}", hint)


def _check_fields(source: str, section: str, d: object, cls: type) -> dict:
    """Keys and value types of a section that rebuilds dataclass `cls`."""
    if not isinstance(d, dict):
        raise _err(source, section, f"expected an object, got {_json_type_name(d)}",
                   f"write the {section} as a JSON object")
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    for key in d:
        if key not in names:
            raise _unknown_key(source, section, key, names)
    hints = typing.get_type_hints(cls)
    out = dict(d)
    for f in fields:
        where = f"{section}.{f.name}"
        if f.name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _err(source, where, "missing key", f"add \"{f.name}\" to the {section} section")
            continue
        v, want = d[f.name], hints[f.name]
        if want is bool:
            ok = isinstance(v, bool)
        elif want is int:
            ok = _is_int(v)
        elif want is float:
            ok = _is_number(v)
            if ok:
                out[f.name] = float(v)
        elif want is str:
            ok = isinstance(v, str)
        else:
            continue
        if not ok:
            raise _err(source, where, f"expected {want.__name__}, got {_json_type_name(v)} {_short(v, 30)}",
                       f"write a JSON {'boolean' if want is bool else 'string' if want is str else 'number'}")
    return out


def _model(source: str, d: object) -> ModelSpec:
    d = _check_fields(source, "model", d, ModelSpec)
    try:
        return ModelSpec(**d)
    except ModelError as exc:
        raise _err(source, "model", str(exc), "fix the model section") from exc


def _hardware(source: str, d: object) -> HardwareProfile:
    if not isinstance(d, dict):
        raise _err(source, "hardware", f"expected an object, got {_json_type_name(d)}",
                   "write the hardware profile as a JSON object")
    label = "<hardware>"
    try:
        return profile_from_dict(d, source=label)
    except ProfileError as exc:
        msg = str(exc)
        rest = msg[len(label) + 2:] if msg.startswith(label + ": ") else msg
        head, sep, tail = rest.partition(": ")
        if sep and " " not in head:
            raise PlanError(f"{source}: hardware.{head}: {tail}") from exc
        raise PlanError(f"{source}: hardware: {rest}") from exc


def _decisions(source: str, d: object, model: ModelSpec, hw: HardwareProfile) -> ScheduleConfig:
    if isinstance(d, dict) and "placement" in d:
        d = dict(d)
        placement = d.pop("placement")
        if not isinstance(placement, dict):
            raise _err(source, "decisions.placement", f"expected an object, got {_json_type_name(placement)}",
                       "write one {gpu, cpu, ssd} object per tensor class")
        for name, split in placement.items():
            if not isinstance(split, dict) or set(split) - set(TIERS):
                raise _err(source, f"decisions.placement.{name}",
                           f"expected an object of {'/'.join(TIERS)} fractions, got {_short(split)}",
                           "write e.g. {\"gpu\": 0, \"cpu\": 1, \"ssd\": 0}")
            for tier, v in split.items():
                if not _is_number(v):
                    raise _err(source, f"decisions.placement.{name}.{tier}",
                               f"expected a number, got {_short(v)}", "write a fraction within [0, 1]")
        try:
            p = Placement.from_dict(placement)
        except PlacementError as exc:
            raise _err(source, "decisions.placement", str(exc), "fix the placement") from exc
        d = _check_fields(source, "decisions", {**d, "placement": p}, ScheduleConfig)
    else:
        d = _check_fields(source, "decisions", d, ScheduleConfig)  # reports the missing placement
    cfg = ScheduleConfig(**d)

    def bad(key: str, problem: str, fix: str) -> PlanError:
        return _err(source, f"decisions.{key}", problem, fix)

    if cfg.family not in FAMILIES:
        raise bad("family", f"unknown schedule family {_short(cfg.family)}",
                  f"use one of {', '.join(FAMILIES)}")
    if cfg.runtime not in RUNTIMES:
        raise bad("runtime", f"unknown runtime {_short(cfg.runtime)}", f"use one of {', '.join(RUNTIMES)}")
    for key in ("batch", "micro_batch", "seq", "group", "prefetch_depth", "iterations", "gpus", "nodes"):
        if getattr(cfg, key) < 1:
            raise bad(key, f"must be >= 1, got {getattr(cfg, key)}", "write a positive integer")
    if cfg.gpus > hw.gpu_count:
        raise bad("gpus", f"{cfg.gpus} GPUs per box, but the hardware section has {hw.gpu_count}",
                  f"write gpus <= {hw.gpu_count}, or plan for a profile whose topology.gpu_count is "
                  f"{cfg.gpus}")
    if cfg.nodes > 1 and hw.network is None:
        raise bad("nodes", f"{cfg.nodes} boxes, but the hardware section has no network",
                  "write nodes 1, or plan for a profile with a network section")
    if cfg.act_prefetch < 0:
        raise bad("act_prefetch", f"must be >= 0, got {cfg.act_prefetch}", "write a non-negative integer")
    if cfg.batch % cfg.micro_batch:
        raise bad("batch", f"batch {cfg.batch} is not divisible by micro_batch {cfg.micro_batch}",
                  "use a micro-batch that divides the batch")
    if cfg.batch % (cfg.micro_batch * cfg.world.ranks):
        raise bad("batch", f"batch {cfg.batch} is not divisible by {cfg.world.ranks} ranks x micro_batch "
                  f"{cfg.micro_batch}",
                  "use a batch that is a multiple of ranks x micro_batch")
    if cfg.num_micro_batches % cfg.group:
        raise bad("group", f"group {cfg.group} does not divide the {cfg.num_micro_batches} micro-batches",
                  "use a divisor of batch / micro_batch")
    if not 0.0 <= cfg.alpha < 1.0:
        raise bad("alpha", f"must be within [0, 1), got {cfg.alpha}", "write a fraction below 1")
    if not 0 <= cfg.swap_layers <= model.num_layers:
        raise bad("swap_layers", f"must be within [0, {model.num_layers}], got {cfg.swap_layers}",
                  "write a number of layers the model has")
    return cfg


def _tier_bytes(source: str, key: str, d: object) -> dict[str, float]:
    if not isinstance(d, dict):
        raise _err(source, key, f"expected an object, got {_json_type_name(d)}",
                   "write {\"gpu\": .., \"cpu\": .., \"ssd\": ..}")
    for k in d:
        if k not in TIERS:
            raise _unknown_key(source, key, k, TIERS)
    for t in TIERS:
        if t not in d:
            raise _err(source, f"{key}.{t}", "missing key", f"add \"{t}\" (bytes)")
        if not _is_number(d[t]) or d[t] < 0:
            raise _err(source, f"{key}.{t}", f"expected a non-negative number of bytes, got {_short(d[t])}",
                       "write bytes as a plain number")
    return {t: float(d[t]) for t in TIERS}


def _positive_int(source: str, d: dict, key: str) -> int:
    v = d[key]
    if not _is_int(v) or v < 1:
        raise _err(source, key, f"expected a positive integer, got {_short(v)}", "write a whole number >= 1")
    return v


def _cycle_text(cycle: list[int], limit: int = 6) -> str:
    ids = cycle[:limit]
    more = f", ... ({len(cycle)} ops)" if len(cycle) > limit else ""
    return " -> ".join(str(i) for i in ids) + more + (f" -> {cycle[0]}" if len(cycle) <= limit else "")


@dataclass(frozen=True)
class _OpBounds:
    """What an op's ids and indices may be: ops 0..n-1, iterations, blocks and micro-batches."""

    n: int
    num_iterations: int
    num_blocks: int
    num_mb: int


def _ops(source: str, ops: object, num_iterations: int, num_blocks: int, num_mb: int) -> list[Task]:
    """The plan's ops as tasks: each op parsed and its fields checked, then the references between them (queue
    positions, dependency cycles, deadlocks through the queues)."""
    if not isinstance(ops, list):
        raise _err(source, "ops", f"expected a list of ops, got {_json_type_name(ops)}",
                   "write \"ops\": [...]")
    n = len(ops)
    if n == 0:
        raise _err(source, "ops", "the plan has no ops", "write the plan with tierflow, not by hand")
    bounds = _OpBounds(n, num_iterations, num_blocks, num_mb)
    parsed = _plain_ops(ops, bounds)
    if parsed is None:  # an op not in the plain form tierflow writes: the careful pass names its problem
        parsed = _checked_ops(source, ops, bounds)
    done, orders = parsed
    by_res = _check_queues(source, done, orders, num_iterations)
    if not _deadlock_free(done, by_res):  # the careful checks say which rule a cycle breaks
        _check_references(source, done, orders, by_res)
    return done


def _checked_ops(source: str, ops: list, bounds: _OpBounds) -> tuple[list[Task], list[int]]:
    """The ops parsed one by one, every field checked in turn: the first problem raises PlanError."""
    n = bounds.n
    tasks: list[Task | None] = [None] * n
    orders: list[int] = [0] * n
    for index, op in enumerate(ops):
        tid = _op_id(source, index, op, n)
        if tasks[tid] is not None:
            raise _err(source, f"op {tid}", f"duplicate id {tid}", "give every op its own id")
        tasks[tid] = _op_task(source, tid, op, bounds)
        orders[tid] = op["order"]
    return tasks, orders  # type: ignore[return-value]  # every slot filled: n unique ids within 0..n-1


_LINK_OP_KEYS = frozenset((*OP_KEYS, "bytes"))
_COMPUTE_OP_KEYS = frozenset((*OP_KEYS, "seconds"))
_LINK_SET, _COMPUTE_SET = frozenset(LINKS), frozenset(COMPUTE_RESOURCES)


def _plain_ops(ops: list, bounds: _OpBounds) -> tuple[list[Task], list[int]] | None:
    """The ops as tasks in one straight pass that accepts only what every check of `_checked_ops` accepts,
    in the plain JSON types tierflow writes (exact int, float, str, list); None at the first op it does not
    accept, which `_checked_ops` then reports (the same tasks either way)."""
    try:
        return _plain_ops_pass(ops, bounds)
    except (TypeError, ValueError, OverflowError, KeyError):
        return None


def _plain_ops_pass(ops: list, bounds: _OpBounds) -> tuple[list[Task], list[int]] | None:
    n, ni, nb, nm = bounds.n, bounds.num_iterations, bounds.num_blocks, bounds.num_mb
    inf, tier_index = math.inf, TIER_INDEX
    tasks: list[Task | None] = [None] * n
    orders: list[int] = [0] * n
    for op in ops:
        if type(op) is not dict:
            return None
        r = op.get("resource")
        if type(r) is not str:
            return None
        if r in _LINK_SET:
            if op.keys() != _LINK_OP_KEYS:
                return None
            work = op["bytes"]
        elif r in _COMPUTE_SET and op.keys() == _COMPUTE_OP_KEYS:
            work = op["seconds"]
        else:
            return None
        tid, kind, tensor, deps, mem = op["id"], op["kind"], op["tensor"], op["deps"], op["mem"]
        it, block, mb, order = op["iteration"], op["block"], op["mb"], op["order"]
        if (type(tid) is not int or not 0 <= tid < n or tasks[tid] is not None
                or type(kind) is not str or not kind or type(tensor) is not str or not tensor
                or type(it) is not int or not 0 <= it < ni or type(block) is not int or not 0 <= block < nb
                or type(mb) is not int or not -1 <= mb < nm or type(order) is not int or order < 0
                or type(deps) is not list or type(mem) is not list):
            return None
        if type(work) is int:
            work = float(work)
        if type(work) is not float or not 0.0 <= work < inf:
            return None
        for d in deps:
            if type(d) is not int or not 0 <= d < n:
                return None
        mem_start: list[tuple[int, float]] = []
        mem_end: list[tuple[int, float]] = []
        for e in mem:
            if type(e) is not list or len(e) != 3:
                return None
            when, tier, delta = e
            if type(delta) is int:
                delta = float(delta)
            if type(delta) is not float or not -inf < delta < inf or type(tier) is not str:
                return None
            ti = tier_index[tier]  # KeyError: not a tier
            if when == "start":
                mem_start.append((ti, delta))
            elif when == "end":
                mem_end.append((ti, delta))
            else:
                return None
        tasks[tid] = Task(tid, kind, r, work, tensor, block, mb, it, list(deps), float(order), mem_start,
                          mem_end)
        orders[tid] = order
    return tasks, orders  # type: ignore[return-value]  # n ops, unique ids within 0..n-1: every slot filled


def _deadlock_free(done: list[Task], by_res: dict[str, dict[int, int]]) -> bool:
    """Whether the dependencies and the queue orders together are acyclic (one pass of Kahn's algorithm).
    That implies every check of `_check_references`: no dependency cycle, and no op queued before a
    same-resource dependency (its queue would lead from it to that dependency, a cycle)."""
    n = len(done)
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for t in done:
        deps = t.deps
        if deps:
            indeg[t.id] = len(deps)
            for d in deps:
                succ[d].append(t.id)
    for q in by_res.values():
        prev = -1
        for pos in range(len(q)):
            i = q[pos]
            if prev >= 0:
                succ[prev].append(i)
                indeg[i] += 1
            prev = i
    ready = [i for i in range(n) if not indeg[i]]
    placed = 0
    while ready:
        i = ready.pop()
        placed += 1
        for s in succ[i]:
            indeg[s] -= 1
            if not indeg[s]:
                ready.append(s)
    return placed == n


def _op_id(source: str, index: int, op: object, n: int) -> int:
    """The id of ops[index], which must be an object whose id is within 0..n-1."""
    if not isinstance(op, dict):
        raise _err(source, f"ops[{index}]", f"expected an object, got {_json_type_name(op)}",
                   "write each op as an object")
    tid = op.get("id")
    if "id" not in op:
        raise _err(source, f"ops[{index}]", "missing field 'id'", "give every op an integer id")
    if not _is_int(tid) or not 0 <= tid < n:
        raise _err(source, f"ops[{index}]", f"id {_short(tid)} out of range",
                   f"ids must be the integers 0..{n - 1}, one per op")
    return tid


def _op_task(source: str, tid: int, op: dict, bounds: _OpBounds) -> Task:
    """One op parsed into a Task, every field checked."""
    where = f"op {tid}"
    _check_op_keys(source, where, op)
    resource, work = _op_work(source, where, op)
    for key in ("kind", "tensor"):
        if not isinstance(op[key], str) or not op[key]:
            raise _err(source, where, f"{key} must be a non-empty string, got {_short(op[key])}",
                       f"fix {key!r}")
    _check_op_indices(source, where, op, bounds)
    deps = _op_deps(source, where, op["deps"], bounds.n)
    mem_start, mem_end = _op_mem(source, where, op["mem"])
    return Task(tid, op["kind"], resource, work, op["tensor"], op["block"], op["mb"], op["iteration"], deps,
                float(op["order"]), mem_start, mem_end)


def _check_op_keys(source: str, where: str, op: dict) -> None:
    """Every key of the op known, every required one present."""
    known = OP_KEYS + OP_WORK_KEYS
    for key in op:
        if key not in known:
            raise _unknown_key(source, where, key, known)
    for key in OP_KEYS:
        if key not in op:
            raise _err(source, where, f"missing field {key!r}", f"add \"{key}\" to the op")


def _op_work(source: str, where: str, op: dict) -> tuple[str, float]:
    """The op's resource and its work: seconds on gpu/cpu, bytes on a link."""
    resource = op["resource"]
    if resource not in RESOURCES:
        raise _err(source, where, f"unknown resource {_short(resource)}",
                   f"use one of {', '.join(RESOURCES)}")
    work_key = "bytes" if resource in LINKS else "seconds"
    other = "seconds" if work_key == "bytes" else "bytes"
    if other in op:
        raise _err(source, where, f"a {resource} op carries {other!r}",
                   f"{resource} ops carry {work_key!r}: gpu/cpu ops carry seconds, link ops bytes")
    if work_key not in op:
        raise _err(source, where, f"missing field {work_key!r}", f"{resource} ops carry {work_key!r}")
    work = op[work_key]
    if not _is_number(work) or work < 0:
        raise _err(source, where, f"{work_key} must be a non-negative number, got {_short(work)}",
                   f"write the {work_key} as a plain number >= 0")
    return resource, float(work)


def _check_op_indices(source: str, where: str, op: dict, bounds: _OpBounds) -> None:
    """The op's iteration, block, micro-batch and queue position within the plan's bounds."""
    it, block, mb, order = op["iteration"], op["block"], op["mb"], op["order"]
    num_iterations, num_blocks, num_mb = bounds.num_iterations, bounds.num_blocks, bounds.num_mb
    if not _is_int(it) or not 0 <= it < num_iterations:
        raise _err(source, where, f"iteration {_short(it)} out of range",
                   f"iterations run 0..{num_iterations - 1} (num_iterations = {num_iterations})")
    if not _is_int(block) or not 0 <= block < num_blocks:
        raise _err(source, where, f"block {_short(block)} out of range",
                   f"blocks run 0..{num_blocks - 1} (num_blocks = {num_blocks})")
    if not _is_int(mb) or not -1 <= mb < num_mb:
        raise _err(source, where, f"mb {_short(mb)} is not a micro-batch index",
                   f"micro-batches run 0..{num_mb - 1}; -1 marks per-block ops")
    if not _is_int(order) or order < 0:
        raise _err(source, where, f"order {_short(order)} is not a queue position",
                   "write the 0-based position in the resource's queue")


def _op_deps(source: str, where: str, deps: object, n: int) -> list[int]:
    """The op's dependencies: a list of existing op ids."""
    if not isinstance(deps, list):
        raise _err(source, where, f"deps must be a list of op ids, got {_json_type_name(deps)}",
                   "write \"deps\": [...]")
    for d in deps:
        if not _is_int(d) or not 0 <= d < n:
            raise _err(source, where, f"dangling dependency: op {_short(d, 20)} does not exist",
                       f"depend only on op ids 0..{n - 1}")
    return list(deps)


def _op_mem(source: str, where: str, mem: object) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The op's memory effects, (tier index, bytes) at its start and at its end."""
    if not isinstance(mem, list):
        raise _err(source, where, f"mem must be a list, got {_json_type_name(mem)}",
                   "write \"mem\": [[when, tier, bytes], ...]")
    mem_start: list[tuple[int, float]] = []
    mem_end: list[tuple[int, float]] = []
    for e in mem:
        if not isinstance(e, list) or len(e) != 3:
            raise _err(source, where, f"mem effect {_short(e)} is not [when, tier, bytes]",
                       "write e.g. [\"start\", \"gpu\", 1024.0]")
        when, tier, delta = e
        if when not in MEM_WHEN:
            raise _err(source, where, f"mem effect at {_short(when)}", "use \"start\" or \"end\"")
        if tier not in TIER_INDEX:
            raise _err(source, where, f"unknown tier {_short(tier)} in mem", f"use one of {', '.join(TIERS)}")
        if not _is_number(delta):
            raise _err(source, where, f"mem bytes {_short(delta)} is not a finite number",
                       "write + bytes to allocate, - bytes to free")
        (mem_start if when == "start" else mem_end).append((TIER_INDEX[tier], float(delta)))
    return mem_start, mem_end


def _check_queues(source: str, done: list[Task], orders: list[int],
                  num_iterations: int) -> dict[str, dict[int, int]]:
    """Each resource's queue positions are exactly 0..k-1, and every iteration computes on the gpu. Returns
    resource -> {position: op id}."""
    by_res: dict[str, dict[int, int]] = {r: {} for r in RESOURCES}
    for t in done:
        q = by_res[t.resource]
        if orders[t.id] in q:
            raise _err(source, f"op {t.id}",
                       f"same order {orders[t.id]} on {t.resource} as op {q[orders[t.id]]}",
                       "give each op of a resource its own queue position")
        q[orders[t.id]] = t.id
    for r, q in by_res.items():
        if q and max(q) != len(q) - 1:
            missing = min(set(range(len(q))) - set(q))
            raise _err(source, f"op {q[max(q)]}", f"order {max(q)} on {r} but position {missing} is empty",
                       f"number the {len(q)} {r} ops 0..{len(q) - 1}")
    gpu_iterations = {t.iteration for t in done if t.resource == "gpu"}
    for it in range(num_iterations):
        if it not in gpu_iterations:
            raise _err(source, "ops", f"iteration {it} has no gpu op", "every iteration computes on the gpu")
    return by_res


def _check_references(source: str, done: list[Task], orders: list[int],
                      by_res: dict[str, dict[int, int]]) -> None:
    """The dependencies are acyclic, no op is queued before a same-resource dependency, and dependencies and
    queue orders together do not deadlock."""
    preds = [sorted(set(t.deps)) for t in done]
    try:
        topological_order(len(done), preds)
    except CycleError as e:
        raise _err(source, f"op {e.cycle[0]}", f"dependency cycle {_cycle_text(e.cycle)}",
                   "remove a dependency on the cycle") from None
    # an op queued before one of its own dependencies on the same resource: that resource would stall forever
    for t in done:
        for d in t.deps:
            if done[d].resource == t.resource and orders[d] > orders[t.id]:
                raise _err(source, f"op {t.id}", f"order {orders[t.id]} on {t.resource} is before its "
                           f"dependency op {d} (order {orders[d]})",
                           "queue every op after its same-resource dependencies")
    # dependencies and queue orders together must be acyclic, else the resources wait on each other forever
    chained = [list(p) for p in preds]
    for q in by_res.values():
        for pos in range(1, len(q)):
            chained[q[pos]].append(q[pos - 1])
    try:
        topological_order(len(done), chained)
    except CycleError as e:
        raise _err(source, f"op {e.cycle[0]}", f"the resource orders deadlock: ops {_cycle_text(e.cycle)} "
                   "wait on each other through deps and queues",
                   "reorder the queues to follow the dependencies") from None


def _check_kinds(source: str, tasks: list[Task]) -> None:
    """Every op's kind is one of the op vocabulary (tierflow.planner.core.opkinds.OP_KINDS). Checked after the
    digest, so that an edited op of a written plan is reported as an edit."""
    for t in tasks:
        if t.kind not in OP_KINDS:
            close = difflib.get_close_matches(t.kind, sorted(OP_KINDS), n=1, cutoff=0.6)
            fix = f"did you mean {close[0]!r}?" if close else f"use one of {', '.join(sorted(OP_KINDS))}"
            raise _err(source, f"op {t.id}", f"op kind {_short(t.kind)} is not implemented", fix)


_REWRITE = "rewrite it: tierflow plan -o or simulate --write-plan"


def _check_micro_batch_count(source: str, ops: object, cfg: ScheduleConfig) -> None:
    """The micro-batches the ops compute must be the decisions' batch / micro_batch: an edited decisions.batch
    would otherwise train (and report tokens/s for) another batch than the ops compute."""
    if not isinstance(ops, list):
        return  # _ops reports it
    mbs = [o["mb"] for o in ops
           if isinstance(o, dict) and _is_int(o.get("mb")) and o.get("resource") == "gpu"]
    if not mbs:
        return
    computed = max(mbs) + 1
    if computed != cfg.num_micro_batches:
        ranks = cfg.world.ranks
        split = (f"micro_batch {cfg.micro_batch}" if ranks == 1
                 else f"({ranks} ranks x micro_batch {cfg.micro_batch})")
        raise _err(source, "decisions.batch", f"{cfg.batch} / {split} = "
                   f"{cfg.num_micro_batches} micro-batches, the ops compute {computed}", _REWRITE)


def _check_derived_bytes(source: str, model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig,
                         static: dict[str, float], capacity: dict[str, float]) -> None:
    """static_bytes and capacity_bytes must be what the model, placement and hardware imply (recomputed)."""
    want_cap = rank_capacity_bytes(hw, cfg.gpus)
    for t in TIERS:
        if not math.isclose(capacity[t], want_cap[t], rel_tol=1e-9, abs_tol=1.0):
            raise _err(source, f"capacity_bytes.{t}", f"{capacity[t]:,.0f} bytes, but the hardware section "
                       f"gives {want_cap[t]:,.0f}: edited after writing?", _REWRITE)
    want = placed_static_bytes(model, cfg.placement, cfg.runtime, cfg.world.ranks, cfg.ds_knobs, hw=hw)
    for t in TIERS:
        if not math.isclose(static[t], want[t], rel_tol=1e-9, abs_tol=1.0):
            raise _err(source, f"static_bytes.{t}", f"{static[t]:,.0f} bytes, but the model and "
                       f"decisions.placement give {want[t]:,.0f}: edited after writing?", _REWRITE)


def _check_digest(source: str, d: dict, model: ModelSpec, hw: HardwareProfile, cfg: ScheduleConfig,
                  ops_digest_fresh: bool = False) -> None:
    """Verify the digest written with the plan: name the first field whose value is not the one the ops were
    built from, or say that the ops themselves were edited."""
    dg = d["digest"]
    if (not isinstance(dg, dict) or set(dg) != {"algorithm", "fields", "ops"}
            or not isinstance(dg["fields"], dict)):
        raise _err(source, "digest", "expected an object {algorithm, fields, ops}", _REWRITE)
    if dg["algorithm"] != DIGEST_ALGORITHM:
        raise _err(source, "digest.algorithm", f"unknown digest {_short(dg['algorithm'])}",
                   f"this tierflow writes {DIGEST_ALGORITHM!r}; {_REWRITE}")
    fields = _digest_fields(model, hw, cfg)
    recorded = dg["fields"]
    # a field one side lacks counts as null: a plan written before an optional (nullable) profile or model
    # field existed still loads, as long as the field is null now
    none = _hash(None)
    for key in [*fields, *(k for k in recorded if k not in fields)]:
        if recorded.get(key, none) != fields.get(key, none):
            raise _err(source, key, "not the value the ops were built for: edited after writing "
                       "(the digest does not match)", _REWRITE)
    # the recorded fields: each one checked above
    if not ops_digest_fresh and dg["ops"] != _digest_ops(d, recorded):
        raise _err(source, "ops", "ops or byte totals edited after writing (the digest does not match)",
                   _REWRITE)


def _check_top_level(source: str, d: object) -> dict:
    """The plan's top level: a JSON object of a tierflow plan in a version this tierflow reads, with every
    required key and no unknown one."""
    if not isinstance(d, dict):
        raise _err(source, "(top level)", f"expected a JSON object, got {_json_type_name(d)}",
                   "is this a tierflow plan?")
    if "format" not in d:
        raise _err(source, "format", "missing key",
                   f"add \"format\": \"{PLAN_FORMAT}\"; is this a tierflow plan?")
    if d["format"] != PLAN_FORMAT:
        raise _err(source, "format", f"expected {PLAN_FORMAT!r}, got {_short(d['format'])}",
                   "this is not a tierflow plan file")
    supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
    if "version" not in d:
        raise _err(source, "version", "missing key",
                   f"add \"version\"; this tierflow reads versions {supported}")
    version = d["version"]
    if not _is_int(version) or version not in SUPPORTED_VERSIONS:
        newer = _is_int(version) and version > max(SUPPORTED_VERSIONS)
        raise _err(source, "version", f"unsupported version {_short(version)}",
                   f"this tierflow reads versions {supported}" + ("; upgrade tierflow" if newer else ""))
    for key in d:
        if key not in REQUIRED_KEYS + OPTIONAL_KEYS:
            raise _unknown_key(source, "(top level)", key, REQUIRED_KEYS + OPTIONAL_KEYS)
    for key in REQUIRED_KEYS:
        if key not in d:
            raise _err(source, key, "missing key", f"add \"{key}\" at the top level")
    if "created_by" in d and not isinstance(d["created_by"], str):
        raise _err(source, "created_by", f"expected a string, got {_json_type_name(d['created_by'])}",
                   "write a string")
    for key in ("predicted", "solver"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise _err(source, key, f"expected an object or null, got {_json_type_name(d[key])}",
                       f"write \"{key}\": {{...}}")
    return d


def plan_from_dict(d: object, source: str = "<plan>", *, ops_digest_fresh: bool = False) -> Plan:
    """Validate a parsed plan and rebuild it; raises PlanError. `ops_digest_fresh`: the writer's own dict,
    whose digest `plan_digest` has just computed from these very ops and fields, so that once the fields
    match the ops' hash matches too and is not computed a second time."""
    d = _check_top_level(source, d)
    model = _model(source, d["model"])
    if model.lora is not None and d["version"] < 2:
        raise _err(source, "model.lora", f"LoRA is not part of version {d['version']}",
                   "write \"version\": 2 (LoRA plans are version 2)")
    hardware = _hardware(source, d["hardware"])
    config = _decisions(source, d["decisions"], model, hardware)
    static = _tier_bytes(source, "static_bytes", d["static_bytes"])
    capacity = _tier_bytes(source, "capacity_bytes", d["capacity_bytes"])
    num_iterations = _positive_int(source, d, "num_iterations")
    num_blocks = _positive_int(source, d, "num_blocks")
    if num_iterations != config.iterations:
        raise _err(source, "num_iterations",
                   f"{num_iterations} but decisions.iterations is {config.iterations}", "make them equal")
    if num_blocks != model.num_layers + 2:
        raise _err(source, "num_blocks", f"{num_blocks} but the model has {model.num_layers} layers + 2",
                   f"write {model.num_layers + 2} (embedding, layers, head)")
    _check_micro_batch_count(source, d["ops"], config)
    with gc_paused():  # a task, its lists and tuples per op, no cycles: the collector's passes only cost time
        tasks = _ops(source, d["ops"], num_iterations, num_blocks, config.num_micro_batches)
    if config.world.ranks == 1:
        net = next((t for t in tasks if t.resource == NET), None)
        if net is not None:
            raise _err(source, f"op {net.id}", "a collective (resource net) in a plan of one rank",
                       "write decisions.gpus / nodes for the world it was built for, or " + _REWRITE)
    if d.get("digest") is not None:
        _check_digest(source, d, model, hardware, config, ops_digest_fresh)
    if model.max_positions and config.seq > model.max_positions:  # after the digest, which names an edit
        raise _err(source, "decisions.seq", f"{config.seq} tokens exceed the model's {model.max_positions} "
                   "learned positions", f"write seq <= {model.max_positions}, or " + _REWRITE)
    _check_kinds(source, tasks)
    _check_derived_bytes(source, model, hardware, config, static, capacity)
    graph = TaskGraph(tasks, static, capacity, num_iterations, num_blocks,
                      meta={"world": config.world.to_dict()} if config.world.ranks > 1 else {})
    return Plan(model=model, hardware=hardware, config=config, graph=graph, predicted=d.get("predicted"),
                solver=d.get("solver"), source=source)


def validate_plan_dict(d: dict, source: str, *, ops_digest_fresh: bool = False) -> None:
    """Raise PlanError (one line naming `source`, the key or op id, the problem and a fix) unless `d` is a
    valid plan (`ops_digest_fresh`: see plan_from_dict)."""
    plan_from_dict(d, source, ops_digest_fresh=ops_digest_fresh)


def _op_signature(tasks: list[Task]) -> Counter:
    """What the ops do, independent of their order and of the GPU's seconds (which the hardware section sets):
    each op's kind, resource, tensor, block, micro-batch, iteration, bytes moved and memory effects."""
    sig: Counter = Counter()
    for t in tasks:
        moved = 0.0 if t.resource == "gpu" else round(t.work, 3)
        mem = (tuple(sorted((tier, round(b, 3)) for tier, b in t.mem_start)),
               tuple(sorted((tier, round(b, 3)) for tier, b in t.mem_end)))
        sig[(t.kind, t.resource, t.tensor, t.block, t.mb, t.iteration, moved, mem)] += 1
    return sig


def check_ops_match_decisions(plan: Plan) -> None:
    """Before training (`tierflow run`): the ops must be the ones the model and the decisions build (the
    executor sizes its tensors from the model and the decisions, the ops from the file), with or without a
    digest: an edited decisions.seq, micro_batch, batch, gpus / nodes or model shape is refused here (exit 2)
    instead of failing at op 1. The queues' order may be edited; what the ops move may not."""
    cfg = plan.config
    source = str(plan.source)
    built = _op_signature(build_graph(plan.model, plan.hardware, cfg).tasks)
    found = _op_signature(plan.graph.tasks)
    if built == found:
        return
    extra, missing = found - built, built - found
    k = next(iter(extra or missing))
    what = (f"{k[0]} op of block {k[3]} mb {k[4]} iteration {k[5]} is not what batch {cfg.batch}, "
            f"micro_batch {cfg.micro_batch}, seq {cfg.seq}, {cfg.world.ranks} rank(s) and the model build: "
            "edited after writing?")
    raise _err(source, "ops", what, _REWRITE)


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a plan file; raises PlanError."""
    source = os.fspath(path)
    try:
        # plain or gzip-compressed, by the content; refused before it is inflated when the text and its parse
        # could not fit in memory
        text = read_text(path, MAX_PLAN_BYTES, json_cost=True)
    except InputTooCostly as exc:  # said whole: what it needs, what is left
        raise PlanError(f"{source}: {exc}") from None
    except InputLimitError as exc:
        raise _err(source, "(file)", str(exc),
                   "give the path of a plan .json file written by tierflow") from None
    except FileNotFoundError as exc:
        raise _err(source, "(file)", "file not found", "check the path") from exc
    except IsADirectoryError as exc:
        raise _err(source, "(file)", "is a directory", "give the path of a plan .json file") from exc
    except UnicodeDecodeError as exc:
        raise _err(source, "(file)", "is not UTF-8 text", "give a plan written by tierflow") from exc
    except OSError as exc:
        if _looks_gzip(path):
            raise _err(source, "(file)", f"damaged gzip file: {exc}", "write the plan again") from exc
        raise _err(source, "(file)", f"cannot read: {exc.strerror or exc}",
                   "check the file's permissions") from exc
    try:
        # ops: _ops checks them
        with reading(source, f"{size_text(len(text))} of JSON text"):
            d = loads_json_limited(text, unchecked=("ops",), parse_constant=_reject_constant)
        del text
    except InputLimitError as exc:
        raise _err(source, "(file)", str(exc), "a plan nests 4 levels: ops, op, mem, effect") from None
    except json.JSONDecodeError as exc:
        raise _err(source, f"line {exc.lineno} column {exc.colno}", f"not JSON: {exc.msg}",
                   "fix the JSON syntax, or write the plan again") from exc
    except ValueError as exc:  # NaN / Infinity
        raise _err(source, "(file)", f"not strict JSON: {exc}", "write numbers as finite values") from exc
    return plan_from_dict(d, source)


def _looks_gzip(path: str | os.PathLike[str]) -> bool:
    """Whether `path` starts with gzip's magic bytes (False when it cannot be read at all)."""
    try:
        return is_gzip_file(path)
    except OSError:
        return False


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


__all__ = [
    "PLAN_FORMAT", "PLAN_VERSION", "SUPPORTED_VERSIONS", "MAX_PLAN_BYTES", "PlanError", "plan_digest",
    "plan_from_dict", "validate_plan_dict", "load_plan", "check_ops_match_decisions",
]
