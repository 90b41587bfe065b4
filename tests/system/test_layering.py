"""Architecture rules: tierflow.errors <- hwprofiles <- planner (core <- search <- fit <- io) <- executor <-
tierflow.cli, one public API module that nothing inside imports, no import cycles among tierflow's modules
(lazy imports included), the rooms of the layout, one error base, op kinds spelled once, the planner never
imports torch, and every package folder is installed under `tierflow`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# (folder or file, installed name, rank): a module may import only layers of lower or equal rank
LAYERS = [
    ("tierflow/errors.py", "tierflow.errors", 0),
    ("tierflow/outputs.py", "tierflow.outputs", 0),  # output checks and atomic writes, for every layer
    ("tierflow/logs.py", "tierflow.logs", 0),  # the `tierflow` logger, --quiet / --verbose, for every layer
    ("tierflow/extras.py", "tierflow.extras", 0),  # the extras and how to install one, for every layer
    ("hwprofiles", "tierflow.hwprofiles", 1),
    ("planner/core", "tierflow.planner.core", 2),
    ("planner/search", "tierflow.planner.search", 3),
    ("planner/fit", "tierflow.planner.fit", 4),  # profile fitting, through the simulator
    ("planner/io", "tierflow.planner.io", 5),
    ("executor", "tierflow.executor", 6),
    ("tierflow/cli", "tierflow.cli", 7),
]
# installed package -> folder (pyproject's package-dir)
FOLDERS = {"tierflow": "tierflow", "tierflow.hwprofiles": "hwprofiles", "tierflow.planner": "planner",
           "tierflow.executor": "executor"}


def files_of(path: str) -> list[Path]:
    p = ROOT / path
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top, inside functions or under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def layer_of(module: str) -> int | None:
    ranks = [rank for _, name, rank in LAYERS if module == name or module.startswith(name + ".")]
    return max(ranks) if ranks else None


def module_name(path: Path) -> str:
    """The installed name of a source file, e.g. executor/tiers/store.py -> tierflow.executor.tiers.store."""
    rel = path.relative_to(ROOT)
    for installed, folder in FOLDERS.items():
        if rel.parts[0] == folder:
            parts = [*installed.split("."), *rel.parts[1:]]
            parts[-1] = parts[-1].removesuffix(".py")
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(path)


def package_modules() -> dict[str, Path]:
    return {module_name(f): f for folder in FOLDERS.values() for f in (ROOT / folder).rglob("*.py")}


def absolute_module(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute name of a `from ... import` (relative ones resolved against the importing module)."""
    if node.level == 0:
        return node.module
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imported_tierflow_modules(path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules a file imports: `from package import name` counts as the submodule
    package.name where there is one, else as the package; relative imports are resolved."""
    importer, deps = module_name(path), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node, importer, path.name == "__init__.py")
            subs = [f"{module}.{a.name}" for a in node.names]
            names = [m if m in mods else module for m in subs]
        else:
            continue
        for m in names:
            while m and m not in mods:
                m = m.rpartition(".")[0]
            if m:
                deps.add(m)
    return deps


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at the top, inside functions or under TYPE_CHECKING)."""
    mods = package_modules()
    return {name: imported_tierflow_modules(path, mods) - {name} for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or None (iterative depth-first search)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                stack.append((nxt, iter(sorted(graph.get(nxt, ())))))
                path.append(nxt)
    return None


def test_imports_only_go_down_the_stack():
    bad = []
    for folder, _, rank in LAYERS:
        for f in files_of(folder):
            for mod in imported_modules(f):
                dep = layer_of(mod)
                if dep is not None and dep > rank:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_the_layer_rule_can_fail():
    """layer_of ranks what the rule compares: an executor import inside the planner core would be caught."""
    assert layer_of("tierflow.executor.engine") > layer_of("tierflow.planner.core.graph")
    assert layer_of("tierflow.planner.search.loads") > layer_of("tierflow.planner.core.schedules")
    assert layer_of("tierflow.cli.simulate") > layer_of("tierflow.executor.run")
    assert layer_of("tierflow.errors") < layer_of("tierflow.hwprofiles")
    assert layer_of("tierflow.planner.search.loads") < layer_of("tierflow.planner.fit.trace_fit") < \
        layer_of("tierflow.planner.io.planfile")
    assert layer_of("numpy") is None


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_relative_imports_are_resolved():
    graph = import_graph()
    assert "tierflow.hwprofiles.profile" in graph["tierflow.hwprofiles.overrides"]
    assert "tierflow.hwprofiles.inputs" in graph["tierflow.hwprofiles.profile"]


def test_the_cycle_check_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


# (room, rooms it must not import): a room below another in its package
BELOW = [("executor/optim", "tierflow.executor.ops")]


def room_imports(room: str, forbidden: str) -> list[str]:
    return [f"{f.relative_to(ROOT)} imports {mod}" for f in files_of(room) for mod in imported_modules(f)
            if mod == forbidden or mod.startswith(forbidden + ".")]


def test_rooms_below_others_do_not_import_them():
    """The optimizer's numerics (executor/optim) lie below the ops that call them (executor/ops)."""
    bad = [line for room, forbidden in BELOW for line in room_imports(room, forbidden)]
    assert not bad, bad


def test_the_room_rule_can_fail():
    assert room_imports("executor/ops", "tierflow.executor.optim")  # ops/optimizer.py imports optim
    assert not room_imports("executor/optim", "tierflow.executor.ops")


def private_reaches(room: str, allowed: tuple[str, ...] = ("self", "cls", "torch")) -> list[str]:
    """`x._name` in the files of `room` where x is neither the object itself nor torch (whose private
    kernels, torch._fused_adamw_, are called by name): a reach into another module's or object's
    internals, such as optim calling an ops object's private method."""
    out = []
    for f in files_of(room):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                owner = n.value.id if isinstance(n.value, ast.Name) else ast.unparse(n.value)
                if owner not in allowed:
                    out.append(f"{f.relative_to(ROOT)}:{n.lineno} reaches {owner}.{n.attr}")
    return out


def test_optim_reaches_into_nothing_above_it():
    """executor/optim neither imports the ops that call it (test_rooms_below_others_do_not_import_them) nor
    reaches into an object they hand it: no private attribute of anything but its own objects and torch."""
    bad = private_reaches("executor/optim")
    assert not bad, bad


def test_the_private_reach_rule_can_fail():
    assert private_reaches("executor/ops")  # ops reach their context's internals (not checked here)


def test_the_executor_never_sees_the_command_line():
    """The executor is a library: the CLI turns its flags into typed options (executor/options.py); no
    executor module imports argparse or reads sys.argv."""
    bad = []
    for f in files_of("executor"):
        if "argparse" in imported_modules(f) or "sys.argv" in f.read_text():
            bad.append(str(f.relative_to(ROOT)))
    assert not bad, bad


def test_the_rooms_of_the_layout():
    """The executor's and the planner's rooms, one CLI module per command, and no flat stand-ins for a
    folder."""
    for room in ("executor/ops", "executor/optim", "executor/tiers", "executor/device", "tierflow/cli",
                 "planner/search/slots", "planner/core/runtimes", "planner/fit", "planner/io/deepspeed"):
        assert (ROOT / room / "__init__.py").is_file(), room
    commands = {"simulate", "plan", "capacity", "fit", "compare", "models", "profiles", "run", "calibrate",
                "env"}
    assert commands <= {f.stem for f in (ROOT / "tierflow/cli").glob("*.py")}
    assert not list((ROOT / "executor").glob("ops_*.py"))
    assert not (ROOT / "planner/io/cli.py").exists()
    assert not list((ROOT / "planner/io").glob("ds*.py"))  # the DeepSpeed bridge is planner/io/deepspeed
    assert not list((ROOT / "planner/search").glob("*fit*.py"))  # profile fitting is planner/fit


def test_one_contract_module():
    """The schedule's decisions and the plan, what the planner hands the executor, are defined in
    planner/core/contract.py and nowhere else."""
    where = {}
    for path in package_modules().values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in ("ScheduleConfig", "Plan"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert where == {"ScheduleConfig": ["planner/core/contract.py"], "Plan": ["planner/core/contract.py"]}


def private_imports(path: Path) -> list[str]:
    """The names starting with one underscore that a file imports from another of the package's modules."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierflow"):
            out += [f"{node.module}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_names_across_modules():
    """No module of the package imports another module's private name: what is shared is public, or stays in
    one module."""
    found = {str(p.relative_to(ROOT)): private_imports(p) for p in package_modules().values()}
    bad = {f: names for f, names in found.items() if names}
    assert not bad, bad


def test_the_private_name_check_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from tierflow.planner.core.trace import _x, op_color\nfrom os import _exit\n")
    assert private_imports(f) == ["tierflow.planner.core.trace._x"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def imported_names(path: Path, mods: dict[str, Path], importer: str) -> dict[str, str]:
    """Local name -> what it is bound to, for the package's imports of a file: a module's installed name, or
    `module:Name` for a name imported from one (`from tierflow.x import y`, `import tierflow.x as m`)."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in mods:
                    out[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(node, importer, path.name == "__init__.py")
            if not module.startswith("tierflow"):
                continue
            for a in node.names:
                sub = f"{module}.{a.name}"
                out[a.asname or a.name] = sub if sub in mods else f"{module}:{a.name}"
    return out


def module_classes(mods: dict[str, Path]) -> dict[str, dict[str, set[str]]]:
    """module -> its top-level classes -> the names of the methods each defines."""
    out: dict[str, dict[str, set[str]]] = {}
    for name, path in mods.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(name, {})[node.name] = {
                    f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def private_reach_across(path: Path, mods: dict[str, Path], classes: dict[str, dict[str, set[str]]],
                         me: str | None = None) -> list[str]:
    """A file's reaches into another of the package's modules' private names, by attribute: `module._name`
    on a module it imported (`import tierflow.x as m; m._y`, `from tierflow import x; x._y`,
    `tierflow.x._y`), `Cls._name` on a class imported from another module, and a subclass of such a class
    that overrides one of its private methods. (`from x import _y` is private_imports'.)"""
    me = me or module_name(path)
    bound, out, where = imported_names(path, mods, me), [], path.name
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = ast.unparse(node.value)
            target = bound.get(owner, owner if owner in mods else None)
            if target is not None and target.split(":")[0] != me:
                out.append(f"{where}:{node.lineno} reaches {target.replace(':', '.')}.{node.attr}")
        elif isinstance(node, ast.ClassDef):
            mine = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for base in node.bases:
                target = bound.get(ast.unparse(base), "")
                module, _, cls = target.partition(":")
                theirs = classes.get(module, {}).get(cls, set())
                for m in sorted(n for n in mine & theirs if _private(n)):
                    out.append(f"{where}:{node.lineno} {node.name} overrides {module}.{cls}.{m}")
    return out


def test_no_private_reach_across_modules():
    """No module of the package reaches into another's private names by attribute either: no `module._name`
    on a module it imported, no `Cls._name` on another module's class, and no subclass overriding another
    module's private method (a public hook is what another module extends)."""
    mods = package_modules()
    classes = module_classes(mods)
    bad = [line for path in mods.values() for line in private_reach_across(path, mods, classes)]
    assert not bad, bad


def test_the_private_reach_across_check_can_fail(tmp_path):
    mods = package_modules()
    classes = module_classes(mods)
    f = tmp_path / "probe.py"
    f.write_text("import tierflow.executor.engine as eng\nfrom tierflow.executor import train_loop\n"
                 "from tierflow.executor.engine import Executor\n"
                 "x = eng._Aborted\ny = train_loop._lock\nz = Executor._dep_waits\n"
                 "class Timed(Executor):\n    def _dep_waits(self):\n        return ()\n"
                 "    def _mine(self):\n        return self._other\n")
    got = private_reach_across(f, mods, classes, me="tierflow.executor.probe")
    assert sorted(line.split(" ", 1)[1] for line in got) == [
        "Timed overrides tierflow.executor.engine.Executor._dep_waits",
        "reaches tierflow.executor.engine.Executor._dep_waits", "reaches tierflow.executor.engine._Aborted",
        "reaches tierflow.executor.train_loop._lock"], got


def test_the_run_configuration_imports_no_solver():
    """Importing the run's configuration (executor/options.py) imports neither torch nor a solver: not
    OR-Tools, scipy, the simulator, the trace fit or the planning function."""
    code = ("import sys, tierflow.executor.options; "
            "print(*[m in sys.modules for m in ('ortools', 'scipy', 'torch', "
            "'tierflow.planner.core.simulator', 'tierflow.planner.fit.trace_fit', "
            "'tierflow.planner.io.planning', 'tierflow.executor.decide')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False"] * 7, out.stdout


def process_ends(path: Path) -> list[str]:
    """Calls that end the process (`os._exit`, `sys.exit`, `exit`, `quit`) in a file."""
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Call):
            name = ast.unparse(n.func)
            if name in ("os._exit", "sys.exit", "exit", "quit"):
                out.append(f"{path.relative_to(ROOT)}:{n.lineno} {name}")
    return out


# the one library call that ends a process: a rank whose launcher died and whose main thread did not stop
# within the grace time after its SIGTERM (dist.watch_launcher's thread; the command cannot act: its thread is
# the one stuck)
PROCESS_ENDS_ALLOWED = {"executor/dist.py": 1}


def test_the_library_raises_and_only_the_command_line_ends_the_process():
    """The library raises (RunStopped, TierflowError); only tierflow/cli maps them to exit codes and ends the
    process (tierflow/cli/run.py `_end`: a rank of several at once)."""
    found: dict[str, list[str]] = {}
    for folder in ("tierflow/errors.py", "tierflow/outputs.py", "tierflow/logs.py", "hwprofiles", "planner",
                   "executor"):
        for f in files_of(folder):
            if process_ends(f):
                found[str(f.relative_to(ROOT))] = process_ends(f)
    assert {k: len(v) for k, v in found.items()} == PROCESS_ENDS_ALLOWED, found
    assert process_ends(ROOT / "tierflow/cli/run.py")  # the check sees one where there is one


BUILTIN_ERRORS = {"Exception", "BaseException", "ValueError", "RuntimeError", "OSError", "KeyError",
                  "TypeError"}
# signals that stop a run, not errors
CONTROL_FLOW = {"Interrupted", "RunStopped", "RoundAborted", "_RowError"}


def exception_classes() -> tuple[dict[str, set[str]], set[str]]:
    """Every class of the package whose bases name an exception: class name -> its bases' names."""
    classes = {}
    for path in package_modules().values():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = {b.id for b in node.bases if isinstance(b, ast.Name)}
    derived = {"TierflowError"}
    for _ in range(len(classes)):
        derived |= {name for name, bases in classes.items() if bases & derived}
    errors = {name for name, bases in classes.items() if bases & (BUILTIN_ERRORS | derived)}
    return {name: classes[name] for name in errors}, derived


def test_one_error_base():
    """Every error class of the package derives from tierflow.errors.TierflowError (control flow aside)."""
    errors, derived = exception_classes()
    assert len(errors) > 30
    bad = sorted(set(errors) - derived - CONTROL_FLOW)
    assert not bad, f"derive these from tierflow.errors.TierflowError: {bad}"


def test_nothing_inside_imports_the_public_api():
    bad = [str(f.relative_to(ROOT)) for folder, _, _ in LAYERS for f in files_of(folder)
           if any(m == "tierflow.api" or m.startswith("tierflow.api.") for m in imported_modules(f))]
    assert not bad, bad


def test_old_bare_package_names_are_gone():
    """`planner`, `executor` and `hwprofiles` collide with other PyPI distributions: only tierflow.* is
    imported."""
    bad = []
    for f in list(ROOT.glob("*/**/*.py")):
        if ".venv" in f.parts:
            continue
        for mod in imported_modules(f):
            if mod.split(".")[0] in ("planner", "executor", "hwprofiles"):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_pyproject_installs_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    expected = set()
    for installed, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([installed, *rel.parts]))
    assert set(cfg["packages"]) == expected


def test_planner_and_cli_start_without_torch():
    code = ("import sys, tierflow.cli, tierflow.api, tierflow.planner.core.simulator, "
            "tierflow.planner.core.trace, tierflow.hwprofiles; "
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'networkx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False", "False"]


def test_every_registered_command_loads_without_torch():
    """Every command module of tierflow.cli is imported for every command (tierflow simulate, plan, ...): they
    must not import torch, which takes seconds and slows the planner's garbage collection."""
    code = ("import sys; from tierflow.cli import build_parser; p = build_parser(); "
            "names = sorted(p._subparsers._group_actions[0].choices); "
            "print(','.join(names), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    names, has_torch = out.stdout.split()
    assert {"run", "calibrate", "plan", "simulate"} <= set(names.split(","))
    assert has_torch == "False"


def test_version_and_module_entry_point():
    import tierflow

    for cmd in ([sys.executable, "-m", "tierflow", "--version"],):
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
        assert out.stdout.strip() == f"tierflow {tierflow.__version__}"


# strings equal to an op kind that are not op kinds: a DeepSpeed optimizer type, the head's block kind, the
# `recompute` decision of a schedule (its plan-file key and its description)
NOT_OP_KINDS = {("planner/io/deepspeed/config.py", "adam"), ("planner/io/deepspeed/train.py", "adam"),
                ("planner/core/workload.py", "head"), ("planner/core/contract.py", "recompute")}


def test_op_kinds_are_spelled_once():
    """The op vocabulary lives in planner/core/opkinds.py: no other module of the package spells an op kind
    as a string (schedule builders, plan-file checks and the executor's dispatch table use its names)."""
    from tierflow.planner.core.opkinds import OP_KINDS

    bad = []
    for folder in FOLDERS.values():
        for f in (ROOT / folder).rglob("*.py"):
            rel = str(f.relative_to(ROOT))
            if rel == "planner/core/opkinds.py":
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if (isinstance(node, ast.Constant) and node.value in OP_KINDS
                        and (rel, node.value) not in NOT_OP_KINDS):
                    bad.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not bad, f"use the names of tierflow.planner.core.opkinds: {bad}"
