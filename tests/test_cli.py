"""The CLI's promises: a job's args are checked before any rank starts, `launch --profile`
reaches the ranks, a failed probe keeps the old profile, exit codes in --help, completion."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from launcher_helpers import jaxcomm_cmd, run_cli, run_probe, write_recipe

from jaxcomm import cost


@pytest.mark.parametrize(
    ("job", "args", "expected"),
    [
        ("smoke", {"sise": 8}, ["args.sise: unknown key for job smoke", "allowed: size,"]),
        ("smoke", {"fail_mode": "boom"}, ["args.fail_mode", "'boom'", "'raise'"]),
        ("digits", {"hiden": 8}, ["args.hiden: unknown key for job digits", "hidden"]),
        ("bytes-lm", {"with": 8}, ["args.with: unknown key for job bytes-lm", "width"]),
        ("allreduce", {"sizes": [0]}, ["args.sizes.0", "greater than or equal to 1"]),
        ("probe", {"repeats": 0}, ["args.repeats", "greater than or equal to 1"]),
    ],
)
def test_a_typod_arg_exits_2_before_any_rank_starts(tmp_path, job, args, expected):
    recipe = write_recipe(tmp_path / "r.yaml", job=job, args=args)
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    for text in expected:
        assert text in res.stderr, (text, res.stderr)
    assert "Traceback" not in res.stderr and not out.exists()


def test_every_field_of_the_examples_config_is_an_arg():
    import dataclasses

    from jaxcomm_launcher.jobs.args import args_model

    from jaxcomm.examples import bytes_lm, digits

    for job, config in (
        ("digits", digits.DigitsConfig),
        ("lbann-mlp", digits.DigitsConfig),
        ("bytes-lm", bytes_lm.BytesLMConfig),
    ):
        assert list(args_model(job).model_fields) == [f.name for f in dataclasses.fields(config)]
    assert args_model("mymodule:train") is None  # a user's job: its args reach it unchecked


def test_plan_answers_without_checking_a_training_jobs_args(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", job="digits", args={"hiden": 8})
    res = run_cli("plan", str(recipe), cwd=tmp_path)
    assert res.returncode == 0 and "pick:" in res.stdout, res.stderr


_SHOW_PROFILE = (
    "def run(ctx):\n"
    "    ctx.print(f'profile={ctx.jaxcomm.profile} variant={ctx.variant}')\n"
    "    ctx.metrics.log(0, loss=1.0)\n"
)


def test_launch_profile_is_the_runs_profile(tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "show.py").write_text(_SHOW_PROFILE)
    profile = tmp_path / "p.json"
    cost.DEFAULT_PROFILE.save(profile)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        job="show:run",
        world={"processes": 1},
        pythonpath=["jobs"],
        jaxcomm={"algorithm": "auto", "profile": "/elsewhere/old.json"},
        sweep=[{"label": "a"}, {"label": "b", "profile": "/elsewhere/b.json"}],
    )
    out = tmp_path / "run"
    res = run_cli("launch", str(recipe), "--out", str(out), "--profile", "p.json", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    for label in ("a", "b"):
        assert f"profile={profile} variant={label}" in (out / label / "rank0.log").read_text()
        spec = json.loads((out / label / "spec.json").read_text())
        assert spec["jaxcomm"]["profile"] == str(profile)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = run_cli("launch", str(recipe), "--dry-run", "--profile", str(bad), cwd=tmp_path)
    assert res.returncode == 2 and "--profile" in res.stderr and str(bad) in res.stderr


def test_a_failed_probe_keeps_the_old_profile(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", world={"processes": 2})
    out = tmp_path / "profile.json"
    out.write_text('{"old": true}\n')
    res = run_probe(recipe, out, tmp_path, "--timeout", "0.001")
    assert res.returncode == 124, res.stdout + res.stderr
    assert out.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["profile.json", "r.yaml"]


def test_exit_codes_are_in_help(tmp_path):
    for args in ([], ["launch"], ["probe"]):
        res = run_cli(*args, "--help", cwd=tmp_path)
        assert res.returncode == 0
        text = " ".join(res.stdout.split())
        assert "Exit codes: 0 success" in text and "2 invalid recipe" in text, args
        assert "124 timeout" in text and "130 interrupted" in text


def _complete(words: str, tmp_path) -> list[str]:
    env = dict(
        os.environ,
        _JAXCOMM_COMPLETE="complete_bash",
        COMP_WORDS=words,
        COMP_CWORD=str(len(words.split()) - (0 if words.endswith(" ") else 1)),
    )
    cmd = jaxcomm_cmd()
    if len(cmd) > 1:
        pytest.skip("completion needs the installed `jaxcomm` script (its name sets the variable)")
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_shell_completion_of_commands_and_recipes(tmp_path):
    assert "launch" in _complete("jaxcomm la", tmp_path)
    (tmp_path / "mine.yaml").write_text("name: mine\n")
    got = _complete("jaxcomm launch ", tmp_path)
    assert {"digits-dense", "digits-gpu", "mine.yaml"} <= set(got)
    assert _complete("jaxcomm launch digits-g", tmp_path) == ["digits-gpu"]
    res = run_cli("--show-completion", "bash", cwd=tmp_path)
    assert res.returncode == 0 and "_JAXCOMM_COMPLETE" in res.stdout
