"""Import layering of src/dpft (issue 46): back-arrows against DESIGN.md's layer order and import circles.

Counts every import: module level, inside functions, and ``importlib.import_module("dpft....")`` on a
string literal (an import by name still is an edge). Usage: ``python tests/layers.py [REPO_ROOT]``.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "dpft"

#: DESIGN.md "Layout", bottom up: a module may import only from its own floor or floors below it.
FLOORS: list[tuple[str, ...]] = [
    ("errors", "config"),
    ("accounting",),
    ("privacy",),
    ("grads",),
    ("data", "models"),
    ("step",),
    ("placement",),
    ("session",),
    ("methods",),
    ("outputs",),
    ("run", "api", "integrations"),
    ("audit", "cli"),
]
#: packages DESIGN.md does not place yet: their floor (closest to what they do)
EXTRA = {"transforms": "step", "optim": "step", "eval": "data", "selection": "methods", "synth": "methods",
         "__init__": "cli", "__main__": "cli"}


def floor_of(mod: str) -> int:
    top = mod.split(".")[1] if mod.count(".") >= 1 else "__init__"
    top = EXTRA.get(top, top)
    for i, names in enumerate(FLOORS):
        if top in names:
            return i
    raise KeyError(f"{mod}: package {top!r} has no floor in FLOORS")


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The dpft modules ``path`` imports, anywhere in it (resolved to the longest known module)."""
    tree = ast.parse(path.read_text())
    me = module_name(path)
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        if name and name != me:
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dpft"):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("dpft"):
                for a in node.names:
                    full = f"{base}.{a.name}"
                    add(full if full in modules else base)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("dpft"):
                add(node.args[0].value)
    # import by name on a computed argument (a registry of module names): every module-name string
    # literal in the file counts as an edge
    if any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"
           and n.args and not isinstance(n.args[0], ast.Constant) for n in ast.walk(tree)):
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in modules:
                add(n.value)
    return out


def graph() -> dict[str, set[str]]:
    files = sorted(SRC.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) for p in files}


def back_arrows(g: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, bs in g.items() for b in bs
                  if a.count(".") and b.count(".") and floor_of(b) > floor_of(a))


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    global SRC
    if len(sys.argv) > 1:  # another checkout's root
        SRC = Path(sys.argv[1]) / "src" / "dpft"
    g = graph()
    arrows = back_arrows(g)
    circ = cycles(g)
    lines = sum(len(p.read_text().splitlines()) for p in SRC.rglob("*.py"))
    audit = sum(len(p.read_text().splitlines()) for p in (SRC / "audit").rglob("*.py"))
    print(f"src/dpft: {len(g)} modules, {lines} lines (audit/ {audit})")
    print(f"back-arrows against the layer order: {len(arrows)}")
    for a, b in arrows:
        print(f"  {a} -> {b}")
    print(f"import circles: {len(circ)} (largest {max((len(c) for c in circ), default=0)} modules)")
    for c in circ:
        print(f"  [{len(c)}] " + ", ".join(c[:12]) + (" …" if len(c) > 12 else ""))


if __name__ == "__main__":
    main()
