"""Calibration: measure the machine it runs on and build a hardware profile the planner accepts (the command
is `tierflow calibrate`, tierflow/cli/calibrate.py).

- GPU (``--device cuda``): bf16 GEMM TFLOPS at transformer shapes, a small GEMM to fit ``gemm_half_gflop``,
  HBM bandwidth, memory size, pinned H2D / D2H bandwidth alone and both at once (gpu.py).
- The CPU as the device (``--device cpu``): fp32 GEMM rates at six sizes fitted to the cost model's curve,
  elementwise bandwidth, copies within host memory alone and two at once (host_device.py), and the cores that
  compute, CPU Adam, the copies and the SSD ops share.
- CPU: DRAM copy bandwidth, memory size, CPU AdamW update rate (cpu.py).
- SSD (with ``--ssd-dir``): sequential O_DIRECT write and read bandwidth, a mixed read + write run and the
  free space; the directory's filesystem is measured as ONE device (ssd.py).
- The executor itself on a CPU device: its store, compute beside its I/O threads, its fixed cost per op
  (executor_costs.py).

measurements.py runs them in order; profile_builder.py builds the profile (what cannot be measured comes from
a base profile) and records the source of every field; profile_output.py prints and writes it. torch is
imported inside the functions (common.import_torch).
"""

from tierflow.executor.calibration.common import FULL, QUICK, CalibrationError, Sizes
from tierflow.executor.calibration.cpu import cpu_model
from tierflow.executor.calibration.executor_costs import measure_store
from tierflow.executor.calibration.measurements import measurement_plan, run_measurements
from tierflow.executor.calibration.profile_builder import Calibration, FieldInfo, build_profile
from tierflow.executor.calibration.profile_output import format_table, write_profile
from tierflow.executor.calibration.ssd import block_device_name

__all__ = ["FULL", "QUICK", "Calibration", "CalibrationError", "FieldInfo", "Sizes", "block_device_name",
           "build_profile", "cpu_model", "format_table", "measure_store", "measurement_plan",
           "run_measurements", "write_profile"]
