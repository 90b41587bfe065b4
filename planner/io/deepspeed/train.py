"""The training settings of a DeepSpeed config (`tierflow run --ds-config`): its `optimizer` (Adam/AdamW:
lr, betas, eps, weight_decay), `scheduler` and `gradient_clipping` sections as tierflow run's options. Pure
JSON reading, no torch.

DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py) map to the Hugging Face schedule of the same
shape: WarmupLR -> constant_with_warmup, WarmupDecayLR -> linear, WarmupCosineLR -> cosine, each with linear
warmup from 0 to the optimizer's lr and (cosine) decay to 0. tierflow runs Hugging Face's formulas
(transformers.get_scheduler); DeepSpeed's differ in the first warmup steps (its counter starts at -1 and it
warms up over at least 2 steps), which `ds_training_settings` says in a note. What does not map (a log
warmup, a minimum lr above 0, OneCycle, LRRangeTest, another optimizer) is refused with one line.
"""

from __future__ import annotations

from pathlib import Path

from tierflow.errors import TierflowError
from tierflow.hwprofiles.inputs import loads_json_limited, read_limited_text
from tierflow.planner.io.deepspeed.config import MAX_DS_CONFIG_BYTES


class DsTrainError(TierflowError, ValueError):
    """A DeepSpeed config's training section that tierflow run cannot honour (one line)."""


# DeepSpeed's optimizer types tierflow runs, lower-cased (its Adam is AdamW unless adam_w_mode is false)
DS_ADAM, DS_ADAMW = "adam", "adamw"
SCHEDULER_NAMES = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def ds_training_settings(path: str | Path) -> tuple[dict[str, object], list[str]]:
    """(settings, notes): the TrainHyper fields a DeepSpeed config sets (lr, beta1, beta2, eps, weight_decay,
    schedule, warmup_steps, clip_grad_norm; absent sections set nothing) and notes worth a warning."""
    p = Path(path)
    try:
        # bounded as the planner's reader of the same file (config.py: 4 MiB, nesting, a pipe, not /dev/zero)
        data = loads_json_limited(read_limited_text(p, MAX_DS_CONFIG_BYTES))
    except (OSError, ValueError) as e:
        why = " ".join(str(e).split())[:80]
        raise DsTrainError(f"--ds-config {p}: cannot read it as JSON ({why})") from None
    if not isinstance(data, dict):
        raise DsTrainError(f"--ds-config {p}: not a JSON object (a DeepSpeed config is one)")
    out: dict[str, object] = {}
    notes: list[str] = []
    _optimizer(data.get("optimizer"), p, out)
    _scheduler(data.get("scheduler"), p, out, notes)
    clip = data.get("gradient_clipping")
    if clip is not None:
        out["clip_grad_norm"] = _number(clip, p, "gradient_clipping", lo=0.0)
    return out, notes


def _number(v: object, p: Path, key: str, lo: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= lo or v == float("inf"):
        raise DsTrainError(f"--ds-config {p}: {key} {v!r} must be a finite number >= {lo:g} (\"auto\" is "
                           "resolved by Hugging Face's Trainer only; write the number)")
    return float(v)


def _optimizer(opt: object, p: Path, out: dict) -> None:
    if opt is None:
        return
    kind = opt.get("type") if isinstance(opt, dict) else None
    if not isinstance(kind, str) or kind.lower() not in (DS_ADAM, DS_ADAMW):
        raise DsTrainError(f"--ds-config {p}: optimizer type {kind!r}: tierflow runs AdamW only (use "
                           "\"type\": \"AdamW\")")
    params = opt.get("params") or {}
    if kind.lower() == DS_ADAM and not params.get("adam_w_mode", True):
        raise DsTrainError(f"--ds-config {p}: optimizer Adam with adam_w_mode false (L2 regularization): "
                           "tierflow runs AdamW's decoupled weight decay only")
    if "lr" in params:
        out["lr"] = _number(params["lr"], p, "optimizer.params.lr", lo=0.0)
    if "betas" in params:
        b = params["betas"]
        if not (isinstance(b, list) and len(b) == 2):
            raise DsTrainError(f"--ds-config {p}: optimizer.params.betas {b!r} must be a list of two numbers")
        out["beta1"], out["beta2"] = (_number(x, p, "optimizer.params.betas", lo=0.0) for x in b)
    for key in ("eps", "weight_decay"):
        if key in params:
            out[key] = _number(params[key], p, f"optimizer.params.{key}", lo=0.0)


def _scheduler(sch: object, p: Path, out: dict, notes: list[str]) -> None:
    if sch is None:
        return
    kind = sch.get("type") if isinstance(sch, dict) else None
    if kind not in SCHEDULER_NAMES:
        raise DsTrainError(f"--ds-config {p}: scheduler type {kind!r} has no Hugging Face equivalent "
                           f"tierflow runs (use one of {', '.join(SCHEDULER_NAMES)}, or --lr-schedule)")
    params = sch.get("params") or {}
    if params.get("warmup_type", "log") != "linear":
        raise DsTrainError(f"--ds-config {p}: scheduler {kind} with a log warmup (DeepSpeed's default): "
                           "tierflow warms up linearly; set \"warmup_type\": \"linear\"")
    # DeepSpeed's defaults: WarmupLR/WarmupDecayLR warmup_min_lr 0; WarmupCosineLR warmup_min_ratio 0,
    # cos_min_ratio 1e-4
    mins = ((("warmup_min_ratio", 0.0), ("cos_min_ratio", 1e-4)) if kind == "WarmupCosineLR"
            else (("warmup_min_lr", 0.0),))
    for key, default in mins:
        if params.get(key, default) != 0:
            raise DsTrainError(f"--ds-config {p}: scheduler {kind} {key} {params.get(key, default)!r}: "
                               f"tierflow's schedules start and end at 0; set \"{key}\": 0")
    if "warmup_max_lr" in params:
        out["lr"] = _number(params["warmup_max_lr"], p, "scheduler.params.warmup_max_lr", lo=0.0)
    steps = params.get("warmup_num_steps", 1000)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise DsTrainError(f"--ds-config {p}: scheduler.params.warmup_num_steps {steps!r} must be an integer "
                           ">= 0")
    out["schedule"], out["warmup_steps"] = SCHEDULER_NAMES[kind], steps
    notes.append(f"--ds-config {p.name}: scheduler {kind} runs as Hugging Face's {SCHEDULER_NAMES[kind]} "
                 "(transformers' formula; DeepSpeed's own counts from step -1 and warms up over >= 2 steps), "
                 "over this run's --steps")
