"""Profile fitting: hardware-profile fields fitted to measured runs (profile_fit) or to one measured trace,
op kind by op kind (trace_fit), through the simulator."""
