"""The DeepSpeed bridge: a DeepSpeed config read as a tierflow schedule (config), what each of its keys does
to a step as DeepSpeed's code runs it (keys), its optimizer, scheduler and clipping as `run`'s settings
(train), and the bridge's runs: a config simulated with tierflow's plan beside it (bridge). The runtime
model itself (DeepSpeed's buffers and hooks) is planner/core (dsruntime, runtimes/deepspeed)."""
