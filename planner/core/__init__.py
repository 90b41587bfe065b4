"""The simulator core: model zoo, workload, cost model, placement, task graph, schedules, memory model,
discrete-event simulator and traces."""
