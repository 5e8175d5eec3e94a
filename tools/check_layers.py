"""Check ferro's layering: in an installed venv, or statically in the source tree.

Usage:
  python check_layers.py EXPECTED_DISTS ALL_DISTS   (comma-separated distribution names)
      The venv holds exactly EXPECTED_DISTS of ALL_DISTS and each of them imports: a user who
      installs one distribution gets its layers and nothing above them (the tests(...) sessions).
  python check_layers.py --static [ROOT]            (ROOT: the repository root by default)
      Reads packages/*/src with ``ast`` (imports nothing) and prints one line per finding:
        - an upward import: a module of distribution D imports a ferro distribution that is not
          one of D's layers (``PACKAGES`` in ROOT/noxfile.py, read by parsing, not importing;
          an import under ``if TYPE_CHECKING:`` counts here, marked as such; a distribution
          D names in its optional dependencies, an extra, is an optional layer of D's);
        - an import cycle between the modules of one distribution (imports inside functions
          count, imports under ``if TYPE_CHECKING:`` do not; .pyx/.pxd modules count, with the
          imports of the .pxi files they ``include``);
        - a call from compiled code up into Python: a Python module that hands a callable to a
          compiled module (.pyx) of its own distribution (``_x.set_general(f)``,
          ``_x.register(f)``, ``_x.add_hook(f)``...), which the compiled code would then call
          back: what compiled code runs, it imports from below;
        - a source file (.py .pyx .pxi .pxd .h .c.in) over 500 lines, a Python module's
          docstrings not counted (documenting every public name never makes a module two);
          one over 360 lines is reported as a smell to look at (cohesion decides where a file
          splits, not a count), which does not fail the check.
      Then a summary line; exit status 1 if anything but a smell was found.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import io
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMELL_LINES = 360  # reported, to look at
MAX_LINES = 500  # fails
SIZED_SUFFIXES = (".py", ".pyx", ".pxi", ".pxd", ".h", ".c.in")
MODULE_SUFFIXES = (".py", ".pyx", ".pxd")  # files that are (or declare) an importable module
CYTHON_SUFFIXES = (".pyx", ".pxd", ".pxi")
_FROM = re.compile(r"^from\s+([\w.\s]+?)\s+c?import\s+(.+)$")
_IMPORT = re.compile(r"^c?import\s+(.+)$")
_INCLUDE = re.compile(r"""^include\s+(['"])(.+)\1$""")


@dataclass(frozen=True)
class RawImport:
    """One import statement (a plain ``import a.b`` per name), as written."""

    path: Path
    line: int
    level: int  # 0: absolute; n: n leading dots
    module: str  # "" for ``from . import x``
    names: tuple[str, ...]  # what ``from ... import`` takes; () for a plain import
    type_checking: bool = False


@dataclass
class Module:
    name: str  # dotted, e.g. ferro_backend.base (a package's __init__ is the package's name)
    dist: str
    is_package: bool
    imports: list[RawImport]
    compiled: bool = False  # a .pyx is (part of) it


def read_layers(root: Path) -> dict[str, list[str]]:
    """``PACKAGES`` (dist -> its local layers) from ROOT/noxfile.py, by parsing it."""
    tree = ast.parse((root / "noxfile.py").read_text(), "noxfile.py")
    for node in tree.body:
        target: ast.expr | None = None
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if isinstance(target, ast.Name) and target.id == "PACKAGES":
            return {str(k): [str(d) for d in v] for k, v in ast.literal_eval(value).items()}
    raise SystemExit(f"check_layers: no PACKAGES table in {root / 'noxfile.py'}")


def python_imports(path: Path, source: str) -> list[RawImport]:
    """Every import in a Python file, at any depth, marking those under ``if TYPE_CHECKING:``."""
    found: list[RawImport] = []

    def walk(nodes: list[ast.AST], tc: bool) -> None:
        for node in nodes:
            # ``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``: its body never runs
            if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
                walk(list(node.body), True)
                walk(list(node.orelse), tc)
                continue
            if isinstance(node, ast.Import):
                found.extend(RawImport(path, node.lineno, 0, a.name, (), tc) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                names = tuple(a.name for a in node.names)
                found.append(RawImport(path, node.lineno, node.level, node.module or "", names, tc))
            walk(list(ast.iter_child_nodes(node)), tc)

    walk(list(ast.parse(source, str(path)).body), False)
    return found


def _logical_lines(source: str) -> list[tuple[int, str]]:
    """(first line, tokens joined by spaces) per logical line: strings and comments stay whole
    tokens, so a docstring never reads as an import. Cython tokenizes as Python does."""
    lines: list[tuple[int, str]] = []
    tokens: list[str] = []
    start = 0
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if tokens:
                lines.append((start, " ".join(tokens)))
            tokens = []
        elif tok.type not in skip:
            start = start if tokens else tok.start[0]
            tokens.append(tok.string)
    return lines


def cython_imports(path: Path, source: str) -> tuple[list[RawImport], list[str]]:
    """A Cython file's ``import``/``cimport`` statements (at any depth) and ``include`` targets."""
    found: list[RawImport] = []
    includes: list[str] = []
    for line, text in _logical_lines(source):
        if m := _INCLUDE.match(text):
            includes.append(m.group(2))
        elif m := _FROM.match(text):
            dotted = m.group(1).replace(" ", "")
            module = dotted.lstrip(".")
            names = [n.split()[0] for n in m.group(2).strip("() ").split(",") if n.strip()]
            found.append(RawImport(path, line, len(dotted) - len(module), module, tuple(names)))
        elif m := _IMPORT.match(text):
            for part in m.group(1).split(","):
                name = part.split(" as ")[0].replace(" ", "")
                found.append(RawImport(path, line, 0, name, ()))
    return found, includes


def sized_lines(path: Path) -> int:
    """``path``'s lines, a Python module's docstrings (module, class and function) left out."""
    text = path.read_text(errors="replace")
    lines = len(text.splitlines())
    if path.suffix != ".py":
        return lines
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return lines
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            doc = node.body[0]
            lines -= doc.end_lineno - doc.lineno + 1
    return lines


def source_files(root: Path, dist: str) -> list[Path]:
    src = root / "packages" / dist / "src"
    return sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(SIZED_SUFFIXES))


def resolve(imp: RawImport, mod: Module) -> str | None:
    """The absolute dotted name ``imp`` imports (from), seen from module ``mod``."""
    if imp.level == 0:
        return imp.module
    package = mod.name.split(".") if mod.is_package else mod.name.split(".")[:-1]
    if imp.level - 1 >= len(package):
        return None  # above the top-level package
    base = package[: len(package) - (imp.level - 1)]
    return ".".join(base + [imp.module] if imp.module else base)


def targets(imp: RawImport, mod: Module, modules: dict[str, Module]) -> list[str]:
    """The modules of the tree ``imp`` makes ``mod`` import: ``from P import x`` imports the
    submodule P.x where there is one, else P itself (its __init__ where P is a package);
    ``import a.b`` imports a.b (the longest prefix of the name that is a module here). Either
    runs the __init__ of every package on the way first (``from .engine import _ring`` runs
    engine/__init__.py), except the packages ``mod`` itself is in, which have begun already."""
    base = resolve(imp, mod)
    parts = base.split(".") if base else []
    prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
    hit = next((p for p in prefixes if p in modules), None)
    subs = [f"{base}.{name}" for name in imp.names]
    out = [sub if sub in modules else hit for sub in subs] if imp.names else [hit]
    own = mod.name.split(".")
    own_packages = {".".join(own[:n]) for n in range(1, len(own) + (1 if mod.is_package else 0))}
    out += [p for p in prefixes if p in modules and modules[p].is_package and p not in own_packages]
    return sorted({t for t in out if t is not None})


def load_modules(root: Path, layers: dict[str, list[str]]) -> tuple[dict[str, Module], list[str]]:
    """Every module of every distribution, with its imports (and its included .pxi files')."""
    modules: dict[str, Module] = {}
    problems: list[str] = []
    for dist in layers:
        for path in source_files(root, dist):
            if path.suffix not in MODULE_SUFFIXES:
                continue
            rel = path.relative_to(root / "packages" / dist / "src").with_suffix("")
            is_package = rel.name == "__init__"
            name = ".".join(rel.parts[:-1] if is_package else rel.parts)
            try:
                imports = file_imports(path)
            except (SyntaxError, ValueError, OSError, tokenize.TokenError) as exc:
                problems.append(f"{path.relative_to(root)}: cannot read its imports: {exc}")
                continue
            # a .pxd's cimports join those of its .pyx: one module
            module = modules.setdefault(name, Module(name, dist, is_package, []))
            module.imports.extend(imports)
            module.compiled |= path.suffix == ".pyx"
    return modules, problems


def file_imports(path: Path, seen: frozenset[Path] = frozenset()) -> list[RawImport]:
    """The imports of one source file, plus those of the .pxi files it includes (recursively)."""
    source = path.read_text()
    if not path.name.endswith(CYTHON_SUFFIXES):
        return python_imports(path, source)
    found, includes = cython_imports(path, source)
    for inc in includes:
        target = (path.parent / inc).resolve()
        if target.is_file() and target not in seen:
            found.extend(file_imports(target, seen | {target}))
    return found


def optional_layers(root: Path, dist: str, layers: dict[str, list[str]]) -> set[str]:
    """The ferro distributions ``dist`` names in its optional dependencies (an extra such as
    ferro-checkpoint's ``backend``): it may use them where they are installed."""
    import tomllib

    pyproject = root / "packages" / dist / "pyproject.toml"
    if not pyproject.is_file():
        return set()
    extras = tomllib.loads(pyproject.read_text()).get("project", {}).get(
        "optional-dependencies", {})
    named = {re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0] for reqs in extras.values()
             for req in reqs}
    return named & set(layers)


def upward_imports(root: Path, layers: dict[str, list[str]], modules: dict[str, Module]) -> list[str]:
    """One line per import of a ferro distribution that is neither a layer of the importer's
    nor one of its optional layers (:func:`optional_layers`)."""
    owner = {dist.replace("-", "_"): dist for dist in layers}  # the noxfile's IMPORT_NAMES
    owner.update({name.split(".")[0]: mod.dist for name, mod in modules.items()})
    optional = {dist: optional_layers(root, dist, layers) for dist in layers}
    lines: set[str] = set()  # a set: a .pxi included by two modules is reported once
    for mod in modules.values():
        for imp in mod.imports:
            dist = owner.get(imp.module.split(".")[0]) if imp.level == 0 else None
            if dist is None or dist == mod.dist or dist in layers[mod.dist] \
                    or dist in optional.get(mod.dist, ()):
                continue
            allowed = ", ".join(layers[mod.dist]) or "none"
            tc = " (under TYPE_CHECKING)" if imp.type_checking else ""
            lines.add(f"{imp.path.relative_to(root)}:{imp.line}: upward import: {mod.dist} imports "
                      f"{imp.module} ({dist}){tc}; the layers of {mod.dist}: {allowed}")
    return sorted(lines)


Graph = dict[str, dict[str, list[RawImport]]]


def import_graph(modules: dict[str, Module]) -> Graph:
    """module -> {module of the same distribution it imports -> the imports doing so}."""
    graph: Graph = {name: {} for name in modules}
    for name, mod in modules.items():
        for imp in mod.imports:
            if imp.type_checking:
                continue
            for target in targets(imp, mod, modules):
                if target != name and modules[target].dist == mod.dist:
                    graph[name].setdefault(target, []).append(imp)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The import cycles, each as the group of modules that reach one another through imports
    (a strongly connected component): breaking the cycle means removing imports inside it."""

    def reachable(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            new = set(graph[todo.pop()]) - seen
            seen |= new
            todo.extend(new)
        return seen

    reach = {name: reachable(name) for name in graph}
    groups: list[list[str]] = []
    for name in sorted(graph):
        if name in reach[name] and not any(name in g for g in groups):
            groups.append(sorted(m for m in reach[name] if name in reach[m]))
    return groups


def describe_cycle(root: Path, graph: Graph, group: list[str], modules: dict[str, Module]) -> str:
    """One line: each import from a module of the group to another, with its file and lines."""
    src = root / "packages" / modules[group[0]].dist / "src"
    steps = []
    for a in group:
        for b in sorted(set(graph[a]) & set(group)):
            lines = ",".join(str(n) for n in sorted({imp.line for imp in graph[a][b]}))
            steps.append(f"{graph[a][b][0].path.relative_to(src)}:{lines} imports {b}")
    return f"{src.relative_to(root)}: import cycle among {len(group)} modules: " + "; ".join(steps)


#: the names of calls that hand a callable over to be called back later
_HANDOVER = re.compile(r"^(set_|register|add_\w*hook|on_)")


def upcalls(root: Path, modules: dict[str, Module]) -> list[str]:
    """Each call in a Python module that hands a callable (a name, an attribute, a lambda, a
    conditional of them) to a compiled module of its own distribution by a handover call
    (:data:`_HANDOVER`)."""
    found = []
    for mod in modules.values():
        path = root / "packages" / mod.dist / "src" / Path(*mod.name.split("."))
        path = path / "__init__.py" if mod.is_package else path.with_suffix(".py")
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> the module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = resolve(RawImport(path, node.lineno, node.level, node.module or "", ()), mod)
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and _HANDOVER.match(node.func.attr)):
                continue
            target = modules.get(bound.get(node.func.value.id, ""))
            handed = [a for a in node.args
                      if isinstance(a, (ast.Name, ast.Attribute, ast.Lambda, ast.IfExp))]
            if target is not None and target.compiled and target.dist == mod.dist and handed:
                found.append(f"{path.relative_to(root)}:{node.lineno}: hands "
                             f"{ast.unparse(handed[0])} to compiled {target.name}."
                             f"{node.func.attr}: compiled code calling up into Python")
    return found


def check_static(root: Path) -> tuple[list[str], str, list[str]]:
    """All findings on the tree at ROOT, the summary line, and the smells (files over
    SMELL_LINES, not findings)."""
    root = root.resolve()
    layers = read_layers(root)
    problems = [f"packages/{p.name}: a distribution missing from PACKAGES in noxfile.py"
                for p in sorted((root / "packages").iterdir())
                if (p / "src").is_dir() and p.name not in layers]
    modules, unreadable = load_modules(root, layers)
    upward = upward_imports(root, layers, modules)
    graph = import_graph(modules)
    loops = [describe_cycle(root, graph, g, modules) for g in cycles(graph)]
    up = upcalls(root, modules)
    files = [path for dist in layers for path in source_files(root, dist)]
    sizes = {path: sized_lines(path) for path in files}
    big = [f"{p.relative_to(root)}: {n} lines, over {MAX_LINES}" for p, n in sizes.items() if n > MAX_LINES]
    smells = [f"smell (not a failure): {p.relative_to(root)}: {n} lines, over {SMELL_LINES}"
              for p, n in sizes.items() if SMELL_LINES < n <= MAX_LINES]
    summary = (f"check_layers --static: {len(modules)} modules checked ({len(files)} source files): "
               f"{len(loops)} cycles, {len(up)} up-calls, {len(big)} oversize, "
               f"{len(upward)} upward imports, "
               f"{len(smells)} over {SMELL_LINES} lines to look at")
    return [*problems, *unreadable, *upward, *loops, *up, *big], summary, smells


def main() -> int:
    if sys.argv[1:2] == ["--static"]:
        if len(sys.argv) > 3:
            print("usage: check_layers.py --static [ROOT]", file=sys.stderr)
            return 2
        findings, summary, smells = check_static(Path(sys.argv[2] if len(sys.argv) == 3 else ROOT))
        print(*smells, *findings, summary, sep="\n")
        return 1 if findings else 0
    expected = set(sys.argv[1].split(","))
    everything = sys.argv[2].split(",")
    installed = set()
    for dist in everything:
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            continue
        installed.add(dist)
    if installed != expected:
        print(f"check_layers: installed ferro dists {sorted(installed)}, expected {sorted(expected)}")
        return 1
    for dist in everything:
        name = dist.replace("-", "_")
        try:
            mod = importlib.import_module(name)
        except ImportError:
            if dist in expected:
                raise
            continue
        if dist not in expected:
            print(f"check_layers: {name} imports although {dist} is not installed")
            return 1
        print(f"check_layers: {name} {mod.__version__} imports alone with {sorted(expected)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
