"""The end-to-end workloads through the launcher, a few steps each (the full runs are
benchmarks/train.py): lbann-mlp with bf16 psum, the bf16 jaxcomm wire and adaptive; bytes-lm
with psum and gTop-k; and benchmarks/train.py's table/JSON/PNG on a tiny lbann-mlp run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from launcher_helpers import ROOT, run_cli


def _recipe(tmp_path, workload: str, sweep: list[dict], train: dict, args: dict):
    data = yaml.safe_load((ROOT / "recipes" / f"{workload}.yaml").read_text())
    data["sweep"] = sweep
    data["world"] = {"processes": 2, "devices_per_process": 1}
    data["train"].update(train)
    data["args"].update(args)
    data["timeout"] = 600
    path = tmp_path / f"{workload}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.timeout(660)  # the launch's own 600 s bound decides, not pytest's 300 s
def test_lbann_mlp_few_steps(tmp_path):
    pytest.importorskip("sklearn")
    recipe = _recipe(
        tmp_path,
        "lbann-mlp",
        [
            {"algorithm": "psum", "grad_dtype": "bfloat16"},
            {"algorithm": "dense", "grad_dtype": "bfloat16"},
            {"algorithm": "adaptive"},
        ],
        {"steps": 4, "hidden": 256, "eval_every": 2},
        {},
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    results = {
        r["label"]: r for r in (json.loads(p.read_text()) for p in out.rglob("digits-mlp-*.json"))
    }
    assert set(results) == {"psum-bf16", "dense-bf16", "adaptive"}
    for r in results.values():
        assert r["parameters"] == 64 * 256 + 2 * 256 * 256 + 256 * 10 + 3 * 256 + 10
        assert [h["step"] for h in r["history"]] == [0, 2, 3]
        assert all(h["loss"] == h["loss"] for h in r["history"])  # finite, not NaN
    dense_bf16 = results["dense-bf16"]
    # 2 bytes per element on jaxcomm's 16-bit wire: half of the float32 ring.
    assert dense_bf16["bytes_sent_per_step"] == pytest.approx(
        dense_bf16["dense_bytes_per_step"] / 2, rel=1e-3
    )
    assert results["adaptive"]["bytes_sent_per_step"] < dense_bf16["bytes_sent_per_step"] / 4


@pytest.mark.timeout(660)  # the launch's own 600 s bound decides, not pytest's 300 s
def test_bytes_lm_few_steps(tmp_path):
    recipe = _recipe(
        tmp_path,
        "bytes-lm",
        [{"algorithm": "psum"}, {"algorithm": "gtopk", "density": 0.05}],
        {"steps": 3, "batch_size": 4, "eval_every": 2},
        {
            "width": 32,
            "layers": 1,
            "heads": 2,
            "seq_len": 32,
            "max_corpus_bytes": 200_000,
            "eval_sequences": 8,
        },
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), "-q", cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    results = {
        r["label"]: r for r in (json.loads(p.read_text()) for p in out.rglob("bytes-lm-*.json"))
    }
    assert set(results) == {"psum", "gtopk"}
    for r in results.values():
        assert r["corpus_bytes"] == 200_000
        assert 0 < r["validation_bits_per_byte"] < 9  # untrained: about log2(256) = 8
    assert 0 < results["gtopk"]["bytes_sent_per_step"] < results["psum"]["bytes_sent_per_step"]


@pytest.mark.timeout(660)  # the launch's own 600 s bound decides, not pytest's 300 s
def test_train_benchmark_writes_table_json_and_plot(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    res = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "train.py"),
            "--steps",
            "3",
            "--eval-every",
            "1",
            "--processes",
            "2",
            "--train",
            "hidden=128",
            "--algorithms",
            "psum",
            "gtopk",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "to target" in res.stdout and "gtopk" in res.stdout
    summary = json.loads((tmp_path / "train-lbann-mlp-local.json").read_text())
    assert {r["algorithm"] for r in summary["rows"]} == {"psum", "gtopk"}
    psum = next(r for r in summary["rows"] if r["algorithm"] == "psum")
    assert psum["time_to_target_s"] is not None  # psum reaches its own final accuracy
    assert (tmp_path / "train-lbann-mlp-local.png").exists()
