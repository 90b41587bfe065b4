"""Runtime lohan: Fuyou as LoHan's code runs it (docs/baselines-as-coded.md B2, B3), as hooks of the schedule
builder (tierflow.planner.core.runtimes)."""

from __future__ import annotations

from tierflow.planner.core.graph import Task, topological_order

# LoHan: how far behind the I/O it waits for a training-thread op is queued (a key offset, in steps)
THREAD_KEY_STEP = 0.001


class LohanHooks:
    """The builder's hooks for runtime lohan (mixed into tierflow.planner.core.schedules._Builder)."""

    def _lohan_trigger(self, k_last: int, thread_last: Task | None) -> list[int]:
        """LoHan: the tasks after which its training thread reaches the gradient hook that steps the block
        whose last backward step is k_last: its previous wait, and the next block's weights fetched (it waits
        for their copy to the GPU, ratel_init.py:838-855) before it launches that block's backward; the GPU
        may still be behind."""
        out = [thread_last.id] if thread_last is not None else []
        h = self.uses[self.step_use[k_last + 1]].fetch_h2d if k_last + 1 < len(self.step_use) else None
        return out + [h.id if h is not None else self.step_task[k_last]]


    def _lohan_thread(self, read: Task, write: Task | None, k_last: int, end: int) -> Task:
        """LoHan's training thread at a sub-group boundary: it reads the block's optimizer states and waits,
        then writes back the block stepped before it and waits; only then does it go on to the next module's
        hook, which reads that module's weights from NVMe. The GPU runs ahead on what the thread launched
        before."""
        if write is not None:
            write.deps.append(read.id)  # the write is issued after the read's wait
            write.key = max(write.key, read.key + THREAD_KEY_STEP)
        last = write if write is not None else read
        if k_last + 2 >= end:
            return last  # the iteration's last blocks: the next forward waits for the weights it reads anyway
        rd = self.uses[self.step_use[k_last + 2]].read
        if rd is not None:
            rd.deps.append(last.id)
            rd.key = max(rd.key, last.key + THREAD_KEY_STEP)  # behind it in its resource's queue
        return last



def renumber(tasks: list[Task]) -> None:
    """Give the tasks new ids in a topological order, the build order wherever the edges allow, so that every
    task again comes after its dependencies: LoHan's training thread adds edges from later-built tasks to
    earlier ones (_Builder._lohan_thread), all within one iteration, so the ops stay ordered by iteration."""
    order = topological_order(len(tasks), [t.deps for t in tasks], [float(t.id) for t in tasks],
                              cycle_message="LoHan's thread order makes a dependency cycle")
    new_id = {old: new for new, old in enumerate(order)}
    ordered = [tasks[i] for i in order]
    for t in ordered:
        t.id = new_id[t.id]
        t.deps = sorted(new_id[d] for d in t.deps)
    tasks[:] = ordered

