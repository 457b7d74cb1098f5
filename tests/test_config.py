"""One place for each thing: the environment settings table, the quantizer kinds shared with
C++, the lean core install and the launcher's import graph."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Modules of the extras (pyproject.toml): the core must import without any of them.
EXTRA_MODULES = ("flax", "sklearn", "typer", "rich", "yaml", "pydantic", "matplotlib", "orbax")

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
sys.meta_path.insert(0, Block())
"""


def _python(code: str, blocked: tuple[str, ...] = (), env: dict | None = None):
    import os

    return subprocess.run(
        [sys.executable, "-P", "-c", BLOCKER.format(blocked=set(blocked)) + code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )


def test_settings_parse_and_name_the_variable():
    from jaxcomm import config

    assert config.get("JAXCOMM_TIMEOUT_S", {}) == 120.0
    assert config.get("JAXCOMM_TIMEOUT_S", {"JAXCOMM_TIMEOUT_S": "2.5"}) == 2.5
    assert config.get("JAXCOMM_UCX_SPIN_US", {"JAXCOMM_UCX_SPIN_US": "0"}) == 0.0
    assert config.get("JAXCOMM_INIT_TIMEOUT", {"JAXCOMM_INIT_TIMEOUT": "30"}) == 30
    assert config.get("JAXCOMM_PROCESS_ID", {}) is None
    for name, bad in (
        ("JAXCOMM_TIMEOUT_S", "0"),
        ("JAXCOMM_TIMEOUT_S", "soon"),
        ("JAXCOMM_UCX_SPIN_US", "-1"),
        ("JAXCOMM_UCX_SPIN_US", "nan"),
        ("JAXCOMM_UCX_WAIT", "spin"),
        ("JAXCOMM_INIT_TIMEOUT", "1.5"),
        ("JAXCOMM_COORDINATOR_PORT", "70000"),
        ("JAXCOMM_NUM_PROCESSES", "0"),
    ):
        with pytest.raises(config.ConfigError, match=f"{name}='{re.escape(bad)}' is invalid"):
            config.get(name, {name: bad})
    with pytest.raises(config.ConfigError, match="JAXCOMM_UCX_WAIT"):
        config.check_environment({"JAXCOMM_UCX_WAIT": "spin"})


def test_loading_the_library_refuses_a_bad_setting_that_cpp_reads():
    # Importing jaxcomm loads no C++ (the launcher imports its light modules plainly); the
    # first use of the library checks every setting before the C++ can read one.
    done = _python("import jaxcomm\njaxcomm.metrics()", env={"JAXCOMM_UCX_SPIN_US": "fast"})
    assert done.returncode != 0
    assert "JAXCOMM_UCX_SPIN_US='fast' is invalid" in done.stderr, done.stderr[-2000:]


def test_every_setting_read_anywhere_is_declared_and_documented():
    from jaxcomm import config

    read = set()
    patterns = {
        "*.cc": r'getenv\("(JAXCOMM_\w+)"\)',
        "*.h": r'getenv\("(JAXCOMM_\w+)"\)',
        "*.py": r'(?:environ|env)(?:\.get\(|\[)"(JAXCOMM_\w+)"',
    }
    for folder in ("ffi", "jaxcomm", "launcher"):
        for glob, pattern in patterns.items():
            for path in (ROOT / folder).rglob(glob):
                read |= set(re.findall(pattern, path.read_text()))
    assert read, "the scan found nothing: its patterns are stale"
    assert read <= set(config.SETTINGS), sorted(read - set(config.SETTINGS))
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    assert config.markdown_table() in design, "docs/DESIGN.md's table is stale: regenerate it"


def test_quantizer_kinds_come_from_the_library_table():
    # Each quantizer declares its kind number in its own header (kernels/<name>.h, k<Name>Kind)
    # and its table entry carries it; Python reads the compiled library's table
    # (jaxcomm_quantizers_json), as the collectives' attributes do. The table's names are the
    # registry's quantizers, its numbers unique, and each the one its header declares (a
    # library built from other sources fails here).
    from jaxcomm import _ffi, algorithms

    table = _ffi.quantizer_kinds()
    assert {q.name: q.quantizer_kind for q in algorithms.quantizers()} == table
    kinds = list(table.values())
    assert all(type(kind) is int and kind >= 0 for kind in kinds), table
    assert len(set(kinds)) == len(kinds), f"two quantizers share a kind number: {table}"
    for name, kind in table.items():
        header = (ROOT / "kernels" / f"{name}.h").read_text()
        declared = re.findall(r"constexpr QuantizerKind k\w+Kind\{(\d+)\};", header)
        assert declared == [str(kind)], f"kernels/{name}.h declares {declared}, the library {kind}"


def test_core_imports_without_the_extras():
    done = _python(
        "import jaxcomm, jaxcomm.optax, jaxcomm.cost, jaxcomm.config\n"
        "import jax.numpy as jnp\n"
        "v, i = jaxcomm.ops.topk_abs(jnp.array([1.0, -4.0, 2.0]), 1)\n"
        "assert float(v[0]) == -4.0\n"
        f"assert not {{m.split('.')[0] for m in sys.modules}} & {set(EXTRA_MODULES)!r}\n"
        "print('ok')",
        blocked=EXTRA_MODULES,
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_the_package_loads_its_jax_api_on_first_use():
    done = _python(
        "import jaxcomm\n"
        "assert 'jax' not in sys.modules and 'jaxcomm._ffi' not in sys.modules\n"
        "import types\n"
        "assert type(jaxcomm) is types.ModuleType  # no class swap\n"
        "assert callable(jaxcomm.metrics) and callable(jaxcomm.reset_metrics)\n"
        "assert jaxcomm.metrics()['totals'] == [] and jaxcomm.metrics()['recent'] == []\n"
        "assert set(jaxcomm.__all__) <= set(dir(jaxcomm))\n"
        "assert all(getattr(jaxcomm, name) is not None for name in jaxcomm.__all__)\n"
        "print('ok')"
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_cli_without_the_launch_extra_says_how_to_get_it():
    done = _python(
        "import runpy; runpy.run_module('jaxcomm_launcher', run_name='__main__')",
        blocked=("typer",),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install 'jaxcomm[launch]'" in done.stderr and "typer" in done.stderr


@pytest.mark.parametrize(
    ("extra", "blocked", "code"),
    [
        ("examples", "flax", "import jaxcomm.examples.digits"),
        (
            "checkpoint",
            "orbax",
            "import jaxcomm.optax\njaxcomm.optax.save_state('/nonexistent/x', {})",
        ),
    ],
)
def test_a_missing_extra_says_how_to_get_it(extra, blocked, code):
    done = _python(code, blocked=(blocked,))
    assert done.returncode != 0
    assert f"pip install 'jaxcomm[{extra}]'" in done.stderr, done.stderr[-2000:]


def test_launcher_backends_do_not_import_the_runner():
    # runner -> backends -> slurm used to import runner back (hidden in functions).
    done = _python(
        "import jaxcomm_launcher.backends, jaxcomm_launcher.backends.slurm\n"
        "assert 'jaxcomm_launcher.runner' not in sys.modules\n"
        "assert 'jax' not in sys.modules  # the launcher's own process stays light\n"
        "print('ok')"
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_every_repository_path_named_in_the_tree_exists():
    """Comments, docstrings and docs name files by their repository path (ffi/engine.h,
    benchmarks/overlap.py, ...): each such path must exist, so that a rename updates them.
    Paths followed by a placeholder (`<...>`, `{...}`, `*`) are skipped."""
    root = pathlib.Path(__file__).resolve().parents[1]
    listed = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=False
    ).stdout.split()
    if not listed:
        pytest.skip("not a git checkout")
    pattern = re.compile(
        r"(?<![\w./<-])((?:ffi|kernels|jaxcomm|launcher|tests|benchmarks|docs|recipes|\.ci)"
        r"/[\w./-]*\w)"
    )
    missing = []
    for name in listed:
        path = root / name
        if path.suffix in (".png", ".json", ".whl") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for match in pattern.finditer(text):
            ref = match.group(1)
            end = match.end()
            if text[end : end + 1] in ("-", "{", "<", "*"):
                continue  # a name built at run time (results/overlap-<backend>...)
            if not (root / ref).exists() and not any(
                p.startswith(ref + ".")
                for p in listed  # "results/x" for x.json and x.png
            ):
                missing.append(f"{name}: {ref}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
