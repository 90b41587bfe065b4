"""Executor: replays a tierflow plan file with PyTorch on real hardware (see issue "Executor").

Not implemented yet. Commands it will add (`run`, `compare`, `calibrate`) register through the
`tierflow.commands` entry-point group so that the planner never imports torch.
"""
