"""`tierflow calibrate`: measure the machine it runs on and write a hardware profile the planner accepts.

    tierflow calibrate --ssd-dir /mnt/nvme/tmp --base h100-80g -o box.yaml
    tierflow simulate --hw box.yaml

The measurements and the profile are tierflow.executor.calibration's; here are the flags, their checks and the
output. Everything it cannot measure comes from ``--base PROFILE`` (default: the bundled ``rtx4090-lohan`` for
gpu/pcie and prices, and no SSD tier without ``--ssd-dir``); ``--set KEY=VALUE`` fixes a field after
measuring. The executor (and torch) is imported when the command runs, not when the parser is built.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierflow.cli.args import add_set_arg
from tierflow.cli.argtypes import positive_int
from tierflow.errors import UsageError
from tierflow.hwprofiles import load_profile, parse_overrides
from tierflow.outputs import check_output_file

if TYPE_CHECKING:
    from tierflow.executor.calibration import Sizes

EXTRA = "run"  # torch and safetensors: tierflow.cli.main checks them before the command runs
SET_SYNTAX = "--set {item}: expected SECTION.KEY=VALUE, e.g. --set gpu.memory_gib=2"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate", help="measure this machine (GPU, PCIe, CPU, SSD) and write a hardware profile",
        description="Measure this machine and write a hardware profile for `tierflow simulate --hw FILE`. "
        "Measures the GPU (when CUDA is available), PCIe copies, DRAM bandwidth, CPU Adam and, with "
        "--ssd-dir, the SSD. What it cannot measure comes from --base (default: the bundled rtx4090-lohan "
        "for gpu/pcie and prices, and no SSD tier).")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="profile YAML to write, e.g. box.yaml")
    p.add_argument("--ssd-dir", default=None, metavar="DIR",
                   help="a directory on the SSD (array) to measure; needs 2x the test file free (4.1 GB, or "
                   "0.6 GB with --quick)")
    p.add_argument("--base", default=None, metavar="PROFILE",
                   help="profile name or YAML for what cannot be measured and for datasheet peaks "
                   "(gpu.peak_tflops, gpu.hbm_gbps) and prices")
    p.add_argument("--quick", action="store_true", help="smaller, shorter measurements (under ~20 s)")
    p.add_argument("--ssd-file-mib", type=positive_int(1 << 20), default=None, metavar="N",
                   help="size of the SSD test file in MiB (default 2048, 256 with --quick)")
    p.add_argument("--name", default=None, help="profile name (default calibrated-<hostname>)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="the device tierflow run will train on: cuda measures the GPU and PCIe; cpu measures "
                   "this CPU as the device (fp32 GEMMs over sizes, elementwise bandwidth, copies within host "
                   "memory, its cores shared with CPU Adam); auto: cuda when available, else cpu")
    add_set_arg(p, "set a profile field after measuring, e.g. --set gpu.memory_gib=2 (the device memory cap "
                "of a CPU device; default 2) or --set cpu.memory_gib=8 (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print the fields, sources and raw measurements as JSON")
    return p


def parse_sets(items: list[str] | None) -> dict[str, Any]:
    """--set KEY=VALUE items: numbers as numbers, null as None, the rest as text (validated with the
    profile)."""
    return parse_overrides(items, SET_SYNTAX, need_dot=True, typed=True)


def run(args: argparse.Namespace) -> int:
    from tierflow.executor.calibration import FULL, QUICK, Sizes, build_profile, format_table, write_profile
    from tierflow.executor.calibration.common import MIB, import_torch

    torch = import_torch()
    sizes = QUICK if args.quick else FULL
    if args.ssd_file_mib is not None:
        if args.ssd_file_mib < 1:
            raise UsageError(f"--ssd-file-mib {args.ssd_file_mib}: must be at least 1")
        sizes = Sizes(**{**sizes.__dict__, "ssd_file_bytes": args.ssd_file_mib * MIB,
                         "ssd_block_bytes": min(sizes.ssd_block_bytes, args.ssd_file_mib * MIB)})
    out = Path(args.out)
    check_output_file(out, "-o")  # before any measurement (tierflow.outputs)
    base = load_profile(args.base) if args.base else None
    ssd_dir = _ssd_dir(args, sizes)
    gpu = torch.cuda.is_available()
    device = args.device if args.device != "auto" else ("cuda" if gpu else "cpu")
    if device == "cuda" and not gpu:
        raise UsageError("--device cuda: no CUDA device is available here (use --device cpu to profile this "
                         "CPU as the device)")
    overrides = parse_sets(args.set)
    m = _measure(sizes, ssd_dir, gpu, device)
    cal = build_profile(m, base, name=args.name, device_gib=overrides.pop("gpu.memory_gib", None),
                        overrides=overrides)
    write_profile(cal, out)
    if args.json:
        print(json.dumps(cal.to_json(m, str(out)), indent=2))
        return 0
    print(f"tierflow calibrate on {m['host']} (torch {m['torch']}, {m['cpu_threads']} CPU threads"
          f"{', quick' if args.quick else ''})")
    print()
    print(format_table(cal))
    print()
    for n in cal.notes:
        print(f"note: {n}")
    print(f"not measured (null with its reason, or a default or price of {cal.base_name}): "
          f"{', '.join(cal.not_measured) or 'none'}")
    print(f"wrote {out}: {cal.profile.summary()}")
    # a CPU device computes fp32 and its rates are real bytes: its plans are fp32
    print(f"use it with: tierflow simulate --hw {out}{' --precision fp32' if device == 'cpu' else ''}")
    return 0


def _ssd_dir(args: argparse.Namespace, sizes: Sizes) -> Path | None:
    """--ssd-dir, checked for the SSD test's two files (None without it)."""
    from tierflow.executor.calibration.ssd import check_ssd_dir, ssd_need_bytes

    if args.ssd_dir is None:
        return None
    return check_ssd_dir(args.ssd_dir, ssd_need_bytes(sizes.ssd_file_bytes))


def _measure(sizes: Sizes, ssd_dir: Path | None, gpu: bool, device: str) -> dict[str, Any]:
    """Every measurement, with a progress display; an I/O error on --ssd-dir is one line naming it."""
    from tierflow.executor.calibration import measurement_plan, run_measurements
    from tierflow.planner.io.progress import Progress

    progress = Progress(len(measurement_plan(device, sizes, ssd_dir is not None)), "calibrate")
    try:
        return run_measurements(sizes, ssd_dir, progress, gpu=gpu, device=device)
    except OSError as e:
        if ssd_dir is None:
            raise
        raise UsageError(f"--ssd-dir {ssd_dir}: {e.strerror or e} while measuring (check the directory, its "
                         "free space and permissions, or give another one)") from None
    finally:
        progress.clear()
