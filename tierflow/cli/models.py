"""`tierflow models`: the model zoo, one line per model."""

from __future__ import annotations

import argparse
from typing import Any

from tierflow.planner.core.models import get_model, list_models


def add_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser("models", help="list the model zoo")


def run(args: argparse.Namespace) -> int:
    for name in list_models():
        print(get_model(name).describe())
    return 0
