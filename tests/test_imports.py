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
    """A function that does not fit on a screen is split into named steps (issue 47)."""
    long = []
    for folder in PACKAGES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > 80:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    assert not long, "functions over 80 lines: " + ", ".join(long)
