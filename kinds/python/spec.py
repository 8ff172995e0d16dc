"""The ``python`` kind's spec section: ``python`` (entry point, arguments, environment, workdir)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, StringConstraints, field_validator

from rankctl.contract.names import shown
from rankctl.contract.spec import Section

MAX_TEXT = 4096  # characters of an entry point, one env value, the workdir
MAX_ARG = 131_071        # characters of one argument: what Linux passes (MAX_ARG_STRLEN, 32 pages, less the NUL)
MAX_ARGS_TOTAL = 196_608  # characters of all arguments together (the job file holds at most 256 KiB)
MAX_ARGS = 1000
MAX_WORKDIR_MB = 1024  # python.workdir_max_mb: the largest packed workdir ctl may ship (the coordinator's cap)
UNPACKED_PER_PACKED = 4  # python.workdir_max_unpacked_mb's default: this many times workdir_max_mb
BLOB_RE = r"sha256:[0-9a-f]{64}"
MAX_ENV = 256
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# what the rank sets as torchrun does (``run.torchrun_env``); a job's env may not override them
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
RESERVED_ENV_PREFIX = "MASTER_"

Text = Annotated[StrictStr, StringConstraints(max_length=MAX_TEXT)]
Arg = Annotated[StrictStr, StringConstraints(max_length=MAX_ARG)]
Blob = Annotated[StrictStr, StringConstraints(pattern=f"^{BLOB_RE}$")]


class PythonSpec(Section):
    """Your own script or function, run in every rank with torchrun's environment and the job's groups."""

    entrypoint: StrictStr = Field("", max_length=MAX_TEXT)
    """What each rank runs: a script (``train.py``) or a function (``package.module:function``); or give
    ``module`` instead."""
    module: StrictStr = Field("", max_length=MAX_TEXT)
    """A module each rank runs as ``__main__`` (``python -m package.module``, torchrun's ``-m``), found on the
    workdir or installed on the nodes; instead of ``entrypoint``."""
    args: list[Arg] = Field(default_factory=list, max_length=MAX_ARGS)
    """The script's arguments (``sys.argv[1:]``): each at most what Linux passes in one argument (128 KiB), all
    together at most 192 KiB."""
    env: dict[StrictStr, Text] = Field(default_factory=dict, max_length=MAX_ENV)
    """Environment variables of every rank (a secret: shown to no client); RANK, WORLD_SIZE and the others
    torchrun sets are rankctl's."""
    workdir: StrictStr | None = Field(None, min_length=1, max_length=MAX_TEXT)
    """A directory on the submitting machine: ``ctl submit`` packs and uploads it, and every rank runs in the
    node's extracted copy. null: the worker's own working directory."""
    workdir_blob: Blob | None = None
    """Set by ctl, not by hand: the packed workdir's digest on the coordinator."""
    workdir_max_mb: StrictInt = Field(100, ge=1, le=MAX_WORKDIR_MB)
    """The largest packed workdir ctl ships (MiB)."""
    workdir_max_unpacked_mb: StrictInt | None = Field(None, ge=1, le=UNPACKED_PER_PACKED * MAX_WORKDIR_MB)
    """The most a node extracts of the shipped workdir (MiB, counted as bytes arrive); None: 4 x workdir_max_mb."""

    def unpacked_limit_mb(self) -> int:
        """``workdir_max_unpacked_mb``, or its default."""
        return self.workdir_max_unpacked_mb or UNPACKED_PER_PACKED * self.workdir_max_mb

    @field_validator("args")
    @classmethod
    def _args_total(cls, args: list[str]) -> list[str]:
        total = sum(len(a) for a in args)
        if total > MAX_ARGS_TOTAL:
            raise ValueError(f"{len(args)} arguments of {total} characters in all; the limit is {MAX_ARGS_TOTAL}")
        return args

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"env name {shown(name)} must match [A-Za-z_][A-Za-z0-9_]*")
            if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
                raise ValueError(f"env {name} is set by rankctl for every rank (as torchrun does); "
                                 f"a job may not override {', '.join(RESERVED_ENV)} or {RESERVED_ENV_PREFIX}*")
        return env
