"""The cost model (jaxcomm.cost), `jaxcomm probe`, `jaxcomm plan` and algorithm="auto".

Byte counts are checked against jaxcomm.metrics() of real calls (tests/cost_worker.py);
times against the closed forms of the seeds (gTop-k paper Table I, nccl-tests bus
bandwidth), never against a clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pathlib
import subprocess

import pytest
from collectives_harness import run_script
from launcher_helpers import ROOT, run_cli, run_probe, write_recipe

import jaxcomm
from jaxcomm import algorithms, config, cost
from jaxcomm.cost.algorithm_costs import onebit

HERE = pathlib.Path(__file__).resolve().parent
SMALL = "JAXCOMM_SMALL_ALLREDUCE_BYTES"


@pytest.fixture(autouse=True)
def _declared_small_allreduce_limit(monkeypatch):
    """The in-process cases below are written for the declared default of the small-vector
    limit; a run with JAXCOMM_SMALL_ALLREDUCE_BYTES set (for the whole suite) pins it here. The
    rank processes of the metrics tests inherit the caller's setting, as the model does."""
    monkeypatch.delenv(SMALL, raising=False)
    cost.small_allreduce_bytes.cache_clear()
    yield
    cost.small_allreduce_bytes.cache_clear()


# One link class for everything, no kernels, no call overhead: the seeds' pure alpha-beta model.
ALPHA, BETA_WORD = 1e-4, 4e-9  # seconds per message, seconds per 4-byte word


def pure_profile(alpha: float = ALPHA, beta_word: float = BETA_WORD) -> cost.Profile:
    link = cost.Link(alpha, beta_word / 4)
    return cost.Profile(
        links={c: link for c in cost.LINK_CLASSES},
        gamma={k: 0.0 for k in cost.KERNELS},
        psum=link,
    )


# ---------------------------------------------------------------------------------------------
# Closed forms and hand-computed cases


@pytest.mark.parametrize("p", [2, 4, 8, 16, 32, 1024])
def test_gtopk_matches_table_one(p):
    # Shi et al. 2019, Table I / Eq. 7: 2 log2(P) alpha + 4 k log2(P) beta (beta per word).
    n, density = 1_000_000, 0.001
    k = math.ceil(density * n)
    pred = cost.predict("gtopk", n, cost.World(p), pure_profile(), cost.Options(density=density))
    expected = 2 * math.log2(p) * ALPHA + 4 * k * math.log2(p) * BETA_WORD
    assert pred.communication_seconds == pytest.approx(expected, rel=1e-12)
    assert pred.seconds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 64])
def test_topk_allgather_bandwidth_term_matches_table_one(p):
    # Table I: log(P) alpha + 2(P-1) k beta for a recursive-doubling allgather; jaxcomm's is a
    # ring, so the bandwidth term is the same and the latency term is (P-1) alpha.
    n, density = 500_000, 0.002
    k = math.ceil(density * n)
    options = cost.Options(density=density)
    bandwidth = cost.predict("topk_allgather", n, cost.World(p), pure_profile(0.0), options)
    assert bandwidth.seconds == pytest.approx(2 * (p - 1) * k * BETA_WORD, rel=1e-12)
    latency = cost.predict("topk_allgather", n, cost.World(p), pure_profile(beta_word=0.0), options)
    assert latency.seconds == pytest.approx((p - 1) * ALPHA, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 5, 8])
def test_ring_bus_bandwidth_is_the_link_bandwidth(p):
    # nccl-tests: busbw = algbw * 2(P-1)/P for allreduce; a bandwidth-optimal ring on links of
    # bandwidth B has busbw == B.
    n = 1_000_000 * p  # divisible by P
    t = cost.predict("dense", n, cost.World(p), pure_profile(0.0)).seconds
    algbw = n * 4 / t
    assert algbw * 2 * (p - 1) / p == pytest.approx(4 / BETA_WORD, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 7])
def test_allgather_bus_factor(p):
    # nccl-tests: allgather busbw factor (P-1)/P: each rank sends (P-1)/P of the gathered bytes.
    n, options = 100_000, cost.Options(density=0.01)
    gathered = p * 2 * options.k(n) * 4
    sent = cost.bytes_sent("topk_allgather", n, cost.World(p), options)
    assert sent == pytest.approx(gathered * (p - 1) / p)


def test_hand_computed_bytes():
    # Ring of 10 floats over 3 ranks: chunks 4, 3, 3; rank 0 skips chunks 1 and 2.
    assert [cost.ring_bytes(10, 3, r) for r in range(3)] == [56, 52, 52]
    # gTop-k, P = 3: rank 2 folds into rank 0; rank 0 broadcasts to 1 and unfolds to 2.
    assert [cost.gtopk_sends(r, 3) for r in range(3)] == [2, 1, 1]
    # P = 8: up the tree 1->0, 3->2, 5->4, 7->6, 2->0, 6->4, 4->0; down 0->4, 0->2, 4->6, 0->1, ...
    assert [cost.gtopk_sends(r, 8) for r in range(8)] == [3, 1, 2, 1, 3, 1, 2, 1]
    # One-bit over 2 ranks, 2048 elements: slices of 1024 -> 1 + 2 + 32 words each, sent once
    # in the reduce-scatter and once in the allgather.
    assert cost.quantized_bytes("onebit", 2048, 2, 0, cost.Options()) == 2 * 35 * 4


def test_options_agree_with_the_compressors():
    for n, d in itertools.product([1, 7, 1000, 12345], [1e-4, 0.01, 0.5, 1.0]):
        assert cost.Options(density=d).k(n) == jaxcomm.TopK(d).k(n)
    for n in [1, 31, 32, 1024, 5000]:
        words = onebit._words(n, cost.Options(), 2, "send")  # one slice's used words
        assert words == jaxcomm.OneBit().packed_words(n)


@pytest.mark.parametrize("algorithm", cost.ALGORITHMS)
def test_time_and_bytes_grow_with_n(algorithm):
    world = cost.World(4, 2, "across_hosts")
    prev_t = prev_b = -1.0
    for n in [0, 1, 1000, 100_000, 1_000_000, 25_000_000]:
        p = cost.predict(algorithm, n, world)
        assert p.seconds >= prev_t and p.bytes_sent_per_rank >= prev_b
        prev_t, prev_b = p.seconds, p.bytes_sent_per_rank


def test_slower_links_never_help_and_compression_wins_on_slow_networks():
    n = 25_000_000
    for algorithm in cost.ALGORITHMS:
        near = cost.predict(algorithm, n, cost.World(4, 1, "same_host")).seconds
        far = cost.predict(algorithm, n, cost.World(4, 1, "across_hosts")).seconds
        assert far >= near
    options = cost.Options(density=0.001)
    far = cost.World(4, 1, "across_hosts")
    assert cost.choose(n, far, ("dense", "gtopk"), options=options) == "gtopk"
    # With free links compression only costs compute: dense wins.
    free = cost.Profile(
        links={c: cost.Link(0.0, 0.0) for c in cost.LINK_CLASSES},
        gamma=cost.DEFAULT_PROFILE.gamma,
        psum=cost.Link(0.0, 0.0),
    )
    assert cost.choose(n, far, ("dense", "gtopk"), free, options) == "dense"


def test_sparse_bytes_scale_as_the_papers_say():
    n, options = 1_000_000, cost.Options(density=0.001)
    for p in [2, 4, 8, 16, 64]:
        ag = cost.bytes_sent("topk_allgather", n, cost.World(p), options)
        gt = cost.bytes_sent("gtopk", n, cost.World(p), options)
        assert gt <= ag
        assert ag == (p - 1) * 2 * options.k(n) * 4  # O(kP)
        assert gt == pytest.approx(2 * (p - 1) / p * 2 * options.k(n) * 4)  # mean over ranks
    # Dense ring: 2(P-1)/P of the vector per rank; on one host the shared-memory path moves
    # as much (its notices go through shared memory and send nothing).
    across = cost.World(8, 1, "across_hosts")
    assert cost.bytes_sent("dense", 80000, across) == pytest.approx(2 * 7 / 8 * 80000 * 4)
    assert cost.bytes_sent("dense", 80000, cost.World(8)) == 2 * 7 / 8 * 80000 * 4
    # Up to 32 KiB: recursive doubling sends the whole vector log2(P) times, the one-shot
    # lets each of the P - 1 peers read all of it.
    assert cost.bytes_sent("dense", 8000, across) == 3 * 8000 * 4
    assert cost.bytes_sent("dense", 8000, cost.World(8)) == 7 * 8000 * 4


def test_small_schedule_bytes_by_hand():
    # P = 6: p2 = 4, ranks 0-3 fold in pairs (0 -> 1, 2 -> 3); 1, 3, 4, 5 exchange twice; the
    # odd ones of a pair also send the result back.
    assert [cost.doubling_bytes(10, 6, r) for r in range(6)] == [40, 120, 40, 120, 80, 80]
    assert [cost.doubling_bytes(10, 4, r) for r in range(4)] == [80] * 4
    assert cost.doubling_bytes(10, 1, 0) == cost.oneshot_bytes(10, 1, 0) == 0
    limit = cost.small_allreduce_bytes()
    assert limit == int(config.SETTINGS[SMALL].default)  # the one declaration of the default
    n = limit // 4
    assert cost.dense_bytes(n, 4, 0, shared_memory=False) == cost.doubling_bytes(n, 4, 0)
    assert cost.dense_bytes(n + 1, 4, 0, shared_memory=False) == cost.ring_bytes(n + 1, 4, 0)
    assert cost.dense_bytes(n, 4, 0, shared_memory=True) == cost.oneshot_bytes(n, 4, 0)
    assert cost.dense_bytes(n + 1, 4, 0, shared_memory=True) == cost.direct_bytes(n + 1, 4, 0)


def test_overlap_hides_communication_only():
    world, n = cost.World(4, 1, "across_hosts"), 4_000_000
    plain = cost.predict("dense", n, world)
    hidden = cost.predict("dense", n, world, overlap=True, hidden_seconds=1.0)
    assert hidden.seconds == pytest.approx(plain.compute_seconds)
    partly = cost.predict("dense", n, world, overlap=True, hidden_seconds=0.01)
    assert partly.seconds == pytest.approx(plain.seconds - 0.01)


def test_bad_inputs_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="unknown algorithm"):
        cost.predict("bf16", 10, cost.World(2))
    with pytest.raises(ValueError, match="World.processes"):
        cost.World(0)
    with pytest.raises(ValueError, match="inter_process"):
        cost.World(2, 1, "moon")
    with pytest.raises(ValueError, match="density"):
        cost.Options(density=2.0)
    with pytest.raises(ValueError, match="n \\(elements\\)"):
        cost.bytes_sent("dense", -1, cost.World(2))
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="p.json"):
        cost.Profile.load(bad)


def test_profile_round_trip(tmp_path):
    path = tmp_path / "profile.json"
    cost.DEFAULT_PROFILE.save(path)
    assert cost.Profile.load(path) == cost.DEFAULT_PROFILE
    partial = {"version": 1, "links": {"same_host": {"alpha": 1e-3, "beta": 1e-9}}}
    loaded = cost.Profile.from_json(partial)
    assert loaded.links["same_host"] == cost.Link(1e-3, 1e-9)
    assert loaded.gamma == cost.DEFAULT_PROFILE.gamma  # the rest comes from the default


# ---------------------------------------------------------------------------------------------
# Bytes == jaxcomm.metrics() of real calls


@pytest.mark.parametrize("devices,n", [(4, 10_001), (6, 50_001)])
def test_predicted_bytes_equal_measured_metrics(devices, n):
    done = run_script(HERE / "cost_worker.py", devices, n, timeout=240, cwd=HERE.parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    # The worker's inputs: identical on every rank, alternating signs, |x| > tau everywhere.
    options = cost.Options(density=0.01, threshold_fraction=1.0, selection_overlap=1.0)
    assert set(measured) >= {"dense", "gtopk", "topk_allgather", "onebit", "adaptive", "hier_dense"}
    # bf16 on one host: the shared-memory schedule at 2 bytes per element.
    half = measured.pop("dense_bf16")
    assert len(half) == devices
    wire16 = cost.Options(element_bytes=2)
    for rank, sent in half.items():
        assert cost.bytes_sent("dense", n, cost.World(1, devices), wire16, int(rank)) == sent, rank
    for algorithm, per_rank in measured.items():
        hier = algorithm.startswith("hier_")
        world = cost.World(2, devices // 2) if hier else cost.World(1, devices)
        assert len(per_rank) == devices
        for rank, sent in per_rank.items():
            predicted = cost.bytes_sent(algorithm, n, world, options, int(rank))
            assert predicted == sent, (algorithm, rank)


# ---------------------------------------------------------------------------------------------
# auto


def test_choose_never_leaves_allowed():
    names = cost.AUTO_CHOICES
    for r in range(1, 4):
        for allowed in itertools.combinations(names, r):
            for world in (cost.World(2), cost.World(4, 2, "across_hosts"), cost.World(1, 8)):
                for n in (1, 10_000, 25_000_000):
                    assert cost.choose(n, world, allowed) in allowed
                    if "dense" in allowed or any(a in allowed for a in cost.QUANTIZER_KINDS):
                        assert cost.choose(n, world, allowed, hierarchical=True) in allowed
    with pytest.raises(ValueError, match="Auto.allowed"):
        cost.Auto(allowed=("dense", "bf16"))
    with pytest.raises(ValueError, match="hierarchical"):
        cost.choose(10, cost.World(2, 2), ("gtopk",), hierarchical=True)


def test_auto_weighs_time_to_target_not_step_time():
    """The pick minimizes (seconds + the step's compute share) x steps relative to dense.
    digits-small's 4810-element gradient on 2 emulated nodes: topk_allgather's call is
    predicted a hair faster than dense's, but it needed 421 steps to dense's 211 (docs/e2e.md),
    and the step's compute is paid again by every extra step: dense wins."""
    profile = cost.Profile(
        links={
            **cost.DEFAULT_PROFILE.links,
            "across_hosts": cost.Link(alpha=0.0, beta=8.4e-9),  # as probed, alpha fitted to 0
        },
        gamma=cost.DEFAULT_PROFILE.gamma,
        psum=cost.DEFAULT_PROFILE.psum,
    )
    world = cost.World(2, 1, "across_hosts")
    allowed = ("dense", "topk_allgather")
    no_factor = {"dense": 1.0, "topk_allgather": 1.0}
    assert cost.choose(4810, world, allowed, profile, steps_factor=no_factor) == "topk_allgather"
    assert cost.choose(4810, world, allowed, profile, compute_seconds=4e-4) == "dense"
    # A big gradient on a slow link still pays for the extra steps.
    assert cost.choose(16_777_216, world, allowed, profile, compute_seconds=0.12) != "dense"
    assert cost.steps_factor_of("topk_allgather") == cost.DEFAULT_STEPS_FACTOR["topk_allgather"]
    assert cost.DEFAULT_STEPS_FACTOR["dense"] == 1.0
    picked = cost.plan([4810], world, profile, algorithms=allowed, compute_seconds=4e-4)["pick"]
    assert picked["algorithm"] == "dense" and picked["steps_factor"] == 1.0
    # The same through Auto, with each bucket's share of the step's compute.
    auto = cost.Auto(allowed=allowed, profile=profile, compute_seconds=4e-4)
    assert cost.resolve_auto(auto, 4810, 2, 2, 1, share=1.0) is None
    for bad in ({"gtopk": 0.0}, {"gtopk": float("nan")}):
        with pytest.raises(ValueError, match="steps_factor"):
            cost.Auto(allowed=("gtopk",), steps_factor=bad)
    with pytest.raises(ValueError, match="compute_seconds"):
        cost.Auto(compute_seconds=-1.0)


def test_warmup_pays_weighs_the_warmups_seconds_against_its_steps():
    """lbann-mlp at 100 Mbit/s (docs/e2e.md): the warm-up's first phase (density 0.25) makes a
    sparse step cost seconds, and dropping the warm-up costs steps. auto keeps the warm-up when
    dropping it costs many steps, drops it when it costs few, and follows the schedule when
    nothing measured says otherwise. The predicted times are the phases' step times by hand."""
    link = cost.Link(alpha=1e-4, beta=8e-8)  # 100 Mbit/s
    profile = cost.Profile(
        links={c: link for c in cost.LINK_CLASSES}, gamma=cost.DEFAULT_PROFILE.gamma, psum=link
    )
    buckets, starts, densities = [16_777_216, 16_777_216, 300_000], [0, 36], [0.25, 0.001]
    common = dict(allowed=("gtopk",), profile=profile, compute_seconds=0.25, dense_steps=131)
    args = (buckets, starts, densities, 2, 2, 1)

    def step(density: float) -> float:
        options = cost.Options(density=density)
        world = cost.World(2, 1, profile.inter_process)
        return 0.25 + sum(
            cost.predict("gtopk", n, world, profile, options).seconds for n in buckets
        )

    followed = cost.warmup_pays(cost.Auto(**common, steps_factor={"gtopk": 1.0}), *args)
    assert followed == {
        "warmup": True, "with_s": None, "without_s": None, "choices": [["gtopk"] * 3] * 2,
    }  # fmt: skip
    cheap = cost.Auto(**common, steps_factor={"gtopk": 1.0}, steps_factor_no_warmup={"gtopk": 1.6})
    decision = cost.warmup_pays(cheap, *args)
    assert decision["with_s"] == pytest.approx(36 * step(0.25) + (131 - 36) * step(0.001))
    assert decision["without_s"] == pytest.approx(131 * 1.6 * step(0.001))
    assert step(0.25) > 5 * step(0.001)  # the premise: the warm-up's steps are expensive
    assert decision["warmup"] is False
    costly = dataclasses.replace(cheap, steps_factor_no_warmup={"gtopk": 20.0})
    assert cost.warmup_pays(costly, *args)["warmup"] is True
    assert any("warmup_decision" in d for d in cost.auto_decisions())
    with pytest.raises(ValueError, match="starts"):
        cost.warmup_pays(cheap, buckets, [5, 36], densities, 2, 2, 1)
    with pytest.raises(ValueError, match="dense_steps"):
        cost.Auto(dense_steps=0)
    with pytest.raises(ValueError, match="steps_factor"):
        cost.Auto(allowed=("gtopk",), steps_factor_no_warmup={"gtopk": -1.0})


def test_auto_weighs_dense_16_bit_wire_for_16_bit_gradients():
    """bytes-lm on 2 nodes at 1 Gbit/s (docs/e2e.md): with float32 gradients adaptive's call is
    predicted well under dense's, but a bf16 gradient goes on dense's 16-bit wire at half the
    bytes, and with the step's compute and adaptive's extra steps dense is then the pick."""
    world = cost.World(2, 1, "across_hosts")
    measured = {"sum": 6.7e-10, "quantize.adaptive": 4.6e-9, "decode.adaptive": 3.5e-10}
    profile = cost.Profile(  # as probed on the emulated 1 Gbit/s link, alpha fitted to 0
        links={**cost.DEFAULT_PROFILE.links, "across_hosts": cost.Link(alpha=0.0, beta=8.2e-9)},
        gamma={**cost.DEFAULT_PROFILE.gamma, **measured},
        psum=cost.DEFAULT_PROFILE.psum,
        inter_process="across_hosts",
    )
    n, allowed, compute = 3_300_000, ("dense", "adaptive"), 0.112
    f32 = cost.predict("dense", n, world, profile)
    f16 = cost.predict("dense", n, world, profile, cost.Options(element_bytes=2))
    assert f16.bytes_sent_per_rank == f32.bytes_sent_per_rank / 2
    assert f16.seconds < f32.seconds
    assert cost.choose(n, world, allowed, profile, compute_seconds=compute) == "adaptive"
    half = cost.Options(element_bytes=2)
    assert cost.choose(n, world, allowed, profile, half, compute_seconds=compute) == "dense"
    auto = cost.Auto(allowed=allowed, profile=profile, compute_seconds=compute)
    assert cost.resolve_auto(auto, n, 2, 2, 1, element_bytes=2) is None
    assert cost.auto_decisions()[-1]["element_bytes"] == 2
    assert cost.resolve_auto(auto, n, 2, 2, 1) == jaxcomm.Adaptive()
    with pytest.raises(ValueError, match="element_bytes"):
        cost.Options(element_bytes=3)


def test_resolve_auto_builds_the_chosen_compressor(tmp_path):
    auto = cost.Auto(allowed=("gtopk",), options=cost.Options(density=0.01))
    assert cost.resolve_auto(auto, 1000, 4, 2, 2) == jaxcomm.GTopK(0.01)
    assert cost.resolve_auto(cost.Auto(allowed=("dense",)), 10**7, 4, 4, 1) is None
    # A profile file is read once, at construction.
    path = tmp_path / "p.json"
    cost.DEFAULT_PROFILE.save(path)
    assert cost.Auto(profile=str(path)).resolved_profile() == cost.DEFAULT_PROFILE
    assert cost.auto_decisions()[-1]["choice"] == "dense"


def test_auto_chooses_identically_on_every_rank(tmp_path):
    # 2 processes x 2 devices train the digits MLP with algorithm: auto; each rank logs its
    # choice per bucket. Only gtopk and onebit are allowed (dense would win so small a model).
    recipe = write_recipe(
        tmp_path / "auto.yaml",
        job="digits",
        world={"processes": 2, "devices_per_process": 2},
        jaxcomm={"algorithm": "auto", "allowed": ["gtopk", "onebit"], "density": 0.05},
        train={"steps": 3, "eval_every": 10},
        args={"warmup": False},
    )
    done = run_cli("launch", str(recipe), "--out", str(tmp_path / "run"), "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    choices = []
    for log in sorted((tmp_path / "run").rglob("rank*.log")):
        lines = [ln for ln in log.read_text().splitlines() if "digits auto: bucket" in ln]
        assert lines, log
        choices.append([ln.split("digits auto:", 1)[1] for ln in lines])
    assert len(choices) == 2 and choices[0] == choices[1]
    assert all("-> gtopk" in c or "-> onebit" in c for c in choices[0])


# ---------------------------------------------------------------------------------------------
# plan and probe


def _plan(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return run_cli("plan", *args, cwd=cwd)


def test_plan_json_schema(tmp_path):
    done = _plan(str(ROOT / "recipes" / "emulated-1gbit.yaml"), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"pick", "predictions"}
    keys = {
        "algorithm",
        "elements",
        "processes",
        "devices_per_process",
        "bytes_sent_per_rank",
        "seconds",
    }
    sizes = [16384, 262144, 4194304]  # the recipe's args.sizes
    assert all(set(p) == keys for p in out["predictions"])
    assert {p["algorithm"] for p in out["predictions"]} == set(cost.ALGORITHMS)
    assert sorted({p["elements"] for p in out["predictions"]}) == sizes
    assert all(p["processes"] == 4 and p["devices_per_process"] == 1 for p in out["predictions"])
    assert out["pick"]["algorithm"] in cost.ALGORITHMS
    assert out["pick"]["elements"] == sum(sizes)
    # The pick has the least predicted time to target over the whole step: its seconds times
    # the steps it needs relative to dense; not the leaf-shaped powersgd, whose row is a bound
    # (each size as a near-square matrix), listed but not picked unless allowed.
    totals = {
        a: sum(p["seconds"] for p in out["predictions"] if p["algorithm"] == a)
        * cost.steps_factor_of(a)
        for a in cost.ALGORITHMS
        if algorithms.get(a).leafwise is None
    }
    assert "powersgd" in {p["algorithm"] for p in out["predictions"]}
    pick = out["pick"]
    assert pick["seconds"] * pick["steps_factor"] == pytest.approx(min(totals.values()))
    # The same model, called directly, gives the same numbers.
    row = next(
        p for p in out["predictions"] if p["algorithm"] == "gtopk" and p["elements"] == 16384
    )
    direct = cost.predict("gtopk", 16384, cost.World(4, 1, "across_hosts"))
    assert row["bytes_sent_per_rank"] == direct.bytes_sent_per_rank


def test_plan_table_allowed_profile_and_dry_run(tmp_path):
    profile = tmp_path / "p.json"
    cost.DEFAULT_PROFILE.save(profile)
    recipe = str(ROOT / "recipes" / "digits-dense.yaml")
    done = _plan(recipe, "--profile", str(profile), "--allowed", "dense,gtopk", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "4810" in done.stdout  # the MLP's parameter count
    pick = [ln for ln in done.stdout.splitlines() if ln.startswith("pick:")]
    assert pick and pick[0].split()[1] in ("dense", "gtopk")
    bad = _plan(recipe, "--allowed", "dense,bf16", cwd=tmp_path)
    assert bad.returncode == 2 and "bf16" in bad.stderr
    bad_profile = tmp_path / "bad.json"
    bad_profile.write_text("not json")
    assert _plan(recipe, "--profile", str(bad_profile), cwd=tmp_path).returncode == 2
    custom = write_recipe(tmp_path / "custom.yaml", job="mymod:run")
    unknown = _plan(str(custom), cwd=tmp_path)
    assert unknown.returncode == 2 and "--elements" in unknown.stderr
    assert _plan(str(custom), "--elements", "1000", cwd=tmp_path).returncode == 0
    # Overlap on with a long backward pass hides all communication: only kernels remain.
    hidden = _plan(
        str(custom), "--elements", "1000000", "--overlap-ms", "1e6", "--json", cwd=tmp_path
    )
    rows = json.loads(hidden.stdout)["predictions"]
    dense = next(r for r in rows if r["algorithm"] == "dense")
    world = cost.World(2)
    assert dense["seconds"] == pytest.approx(
        cost.predict("dense", 1_000_000, world).compute_seconds
    )
    dry = run_cli("launch", recipe, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "# pick:" in dry.stdout and "# plan for digits-dense" in dry.stdout


@pytest.mark.parametrize("model,hidden", [("mlp", 64), ("mlp", 7), ("cnn", 32)])
def test_plan_counts_digits_parameters_like_flax(model, hidden):
    import jax
    import numpy as np
    from jaxcomm_launcher.cli import _digits_parameters

    from jaxcomm.examples import digits

    net = digits.MLP(hidden) if model == "mlp" else digits.CNN(hidden)
    params = jax.eval_shape(net.init, jax.random.key(0), jax.numpy.zeros((1, 64)))
    count = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    assert _digits_parameters(model, hidden) == count


def test_probe_on_a_local_world_writes_a_valid_profile(tmp_path):
    recipe = write_recipe(tmp_path / "w.yaml", world={"processes": 2, "devices_per_process": 2})
    out = tmp_path / "profile.json"
    sizes = ("--sizes", "1024", "--sizes", "262144", "--kernel-elements", "65536")
    done = run_probe(recipe, out, tmp_path, *sizes, "--repeats", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    profile = cost.Profile.load(out)
    data = json.loads(out.read_text())
    assert data["world"] == {"processes": 2, "devices_per_process": 2, "backend": "local"}
    assert profile.inter_process == "same_host"
    measured = set(profile.measured)
    assert {"links.same_host", "links.same_process", "psum", "call"} <= measured
    assert {f"gamma.{k}" for k in cost.KERNELS} <= measured
    assert "links.across_hosts" not in measured  # a local world cannot measure it
    assert profile.links["same_host"].beta > 0 and profile.gamma["topk"] > 0
    # alpha comes from its own latency test (a 2-element allreduce), not from the sizes' fit.
    medians = data["samples"]["medians"]
    assert {"ring.same_host.2", "ring.same_host.1024", "ring.same_process.2"} <= set(medians)
    # gTop-k is calibrated inside the collective at the warm-up's first density too, where
    # each selected entry and its merge take the time (lbann-mlp: -38 % without it).
    assert {"calibration.gtopk", "calibration.gtopk.wide"} <= set(medians)
    # plan reads it.
    planned = _plan(str(recipe), "--profile", str(out), "--elements", "100000", cwd=tmp_path)
    assert planned.returncode == 0 and "pick:" in planned.stdout


# ---------------------------------------------------------------------------------------------
# The model is light and reads the library's settings the way the library does


def _fresh_python(
    code: str, env: dict | None = None, flags: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    import os
    import sys

    environ = {k: v for k, v in os.environ.items() if k != SMALL}
    return subprocess.run(
        [sys.executable, *flags, "-c", code],
        capture_output=True,
        text=True,
        cwd="/",
        env={**environ, **(env or {})},
        timeout=240,
    )


def test_cost_loads_without_jax_or_the_library():
    # What `jaxcomm plan` does: the cost model and the registry, imported plainly, without
    # JAX or the library.
    done = _fresh_python(
        "import sys\n"
        "from jaxcomm import algorithms, cost\n"
        "p = cost.predict('gtopk', 1000, cost.World(4), options=cost.Options(density=0.01))\n"
        "assert p.bytes_sent_per_rank == 120.0, p\n"
        "assert algorithms.names()[0] == 'psum'\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
        "heavy += sorted(m for m in sys.modules if m.startswith(('jaxcomm._ffi', 'jaxcomm.collectives')))\n"
        "assert not heavy, heavy\n"
        "assert not any('jaxcomm_ffi' in str(getattr(m, '__file__', '')) for m in sys.modules.values())\n"
        "print('light')\n"
    )
    assert done.returncode == 0 and done.stdout.strip() == "light", done.stderr[-3000:]


def test_import_jaxcomm_cost_loads_no_jax():
    # The package import is light (jaxcomm/__init__.py loads the JAX API on first use), so
    # `import jaxcomm.cost` imports neither JAX nor the library: -X importtime lists every
    # module imported, and the cost model still works.
    done = _fresh_python(
        "import sys, jaxcomm.cost as cost\n"
        "p = cost.predict('gtopk', 1000, cost.World(4), options=cost.Options(density=0.01))\n"
        "assert p.bytes_sent_per_rank == 120.0, p\n"
        "assert not any('jaxcomm_ffi' in str(getattr(m, '__file__', '')) "
        "for m in sys.modules.values())\n",
        flags=("-X", "importtime"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "jaxcomm.cost" in imported, done.stderr[-3000:]
    heavy = [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "numpy")]
    assert not heavy, heavy


def test_light_modules_import_only_light_modules():
    # The launcher imports jaxcomm.cost and jaxcomm.algorithms in its own process: they reach
    # their siblings by relative imports, and at module level import nothing of JAX, the FFI,
    # the collectives or optax (no import graph arrow back from cost to the package that
    # imports cost).
    import ast

    light = {"_checks", "config", "algorithms", "cost"}
    paths = [ROOT / "jaxcomm" / "config.py", ROOT / "jaxcomm" / "_checks.py"]
    paths += [*(ROOT / "jaxcomm" / "cost").glob("*.py")]
    paths += [*(ROOT / "jaxcomm" / "algorithms").glob("*.py")]
    for path in paths:
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: must stay inside the light modules
                    base = (node.module or "").split(".")[0]
                    names = [base] if base else [a.name for a in node.names]
                    assert all(
                        n in light or n.startswith("_") or path.parent.name != "jaxcomm"
                        for n in names
                    ), (path, names)
                    continue
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert top not in ("jax", "jaxlib", "numpy", "jaxcomm"), (path, module)


@pytest.mark.parametrize("setting", [None, "0", "4096"])
def test_small_allreduce_limit_is_the_librarys(setting):
    # The model reads JAXCOMM_SMALL_ALLREDUCE_BYTES through jaxcomm.config (no library call);
    # the C++ library reads the same variable, with the default jaxcomm.config declares.
    done = _fresh_python(
        "import jaxcomm\n"
        "from jaxcomm import _ffi, cost\n"
        "print(cost.small_allreduce_bytes(), _ffi.library().jaxcomm_allreduce_small_bytes())\n",
        env={SMALL: setting} if setting is not None else None,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    model, library = (int(v) for v in done.stdout.split())
    expected = int(setting if setting is not None else config.SETTINGS[SMALL].default)
    assert model == library == expected


def test_probe_calibrates_each_kernel_with_its_own_collective():
    """The probe's gamma calibration: "gtopk.wide" scales topk.entry and merge by its own
    collective's time, and a first calibration that the rest explains (a noisy sample under
    load skips it) does not stop the next (it once raised KeyError: 'gtopk' on a busy
    machine, and scaled the wide kernels by gtopk's factor)."""
    from jaxcomm.cost.fit import calibrate_gamma

    world = cost.World(2, 1, "same_host")
    base = {"version": 1, "links": {}, "call": 0.0, "inter_process": "same_host"}
    n = 1 << 20
    wide = cost.Options(density=0.25)
    kernels = {"gtopk": (("topk",), cost.Options()), "gtopk.wide": (("topk.entry", "merge"), wide)}
    profile = cost.Profile.from_json(dict(base, gamma=dict(cost.DEFAULT_PROFILE.gamma)))
    predicted = cost.predict("gtopk", n, world, profile, wide).seconds
    gamma = dict(cost.DEFAULT_PROFILE.gamma)
    scales = calibrate_gamma(
        gamma, kernels, {"gtopk": 0.0, "gtopk.wide": 3 * predicted}, base, world, n
    )
    assert list(scales) == ["gtopk.wide"] and scales["gtopk.wide"] > 1.0
    assert gamma["topk"] == cost.DEFAULT_PROFILE.gamma["topk"]  # skipped: as the ops measured
    for name in ("topk.entry", "merge"):
        assert gamma[name] == pytest.approx(cost.DEFAULT_PROFILE.gamma[name] * scales["gtopk.wide"])
    # The calibrated profile predicts the measured time of the wide collective.
    after = cost.Profile.from_json(dict(base, gamma=gamma))
    assert cost.predict("gtopk", n, world, after, wide).seconds == pytest.approx(3 * predicted)


def test_measured_constants_are_data_that_say_where_they_come_from():
    # The default profile and the steps factors live in jaxcomm/cost/default_profile.json, each
    # value with where and how it was measured; no algorithm module holds a measured number.
    data = json.loads(cost.model.MEASURED_FILE.read_text())
    notes = data["profile_measured"]
    assert set(cost.KERNELS) == set(data["profile"]["gamma"])
    for kernel in cost.KERNELS:
        assert notes[f"gamma.{kernel}"].strip(), kernel
    for key in ("psum", "call", *(f"links.{c}" for c in cost.LINK_CLASSES)):
        assert notes[key].strip(), key
    assert set(data["steps_factor"]) == set(cost.AUTO_CHOICES)
    for name, entry in data["steps_factor"].items():
        assert entry["measured"].strip() and cost.DEFAULT_STEPS_FACTOR[name] == entry["factor"]
    assert cost.DEFAULT_PROFILE.gamma == {k: data["profile"]["gamma"][k] for k in cost.KERNELS}
    for record in algorithms.registered():
        priced = cost.algorithm_costs.get(record.name)
        assert all(isinstance(k, str) for k in priced.kernels), record.name
        assert not hasattr(record, "steps_factor") and not hasattr(priced, "steps_factor")
