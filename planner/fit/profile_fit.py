"""Fit named hardware-profile fields to measured training runs, through the simulator itself (`tierflow fit`).

A run is what was measured on a box: model, schedule family, batch, micro-batch (or "best": the fastest
power-of-two divisor of the batch that fits), sequence length, placement (the library's default or JSON
fractions as `tierflow simulate --placement` takes), profile overrides such as ``ssd.count=6``, and the
measured iteration time or TFLOPS (hardware TFLOPS count the recompute forward, model TFLOPS do not).

`fit` chooses values for a few profile fields, each within declared physical bounds, that minimise the sum of
squared relative errors between the simulated and the measured values. It optimises the logarithms of the
values (rates are scale quantities) with scipy's bounded Nelder-Mead (or Powell) method from the base value
and from the geometric centre of the bounds (`restarts`), keeping the best. The simulator is piecewise smooth
in the rates (a bottleneck moves from one resource to another), so the method does not use derivatives, and a
cache keyed by (run, micro-batch, values) avoids simulating a point twice. A "best" micro-batch is chosen at
the start point and kept fixed while the optimiser runs; it is then chosen again at the optimum and the fit
repeats until the choice no longer changes, so the reported predictions use each run's fastest micro-batch at
the fitted values.

It reports each run's residual, the leave-one-out error (each run refitted without it, warm-started from the
full fit, then predicted), and which fields the data cannot identify: no prediction moves by more than 1% when
the field goes to either bound, no prediction moves near the fitted value (the data only bounds it from one
side), or its sensitivities (d log prediction / d log field per run) are collinear with another field's
(|cos| > 0.99: only a combination of the two is determined). Fitted values on a bound are reported too.

`write_fitted_profile` writes a profile YAML (the base file's text, with each fitted line replaced and
commented with the data it came from). Torch-free, like the rest of the planner.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from scipy.optimize import minimize

from tierflow.errors import TierflowError
from tierflow.hwprofiles import HardwareProfile, ProfileError, list_profiles, load_profile, parse_overrides
from tierflow.hwprofiles.inputs import (
    MIB,
    InputLimitError,
    check_yaml_depth,
    csv_rows_limited,
    read_limited_text,
)
from tierflow.hwprofiles.profile import profile_from_dict
from tierflow.planner.core.families import FAMILIES
from tierflow.planner.core.models import ModelError, ModelSpec, get_model
from tierflow.planner.core.placement import Placement, PlacementError, parse_placement
from tierflow.planner.core.schedules import ScheduleError, make_schedule
from tierflow.planner.core.simulate import simulate_config
from tierflow.planner.core.simulator import CapacityError, SimResult, SimulationError

MEASURES = ("hw_tflops", "model_tflops", "iteration_s")
COLUMNS = ("model", "hw", "schedule", "batch", "micro_batch", "seq", "placement", "overrides", "measured",
           "measure")
# blank or absent: the model's seq, the default placement, none
OPTIONAL_COLUMNS = ("seq", "placement", "overrides")
MAX_RUNS_BYTES = 16 * MIB  # a file of measured runs: a few hundred rows (hwprofiles.inputs bounds reading)
UNIDENTIFIED_CHANGE = 0.01  # a field whose bounds move no prediction by more than this is unidentified
COLLINEAR_COS = 0.99  # sensitivity columns more aligned than this are not separable
# |d log prediction / d log field| below this for every run (a 10% change moves no prediction by more than
# 0.1%): locally insensitive
INSENSITIVE = 0.01
JACOBIAN_STEP = 0.02  # log-space step of the finite differences (about 2%)
PENALTY = 10.0  # relative residual charged for a run that does not fit (or an invalid profile) at some values
# Added to the objective the optimiser sees: Powell's stopping rule is relative to the objective, which for an
# exact fit (synthetic data) falls towards 0 without end; with this floor it stops once an iteration gains
# less than ftol x floor (relative residuals of about 1e-4). Nelder-Mead's fatol is absolute and unaffected.
OBJECTIVE_FLOOR = 1e-4
MAX_ROUNDS = 3  # re-choices of the "best" micro-batches


class FitError(TierflowError, ValueError):
    """Bad runs, fields or bounds; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


# ---- runs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One measured training run."""

    model: str
    hw: str
    schedule: str
    batch: int
    micro_batch: int | str  # sequences per micro-batch, or "best"
    seq: int | None  # None: the model's own
    placement: str  # "default", "gpu" / "cpu" / "ssd", or JSON fractions per tensor class
    overrides: dict[str, str] = field(hash=False)  # profile overrides, e.g. {"ssd.count": "6"}
    measured: float = 0.0
    measure: str = "hw_tflops"  # hw_tflops | model_tflops | iteration_s
    row: int = 0  # 1-based data row in its file (0: not from a file)
    source: str = ""  # the file it came from
    # model fields the run changes, written in the overrides column as model.FIELD=VALUE (e.g.
    # model.lm_head=false for a benchmark model without an LM head)
    model_overrides: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> tuple:
        return (self.model, self.schedule, self.batch, self.micro_batch, self.seq, self.placement,
                tuple(sorted(self.overrides.items())), self.model_overrides)

    def label(self) -> str:
        ov = ",".join([f"model.{k}={v}" for k, v in self.model_overrides]
                      + [f"{k}={v}" for k, v in self.overrides.items()])
        mb = f"{self.batch}x{self.micro_batch}" if self.micro_batch != "best" else f"{self.batch}xbest"
        parts = [self.model, self.schedule, mb]
        if self.seq:
            parts.append(f"seq {self.seq}")
        if self.placement != "default":
            parts.append("custom placement")
        if ov:
            parts.append(ov)
        return " ".join(parts)

    def where(self) -> str:
        return f"{self.source or 'runs'}: row {self.row}" if self.row else (self.source or "run")


@dataclass(frozen=True)
class FitField:
    """A profile field to fit (dotted key) and its physical bounds."""

    key: str
    lower: float
    upper: float

    @classmethod
    def parse(cls, text: str) -> FitField:
        """``ssd.read_gbps=0.5:8`` -> FitField("ssd.read_gbps", 0.5, 8.0)."""
        m = re.fullmatch(r"\s*([A-Za-z_]\w*\.[A-Za-z_]\w*)\s*=\s*([^:]+):([^:]+)\s*", text or "")
        fix = "write section.key=LOW:HIGH, e.g. --field ssd.read_gbps=0.5:8"
        if not m:
            raise FitError(f"--field {text!r}: expected section.key=LOW:HIGH ({fix})")
        try:
            lo, hi = float(m.group(2)), float(m.group(3))
        except ValueError:
            raise FitError(f"--field {text!r}: bounds must be numbers ({fix})") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo < hi):
            raise FitError(f"--field {text!r}: bounds must satisfy 0 < LOW < HIGH (the fit works on "
                           "logarithms)")
        return cls(m.group(1), lo, hi)

    def describe(self) -> str:
        return f"{self.key} in [{_num(self.lower)}, {_num(self.upper)}]"


RUNS_OVERRIDE_SYNTAX = ("overrides: {item!r} is not section.key=value (write e.g. "
                        "ssd.count=6;cpu.memory_gib=256)")


def run_overrides(text: str) -> dict[str, str]:
    """A runs file's overrides column, ``ssd.count=6;cpu.memory_gib=256`` -> {"ssd.count": "6", ...}."""
    items = [item.strip() for item in (text or "").split(";") if item.strip()]
    return parse_overrides(items, RUNS_OVERRIDE_SYNTAX, need_value=True)


def run_placement(text: str) -> Placement | None:
    """A runs file's placement column: "default" (or blank) -> None (the schedule's default); else gpu | cpu |
    ssd or JSON fractions per tensor class, as `tierflow simulate --placement` takes them (not a file)."""
    text = (text or "").strip()
    return None if text == "default" else parse_placement(text, flag="", files=False)


@lru_cache(maxsize=256)
def _model(name: str, seq: int | None, model_overrides: tuple[tuple[str, str], ...] = ()) -> ModelSpec:
    m = get_model(name)
    if model_overrides:
        m = with_model_overrides(m, model_overrides)
    return m.with_seq(seq) if seq else m


def with_model_overrides(model: ModelSpec, overrides: tuple[tuple[str, str], ...]) -> ModelSpec:
    """The model with fields replaced (values parsed by the field's type; the name says what changed)."""
    fields = {f.name: f for f in dataclasses.fields(ModelSpec)}
    values = {}
    for key, text in overrides:
        if key not in fields or key == "name":
            raise FitError(f"model.{key}: not a model field (known: "
                           f"{', '.join(k for k in fields if k != 'name')})")
        current = getattr(model, key)
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise FitError(f"model.{key}: expected true or false, got {text!r}")
            values[key] = text.lower() == "true"
        elif isinstance(current, int):
            try:
                values[key] = int(text)
            except ValueError:
                raise FitError(f"model.{key}: expected an integer, got {text!r}") from None
        else:
            values[key] = type(current)(text)
    name = model.name + "".join(f"[{k}={v}]" for k, v in overrides)
    try:
        return dataclasses.replace(model, name=name, **values)
    except (ModelError, ValueError, TypeError) as e:
        raise FitError(f"model overrides {dict(overrides)}: {e}") from None


@lru_cache(maxsize=64)
def _profile(name: str) -> HardwareProfile:
    return load_profile(name)


@lru_cache(maxsize=256)
def _num(x: float | None) -> str:
    return "null" if x is None else f"{x:.4g}"


# ---- loading -----------------------------------------------------------------------------------------------


class _RowError(Exception):
    def __init__(self, column: str, problem: str) -> None:
        self.column, self.problem = column, problem


def load_runs(path: str | Path) -> list[Run]:
    """Runs from a CSV (header: COLUMNS; lines starting with '#' are comments) or a YAML list of mappings with
    the same keys. Any problem raises FitError: one line naming the file, the data row (1-based) and the
    column."""
    path = Path(path)
    src = str(path)
    try:  # bounded (hwprofiles.inputs): a regular file or a pipe, at most MAX_RUNS_BYTES
        text = read_limited_text(path, MAX_RUNS_BYTES)
    except InputLimitError as e:
        raise FitError(f"{src}: {e} (a file of measured runs is a small CSV or YAML file)") from None
    except FileNotFoundError:
        raise FitError(f"{src}: file not found (give the path of a CSV or YAML file of runs)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise FitError(f"{src}: cannot read ({e})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        records, lines = _yaml_records(text, src)
    else:
        records, lines = _csv_records(text, src)
    if not records:
        raise FitError(f"{src}: no runs (add one row per measured run under the header {','.join(COLUMNS)})")
    runs = []
    for i, rec in enumerate(records, start=1):
        try:
            runs.append(_make_run(rec, i, src))
        except _RowError as e:
            line = f" (line {lines[i - 1]})" if lines[i - 1] else ""
            raise FitError(f"{src}: row {i}{line}, column {e.column}: {e.problem}") from None
    return runs


def _normalise(name: str) -> str:
    return str(name).strip().lower().replace("-", "_").replace(" ", "_")


def _check_columns(names: Sequence[str], src: str, where: str) -> None:
    for name in names:
        if name not in COLUMNS:
            close = difflib.get_close_matches(name, COLUMNS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"the columns are {', '.join(COLUMNS)}"
            raise FitError(f"{src}: {where}, column {name or '(empty)'}: unknown column ({hint})")
    for name in COLUMNS:
        if name not in names and name not in OPTIONAL_COLUMNS:
            raise FitError(f"{src}: {where}, column {name}: missing (add a '{name}' column; the columns are "
                           f"{', '.join(COLUMNS)})")


def _csv_records(text: str, src: str) -> tuple[list[dict[str, str]], list[int]]:
    kept = [(n, line) for n, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not kept:
        return [], []
    try:
        rows = csv_rows_limited("\n".join(line for _, line in kept))
    except ValueError as e:  # a field past the limit (InputLimitError), a CSV syntax error
        raise FitError(f"{src}: {e}") from None
    header = [_normalise(c) for c in rows[0]]
    _check_columns(header, src, f"header (line {kept[0][0]})")
    dup = [c for c in header if header.count(c) > 1]
    if dup:
        raise FitError(f"{src}: header (line {kept[0][0]}), column {dup[0]}: appears twice (keep one)")
    records, lines = [], []
    for i, cells in enumerate(rows[1:], start=1):
        line = kept[i][0] if i < len(kept) else 0
        if len(cells) != len(header):
            raise FitError(f"{src}: row {i} (line {line}), column "
                           f"{header[min(len(cells), len(header)) - 1]}: {len(cells)} cells for "
                           f"{len(header)} columns (quote cells that contain commas, "
                           f"such as JSON placements, with double quotes)")
        records.append({h: c.strip() for h, c in zip(header, cells)})
        lines.append(line)
    return records, lines


def _yaml_records(text: str, src: str) -> tuple[list[dict[str, str]], list[int]]:
    try:
        check_yaml_depth(text)
        data = yaml.safe_load(text)
    except InputLimitError as e:
        raise FitError(f"{src}: {e}") from None
    except yaml.YAMLError as e:
        raise FitError(f"{src}: malformed YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return [], []
    if not isinstance(data, list):
        raise FitError(f"{src}: expected a list of runs (mappings with keys {', '.join(COLUMNS)})")
    records = []
    for i, item in enumerate(data, start=1):
        if not isinstance(item, dict):
            raise FitError(f"{src}: row {i}, column (all): expected a mapping with keys {', '.join(COLUMNS)}")
        rec = {}
        for k, v in item.items():
            if isinstance(v, dict):
                v = json.dumps(v) if _normalise(k) == "placement" else ";".join(f"{a}={b}"
                                                                                for a, b in v.items())
            rec[_normalise(k)] = "" if v is None else str(v)
        _check_columns(list(rec), src, f"row {i}")
        records.append(rec)
    return records, [0] * len(records)


def _positive_int(rec: dict[str, str], col: str) -> int:
    text = rec.get(col, "")
    try:
        value = int(text)
    except ValueError:
        raise _RowError(col, f"expected a positive integer, got {text!r} (write a whole number such as "
                        "48)") from None
    if value <= 0:
        raise _RowError(col, f"expected a positive integer, got {value} (write a whole number such as 48)")
    return value


def _make_run(rec: dict[str, str], row: int, src: str) -> Run:
    for col in COLUMNS:
        if col not in OPTIONAL_COLUMNS and not rec.get(col):
            raise _RowError(col, "empty (every run needs a value here)")
    try:
        model = get_model(rec["model"])
    except ModelError as e:
        raise _RowError("model", f"{e} (see `tierflow models`)") from None
    try:
        hw = _profile(rec["hw"])
    except ProfileError as e:
        raise _RowError("hw", str(e)) from None
    schedule = rec["schedule"]
    if schedule not in FAMILIES:
        raise _RowError("schedule", f"unknown schedule {schedule!r} (use one of {', '.join(FAMILIES)})")
    batch = _positive_int(rec, "batch")
    mb_text = rec["micro_batch"].lower()
    micro_batch: int | str = "best" if mb_text == "best" else _positive_int(rec, "micro_batch")
    if micro_batch != "best" and batch % micro_batch:
        raise _RowError("micro_batch", f"{micro_batch} does not divide the batch {batch} (use a divisor, or "
                        "best)")
    seq = _positive_int(rec, "seq") if rec.get("seq") else None
    if seq:
        try:
            model.with_seq(seq)
        except ModelError as e:
            raise _RowError("seq", str(e)) from None
    placement = rec.get("placement") or "default"
    try:
        run_placement(placement)
    except PlacementError as e:
        raise _RowError("placement", str(e)) from None
    try:
        overrides = run_overrides(rec.get("overrides", ""))
        model_overrides = tuple((k.removeprefix("model."), v) for k, v in overrides.items()
                                if k.startswith("model."))
        overrides = {k: v for k, v in overrides.items() if not k.startswith("model.")}
        hw.with_overrides(overrides)
        if model_overrides:
            with_model_overrides(model, model_overrides)
    except (FitError, ProfileError) as e:
        raise _RowError("overrides", str(e)) from None
    try:
        measured = float(rec["measured"])
    except ValueError:
        raise _RowError("measured", f"expected a number, got {rec['measured']!r} (write e.g. "
                        "146.3)") from None
    if not (math.isfinite(measured) and measured > 0):
        raise _RowError("measured", f"must be a positive number, got {rec['measured']!r}")
    measure = rec["measure"].lower()
    if measure not in MEASURES:
        raise _RowError("measure", f"unknown measure {rec['measure']!r} (use one of {', '.join(MEASURES)}: "
                        "hardware TFLOPS count the recompute forward, model TFLOPS do not)")
    return Run(model=rec["model"], hw=rec["hw"], schedule=schedule, batch=batch, micro_batch=micro_batch,
               seq=seq, placement=placement, overrides=overrides, measured=measured, measure=measure, row=row,
               source=src, model_overrides=model_overrides)


# ---- prediction --------------------------------------------------------------------------------------------


def micro_batches(run: Run) -> list[int]:
    """The micro-batches a run may use: its own, or every power-of-two divisor of the batch for "best"."""
    if run.micro_batch != "best":
        return [int(run.micro_batch)]
    out, mb = [], 1
    while mb <= run.batch:
        if run.batch % mb == 0:
            out.append(mb)
        mb *= 2
    return out


def simulate_run(run: Run, hw: HardwareProfile, micro_batch: int) -> SimResult:
    """Simulate `run` on `hw` (its overrides already applied) at one micro-batch."""
    model = _model(run.model, run.seq, run.model_overrides)
    cfg = make_schedule(run.schedule, model, hw, batch=run.batch, micro_batch=micro_batch, seq=model.seq_len,
                        placement=run_placement(run.placement))
    return simulate_config(model, hw, cfg)


def measure_of(res: SimResult, measure: str) -> float:
    return float(getattr(res, measure))


@dataclass(frozen=True)
class Prediction:
    value: float  # in the run's measure
    micro_batch: int
    iteration_s: float


def predict(run: Run, hw: HardwareProfile) -> Prediction:
    """The simulated value of `run` on `hw` (the base profile: the run's overrides are applied here). For a
    "best" micro-batch, the fastest power-of-two divisor of the batch that fits (CapacityError: does not
    fit)."""
    hw_run = hw.with_overrides(run.overrides) if run.overrides else hw
    best: tuple[int, SimResult] | None = None
    errors = []
    for mb in micro_batches(run):
        try:
            res = simulate_run(run, hw_run, mb)
        except (CapacityError, ScheduleError) as e:
            errors.append(f"micro-batch {mb}: {e}")
            continue
        if best is None or res.iteration_s < best[1].iteration_s:
            best = (mb, res)
    if best is None:
        raise FitError(f"{run.where()}: {run.label()} does not fit on {hw_run.name} "
                       f"({'; '.join(errors)[:300]})")
    return Prediction(measure_of(best[1], run.measure), best[0], best[1].iteration_s)


# ---- the fit -----------------------------------------------------------------------------------------------


@dataclass
class RunFit:
    run: Run
    predicted: float
    micro_batch: int | None
    residual: float  # predicted / measured - 1
    loo_predicted: float | None = None
    loo_residual: float | None = None

    @property
    def measured(self) -> float:
        return self.run.measured

    def to_dict(self) -> dict[str, Any]:
        r = self.run
        return {"row": r.row, "label": r.label(), "model": r.model, "hw": r.hw, "schedule": r.schedule,
                "batch": r.batch, "micro_batch": r.micro_batch, "micro_batch_used": self.micro_batch,
                "seq": r.seq, "placement": r.placement, "overrides": r.overrides, "measure": r.measure,
                "measured": r.measured, "predicted": self.predicted, "residual": self.residual,
                "loo_predicted": self.loo_predicted, "loo_residual": self.loo_residual}


@dataclass
class FitResult:
    fields: list[FitField]
    values: dict[str, float]  # fitted
    initial: dict[str, float | None]  # the base profile's
    runs: list[RunFit]
    rms: float  # relative, over the runs
    max_abs: float
    loo_rms: float | None
    loo_max_abs: float | None
    unidentified: dict[str, str]  # field -> why
    at_bound: dict[str, str]  # field -> "lower" | "upper"
    sensitivity: dict[str, list[float]]  # field -> d log prediction / d log field, per run
    evaluations: int  # objective evaluations (all fits, leave-one-out included)
    simulations: int  # distinct simulations run
    wall_s: float
    base_hw: str
    base_source: str
    method: str

    def notes(self) -> list[str]:
        out = [f"{k}: unidentified: {why}" for k, why in self.unidentified.items()]
        for k, side in self.at_bound.items():
            f = next(f for f in self.fields if f.key == k)
            bound = f.lower if side == "lower" else f.upper
            out.append(f"{k}: at its {side} bound {_num(bound)} (the data would push it further; widen the "
                       "bound only if that is physically possible)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"base_hw": self.base_hw, "base_source": self.base_source, "method": self.method,
                "fields": [{"key": f.key, "lower": f.lower, "upper": f.upper, "initial": self.initial[f.key],
                            "value": self.values[f.key], "unidentified": self.unidentified.get(f.key),
                            "at_bound": self.at_bound.get(f.key), "sensitivity": self.sensitivity.get(f.key)}
                           for f in self.fields],
                "values": self.values, "rms": self.rms, "max_abs": self.max_abs, "loo_rms": self.loo_rms,
                "loo_max_abs": self.loo_max_abs, "unidentified": self.unidentified, "at_bound": self.at_bound,
                "runs": [r.to_dict() for r in self.runs], "evaluations": self.evaluations,
                "simulations": self.simulations, "wall_s": self.wall_s, "notes": self.notes()}


Progress = Callable[[int, int, str], None]


class FitProblem:
    """The runs, the base profile and the fields, with a cache of simulations keyed by (run, micro-batch,
    values)."""

    def __init__(self, runs: list[Run], base_hw: HardwareProfile, fields: list[FitField]) -> None:
        self.runs, self.base, self.fields = runs, base_hw, fields
        self.keys = [f.key for f in fields]
        self.lo = np.log([f.lower for f in fields])
        self.hi = np.log([f.upper for f in fields])
        self.cache: dict[tuple, float | None] = {}
        self.hw_cache: dict[tuple, HardwareProfile | None] = {}
        self.simulations = 0
        self.evaluations = 0
        # (evaluations, objective) for progress
        self.on_evaluation: Callable[[int, float], None] | None = None

    @staticmethod
    def xkey(x: np.ndarray) -> tuple:
        return tuple(round(float(v), 10) for v in x)

    def values(self, x: np.ndarray) -> dict[str, float]:
        return {k: float(math.exp(v)) for k, v in zip(self.keys, x)}

    def hw(self, i: int, x: np.ndarray) -> HardwareProfile | None:
        key = (self.runs[i].key, self.xkey(x))
        if key not in self.hw_cache:
            try:
                self.hw_cache[key] = self.base.with_overrides({**self.runs[i].overrides, **self.values(x)})
            except ProfileError:  # e.g. pcie.h2d_gbps below pcie.duplex_h2d_gbps
                self.hw_cache[key] = None
        return self.hw_cache[key]

    def value(self, i: int, mb: int, x: np.ndarray) -> float | None:
        """The run's simulated measure at micro-batch mb and log-values x; None if it does not fit."""
        run = self.runs[i]
        key = (run.key, run.measure, mb, self.xkey(x))
        if key not in self.cache:
            hw = self.hw(i, x)
            out = None
            if hw is not None:
                self.simulations += 1
                try:
                    out = measure_of(simulate_run(run, hw, mb), run.measure)
                except (CapacityError, ScheduleError, SimulationError):
                    out = None
            self.cache[key] = out
        return self.cache[key]

    def best(self, i: int, x: np.ndarray) -> tuple[int | None, float | None]:
        """(micro-batch, value) of the fastest micro-batch that fits, or (None, None)."""
        run = self.runs[i]
        found: tuple[int | None, float | None] = (None, None)
        for mb in micro_batches(run):
            v = self.value(i, mb, x)
            if v is None:
                continue
            faster = found[1] is None or ((v < found[1]) if run.measure == "iteration_s" else (v > found[1]))
            if faster:
                found = (mb, v)
        return found

    def residual(self, i: int, v: float | None) -> float:
        return PENALTY if v is None else v / self.runs[i].measured - 1.0

    def objective(self, x: np.ndarray, subset: Sequence[int], mbs: dict[int, int]) -> float:
        self.evaluations += 1
        x = np.clip(x, self.lo, self.hi)
        f = float(sum(self.residual(i, self.value(i, mbs[i], x)) ** 2 for i in subset))
        if self.on_evaluation:
            self.on_evaluation(self.evaluations, math.sqrt(f / max(1, len(subset))))
        return f

    def _floored(self, x: np.ndarray, subset: Sequence[int], mbs: dict[int, int]) -> float:
        return self.objective(x, subset, mbs) + OBJECTIVE_FLOOR

    def choose(self, subset: Sequence[int], x: np.ndarray, previous: dict[int, int]) -> dict[int, int]:
        out = dict(previous)
        for i in subset:
            mb, _ = self.best(i, x)
            if mb is not None:
                out[i] = mb
        return out

    def _simplex(self, x0: np.ndarray, scale: float) -> np.ndarray:
        """Nelder-Mead's first simplex: x0 and a step of `scale` x the log-range along each axis (inwards)."""
        pts = [x0]
        for j in range(len(x0)):
            x = x0.copy()
            step = scale * (self.hi[j] - self.lo[j])
            x[j] = x0[j] + step if x0[j] + step <= self.hi[j] else x0[j] - step
            pts.append(x)
        return np.array(pts)

    def optimise(self, subset: Sequence[int], starts: list[np.ndarray], mbs: dict[int, int], method: str,
                 max_evals: int, scale: float = 0.15) -> tuple[np.ndarray, dict[int, int]]:
        """Minimise over `subset` from each start; re-choose "best" micro-batches at the optimum until
        stable."""
        bounds = list(zip(self.lo, self.hi))
        mbs = self.choose(subset, starts[0], mbs)
        x_best = starts[0]
        for _ in range(MAX_ROUNDS):
            best_f = math.inf
            for x0 in starts:
                x0 = np.clip(x0, self.lo, self.hi)
                res = minimize(self._floored, x0, args=(subset, mbs), method=method, bounds=bounds,
                               options=_options(method, max_evals, self._simplex(x0, scale)))
                x = np.clip(res.x, self.lo, self.hi)
                f = self.objective(x, subset, mbs)
                if f < best_f:
                    best_f, x_best = f, x
            new = self.choose(subset, x_best, mbs)
            if new == mbs:
                break
            mbs, starts = new, [x_best]
        return x_best, mbs


def _options(method: str, max_evals: int, simplex: np.ndarray) -> dict[str, Any]:
    if method == "Powell":
        return {"xtol": 1e-4, "ftol": 1e-5, "maxfev": max_evals}
    if method == "Nelder-Mead":
        return {"xatol": 1e-3, "fatol": 1e-9, "maxfev": max_evals, "initial_simplex": simplex}
    raise FitError(f"unknown method {method!r} (use Nelder-Mead or Powell)")


def _check(runs: Sequence[Run], base_hw: HardwareProfile, fields: Sequence[FitField]) -> None:
    if not runs:
        raise FitError("no runs to fit")
    if not fields:
        raise FitError("no fields to fit (give at least one --field section.key=LOW:HIGH)")
    data = base_hw.to_dict()
    seen = set()
    for f in fields:
        if f.key in seen:
            raise FitError(f"--field {f.key}: given twice (fit each field once)")
        seen.add(f.key)
        section, _, key = f.key.partition(".")
        if section not in data or not isinstance(data[section], dict) or key not in data[section]:
            known = [f"{s}.{k}" for s in data if isinstance(data[s], dict) for k in data[s]]
            close = difflib.get_close_matches(f.key, known, n=1)
            raise FitError(f"--field {f.key}: unknown profile key ("
                           + (f"did you mean '{close[0]}'?" if close else f"known: {', '.join(known)}") + ")")
        value = data[section][key]
        if isinstance(value, (bool, int, str)):
            raise FitError(f"--field {f.key}: only real-valued fields can be fitted ({f.key} is "
                           f"{type(value).__name__}; vary it per run with the overrides column instead)")
        if not f.lower < f.upper or f.lower <= 0:
            raise FitError(f"--field {f.key}: bounds must satisfy 0 < lower < upper")
        for bound in (f.lower, f.upper):
            try:
                base_hw.with_overrides({f.key: bound})
            except ProfileError as e:
                raise FitError(f"--field {f.key}: the bound {_num(bound)} makes {base_hw.name} invalid: {e} "
                               "(narrow the bounds)") from None
    first = runs[0]
    for r in runs:
        if r.hw != first.hw:
            raise FitError(f"{r.where()}, column hw: {r.hw!r} differs from {first.hw!r} in row {first.row} "
                           f"(fit one box at a time: split the file)")
        clash = sorted(set(r.overrides) & seen)
        if clash:
            raise FitError(f"{r.where()}, column overrides: {clash[0]} is also a fitted field (drop it from "
                           "the overrides or from the --field list)")


def fit(runs: Sequence[Run], base_hw: HardwareProfile, fields: Sequence[FitField], *, loo: bool = True,
        method: str = "Nelder-Mead", restarts: int = 1, max_evals: int = 400, seed: int = 0,
        progress: Progress | None = None) -> FitResult:
    """Fit `fields` of `base_hw` to the measured `runs` (see the module docstring). `restarts` extra starts
    beyond the base value: the geometric centre of the bounds, then random points (seeded)."""
    t0 = time.perf_counter()
    runs, fields = list(runs), list(fields)
    _check(runs, base_hw, fields)
    p = FitProblem(runs, base_hw, fields)
    n_runs = len(runs)
    total = 2 + (n_runs if loo else 0)
    step = [0]

    def report(what: str) -> None:
        if progress:
            progress(step[0], total, what)

    data = base_hw.to_dict()
    initial = {f.key: data[f.key.split(".")[0]][f.key.split(".")[1]] for f in fields}
    x0 = np.array([math.log(v) if v else (lo + hi) / 2 for v, lo, hi in zip(initial.values(), p.lo, p.hi)])
    x0 = np.clip(x0, p.lo, p.hi)
    rng = np.random.default_rng(seed)
    starts = [x0] + [(p.lo + p.hi) / 2 if k == 0 else rng.uniform(p.lo, p.hi) for k in range(restarts)]

    everyone = list(range(n_runs))
    report("checking the runs at the base values")
    mbs0: dict[int, int] = {}
    for i, run in enumerate(runs):
        mb, v = p.best(i, x0)
        if mb is None:
            try:  # the reason, in one line
                predict(run, p.hw(i, x0) or base_hw)
            except (FitError, ProfileError) as e:
                raise FitError(str(e)) from None
            raise FitError(f"{run.where()}: {run.label()} does not fit at the start values")
        mbs0[i] = mb

    phase = ["fit", math.inf]  # what runs, the best rms in it so far

    def on_evaluation(k: int, rms: float) -> None:
        phase[1] = min(phase[1], rms)
        if k % 5 == 0:
            report(f"{phase[0]}: {k} evaluations, best rms {phase[1]:.2%}")

    p.on_evaluation = on_evaluation
    x, mbs = p.optimise(everyone, starts, mbs0, method, max_evals)
    step[0] = 1
    fitted: list[RunFit] = []
    for i, run in enumerate(runs):
        mb, v = p.best(i, x)
        fitted.append(RunFit(run, v if v is not None else math.nan, mb, p.residual(i, v)))

    if loo and n_runs > 1:
        for i in everyone:
            phase[:] = [f"leave-one-out {i + 1}/{n_runs}", math.inf]
            others = [j for j in everyone if j != i]
            x_i, _ = p.optimise(others, [x], mbs, method, max_evals, scale=0.02)
            _, v = p.best(i, x_i)
            fitted[i].loo_predicted = v
            fitted[i].loo_residual = p.residual(i, v)
            step[0] += 1

    p.on_evaluation = None
    report("identifiability")
    unidentified, at_bound, sens = identify(p, x, mbs)
    step[0] = total
    report("done")
    res = [r.residual for r in fitted]
    loos = [r.loo_residual for r in fitted if r.loo_residual is not None]
    return FitResult(
        fields=fields, values=p.values(x), initial=initial, runs=fitted,
        rms=float(np.sqrt(np.mean(np.square(res)))), max_abs=float(np.max(np.abs(res))),
        loo_rms=float(np.sqrt(np.mean(np.square(loos)))) if loos else None,
        loo_max_abs=float(np.max(np.abs(loos))) if loos else None,
        unidentified=unidentified, at_bound=at_bound, sensitivity=sens, evaluations=p.evaluations,
        simulations=p.simulations, wall_s=time.perf_counter() - t0, base_hw=base_hw.name,
        base_source=base_hw.source, method=method)


def identify(p: FitProblem, x: np.ndarray, mbs: dict[int, int]
              ) -> tuple[dict[str, str], dict[str, str], dict[str, list[float]]]:
    n = len(p.runs)
    base = np.array([p.value(i, mbs[i], x) or math.nan for i in range(n)])
    unidentified: dict[str, str] = {}
    at_bound: dict[str, str] = {}
    # 1. moving each field to either bound (each run at its fitted micro-batch)
    for j, key in enumerate(p.keys):
        change = 0.0
        for bound in (p.lo[j], p.hi[j]):
            xb = x.copy()
            xb[j] = bound
            for i in range(n):
                v = p.value(i, mbs[i], xb)
                change = max(change, PENALTY if v is None else abs(v / base[i] - 1))
        if change <= UNIDENTIFIED_CHANGE:
            unidentified[key] = ("no run is sensitive to it: moving it to either bound changes no "
                                 f"prediction by more than {UNIDENTIFIED_CHANGE:.0%} (largest change "
                                 f"{change:.2%})")
        if x[j] - p.lo[j] < 1e-3:
            at_bound[key] = "lower"
        elif p.hi[j] - x[j] < 1e-3:
            at_bound[key] = "upper"
    # 2. sensitivities d log prediction / d log field at the fit (each run at its chosen micro-batch)
    J = np.zeros((n, len(p.keys)))
    for j in range(len(p.keys)):
        up, down = x.copy(), x.copy()
        up[j] = min(p.hi[j], x[j] + JACOBIAN_STEP)
        down[j] = max(p.lo[j], x[j] - JACOBIAN_STEP)
        h = up[j] - down[j]
        for i in range(n):
            a, b = p.value(i, mbs[i], up), p.value(i, mbs[i], down)
            J[i, j] = math.log(a / b) / h if a and b and h > 0 else 0.0
    sens = {key: [float(v) for v in J[:, j]] for j, key in enumerate(p.keys)}
    norms = np.linalg.norm(J, axis=0)
    for j, key in enumerate(p.keys):
        if key not in unidentified and np.max(np.abs(J[:, j])) < INSENSITIVE:
            unidentified[key] = ("no prediction changes near the fitted value (largest |d log prediction / "
                                 f"d log field| {np.max(np.abs(J[:, j])):.4f}): the data bound it from one "
                                 "side only, any value beyond the point where it stops binding fits as well")
    for j, key in enumerate(p.keys):
        for k, other in enumerate(p.keys):
            if k == j or norms[j] < INSENSITIVE or norms[k] < INSENSITIVE:
                continue
            cos = float(J[:, j] @ J[:, k] / (norms[j] * norms[k]))
            if abs(cos) > COLLINEAR_COS and key not in unidentified:
                unidentified[key] = (f"collinear with {other} (|cos| = {abs(cos):.3f} between their "
                                     "sensitivities): the data determine only a combination of the two")
    return unidentified, at_bound, sens


# ---- writing the fitted profile ----------------------------------------------------------------------------


def _yaml_number(v: float) -> str:
    text = repr(float(f"{v:.4g}"))
    if "e" in text and "." not in text.split("e")[0]:  # YAML 1.1 reads 1e-05 as a string
        mantissa, exp = text.split("e")
        text = f"{mantissa}.0e{exp}"
    return text


def _base_text(hw: HardwareProfile) -> str | None:
    src = hw.source
    stem = (src[len("hwprofiles/"):-len(".yaml")] if src.startswith("hwprofiles/") and src.endswith(".yaml")
            else None)
    if stem and stem in list_profiles():
        return resources.files("tierflow.hwprofiles").joinpath(f"{stem}.yaml").read_text(encoding="utf-8")
    path = Path(src)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
    return None


def _generated_text(hw: HardwareProfile) -> str:
    return yaml.safe_dump(hw.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True,
                          width=10**6)


_TOP = re.compile(r"^([A-Za-z_]\w*):(.*)$")
_KEY = re.compile(r"^(\s+)([A-Za-z_]\w*):(.*)$")


def _edit(text: str, name: str, changes: dict[str, tuple[str, str]]) -> str | None:
    """Replace the lines of the dotted keys in `changes` ({key: (value text, comment)}) and the name line;
    None when the layout is not the simple one the bundled files use."""
    lines = text.splitlines()
    section, ends, done, named = None, {}, set(), False
    for i, line in enumerate(lines):
        top = _TOP.match(line)
        if top:
            section = top.group(1)
            if section == "name":
                lines[i] = f"name: {json.dumps(name)}"
                named = True
            ends[section] = i + 1
            continue
        m = _KEY.match(line)
        if m and section:
            ends[section] = i + 1
            dotted = f"{section}.{m.group(2)}"
            if dotted in changes:
                value, comment = changes[dotted]
                lines[i] = f"{m.group(1)}{m.group(2)}: {value}  # {comment}"
                done.add(dotted)
    if not named:
        return None
    for dotted in sorted(set(changes) - done, key=lambda d: -ends.get(d.split(".")[0], 0)):
        sec, key = dotted.split(".")
        if sec not in ends:
            return None
        value, comment = changes[dotted]
        lines.insert(ends[sec], f"  {key}: {value}  # {comment}")
    return "\n".join(lines) + "\n"


def write_fitted_profile(base_hw: HardwareProfile, result: FitResult, path: str | Path, data_name: str,
                         name: str | None = None) -> HardwareProfile:
    """Write a profile YAML: `base_hw` with the fitted values, each fitted line carrying a comment naming the
    data, the run count, the leave-one-out error and the bounds. Every other value (and, when the base profile
    came from a file, its comment) is kept. Returns the profile as loaded back from the file."""
    name = name or f"{base_hw.name}-fit"
    n = len(result.runs)
    loo = f"LOO error {result.loo_rms:.1%}" if result.loo_rms is not None else "no LOO"
    target = base_hw.to_dict()
    changes: dict[str, tuple[str, str]] = {}
    for f in result.fields:
        sec, key = f.key.split(".")
        value = _yaml_number(result.values[f.key])
        target[sec][key] = float(value)
        was = _num(result.initial[f.key])
        notes = ""
        if f.key in result.unidentified:
            notes += "; UNIDENTIFIED by this data"
        if f.key in result.at_bound:
            notes += f"; at the {result.at_bound[f.key]} bound"
        changes[f.key] = (value, f"fit: {data_name}, {n} runs, RMS residual {result.rms:.1%}, {loo}, "
                                 f"bounds [{_num(f.lower)}, {_num(f.upper)}], was {was}{notes}")
    fitted = ", ".join(f"{f.key}={_yaml_number(result.values[f.key])}" for f in result.fields)
    header = (f"# Fitted by `tierflow fit` from {data_name} ({n} runs) on {base_hw.name} ({base_hw.source}): "
              f"{fitted}; RMS residual {result.rms:.1%}, {loo}.\n")
    text = _base_text(base_hw)
    out = None
    if text is not None:
        parsed = yaml.safe_load(text)
        # keys whose value in the file differs from base_hw (it carried overrides) are rewritten too
        for sec, values in target.items():
            if isinstance(values, dict):
                for key, v in values.items():
                    dotted = f"{sec}.{key}"
                    old = (parsed.get(sec) or {}).get(key) if isinstance(parsed, dict) else None
                    if dotted not in changes and old != v:
                        vt = "null" if v is None else (json.dumps(v) if isinstance(v, str) else str(v))
                        changes[dotted] = (vt, f"override in {base_hw.name}")
        out = _edit(text, name, changes)
    target["name"] = name
    if out is not None:
        try:
            if profile_from_dict(yaml.safe_load(out)).to_dict() != profile_from_dict(target).to_dict():
                out = None
        except (ProfileError, yaml.YAMLError):
            out = None
    if out is None:
        out = _edit(_generated_text(base_hw), name, {k: v for k, v in changes.items() if k in
                                                      {f.key for f in result.fields}})
    Path(path).write_text(header + out, encoding="utf-8")
    return load_profile(Path(path))
