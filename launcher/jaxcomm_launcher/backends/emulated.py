"""``emulated``: an N-node cluster on one machine (docs/DESIGN.md §5; needs root).

Each rank runs in its own network namespace, joined to a private bridge by a veth pair whose
two ends are shaped with ``tc qdisc ... tbf rate <bandwidth> burst <burst>``. Addresses come
from the recipe's private subnet (default 10.77.0.0/24) and exist only inside the namespaces
(the bridge itself has no address), so no traffic can leave them. ``unshare --ipc`` gives each
rank its own IPC namespace, so UCX cannot fall back to shared memory between "nodes", and
``taskset`` pins each node to cores of its own (``backend.cpus_per_node``; a world that needs
more cores than the host has is reported as oversubscribed: ``placement.py``).

On ``world.platform: gpu`` the nodes share this machine's GPUs as local ranks do (each its
``CUDA_VISIBLE_DEVICES``, several per GPU with ``world.processes_per_gpu``), and what they
send still crosses the emulated links: UCX over ``tcp`` on ``eth0`` (device buffers staged
through host memory, ``cuda_copy``), NCCL over sockets (``NCCL_P2P_DISABLE``,
``NCCL_SHM_DISABLE``). NVLink and CUDA IPC between nodes are never used, as between hosts.

Names carry a random run id (``jcm<id>r<rank>``, bridge ``jcb<id>``) so concurrent runs do
not collide; everything created is recorded and removed in ``__exit__``, also after a failure,
a timeout or Ctrl-C.
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
from types import TracebackType

from jaxcomm_launcher import cleanup
from jaxcomm_launcher.backends._base import (
    BackendError,
    PerRankBackend,
    rank_env,
    worker_command,
)
from jaxcomm_launcher.placement import Placement, emulated_placement
from jaxcomm_launcher.recipe import EmulatedBackend, Recipe

COORDINATOR_PORT = 29500  # any port works: the namespaces are fresh


class EmulatedBackendRunner(PerRankBackend):
    """Creates the namespaces on ``__enter__``, starts ranks in them, removes all on exit.

    Args:
        recipe: The recipe (``backend.kind == "emulated"``).
        run_dir: The run directory (``emulated-setup.log`` records every command).

    Example:
        >>> with EmulatedBackendRunner(recipe, run_dir) as b:  # doctest: +SKIP
        ...     b.start(supervisor, spec_path)
    """

    kind = "emulated"
    opts: EmulatedBackend

    def __init__(self, recipe: Recipe, run_dir: pathlib.Path, run_id: str | None = None) -> None:
        super().__init__(recipe, run_dir)
        self.run_id = run_id or secrets.token_hex(2)
        n = recipe.world.processes
        net = ipaddress.ip_network(self.opts.subnet)
        hosts = list(net.hosts()) if net.num_addresses <= 1 << 16 else None
        if hosts is not None and len(hosts) < n:
            raise BackendError(
                f"backend.subnet {net} has {len(hosts)} addresses, world.processes={n} needs more"
            )
        self.prefix = net.prefixlen
        self.addresses = [str(net.network_address + 1 + i) for i in range(n)]
        self.bridge = f"jcb{self.run_id}"
        self.namespaces = [f"jcm{self.run_id}r{i}" for i in range(n)]
        self.veths = [f"jcv{self.run_id}r{i}" for i in range(n)]
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        self._log: list[str] = []
        self._placement = emulated_placement(n, self.opts.cpus_per_node, pin=self.opts.pin_cpus)

    def placement(self, *, dry_run: bool = False) -> Placement:
        """Returns each node's cores (``backend.cpus_per_node``), its GPUs and the
        oversubscription."""
        return self.gpu_placement(self._placement, dry_run=dry_run)

    # -- set-up and tear-down -------------------------------------------------------------

    def _check(self) -> None:
        if os.geteuid() != 0:
            raise BackendError(
                "the emulated backend needs root: it creates network namespaces, veth pairs, a "
                "bridge and tc qdiscs. Run `jaxcomm launch` as root (e.g. sudo -E), or use "
                "`--set backend.kind=local`."
            )
        for tool in ("ip", "tc", "unshare", *(("taskset",) if self.opts.pin_cpus else ())):
            if shutil.which(tool) is None:
                raise BackendError(
                    f"the emulated backend needs `{tool}` (Debian: apt-get install iproute2 "
                    "util-linux)"
                )

    def _sh(self, *cmd: str) -> None:
        self._log.append(" ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise BackendError(
                f"emulated cluster set-up failed at `{' '.join(cmd)}`: {result.stderr.strip()}"
            )

    def setup_commands(self) -> list[list[str]]:
        """Returns the commands that build the emulated cluster (for logs and ``--dry-run``)."""
        o = self.opts
        tbf = ["root", "tbf", "rate", o.bandwidth, "burst", o.burst, "latency", "50ms"]
        cmds = [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "link", "set", self.bridge, "up"],
        ]
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses, strict=True):
            peer = veth.replace("jcv", "jcp", 1)
            cmds += [
                ["ip", "netns", "add", ns],
                ["ip", "link", "add", veth, "type", "veth", "peer", "name", peer],
                ["ip", "link", "set", peer, "netns", ns],
                ["ip", "-n", ns, "link", "set", peer, "name", "eth0"],
                ["ip", "link", "set", veth, "master", self.bridge],
                ["ip", "link", "set", veth, "up"],
                ["ip", "-n", ns, "addr", "add", f"{addr}/{self.prefix}", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "-n", ns, "link", "set", "lo", "up"],
                # Shape both directions: each veth end only shapes what it sends.
                ["tc", "qdisc", "add", "dev", veth, *tbf],
                ["tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf],
            ]
        return cmds

    def __enter__(self) -> EmulatedBackendRunner:
        self._check()
        # What an earlier launcher killed outright left behind goes first (jaxcomm cleanup).
        cleanup.sweep()
        cleanup.claim(self.run_id)
        try:
            for cmd in self.setup_commands():
                if cmd[:3] == ["ip", "netns", "add"]:
                    self._created_ns.append(cmd[3])
                elif cmd[:3] == ["ip", "link", "add"]:
                    self._created_links.append(cmd[3])
                self._sh(*cmd)
            for ns, addr in zip(self.namespaces, self.addresses, strict=True):
                self._write_hosts(ns, addr)
        except BaseException:
            self.teardown()
            raise
        return self

    def _write_hosts(self, ns: str, addr: str) -> None:
        # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts. Gloo resolves
        # the machine's hostname to pick the address it announces to peers; inside a
        # namespace that must be the namespace's own address, not 127.0.0.1.
        d = pathlib.Path("/etc/netns") / ns
        d.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        (d / "hosts").write_text(
            f"127.0.0.1 localhost\n{addr} {host} {ns}\n"
            + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.namespaces, strict=True))
        )

    def teardown(self) -> None:
        """Removes every namespace, link and file this run created (errors are ignored)."""
        for ns in reversed(self._created_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(pathlib.Path("/etc/netns") / ns, ignore_errors=True)
        # Deleting a namespace deletes its veth end and so the pair; the bridge (and any
        # veth whose peer never reached a namespace) goes explicitly.
        for link in reversed(self._created_links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._created_ns.clear()
        self._created_links.clear()
        cleanup.release(self.run_id)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "emulated-setup.log").write_text("\n".join(self._log) + "\n")
        except OSError:
            pass

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    # -- ranks ----------------------------------------------------------------------------

    def rank_command(self, rank: int, spec_path: pathlib.Path) -> list[str]:
        """Returns the command running `rank` inside its namespace.

        Args:
            rank: The rank.
            spec_path: The run's spec.json.

        Returns:
            ``ip netns exec <ns> [taskset -c <cores>] [unshare --ipc] python -m
            jaxcomm_launcher.worker ...``.
        """
        cmd = ["ip", "netns", "exec", self.namespaces[rank]]
        if self._placement.node_cpus is not None:
            cmd += ["taskset", "-c", ",".join(map(str, self._placement.node_cpus[rank]))]
        if self.opts.ipc_isolation:
            cmd += ["unshare", "--ipc"]
        return cmd + worker_command(spec_path)

    def _rank_env(self, rank: int, devices: dict[str, str]) -> dict[str, str]:
        port = COORDINATOR_PORT + self.attempt  # a restart gets a fresh port
        n, coordinator = self.recipe.world.processes, f"{self.addresses[0]}:{port}"
        env = {**rank_env(rank, n, coordinator), "JAXCOMM_NODE_ADDRESS": self.addresses[rank]}
        env.update(devices)
        gpu = self.recipe.world.platform == "gpu"
        if self.opts.ucx_tls:
            # On GPUs UCX may stage device buffers through host memory (cuda_copy); the wire
            # between nodes stays the shaped link.
            tls = self.opts.ucx_tls
            env["UCX_TLS"] = f"{tls},cuda_copy" if gpu and "cuda" not in tls else tls
            env["UCX_NET_DEVICES"] = "eth0"
        if gpu:
            # The nodes share one machine's GPUs, but what they send must cross the emulated
            # network: NCCL (XLA's psum) over sockets on eth0, not peer-to-peer or shared memory.
            env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="eth0")
        return env

    def rank_launches(
        self, spec_path: pathlib.Path, *, dry_run: bool = False
    ) -> list[tuple[list[str], dict[str, str]]]:
        """Returns every rank's command in its namespace and its variables (address, UCX).

        Args:
            spec_path: The run's spec.json.
            dry_run: Only describing: a host without GPUs shows the GPUs a GPU world would
                take (the namespaces' names and addresses are fixed at construction).
        """
        devices = self.device_env(dry_run=dry_run)
        return [
            (self.rank_command(rank, spec_path), self._rank_env(rank, devices[rank]))
            for rank in range(self.recipe.world.processes)
        ]

    def describe(self, spec_path: pathlib.Path) -> list[str]:
        """Returns set-up commands and rank commands (for ``--dry-run``)."""
        lines = [" ".join(c) for c in self.setup_commands()]
        lines += super().describe(spec_path)
        lines.append(
            f"# tear-down: ip netns del {' '.join(self.namespaces)}; ip link del {self.bridge}"
        )
        return lines
