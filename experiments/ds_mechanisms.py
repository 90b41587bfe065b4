"""Real DeepSpeed ZeRO-Infinity runs (CPU accelerator, race_deepspeed.py's model and config) instrumented per
mechanism, to check what planner/io/deepspeed/keys.py reads in DeepSpeed's code:

- `offload_param.max_in_cpu`: how many parameter elements end up in host memory for good
  (`final_location != nvme`) and how many stay on NVMe, at the default and at 0;
- `offload_param.buffer_count`: the NVMe read-ahead of parameters: the most parameters in flight from NVMe at
  once (AsyncPartitionedParameterSwapper.inflight_params after each swap_in) and the largest swap_in call,
  with 5 and with 10 buffers.

    python experiments/ds_mechanisms.py [--steps N] [--dir DIR]

Counts, not times: each variant runs `--steps` steps (the first is DeepSpeed's trace; the counts are over the
later ones). Needs DeepSpeed (the `[baseline]` extra, libaio).

    python experiments/ds_mechanisms.py --pinned [--mib 1100]   # CUDA box; one skip line elsewhere

- `offload_optimizer.pin_memory` (planner/core/dsruntime.py pinned_alloc_bytes, deepspeed_setup_peak_bytes):
  DeepSpeed pins its gradient partitions as `get_accelerator().pin_memory(torch.zeros(n))`, that is
  `Tensor.pin_memory()` through torch's caching host allocator. Measures, for a bf16 buffer of `--mib` MiB
  (just above a power of two by default), the pinned bytes torch reserves (`torch.cuda.host_memory_stats()`)
  and the process's peak RSS growth while the pageable original and its pinned copy are alive: the model
  predicts the next power of two, and pageable + pinned at the peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import race_deepspeed as race  # noqa: E402
from expcommon import script_main  # noqa: E402

from tierflow.planner.io.deepspeed.config import largest_param_elems  # noqa: E402

# bf16 1024 x 1024 matrices: 2 MiB, above the 1 MiB DeepSpeed swaps at the least. In bf16: with fp32
# parameters on NVMe, DeepSpeed 0.19.8 on the CPU accelerator stops in the first forward ("expected m1 and m2
# to have the same dtype, but got: float != c10::BFloat16": its parameter swap buffers are bf16)
POINT = race.Point(2, 1024, 16, 1, 64, vocab=2048)
VARIANTS = {  # offload_param keys beyond the device
    "max_in_cpu default, 5 buffers": {},
    "max_in_cpu 0, 5 buffers": {"max_in_cpu": 0},
    "max_in_cpu 0, 10 buffers": {"max_in_cpu": 0, "buffer_count": 10},
}


def job_for(nvme_dir: str, extra: dict, steps: int) -> dict:
    cfg = race.ds_config(POINT, nvme_dir, "ds-default")
    largest = largest_param_elems(POINT.spec())  # the MLP's 1024 x 4096 here, above the embedding
    cfg["zero_optimization"]["offload_param"].update({"buffer_size": largest, **extra})
    cfg["bf16"] = {"enabled": True}
    return {"kind": "mech", "point": POINT.__dict__, "ds_config": cfg, "threads": race.THREADS,
            "steps": steps}


def mech_worker(job: dict) -> dict:
    """One variant: instrument the parameter swapper, run the steps, count."""
    seen = {"calls": 0, "max_call": 0, "max_inflight": 0, "after_trace": False}

    def instrument() -> None:
        from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

        orig = AsyncPartitionedParameterSwapper.swap_in

        def swap_in(self, params, async_op=True, swap_in_buffers=None):
            out = orig(self, params, async_op, swap_in_buffers)
            if seen["after_trace"]:
                seen["calls"] += 1
                seen["max_call"] = max(seen["max_call"], len(params))
                seen["max_inflight"] = max(seen["max_inflight"], len(self.inflight_params))
            return out

        AsyncPartitionedParameterSwapper.swap_in = swap_in

    ds = race.ds_engine(job, before_init=instrument)
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    params = list(ds.engine.module.parameters())
    on_nvme = sum(p.ds_numel for p in params if p.ds_tensor.final_location == OffloadDeviceEnum.nvme)
    for step in range(job["steps"]):
        seen["after_trace"] = step >= 1
        x, y = ds.data.batch(step, ds.point.batch, ds.point.seq)
        loss = ds.engine(x, y)
        ds.engine.backward(loss)
        ds.engine.step()
    return {"params": sum(p.ds_numel for p in params), "on_nvme": on_nvme,
            "swap_in_calls": seen["calls"], "largest_swap_in": seen["max_call"],
            "most_in_flight": seen["max_inflight"]}


def pinned_check(mib: int) -> dict:
    """DeepSpeed's pinning of a pageable buffer of `mib` MiB (stage3.py:791-795 @0.19.8), on a CUDA device:
    what torch's caching host allocator reserves and how far the process's peak RSS grows, beside the model's
    prediction. A one-line skip where there is no CUDA device (its pinned allocator is CUDA's)."""
    import resource

    import torch

    from tierflow.planner.core.dsruntime import pinned_alloc_bytes

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device: torch's pinned host allocator is CUDA's (run it on a GPU box)"}
    nbytes = mib << 20
    before = dict(torch.cuda.host_memory_stats())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pageable = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    pinned = pageable.pin_memory()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    after = dict(torch.cuda.host_memory_stats())
    grown = {k: after[k] - before.get(k, 0) for k in after
             if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}
    del pageable, pinned
    return {"buffer_bytes": nbytes, "predicted_pinned_bytes": pinned_alloc_bytes(nbytes),
            "predicted_peak_bytes": nbytes + pinned_alloc_bytes(nbytes), "peak_rss_growth_bytes": rss1 - rss0,
            "host_memory_stats_growth": grown, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", help="the NVMe folder (default: a new temporary one)")
    ap.add_argument("--pinned", action="store_true", help="only the pinned-allocation check (CUDA)")
    ap.add_argument("--mib", type=int, default=1100, help="--pinned: the buffer's size in MiB")
    args = ap.parse_args(argv)
    if args.pinned:
        print(f"pinned: {json.dumps(pinned_check(args.mib))}", flush=True)
        return 0
    if race.deepspeed_missing():
        print(f"ds_mechanisms: skipped: {race.deepspeed_missing()}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="tierflow-dsmech-"))
    nvme = Path(args.dir) if args.dir else work / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    for name, extra in VARIANTS.items():
        res = race.run_worker(job_for(str(nvme), extra, args.steps), work, script=Path(__file__).resolve())
        print(f"{name}: {json.dumps(res)}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        job = json.loads(Path(sys.argv[2]).read_text())
        print(race.RESULT_TAG + json.dumps(mech_worker(job)), flush=True)
    else:
        sys.exit(script_main(main))
