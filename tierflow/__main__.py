"""`python -m tierflow ...` is the `tierflow` command."""

from tierflow.planner.io.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
