"""Where each tensor class lives: fractions over GPU, CPU and SSD, the defaults each schedule starts from, and
the one parser of a placement written as text (`parse_placement`: `tierflow simulate --placement`, the
placement column of a runs file)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field

from tierflow.errors import TierflowError
from tierflow.hwprofiles.inputs import MIB, InputLimitError, loads_json_limited, read_limited_text
from tierflow.planner.core.graph import TIERS

TENSOR_CLASSES = ("weights", "master", "adam_m", "adam_v", "grads", "checkpoints")


class PlacementError(TierflowError, ValueError):
    """A placement that cannot be used (fractions, or a combination the executor cannot run)."""


@dataclass(frozen=True)
class Split:
    gpu: float = 0.0
    cpu: float = 1.0
    ssd: float = 0.0

    def __post_init__(self) -> None:
        for tier in TIERS:
            v = getattr(self, tier)
            if not 0.0 <= v <= 1.0:
                raise PlacementError(f"placement fraction {tier}={v} must be within [0, 1]")
        if abs(self.gpu + self.cpu + self.ssd - 1.0) > 1e-6:
            raise PlacementError(f"placement fractions gpu={self.gpu} cpu={self.cpu} ssd={self.ssd} must sum "
                                 "to 1")

    @classmethod
    def from_dict(cls, data: object, where: str = "") -> Split:
        """A split from {gpu, cpu, ssd} fractions (`where` names it in a message); a tier outside those or a
        value that is not an object is one line (PlacementError), not a TypeError of the constructor."""
        if not isinstance(data, dict):
            raise PlacementError(f"{where}: expected an object of gpu/cpu/ssd fractions, got "
                                 f"{json.dumps(data)[:40]}")
        for k, v in data.items():
            if k not in TIERS:
                close = difflib.get_close_matches(str(k), TIERS, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise PlacementError(f"{where}: unknown tier {str(k)[:40]!r} ({hint}the tiers are "
                                     f"{', '.join(TIERS)})")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise PlacementError(f"{where}.{k}: expected a fraction within [0, 1], got "
                                     f"{json.dumps(v)[:40]}")
        return cls(**data)

    @property
    def off_gpu(self) -> float:
        return self.cpu + self.ssd

    def as_dict(self) -> dict[str, float]:
        return {"gpu": self.gpu, "cpu": self.cpu, "ssd": self.ssd}


def _split(**kw: float) -> Split:
    return Split(**kw)


@dataclass(frozen=True)
class Placement:
    """Fractions of every tensor class per tier. `grads` is where gradients accumulate between micro-batches
    (gpu: on the GPU across all micro-batches; cpu: fp32 in host memory; ssd: spilled until the optimizer
    step). `checkpoints` is where activation checkpoints (and, in vertical schedules, the activations and
    activation gradients that wait between layers) are kept."""

    weights: Split = field(default_factory=Split)
    master: Split = field(default_factory=Split)
    adam_m: Split = field(default_factory=Split)
    adam_v: Split = field(default_factory=Split)
    grads: Split = field(default_factory=Split)
    checkpoints: Split = field(default_factory=Split)

    def __post_init__(self) -> None:
        g = self.master.gpu
        if self.adam_m.gpu != g or self.adam_v.gpu != g:
            raise PlacementError("master, adam_m and adam_v must have the same GPU fraction (the optimizer "
                                 "runs where they are)")
        if g not in (0.0, 1.0):
            raise PlacementError(f"optimizer states on the GPU must be all or nothing, got gpu={g}")
        if g == 1.0 and (self.weights.gpu != 1.0 or self.grads.gpu != 1.0):
            raise PlacementError("a GPU optimizer needs the weights and gradients on the GPU too "
                                 "(weights.gpu = grads.gpu = 1)")
        if self.grads.ssd > 0 and self.grads.gpu > 0:
            raise PlacementError("gradients accumulate either on the GPU or on the host side, not both with "
                                 "an SSD spill")

    @property
    def gpu_optimizer(self) -> bool:
        return self.master.gpu == 1.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: getattr(self, name).as_dict() for name in TENSOR_CLASSES}

    @classmethod
    def from_dict(cls, data: dict) -> Placement:
        unknown = set(data) - set(TENSOR_CLASSES)
        if unknown:
            raise PlacementError(f"unknown tensor class {sorted(unknown)[0]!r} (known: "
                                 f"{', '.join(TENSOR_CLASSES)})")
        return cls(**{k: Split.from_dict(v, k) for k, v in data.items()})

    @classmethod
    def uniform(cls, tier: str) -> Placement:
        s = Split(**{t: 1.0 if t == tier else 0.0 for t in TIERS})
        return cls(weights=s, master=s, adam_m=s, adam_v=s, grads=s, checkpoints=s)

    def describe(self, lora: bool = False) -> str:
        """One line of every class's tiers; for a LoRA model (`lora`) the classes that hold something: the
        frozen base (`weights`) and the checkpoints, beside the adapters and their states on the GPU."""
        parts = []
        for name in ("weights", "checkpoints") if lora else TENSOR_CLASSES:
            s = getattr(self, name)
            tiers = [f"{t} {getattr(s, t):.0%}" for t in TIERS if getattr(s, t) > 0]
            parts.append(f"{'frozen weights' if lora and name == 'weights' else name}: {' '.join(tiers)}")
        if lora:
            parts.append("adapters, their gradients and states: gpu 100%")
        return "; ".join(parts)


def fill_split(nbytes: float, budget_bytes: float) -> tuple[Split, float]:
    """Put as much of `nbytes` on the CPU as `budget_bytes` allows, the rest on SSD. Returns (split, budget
    left)."""
    if nbytes <= 0:
        return Split(), budget_bytes
    cpu = max(0.0, min(1.0, budget_bytes / nbytes))
    cpu = round(cpu, 6)
    return Split(gpu=0.0, cpu=cpu, ssd=round(1.0 - cpu, 6)), budget_bytes - cpu * nbytes


PLACEMENT_EXAMPLE = '\'{"weights": {"gpu": 0, "cpu": 0.5, "ssd": 0.5}}\' or gpu|cpu|ssd'
MAX_PLACEMENT_BYTES = MIB


def parse_placement(text: str | None, flag: str = "--placement", files: bool = True) -> Placement | None:
    """A placement written as text: gpu|cpu|ssd; JSON fractions per tensor class when the text starts with "{"
    (so that a long inline JSON is never tried as a path), the classes it leaves out completed with the
    library's defaults (everything in CPU memory); else, with `files`, the path of such a JSON file. Empty:
    None (the schedule's default). A bad one raises PlacementError, one line led by `flag` (none if empty)."""
    if not text:
        return None
    if text in ("gpu", "cpu", "ssd"):
        return Placement.uniform(text)
    inline = text.lstrip().startswith("{")
    if not inline and not files:
        raise PlacementError(f"{_lead(flag)}not gpu|cpu|ssd nor JSON starting with '{{'; e.g. "
                             f"{PLACEMENT_EXAMPLE}")
    lead = _lead(flag if inline else f"{flag} {text}")
    fractions = _completed(_read_json(text, inline, lead), lead)
    try:
        return Placement.from_dict(fractions)
    except PlacementError as e:
        raise PlacementError(f"{lead}{e}") from None
    except TypeError as e:
        if flag:
            raise PlacementError(f"{flag}: {e}") from None
        raise PlacementError(f"bad tensor-class fractions ({e}); each class takes gpu, cpu and ssd") from None


def _lead(where: str) -> str:
    return f"{where}: " if where else ""


def _read_json(text: str, inline: bool, lead: str) -> object:
    """The parsed JSON of an inline placement, or of the file at path `text` (bounded: hwprofiles.inputs)."""
    try:
        return loads_json_limited(text if inline else read_limited_text(text, MAX_PLACEMENT_BYTES))
    except json.JSONDecodeError as e:
        raise PlacementError(f"{lead}not JSON ({e.msg} at char {e.pos}); e.g. {PLACEMENT_EXAMPLE}") from None
    except (InputLimitError, UnicodeDecodeError) as e:
        raise PlacementError(f"{lead}{e} (give a JSON file of fractions per tensor class)") from None
    except FileNotFoundError:
        raise PlacementError(f"{lead}no such file, and not gpu|cpu|ssd or JSON starting with '{{'; e.g. "
                             f"{PLACEMENT_EXAMPLE}") from None
    except OSError as e:
        raise PlacementError(f"{lead}cannot read: {e.strerror or e} (give a JSON file or inline "
                             "JSON)") from None


def _completed(data: object, lead: str) -> dict:
    """The fractions of `data` (a JSON object of tensor classes) over the default placement's."""
    if not isinstance(data, dict):
        raise PlacementError(f"{lead}expected a JSON object of tensor classes, got {type(data).__name__}; "
                             f"e.g. {PLACEMENT_EXAMPLE}")
    base = Placement().as_dict()
    for k, v in data.items():
        if not isinstance(v, dict) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               for x in v.values()):
            raise PlacementError(f"{lead}{k}: expected an object of gpu/cpu/ssd fractions, got "
                                 f"{json.dumps(v)[:40]}; " + 'e.g. {"gpu": 0, "cpu": 0.5, "ssd": 0.5}')
        base[k] = v
    return base
