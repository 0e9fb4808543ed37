"""The package's seams, held by tests: where private names of dependencies may appear, what importing
loads, which modules may import which, and that every overridden Lightning method says so."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import lightning_resume
from lightning_resume._compat import torchdata as torchdata_compat

PACKAGE = Path(lightning_resume.__file__).parent
ROOT = PACKAGE.parent
COMPAT = PACKAGE / "_compat"
DEPENDENCIES = ("lightning", "torchdata", "torch.distributed.checkpoint", "torch.distributed.tensor")
SECOND_COPIES = ("pytorch_lightning", "lightning_fabric")
"""The standalone packages: a second copy of Lightning beside ``lightning.pytorch`` / ``lightning.fabric``."""


def _modules(include_compat: bool = False) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if include_compat or COMPAT not in p.parents)


def _tree(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def _is_dependency(module: str) -> bool:
    return any(module == d or module.startswith(d + ".") for d in DEPENDENCIES)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _names_defined_by_us() -> set[str]:
    """Every name the package (outside ``_compat``) defines: functions, classes, attributes it assigns."""
    names: set[str] = set()
    for path in _modules():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


FSSPEC_ASYNC_API = frozenset({"_call_s3"})
"""Not private: fsspec's async filesystems name their coroutine API with a leading underscore (``_cat_file`` is
the coroutine of ``cat_file``); s3fs's ``_call_s3`` is the coroutine of its public ``call_s3``."""


def _private_uses(path: Path, ours: set[str], state_keys: set[str]) -> list[str]:
    where = path.relative_to(ROOT) if ROOT in path.parents else path
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module and _is_dependency(node.module):
            if any(_is_private(part) for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno} imports from private module {node.module}")
            found += [
                f"{where}:{node.lineno} imports {node.module}.{a.name}" for a in node.names if _is_private(a.name)
            ]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_dependency(alias.name) and any(_is_private(p) for p in alias.name.split(".")):
                    found.append(f"{where}:{node.lineno} imports private module {alias.name}")
        elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in ours | FSSPEC_ASYNC_API:
            found.append(f"{where}:{node.lineno} uses .{node.attr}, which the package does not define")
        elif isinstance(node, ast.Constant) and node.value in state_keys:
            found.append(f"{where}:{node.lineno} spells torchdata's state key {node.value!r}")
    return found


def test_no_private_name_of_a_dependency_outside_compat():
    ours = _names_defined_by_us()
    state_keys = {v for k, v in vars(torchdata_compat).items() if k.startswith("_") and isinstance(v, str)}
    state_keys -= {"yielded"}  # too plain a word to police; it is only read through _compat.torchdata
    assert state_keys, "the torchdata shim should define its state keys"
    found = [line for path in _modules() for line in _private_uses(path, ours, state_keys)]
    assert not found, "private names of Lightning/torchdata/DCP belong in lightning_resume/_compat:\n" + "\n".join(
        found
    )


def test_the_seam_test_catches_a_private_use(tmp_path):
    """The check above must be able to fail: a module reaching into Lightning or torchdata is reported."""
    module = tmp_path / "bad.py"
    module.write_text(
        "from lightning.fabric.utilities.types import _PATH\n"
        "def f(trainer):\n    return trainer.fit_loop._data_fetcher, {'_num_yielded': 1}\n"
    )
    found = "\n".join(_private_uses(module, set(), {"_num_yielded"}))
    assert "_PATH" in found and "._data_fetcher" in found and "'_num_yielded'" in found


def test_only_one_import_root_for_lightning():
    found = []
    for path in _modules(include_compat=True):
        for node in ast.walk(_tree(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in SECOND_COPIES]
    assert not found, "import Lightning as lightning.pytorch / lightning.fabric only:\n" + "\n".join(found)


def _run(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_everything_leaves_lightnings_loggers_and_copies_alone():
    loaded = _run(
        "import json, sys, importlib, pkgutil\n"
        "import lightning.pytorch\n"
        "import lightning_utilities.core.rank_zero as rz\n"
        "before = rz.log.name\n"
        "import lightning_resume\n"
        "for name in lightning_resume.__all__: getattr(lightning_resume, name)\n"
        "for m in pkgutil.walk_packages(lightning_resume.__path__, 'lightning_resume.'): importlib.import_module(m.name)\n"
        "print(json.dumps({'before': before, 'after': rz.log.name,"
        " 'copies': sorted(m for m in sys.modules if m.split('.')[0] in ('lightning_fabric', 'pytorch_lightning'))}))\n"
    )
    assert loaded["after"] == loaded["before"] == "lightning.pytorch.utilities.rank_zero"
    assert loaded["copies"] == []


HEAVY = ("lightning", "torch.distributed.checkpoint", "pytorch_lightning", "lightning_fabric")


def _heavy_modules_after(statement: str) -> list[str]:
    roots = repr(HEAVY)
    return _run(
        f"import json, sys\n{statement}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if any(m == r or m.startswith(r + '.') for r in {roots}))))\n"
    )


def test_pure_modules_import_without_lightning_or_dcp():
    pure = (
        "lightning_resume.schedule.state, lightning_resume.retention.policy, lightning_resume.schedule.history,"
        " lightning_resume.cloud.detect, lightning_resume.cloud.protocols, lightning_resume.storage.remote_budget,"
        " lightning_resume.prove.compare"
    )
    assert _heavy_modules_after(f"import {pure}") == []
    assert _heavy_modules_after("import lightning_resume") == []


def test_plan_command_starts_without_dcp():
    heavy = _heavy_modules_after(
        "from lightning_resume.cli.main import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): assert main(['plan', '--cost', '60', '--mtbf', '24h']) == 0"
    )
    assert not [m for m in heavy if m.startswith("torch.distributed.checkpoint")]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any level, lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for path in _modules(include_compat=True):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        deps: set[str] = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_resume"):
                deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("lightning_resume")}
        graph[name] = deps
    known = set(graph)
    return {m: {d for d in deps if d in known and d != m and d != "lightning_resume"} for m, deps in graph.items()}


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph seen at the level of the top entries: ``io``, ``sharded``, ``storage``..."""

    def top(module: str) -> str:
        return module.split(".")[1] if "." in module else module

    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(top(module), set()).update(top(d) for d in deps)
    return {p: deps - {p, "lightning_resume"} for p, deps in packages.items() if p != "lightning_resume"}


def _first_cycle(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_cycles():
    cycle = _first_cycle(_import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycles_between_packages():
    cycle = _first_cycle(_package_graph(_import_graph()))
    assert not cycle, "package import cycle (a lazy import counts too): " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle_between_packages_made_of_acyclic_modules():
    modules = {
        "lightning_resume.format.read": {"lightning_resume.sharded.commit"},
        "lightning_resume.sharded.api": {"lightning_resume.format.write"},
    }
    assert not _first_cycle(modules)
    assert _first_cycle(_package_graph(modules)) == ["format", "sharded", "format"]


MAX_MODULES_PER_FOLDER = 12
"""A folder is one concern a newcomer can name; past a dozen modules it is a drawer."""


def test_no_folder_is_a_drawer():
    folders = {p.parent for p in _modules(include_compat=True)}
    crowded = {
        str(f.relative_to(ROOT)): n
        for f in folders
        if (n := len([m for m in f.glob("*.py") if m.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, f"split these folders by concern: {crowded}"


def test_the_layer_order_of_the_storage_stack():
    """storage < format < sharded < staging < io < memory: a lower layer never imports a higher one."""
    order = ["storage", "format", "sharded", "staging", "io", "memory"]
    packages = _package_graph(_import_graph())
    upward = [(p, d) for p in order for d in packages.get(p, ()) if d in order and order.index(d) > order.index(p)]
    assert not upward, f"a lower layer imports a higher one: {upward}"


def _our_classes() -> list[type]:
    classes = {}
    for info in pkgutil.walk_packages(lightning_resume.__path__, "lightning_resume."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__.startswith("lightning_resume"):
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(classes.values())


def _overrides_without_marker(cls: type) -> list[str]:
    missing = []
    bases = [b for b in cls.__mro__[1:] if _is_dependency(b.__module__)]
    for name, member in vars(cls).items():
        if name.startswith("__") or not any(name in vars(b) for b in bases):
            continue
        fn = member.fget if isinstance(member, property) else member
        if inspect.isfunction(fn) and not getattr(fn, "__override__", False):
            missing.append(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return missing


def test_no_private_method_of_a_dependency_is_overridden_outside_compat():
    found = []
    for cls in _our_classes():
        if cls.__module__.startswith("lightning_resume._compat"):
            continue
        bases = [b for b in cls.__mro__[1:] if _is_dependency(b.__module__)]
        found += [
            f"{cls.__module__}.{cls.__qualname__}.{name}"
            for name in vars(cls)
            if _is_private(name) and inspect.isfunction(vars(cls)[name]) and any(name in vars(b) for b in bases)
        ]
    assert not found, "route these through a hook in lightning_resume/_compat:\n" + "\n".join(found)


def test_every_overridden_lightning_method_is_marked_override():
    missing = [line for cls in _our_classes() for line in _overrides_without_marker(cls)]
    assert not missing, "add @typing_extensions.override to:\n" + "\n".join(missing)


def test_public_api_is_sorted_and_matches_the_readme():
    assert lightning_resume.__all__ == sorted(lightning_resume.__all__)
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    listed = sorted({line.split("`")[1] for line in section.splitlines() if line.startswith("- `")})
    assert listed == lightning_resume.__all__


def test_layout_section_of_the_readme_matches_the_tree():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    entries = [line for line in block.splitlines()[1:] if line.startswith("  ") and not line.startswith("   ")]
    listed = {line.split()[0].rstrip("/") for line in entries}
    actual = {p.name for p in PACKAGE.iterdir() if not p.name.startswith("__pycache__")}
    actual = {n[:-3] if n.endswith(".py") else n for n in actual} - {"__init__"}
    listed = {n[:-3] if n.endswith(".py") else n for n in listed} - {"__init__"}
    assert listed == actual


def test_no_test_module_imports_another_test_module():
    tests = ROOT / "tests"
    found = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)}: {m}" for m in modules if m.split(".")[-1].startswith("test_")]
    assert not found, "share code through tests/helpers instead:\n" + "\n".join(found)


SEAM_FOLDERS = ("exact", "memory")
"""Folders that reach the checkpoint IO only through ``lightning_resume.protocols``, never by its class."""


def _isinstance_of_a_plugin(path: Path) -> list[str]:
    """Every ``isinstance(x, C)`` in ``path`` whose ``C`` (or a member of a tuple ``C``) is a ``CheckpointIO`` class."""
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    module = importlib.import_module(name.removesuffix(".__init__"))
    found = []
    for node in ast.walk(_tree(path)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2):
            continue
        second = node.args[1]
        for expr in second.elts if isinstance(second, ast.Tuple) else [second]:
            try:
                cls = eval(compile(ast.Expression(expr), str(path), "eval"), vars(module))  # a name or dotted name
            except Exception:  # a local variable: not a class the module names
                continue
            is_protocol = getattr(cls, "_is_protocol", False)
            if inspect.isclass(cls) and issubclass(cls, CheckpointIO) and not is_protocol:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} isinstance(..., {ast.unparse(expr)})")
    return found


def test_exact_and_memory_reach_the_checkpoint_io_through_protocols_only():
    found = [line for folder in SEAM_FOLDERS for p in sorted((PACKAGE / folder).rglob("*.py"))
             for line in _isinstance_of_a_plugin(p)]  # fmt: skip
    assert not found, "use a protocol of lightning_resume.protocols instead:\n" + "\n".join(found)


def test_the_plugin_isinstance_check_catches_one(tmp_path, monkeypatch):
    package = tmp_path / "lightning_resume_probe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "probe.py").write_text(
        "from lightning_resume.io.plugin import SafetensorsCheckpointIO\n"
        "from lightning_resume.protocols import InPlaceLoading\n\n"
        "def f(io):\n"
        "    return isinstance(io, InPlaceLoading) or isinstance(io, (int, SafetensorsCheckpointIO))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _isinstance_of_a_plugin(package / "probe.py") == [
        "lightning_resume_probe/probe.py:5 isinstance(..., SafetensorsCheckpointIO)"
    ]
