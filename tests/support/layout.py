"""Where a test file belongs: tests/ mirrors the source tree, two folder levels deep.

The rule (tests/system/test_tests_layout.py enforces it):
1. A test file's subject is named in SUBJECTS (its stem -> the test folder), for files whose name is not a
   module's, or whose module name is ambiguous, or whose subject is cross-cutting (`system`: layering, docs,
   README, notebooks, hostile inputs, end-to-end runs across planner, executor and CLI).
2. Otherwise `test_<name>.py` tests the one library module `<name>.py` or package folder `<name>/` of
   tierflow/, hwprofiles/, planner/ or executor/, or else the script experiments/<name>.py.
3. The folder is that source path's folder (a package's own folder) with `tierflow/` dropped, cut to two
   levels: planner/core/simulator.py -> tests/planner/core/, planner/search/slots/ -> tests/planner/search/,
   executor/optim/quant8.py -> tests/executor/optim/, tierflow/cli/exits.py -> tests/cli/,
   experiments/gpu_check.py -> tests/experiments/.
A name matching no module, or several, must be added to SUBJECTS. Basenames stay unique across tests/ so the
name alone says where a file goes. tests/support/ holds what tests import (not tests); tests/conftest.py the
shared fixtures.

    python tests/support/layout.py                # list what is out of place (nothing: exit 0)
    python tests/support/layout.py --move         # git mv each misplaced test file into its folder
    python tests/support/layout.py --fix          # import from tests/support/, Path(__file__) from the repo
    python tests/support/layout.py --fix-refs     # rewrite tests/... paths in docs and code to where they are
    python tests/support/layout.py --modules      # and the library modules with no test file of their name

After --move, --fix imports from tests/support/ what test files imported from test_executor, helpers,
dist_worker or test_files, and starts each Path(__file__) path from the repository (parents[depth]); then ruff
check --fix --select I sorts the rewritten imports.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SOURCE_FOLDERS = ("tierflow", "hwprofiles", "planner", "executor")
SUPPORT = "support"
# stem -> folder under tests/, for names that are no module's, ambiguous, or cross-cutting
SUBJECTS = {
    "test_accelerators": "planner/core",  # numba_once: optional compiled kernels
    "test_calibrate": "executor/calibration",
    "test_cli_exits": "cli",
    "test_closed_loop_sweep": "experiments",  # experiments/closed_loop.py --sweep
    "test_compute": "planner/core",  # planner/core/compute.py (not executor/ops/compute.py)
    "test_device_memory": "planner/core",  # the planner's working memory against the executor's ops
    "test_dist_executor": "executor",
    "test_ds_keys": "planner/io",  # planner/io/deepspeed/keys.py
    "test_ds_runtime": "planner/core",  # planner/core/dsruntime.py
    "test_dsconfig": "planner/io",  # planner/io/deepspeed/config.py and bridge.py
    "test_env": "executor",  # executor/env.py (the command: tierflow/cli/env.py)
    "test_executor_models": "executor/models",
    "test_executor_units": "executor",
    "test_experiments": "experiments",
    "test_files": "planner/io",  # plan files and traces, gzip or not
    "test_finetune": "executor",
    "test_fit": "planner/fit",
    "test_fp32_inplace": "planner/core",  # workload.Precision.in_place
    "test_gantt": "planner/core",  # planner/core/trace.py
    "test_happens_before": "executor/ops",  # what ops hand each other, over a real run
    "test_lora": "planner/core",  # planner/core/lora.py (executor/lora.py: test_lora_executor)
    "test_lora_executor": "executor",  # executor/lora.py: adapters trained over the tiers
    "test_lora_dist": "executor",  # executor/lora.py on several ranks (ops/net.py all_reduce_grads)
    "test_lora_numerics": "executor/models",  # the executor's LoRA against transformers + PEFT
    "test_loss_memory": "planner/core",  # workload.head_cost against the executor's head
    "test_memory_contract": "executor",
    "test_models": "planner/core",  # planner/core/models/ (executor/models/: test_executor_models)
    "test_multi_gpu": "planner/core",  # planner/core/world.py and the schedule builder's collectives
    "test_pinned": "executor/device",
    "test_precision": "planner/core",  # workload.Precision
    "test_profile": "executor",  # tierflow run --profile (not hwprofiles/profile.py)
    "test_reliability_inputs": "cli",
    "test_reliability_run": "executor",
    "test_saved_activations": "planner/core",  # BlockCost.full_activation_bytes against the executor's layers
    "test_store": "executor/tiers",  # executor/tiers/ssd_store.py
    "test_times": "planner/core",  # planner/core/timefmt.py
    "test_topological": "planner/core",  # planner/core/graph.py
    # cross-cutting
    "test_docs": "system",
    "test_docs_tables": "system",
    "test_extras": "system",  # the README's first install and every command
    "test_hostile": "system",
    "test_layering": "system",
    "test_model_plugins": "system",  # a family registered from outside, planned, simulated and trained
    "test_notebooks": "system",
    "test_readme_demo": "system",
    "test_refusals": "system",
    "test_streaming_inputs": "system",
    "test_tests_layout": "system",
}


def folder_of(source: Path) -> str:
    """The test folder of a source file or package folder (relative to the repository)."""
    parts = list(source.parts if source.suffix != ".py" else source.parent.parts)
    if parts[:1] == ["tierflow"] and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts[:2])


def sources_named(name: str) -> list[Path]:
    """The library modules `<name>.py` and package folders `<name>/` (relative paths)."""
    out = []
    for top in SOURCE_FOLDERS:
        base = ROOT / top
        if top == name:
            out.append(Path(top))
        out += [p.relative_to(ROOT) for p in base.rglob(f"{name}.py") if "__pycache__" not in p.parts]
        out += [p.relative_to(ROOT) for p in base.rglob(name) if p.is_dir() and (p / "__init__.py").exists()]
    return sorted(set(out))


def place(stem: str) -> str:
    """The folder under tests/ where test file `<stem>.py` belongs; ValueError when no rule says."""
    if stem in SUBJECTS:
        return SUBJECTS[stem]
    name = stem.removeprefix("test_")
    found = sources_named(name)
    if len(found) == 1:
        return folder_of(found[0])
    if not found and (ROOT / "experiments" / f"{name}.py").exists():
        return "experiments"
    what = "no module" if not found else "several modules (" + ", ".join(map(str, found)) + ")"
    raise ValueError(f"tests: {stem}.py names {what}: add it to SUBJECTS in tests/support/layout.py")


def all_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def misplaced() -> list[tuple[Path, str]]:
    """(file, folder where it belongs) for each test file not in its folder (and that no rule places)."""
    out = []
    for f in all_test_files():
        want = unplaced_reason(f)
        if want is None:
            want = place(f.stem)
            if f.parent.relative_to(TESTS).as_posix() != want:
                out.append((f, want))
    return out


def unplaced_reason(f: Path) -> str | None:
    try:
        place(f.stem)
    except ValueError as e:
        return str(e)
    return None


def unplaced() -> list[str]:
    """One line for each test file that no rule places."""
    return [r for f in all_test_files() if (r := unplaced_reason(f))]


def hint(f: Path, want: str) -> str:
    return (f"{f.relative_to(ROOT)} belongs in tests/{want}/: "
            f"git mv {f.relative_to(ROOT)} tests/{want}/{f.name} (or: python tests/support/layout.py --move)")


# -- what a file moved out of the flat tests/ still says ----------------------------------------------------

# files whose tests/... paths and Path(__file__) lines are examples (this tool and its test), not references
EXAMPLES = {"tests/support/layout.py", "tests/system/test_tests_layout.py"}
# imports of what moved to tests/support/ (test modules do not import each other in importlib mode)
OLD_IMPORTS = [
    (re.compile(r"^(\s*)from test_executor import", re.M), r"\1from support.runs import"),
    (re.compile(r"^(\s*)from helpers import", re.M), r"\1from support.helpers import"),
    (re.compile(r"^(\s*)from dist_worker import", re.M), r"\1from support.dist_worker import"),
    (re.compile(r"^(\s*)from test_files import", re.M), r"\1from support.schemas import"),
    (re.compile(r"^from test_corpus import tok_dir.*\n", re.M), ""),  # the fixture is in tests/conftest.py
]
# a path from the test file's own location: Path(__file__).resolve().parents[k] / "name" or ROOT = ...
FILE_PATH = re.compile(r"(\w+ = )?Path\(__file__\)(?:\.resolve\(\))?(?:\.parents\[(\d)\]|((?:\.parent)+))"
                       r"(?: / \"([\w.]+)\")?")


def old_imports(f: Path) -> list[str]:
    text = f.read_text()
    return [m.group(0).strip() for pattern, _ in OLD_IMPORTS for m in pattern.finditer(text)]


def root_problems(f: Path) -> list[tuple[str, str, str | None]]:
    """(text, message, replacement) for each path built from Path(__file__) that names a missing file or
    folder or one of the repository's top level from elsewhere, or a ROOT / REPO that is not the repository;
    the replacement starts from the repository instead (None where that path is missing too)."""
    out = []
    depth = len(f.relative_to(TESTS).parts)  # parents[depth] is the repository
    if f.relative_to(ROOT).as_posix() in EXAMPLES:
        return out
    for m in FILE_PATH.finditer(f.read_text()):
        up = int(m.group(2)) + 1 if m.group(2) else m.group(3).count(".parent")
        base, name = f.resolve().parents[up - 1], m.group(4)
        is_root = (m.group(1) or "").strip(" =") in ("ROOT", "REPO")
        # a name of the repository's top level (experiments, docs, ...) is meant from there, even where
        # tests/ has a folder of that name (tests/experiments/)
        if base != ROOT and (is_root if not name else not (base / name).exists() or (ROOT / name).exists()):
            fixed = f'{m.group(1) or ""}Path(__file__).resolve().parents[{depth}]'
            fixed += f' / "{name}"' if name else ""
            ok = not name or (ROOT / name).exists()
            message = (f"{f.relative_to(ROOT)}: {m.group(0)} is {base / (name or '')}; the repository is "
                       f"Path(__file__).resolve().parents[{depth}] here")
            out.append((m.group(0), message, fixed if ok else None))
    return out


def wrong_roots(f: Path) -> list[str]:
    return [message for _, message, _ in root_problems(f)]


def fix_file(f: Path) -> bool:
    """Import from tests/support/ what moved there and start Path(__file__) paths from the repository."""
    text = f.read_text()
    new = text
    for pattern, repl in OLD_IMPORTS:
        new = pattern.sub(repl, new)
    for old, _, fixed in root_problems(f):
        if fixed:
            new = new.replace(old, fixed)
    if new != text:
        f.write_text(new)
    return new != text


# -- references to test files in docs and code ---------------------------------------------------------------

REF = re.compile(r"\btests/(?:[a-z0-9_]+/)*([a-z0-9_]+\.py)\b")
REF_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".yaml", ".txt", ""}


def current_paths() -> dict[str, str]:
    """basename -> path of every Python file under tests/ (relative to the repository)."""
    files = [p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts]
    return {p.name: p.relative_to(ROOT).as_posix() for p in files}




def text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in out.splitlines()
            if Path(n).suffix in REF_SUFFIXES and n not in EXAMPLES and (ROOT / n).is_file()]


def stale_refs() -> list[tuple[Path, str, str]]:
    """(file, reference, what it should say) for each tests/... path that is not where the file is."""
    now = current_paths()
    out = []
    for f in text_files():
        try:
            text = f.read_text()
        except UnicodeDecodeError:
            continue
        for m in REF.finditer(text):
            want = now.get(m.group(1))
            if want and m.group(0) != want:
                out.append((f, m.group(0), want))
    return out


def fix_refs() -> int:
    now = current_paths()
    changed = 0
    for f, _, _ in {(f, None, None) for f, _, _ in stale_refs()}:
        text = f.read_text()
        f.write_text(REF.sub(lambda m: now.get(m.group(1), m.group(0)), text))
        changed += 1
    return changed


def modules_with_tests() -> tuple[list[str], list[str]]:
    """(library modules with a test file of their name, those without): each `<name>.py` of tierflow/,
    hwprofiles/, planner/ and executor/ but __init__.py and __main__.py, against tests/**/test_<name>.py."""
    stems = {f.stem.removeprefix("test_") for f in all_test_files()}
    mods = sorted(p.relative_to(ROOT).as_posix() for top in SOURCE_FOLDERS for p in (ROOT / top).rglob("*.py")
                  if "__pycache__" not in p.parts and p.name not in ("__init__.py", "__main__.py"))
    have = [m for m in mods if Path(m).stem in stems]
    return have, [m for m in mods if m not in have]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--move", action="store_true", help="git mv each misplaced test file into its folder")
    ap.add_argument("--fix-refs", action="store_true", help="rewrite stale tests/... paths in tracked files")
    ap.add_argument("--fix", action="store_true",
                    help="import from tests/support/ what moved there, Path(__file__) paths from the repo")
    ap.add_argument("--modules", action="store_true", help="list the library modules without a test file")
    args = ap.parse_args(argv)
    for line in unplaced():
        print(line, file=sys.stderr)
    for f, want in misplaced():
        if args.move:
            (TESTS / want).mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(f), str(TESTS / want / f.name)], cwd=ROOT, check=True)
            print(f"moved {f.relative_to(ROOT)} -> tests/{want}/{f.name}")
        else:
            print(hint(f, want))
    for f in all_test_files():
        if args.fix and fix_file(f):
            print(f"{f.relative_to(ROOT)}: fixed (then: ruff check --fix --select I {f.relative_to(ROOT)})")
        if old_imports(f):
            print(f"{f.relative_to(ROOT)}: {old_imports(f)} (python tests/support/layout.py --fix)")
        for line in wrong_roots(f):
            print(line + " (python tests/support/layout.py --fix)")
    if args.fix_refs:
        print(f"rewrote tests/... paths in {fix_refs()} files")
    else:
        for f, ref, want in stale_refs():
            print(f"{f.relative_to(ROOT)}: {ref} is now {want} (python tests/support/layout.py --fix-refs)")
    have, without = modules_with_tests()
    print(f"{len(have)} of {len(have) + len(without)} library modules have a test file of their name")
    if args.modules:
        print("\n".join(f"  no tests/**/test_{Path(m).stem}.py: {m}" for m in without))
    return 2 if unplaced() else 0


if __name__ == "__main__":
    sys.exit(main())
