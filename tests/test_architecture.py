"""The package's shape, read from its source with `ast` (nothing is imported): the folders and the
rules between them (docs/architecture.md), no import cycle, engines as peers, short modules and
functions.

Imports counted: every `import` / `from ... import` statement, at module level and inside functions
alike (an import inside a function is deferred, not absent: the dependency is real), except those
under `if TYPE_CHECKING:` (never executed). `from gpuopt import x` counts as an import of the
submodule `gpuopt.x` when x is one, else of the package `gpuopt`. Importing `a.b.c` runs `a` and
`a.b` too; those implicit parent-package edges are not counted (as import-linter and pylint do).
The sweeper reaches the torch side only through processes it starts (`python -m gpuopt.X`), which
are strings, not imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "gpuopt"
MAX_FUNCTION_LINES = 80

MAX_MODULE_LINES = 500
# The most floors (the longest chain of imports among its own modules, deferred ones counted) a
# folder may have: a change one floor down reaches everything above it (issue 40: sweeper/ <= 6).
MAX_FLOORS = 6

# The folders of gpuopt/ and which side of the torch line each is on.
TORCH_FREE = ("core", "study", "sweeper", "report")
TORCH_SIDE = ("trial", "engines", "workload", "processes")
# Top-level modules of the torch side (entry points that build or probe a device).
TORCH_SIDE_MODULES = ("gpuopt.run", "gpuopt.env")

# Functions over MAX_FUNCTION_LINES, as "module:qualname". The goal is none.
LONG_FUNCTIONS_ALLOWED: set[str] = set()  # empty is the goal, and it is reached


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    target: str  # the imported module (a gpuopt module, or a third-party top-level name)
    deferred: bool  # inside a function
    line: int


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    known = modules()
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = _resolve(module, node)
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            for alias in node.names
        ]
    targets = []
    for name in names:
        while name.startswith("gpuopt.") and name not in known:  # a name inside a module
            name = name.rpartition(".")[0]
        targets.append(name if name in known else name.split(".")[0])
    return targets


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    found: list[Import] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for other in child.orelse:
                    visit(other, deferred)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                found.extend(Import(t, deferred, child.lineno) for t in _targets(module, child))
            inner = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, deferred or inner)

    visit(ast.parse(modules()[module].read_text()), deferred=False)
    return tuple(found)


def import_graph(include_deferred: bool = True) -> dict[str, set[str]]:
    known = modules()
    return {
        module: {
            i.target
            for i in imports_of(module)
            if i.target in known and i.target != module and (include_deferred or not i.deferred)
        }
        for module in known
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the DFS path, "done" after
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def folder(module: str) -> str | None:
    """The folder of gpuopt/ a module lives in ("core", "sweeper", ...), None at the top level."""
    parts = module.split(".")
    return (
        parts[1]
        if len(parts) > 2 or (len(parts) == 2 and modules()[module].name == "__init__.py")
        else None
    )


def gpuopt_imports(module: str) -> list[Import]:
    return [i for i in imports_of(module) if i.target in modules() and i.target != module]


def test_the_parser_sees_module_level_deferred_and_submodule_imports() -> None:
    # registry: `from gpuopt.engines._lifecycle import run_measured` inside run_trial.
    registry = {(i.target, i.deferred) for i in imports_of("gpuopt.engines.registry")}
    assert ("gpuopt.engines._lifecycle", True) in registry
    # ... but not its `if TYPE_CHECKING:` imports.
    assert not any(i.target == "gpuopt.core.result" for i in imports_of("gpuopt.engines.registry"))
    # `from gpuopt.trial import policies` (a submodule) and `from gpuopt.trial.measure import X` (names).
    native = {i.target for i in imports_of("gpuopt.engines.native") if not i.deferred}
    assert {"gpuopt.trial.policies", "gpuopt.trial.measure", "torch"} <= native
    assert folder("gpuopt.core.spec") == "core" and folder("gpuopt.run") is None
    assert folder("gpuopt.sweeper.confirm.rounds") == "sweeper" and folder("gpuopt.core") == "core"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_among_gpuopt_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def floors(graph: dict[str, set[str]], within: str) -> dict[str, int]:
    """Each module of `within`'s floor: 1 when it imports none of `within`'s modules, else one
    more than the highest it imports (the graph is acyclic: the test above)."""
    inside = {m for m in graph if m.startswith(within + ".")}
    found: dict[str, int] = {}

    def floor(module: str) -> int:
        if module not in found:
            found[module] = 1 + max((floor(m) for m in graph[module] & inside), default=0)
        return found[module]

    return {module: floor(module) for module in sorted(inside)}


def test_the_floor_rule_counts_the_longest_chain_inside_the_folder() -> None:
    graph = {"p.a": {"p.b", "x.y"}, "p.b": {"p.c"}, "p.c": set(), "p.d": {"p.c"}, "x.y": set()}
    assert floors(graph, "p") == {"p.a": 3, "p.b": 2, "p.c": 1, "p.d": 2}


def test_the_sweeper_has_at_most_max_floors() -> None:
    found = floors(import_graph(), "gpuopt.sweeper")
    top = max(found.values())
    assert top <= MAX_FLOORS, f"sweeper/ has {top} floors: " + ", ".join(
        f"{m} {f}" for m, f in found.items() if f > MAX_FLOORS - 2
    )


def test_core_imports_no_other_gpuopt_package() -> None:
    for module in sorted(m for m in modules() if folder(m) == "core"):
        others = sorted({i.target for i in gpuopt_imports(module) if folder(i.target) != "core"})
        assert not others, f"{module} imports {others}"


def test_torch_free_folders_import_no_torch_side_module_not_even_deferred() -> None:
    for module in sorted(m for m in modules() if folder(m) in TORCH_FREE):
        bad = sorted(
            {
                f"{i.target}:{i.line}"
                for i in imports_of(module)
                if i.target == "torch"
                or folder(i.target) in TORCH_SIDE
                or i.target in TORCH_SIDE_MODULES
            }
        )
        assert not bad, f"{module} (torch-free) imports {bad}"


def test_the_study_format_is_read_by_sweeper_and_report_which_import_neither_each_other() -> None:
    allowed = {"study": {"core", "study"}, "sweeper": {"core", "study", "sweeper"}}
    allowed["report"] = {"core", "study", "report"}
    for module in sorted(m for m in modules() if folder(m) in allowed):
        used = {folder(i.target) for i in gpuopt_imports(module)} - {None}
        assert used <= allowed[folder(module)], (
            f"{module} imports {sorted(used - allowed[folder(module)])}"
        )
        top = {i.target for i in gpuopt_imports(module) if folder(i.target) is None}
        assert top <= {"gpuopt"}, f"{module} imports top-level modules {sorted(top)}"


def test_no_module_longer_than_the_limit() -> None:
    long = {
        m: n
        for m, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_engines_are_peers_that_share_only_private_building_blocks() -> None:
    """native, user_step and lightning/ never import each other: each may use the private `_x`
    modules of engines/ (and lightning/ its own modules), and the registry imports none of them."""
    engine_modules = {m for m in modules() if m.startswith("gpuopt.engines.")}
    assert {"gpuopt.engines.native", "gpuopt.engines.lightning.engine"} <= engine_modules
    for module in sorted(engine_modules):
        used = {i.target for i in imports_of(module) if i.target.startswith("gpuopt.engines.")}
        own = "gpuopt.engines.lightning." if module.startswith("gpuopt.engines.lightning.") else "-"
        peers = {
            t for t in used if not t.rpartition(".")[2].startswith("_") and not t.startswith(own)
        }
        assert not peers, f"{module} imports {sorted(peers)}"


def test_trial_is_a_layer_under_the_engines() -> None:
    """trial/ (devices, policies, the window, monitors, profiles, the guard's decisions) is what an
    engine calls; it never imports engines/, not even deferred. The processes that drive engines
    (the shared measuring process, the memory probe) live in processes/, above both."""
    for module in sorted(m for m in modules() if folder(m) == "trial"):
        bad = sorted(
            {
                f"{i.target}:{i.line}"
                for i in gpuopt_imports(module)
                if folder(i.target) in ("engines", "processes")
            }
        )
        assert not bad, f"{module} reaches up into {bad}"


def test_no_module_file_name_is_repeated_across_folders() -> None:
    """Each module is named by what it holds: two `export.py` in two folders read as one thing."""
    seen: dict[str, list[str]] = {}
    for module, path in modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            seen.setdefault(path.name, []).append(module)
    repeated = {name: found for name, found in seen.items() if len(found) > 1}
    assert not repeated, f"file names used in more than one folder: {repeated}"


def test_registry_knows_exactly_the_engines_validation_accepts() -> None:
    from gpuopt.core.spec import ENGINES as VALID_NAMES
    from gpuopt.engines.registry import ENGINES

    assert tuple(ENGINES) == VALID_NAMES
    assert all(entry.module in modules() for entry in ENGINES.values())


def _module_level_torch_chain(module: str, graph: dict[str, set[str]]) -> list[str] | None:
    """[module, ..., the one importing torch] through module-level gpuopt imports, or None."""
    seen, stack = {module}, [[module]]
    while stack:
        chain = stack.pop()
        if any(i.target == "torch" and not i.deferred for i in imports_of(chain[-1])):
            return chain
        for nxt in sorted(graph[chain[-1]] - seen):
            seen.add(nxt)
            stack.append([*chain, nxt])
    return None


# The one timed-window state machine (issue 40): every engine pushes its loop's events into it.
WINDOW_METER = "gpuopt.engines._meter"
# What drives a window: only the meter calls these (trial.measure defines them; _distributed wraps
# a clock and a rule for ranks).
WINDOW_DRIVERS = ("make_clock", "StopRule", "from_measure", "next_stop_check")


def named_calls(source: str, names: tuple[str, ...]) -> list[tuple[int, str, ast.Call]]:
    """(line, name, call) of each call of a function or method named in `names` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in names:
                found.append((node.lineno, name, node))
    return found


def calls_outside(find, allowed: set[str]) -> dict[str, str]:
    """{"module:line": name} of every call `find(source)` finds in a module not in `allowed`: the
    shape of the "one of each" rules below."""
    return {
        f"{module}:{line}": name
        for module in sorted(set(modules()) - allowed)
        for line, name in find(modules()[module].read_text())
    }


def window_driver_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each call of a WINDOW_DRIVERS function or method in `source`."""
    return [(line, name) for line, name, _ in named_calls(source, WINDOW_DRIVERS)]


def test_the_window_rule_sees_a_clock_or_rule_driven_by_hand() -> None:
    calls = window_driver_calls(
        "clock, rule = ranks.align(make_clock(d), StopRule.from_measure(m))"
    )
    assert sorted(name for _, name in calls) == ["from_measure", "make_clock"]
    assert [n for _, n in window_driver_calls("x = next_stop_check(5)")] == ["next_stop_check"]
    assert window_driver_calls("rule: StopRule = make") == []  # a name, not a call


def test_one_window_state_machine_every_engine_feeds() -> None:
    """Clocks, the stop rule and its schedule are driven by gpuopt.engines._meter alone: a second
    copy of the window (three existed: the native loop's, a hook meter's, Lightning's) cannot grow
    back unseen. trial.measure defines them; _distributed wraps them for ranks."""
    allowed = {WINDOW_METER, "gpuopt.trial.measure", "gpuopt.engines._distributed"}
    calls = calls_outside(window_driver_calls, allowed)
    assert not calls, f"a window driven outside {WINDOW_METER}: {calls}"
    assert window_driver_calls(modules()[WINDOW_METER].read_text())


# The one module that writes the study (issue 40): Optuna's write calls, by method name. The
# adapters of Optuna's internals (_compat) and of its storages (study.storage) implement them.
STUDY_WRITER = "gpuopt.sweeper.record"
STUDY_WRITES = (
    "tell",
    "report",
    "set_user_attr",
    "set_trial_user_attr",
    "set_study_user_attr",
    "set_trial_system_attr",
    "set_study_system_attr",
    "set_trial_state_values",
    "add_trial",
    "add_trials",
    "enqueue_trial",
    "set_metric_names",
)
STORAGE_ADAPTERS = {"gpuopt.core._compat", "gpuopt.study.storage"}


def study_write_calls(source: str) -> list[tuple[int, str]]:
    """(line, method) of each call of an Optuna write method in `source` (a `tell` with no
    argument is a file's position, not a study's)."""
    return [
        (line, name)
        for line, name, call in named_calls(source, STUDY_WRITES)
        if isinstance(call.func, ast.Attribute) and (name != "tell" or call.args or call.keywords)
    ]


def test_the_study_write_rule_sees_every_way_to_write() -> None:
    source = "study.tell(t, 1.0); f.tell(); storage.set_trial_user_attr(1, 'k', 2); x.ask()"
    assert [name for _, name in study_write_calls(source)] == ["tell", "set_trial_user_attr"]


def test_one_module_writes_the_study() -> None:
    """Every record users read (trials, their attrs, the study's attrs, the workers' claims) is
    written through gpuopt.sweeper.record: what is written, and that no secret is, is checked in
    one place; the comparison service and the confirmation's rounds cannot start writing unseen."""
    calls = calls_outside(study_write_calls, {STUDY_WRITER} | STORAGE_ADAPTERS)
    assert not calls, f"the study written outside {STUDY_WRITER}: {calls}"
    assert study_write_calls(modules()[STUDY_WRITER].read_text())


# The one comparison service (issue 40): the paired statistics are called from it alone (the
# confirmation's stored verdicts read through its `paired_speedup`), and it writes nothing.
COMPARISON = "gpuopt.sweeper.comparison"
PAIRED_STATS = ("speedup", "log_ratios", "stein_pairs", "mean_interval")


def test_one_comparison_service() -> None:
    """A paired ratio, its interval or a Stein count computed outside the comparison service
    would be a fifth way to compare (four existed: the race's screen, its whole trials, the two
    confirmations); the service and what calls it record nothing in the study themselves."""

    def paired_stats_calls(source: str) -> list[tuple[int, str]]:
        return [(line, name) for line, name, _ in named_calls(source, PAIRED_STATS)]

    calls = calls_outside(paired_stats_calls, {COMPARISON, "gpuopt.core.stats"})
    assert not calls, f"paired statistics outside {COMPARISON}: {calls}"
    graph = import_graph(include_deferred=True)
    for module in (COMPARISON, "gpuopt.sweeper.race.screen", "gpuopt.sweeper.confirm.verdicts"):
        assert STUDY_WRITER not in graph[module], f"{module} writes the study"


def test_torch_free_folders_do_not_import_torch_at_module_level() -> None:
    """The sweeping process never imports torch (seconds, and a CUDA context near the GPUs): also
    not through the gpuopt modules they import at module level."""
    graph = import_graph(include_deferred=False)
    for module in sorted(modules()):
        if folder(module) in TORCH_FREE:
            chain = _module_level_torch_chain(module, graph)
            assert chain is None, "torch at module level: " + " -> ".join([*(chain or []), "torch"])


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualname, lines) of every function, nested ones included."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                found.append((name, node.end_lineno - node.lineno + 1))
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


@cache
def function_lengths() -> dict[str, int]:
    return {
        f"{module}:{name}": lines
        for module, path in modules().items()
        for name, lines in _functions(ast.parse(path.read_text()))
    }


def test_no_function_longer_than_the_limit() -> None:
    long = {
        name: lines
        for name, lines in function_lengths().items()
        if lines > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS_ALLOWED
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_long_function_allowances_are_still_needed() -> None:
    """Every allowance names a function that exists and is still over the limit (an empty set
    passes: nothing is allowed)."""
    lengths = function_lengths()
    stale = sorted(n for n in LONG_FUNCTIONS_ALLOWED if lengths.get(n, 0) <= MAX_FUNCTION_LINES)
    assert not stale, f"drop these from LONG_FUNCTIONS_ALLOWED: {stale}"


# The two catalogues (docs/architecture.md, "Where to make a change"): every table of metric
# names or knob keys derives from them, so a literal one elsewhere is a parallel table regrowing.
CATALOGUES = ("gpuopt.core.metrics", "gpuopt.core.knobs")
TABLE_MIN = 3  # names in one literal that make it a table
# How a trial is measured, not a knob of what it trains (the confirmation's lean overrides).
NOT_KNOBS = ("measure.", "profile.")


@cache
def catalogue_terms() -> tuple[frozenset[str], frozenset[str]]:
    """(metric names, knob keys: a key, or a group's prefix ending in a dot)."""
    import dataclasses

    from gpuopt.core import knobs, metrics

    names = frozenset(f.name for f in dataclasses.fields(metrics.Metrics))
    keys = frozenset(k.key for k in knobs.KNOBS if not k.key.startswith(NOT_KNOBS))
    return names, keys


def is_catalogued(text: str) -> bool:
    """A metric name, or a knob key (also as an override: `loader.pin_memory=true`)."""
    names, keys = catalogue_terms()
    key = text.lstrip("+~").split("=", 1)[0]
    prefixes = tuple(k for k in keys if k.endswith("."))
    return key in names or key in keys or (key.startswith(prefixes) and key not in prefixes)


def literal_tables(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of each tuple, list, set or dict literal in `source` holding TABLE_MIN or
    more catalogued names among its elements (a dict: its keys)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = [key for key in node.keys if key is not None]
        else:
            continue
        texts = [e.value for e in elements if isinstance(e, ast.Constant)]
        hits = [text for text in texts if isinstance(text, str) and is_catalogued(text)]
        if len(hits) >= TABLE_MIN:
            found.append((node.lineno, hits))
    return found


def test_the_rule_sees_a_table_of_metric_names_or_knob_keys() -> None:
    assert is_catalogued("step_time_ms") and is_catalogued("loader.pin_memory=true")
    assert is_catalogued("model.channels_last") and is_catalogued("loader.prefetch_factor")
    assert not is_catalogued("measure.ceiling") and not is_catalogued("throughputs")
    table = ("throughput", "data_wait", "mfu")
    assert [hits for _, hits in literal_tables(repr(table))] == [list(table)]
    assert literal_tables("{'loader.num_workers': 1, 'device.num_threads': 2, 'x': 3}") == []
    assert literal_tables("f(throughput=1, data_wait=2, mfu=3)") == []  # names, not strings


def test_no_table_of_metric_names_or_knob_keys_outside_the_two_catalogues() -> None:
    tables = {
        f"{module}:{line}": hits
        for module in sorted(set(modules()) - set(CATALOGUES))
        for line, hits in literal_tables(modules()[module].read_text())
    }
    assert not tables, (
        "literal tables of metric names or knob keys (derive them from gpuopt.core.metrics / "
        f"gpuopt.core.knobs): {tables}"
    )


def test_no_module_compares_a_metric_name_to_step_time_ms() -> None:
    """Which way a metric is better is its goal in the catalogue (gpuopt.core.metrics: `goal`,
    `higher_is_better`). A comparison of a name with the literal "step_time_ms" (`metric !=
    "step_time_ms"`: lower is better) is that goal hard-coded again, which the race's ratios once
    did in three places; a metric added with goal "minimize" would be ranked backwards there."""
    found = [
        f"{module}:{node.lineno}"
        for module, path in sorted(modules().items())
        if module != "gpuopt.core.metrics"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        and any(
            isinstance(side, ast.Constant) and side.value == "step_time_ms"
            for side in (node.left, *node.comparators)
        )
    ]
    assert not found, f"compare with the metric's goal (core.metrics.higher_is_better): {found}"


def test_every_package_folder_ships_in_the_wheel() -> None:
    """pyproject's explicit `packages` list names every folder of gpuopt/ (a folder missing from it
    works in an editable install and is absent from a wheel: `pip install .` would break)."""
    import tomllib

    pyproject = tomllib.loads((PACKAGE_DIR.parent / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {_module_name(p) for p in PACKAGE_DIR.rglob("__init__.py")}
    assert folders - listed == set()
