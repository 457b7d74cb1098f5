"""``slurm``: render an sbatch script (one ``srun`` step per sweep entry), submit, follow.

The script runs each sweep entry as one ``srun`` step whose tasks write ``rank<R>.log``
(``srun --output=.../rank%t.log``) next to their metrics; ``srun``'s own messages go to
``srun.log`` and the step's exit status and times to ``step.json``. Ranks take their rank,
size and coordinator from Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, the first node of the
step; see :func:`jaxcomm_launcher.worker.coordinator_address`). The script ends with
``jaxcomm report``, so a detached run gets its summary and plots without the launcher.

``jaxcomm launch`` submits the script, then follows the job (``--detach``: only submits): it
shows the job's state and the running entry's progress, echoes the rank logs as they grow,
runs ``scancel`` on Ctrl-C or timeout, and at the end reads the step files
(:func:`collect`) into ``run.json`` and writes ``summary.json``, the table and the plots as
the other backends do. The run directory must be on a filesystem the compute nodes share.

On ``world.platform: gpu`` the job asks for each node's GPUs with ``--gres=gpu:N``, and every
task takes its own by ``SLURM_LOCALID`` (``placement.gpu_slots``; several tasks per GPU with
``world.processes_per_gpu``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

from rich.console import Console

from jaxcomm_launcher import faults, rundir
from jaxcomm_launcher.backends._base import BackendError, BackendRunner, gpu_env
from jaxcomm_launcher.placement import gpu_rule, gpus_needed
from jaxcomm_launcher.procs import Interrupted, Outcome, RankEcho
from jaxcomm_launcher.recipe import SlurmBackend
from jaxcomm_launcher.results import read_run

# Job states in which the job may still run or still has processes (squeue(1), "JOB STATE
# CODES"); any other state is final.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
    }
)
# "srun: error: node3: task 1: Killed", "srun: error: n1: tasks 0-1: Exited with exit code 2"
_SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_SIGNAL_BY_TEXT = {signal.strsignal(s): s for s in signal.Signals if signal.strsignal(s)}
STATE_POLL_S = 2.0  # slurmctld is shared by every user of the cluster: ask it sparingly
UNKNOWN_POLLS = 5  # consecutive polls without an answer before the job counts as gone
FILE_POLL_S = 0.3
LOCAL_RANK = "SLURM_LOCALID"
"""Each task's index on its node; on GPUs it picks the task's GPUs (placement.py)."""


STEP_FUNCTION = [
    "# step DIR SRUN...: runs one sweep entry; srun's own messages go to DIR/srun.log,",
    "# its exit status and times to DIR/step.json (read by `jaxcomm launch` and `report`).",
    "step() {",
    "  local dir=$1 started rc=0",
    "  shift",
    "  started=$(date +%s.%N)",
    '  "$@" 2>"$dir/srun.log" || rc=$?',
    '  printf \'{"exit_code": %d, "started": %s, "ended": %s}\\n\' '
    '"$rc" "$started" "$(date +%s.%N)" >"$dir/step.json"',
    '  return "$rc"',
    "}",
    "status=0",
]
"""The sbatch script's shell function that runs one sweep entry, and its exit status."""


@dataclasses.dataclass
class JobState:
    """What Slurm says about a job.

    Attributes:
        state: ``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``, ``CANCELLED``, ...
        reason: Why it waits or failed (``Resources``, ``NonZeroExitCode``, ``None``).
        nodes: Its node list (empty while pending).
        exit_code: The batch script's ``exit:signal``.

    Example:
        >>> JobState("COMPLETING", nodes="n[1-2]").active
        True
    """

    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""

    @property
    def active(self) -> bool:
        """True while the job may still run or still has processes."""
        return self.state in ACTIVE_STATES


def job_state(job_id: str) -> JobState | None:
    """Asks Slurm for a job's state: ``scontrol``, then ``sacct`` once slurmctld forgot it.

    Args:
        job_id: The job id from ``sbatch``.

    Returns:
        The state, or None when neither command knows the job (or is installed).

    Example:
        >>> job_state("12345").state  # doctest: +SKIP
        'RUNNING'
    """
    if shutil.which("scontrol"):
        res = _query(["scontrol", "show", "job", "-o", job_id])
        if res.returncode == 0 and "JobState=" in res.stdout:
            fields = dict(
                item.split("=", 1) for item in res.stdout.split() if "=" in item
            )  # one line of Key=Value pairs; values of the keys read here hold no spaces
            return JobState(
                state=fields.get("JobState", "UNKNOWN"),
                reason=fields.get("Reason", ""),
                nodes="" if fields.get("NodeList") == "(null)" else fields.get("NodeList", ""),
                exit_code=fields.get("ExitCode", ""),
            )
    if shutil.which("sacct"):
        res = _query(
            ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,Reason,NodeList,ExitCode"]
        )
        line = res.stdout.strip().splitlines()[0] if res.stdout.strip() else ""
        if res.returncode == 0 and line.count("|") == 3:
            state, reason, nodes, exit_code = line.split("|")
            # sacct writes "CANCELLED by 0"; the state is the first word.
            return JobState(state.split()[0], reason, nodes, exit_code)
    return None


def _describe(state: JobState) -> str:
    # "PENDING (Resources)", "RUNNING on n[1-2]"
    why = f" ({state.reason})" if state.state == "PENDING" and state.reason != "None" else ""
    where = f" on {state.nodes}" if state.nodes and state.state != "PENDING" else ""
    return state.state + why + where


def _query(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    # A busy slurmctld may not answer for a while: a late answer is no answer.
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 1, "", "timed out")


def _scancel(job_id: str) -> None:
    if shutil.which("scancel"):
        subprocess.run(["scancel", job_id], capture_output=True, text=True)


@dataclasses.dataclass
class StepFailure:
    """The first task ``srun`` reported as failed in one step."""

    rank: int
    node: str
    what: str  # "Killed", "Exited with exit code 1", ...

    def returncode(self) -> int:
        """Returns the task's status as ``Popen.returncode`` would (negative: a signal).

        Returns:
            The exit code, or minus the signal number.

        Example:
            >>> StepFailure(1, "n3", "Killed").returncode()
            -9
        """
        m = re.match(r"Exited with exit code (\d+)", self.what)
        if m:
            return int(m.group(1))
        sig = _SIGNAL_BY_TEXT.get(self.what.split(" (")[0])
        return -int(sig) if sig else 1


def srun_task_failures(srun_log: pathlib.Path) -> list[StepFailure]:
    """Returns the failed tasks ``srun`` reported in `srun_log`, in the order it saw them.

    Args:
        srun_log: A step's ``srun.log`` (srun's own stderr).

    Returns:
        One entry per failed task (``tasks 0-1`` gives two).

    Example:
        >>> srun_task_failures(pathlib.Path("runs/x/dense/srun.log"))  # doctest: +SKIP
        [StepFailure(rank=1, node='node3', what='Killed')]
    """
    try:
        text = srun_log.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _SRUN_TASK_ERROR.match(line.strip())
        if not m:
            continue
        node, tasks, what = m.groups()
        for part in tasks.split(","):
            lo, _, hi = part.partition("-")
            for rank in range(int(lo), int(hi or lo) + 1):
                out.append(StepFailure(rank, node, what.strip()))
    return out


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def collect(
    run_dir: pathlib.Path, state: JobState | None = None, cancelled: str | None = None
) -> dict[str, Any]:
    """Reads what the job wrote into each entry's status in ``run.json`` (and saves it).

    An entry whose ``step.json`` says exit 0 is ``ok``; a non-zero exit is ``failed`` with
    the failed rank (as the supervised backends choose it: a task killed by a signal, else the
    rank whose error came first) and its node; an entry without ``step.json`` is
    ``running``/``waiting`` while the job is active, else ``interrupted`` (it had started),
    ``timeout`` or ``not run``, and ``unknown`` when Slurm cannot tell the job's state.

    Args:
        run_dir: The run directory (``run.json`` with ``slurm.job_id``).
        state: The job's state if the caller knows it; else Slurm is asked.
        cancelled: Why the launcher cancelled the job (``timeout`` or ``interrupted``), if
            it did: the entry that was running gets that status.

    Returns:
        The updated run description; failed entries carry ``reason``, ``failed_rank``,
        ``failed_node`` and ``detail``.

    Example:
        >>> collect(pathlib.Path("runs/digits-dense-20250101-000000"))["slurm"]["state"]  # doctest: +SKIP
        'COMPLETED'
    """

    run = read_run(run_dir)
    slurm = run.setdefault("slurm", {})
    # The job's own closing `jaxcomm report` would see the job RUNNING: leave the state to
    # the launcher or a later report (every step has its step.json by then anyway).
    inside = os.environ.get("SLURM_JOB_ID") == str(slurm.get("job_id"))
    if state is None and slurm.get("job_id") and not inside:
        state = job_state(str(slurm["job_id"]))
    if state is not None:
        slurm.update(state=state.state, reason=state.reason, exit_code=state.exit_code)
        if state.nodes:
            slurm["nodes"] = state.nodes
    for entry in run.get("variants", []):
        vdir = run_dir / entry["label"]
        for key in ("reason", "failed_rank", "failed_node", "detail", "error"):
            entry.pop(key, None)
        step = _read_json(vdir / "step.json")
        if step is None:
            _unfinished_entry(entry, any(vdir.glob("rank*.log")), state, cancelled)
            continue
        restarts = faults.read_restarts(vdir)
        if restarts:
            entry["restarts"] = restarts
        entry["wall_s"] = round(float(step["ended"]) - float(step["started"]), 2)
        if int(step["exit_code"]) == 0:
            entry["status"] = "ok"
            continue
        _failed_entry(entry, vdir, step, slurm.get("nodes", ""))
    (run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return run


def _unfinished_entry(
    entry: dict[str, Any], started: bool, state: JobState | None, cancelled: str | None
) -> None:
    """The status (and reason) of an entry without ``step.json``: cancelled, still running or
    waiting, cut by the job's end, never run, or unknown without Slurm's word."""
    if started and cancelled:
        entry["status"] = cancelled
        entry["reason"] = f"the launcher cancelled slurm job ({cancelled})"
    elif state is None:
        # Without Slurm's word (no scontrol/sacct here, or the job long forgotten) an
        # entry without step.json may still run or may have been cut: say so.
        entry["status"] = "unknown"
        entry["reason"] = "no step.json, and Slurm does not know the job"
    elif state.active:
        entry["status"] = "running" if started else "waiting"
    elif started and state.state == "TIMEOUT":
        entry["status"] = "timeout"
        entry["reason"] = "slurm job reached its time limit (backend.time)"
    elif started:
        entry["status"] = "interrupted"
        entry["reason"] = f"slurm job {state.state.lower()} while this entry ran"
    else:
        entry["status"] = "not run"


def _failed_entry(
    entry: dict[str, Any], vdir: pathlib.Path, step: dict[str, Any], nodes: str
) -> None:
    """Marks `entry`, whose step exited non-zero, ``failed``: the failed rank (as the
    supervised backends choose it), its node (`nodes`: the job's node list), how it failed
    and its error."""
    entry["status"] = "failed"
    failures = srun_task_failures(vdir / "srun.log")
    # srun lists tasks in the order it noticed them, and may notice a peer's error exit
    # (it lost its connection to the dead rank) before the death itself. As the
    # supervised backends do, blame a signal death first, but not SIGTERM: that is what
    # srun sends the other tasks when it ends the step.
    culprits = [f for f in failures if f.returncode() < 0 and f.returncode() != -15]
    first = culprits[0] if culprits else (failures[0] if failures else None)
    outcome = Outcome(
        ok=False,
        reason="failed",
        failed_rank=first.rank if first else None,
        returncode=first.returncode() if first else None,
    )
    rank = rundir.failed_rank(outcome, vdir)
    status = _read_json(vdir / f"rank{rank}.status.json") or {}
    node = status.get("host") or next((f.node for f in failures if f.rank == rank), None)
    if node is None and nodes and not any(c in nodes for c in ",["):
        node = nodes  # a one-node job: every rank ran there
    if rank is not None and first is not None and rank == first.rank:
        how = f"srun: task {first.rank}: {first.what}"
    elif first is not None:
        how = f"it raised first; srun: task {first.rank}: {first.what}"
    else:
        how = f"srun exited with {step['exit_code']}"
    error = rundir.status_error(vdir, rank)
    if error:
        entry["error"] = error
    entry.update(
        failed_rank=rank,
        failed_node=node,
        detail=how,
        reason=(
            f"rank {rank} on node {node or '?'} failed ({how})"
            if rank is not None
            else f"the step failed ({how})"
        ),
    )


class _FileTail:
    """Yields the complete lines appended to a file since the last call."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        return [line.decode(errors="replace").rstrip("\r") for line in lines]


class _LogPump:
    """Echoes what a Slurm job's rank logs and ``srun.log`` files gained, entry by entry."""

    def __init__(
        self, recipe: Any, run_dir: pathlib.Path, job_id: str, console: Console, quiet: bool
    ) -> None:
        self.recipe, self.run_dir, self.job_id, self.console = recipe, run_dir, job_id, console
        self.labels = [s.display_label() for s in recipe.variants()]
        self.echo = RankEcho(console, quiet)
        self.tails: dict[pathlib.Path, _FileTail] = {}
        self.seen_labels: set[str] = set()

    def pump(self, final: bool = False) -> str | None:
        """Echoes what the logs gained (`final`: their unfinished last lines too); returns
        the entry that runs now (the last one with logs and no step.json)."""
        current = None
        for label in self.labels:
            vdir = self.run_dir / label
            logs = sorted(vdir.glob("rank*.log"), key=lambda p: p.name)
            if logs and label not in self.seen_labels:
                self.seen_labels.add(label)
                self.console.rule(
                    f"[bold]{self.recipe.name}[/] · {label} · slurm job {self.job_id} · "
                    f"{self.recipe.world.processes} tasks"
                )
            for path in [*logs, vdir / "srun.log"]:
                tail = self.tails.setdefault(path, _FileTail(path))
                rank = int(path.stem[4:]) if path.stem[4:].isdigit() else None
                for text in tail.new_lines(final):
                    self.echo.line(rank, text, "srun")
            if logs and not (vdir / "step.json").exists():
                current = label
        return current

    def progress(self, current: str | None) -> str:
        """`` · LABEL (i/n)`` and the entry's latest step, or nothing without a running one."""
        if not current:
            return ""
        where = f"({self.labels.index(current) + 1}/{len(self.labels)})"
        return f" · {current} {where}{rundir.progress(self.run_dir / current)}"


class _StatePoll:
    """Asks Slurm for a job's state every ``STATE_POLL_S`` and prints it when it changes."""

    def __init__(self, job_id: str, console: Console) -> None:
        self.job_id, self.console = job_id, console
        self.state: JobState | None = None
        self.unknown = 0  # consecutive polls without an answer
        self.last_poll = -STATE_POLL_S
        self.last_shown = ""

    def ended(self, elapsed: float) -> bool:
        """Polls if one is due at `elapsed` seconds; True once the job has ended, or Slurm
        has not answered ``UNKNOWN_POLLS`` polls in a row (``state`` is then None)."""
        if elapsed - self.last_poll < STATE_POLL_S:
            return False
        self.last_poll = elapsed
        polled = job_state(self.job_id)
        # No answer: slurmctld may be busy; the job is gone only after several polls in a
        # row without one.
        self.unknown = self.unknown + 1 if polled is None else 0
        if polled is not None:
            self.state = polled
        if self.unknown >= UNKNOWN_POLLS:
            self.state = None
            return True
        if self.state is not None and not self.state.active:
            return True
        shown = _describe(self.state) if self.state is not None else self.last_shown
        if shown != self.last_shown:
            self.console.print(f"slurm job {self.job_id}: {shown}", highlight=False)
            self.last_shown = shown
        return False


class SlurmBackendRunner(BackendRunner):
    """Renders the sbatch script of a recipe, submits it and follows the job.

    Args:
        recipe: The recipe (``backend.kind == "slurm"``).
        run_dir: The run directory on a filesystem shared with the compute nodes.

    Example:
        >>> print(SlurmBackendRunner(recipe, pathlib.Path("/scratch/run")).render())  # doctest: +SKIP
    """

    kind = "slurm"
    opts: SlurmBackend

    def render(self) -> str:
        """Returns the sbatch script.

        Returns:
            The script text; deterministic for a given recipe and run directory.

        Example:
            >>> script = SlurmBackendRunner(recipe, run_dir).render()  # doctest: +SKIP
        """
        gres = self.gpu_gres()
        lines = [*self._sbatch_options(gres), *self._environment(gres), *STEP_FUNCTION]
        for settings in self.recipe.variants():
            lines += self._entry_lines(settings.display_label(), gres)
        py, quoted = shlex.quote(self.opts.python), shlex.quote(str(self.run_dir))
        lines += [
            f"{py} -P -m jaxcomm_launcher.cli report {quoted} "
            f">{shlex.quote(str(self.run_dir) + '/report.log')} 2>&1 || true",
            'exit "$status"',
        ]
        return "\n".join(lines) + "\n"

    def _sbatch_options(self, gres: str | None) -> list[str]:
        """The script's first line and its ``#SBATCH`` options."""
        r, o = self.recipe, self.opts
        n = r.world.processes
        per_node = o.tasks_per_node or -(-n // o.nodes)
        lines = [
            "#!/bin/bash",
            f"#SBATCH --job-name=jaxcomm-{r.name}",
            f"#SBATCH --nodes={o.nodes}",
            f"#SBATCH --ntasks={n}",
            f"#SBATCH --ntasks-per-node={per_node}",
        ]
        if o.cpus_per_task:
            lines.append(f"#SBATCH --cpus-per-task={o.cpus_per_task}")
        if gres:
            lines.append(f"#SBATCH --gres={gres}")
        lines.append(f"#SBATCH --time={o.time}")
        if o.partition:
            lines.append(f"#SBATCH --partition={o.partition}")
        if o.account:
            lines.append(f"#SBATCH --account={o.account}")
        lines.append(f"#SBATCH --output={self.run_dir}/slurm-%j.out")
        return lines + [f"#SBATCH {a}" for a in o.sbatch_args]

    def _environment(self, gres: str | None) -> list[str]:
        """The setup lines and the ranks' environment: the recipe's env, GPUs, PYTHONPATH and
        the coordinator's port."""
        r, o = self.recipe, self.opts
        lines = [
            "# Generated by `jaxcomm launch` (recipe " + r.name + "). Submit with sbatch.",
            "set -euo pipefail",
            *o.setup,
            "export PYTHONUNBUFFERED=1",
        ]
        for k, v in {**r.env, **gpu_env(r)}.items():
            lines.append(f"export {k}={shlex.quote(v)}")
        if gres:
            w = r.world
            lines.append(f"# {gpu_rule(w.devices_per_process, w.processes_per_gpu, LOCAL_RANK)}")
        if r.pythonpath:
            lines.append(
                f'export PYTHONPATH={shlex.quote(":".join(r.pythonpath))}"${{PYTHONPATH:+:$PYTHONPATH}}"'
            )
        # Each rank finds the coordinator itself: the first node of its step, this port
        # plus the step id (jaxcomm_launcher.worker.coordinator_address).
        return lines + [f"export JAXCOMM_COORDINATOR_PORT={o.port}"]

    def _entry_lines(self, label: str, gres: str | None) -> list[str]:
        """The lines that run sweep entry `label`: one ``srun`` step, or with
        ``max_restarts`` a loop that relaunches it inside the allocation."""
        r, py = self.recipe, shlex.quote(self.opts.python)
        n, run_dir = r.world.processes, str(self.run_dir)
        vdir = shlex.quote(f"{run_dir}/{label}")
        spec = shlex.quote(f"{run_dir}/{label}/spec.json")
        out = shlex.quote(f"{run_dir}/{label}/rank%t.log")
        # --kill-on-bad-exit: one failed rank ends the step instead of hanging it.
        srun = (
            f"step {vdir} srun --kill-on-bad-exit=1 --ntasks={n} "
            + (f"--gres={gres} " if gres else "")
            + f"--job-name={shlex.quote(label)} --output={out} "
            # A restarted step appends to the rank logs instead of truncating them.
            + ("--open-mode=append " if r.max_restarts else "")
            + f"{py} -P -m jaxcomm_launcher.worker --spec {spec}"
        )
        lines = [f"# --- {label}", f"mkdir -p {vdir}"]
        if not r.max_restarts:
            return [*lines, f"{srun} || status=$?"]
        # Restarts stay inside the allocation: a new srun step (a new step id, so a new
        # coordinator port) resumes from the newest checkpoint; docs/faults.md.
        return lines + [
            "attempt=0",
            f"until {srun}; do",
            "  rc=$?",
            f'  if [ "$attempt" -ge {r.max_restarts} ]; then status=$rc; break; fi',
            "  attempt=$((attempt + 1))",
            f"  {py} -P -m jaxcomm_launcher.faults restart {vdir} "
            f'--attempt "$attempt" --processes {n} --exit-code "$rc" || true',
            "done",
        ]

    def gpu_gres(self) -> str | None:
        """Returns the GPUs each node needs as a ``--gres`` value (None on CPU worlds).

        Every task of a node sees the node's GPUs and takes its own by ``SLURM_LOCALID``
        (``jaxcomm_launcher.worker.local_gpus``), so ranks may share a GPU, which
        ``--gpus-per-task`` cannot express.

        Example:
            >>> SlurmBackendRunner(recipe, run_dir).gpu_gres()  # doctest: +SKIP
            'gpu:4'
        """
        w, o = self.recipe.world, self.opts
        if w.platform != "gpu":
            return None
        per_node = o.tasks_per_node or -(-w.processes // o.nodes)
        return f"gpu:{gpus_needed(per_node, w.devices_per_process, w.processes_per_gpu)}"

    def write(self) -> pathlib.Path:
        """Writes the script, the run description and one spec.json per sweep entry.

        Returns:
            The script path, ``RUN_DIR/job.sbatch``.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.json").write_text(
            json.dumps(self.recipe.model_dump(mode="json"), indent=2)
        )
        run = rundir.run_description(self.recipe)
        for settings in self.recipe.variants():
            vdir = self.run_dir / settings.display_label()
            vdir.mkdir(exist_ok=True)
            (vdir / "spec.json").write_text(
                json.dumps(rundir.spec(self.recipe, settings, vdir), indent=2)
            )
            run["variants"].append(
                {
                    "label": settings.display_label(),
                    "status": "submitted",
                    "jaxcomm": settings.model_dump(),
                }
            )
        path = self.run_dir / "job.sbatch"
        run["slurm"] = {"script": str(path)}
        (self.run_dir / "run.json").write_text(json.dumps(run, indent=2) + "\n")
        path.write_text(self.render())
        return path

    def submit(self, console: Console) -> str:
        """Writes the script and submits it with ``sbatch``; records the job id in run.json.

        Args:
            console: For the job id.

        Returns:
            The Slurm job id.

        Raises:
            BackendError: When ``sbatch`` is missing or refuses the job.
        """
        sbatch = shutil.which("sbatch")
        if sbatch is None:
            raise BackendError(
                "the slurm backend needs `sbatch`, which is not on PATH (is this a Slurm login "
                "node?). Use --dry-run to print the script and submit it elsewhere."
            )
        path = self.write()
        result = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            raise BackendError(f"sbatch refused {path}: {result.stderr.strip()}")
        job_id = result.stdout.strip().split(";")[0]
        run_json = self.run_dir / "run.json"
        run = json.loads(run_json.read_text())
        run["slurm"]["job_id"] = job_id
        run_json.write_text(json.dumps(run, indent=2) + "\n")
        console.print(f"submitted Slurm job {job_id}: {path}", highlight=False)
        return job_id

    def follow(
        self,
        job_id: str,
        console: Console,
        timeout: float | None = None,
        quiet: bool = False,
    ) -> tuple[Outcome, JobState | None]:
        """Follows a submitted job until it ends; Ctrl-C, SIGTERM or `timeout` cancel it.

        Shows the job state and the running entry's latest step, echoes every rank log and
        ``srun.log`` line (rank-prefixed, as the supervised backends do) and prints each
        entry's header when its first log appears. After a cancel it waits until Slurm has
        ended every process of the job.

        Args:
            job_id: The id ``submit`` returned.
            console: For the logs and the status line.
            timeout: Seconds from now after which the job is cancelled (None: no limit).
            quiet: Do not echo the logs (the tails are still kept).

        Returns:
            (how it ended: ``ok``/``failed`` from the job state, ``timeout``, ``interrupted``;
            the job's final state, None if Slurm forgot it).

        Example:
            >>> outcome, state = runner.follow(runner.submit(console), console)  # doctest: +SKIP
        """
        t0 = time.monotonic()
        logs = _LogPump(self.recipe, self.run_dir, job_id, console, quiet)
        poll = _StatePoll(job_id, console)
        reason = "ok"
        status_line = console.status(f"slurm job {job_id}: submitted")
        try:
            with status_line:
                while True:
                    elapsed = time.monotonic() - t0
                    if poll.ended(elapsed):
                        break
                    status_line.update(
                        f"slurm job {job_id}: {poll.state.state if poll.state else '?'} "
                        f"{elapsed:.0f} s{logs.progress(logs.pump())}"
                    )
                    if timeout is not None and elapsed > timeout:
                        reason = "timeout"
                        break
                    time.sleep(FILE_POLL_S)
        except (KeyboardInterrupt, Interrupted):
            reason = "interrupted"
        state = poll.state
        if reason != "ok":
            state = self.cancel(job_id, console)
        logs.pump(final=True)
        if reason == "timeout":
            return (
                Outcome(False, "timeout", detail=f"the run exceeded its {timeout:g} s timeout"),
                state,
            )
        if reason == "interrupted":
            return (
                Outcome(False, "interrupted", detail="interrupted (Ctrl-C / SIGTERM)"),
                state,
            )
        ok = state is not None and state.state == "COMPLETED"
        detail = f"slurm job {job_id} ended {state.state if state else 'UNKNOWN'}"
        return Outcome(ok, "ok" if ok else "failed", detail=detail), state

    def cancel(self, job_id: str, console: Console, wait_s: float = 120.0) -> JobState | None:
        """Runs ``scancel`` and waits until Slurm has stopped every process of the job.

        Args:
            job_id: The job.
            console: Says what happens.
            wait_s: Give up waiting after this long (the job is cancelled regardless).

        Returns:
            The job's final state (None if Slurm forgot it).

        Example:
            >>> runner.cancel("12345", Console()).state  # doctest: +SKIP
            'CANCELLED'
        """
        # Ignore further Ctrl-C while cancelling: an interrupted cancel leaves the job running.
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            console.print(f"cancelling slurm job {job_id} (scancel)", highlight=False)
            _scancel(job_id)
            deadline = time.monotonic() + wait_s
            state = job_state(job_id)
            while state is not None and state.active and time.monotonic() < deadline:
                time.sleep(0.5)
                state = job_state(job_id)
            return state
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)
