"""How the host optimizer slows the GPU's work on a GPU box (cpu.gpu_slowdown_beside_host_optimizer): a thread
that launches a layer's worth of small kernels, as the executor's gpu worker does, alone and while the
executor's own optimizer op (optimizer_op.HostAdamOp) runs on another thread with the thread count the
optimizer worker will use (executor/optim/host_threads.py). On the H200 of the first GPU run every GPU op kind
took 2.6-10.8x its prediction beside a host optimizer that held every core: the launching thread waited for a
core and the GPU idled between its launches."""

from __future__ import annotations

import threading
import time

from tierflow.executor.calibration.common import import_torch


def launch_burst_s(x, kernels: int) -> float:
    """Seconds for one thread to launch `kernels` small matrix products on `x`'s device and see them done
    (a layer's worth of short kernels: their time is launch-bound on a GPU)."""
    torch = import_torch()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    out = torch.empty_like(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(kernels):
        torch.mm(x, x, out=out)
    sync()
    return time.perf_counter() - t0


def measure_gpu_beside_host_optimizer(device: str, threads: int, adam_params: int = 8 * 2**20,
                                      kernels: int = 200, reps: int = 5, dim: int = 256) -> dict[str, float]:
    """{"alone_s", "beside_s", "slowdown"}: the median launch burst alone, then while the executor's adam op
    steps `adam_params` parameters in a loop on `threads` intra-op threads in another thread; slowdown is
    beside / alone (at least 1)."""
    torch = import_torch()
    from tierflow.executor.calibration.optimizer_op import HostAdamOp
    from tierflow.executor.optim.host_threads import apply_in_this_thread, restore

    before = torch.get_num_threads()
    x = torch.randn(dim, dim, device=device)
    launch_burst_s(x, kernels)  # warm-up: the kernels' first dispatch
    alone = sorted(launch_burst_s(x, kernels) for _ in range(reps))[reps // 2]
    op = HostAdamOp(adam_params)
    op.step()  # first touches
    stop, started = threading.Event(), threading.Event()

    def optimizer() -> None:
        apply_in_this_thread(threads)  # as the executor's cpu worker: the process-wide count restored after
        op.step()
        started.set()  # the bursts start once the optimizer is in its loop
        while not stop.is_set():
            op.step()

    worker = threading.Thread(target=optimizer, name="tierflow-calibrate-adam", daemon=True)
    worker.start()
    started.wait()
    try:
        beside = sorted(launch_burst_s(x, kernels) for _ in range(reps))[reps // 2]
    finally:
        stop.set()
        worker.join()
        restore(before)
    return {"alone_s": alone, "beside_s": beside, "slowdown": max(1.0, beside / alone)}
