"""Recipe schema: one YAML file describes a run (job, world layout, backend, jaxcomm settings).

Validation is strict (unknown keys are errors) so a typo never silently falls back to a
default. :func:`load_recipe` turns pydantic's errors into :class:`RecipeError`, whose message
names each bad field, the value found and what is allowed; the CLI prints it and exits 2.
"""

from __future__ import annotations

import copy
import ipaddress
import pathlib
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from jaxcomm import algorithms, config, cost
from jaxcomm_launcher.jobs.args import check_args

# Bundled jobs by short name; anything else must be written `module:function`.
BUNDLED_JOBS: dict[str, str] = {
    "smoke": "jaxcomm_launcher.jobs.smoke:run",
    "digits": "jaxcomm_launcher.jobs.digits:run",
    "allreduce": "jaxcomm_launcher.jobs.allreduce:run",
    "probe": "jaxcomm_launcher.jobs.probe:run",
    "lbann-mlp": "jaxcomm_launcher.jobs.lbann_mlp:run",
    "bytes-lm": "jaxcomm_launcher.jobs.bytes_lm:run",
}

_JOB_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _tc_word(pattern: str, what: str) -> AfterValidator:
    """Checks a tc argument against ``pattern`` (any case) and returns it lower-cased."""
    regex = re.compile(pattern, re.IGNORECASE)

    def check(v: str) -> str:
        if not regex.match(v):
            raise ValueError(f"must be {what}")
        return v.lower()

    return AfterValidator(check)


TcRate = Annotated[
    str,
    _tc_word(
        r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$", "a tc rate such as 1gbit, 500mbit, 100kbit"
    ),
]
"""A tc rate (``1gbit``, ``500mbit``), lower-cased."""
TcSize = Annotated[str, _tc_word(r"^\d+(b|kb|mb|k|m)?$", "a size such as 128kb, 1mb, 131072")]
"""A tc size (``128kb``, ``131072``), lower-cased."""


LIGHT = "light"
"""Validation context key: True skips the checks that import JAX (a training job's args)."""


class RecipeError(Exception):
    """A recipe that cannot be used; ``str(err)`` is a user-facing, multi-line message."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PLATFORMS = ("cpu", "gpu")
"""What a rank's devices are: CPU devices of its process, or NVIDIA GPUs."""


class World(_Strict):
    """How many processes (ranks), on which platform, and how many devices each one owns.

    On ``gpu`` each rank gets ``devices_per_process`` GPUs of its node (``CUDA_VISIBLE_DEVICES``,
    see ``placement.py``); ``processes_per_gpu`` > 1 lets that many ranks share one GPU, which
    only the UCX transport can serve (NCCL refuses two ranks on one GPU).
    """

    processes: int = Field(2, ge=1, le=1024, description="number of processes (ranks)")
    devices_per_process: int = Field(
        1, ge=1, le=512, description="devices each process owns: CPU devices (cpu) or GPUs (gpu)"
    )
    platform: Literal["cpu", "gpu"] = Field(
        "cpu", description="cpu: each rank runs on CPU devices; gpu: on NVIDIA GPUs (CUDA)"
    )
    processes_per_gpu: int = Field(
        1,
        ge=1,
        le=64,
        description="gpu: ranks that share each GPU (> 1: devices_per_process must be 1 and "
        "the transport ucx; no rank preallocates the GPU's memory)",
    )

    @model_validator(mode="after")
    def _check_gpu(self) -> World:
        if self.processes_per_gpu > 1 and self.platform != "gpu":
            raise ValueError(
                "world.processes_per_gpu applies to GPUs: set world.platform: gpu, or remove it"
            )
        if self.processes_per_gpu > self.processes:
            raise ValueError(
                f"world.processes_per_gpu={self.processes_per_gpu} is more than "
                f"world.processes={self.processes}: at most every rank shares one GPU"
            )
        if self.processes_per_gpu > 1 and self.devices_per_process > 1:
            raise ValueError(
                "world.processes_per_gpu > 1 shares one GPU among ranks: each rank then owns "
                "exactly one device, so world.devices_per_process must be 1"
            )
        return self

    @property
    def shares_gpus(self) -> bool:
        """True when several ranks share one GPU (``processes_per_gpu`` > 1)."""
        return self.platform == "gpu" and self.processes_per_gpu > 1


class LocalBackend(_Strict):
    """N processes on this machine, joined by jax.distributed over loopback."""

    kind: Literal["local"] = "local"


class EmulatedBackend(_Strict):
    """Each rank in its own network namespace on a private bridge with tbf-shaped links."""

    kind: Literal["emulated"] = "emulated"
    bandwidth: TcRate = Field("1gbit", description="tc rate per link, e.g. 1gbit, 500mbit")
    burst: TcSize = Field(
        "128kb", description="tbf burst; below 128kb the CPU becomes the bottleneck"
    )
    subnet: str = Field(
        "10.77.0.0/24", description="private IPv4 subnet used inside the namespaces"
    )
    ipc_isolation: bool = Field(True, description="run each rank under `unshare --ipc`")
    ucx_tls: str | None = Field("tcp", description="UCX_TLS for the ranks (None: leave unset)")
    cpus_per_node: int | None = Field(
        None,
        ge=1,
        description="cores each node (rank) is pinned to with taskset; None: the launcher's "
        "cores split evenly, at least 1 (more nodes than cores wrap round: oversubscribed)",
    )
    pin_cpus: bool = Field(True, description="pin each node to its own cores (taskset)")

    @field_validator("subnet")
    @classmethod
    def _subnet(cls, v: str) -> str:
        net = ipaddress.ip_network(v, strict=True)
        if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
            raise ValueError("must be a private IPv4 subnet such as 10.77.0.0/24")
        return str(net)


class MpirunBackend(_Strict):
    """OpenMPI ``mpirun`` with a hostfile; ranks read OMPI_COMM_WORLD_RANK/SIZE."""

    kind: Literal["mpirun"] = "mpirun"
    hosts: list[str] = Field(
        default_factory=lambda: ["localhost"], description="hosts, written to a hostfile"
    )
    hostfile: str | None = Field(None, description="existing hostfile (overrides `hosts`)")
    slots_per_host: int | None = Field(None, ge=1, description="slots per host in the hostfile")
    coordinator: str | None = Field(
        None, description="host:port of rank 0's coordinator (default: first host, free port)"
    )
    mpirun: str = Field("mpirun", description="mpirun executable")
    extra_args: list[str] = Field(default_factory=list, description="more mpirun arguments")


class SlurmBackend(_Strict):
    """An sbatch script with one ``srun`` step per sweep entry."""

    kind: Literal["slurm"] = "slurm"
    nodes: int = Field(1, ge=1)
    tasks_per_node: int | None = Field(None, ge=1)
    cpus_per_task: int | None = Field(None, ge=1)
    partition: str | None = None
    account: str | None = None
    time: str = Field("00:30:00", description="wall-clock limit, HH:MM:SS")
    port: int = Field(29500, ge=1024, le=65535, description="coordinator port on the first node")
    python: str = Field("python3", description="interpreter on the compute nodes")
    setup: list[str] = Field(default_factory=list, description="shell lines run before srun")
    sbatch_args: list[str] = Field(default_factory=list, description="extra #SBATCH lines")

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if not re.match(r"^(\d+-)?\d{1,3}:\d{2}(:\d{2})?$", v):
            raise ValueError("must be HH:MM:SS or D-HH:MM:SS")
        return v


Backend = Annotated[
    LocalBackend | EmulatedBackend | MpirunBackend | SlurmBackend, Field(discriminator="kind")
]
BACKEND_KINDS = ("local", "emulated", "mpirun", "slurm")


# The algorithm registry's names (jaxcomm/algorithms/, light: no JAX): a new algorithm
# module is a valid recipe choice with no edit here.
_ALGORITHMS = algorithms
ALGORITHM_NAMES = (*_ALGORITHMS.names(), _ALGORITHMS.AUTO)
Algorithm = Literal[ALGORITHM_NAMES]  # type: ignore[valid-type]
AutoChoice = Literal[cost.AUTO_CHOICES]  # type: ignore[valid-type]
# A choice's steps relative to dense, as auto's steps factors are given.
StepsFactors = dict[AutoChoice, Annotated[float, Field(gt=0.0)]]


def _auto_setting(description: str, **constraints: Any) -> Any:
    """A setting only ``algorithm: auto`` reads: unset by default, its description says so."""
    return Field(None, description=f"auto: {description}", **constraints)


class DiLoCoSettings(_Strict):
    """DiLoCo (``jaxcomm.optax.diloco``): the optimizer runs ``every`` local steps on every
    rank, then ``jaxcomm.algorithm`` (dense, in ``grad_dtype`` on the wire, or a compressed
    one with error feedback) averages the change of the weights for the outer step."""

    every: int = Field(..., ge=1, description="inner steps between outer steps (H)")
    outer_lr: float = Field(0.7, gt=0.0, description="outer SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer Nesterov momentum")
    delay: int = Field(
        0,
        ge=0,
        description="inner steps between an outer allreduce's start and its application "
        "(Streaming DiLoCo; it runs on jaxcomm's engine meanwhile); < every",
    )
    fragments: int = Field(1, ge=1, description="parameter fragments synced at staggered steps")
    sites: bool = Field(
        False,
        description="DiLoCo over sites: each process is one worker whose devices train it "
        "data-parallel, and each device sends its share of the outer exchange between processes",
    )

    @model_validator(mode="after")
    def _check(self) -> DiLoCoSettings:
        if self.delay >= self.every or self.fragments > self.every:
            raise ValueError("diloco: delay must be < every and fragments <= every")
        return self

    def label_suffix(self) -> str:
        """``"-delay2"`` / ``"-frag4"`` / ``"-sites"`` parts of a label (empty for plain
        DiLoCo)."""
        return (
            (f"-delay{self.delay}" if self.delay else "")
            + (f"-frag{self.fragments}" if self.fragments > 1 else "")
            + ("-sites" if self.sites else "")
        )


class JaxcommSettings(_Strict):
    """How gradients are reduced; passed to the job (the training jobs use them)."""

    algorithm: Algorithm = "dense"
    density: float = Field(0.01, gt=0.0, le=1.0, description="fraction of gradient entries sent")
    grad_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype each rank's gradient is cast to before it is reduced"
    )
    hierarchical: bool = False
    label: str | None = Field(None, description="name of this entry in tables and plots")
    allowed: list[AutoChoice] | None = Field(
        None,
        description=f"algorithms auto may choose (default: {', '.join(cost.DEFAULT_ALLOWED)})",
    )
    profile: str | None = _auto_setting("profile JSON from `jaxcomm probe`")
    compute_seconds: float | None = _auto_setting(
        "seconds of a training step besides the gradient reduction (e.g. one rank's step); "
        "extra steps pay it again",
        ge=0.0,
    )
    steps_factor: StepsFactors | None = _auto_setting(
        "steps each choice needs to reach the target relative to dense, e.g. measured on this "
        "model by benchmarks/train.py (default: each algorithm's own)"
    )
    dense_steps: int | None = _auto_setting(
        "steps dense training needs to reach the target; with steps_factor_no_warmup, auto "
        "decides whether the sparse warm-up pays; a learning auto reads them as the run's "
        "length",
        ge=1,
    )
    steps_factor_no_warmup: StepsFactors | None = _auto_setting(
        "steps_factor of training without the sparse warm-up"
    )
    diloco: DiLoCoSettings | None = Field(
        None, description="train with DiLoCo; `algorithm` is then its outer allreduce"
    )

    def display_label(self) -> str:
        """Returns the name used for this setting in run directories, tables and plots.

        Returns:
            ``label`` if set, else the algorithm (with density for sparse algorithms).

        Example:
            >>> JaxcommSettings(algorithm="gtopk", density=0.01).display_label()
            'gtopk-d0.01'
        """
        if self.label:
            return self.label
        name = self.algorithm
        if self.algorithm != _ALGORITHMS.AUTO and _ALGORITHMS.get(self.algorithm).uses_density:
            name += f"-d{self.density:g}"
        if self.grad_dtype == "bfloat16":
            name += "-bf16"
        if self.hierarchical:
            name += "-hier"
        if self.diloco is not None:
            name = f"diloco{self.diloco.every}-{name}{self.diloco.label_suffix()}"
        return name


def _all_optional(model: type[BaseModel], name: str, doc: str) -> type[BaseModel]:
    """A strict model with every field of ``model``, each optional with default None.

    Each field keeps its type, constraints and description, so a setting is declared once (in
    ``model``) and an override of it is checked alike; None means "not overridden".

    Args:
        model: The model whose fields are copied (its validators are not: a model-level check
            applies to the merged settings, which are validated as ``model`` again).
        name: The new model's class name.
        doc: Its docstring.

    Returns:
        The new model class (extra keys forbidden, like every recipe section).

    Example:
        >>> Partial = _all_optional(World, "Partial", "Some of World's fields.")
        >>> Partial(devices_per_process=2).model_dump(exclude_none=True)
        {'devices_per_process': 2}
        >>> try:
        ...     Partial(processes=0)
        ... except ValidationError as e:
        ...     print(e.errors()[0]["msg"])
        Input should be greater than or equal to 1
    """
    fields: dict[str, Any] = {}
    for field, info in model.model_fields.items():
        # The constraints (gt, le, ...) go on the value's type, so None stays allowed.
        kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        fields[field] = (kind | None, Field(None, description=info.description))
    return create_model(name, __base__=_Strict, __doc__=doc, __module__=__name__, **fields)


JaxcommOverride = _all_optional(
    JaxcommSettings,
    "JaxcommOverride",
    "One sweep entry: any subset of :class:`JaxcommSettings` fields.",
)


class Train(_Strict):
    """Training settings shared by the bundled jobs."""

    steps: int = Field(200, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch, split across all devices")
    learning_rate: float = Field(0.1, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    hidden: int = Field(64, ge=1)
    eval_every: int = Field(25, ge=1)
    seed: int = 0
    target: float | None = Field(
        None,
        description="stop at the first evaluation that reaches this value of the job's metric "
        "(test accuracy: at least; bits per byte: at most); None: run all steps",
    )
    time_cap_s: float | None = Field(
        None, gt=0, description="stop after this many seconds of training (the ranks agree)"
    )
    checkpoint_every: int = Field(
        0, ge=0, description="steps between checkpoints (0: none); a restarted run resumes there"
    )


class Metrics(_Strict):
    """What the run records and draws."""

    log_every: int = Field(1, ge=1, description="write a JSON line every N steps")
    plots: bool = True
    warmup_steps: int = Field(2, ge=0, description="steps excluded from step-time summaries")


FAULT_KINDS = ("link_down", "loss", "delay", "bandwidth", "straggler", "kill", "partition")
NETWORK_FAULTS = ("link_down", "loss", "delay", "bandwidth", "partition")
"""Fault kinds that change the emulated cluster's links (``backend: emulated`` only)."""
NETEM_FAULTS = ("loss", "delay")
"""Fault kinds that need the kernel's ``netem`` qdisc."""

# What each kind needs (besides kind and a trigger) and what it may set.
_FAULT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "link_down": (("node", "seconds"), ()),
    "loss": (("node", "seconds", "percent"), ()),
    "delay": (("node", "seconds", "delay_ms"), ("jitter_ms",)),
    "bandwidth": (("node", "bandwidth"), ("seconds",)),
    "straggler": (("node", "seconds"), ("cpu",)),
    "kill": (("node",), ()),
    "partition": (("groups", "seconds"), ()),
}
_FAULT_HINTS = {
    "node": "node: the rank (emulated: its node) it hits, e.g. node: 1",
    "seconds": "seconds: how long it lasts, e.g. seconds: 5",
    "percent": "percent: packets lost, e.g. percent: 1",
    "delay_ms": "delay_ms: added one-way delay, e.g. delay_ms: 20",
    "bandwidth": "bandwidth: the link's new tc rate, e.g. bandwidth: 100mbit",
    "groups": "groups: the nodes of each side, e.g. groups: [[0], [1]]",
}


class Fault(_Strict):
    """One scheduled fault (``faults:`` entries); docs/faults.md describes each kind."""

    kind: Literal["link_down", "loss", "delay", "bandwidth", "straggler", "kill", "partition"]
    at_s: float | None = Field(
        None, ge=0, description="seconds after the ranks start (first attempt)"
    )
    at_step: int | None = Field(
        None, ge=0, description="when rank 0 has dispatched this many training steps"
    )
    node: int | None = Field(None, ge=0, description="the rank / emulated node it hits")
    seconds: float | None = Field(None, gt=0, description="how long it lasts")
    percent: float | None = Field(None, gt=0, le=100, description="loss: packets dropped, %")
    delay_ms: float | None = Field(None, gt=0, description="delay: added one-way delay")
    jitter_ms: float | None = Field(None, ge=0, description="delay: jitter")
    bandwidth: TcRate | None = Field(None, description="bandwidth: the link's new tc rate")
    cpu: float = Field(0.25, gt=0, lt=1, description="straggler: share of CPU time left")
    groups: list[list[int]] | None = Field(None, description="partition: nodes of each side")

    @model_validator(mode="after")
    def _check(self) -> Fault:
        if (self.at_s is None) == (self.at_step is None):
            raise ValueError(
                f"{self.kind}: give exactly one trigger, at_s (seconds after the start) or "
                "at_step (a training step), e.g. at_s: 30"
            )
        needed, optional = _FAULT_FIELDS[self.kind]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{self.kind} needs " + "; ".join(_FAULT_HINTS[f] for f in missing))
        allowed = {"kind", "at_s", "at_step", "cpu", *needed, *optional}
        extra = [
            f
            for f in ("node", "seconds", "percent", "delay_ms", "jitter_ms", "bandwidth", "groups")
            if getattr(self, f) is not None and f not in allowed
        ]
        if extra:
            raise ValueError(
                f"{self.kind} does not take {', '.join(extra)} (it takes "
                f"{', '.join(sorted(allowed - {'kind'}))})"
            )
        if self.kind == "partition":
            assert self.groups is not None
            flat = [n for g in self.groups for n in g]
            if len(self.groups) != 2 or not all(self.groups) or len(set(flat)) != len(flat):
                raise ValueError(
                    "partition: groups must be two non-empty lists of distinct nodes, "
                    "e.g. groups: [[0], [1]]"
                )
        return self

    def nodes(self) -> list[int]:
        """The nodes this fault names (its ``node``, or every node of its ``groups``)."""
        if self.groups is not None:
            return [n for g in self.groups for n in g]
        return [] if self.node is None else [self.node]

    def describe(self) -> str:
        """One line for logs and the timeline, e.g. ``link_down node 1 for 5 s``.

        Returns:
            The description.

        Example:
            >>> Fault(kind="kill", node=1, at_step=40).describe()
            'kill node 1'
        """
        where = f"groups {self.groups}" if self.groups is not None else f"node {self.node}"
        what = ""
        if self.kind == "loss":
            what = f" {self.percent:g}% loss"
        elif self.kind == "delay":
            what = f" +{self.delay_ms:g} ms" + (
                f" ±{self.jitter_ms:g} ms" if self.jitter_ms else ""
            )
        elif self.kind == "bandwidth":
            what = f" to {self.bandwidth}"
        elif self.kind == "straggler":
            what = f" at {self.cpu:g} CPU"
        during = f" for {self.seconds:g} s" if self.seconds is not None else ""
        return f"{self.kind} {where}{what}{during}"


TRANSPORT_SETTING = "JAXCOMM_TRANSPORT"
"""The ranks' setting that picks the transport of GPU collectives (ucx, nccl or auto)."""
SHARED_GPU_TRANSPORTS = ("ucx", "auto")
"""Transports that serve ranks sharing one GPU (auto picks UCX when a GPU is shared)."""
PREALLOCATE_SETTING = "XLA_PYTHON_CLIENT_PREALLOCATE"
"""JAX's switch for taking most of a GPU's memory at start; off where ranks share a GPU."""


class Recipe(_Strict):
    """A complete run description. See ``recipes/*.yaml`` for examples."""

    name: str = Field(..., min_length=1, pattern=r"^[\w.\-]+$")
    description: str = ""
    job: str = Field(..., description="bundled job name or module:function")
    world: World = Field(default_factory=World)
    backend: Backend = Field(default_factory=LocalBackend)
    jaxcomm: JaxcommSettings = Field(default_factory=JaxcommSettings)
    sweep: list[JaxcommOverride] = Field(
        default_factory=list, description="jaxcomm overrides, one run per entry"
    )
    train: Train = Field(default_factory=Train)
    metrics: Metrics = Field(default_factory=Metrics)
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="the job's arguments, checked against what it declares (jobs/args.py)",
    )
    pythonpath: list[str] = Field(
        default_factory=list, description="directories added to the ranks' PYTHONPATH"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for ranks")
    timeout: float | None = Field(None, gt=0, description="seconds for the whole run")
    max_restarts: int = Field(
        0,
        ge=0,
        le=100,
        description="relaunches of the whole world after a rank fails (resuming from the "
        "newest checkpoint, see train.checkpoint_every)",
    )
    faults: list[Fault] = Field(
        default_factory=list, description="faults injected on schedule (docs/faults.md)"
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_shorthand(cls, v: Any) -> Any:
        # `backend: mpirun` is accepted as shorthand for `backend: {kind: mpirun}`.
        if isinstance(v, str):
            return {"kind": v}
        if isinstance(v, dict) and "kind" not in v:
            return {**v, "kind": "local"}
        return v

    @field_validator("job")
    @classmethod
    def _job(cls, v: str) -> str:
        if v in BUNDLED_JOBS or _JOB_RE.match(v):
            return v
        raise ValueError(
            f"must be a bundled job ({', '.join(sorted(BUNDLED_JOBS))}) or 'module:function'"
        )

    @model_validator(mode="after")
    def _check_sweep(self) -> Recipe:
        labels = [v.display_label() for v in self.variants()]
        dup = {x for x in labels if labels.count(x) > 1}
        if dup:
            raise ValueError(f"sweep entries must have distinct labels, repeated: {sorted(dup)}")
        return self

    @model_validator(mode="after")
    def _check_faults(self) -> Recipe:
        n, kind = self.world.processes, self.backend.kind
        for i, fault in enumerate(self.faults):
            bad = [x for x in fault.nodes() if x >= n]
            if bad:
                raise ValueError(
                    f"faults[{i}] ({fault.kind}): node {bad[0]} does not exist; "
                    f"world.processes={n} has nodes 0..{n - 1}"
                )
            if fault.kind in NETWORK_FAULTS and kind != "emulated":
                raise ValueError(
                    f"faults[{i}] ({fault.kind}) changes the network, which only the emulated "
                    f"backend controls (backend is {kind}); use backend: emulated"
                )
            if fault.kind in ("kill", "straggler") and kind not in ("local", "emulated"):
                raise ValueError(
                    f"faults[{i}] ({fault.kind}) signals a rank's processes, which only the "
                    f"local and emulated backends start themselves (backend is {kind})"
                )
            if fault.kind == "partition" and fault.groups is not None and len(fault.nodes()) != n:
                raise ValueError(
                    f"faults[{i}] (partition): groups must list every node 0..{n - 1} once"
                )
        return self

    @model_validator(mode="after")
    def _check_args(self, info: ValidationInfo) -> Recipe:
        # A typo'd argument exits 2 here, not inside every rank. The training jobs' keys come
        # from their examples, which import JAX: `jaxcomm plan` skips those (LIGHT).
        if self.args:
            light = (info.context or {}).get(LIGHT, False)
            check_args(self.job, self.args, examples=not light)
        return self

    @model_validator(mode="after")
    def _check_env(self) -> Recipe:
        # The ranks' JAXCOMM_* settings fail here, before any rank starts, not in every rank.
        for name in self.env:
            if name in config.SETTINGS:
                try:
                    config.get(name, self.env)
                except config.ConfigError as exc:
                    raise ValueError(f"env.{name}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_shared_gpus(self) -> Recipe:
        if not self.world.shares_gpus:
            return self
        k = self.world.processes_per_gpu
        transport = self.env.get(TRANSPORT_SETTING, "")
        if transport not in ("", *SHARED_GPU_TRANSPORTS):
            raise ValueError(
                f"env.{TRANSPORT_SETTING}={transport!r}: world.processes_per_gpu={k} puts {k} "
                f"ranks on one GPU, which NCCL refuses; use {' or '.join(SHARED_GPU_TRANSPORTS)}"
            )
        if self.env.get(PREALLOCATE_SETTING, "false").lower() not in ("false", "0"):
            raise ValueError(
                f"env.{PREALLOCATE_SETTING}: ranks sharing a GPU must not preallocate it "
                f"(world.processes_per_gpu={k}); remove the setting"
            )
        for where, settings in self._variant_sources():
            if settings.algorithm == "psum":
                raise ValueError(
                    f"{where}.algorithm: psum runs XLA's NCCL collectives, which refuse "
                    f"several ranks on one GPU (world.processes_per_gpu={k}); use a jaxcomm "
                    "algorithm (dense, ...), which goes over UCX"
                )
        return self

    def _variant_sources(self) -> list[tuple[str, JaxcommSettings]]:
        """Each run's settings with the recipe key they come from (``jaxcomm``, ``sweep[i]``)."""
        if not self.sweep:
            return [("jaxcomm", self.jaxcomm)]
        return [(f"sweep[{i}]", v) for i, v in enumerate(self.variants())]

    def job_target(self) -> str:
        """Returns the ``module:function`` the ranks call.

        Returns:
            The resolved job target.

        Example:
            >>> Recipe(name="x", job="digits").job_target()
            'jaxcomm_launcher.jobs.digits:run'
        """
        return BUNDLED_JOBS.get(self.job, self.job)

    def variants(self) -> list[JaxcommSettings]:
        """Returns the jaxcomm settings of each run: the sweep entries, or the base settings.

        Returns:
            One validated :class:`JaxcommSettings` per run, in recipe order.

        Example:
            >>> r = Recipe(name="x", job="digits", sweep=[{"algorithm": "dense"}])
            >>> [v.algorithm for v in r.variants()]
            ['dense']
        """
        if not self.sweep:
            return [self.jaxcomm]
        base = self.jaxcomm.model_dump()
        return [
            JaxcommSettings(**{**base, **entry.model_dump(exclude_none=True)})
            for entry in self.sweep
        ]


# ---------------------------------------------------------------------------------------------
# Loading and error formatting


def _allowed_for(loc: tuple[Any, ...], err: dict[str, Any]) -> str | None:
    ctx = err.get("ctx") or {}
    etype = err.get("type", "")
    if etype == "literal_error" and "expected" in ctx:
        return str(ctx["expected"])
    if etype == "union_tag_invalid" or (etype == "union_tag_not_found"):
        return ", ".join(BACKEND_KINDS)
    if etype == "extra_forbidden":
        model = _model_at(loc[:-1])
        if model is not None:
            return ", ".join(model.model_fields)
    for key, word in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"{word} {ctx[key]}"
    if "pattern" in ctx:
        return f"matching {ctx['pattern']}"
    return None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    # Walk the schema along an error location to list the keys valid at that level.
    model: type[BaseModel] = Recipe
    for part in loc:
        if isinstance(part, int):  # a list index (sweep[1]) keeps the element's model
            continue
        if part in ("local", "emulated", "mpirun", "slurm"):
            model = {
                "local": LocalBackend,
                "emulated": EmulatedBackend,
                "mpirun": MpirunBackend,
                "slurm": SlurmBackend,
            }[part]
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif str(part) == "sweep":
            model = JaxcommOverride
        else:
            return None
    return model


def _format_loc(loc: tuple[Any, ...]) -> str:
    # pydantic puts the discriminator tag into the path (backend.mpirun.hosts); keep it, it
    # tells the user which backend's options were checked. Sweep entries show as sweep[1].
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(recipe)"


def format_validation_error(err: ValidationError, source: str) -> str:
    """Renders a pydantic error as lines naming field, bad value and allowed values.

    Args:
        err: The validation error raised for a recipe.
        source: Where the recipe came from (a path), for the first line.

    Returns:
        A multi-line message without a traceback.

    Example:
        >>> try:
        ...     Recipe(name="x", job="digits", world={"processes": -1})
        ... except ValidationError as e:
        ...     print(format_validation_error(e, "r.yaml").splitlines()[1])
          world.processes: -1 is not allowed (Input should be greater than or equal to 1); allowed: >= 1
    """
    lines = [f"invalid recipe {source}:"]
    for e in err.errors():
        loc = tuple(e.get("loc", ()))
        field = _format_loc(loc)
        etype = e.get("type", "")
        msg = e.get("msg", "")
        if etype == "extra_forbidden":
            line = f"  {field}: unknown key"
        elif etype == "missing":
            line = f"  {field}: required field is missing"
        elif etype == "union_tag_invalid":
            tag = (e.get("ctx") or {}).get("tag")
            line = f"  {field}.kind: {tag!r} is not a backend"
        elif etype == "value_error" and isinstance(e.get("input"), dict | list):
            # A section's own check (its message names the keys): not the section's contents.
            text = msg.removeprefix("Value error, ")
            line = f"  {text}" if field == "(recipe)" else f"  {field}: {text}"
        else:
            value = e.get("input")
            line = f"  {field}: {value!r} is not allowed ({msg})"
        allowed = _allowed_for(loc, e)
        if allowed:
            line += f"; allowed: {allowed}"
        lines.append(line)
    return "\n".join(lines)


def parse_set(items: list[str]) -> list[tuple[list[str], Any]]:
    """Parses ``--set a.b=value`` overrides; values are YAML scalars (``4``, ``true``, ``1gbit``).

    Args:
        items: Strings of the form ``dotted.key=value``.

    Returns:
        (key path, parsed value) pairs.

    Example:
        >>> parse_set(["world.processes=4"])
        [(['world', 'processes'], 4)]
    """
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not p for p in key.split(".")):
            raise RecipeError(f"--set {item!r}: expected dotted.key=value, e.g. world.processes=4")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise RecipeError(f"--set {item!r}: value is not valid YAML: {exc}") from None
        out.append((key.strip().split("."), value))
    return out


def apply_overrides(data: dict[str, Any], overrides: list[tuple[list[str], Any]]) -> dict[str, Any]:
    """Returns a copy of the raw recipe mapping with ``--set`` overrides applied.

    Args:
        data: The recipe as loaded from YAML.
        overrides: Output of :func:`parse_set`.

    Returns:
        The updated mapping (validation happens afterwards, so overrides are checked too).

    Example:
        >>> apply_overrides({"world": {"processes": 2}}, [(["world", "processes"], 4)])
        {'world': {'processes': 4}}
    """
    data = copy.deepcopy(data)
    for path, value in overrides:
        node = data
        for part in path[:-1]:
            nxt = node.get(part)
            if isinstance(nxt, str) and part == "backend":
                nxt = {"kind": nxt}  # expand the shorthand so backend.x=y works
            if not isinstance(nxt, dict):
                nxt = {}
            node[part] = nxt
            node = nxt
        node[path[-1]] = value
    return data


def load_recipe(
    path: str | pathlib.Path, overrides: list[str] | None = None, *, light: bool = False
) -> Recipe:
    """Reads, overrides and validates a recipe file.

    Args:
        path: The YAML file.
        overrides: ``--set`` strings applied before validation.
        light: Skip the checks that import JAX (a training job's ``args``), for commands
            that start no rank (``jaxcomm plan``).

    Returns:
        The validated recipe; relative ``pythonpath`` entries are resolved against the file.

    Raises:
        RecipeError: With a user-facing message for unreadable YAML or invalid fields.

    Example:
        >>> from jaxcomm_launcher.cli import bundled_recipes_dir
        >>> recipe = load_recipe(bundled_recipes_dir() / "digits-dense.yaml", ["train.steps=10"])
        >>> recipe.train.steps
        10
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe {path} is not valid YAML:\n{exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {path} must be a mapping of keys (name, job, world, ...), "
            f"got {type(data).__name__}"
        )
    data = apply_overrides(data, parse_set(overrides or []))
    try:
        recipe = Recipe.model_validate(data, context={LIGHT: light})
    except ValidationError as exc:
        raise RecipeError(format_validation_error(exc, str(path))) from None
    except ValueError as exc:  # raised by sweep expansion outside pydantic's wrapper
        raise RecipeError(f"invalid recipe {path}: {exc}") from None
    base = path.resolve().parent
    # A copy, not an assignment: that would validate the recipe again, without `light`.
    return recipe.model_copy(
        update={"pythonpath": [str((base / p).resolve()) for p in recipe.pythonpath]}
    )
