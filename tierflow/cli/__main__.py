"""`python -m tierflow.cli ...` is the `tierflow` command."""

from tierflow.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
