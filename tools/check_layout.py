#!/usr/bin/env python3
"""Layout check of the project (run in its root): layering, import cycles, sizes.

The project's shared layout rules (DESIGN.md section 3), kept in the repository so that a
clone and CI check themselves (`make layout`).

- engine/ and substrate/ import nothing from talaria/, router/, workloads/; substrate nothing
  from engine/; router/ imports from talaria/ only talaria.protocol (or a protocol package);
  talaria/ imports router/ or workloads/ only from the CLI (composition root).
- no import cycle between modules, type-only imports included;
- no non-test module over 450 lines; engine/ has at most 16 top-level modules.
Prints the findings and 'layout: N problems'. Exit 0 only if none.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PKGS = ("engine", "substrate", "talaria", "router", "workloads")
ROOT = Path(".")


def module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, mod: str) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.add(name)
            for a in node.names:
                out.add(f"{name}.{a.name}")
    return {i for i in out if i.split(".")[0] in PKGS}


def main() -> int:
    files = [p for pkg in PKGS for p in (ROOT / pkg).rglob("*.py")]
    mods = {module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    problems: list[str] = []
    for mod, path in mods.items():
        deps = set()
        for imp in imports_of(path, mod):
            # resolve to the longest known module prefix
            parts = imp.split(".")
            for k in range(len(parts), 0, -1):
                cand = ".".join(parts[:k])
                if cand in mods:
                    deps.add(cand)
                    break
        deps.discard(mod)
        graph[mod] = deps
        top = mod.split(".")[0]
        for d in deps:
            dtop = d.split(".")[0]
            bad = None
            if top in ("engine", "substrate") and dtop in ("talaria", "router", "workloads"):
                bad = "the engine and the substrate import no layer above them"
            elif top == "substrate" and dtop == "engine":
                bad = "the substrate is the lowest layer"
            elif top == "router" and dtop == "engine":
                bad = "the router talks to instances, never to an engine"
            elif top == "router" and dtop == "talaria" and "protocol" not in d:
                bad = "the router imports only the protocol types from talaria"
            elif top == "talaria" and dtop in ("router", "workloads") and not (
                    mod.startswith("talaria.cli") or mod == "talaria.__main__"):
                bad = "only the composition root wires router and workloads"
            if bad:
                problems.append(f"{mod} -> {d}: {bad}")
        n = len(path.read_text().splitlines())
        if n > 450:
            problems.append(f"{path}: {n} lines")
    top_engine = [p for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py"]
    if len(top_engine) > 16:
        problems.append(f"engine/ has {len(top_engine)} top-level modules (at most 16)")
    # cycles (Tarjan)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    for comp in sccs:
        # a package importing its own submodules via __init__ re-exports is not a design cycle
        if all(c.split(".")[0] == comp[0].split(".")[0] for c in comp) and any(
                mods[c].name == "__init__.py" for c in comp) and len(comp) == 2:
            continue
        problems.append("import cycle: " + " <-> ".join(comp))
    for p in problems:
        print(p)
    print(f"layout: {len(problems)} problems")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
