"""LoRA adapters to and from Hugging Face PEFT's directory (adapter_config.json + adapter_model.safetensors):
`export_peft` writes what `peft.PeftModel.from_pretrained(base, DIR)` loads onto the transformers model of the
family and computes the tierflow forward with; `read_peft` reads such a directory back (`--init-peft`),
checked, memory bounded, into the canonical names.

Canonical names (executor/lora.py's): `blocks.{i}.{target}.lora_A` (rank x in) and `.lora_B` (out x rank),
`i` the decoder layer from 0, `target` a LORA_TARGETS name; the forward adds (alpha / rank) B A dropout(x) to
that target's output rows. PEFT puts one adapter on a module: a fused projection (GPT-2's c_attn, GPT-NeoX's
query_key_value, Phi-3's qkv_proj and gate_up_proj) with k targeted parts gets one adapter of rank k x rank
that is exactly the parts' adapters: A the parts' A stacked, B block-diagonal (part j's B in its output rows
and its column group j, zeros elsewhere), its alpha k x alpha so that the scaling is alpha / rank
(`rank_pattern`, `alpha_pattern`). Reading splits such an adapter back only where B has that structure.

No PEFT import: the files are written and read here (peft is needed only to load them into transformers).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tierflow.executor.models import hf_config
from tierflow.executor.models.hf import hf_layout
from tierflow.executor.options import RunConfig, RunError
from tierflow.hwprofiles.inputs import (
    InputLimitError,
    check_affordable,
    json_parse_bound_bytes,
    loads_json_limited,
    read_limited_text,
    reading,
    size_text,
)
from tierflow.outputs import OutputError, atomic_path, check_output_dir, fsync_dir
from tierflow.planner.core.lora import LORA_TARGETS, MAX_RANK, LoraConfig, LoraConfigError, target_shapes
from tierflow.planner.core.models import ModelSpec

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # PEFT writes about 1.5 KB
MAX_HEADER_BYTES = 16 << 20  # ~150 bytes a tensor: 100,000 tensors (safetensors' own limit is 100 MB)
KEY_PREFIX = "base_model.model."  # PEFT's prefix of every saved tensor
TARGETS_METADATA = "tierflow.lora_targets"  # safetensors metadata: the targets of an export
# safetensors dtypes an adapter may be stored in (read as fp32, exactly)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class PeftError(RunError):
    """An adapter directory that cannot be written or read (one line, exit 2)."""


@dataclass(frozen=True)
class Projection:
    """One adapted module of a decoder layer: its path inside the layer (transformers' names) and the targets
    whose outputs are its output rows, in order (one for a plain projection); `heads` for GPT-NeoX's fused
    q, k, v interleaved per head."""

    module: str
    parts: tuple[str, ...]
    heads: bool = False


def _plain(module: str, target: str) -> Projection:
    return Projection(module, (target,))


_QKV = ("q_proj", "k_proj", "v_proj")
_LLAMA = tuple(_plain(f"self_attn.{t}", t) for t in LORA_TARGETS[:4]) + \
    tuple(_plain(f"mlp.{t}", t) for t in LORA_TARGETS[4:])
_FAMILIES: dict[str, tuple[Projection, ...]] = {
    "gpt": (Projection("attn.c_attn", _QKV), _plain("attn.c_proj", "o_proj"), _plain("mlp.c_fc", "up_proj"),
            _plain("mlp.c_proj", "down_proj")),
    "gpt_neox": (Projection("attention.query_key_value", _QKV, heads=True),
                 _plain("attention.dense", "o_proj"), _plain("mlp.dense_h_to_4h", "up_proj"),
                 _plain("mlp.dense_4h_to_h", "down_proj")),
    "phi3": (Projection("self_attn.qkv_proj", _QKV), _plain("self_attn.o_proj", "o_proj"),
             Projection("mlp.gate_up_proj", ("gate_proj", "up_proj")), _plain("mlp.down_proj", "down_proj")),
    "opt": (*(_plain(f"self_attn.{t}", t) for t in _QKV), _plain("self_attn.out_proj", "o_proj"),
            _plain("fc1", "up_proj"), _plain("fc2", "down_proj")),
    **{f: _LLAMA for f in ("llama", "mistral", "qwen2", "qwen3", "gemma")},
}


def canonical_name(layer: int, target: str, which: str) -> str:
    """`blocks.{layer}.{target}.lora_A` / `.lora_B` (which: "A" or "B")."""
    return f"blocks.{layer}.{target}.lora_{which}"


def target_dims(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of every projection a layer of `spec` has (no gate_proj without a gated MLP)."""
    every = LoraConfig(rank=1, targets=LORA_TARGETS)
    return {t: (i, o) for t, i, o in target_shapes(spec, every)}


def projections(spec: ModelSpec) -> tuple[Projection, ...]:
    """The adaptable modules of `spec`'s family, only the parts the layer has; PeftError when the family has
    no PEFT layout (no transformers class, or one that cannot express the spec)."""
    fam = _FAMILIES.get(spec.family)
    if fam is None:
        raise PeftError(f"{spec.name}: family {spec.family!r} has no PEFT layout (families with one: "
                        f"{', '.join(_FAMILIES)})")
    try:
        hf_config(spec.with_lora(None))  # the transformers model the adapters load onto is the base's
    except (ValueError, NotImplementedError) as e:
        raise PeftError(f"PEFT adapters: {e}") from None
    dims = target_dims(spec)
    kept = (Projection(q.module, tuple(t for t in q.parts if t in dims), q.heads) for q in fam)
    return tuple(p for p in kept if p.parts)


def part_rows(spec: ModelSpec, proj: Projection, target: str) -> torch.Tensor:
    """The rows of `proj`'s output that are `target`'s outputs, in the order of the part's own output."""
    dims = target_dims(spec)
    j = proj.parts.index(target)
    if proj.heads:  # NeoX: row h * 3 * head_dim + part * head_dim + d is the part's output h * head_dim + d
        hd, n = spec.head_dim, len(proj.parts)
        heads = dims[target][1] // hd
        base = torch.arange(heads).repeat_interleave(hd) * (n * hd) + torch.arange(hd).repeat(heads)
        return base + j * hd
    start = sum(dims[t][1] for t in proj.parts[:j])
    return torch.arange(start, start + dims[target][1])


def module_path(spec: ModelSpec, layer: int, proj: Projection) -> str:
    """The module's path in the transformers model (`model.layers.3.self_attn.q_proj`)."""
    layout = hf_layout(spec)
    return f"{layout.prefix}{layout.layers}.{layer}.{proj.module}"


def _targeted(spec: ModelSpec, lora: LoraConfig) -> list[tuple[Projection, tuple[str, ...]]]:
    """(module, its targeted parts) for every module with at least one targeted part."""
    out = []
    for p in projections(spec):
        parts = tuple(t for t in p.parts if t in lora.targets)
        if parts:
            out.append((p, parts))
    return out


def expected_shapes(spec: ModelSpec, lora: LoraConfig) -> dict[str, tuple[int, ...]]:
    """The canonical adapters of `spec` with `lora`: name -> shape."""
    dims, r, targeted = target_dims(spec), lora.rank, _targeted(spec, lora)
    return {canonical_name(i, t, w): ((r, dims[t][0]) if w == "A" else (dims[t][1], r))
            for i in range(spec.num_layers) for _, parts in targeted for t in parts for w in "AB"}


# ------------------------------------------------------------------------------------------------------------
# export
# ------------------------------------------------------------------------------------------------------------


def check_export_peft(directory: str | os.PathLike[str], spec: ModelSpec, lora: LoraConfig | None,
                      overwrite: bool = False, flag: str = "--export-peft") -> Path:
    """Before any work: `spec` with `lora` can be written for PEFT and `directory` can take it (new or empty
    unless `overwrite`). Creates nothing; PeftError / OutputError (one line)."""
    if lora is None:
        raise PeftError(f"{flag}: the run trains no LoRA adapters (plan with --lora RANK)")
    if not _targeted(spec, lora):
        raise PeftError(f"{flag}: {spec.name} has none of the targets {', '.join(lora.targets)}")
    return check_output_dir(directory, flag, overwrite=overwrite)


def _check_adapters(adapters: dict[str, torch.Tensor], spec: ModelSpec, lora: LoraConfig) -> None:
    want = expected_shapes(spec, lora)
    missing = [k for k in want if k not in adapters]
    if missing:
        raise PeftError(f"adapters: {missing[0]} is missing ({len(missing)} of {len(want)} missing)")
    extra = sorted(k for k in adapters if k not in want)
    if extra:
        raise PeftError(f"adapters: {extra[0]} is not an adapter of {spec.name} with {lora.describe()}")
    for k, shape in want.items():
        t = adapters[k]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise PeftError(f"adapters: {k} is not a floating-point tensor")
        if tuple(t.shape) != shape:
            raise PeftError(f"adapters: {k} has shape {tuple(t.shape)}, expected {shape}")
        if not bool(torch.isfinite(t).all()):
            raise PeftError(f"adapters: {k} holds NaN or infinite values (the run diverged); not exported")


def peft_tensors(adapters: dict[str, torch.Tensor], spec: ModelSpec,
                 lora: LoraConfig) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """PEFT's tensors of the canonical `adapters` (fp32), and the rank of each fused module (its name in the
    layer -> parts x rank) where more than one part is targeted."""
    r, out, ranks = lora.rank, {}, {}
    dims, targeted = target_dims(spec), _targeted(spec, lora)
    for i in range(spec.num_layers):
        for proj, parts in targeted:
            key = KEY_PREFIX + module_path(spec, i, proj)
            a_parts = [adapters[canonical_name(i, t, "A")].detach().float().cpu() for t in parts]
            if len(proj.parts) == 1:
                b = adapters[canonical_name(i, parts[0], "B")].detach().float().cpu()
            else:
                b = torch.zeros(sum(dims[t][1] for t in proj.parts), r * len(parts))
                for g, t in enumerate(parts):
                    b[part_rows(spec, proj, t), g * r:(g + 1) * r] = \
                        adapters[canonical_name(i, t, "B")].detach().float().cpu()
                if len(parts) > 1:
                    ranks[proj.module] = r * len(parts)
            out[f"{key}.lora_A.weight"] = torch.cat(a_parts).contiguous()
            out[f"{key}.lora_B.weight"] = b.contiguous()
    return out, ranks


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def peft_config(spec: ModelSpec, lora: LoraConfig, ranks: dict[str, int], base_model: str | None) -> dict:
    """adapter_config.json of the export (PEFT's LoraConfig fields; those left out take its defaults)."""
    modules = sorted({p.module for p, _ in _targeted(spec, lora)})
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "revision": None, "inference_mode": True,
        "r": lora.rank, "lora_alpha": _number(lora.alpha), "lora_dropout": lora.dropout,
        "target_modules": modules,
        "rank_pattern": dict(ranks),
        "alpha_pattern": {m: _number(lora.alpha * k / lora.rank) for m, k in ranks.items()},
        "fan_in_fan_out": bool(hf_layout(spec).conv1d),  # GPT-2's Conv1D stores its weight (in, out)
        "bias": "none", "use_rslora": False, "use_dora": False, "lora_bias": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
        "exclude_modules": None,
    }


def export_peft(adapters: dict[str, torch.Tensor], spec: ModelSpec, directory: str | os.PathLike[str], *,
                lora: LoraConfig | None = None, base_model: str | None = None,
                overwrite: bool = False) -> Path:
    """Write the canonical `adapters` of `spec` (its `lora` unless given) as a PEFT adapter directory:
    adapter_config.json (`base_model` as base_model_name_or_path) and adapter_model.safetensors (fp32).
    `directory` must be new or empty unless `overwrite` (then the two files are replaced, each atomically);
    a new one appears whole (written in a temporary directory beside it and renamed). PeftError / OutputError
    (one line) before anything is written."""
    lora = lora if lora is not None else spec.lora
    out = check_export_peft(directory, spec, lora, overwrite=overwrite)
    _check_adapters(adapters, spec, lora)
    tensors, ranks = peft_tensors(adapters, spec, lora)
    config = json.dumps(peft_config(spec, lora, ranks, base_model), indent=2) + "\n"
    metadata = {"format": "pt", TARGETS_METADATA: ",".join(lora.targets)}
    try:
        if out.exists():  # empty, or the caller lets it be overwritten: each file replaced, the config last
            _write_files(out, tensors, metadata, config)
            return out
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out.absolute().parent / f".{out.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:  # a new directory appears whole
            tmp_dir.mkdir()
            _write_files(tmp_dir, tensors, metadata, config)
            os.rename(tmp_dir, out)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    except OSError as e:
        raise OutputError(f"--export-peft {out}: cannot write it ({e.strerror or e}); give a writable "
                          "directory that is new or empty") from None
    fsync_dir(out.absolute().parent)
    return out


def _write_files(directory: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                 config: str) -> None:
    from safetensors.torch import save_file

    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, 0o666 & ~_umask())  # as any file this process creates (safetensors': owner-only)
    with atomic_path(directory / CONFIG_NAME) as tmp:
        tmp.write_text(config)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------------------------------
# import
# ------------------------------------------------------------------------------------------------------------

# adapter_config.json keys that say nothing tierflow trains differently (metadata, PEFT's own switches)
_NEUTRAL_KEYS = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode",
                 "auto_mapping", "peft_version", "fan_in_fan_out", "megatron_core", "qalora_group_size", "r",
                 "lora_alpha", "lora_dropout", "target_modules", "rank_pattern", "alpha_pattern",
                 "init_lora_weights", "ensure_weight_tying", "bias"}
# init_lora_weights values that only initialise the adapters (others change the base weights: PiSSA, OLoRA,
# LoftQ, CorDA, LoRA-GA)
_INITS_OF_ADAPTERS_ONLY = (True, False, "gaussian", "eva", "orthogonal")


@dataclass(frozen=True)
class PeftAdapter:
    """A checked adapter directory, before its tensors are read: its LoRA config, the base it names, and per
    adapted module (path in the layer) its rank and targeted parts, and its tensors' header entries."""

    directory: Path
    lora: LoraConfig
    base_model: str | None
    ranks: dict[str, int]  # module -> its adapter's rank (parts x lora.rank for a fused one)
    parts: dict[str, tuple[str, ...] | None]  # module -> its targeted parts (None: to be read from B)
    header: dict[str, dict]  # tensor name -> its safetensors entry
    data_start: int  # byte offset of the data in the safetensors file


def _fail(directory: Path, what: str) -> PeftError:
    return PeftError(f"--init-peft {directory}: {what}")


def _read_config(d: Path) -> dict:
    path = d / CONFIG_NAME
    try:
        with reading(f"--init-peft {path}", size_text(MAX_CONFIG_BYTES)):
            data = loads_json_limited(read_limited_text(path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise _fail(d, f"no {CONFIG_NAME} (give a directory PEFT's save_pretrained or --export-peft wrote)"
                    ) from None
    except InputLimitError as e:
        raise _fail(d, f"{CONFIG_NAME} {e}") from None
    except (OSError, ValueError) as e:
        raise _fail(d, f"{CONFIG_NAME} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise _fail(d, f"{CONFIG_NAME} is not a JSON object")
    return data


def _check_config_keys(d: Path, cfg: dict) -> None:
    """Refuse, naming the key, what tierflow cannot train: another PEFT method, DoRA, rsLoRA, biases, other
    modules trained, layer-wise targets, initialisations that change the base weights."""
    if cfg.get("peft_type") != "LORA":
        raise _fail(d, f"peft_type is {str(cfg.get('peft_type'))[:40]!r}: tierflow trains LoRA only")
    if cfg.get("task_type") not in (None, "CAUSAL_LM"):
        raise _fail(d, f"task_type is {str(cfg['task_type'])[:40]!r}: tierflow trains causal language models "
                       "(CAUSAL_LM)")
    if cfg.get("bias", "none") != "none":
        raise _fail(d, f"bias is {str(cfg['bias'])[:40]!r}: tierflow trains no biases (bias 'none')")
    if cfg.get("init_lora_weights", True) not in _INITS_OF_ADAPTERS_ONLY:
        raise _fail(d, f"init_lora_weights is {str(cfg['init_lora_weights'])[:40]!r}: that initialisation "
                       "changes the base weights, which tierflow's base does not have (convert the adapter "
                       "with PEFT first)")
    for key in sorted(cfg):
        v = cfg[key]
        if key in _NEUTRAL_KEYS or v is None or v is False or v == {} or v == [] or v == "":
            continue
        raise _fail(d, f"{key} is {json.dumps(v)[:60]}: a PEFT feature tierflow cannot train "
                       "(tierflow trains plain LoRA: no DoRA, rsLoRA, LoRA biases, modules_to_save or "
                       "layer-wise targets)")


def _number_key(d: Path, cfg: dict, key: str, default) -> float:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _fail(d, f"{key} is {json.dumps(v)[:40]}: expected a number")
    return v


def _pattern(d: Path, cfg: dict, key: str) -> dict[str, float]:
    v = cfg.get(key) or {}
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, (int, float))
                                          and not isinstance(x, bool) for k, x in v.items()):
        raise _fail(d, f"{key} is not an object of module name -> number")
    return v


def _pattern_value(pattern: dict[str, float], path: str, default: float) -> float:
    """PEFT's rule (peft.utils.other.get_pattern_key): the first key that matches the end of the module's
    path, after a dot."""
    for key in pattern:
        try:
            if re.match(rf"(.*\.)?({key})$", path):
                return pattern[key]
        except re.error:
            continue
    return default


def _is_targeted(targets, path: str) -> bool:
    """PEFT's rule (check_target_module_exists): a string is a regex the whole path must match; a list names
    the module or the end of its path after a dot."""
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == t or path.endswith("." + t) for t in targets)


def _targeted_modules(d: Path, cfg: dict, spec: ModelSpec) -> list[Projection]:
    """The modules target_modules names, the same in every layer; each listed name must name one."""
    targets = cfg.get("target_modules")
    ok = isinstance(targets, str) or (isinstance(targets, list) and targets
                                      and all(isinstance(t, str) for t in targets))
    if not ok:
        raise _fail(d, "target_modules is not a module name list or a regular expression")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise _fail(d, f"target_modules is not a valid regular expression ({e})") from None
    projs = projections(spec)
    chosen = [p for p in projs if _is_targeted(targets, module_path(spec, 0, p))]
    for i in range(1, spec.num_layers):
        here = [p for p in projs if _is_targeted(targets, module_path(spec, i, p))]
        if here != chosen:
            raise _fail(d, f"target_modules picks other modules in layer {i} than in layer 0; tierflow's "
                           "targets are the same in every layer")
    if isinstance(targets, list):
        paths = [module_path(spec, i, p) for i in range(spec.num_layers) for p in projs]
        for t in targets:
            if not any(_is_targeted([t], path) for path in paths):
                raise _fail(d, f"target module {t[:60]!r} is not a projection tierflow adapts in a "
                               f"{spec.family} layer ({', '.join(p.module for p in projs)})")
    if not chosen:
        raise _fail(d, f"target_modules names none of the projections of a {spec.family} layer")
    return chosen


def _read_header(d: Path) -> tuple[dict, int, int]:
    """(safetensors header, data offset, data bytes), bounded: the 8-byte length is checked against the
    limit and the file's size before the header is read."""
    path = d / WEIGHTS_NAME
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(d, f"{WEIGHTS_NAME} is truncated ({size} bytes; not safetensors)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise _fail(d, f"{WEIGHTS_NAME} declares a {size_text(n)} header, over the limit of "
                               f"{size_text(MAX_HEADER_BYTES)} (not an adapter file)")
            if 8 + n > size:
                raise _fail(d, f"{WEIGHTS_NAME} is truncated: its header needs {n} bytes, the file has "
                               f"{size - 8}")
            raw = f.read(n)
    except FileNotFoundError:
        raise _fail(d, f"no {WEIGHTS_NAME} (PEFT's .bin adapters are not read: save with safetensors, "
                       "PEFT's default)") from None
    except OSError as e:
        raise _fail(d, f"{WEIGHTS_NAME} cannot be read ({e.strerror or e})") from None
    try:
        check_affordable(json_parse_bound_bytes(n, raw.count(b"{"), raw.count(b"[")),
                         f"parsing its {size_text(n)} safetensors header")
        header = loads_json_limited(raw)
    except InputLimitError as e:
        raise _fail(d, f"{WEIGHTS_NAME}: {e}") from None
    except ValueError as e:
        raise _fail(d, f"{WEIGHTS_NAME}'s header is not JSON ({str(e)[:80]}; not safetensors)") from None
    if not isinstance(header, dict):
        raise _fail(d, f"{WEIGHTS_NAME}'s header is not a JSON object (not safetensors)")
    return header, 8 + n, size - 8 - n


def _check_entry(d: Path, name: str, entry: object, shape: tuple[int, int] | None, data_bytes: int) -> None:
    """One tensor's header entry: a float dtype, the expected shape (None: any 2-d), offsets inside the
    data that hold exactly its bytes."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _fail(d, f"{WEIGHTS_NAME}: {name} has no dtype, shape and data_offsets")
    dtype, got, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise _fail(d, f"{WEIGHTS_NAME}: {name} is {str(dtype)[:20]}, expected a float tensor "
                       f"({', '.join(_DTYPES)})")
    ints = isinstance(got, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 1 << 32
                                         for x in got)
    if not ints or len(got) != 2 or (shape is not None and tuple(got) != shape):
        raise _fail(d, f"{WEIGHTS_NAME}: {name} has shape {str(got)[:40]}, expected "
                       f"{list(shape) if shape else 'a matrix'}")
    ok = (isinstance(offsets, list) and len(offsets) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) for x in offsets))
    if not ok or not 0 <= offsets[0] <= offsets[1] <= data_bytes or \
            offsets[1] - offsets[0] != got[0] * got[1] * _DTYPES[dtype].itemsize:
        raise _fail(d, f"{WEIGHTS_NAME}: {name}'s data_offsets {str(offsets)[:40]} do not hold its "
                       f"{got[0]} x {got[1]} {dtype} values within the file's {data_bytes} data bytes "
                       "(truncated or corrupt)")


def _same_base(named: str, ours: str) -> bool:
    if named == ours:
        return True
    a, b = Path(named), Path(ours)
    try:
        if a.exists() and b.exists() and a.resolve() == b.resolve():
            return True
    except OSError:
        pass
    return a.name.lower() == b.name.lower() and bool(a.name)


def inspect_peft(directory: str | os.PathLike[str], spec: ModelSpec,
                 base_model: str | list[str] | None = None) -> PeftAdapter:
    """Check a PEFT adapter directory against `spec` without reading its tensors' data: the config (one line
    naming the key tierflow cannot train), the base it names against `base_model` (the run's: a name, or
    several it goes by, e.g. base_models), the tensors' names, dtypes, shapes and offsets. Where a fused
    module holds fewer parts than it has and the file does not say which (PEFT's saves), `parts` is None
    for it and `lora.targets` counts all its parts: read_peft finds them in B. PeftError (one line)."""
    d = Path(directory)
    if not d.is_dir():
        raise _fail(d, "is not a directory (give one with adapter_config.json and adapter_model.safetensors)")
    cfg = _read_config(d)
    _check_config_keys(d, cfg)
    named = cfg.get("base_model_name_or_path")
    ours = [base_model] if isinstance(base_model, str) else list(base_model or [])
    if ours and isinstance(named, str) and named and not any(_same_base(named, str(o)) for o in ours):
        raise _fail(d, f"the adapter was trained on {named[:80]!r}, this run's base is "
                       f"{' or '.join(repr(str(o)[:80]) for o in ours)} (give the base the adapter names; "
                       "if it is the same model under another name, set base_model_name_or_path in "
                       f"{CONFIG_NAME})")
    r = _number_key(d, cfg, "r", 8)
    alpha = _number_key(d, cfg, "lora_alpha", 8)
    dropout = _number_key(d, cfg, "lora_dropout", 0.0)
    if not isinstance(r, int) or not 0 < r <= MAX_RANK or alpha <= 0:
        raise _fail(d, f"r {r} and lora_alpha {alpha}: expected an integer rank in 1..{MAX_RANK} and a "
                       "positive alpha")
    ranks_p, alphas_p = _pattern(d, cfg, "rank_pattern"), _pattern(d, cfg, "alpha_pattern")
    modules = _targeted_modules(d, cfg, spec)
    header, data_start, data_bytes = _read_header(d)
    ranks, parts, dims = {}, {}, target_dims(spec)
    for p in modules:
        r_m, a_m = (_pattern_value(ranks_p, module_path(spec, 0, p), r),
                    _pattern_value(alphas_p, module_path(spec, 0, p), alpha))
        for i in range(1, spec.num_layers):
            path = module_path(spec, i, p)
            if (_pattern_value(ranks_p, path, r), _pattern_value(alphas_p, path, alpha)) != (r_m, a_m):
                raise _fail(d, f"rank_pattern / alpha_pattern give {path} another rank or alpha than layer "
                               "0's (tierflow's adapters are the same in every layer)")
        k = r_m / r
        if not (isinstance(r_m, int) and 1 <= k <= len(p.parts) and k == int(k)):
            what = "a multiple of r up to its parts x r" if len(p.parts) > 1 else "r (tierflow has one rank)"
            raise _fail(d, f"{p.module} has rank {r_m}, not {what}")
        if not math.isclose(a_m / r_m, alpha / r, rel_tol=1e-12):
            raise _fail(d, f"{p.module}'s scaling {a_m:g} / {r_m} differs from lora_alpha / r = "
                           f"{alpha:g} / {r} (tierflow has one scaling)")
        ranks[p.module] = r_m
        parts[p.module] = p.parts if k == len(p.parts) else None
        n_in, n_out = dims[p.parts[0]][0], sum(dims[t][1] for t in p.parts)
        for i in range(spec.num_layers):
            key = KEY_PREFIX + module_path(spec, i, p)
            for w, shape in (("A", (r_m, n_in)), ("B", (n_out, r_m))):
                name = f"{key}.lora_{w}.weight"
                if name not in header:
                    raise _fail(d, f"{WEIGHTS_NAME} has no {name} (target_modules names {p.module})")
                _check_entry(d, name, header[name], shape, data_bytes)
    wanted = {f"{KEY_PREFIX}{module_path(spec, i, p)}.lora_{w}.weight"
              for i in range(spec.num_layers) for p in modules for w in "AB"}
    for name in header:
        if name != "__metadata__" and name not in wanted:
            raise _fail(d, f"{WEIGHTS_NAME} holds {name[:100]!r}, which is no adapter tierflow trains on "
                           f"{spec.name}")
    meta = header.get("__metadata__")
    marked = meta.get(TARGETS_METADATA) if isinstance(meta, dict) else None
    if isinstance(marked, str):  # tierflow's export says which parts of each fused module it targeted
        for p in modules:
            named_parts = tuple(t for t in p.parts if t in marked.split(","))
            if len(named_parts) * r == ranks[p.module]:
                parts[p.module] = named_parts
    targets = [t for p in modules for t in (parts[p.module] or p.parts)]
    try:
        lora = LoraConfig(rank=r, alpha=alpha, targets=tuple(targets), dropout=dropout)
    except LoraConfigError as e:
        raise _fail(d, str(e)) from None
    return PeftAdapter(d, lora, named if isinstance(named, str) else None, ranks, parts,
                       {k: v for k, v in header.items() if k in wanted}, data_start)


def _load(adapter: PeftAdapter, name: str, f) -> torch.Tensor:
    e = adapter.header[name]
    begin, end = e["data_offsets"]
    f.seek(adapter.data_start + begin)
    buf = bytearray(end - begin)
    if f.readinto(buf) != len(buf):
        raise _fail(adapter.directory, f"{WEIGHTS_NAME} is truncated inside {name}")
    t = torch.frombuffer(buf, dtype=_DTYPES[e["dtype"]]) if buf else torch.empty(0, dtype=_DTYPES[e["dtype"]])
    return t.reshape(e["shape"]).float()


def _split(adapter: PeftAdapter, spec: ModelSpec, proj: Projection, a: torch.Tensor, b: torch.Tensor,
           path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A fused module's adapter as its parts' (A, B): column group g of B must be nonzero only in the rows of
    its part (inferred from the nonzero rows where the config does not say which parts were targeted)."""
    r = adapter.lora.rank
    rows = {t: part_rows(spec, proj, t) for t in proj.parts}
    groups = b.shape[1] // r
    parts = adapter.parts[proj.module]
    if parts is None:  # fewer parts than the module has: which ones, from B's nonzero rows
        found = []
        for g in range(groups):
            block = b[:, g * r:(g + 1) * r]
            owners = [t for t in proj.parts if bool(block[rows[t]].any())]
            if len(owners) != 1:
                why = "is all zeros" if not owners else f"has rows in {', '.join(owners)}"
                raise _fail(adapter.directory, f"{path}: cannot split its rank-{b.shape[1]} adapter into "
                                               f"{groups} parts: column group {g} {why}")
            found.append(owners[0])
        if found != sorted(found, key=proj.parts.index) or len(set(found)) != len(found):
            raise _fail(adapter.directory, f"{path}: its B's column groups are not in the parts' order")
        parts = tuple(found)
    out = {}
    for g, t in enumerate(parts):
        cols = slice(g * r, (g + 1) * r)
        outside = torch.ones(b.shape[0], dtype=torch.bool)
        outside[rows[t]] = False
        if bool(b[outside, cols].any()):
            raise _fail(adapter.directory, f"{path}: its B is not block-diagonal (the columns of {t}'s "
                                           f"rank-{r} group reach other parts' rows), so it is not one "
                                           "adapter per part as tierflow trains them; it cannot be split")
        out[t] = (a[cols].clone(), b[rows[t], cols].clone())
    return out


def read_peft(directory: str | os.PathLike[str], spec: ModelSpec,
              base_model: str | list[str] | None = None) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """A PEFT adapter directory as (its LoraConfig, the adapters in the canonical names, fp32), checked by
    `inspect_peft` before any tensor is read; a fused module's adapter is split into its parts where B is
    block-diagonal. Memory: the adapters' bytes, about three times (PeftError, one line, when that cannot be
    allocated)."""
    adapter = inspect_peft(directory, spec, base_model)
    d = adapter.directory
    data_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in adapter.header.values())
    try:
        check_affordable(3 * data_bytes, f"reading its {size_text(data_bytes)} of adapters")
    except InputLimitError as e:
        raise _fail(d, str(e)) from None
    out: dict[str, torch.Tensor] = {}
    projs = projections(spec)
    with reading(f"--init-peft {d / WEIGHTS_NAME}", f"its adapters, {size_text(3 * data_bytes)}"), \
            open(d / WEIGHTS_NAME, "rb") as f:
        for i in range(spec.num_layers):
            for proj in projs:
                if proj.module not in adapter.ranks:
                    continue
                path = module_path(spec, i, proj)
                a = _load(adapter, f"{KEY_PREFIX}{path}.lora_A.weight", f)
                b = _load(adapter, f"{KEY_PREFIX}{path}.lora_B.weight", f)
                if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                    raise _fail(d, f"{path}: the adapter holds NaN or infinite values")
                pieces = _split(adapter, spec, proj, a, b, path) if len(proj.parts) > 1 else \
                    {proj.parts[0]: (a, b)}
                for t, (pa, pb) in pieces.items():
                    out[canonical_name(i, t, "A")], out[canonical_name(i, t, "B")] = pa, pb
    lora = adapter.lora
    targets = tuple(sorted({n.split(".")[2] for n in out}, key=LORA_TARGETS.index))
    if targets != lora.targets:
        lora = LoraConfig(rank=lora.rank, alpha=lora.alpha, targets=targets, dropout=lora.dropout)
    if len(targets) == len(target_dims(spec)):  # every projection the layer has: PEFT's and tierflow's "all"
        lora = LoraConfig(rank=lora.rank, alpha=lora.alpha, targets=LORA_TARGETS, dropout=lora.dropout)
    return lora, out


# ------------------------------------------------------------------------------------------------------------
# tierflow run --export-peft / --init-peft
# ------------------------------------------------------------------------------------------------------------


def base_models(init: str | None, spec: ModelSpec) -> list[str]:
    """What a run's base model is called: its --init directory (absolute) and the model's name (a hub id
    where the plan was made from one)."""
    return ([str(Path(init).absolute())] if init else []) + [spec.name]


def check_peft_dir(directory: str | os.PathLike[str], flag: str = "--init-peft") -> Path:
    """Before the plan is loaded: `directory` is a directory with adapter_config.json and
    adapter_model.safetensors (PeftError, one line)."""
    d = Path(directory)
    if not d.is_dir():
        raise PeftError(f"{flag} {d}: {'does not exist' if not d.exists() else 'is not a directory'} (give a "
                        f"directory with {CONFIG_NAME} and {WEIGHTS_NAME}: PEFT's save_pretrained or "
                        "tierflow run --export-peft)")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (d / name).is_file():
            raise PeftError(f"{flag} {d}: has no {name} (give a directory PEFT's save_pretrained or tierflow "
                            "run --export-peft wrote; PEFT's .bin adapters are not read)")
    return d


def check_peft_options(export_dir: str | None, init_dir: str | None, init: str | None,
                       spec: ModelSpec) -> None:
    """With the plan's model (`spec`, its `lora`), before any step: --export-peft can be written (the plan
    trains LoRA, the family has a PEFT layout, the directory is new or empty), and --init-peft holds adapters
    of this model (inspect_peft: config, base, tensor shapes) with the plan's rank, alpha, targets and
    dropout. PeftError / OutputError, one line."""
    if export_dir:
        check_export_peft(export_dir, spec, spec.lora)
    if not init_dir:
        return
    lora = spec.lora
    if lora is None:
        raise PeftError(f"--init-peft {init_dir}: the plan trains no LoRA adapters (plan with --lora RANK "
                        "and the adapter's rank, alpha and targets)")
    adapter = inspect_peft(init_dir, spec, base_models(init, spec))
    known = all(p is not None for p in adapter.parts.values())  # else: which parts, once B is read
    check_plans_lora(init_dir, adapter.lora, spec, targets=known)


def check_plans_lora(init_dir: str, got: LoraConfig, spec: ModelSpec, targets: bool = True) -> None:
    """The adapter's rank, alpha, (with `targets`) targets and lora_dropout are the plan's (`spec.lora`): the
    plan decides what the run trains, so a mismatch is refused, never resolved silently; PeftError naming the
    `tierflow plan` flags of the adapter's settings."""
    lora, dims = spec.lora, target_dims(spec)
    plan_targets = {t for t in lora.targets if t in dims}
    got_targets = {t for t in got.targets if t in dims}
    names = ",".join(t for t in LORA_TARGETS if t in got_targets)
    flags = f"--lora {got.rank} --lora-alpha {got.alpha:g} --lora-targets {names}"
    if got.rank != lora.rank or got.alpha != lora.alpha or (targets and got_targets != plan_targets):
        if got.dropout != lora.dropout:
            flags += f" --lora-dropout {got.dropout:g}"
        raise PeftError(f"--init-peft {init_dir}: the adapter is {got.describe()} "
                        f"({', '.join(t for t in LORA_TARGETS if t in got_targets)}), the plan "
                        f"{lora.describe()}; plan again with {flags}")
    if got.dropout != lora.dropout:
        raise PeftError(f"--init-peft {init_dir}: the adapter's {CONFIG_NAME} has lora_dropout "
                        f"{got.dropout:g}, the plan's adapters drop {lora.dropout:g} (the plan decides); "
                        f"plan again with {flags} --lora-dropout {got.dropout:g}, or set lora_dropout to "
                        f"{lora.dropout:g} in {CONFIG_NAME} to go on with the plan's")


def init_adapters(config: RunConfig, spec: ModelSpec) -> dict[str, torch.Tensor] | None:
    """The run's starting adapters from --init-peft (canonical names, fp32), None without it: the training
    side's one call before the first step (checked again: the directory may have changed since the start)."""
    md = config.model_data
    if not md.init_peft:
        return None
    check_peft_options(None, md.init_peft, md.init, spec)
    got, adapters = read_peft(md.init_peft, spec, base_models(md.init, spec))
    check_plans_lora(md.init_peft, got, spec)  # the targets, where only B said which parts
    return adapters


def export_adapters(adapters: dict[str, torch.Tensor], config: RunConfig, spec: ModelSpec) -> Path | None:
    """--export-peft after the last step (the training side's one call; one rank writes): the adapters of
    `spec.lora`, base_model_name_or_path the run's --init directory or the model's name. None without it."""
    out = config.output.export_peft
    if not out:
        return None
    base = base_models(config.model_data.init, spec)[0]
    return export_peft(adapters, spec, out, lora=spec.lora, base_model=base)
