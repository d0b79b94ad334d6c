"""dosa's import graph, function-level imports included: no module reaches itself again, and
no arrow runs upward between packages (pallas_kernels <- indexer <- model <- serving,
experiments; serving never imports experiments)."""

import ast
import importlib
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
RANK = {"pallas_kernels": 0, "indexer": 1, "model": 2, "serving": 3, "experiments": 3}


def module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {module_name(p): p for package in RANK for p in (ROOT / package).rglob("*.py")}


def resolve(name, known):
    """The dosa module an imported dotted name lands in (a package's lazily exported names
    resolved to the module that defines them), or None outside dosa."""
    if name in known:
        return name
    head, _, attr = name.rpartition(".")
    if head in known:
        exports = getattr(importlib.import_module(head), "_MODULE_OF", {})
        return exports.get(attr, head)
    return None


def import_graph():
    known = modules()
    graph = {name: set() for name in known}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                dst = resolve(target, known)
                if dst is not None and dst != name:
                    graph[name].add(dst)
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_upward_import_between_packages():
    upward = [(src, dst) for src, dsts in import_graph().items() for dst in dsts
              if RANK[dst.split(".")[0]] > RANK[src.split(".")[0]]
              or (src.startswith("serving") and dst.startswith("experiments"))]
    assert upward == []


def test_the_walk_sees_function_level_imports():
    """The graph is not vacuous: model.dsa_presets imports the checkpoint loader inside a
    function, and that arrow is in it."""
    graph = import_graph()
    assert "model.pretrained.safetensors_dir" in graph["model.dsa_presets"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


# Optional imports whose distribution may be absent here (an extra not installed).
NOT_INSTALLED = {"llama_cpp": "llama-cpp-python"}


def _requirement_name(spec):
    import re

    return re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_every_third_party_import_is_declared():
    """What the installed packages import from outside dosa and the standard library comes
    from a distribution pyproject.toml names (a dependency or an extra), and nothing of them
    imports torch (the fixture generators that need it live under tests/)."""
    import importlib.metadata
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_requirement_name(s) for s in project["dependencies"]}
    declared |= {_requirement_name(s) for extra in project["optional-dependencies"].values()
                 for s in extra}
    distributions = importlib.metadata.packages_distributions()
    missing, torch = {}, []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops = [node.module.split(".")[0]]
            else:
                continue
            for top in tops:
                if top in RANK or top in sys.stdlib_module_names:
                    continue
                if top == "torch":
                    torch.append(name)
                dists = {d.lower().replace("_", "-")
                         for d in distributions.get(top, [NOT_INSTALLED.get(top, top)])}
                if not dists & declared:
                    missing.setdefault(top, set()).add(name)
    assert not torch, f"modules of the installed packages import torch: {torch}"
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
