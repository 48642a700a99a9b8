"""The package's shape: no import cycles between its modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "qnn_convbwd"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            target = node.module if not node.level else ".".join(filter(None, [base, node.module]))
            candidates = [target, *(f"{target}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate not in modules and "." in candidate:
                candidate = candidate.rsplit(".", 1)[0]
            # A module importing its own package (``from .. import x``) names x, not a cycle.
            if candidate in modules and candidate != name and not name.startswith(candidate + "."):
                found.add(candidate)
    return found


def test_no_import_cycles():
    modules = _modules()
    assert len(modules) > 20, sorted(modules)
    edges = {name: _imports(name, path, modules) for name, path in modules.items()}
    cycles, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for other in sorted(edges[module]):
            if state.get(other) == "open":
                cycles.append([*stack[stack.index(other) :], other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[module] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module)
    assert not cycles, [" -> ".join(c) for c in cycles]


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The check is not vacuous: two modules importing each other are reported."""
    package = tmp_path / "qnn_convbwd"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    for index in range(20):
        (package / f"m{index}.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    try:
        test_no_import_cycles()
    except AssertionError as err:
        assert "qnn_convbwd.a -> qnn_convbwd.b -> qnn_convbwd.a" in str(err)
    else:
        raise AssertionError("a two-module cycle was not reported")


def _importers_of(prefix: str, among: tuple[str, ...]) -> dict[str, set[str]]:
    """Modules under ``among`` (package-relative prefixes) that import ``prefix``."""
    modules = _modules()
    found = {}
    for name, path in modules.items():
        if not name.startswith(tuple(f"qnn_convbwd.{p}" for p in among)):
            continue
        bad = {m for m in _imports(name, path, modules) if m.startswith(f"qnn_convbwd.{prefix}")}
        if bad:
            found[name] = bad
    return found


def test_rules_passes_and_geometry_do_not_import_the_builders():
    """The support rules and the passes decide and rewrite; the builders only build
    QNN ops: what both need (geometry, metadata keys, node kinds) sits below both."""
    assert _importers_of("builders", ("partition", "passes", "geometry", "meta", "nodes")) == {}


def test_the_builders_check_sees_an_upward_import():
    """Not vacuous: the pipeline, which names the visitors, imports the builders."""
    assert "qnn_convbwd.pipeline" in _importers_of("builders", ("pipeline",))


def _absolute_imports(path: Path) -> set[str]:
    """Top-level packages ``path`` imports by absolute name, at any depth of the code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
    return found


def test_the_plugin_never_imports_the_developer_tools():
    """No module of ``qnn_convbwd`` imports ``qnn_convbwd_dev`` (the CLI loads a developer
    subcommand by name when it runs); the developer package does import the plugin."""
    importers = [n for n, p in _modules().items() if "qnn_convbwd_dev" in _absolute_imports(p)]
    assert importers == []
    dev = PACKAGE.parent / "qnn_convbwd_dev"
    assert "qnn_convbwd" in _absolute_imports(dev / "cost.py")  # the check sees imports


def test_the_runtime_never_imports_the_commands():
    """What a user's lowering imports (everything but ``commands/`` and the CLI that runs
    them) never imports ``qnn_convbwd.commands``, at module level or inside functions."""
    runtime = tuple(
        p.removeprefix("qnn_convbwd.")
        for p in _modules()
        if not p.startswith("qnn_convbwd.commands") and p not in ("qnn_convbwd", "qnn_convbwd.cli")
    )
    assert len(runtime) > 20
    assert _importers_of("commands", runtime) == {}
    # Not vacuous: the commands import each other (demo reads models).
    among = _importers_of("commands", ("commands",))
    assert "qnn_convbwd.commands.models" in among["qnn_convbwd.commands.demo"]


LOADED = """
import sys
import qnn_convbwd
import qnn_convbwd.api
import qnn_convbwd.training
from qnn_convbwd.training import WithLoss
assert qnn_convbwd.lower.__module__ == "qnn_convbwd.api"
print(sorted(m for m in sys.modules if m.startswith("qnn_convbwd")))
"""


def test_the_runtime_loads_no_developer_tool_nor_command():
    """In a fresh process, the package, its API and its training module load neither the
    developer package nor a CLI subcommand."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert "qnn_convbwd.api" in loaded and "qnn_convbwd.training" in loaded
    moved = {
        *(f"qnn_convbwd_dev.{p.stem}" for p in (PACKAGE.parent / "qnn_convbwd_dev").glob("*.py")),
        *(f"qnn_convbwd.commands.{p.stem}" for p in (PACKAGE / "commands").glob("*.py")),
    }
    assert len(moved) > 15
    unwanted = [m for m in loaded if m.startswith(("qnn_convbwd_dev", "qnn_convbwd.commands"))]
    assert unwanted == [] and not moved & set(loaded)


PACKAGE_ALONE = """
import sys
import qnn_convbwd
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "executorch"}))
"""


def test_importing_the_package_loads_neither_torch_nor_executorch():
    """``import qnn_convbwd`` is cheap (the doctor, the stdlib-only modules, child
    processes); each public name loads its module on first use."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", PACKAGE_ALONE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[]"]

    import qnn_convbwd

    assert sorted(qnn_convbwd._PUBLIC) == sorted(qnn_convbwd.__all__)
    for name in qnn_convbwd.__all__:
        value = getattr(qnn_convbwd, name)
        assert value.__module__ == f"qnn_convbwd.{qnn_convbwd._PUBLIC[name]}", name
    assert qnn_convbwd.integration.__name__ == "qnn_convbwd.integration"  # a submodule
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        qnn_convbwd.no_such_name  # noqa: B018


LOWERING = """
import sys
import torch
import qnn_convbwd
from qnn_convbwd.toolchain import harness

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, x, target):
        return torch.nn.functional.mse_loss(self.conv(x), target)

from torch.export.experimental import _export_forward_backward
args = (torch.randn(1, 3, 8, 8), torch.randn(1, 4, 6, 6))
joint = _export_forward_backward(torch.export.export(Net(), args, strict=True))
qnn_convbwd.enable()
specs = harness.compile_specs("SM8650")
report = qnn_convbwd.{call}(joint, specs)
assert {check}, report
print(sorted(m for m in sys.modules if m.startswith(("qnn_convbwd_dev", "qnn_convbwd.commands"))))
"""


def _imported_tools(call: str, check: str) -> str:
    import subprocess
    import sys

    code = LOWERING.format(call=call, check=check)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.htp
def test_lowering_imports_no_tools(qnn_sdk):
    """``import qnn_convbwd; enable(); lower(...)`` in a fresh process loads no tool."""
    assert _imported_tools("lower", "report.report.delegated == 1") == "[]"


WITHOUT_DEV = """
import sys
sys.modules["qnn_convbwd_dev"] = None  # as if the developer tools were not installed
from qnn_convbwd import cli
code = cli.main([{argv}])
print("exit", code)
"""


def _cli_without_dev(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    code = WITHOUT_DEV.format(argv=", ".join(repr(a) for a in argv))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


@pytest.mark.parametrize("command", ["bench", "fidelity", "cost", "profile"])
def test_a_developer_subcommand_without_the_developer_tools_says_how_to_install(command, tmp_path):
    proc = _cli_without_dev(tmp_path, command, "--soc", "SM8650")
    assert proc.stdout.strip() == "exit 2", proc.stderr[-3000:]
    assert f"qnn-convbwd {command}: needs the developer tools" in proc.stderr
    assert "pip install -e '.[dev]'" in proc.stderr


def test_a_user_subcommand_runs_without_the_developer_tools(tmp_path):
    proc = _cli_without_dev(tmp_path, "cache", "list", "--dir", str(tmp_path / "cache"))
    assert proc.stdout.strip().splitlines()[-1] == "exit 0", proc.stderr[-3000:]


def test_scripts_import_no_test_module():
    """The scripts take what they share from ``qnn_convbwd`` and ``qnn_convbwd_dev``:
    none puts ``tests/`` on ``sys.path`` or imports a module that lives there."""
    root = PACKAGE.parent
    in_tests = {p.stem for p in (root / "tests").glob("*.py")}
    scripts = sorted((root / "scripts").glob("*.py"))
    assert len(scripts) > 10
    found = {}
    for path in scripts:
        bad = _absolute_imports(path) & in_tests
        if "sys.path" in path.read_text():
            bad.add("sys.path")
        if bad:
            found[path.name] = bad
    assert found == {}
    # Not vacuous: the check sees the scripts' imports and the modules the tests share
    assert sum("qnn_convbwd_dev" in _absolute_imports(p) for p in scripts) > 5
    assert {"tiers", "cases", "test_max_pool"} <= in_tests


# The plugin's layers, lowest first: a module imports only from lower layers (or its
# own package). Names are the package's top-level modules and subpackages.
LAYERS = (
    {
        "meta",
        "options",
        "logs",
        "progress",
        "integration",
        "delegate_io",
        "torchvision_import",
        "fit_plot",
        "finetune_data",
        # a backbone quantized with pt2e, and the straight-through estimator (torch only)
        "quantized",
    },
    # signature reads the metadata key of a parameter the program's own optimizer trains.
    {"geometry", "nodes", "signature"},
    {"partition"},
    {"passes", "builders"},
    {"toolchain", "after_partition"},
    {"context_cache", "device", "parallel_finalize"},
    {"lowering_cache"},
    {"pipeline"},
    {"api"},
    {"training", "qnn_convbwd"},
    {"finetune"},
    # device_train: a finetune run's train.pte trained on a device (scripts/run_on_device.py).
    {"commands", "cli", "device_train"},
)


# Upward imports with a reason, each from inside a function. The simulator harness
# (compile specs, lowering and running a program for the tests and commands) lowers
# through api; quantized.quantizer makes the plugin's QNN SDK usable (toolchain) before
# executorch's QnnQuantizer looks for one of its own.
UPWARD = {
    "qnn_convbwd.toolchain.harness -> qnn_convbwd.api",
    "qnn_convbwd.quantized -> qnn_convbwd.toolchain",
}


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_module_imports_only_from_lower_layers():
    """partition (the rules) below passes and builders, those below the pipeline that
    orders them, the pipeline below api, training and the commands on top."""
    layer = {name: rank for rank, names in enumerate(LAYERS) for name in names}
    modules = _modules()
    assert {_group(m) for m in modules} == set(layer), "a new module needs a layer"
    upward = []
    for name, path in modules.items():
        for other in _imports(name, path, modules):
            if _group(other) != _group(name) and layer[_group(other)] >= layer[_group(name)]:
                upward.append(f"{name} -> {other}")
    assert set(upward) == UPWARD, upward
