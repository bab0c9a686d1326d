"""The package-level import graph of testbed, drawn from the source (nothing is imported).

Every `import` and `from ... import` statement that runs counts, at module level or inside a
function (a lazy import up the layers is still an arrow up); an `if TYPE_CHECKING:` block, which
only names a type for annotations and loads nothing, is left out unless --type-checking is given
(as import-linter does with exclude_type_checking_imports).
A "package" is a direct child of testbed: a subpackage (testbed.cluster) or a top-level
module (testbed.config); analysis/ counts as one, and a package's __main__ (python -m
testbed.interop) as an entry point of its own, as the import contracts have it. Prints the edges, the package
cycles (strongly connected components
of more than one package), and the depth (the number of layers in the longest path of the
condensed graph).

    python scripts/import_graph.py            # summary: packages, edges, cycles, depth
    python scripts/import_graph.py --edges    # also every package edge with one example import
    python scripts/import_graph.py --modules  # cycles at module level too
    python scripts/import_graph.py --type-checking  # count `if TYPE_CHECKING:` imports too
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("testbed", "analysis")  # analysis/ sits beside testbed/ and counts as one package of it


def module_names(root: Path = ROOT, tops: tuple[str, ...] = TOPS) -> dict[str, Path]:
    """Every module under `tops`, by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted(p for top in tops for p in (root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`) blocks."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def imports_of(name: str, path: Path, modules: dict[str, Path], type_checking: bool = False) -> list[tuple[str, int]]:
    """The testbed modules `name` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if type_checking else _type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from a import b` imports a.b when b is a module, else a
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target:
                found.append((target, node.lineno))
    return found


def package_of(module: str) -> str:
    """testbed.X for a module under testbed/X (or testbed/X.py), the top package otherwise; a package's
    __main__ (python -m testbed.interop) is an entry point, a node of its own on top."""
    parts = module.split(".")
    if parts[-1] == "__main__" and len(parts) > 2:
        return module
    if parts[0] != "testbed":
        return parts[0]
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def module_graph(root: Path = ROOT, type_checking: bool = False) -> dict[str, dict[str, tuple[Path, int]]]:
    modules = module_names(root)
    graph: dict[str, dict[str, tuple[Path, int]]] = {m: {} for m in modules}
    for name, path in modules.items():
        for target, line in imports_of(name, path, modules, type_checking):
            if target != name:
                graph[name].setdefault(target, (path, line))
    return graph


def package_graph(graph) -> dict[str, dict[str, str]]:
    """Package -> package -> one example 'file:line' (the root package `testbed` itself is left out:
    its __init__ imports nothing the layers care about, and every module's parent is it)."""
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for source, targets in graph.items():
        a = package_of(source)
        if a == "testbed":
            continue
        out.setdefault(a, {})
        for target, (path, line) in targets.items():
            b = package_of(target)
            if b != a and b != "testbed":
                out[a].setdefault(b, f"{path.relative_to(ROOT)}:{line}")
    return dict(out)


def components(graph: dict[str, dict]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        comp.append(member)
                        if member == node:
                            break
                    out.append(sorted(comp))
    return out


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    return sorted((c for c in components(graph) if len(c) > 1), key=lambda c: (-len(c), c))


def simple_cycles_2(graph: dict[str, dict]) -> list[tuple[str, str]]:
    """Pairs that import each other directly."""
    return sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, {}))


def depth(graph: dict[str, dict]) -> tuple[int, list[str]]:
    """Layers in the longest path of the condensed graph (a cycle counts as one layer), and that path."""
    comps = components(graph)
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    memo: dict[int, list[int]] = {}

    def longest(i: int) -> list[int]:  # Tarjan emits components in reverse topological order
        if i not in memo:
            below = {comp_of[t] for n in comps[i] for t in graph.get(n, ())} - {i}
            memo[i] = [i] + max((longest(j) for j in sorted(below)), key=len, default=[])
        return memo[i]

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    best = max((longest(i) for i in range(len(comps))), key=len, default=[])
    return len(best), ["+".join(comps[i]) for i in best]


def longest_simple_path(graph: dict[str, dict]) -> list[str]:
    """The longest chain of packages that visits none twice (exhaustive search: fine for ~25 nodes
    when the graph is nearly a DAG, bounded by a step budget otherwise)."""
    best: list[str] = []
    budget = [2_000_000]

    def walk(path: list[str], seen: set[str]) -> None:
        nonlocal best
        budget[0] -= 1
        if budget[0] < 0:
            return
        if len(path) > len(best):
            best = list(path)
        for child in sorted(graph.get(path[-1], ())):
            if child not in seen:
                seen.add(child)
                path.append(child)
                walk(path, seen)
                path.pop()
                seen.discard(child)

    for start in sorted(graph):
        walk([start], {start})
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", action="store_true", help="print every package edge with one example")
    parser.add_argument("--modules", action="store_true", help="also the module-level cycles")
    parser.add_argument("--type-checking", action="store_true", help="count `if TYPE_CHECKING:` imports too")
    args = parser.parse_args(argv)
    mods = module_graph(type_checking=args.type_checking)
    pkgs = package_graph(mods)
    if args.edges:
        for a in sorted(pkgs):
            for b, where in sorted(pkgs[a].items()):
                print(f"{a} -> {b}    ({where})")
        print()
    found = cycles(pkgs)
    n_depth, path = depth(pkgs)
    print(f"packages: {len(pkgs)}  edges: {sum(len(t) for t in pkgs.values())}")
    print(f"package cycles (strongly connected components): {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    pairs = simple_cycles_2(pkgs)
    print(f"package pairs that import each other: {len(pairs)}")
    for a, b in pairs:
        print(f"  {a} <-> {b}    ({pkgs[a][b]}; {pkgs[b][a]})")
    print(f"depth (layers in the longest chain, a cycle as one layer): {n_depth}")
    print("  " + " -> ".join(path))
    chain = longest_simple_path(pkgs)
    print(f"longest chain of distinct packages (a cycle unrolled): {len(chain)}")
    print("  " + " -> ".join(chain))
    if args.modules:
        mc = cycles(mods)
        print(f"module cycles: {len(mc)}")
        for c in mc:
            print("  " + " <-> ".join(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
