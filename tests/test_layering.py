"""The package's layers import one way: the kernels (custom_kernels/, installed as ``ds4_mlx.kernels``) sit at
the bottom and know nothing of the model, numerics profiles, sampling, sessions, generation, serving or the
demo; ``import ds4_mlx`` loads the public API on first use."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "custom_kernels"

#: What the kernels may import from the package: themselves and the leaf modules under them.
KERNEL_IMPORTS = ("ds4_mlx.kernels", "ds4_mlx.backend", "ds4_mlx.paths", "ds4_mlx.quants")
#: The layers above the kernels, which importing the kernels must not load.
ABOVE_KERNELS = ("ds4_mlx.model", "ds4_mlx.numerics", "ds4_mlx.sampling", "ds4_mlx.demo", "ds4_mlx.testing",
                 "ds4_mlx.session", "ds4_mlx.generate", "ds4_mlx.server", "ds4_mlx.loader", "ds4_mlx.weights")


def under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def package_imports(source: str, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of ``ds4_mlx`` in ``source``, a module of ``package``: module-level and
    inside functions, relative ones resolved, ``from m import n`` as ``m.n`` (``n`` may be a submodule), and
    ``importlib.import_module`` / ``__import__`` calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    raise ValueError(f"line {node.lineno}: a relative import past the top of {package}")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):  # fmt: skip
            found.append((node.lineno, str(node.args[0].value)))
    return [(line, m) for line, m in found if under(m, ("ds4_mlx",))]


def test_scanner_finds_every_kind_of_import():
    """The scan below is not vacuous: it sees imports at any depth, relative ones and importlib's."""
    source = (
        "import importlib\nfrom . import mv\nimport ds4_mlx.quants\n"
        "def f():\n    from ..model import attention\n    from ds4_mlx import sampling, load\n"
        "    import ds4_mlx.numerics as n\n    return importlib.import_module('ds4_mlx.demo')\n"
    )
    got = package_imports(source, "ds4_mlx.kernels")
    assert [m for _, m in got] == ["ds4_mlx.kernels.mv", "ds4_mlx.quants", "ds4_mlx.model.attention",
                                   "ds4_mlx.sampling", "ds4_mlx.load", "ds4_mlx.numerics", "ds4_mlx.demo"]  # fmt: skip
    assert [m for _, m in got if not under(m, KERNEL_IMPORTS)] == [m for _, m in got][2:]


def test_kernels_import_only_the_leaves_under_them():
    files = sorted(KERNELS.glob("*.py"))
    assert {p.name for p in files} >= {"__init__.py", "fused.py", "sim.py"}
    bad = [f"custom_kernels/{p.name}:{line} imports {m}" for p in files
           for line, m in package_imports(p.read_text(), "ds4_mlx.kernels") if not under(m, KERNEL_IMPORTS)]
    assert not bad, "the kernels import from above them:\n" + "\n".join(bad)


def loaded_modules(code: str) -> list[str]:
    """The ``ds4_mlx`` modules a fresh interpreter has loaded after running ``code``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('ds4_mlx'))))"
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_the_kernels_loads_no_layer_above_them():
    loaded = loaded_modules("import ds4_mlx.kernels, ds4_mlx.kernels.fused, ds4_mlx.kernels.sim")
    assert "ds4_mlx.kernels.fused" in loaded
    assert not [m for m in loaded if under(m, ABOVE_KERNELS)], loaded


def test_public_api_loads_on_first_use():
    """``from ds4_mlx import load, generate`` works, and ``ds4_mlx.generate`` stays the function after the
    submodule of that name is imported."""
    code = (
        "import ds4_mlx, types\nassert 'ds4_mlx.session' not in __import__('sys').modules\n"
        "import ds4_mlx.generate\nfrom ds4_mlx import DS4FormatError, Session, generate, load, stream_generate\n"
        "assert isinstance(generate, types.FunctionType) and ds4_mlx.generate is generate\n"
        "assert set(ds4_mlx.__all__) <= set(dir(ds4_mlx)) and callable(load) and callable(stream_generate)\n"
        "assert Session.__module__ == 'ds4_mlx.session' and issubclass(DS4FormatError, Exception)\n"
    )
    loaded = loaded_modules(code)
    assert {"ds4_mlx.session", "ds4_mlx.model.model", "ds4_mlx.loader"} <= set(loaded)
