"""The package's imports form no circle: every import of `methods/`, `harness/`, `hydra_plugins/`, `data_scripts/` and
`scripts/` (at any level, those inside functions included) read with `ast`, the module graph built, and each circle
printed with the file and line of every edge. An import inside a function is there only to put off a heavy or optional
dependency, and says which (`# lazy: ...` on its line or above it)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("methods", "harness", "hydra_plugins", "data_scripts", "scripts")

def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def imported(node: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The project's modules an import statement names (a `from X import y` names X.y where that is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin for alias in node.names]
    found = []
    for name in names:  # `import a.b.c` names a.b.c, or its nearest enclosing module of the project
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}}, the project's modules only."""
    modules = module_files()
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(node, module, path.name == "__init__.py", modules):
                    if target != module:
                        edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    files = module_files()
    edges = [f"    {files[a].relative_to(REPO)}:{graph[a][b]} imports {b}"
             for a in component for b in sorted(graph[a]) if b in component]
    return " <-> ".join(component) + "\n" + "\n".join(edges)


def test_no_import_circle():
    graph = import_graph()
    standing = circles(graph)
    assert not standing, "import circles:\n" + "\n".join(describe(c, graph) for c in standing)


def test_the_graph_reads_imports_inside_functions():
    graph = import_graph()
    assert "harness.running.run" in graph["harness.reporting.headline"]  # imported inside a function there
    assert graph["harness.training.__main__"]  # relative imports resolve


def function_imports():
    """(file, line number, the project's module or the package imported, whether a `# lazy:` comment says why)."""
    modules = module_files()
    for module, path in modules.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    first = node.lineno - 1  # the comment may stand above a run of imports
                    while first > 0 and lines[first - 1].strip().startswith(("from ", "import ", "# lazy:")):
                        first -= 1
                    said = any("# lazy:" in line for line in lines[first:node.end_lineno])
                    names = imported(node, module, path.name == "__init__.py", modules) or [
                        node.names[0].name if isinstance(node, ast.Import) else node.module or ""]
                    yield str(path.relative_to(REPO)), node.lineno, names[0], said


def test_imports_inside_functions_say_what_they_put_off():
    unsaid = [f"{file}:{line} imports {name}" for file, line, name, said in function_imports()
              if not said]
    assert not unsaid, "imports inside functions without `# lazy: <the heavy or optional dependency>`:\n" + "\n".join(
        unsaid
    )


def test_no_function_is_longer_than_80_lines():
    """A function that does not fit on a screen is split into named steps."""
    long = []
    for folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > 80:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert not long, "functions over 80 lines: " + ", ".join(long)


def folder_of(module: str) -> str:
    """The folder a module lives in (a package's `__init__` lives in its own folder)."""
    return module if (REPO.joinpath(*module.split(".")) / "__init__.py").is_file() else module.rpartition(".")[0]


def folder_ties(graph: dict[str, dict[str, int]]) -> list[str]:
    """Each pair of folders of `methods/` or `harness/` that import each other, with one edge each way."""
    edges: dict[tuple[str, str], str] = {}
    files = module_files()
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = folder_of(module), folder_of(target)
            if a != b and a.split(".")[0] == b.split(".")[0] in ("methods", "harness"):
                edges.setdefault((a, b), f"{files[module].relative_to(REPO)}:{line} imports {target}")
    return [f"{a} <-> {b}: {edges[a, b]}; {edges[b, a]}" for a, b in sorted(edges) if a < b and (b, a) in edges]


def test_no_two_folders_import_each_other():
    """Folders of `methods/` and `harness/` form layers: `machine/` measures the `engine/`, never the other way;
    `harness/` folders call down, not across and back."""
    ties = folder_ties(import_graph())
    assert not ties, "folders that import each other:\n  " + "\n  ".join(ties)


def test_the_folder_check_sees_a_tie():
    back = {"methods.engine.native": {"methods.machine.identity": 43}}
    down = {"methods.machine.profile": {"methods.engine": 36}}
    assert folder_ties(back | down) and not folder_ties(down)


def test_methods_import_nothing_of_the_harness():
    """`harness → methods` is one-way: a method, its engine and its models stand without the harness."""
    back = [f"{module_files()[m].relative_to(REPO)}:{line} imports {t}" for m, targets in import_graph().items()
            if m.startswith("methods") for t, line in targets.items() if t.startswith(("harness", "hydra_plugins"))]
    assert not back, "methods/ importing the harness:\n  " + "\n  ".join(back)


def with_tests() -> dict[str, Path]:
    """The project's modules and the tests' (the tests go through public names too)."""
    return {**module_files(), **{module_name(path): path for path in sorted((REPO / "tests").glob("*.py"))}}


def test_no_module_imports_another_modules_private_name():
    """A name that starts with `_` is its module's own: another module (a test included) that needs it
    gets a public name."""
    found = []
    modules = module_files()
    for module, path in with_tests().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                targets = imported(node, module, path.name == "__init__.py", modules)  # the project's modules only
                if private and targets and targets != [module]:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {', '.join(private)}")
    assert not found, "private names imported from another module:\n  " + "\n  ".join(found)


def private_members() -> dict[str, set[str]]:
    """{`_name`: the project modules whose classes define a method or attribute of that name}."""
    found: dict[str, set[str]] = {}
    for module, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    names = [item.name] if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
                        t.attr for t in getattr(item, "targets", [getattr(item, "target", None)])
                        if isinstance(t, ast.Attribute)]
                    for name in names:
                        if name.startswith("_") and not name.startswith("__"):
                            found.setdefault(name, set()).add(module)
    return found


def test_no_module_reaches_into_another_modules_private_members():
    """`obj._name` where `_name` belongs to a class of another module of the project: that class offers a public
    name for it instead (to the tests too)."""
    members = private_members()
    found = []
    for module, path in with_tests().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in members and module not in members[node.attr] \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                owners = ", ".join(sorted(members[node.attr]))
                found.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr} ({owners})")
    assert not found, "private members used from another module:\n  " + "\n  ".join(found)
