"""The planner: simulator core (``core``), search (``search``) and input/output (``io``).
Never imports torch."""
