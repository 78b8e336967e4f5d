"""The package's import graph has no circle: every `import` and `from ... import` of a commlib
module, at module level or inside a function, is an edge (a function-level import that closes a
circle is still a circle, only a hidden one)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# commlib's packages and where they live (pyproject maps the top-level folders under commlib.*)
PACKAGES = {"commlib": ROOT / "commlib", "commlib.backends": ROOT / "backends",
            "commlib.compressors": ROOT / "compressors", "commlib.switch": ROOT / "switch"}


def modules():
    found = {}
    for prefix, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            if "csrc" not in parts:
                found[".".join([prefix, *parts])] = path
    found["commlib._native"] = None   # the C data path (cffi): imports nothing of commlib's
    return found


def imports_of(name, path, known):
    """The commlib modules `name` imports (a name imported from a package counts as its module
    when it is one, else as the package)."""
    def module_of(dotted):
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {module_of(alias.name) for alias in node.names if alias.name.startswith("commlib")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{up}.{base}" if base else up
            if base.startswith("commlib"):
                found |= {module_of(f"{base}.{alias.name}") for alias in node.names}
    return found - {name, ""}


def circles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    known = modules()
    assert "commlib.runtime" in known and "commlib.backends.switchml" in known, sorted(known)[:10]
    graph = {name: imports_of(name, path, known) & set(known) if path else set() for name, path in known.items()}
    assert "commlib.runtime" in graph["commlib.api"], graph["commlib.api"]   # the walk sees edges
    assert circles(graph) == []


def test_the_walk_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
