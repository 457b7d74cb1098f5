"""A one-host Slurm cluster for tests: munged, slurmctld and slurmd from Debian's packages.

Everything lives in one directory (munge key and socket, ``slurm.conf``, state, logs) and the
daemons listen on free ports, so the cluster touches nothing system-wide and can run beside
another one. The daemons run inside their own PID namespace (``unshare --pid --kill-child``):
stopping it kills the namespace's first process, and the kernel then kills every process
left in the namespace (daemons, slurmstepd, job steps), even after a failed test. The
namespace also dies with the test process (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import pathlib
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

from jaxcomm_launcher.procs import _set_pdeathsig

ROOT = pathlib.Path(__file__).resolve().parents[1]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun", "sinfo")


def unassigned_ports(count: int) -> list[int]:
    """`count` distinct ports, free now and below the kernel's ephemeral range.

    slurmctld and slurmd bind their ports themselves, so a reserved socket
    (``jaxcomm_launcher.backends.reserve_port``) would keep them out. Below
    ``ip_local_port_range`` the kernel never hands a port to a ``bind(0)`` or an outgoing
    connection, so between this check and the daemons' bind only a program asking for that
    very number could take it (bind-then-close in the ephemeral range races with every
    connection on the machine).
    """
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports: list[int] = []
    for _ in range(1000):
        port = 10000 + secrets.randbelow(max(1, low - 10000))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports between 10000 and {low}")


def which(command: str) -> str | None:
    """Finds `command` on PATH or in the sbin directories (daemons live in /usr/sbin)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return shutil.which(command, path=path)


def ensure_installed() -> None:
    """Installs slurm-wlm and munge through .ci/system-deps when a command is missing."""
    if all(which(c) for c in DAEMONS + CLIENTS):
        return
    res = subprocess.run(
        ["bash", str(ROOT / ".ci" / "system-deps")], capture_output=True, text=True
    )
    missing = [c for c in DAEMONS + CLIENTS if not which(c)]
    if res.returncode != 0 or missing:
        raise RuntimeError(
            f".ci/system-deps did not install Slurm (still missing: {missing}):\n"
            f"{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        )


def node_name() -> str:
    # Ranks connect to the coordinator by node name (the first node of the job), so the
    # node must carry a name that resolves: the hostname if it does, else localhost.
    host = socket.gethostname()
    try:
        socket.gethostbyname(host)
        return host
    except OSError:
        return "localhost"


class SlurmCluster:
    """One slurmctld and one slurmd with `cpus` CPUs (more than the machine has is fine).

    Args:
        root: An empty directory for configuration, state and logs.
        cpus: CPUs of the single node (oversubscribed: tasks are not bound to cores).

    Example:
        >>> cluster = SlurmCluster(tmp_path).start()  # doctest: +SKIP
        >>> subprocess.run(["sinfo"], env=cluster.env)  # doctest: +SKIP
        >>> cluster.stop()  # doctest: +SKIP
    """

    def __init__(self, root: pathlib.Path, cpus: int = 8) -> None:
        self.root = root
        self.cpus = cpus
        self.node = node_name()
        self.conf = root / "slurm.conf"
        # munged wants every directory above its socket open to all (pytest's are 0700).
        self.socket_dir = pathlib.Path(tempfile.mkdtemp(prefix="jaxcomm-munge-"))
        self.socket_dir.chmod(0o755)
        self.socket = self.socket_dir / "munge.socket"
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        # The clients find the cluster through SLURM_CONF; the job inherits it (sbatch
        # exports the submitting environment), as it inherits PATH: `python3` and `jaxcomm`
        # are this interpreter's.
        bindir = str(pathlib.Path(sys.executable).parent)
        self.env = dict(
            os.environ,
            SLURM_CONF=str(self.conf),
            PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
            COLUMNS="200",
        )

    def _write_files(self) -> pathlib.Path:
        r = self.root
        for sub, mode in (("key", 0o700), ("state", 0o755), ("spool", 0o755)):
            (r / sub).mkdir(mode=mode, exist_ok=True)
        key = r / "key" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        host = socket.gethostname()
        ctld_port, slurmd_port = unassigned_ports(2)
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=jaxcommtest",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={self.socket}",
                    "CredType=cred/munge",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'slurmd.log'}",
                    # No cgroups needed: processes are tracked through /proc (the namespace's).
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    # Take the node's CPUs from this file, not from the hardware (2 cores).
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "MinJobAge=600",  # keep finished jobs visible to scontrol
                    "KillWait=5",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        q = shlex.quote
        munged, slurmctld, slurmd = (q(which(d) or d) for d in DAEMONS)
        script = r / "cluster.sh"
        script.write_text(
            "\n".join(
                [
                    "#!/bin/bash",
                    "# PID 1 of the cluster's namespace: when it dies, everything in it dies.",
                    f"{munged} -F --key-file={q(str(key))} --socket={q(str(self.socket))} "
                    f"--pid-file={q(str(r / 'key' / 'munged.pid'))} "
                    f"--seed-file={q(str(r / 'key' / 'munged.seed'))} "
                    f"--log-file={q(str(r / 'munged.log'))} &",
                    f"for _ in $(seq 100); do [ -S {q(str(self.socket))} ] && break; sleep 0.1; done",
                    f"[ -S {q(str(self.socket))} ] || {{ echo 'munged did not start'; exit 1; }}",
                    f"{slurmctld} -D -f {q(str(self.conf))} &",
                    f"{slurmd} -D -f {q(str(self.conf))} -N {q(self.node)} &",
                    "wait",
                    "",
                ]
            )
        )
        return script

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Starts the daemons and waits until the node is idle.

        Args:
            timeout: Seconds to wait for the node.

        Returns:
            self.

        Raises:
            RuntimeError: When the node does not come up; the message holds the daemons' logs.
        """
        script = self._write_files()
        self._out = open(self.root / "daemons.out", "wb")  # closed by stop()
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "bash", str(script)],
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_set_pdeathsig,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.run("sinfo", "-h", "-o", "%T")
            if res.returncode == 0 and res.stdout.strip() == "idle":
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        logs = self.logs()
        self.stop()
        raise RuntimeError(f"the test Slurm cluster did not come up:\n{logs}")

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client command against this cluster."""
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)

    def job_state(self, job_id: str) -> str:
        """Returns the job's state as scontrol shows it (``COMPLETED``, ``CANCELLED``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
        return fields.get("JobState", "")

    def jobs(self) -> list[str]:
        """Returns the ids of the jobs slurmctld still runs or queues."""
        out = self.run("squeue", "-h", "-o", "%i").stdout
        return out.split()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Waits until no job is queued or running; returns whether that happened."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.jobs():
                return True
            time.sleep(0.5)
        return False

    def logs(self) -> str:
        """Returns the last lines of the daemons' logs (for failure messages)."""
        parts = []
        for name in ("daemons.out", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                lines = path.read_text(errors="replace").splitlines()[-30:]
                parts.append(f"--- {name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancels every job, then kills the namespace (and with it every process in it)."""
        if self.proc is None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            return
        if self.proc.poll() is None:
            jobs = self.jobs()
            if jobs:
                self.run("scancel", *jobs)
                self.wait_idle(30)
            # unshare --kill-child passes SIGKILL on to the namespace's PID 1.
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self._out is not None:
            self._out.close()
            self._out = None
