"""The algorithm registry (jaxcomm/algorithms/) and its cost records
(jaxcomm/cost/algorithm_costs/): the records agree with the C++ and the specs, and a new
algorithm module and its cost module are picked up everywhere without another edit."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

import jaxcomm
from jaxcomm import _ffi, algorithms, cost
from jaxcomm.algorithms._base import collect_settings

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _cpp_sources() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "ffi").rglob("*.c*")) + "\n".join(
        p.read_text() for p in (ROOT / "ffi").rglob("*.h")
    )


def test_names_are_the_ones_recipes_benchmarks_and_cost_use():
    assert algorithms.names() == (
        "psum",
        "dense",
        "topk_allgather",
        "gtopk",
        "adaptive",
        "blockquant",
        "onebit",
        "threshold",
        "powersgd",
    )
    assert cost.ALGORITHMS == algorithms.planned()
    assert set(algorithms.planned()) <= {a.name for a in algorithms.registered()}
    assert algorithms.AUTO not in algorithms.names()


def test_every_target_is_a_registered_ffi_target():
    # The C++ library exports its registration table (ffi/registrations.h); the registry's
    # names must be registered ones, and a target without a CUDA handler (read from the
    # sources of ffi/cuda/, compiled in CUDA builds only) must be declared CPU-only.
    from test_registrations import cuda_definitions

    table = _ffi.registrations()
    cuda = cuda_definitions(pathlib.Path(__file__).resolve().parents[1])
    for record in algorithms.registered():
        for target in record.targets.values():
            assert target in table, (record.name, target)
            has_gpu = target in cuda
            assert has_gpu == (target not in record.cpu_only_targets), (record.name, target)
        assert record.cpu_only_targets <= set(record.targets.values()), record.name


def test_every_metrics_label_is_one_the_cpp_reports():
    sources = _cpp_sources()
    # The quantized handlers label their metrics with the quantizer table's names
    # (kernels/quantizer_table.h), which the library reports.
    quantizers = set(_ffi.quantizer_kinds())
    for record in algorithms.registered():
        for label in record.metric_labels:
            base = label.removeprefix("hierarchical_").removesuffix("_leader")
            # Hierarchical labels are assembled in C++ from "hierarchical_" + the inner name.
            found = f'"{label}"' in sources or f'"{base}"' in sources or base in quantizers
            assert found, (record.name, label)


def test_quantizers_are_the_entries_of_the_cpp_table():
    # A quantizer's kind number comes from the library's quantizer table, never from Python:
    # every registry quantizer has an entry there and every entry a registry module, and the
    # hierarchical forms send their base's number.
    table = _ffi.quantizer_kinds()
    assert {q.name: q.quantizer_kind for q in algorithms.quantizers()} == table
    for record in algorithms.registered():
        if record.quantizer is not None:
            assert record.quantizer_kind == table[record.quantizer], record.name
        if record.hierarchy is not None:
            assert record.quantizer == algorithms.get(record.hierarchy[0]).quantizer
        if record.quantizer is not None and record.hierarchy is None:
            sent = record.attributes(record.build(cost.Options()), 1024)["quantizer"]
            assert int(sent["kind"]) == table[record.quantizer], record.name
    assert algorithms.get("dense").quantizer_kind is None
    with pytest.raises(ValueError, match="no quantizer 'nosuch'"):
        _ffi.quantizer_kind("nosuch")


def test_specs_build_from_options_and_map_back():
    options = cost.Options(density=0.02, proportion=16.0, tau=0.5)
    for record in algorithms.registered():
        spec = record.build(options) if record.build else None
        if record.spec is None:
            assert spec is None, record.name
            continue
        assert isinstance(spec, record.spec), record.name
        if record.hierarchy is None:
            assert algorithms.of(spec) is record
        assert getattr(jaxcomm, record.spec.__name__) is record.spec  # public as jaxcomm.<Spec>
    assert algorithms.build("gtopk", options) == jaxcomm.GTopK(0.02)
    assert algorithms.build("adaptive", options) == jaxcomm.Adaptive(16.0)
    assert algorithms.build("threshold", options) == jaxcomm.Threshold(0.5)
    with pytest.raises(TypeError, match="algorithm must be one of"):
        algorithms.of(jaxcomm.TopK(0.1))
    with pytest.raises(ValueError, match="unknown algorithm 'nope'.*gtopk"):
        algorithms.get("nope")


def test_each_algorithm_lists_the_settings_it_reads(monkeypatch):
    # Algorithm.settings says which cost.Options fields an algorithm reads, and
    # AlgorithmCost.settings which ones only its cost model reads: its build reads no other
    # than its own, its cost record's byte ledger and time model no other than both (but the
    # cost model's own element_bytes).
    reading = {"on": True, "names": set()}

    def unrecorded(f):  # the checks and dataclasses.replace read every field: not the algorithm
        def call(*args, **kwargs):
            was, reading["on"] = reading["on"], False
            try:
                return f(*args, **kwargs)
            finally:
                reading["on"] = was

        return call

    monkeypatch.setattr(dataclasses, "replace", unrecorded(dataclasses.replace))

    class Recording(cost.Options):
        __post_init__ = unrecorded(cost.Options.__post_init__)

        def __getattribute__(self, name: str):
            if reading["on"] and not name.startswith("_"):
                reading["names"].add("density" if name == "k" else name)
            return super().__getattribute__(name)

    common = {s.name for s in cost.COMMON_SETTINGS}
    for record in algorithms.registered():
        reading["names"] = set()
        options = Recording()
        record.build(options)
        declared = {s.name for s in record.settings}
        assert reading["names"] <= declared, (record.name, reading["names"] - declared)
        world = cost.World(2, 2, "across_hosts")
        priced = cost.algorithm_costs.get(record.name)
        priced.bytes_sent(4096, world, options, 0)
        priced.time(cost.Tally(cost.DEFAULT_PROFILE), 4096, world, options)
        declared |= {s.name for s in priced.settings} | common
        assert reading["names"] <= declared, (record.name, reading["names"] - declared)
    assert cost.SETTINGS == cost.algorithm_costs.settings() + cost.COMMON_SETTINGS
    assert set(algorithms.settings()) < set(cost.algorithm_costs.settings())
    assert [f.name for f in dataclasses.fields(cost.Options)] == [s.name for s in cost.SETTINGS]


def test_a_setting_declared_twice_is_refused():
    twice = [
        algorithms.get("gtopk"),
        dataclasses.replace(
            algorithms.get("onebit"),
            settings=(dataclasses.replace(algorithms.get("gtopk").settings[0], default=0.5),),
        ),
    ]
    with pytest.raises(ImportError, match="'density' is declared by both 'gtopk' and 'onebit'"):
        collect_settings((a.name, a.settings) for a in twice)


def test_hierarchical_forms_follow_their_base():
    forms = {a.name: a for a in algorithms.registered() if a.hierarchy is not None}
    bases = [a for a in algorithms.registered() if a.hierarchical]
    assert {a.name for a in bases} == {"dense", "onebit", "threshold", "adaptive", "blockquant"}
    assert len(forms) == 2 * len(bases)
    leader = forms["hier_adaptive_leader"]
    assert leader.hierarchy == ("adaptive", "leader")
    assert leader.targets == {"flat": "jaxcomm_hierarchical_quantized"}
    assert leader.metric_labels == ("hierarchical_adaptive_leader",)
    assert leader.spec is jaxcomm.Adaptive and not leader.in_recipes
    # Every registered name, hierarchical forms included, has one cost record of that name.
    for record in algorithms.registered():
        assert cost.algorithm_costs.get(record.name).name == record.name
    assert cost.algorithm_costs.get("hier_dense").inter_bytes is None


# A new algorithm: one module and its cost module, nothing else. Its bytes and time are made up;
# what is checked is that the registry, the cost model (its new setting a field of
# cost.Options) and auto find it.
_NEW_MODULE = '''
"""``halfsum``: a made-up algorithm for the registry test."""

from __future__ import annotations

import dataclasses

from ._base import Algorithm, Setting


@dataclasses.dataclass(frozen=True)
class HalfSum:
    scale: float = 0.5


SCALE = Setting("scale", float, 0.5, lambda v: 0.0 < v <= 1.0, "in (0, 1]", "HalfSum's scale.")


ALGORITHM = Algorithm(
    name="halfsum",
    summary="made up",
    order=65,
    spec=HalfSum,
    targets={"flat": "jaxcomm_halfsum"},
    settings=(SCALE,),
    residual=True,
)
'''

_NEW_COST_MODULE = '''
"""The cost of ``halfsum``, made up for the registry test."""

from __future__ import annotations

from ._base import F32, AlgorithmCost


def _bytes(n, world, options, rank):
    return (world.ranks - 1) * n * F32 // 2


def _time(t, n, world, options):
    t.kernel("halve", n)
    if world.ranks > 1:
        t.send(world.flat_link(), world.ranks - 1, _bytes(n, world, options, 0))


COST = AlgorithmCost(
    name="halfsum",
    bytes_sent=_bytes,
    time=_time,
    kernels=("halve",),
    auto_rank=6,
    auto_default=True,
)
'''


def test_a_new_algorithm_is_one_module_and_its_cost(tmp_path):
    # A copy of jaxcomm's light modules plus one new module, its cost module (and its measured
    # constants in the cost model's data), loaded under another package name without JAX:
    # every listing and the cost model see the newcomer.
    copy = tmp_path / "jaxcomm_copy"
    shutil.copytree(
        ROOT / "jaxcomm",
        copy,
        ignore=lambda d, names: [
            n for n in names if n.endswith(".so") or n == "__pycache__" or n == "examples"
        ],
    )
    (copy / "algorithms" / "halfsum.py").write_text(_NEW_MODULE)
    (copy / "cost" / "algorithm_costs" / "halfsum.py").write_text(_NEW_COST_MODULE)
    # Its measured constants are data beside the cost model, not code.
    measured = json.loads((copy / "cost" / "default_profile.json").read_text())
    measured["profile"]["gamma"]["halve"] = 1e-9
    measured["profile_measured"]["gamma.halve"] = "made up for this test"
    (copy / "cost" / "default_profile.json").write_text(json.dumps(measured))
    code = f"""
import sys, types, importlib
pkg = types.ModuleType("light"); pkg.__path__ = [{str(copy)!r}]; sys.modules["light"] = pkg
algorithms = importlib.import_module("light.algorithms")
cost = importlib.import_module("light.cost")
assert algorithms.names()[-1] == "halfsum", algorithms.names()
assert "halfsum" in cost.ALGORITHMS and "halfsum" in cost.AUTO_CHOICES
assert "halfsum" in cost.DEFAULT_ALLOWED and "halve" in cost.KERNELS
world = cost.World(4, 1, "across_hosts")
assert cost.bytes_sent("halfsum", 1000, world) == 3 * 1000 * 4 // 2
assert cost.predict("halfsum", 1000, world).seconds > 0
assert "halfsum" in [p["algorithm"] for p in cost.plan([1000], world)["predictions"]]
assert type(algorithms.build("halfsum", cost.Options())).__name__ == "HalfSum"
assert cost.resolve_auto(cost.Auto(allowed=("halfsum",)), 1000, 4, 4, 1).scale == 0.5
assert algorithms.build("halfsum", cost.Options(scale=0.25)).scale == 0.25
assert "scale: HalfSum's scale." in cost.Options.__doc__
try:
    cost.Options(scale=2.0)
    raise AssertionError("Options(scale=2.0) passed")
except ValueError as e:
    assert str(e) == "Options.scale=2.0 is out of range: it must be in (0, 1], e.g. scale=0.5", e
assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxcomm")]
print("found")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "found", done.stderr[-3000:]
