"""`tierflow profiles`: the bundled hardware profiles, one line per box."""

from __future__ import annotations

import argparse
from typing import Any

from tierflow.hwprofiles import list_profiles, load_profile


def add_parser(sub: Any) -> argparse.ArgumentParser:
    return sub.add_parser("profiles", help="list the bundled hardware profiles")


def run(args: argparse.Namespace) -> int:
    for name in list_profiles():
        hw = load_profile(name)
        print(f"{name:<16} {hw.summary()}")
    return 0
