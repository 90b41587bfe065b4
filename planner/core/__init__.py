"""The simulator core: model zoo, workload, cost model, placement, task graph, the planner-executor contract
(ScheduleConfig, Plan, op kinds), schedules (families, the builder, runtime hooks), memory model,
discrete-event simulator and traces."""
