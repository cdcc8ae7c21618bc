"""The layout rules: data flows one way, no import cycles, every function under 80 lines (and at most five of 60
or more), every module named in docs/architecture.md; a module over 500 lines is reported.

Every top-level part of ``rlctl`` has a layer; a module may import its own part or a lower layer, never
a higher one. Imports inside functions count too (a lazy import is still a dependency); imports under
``if TYPE_CHECKING:`` do not (they never run).

The line cap is a warning, not a failure: a module that reads top to bottom is better long than split
mid-thought. The modules over it are printed (``pytest -rw`` lists them) so a growing one is seen.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rlctl"
MAX_LINES = 500

# low -> high; a part may import parts of its own layer's index or lower
LAYERS: list[set[str]] = [
    {"errors", "terminal", "names", "catalog", "algos", "presets", "testing", "usercode", "support"},
    {"config", "formats", "metrics"},
    {"data", "estimate"},
    {"plan"},
    {"runtime"},
    {"engines", "rollout", "rewards", "agents"},
    {"recipes"},
    {"launch", "job", "checks", "modelfiles", "datacheck", "slurm"},
    {"convert"},
    {"bench", "demo", "run_report", "viewer", "evaluate"},
    {"cli", "__main__"},
]
# lower in the table, but still not theirs to import: engines model nothing about plans or estimates
FORBIDDEN = {"engines": {"estimate", "plan"}, "rollout": {"estimate", "plan"}, "launch": {"job"}}


def _layer(part: str) -> int:
    for i, parts in enumerate(LAYERS):
        if part in parts:
            return i
    raise AssertionError(f"rlctl/{part} has no layer in tests/layout/test_layout.py: add it")


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, *, typing_too: bool = False) -> set[str]:
    """Every rlctl module ``path`` imports (at run time; ``typing_too``: under TYPE_CHECKING as well)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing_too:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("rlctl"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("rlctl"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _graph(*, typing_too: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in _imports(path, typing_too=typing_too) if m in modules and m != name}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_import_goes_down_the_layers():
    wrong = []
    for module, deps in sorted(_graph().items()):
        src = _part(module)
        if src == "__init__":
            continue
        for dep in sorted(deps):
            dst = _part(dep)
            if dst == "__init__" or dst == src:
                continue
            if _layer(dst) > _layer(src) or dst in FORBIDDEN.get(src, set()):
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "imports from a lower layer to a higher one:\n" + "\n".join(wrong)


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_cycle_even_through_type_only_imports():
    """An import under TYPE_CHECKING never runs, but it still ties two modules together: a module that
    names another's type to take it whole (``dynamic_sample(rl: RLTrainer)`` was one) reaches back into
    it, and ``agents.build -> sources -> tools -> build`` was another. rlctl has none."""
    cycles = _cycles(_graph(typing_too=True))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    # a package imports its own submodules through __init__; count only module-to-module edges
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                dfs(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node, [node])
    return cycles


class LongModuleWarning(UserWarning):
    """A module over MAX_LINES lines: worth a look, not a reason to split it mid-thought."""


def long_modules(root: Path = PACKAGE) -> list[tuple[str, int]]:
    """(path, lines) of every module under ``root`` over MAX_LINES, longest first."""
    sizes = [(str(p.relative_to(root.parent)), len(p.read_text().splitlines())) for p in root.rglob("*.py")]
    return sorted(((p, n) for p, n in sizes if n > MAX_LINES), key=lambda x: -x[1])


def test_long_modules_are_reported():
    for path, n in long_modules():
        print(f"{path}: {n} lines (over {MAX_LINES})")
        warnings.warn(f"{path} has {n} lines (over {MAX_LINES})", LongModuleWarning, stacklevel=1)


def test_the_report_names_exactly_the_long_modules(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name, n in (("at_cap.py", MAX_LINES), ("sub/over.py", MAX_LINES + 1), ("longest.py", 2 * MAX_LINES)):
        (pkg / name).write_text("x = 1\n" * n)
    assert long_modules(pkg) == [("pkg/longest.py", 2 * MAX_LINES), ("pkg/sub/over.py", MAX_LINES + 1)]


# ---------------------------------------------------------------------------------------------
# Functions: one screen each

MAX_FUNCTION_LINES = 80  # a function has fewer lines than this: one you cannot read in one screen is two
# Known exceptions, each "path::qualified name": TODO(issue 22) split them, then remove them from here (a
# name that is no longer long, or no longer exists, fails the test below so the list only shrinks).
LONG_FUNCTIONS_TODO: set[str] = set()


def function_lengths(root: Path = PACKAGE) -> dict[str, int]:
    """{"path::Class.function": lines} of every function under ``root``, from its ``def`` line to its last
    line (decorators not counted; a nested function counts in its own right and within its parent)."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                out[f"{path}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, path, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, path, f"{prefix}{child.name}.")
            else:
                visit(child, path, prefix)

    for p in sorted(root.rglob("*.py")):
        visit(ast.parse(p.read_text()), str(p.relative_to(root.parent)), "")
    return out


def test_every_function_fits_on_a_screen():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n >= MAX_FUNCTION_LINES}
    new = sorted(f"{name}: {n} lines" for name, n in long.items() if name not in LONG_FUNCTIONS_TODO)
    assert not new, f"functions of {MAX_FUNCTION_LINES} lines or more (split them):\n" + "\n".join(new)
    stale = sorted(LONG_FUNCTIONS_TODO - set(long))
    assert not stale, "no longer long (or gone): remove from LONG_FUNCTIONS_TODO:\n" + "\n".join(stale)
    for name in sorted(LONG_FUNCTIONS_TODO):
        warnings.warn(f"{name} has {long[name]} lines (TODO: under {MAX_FUNCTION_LINES})", LongModuleWarning, 1)


# Aim lower: a function of AIM_FUNCTION_LINES lines or more is the exception (issue 38: at most MAX_AIM_EXCEPTIONS)
AIM_FUNCTION_LINES = 60
MAX_AIM_EXCEPTIONS = 5


def functions_at_least(lines: int, root: Path = PACKAGE) -> list[str]:
    """Every function under ``root`` of ``lines`` lines or more, as "path::name: N lines", longest first."""
    found = sorted(((n, name) for name, n in function_lengths(root).items() if n >= lines), key=lambda x: (-x[0], x[1]))
    return [f"{name}: {n} lines" for n, name in found]


def test_at_most_five_functions_reach_sixty_lines():
    long = functions_at_least(AIM_FUNCTION_LINES)
    assert len(long) <= MAX_AIM_EXCEPTIONS, (
        f"{len(long)} functions of {AIM_FUNCTION_LINES} lines or more (at most {MAX_AIM_EXCEPTIONS}; split one into "
        "named steps):\n" + "\n".join(long)
    )


def test_functions_at_least_names_exactly_the_long_ones(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = lambda n: "\n".join(f"    x{i} = {i}" for i in range(n - 1))  # noqa: E731 (the def line is one more)
    (pkg / "m.py").write_text(f"def short():\n{body(59)}\n\n\ndef at():\n{body(60)}\n\n\ndef over():\n{body(61)}\n")
    assert functions_at_least(60, pkg) == ["pkg/m.py::over: 61 lines", "pkg/m.py::at: 60 lines"]


def test_function_lengths_are_counted_from_def_to_last_line(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(5))
    source = (
        f"import functools\n\n\n@functools.cache\ndef five_body_lines():\n{body}\n\n\n"
        "class C:\n    async def method(self):\n        def inner():\n            return 1\n\n        return inner\n"
    )
    (pkg / "m.py").write_text(source)
    assert function_lengths(pkg) == {
        "pkg/m.py::five_body_lines": 6,  # the def line and five body lines; the decorator is not counted
        "pkg/m.py::C.method": 5,
        "pkg/m.py::C.method.inner": 2,
    }


def test_architecture_md_names_every_module():
    """docs/architecture.md's "One line per module" names each module of rlctl/ under its package."""
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = doc.split("## One line per module", 1)[1].split("```")[1]
    sections: dict[str, str] = {}  # "" (top level) or a package -> its lines
    current = ""
    for line in block.splitlines()[2:]:
        m = re.match(r"  (\w+)/", line)
        current = m.group(1) if m else current if line.startswith("     ") else ""
        sections[current] = sections.get(current, "") + line + "\n"
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if path.name == "__init__.py" or path.name == "__main__.py":
            continue
        text, word = (sections.get("", ""), path.name) if len(parts) == 1 else (sections.get(parts[0], ""), path.stem)
        if not re.search(rf"(?<![\w.]){re.escape(word)}(?!\w)", text):
            missing.append(str(path.relative_to(PACKAGE.parent)))
    assert not missing, "not in docs/architecture.md's one line per module:\n" + "\n".join(missing)
