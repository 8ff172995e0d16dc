"""The job-kind registry: every kind declares itself once, as a ``JobKind``, in its own folder.

A kind is found in three ways, all of which call ``register``:
- built in: every sub-package of ``rankctl.kinds`` that defines ``KIND`` (``kinds/train/``, ...);
- installed: an entry point in the group ``rankctl.kinds`` naming a ``JobKind`` or a module with ``KIND``;
- named at start-up: ``load_module(name)`` for ``Launcher.start(imports=...)``,
  ``LocalCluster(imports=...)`` and the ``RANKCTL_KINDS`` environment variable
  (comma-separated modules, read by ``ctl``, the coordinator and the launchers).

Pure: importing this module, or a kind's ``KIND``, never imports torch; the rank entry, the
result aggregation and the rendering are ``"module:function"`` strings resolved on first use.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable, Mapping

from rankctl.kinds.figures import Figure, Fold  # noqa: F401 - Fold: the kinds name it from here too

if TYPE_CHECKING:
    from pydantic import BaseModel

    from rankctl.contract.spec import JobSpec

ENTRY_POINT_GROUP = "rankctl.kinds"
ENV_VAR = "RANKCTL_KINDS"

Ref = "str | Callable[..., Any] | None"  # "module:function", a callable, or nothing


@dataclass(frozen=True, kw_only=True)
class JobKind:
    """Everything rankctl knows of one job kind.

    ``sections``: the kind's spec sections (name -> pydantic model with defaults), filled in at submit.
    ``check(spec, cfg) -> [problem, ...]``: cross-field rules, pure (no torch); run once at submit.
    ``entry``: the rank's function ``(RankContext) -> dict | None`` (its result).
    ``aggregate(rank -> result) -> job result``: on the coordinator, pure; default: every rank's result.
    ``summary(result) -> dict``: extra top-level fields of ``ctl status --json``.
    ``tables(result, rows_table) -> [(result key, table)]`` and ``progress(job) -> renderable | None``: ``ctl``'s view.
    ``client_overrides(spec, job_dir) -> ["key=value"]``: what ``ctl`` adds before submitting (e.g. absolute
    paths); ``job_dir`` is the job file's directory, absolute.
    ``blobs(spec dict) -> ["sha256:<hex>"]``: blobs the spec references (a packed workdir), pure; the
    coordinator refuses a job whose blobs it does not hold, and a daemon fetches them before its ranks start.
    ``blob_limit(spec dict) -> bytes``: the most a node may unpack of those blobs (a workdir quota), pure.
    ``shipment(spec) -> Shipment | None``: a directory ``ctl`` packs and uploads before submitting (a workdir).
    ``node_paths(spec dict, workdir, cwd) -> [(field, value, path)]``: the node files a rank will open, which
    the worker's sandbox keeps under its roots before the ranks start.
    ``written_paths(spec) -> [(field, value, path)]``: the node directories a rank creates, writes or deletes
    under, named by the spec (``path`` built from ``value``); the worker refuses one it cannot reach through no
    symbolic link below a root (``contract.files.safepath``), the coordinator one under no registered node's roots.
    ``drain_checkpoint``: a running job saves a checkpoint at a step the daemon asks for (a node's drain waits
    for it, then restarts the job without the node); otherwise a drain restarts it at once. A kind whose ranks
    agree on that step and report it (``contract.files.rankfiles.SAVED_ON_REQUEST`` among its ``figures``, folded
    ``max``) is moved once that step is complete; otherwise once every rank passed the step asked for.
    ``own_rendezvous``: the rank's code creates its default process group itself (torchrun-style scripts);
    the runtime creates no group before the entry runs.
    ``figures``: the per-step numbers the coordinator folds over a job's ranks into its step event, ``ctl``,
    the dashboard and the metrics (name -> ``kinds.figures.Figure``: how it is folded and shown, its chart and
    its gauge; or only its ``Fold``). Other numbers a rank reports stay in its metrics.
    ``secrets``: dotted spec fields whose values no client ever sees (``python.env``): a mapping's values are
    redacted and its keys stay, any other value is redacted; only the Assign to the job's nodes carries them.
    ``warm() -> None``: imports too heavy for the launcher's start-up that every rank would pay; the launcher
    calls it once, before it first forks ranks of this kind, so its forks inherit them.
    """

    name: str
    sections: Mapping[str, type["BaseModel"]] = field(default_factory=dict)
    check: Any = None
    entry: Any = None
    aggregate: Any = None
    summary: Any = None
    tables: Any = None
    progress: Any = None
    client_overrides: Any = None
    blobs: Any = None
    blob_limit: Any = None
    shipment: Any = None
    node_paths: Any = None
    written_paths: Any = None
    drain_checkpoint: bool = False
    own_rendezvous: bool = False
    figures: Mapping[str, "Fold | Figure"] = field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    warm: Any = None

    def resolve(self, attr: str) -> Callable[..., Any] | None:
        """The hook ``attr`` as a callable; a ``"module:function"`` string is imported now."""
        target = getattr(self, attr)
        if isinstance(target, str):
            module, _, name = target.partition(":")
            target = getattr(importlib.import_module(module), name)
        return target


@dataclass(frozen=True, kw_only=True)
class Shipment:
    """A directory ``ctl`` packs (gzip tar, ``.rankctlignore``) and uploads before submitting; the spec then
    references the blob by ``field`` (set to its digest), and ``source`` names it in errors."""

    directory: str
    max_mb: int
    field: str      # the spec field that references the blob, e.g. "python.workdir_blob"
    source: str     # the spec field that named the directory, e.g. "python.workdir"
    cap: str        # the spec field of max_mb, e.g. "python.workdir_max_mb"
    inside: tuple[str, str] | None = None   # (field, relative path) of a file that must be in it: the script run


_KINDS: dict[str, JobKind] = {}
_lock = threading.RLock()
_loaded = False
_version = 0  # bumped on every change, so that composed spec models are rebuilt


def register(kind: JobKind) -> JobKind:
    """Add (or replace) a kind."""
    global _version
    with _lock:
        _KINDS[kind.name] = kind
        _version += 1
    return kind


def unregister(name: str) -> None:
    """Forget a kind (tests that add one)."""
    global _version
    with _lock:
        _KINDS.pop(name, None)
        _version += 1


def register_kind(name: str, entry: Any) -> JobKind:
    """A kind with a rank entry only (no spec sections, no aggregation): tests and quick tools."""
    return register(JobKind(name=name, entry=entry))


def load_module(name: str) -> None:
    """Import ``name``; register its ``KIND`` if it has one (it may also call ``register`` itself)."""
    module = importlib.import_module(name)
    kind = getattr(module, "KIND", None)
    if isinstance(kind, JobKind):
        register(kind)


def _load_builtin() -> None:
    import rankctl.kinds as package

    for info in pkgutil.iter_modules(package.__path__):
        if info.ispkg:
            load_module(f"{package.__name__}.{info.name}")


def _load_entry_points() -> None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        target = ep.load()
        register(target) if isinstance(target, JobKind) else load_module(target.__name__)


def _load_env() -> None:
    for name in filter(None, (m.strip() for m in os.environ.get(ENV_VAR, "").split(","))):
        load_module(name)


def ensure_loaded() -> None:
    """Find the built-in, installed and ``RANKCTL_KINDS`` kinds (once per process)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        _load_builtin()
        _load_entry_points()
        _load_env()


def kinds() -> dict[str, JobKind]:
    ensure_loaded()
    return dict(_KINDS)


def version() -> int:
    ensure_loaded()
    return _version


def blobs_of(spec: "JobSpec") -> list[str]:
    """The blobs a typed job spec references, by its kind's ``blobs`` hook: e.g. a packed workdir.
    A kind unknown here references none (a daemon may not load the kinds its launcher loads)."""
    kind = kinds().get(spec.kind)
    hook = kind.resolve("blobs") if kind else None
    return list(hook(spec)) if hook else []


def blob_limit_of(spec: "JobSpec") -> int | None:
    """The bytes a node may unpack of the spec's blobs, by its kind's ``blob_limit`` hook; None: no limit
    of the spec's own (the node's cap applies)."""
    kind = kinds().get(spec.kind)
    hook = kind.resolve("blob_limit") if kind else None
    return int(hook(spec)) if hook else None


def unknown_kind(name: str) -> str:
    from rankctl.contract.names import shown

    return f"unknown job kind {shown(name)}; known kinds: {', '.join(sorted(kinds()))}"


def get(name: str) -> JobKind:
    try:
        return kinds()[name]
    except KeyError:
        raise ValueError(unknown_kind(name)) from None
