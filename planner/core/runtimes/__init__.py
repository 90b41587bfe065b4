"""How the modelled runtimes run a schedule: each non-ideal runtime is a set of hook methods that the generic
builder (tierflow.planner.core.schedules._Builder) inherits and calls at fixed points, each doing nothing
unless the schedule runs as that runtime (ScheduleConfig.runtime).

- deepspeed (DeepSpeedHooks): ZeRO-Infinity as DeepSpeed's ZeRO-3 code runs it: gradient buckets and their
  stream events (_ds_grad_bucket, _ds_flush), parameters cached in host memory (_ds_cached_blocks), the
  host's waits at module hooks (_ds_drained_at_next_hook), the optimizer's sub-groups (_ds_sub_group,
  _ds_read_bound);
- lohan (LohanHooks): Fuyou as LoHan's code runs it: the training thread's waits at sub-group boundaries
  (_lohan_trigger, _lohan_thread), and the renumbering its backward edges need (renumber).

optstep holds the records of one block's optimizer step that the builder and the hooks share.
"""
