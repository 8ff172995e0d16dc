"""Named contexts (a coordinator address and a TLS identity directory) in the user's config file.

The file is YAML: ``current-context: NAME`` and ``contexts: {NAME: {coordinator: HOST:PORT, tls_dir: DIR}}``,
at ``$RANKCTL_CONFIG``, else ``click.get_app_dir("rankctl")/config.yaml`` ($XDG_CONFIG_HOME/rankctl on
Linux). Precedence for the address and the directory: flag > env > the selected context > default.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click

from rankctl.cli.errors import EXIT_USAGE, CtlError

DEFAULT_COORDINATOR = "127.0.0.1:7420"
CONFIG_ENV = "RANKCTL_CONFIG"
CONTEXT_ENV = "RANKCTL_CONTEXT"
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
CONTEXT_KEYS = ("coordinator", "tls_dir")


def config_path() -> Path:
    explicit = os.environ.get(CONFIG_ENV)
    return Path(explicit) if explicit else Path(click.get_app_dir("rankctl")) / "config.yaml"


def name_problem(name: str) -> str | None:
    if NAME_RULE.fullmatch(name):
        return None
    return (f"context name {name!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a letter "
            "or a digit")


def address_problem(address: str) -> str | None:
    """HOST:PORT (port 1-65535), a gRPC ``unix:`` target, or several HOST:PORT joined by commas (the coordinators
    of one replicated store)."""
    if address.startswith("unix:") and len(address) > 5:
        return None
    for part in address.split(","):
        host, _, port = part.rpartition(":")
        if not (host and port.isascii() and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in part)):
            return (f"coordinator {address!r} must be HOST:PORT with a port 1-65535, several joined by commas, "
                    "or unix:PATH")
    return None


@dataclass(frozen=True, kw_only=True)
class Context:
    coordinator: str
    tls_dir: str | None = None


@dataclass(frozen=True, kw_only=True)
class Config:
    current: str | None = None
    contexts: dict[str, Context] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        return {"current-context": self.current,
                "contexts": {n: {k: v for k, v in vars(c).items() if v is not None} for n, c in self.contexts.items()}}

    def with_context(self, name: str, ctx: Context) -> "Config":
        return replace(self, contexts={**self.contexts, name: ctx})

    def without(self, name: str) -> "Config":
        rest = {n: c for n, c in self.contexts.items() if n != name}
        return replace(self, contexts=rest, current=None if self.current == name else self.current)


class ConfigError(CtlError):
    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}", EXIT_USAGE)


def _context(path: Path, name: Any, body: Any) -> Context:
    where = f"contexts.{name}"
    if not isinstance(name, str):   # YAML read `1:` or `null:` as a number or None, not a name
        raise ConfigError(path, f"{where}: a context name is a string; YAML read this key as "
                                f"{type(name).__name__} {name!r} (quote it)")
    if name_problem(name):
        raise ConfigError(path, f"{where}: {name_problem(name)}")
    if not isinstance(body, dict):
        raise ConfigError(path, f"{where} is {body!r}: must be a mapping with coordinator (and tls_dir)")
    unknown = sorted(set(map(str, body)) - set(CONTEXT_KEYS))
    if unknown:
        raise ConfigError(path, f"{where}.{unknown[0]}: unknown field (fields: {', '.join(CONTEXT_KEYS)})")
    coordinator, tls_dir = body.get("coordinator"), body.get("tls_dir")
    if not isinstance(coordinator, str) or address_problem(coordinator):
        problem = address_problem(coordinator) if isinstance(coordinator, str) else "a string HOST:PORT is required"
        raise ConfigError(path, f"{where}.coordinator={coordinator!r}: {problem}")
    if tls_dir is not None and (not isinstance(tls_dir, str) or not tls_dir):
        raise ConfigError(path, f"{where}.tls_dir={tls_dir!r}: must be a directory path (a string)")
    return Context(coordinator=coordinator, tls_dir=tls_dir)


def parse(path: Path, doc: Any) -> Config:
    """The config from a loaded YAML document; ConfigError names the field, the value and the rule."""
    if doc is None:
        return Config()
    if not isinstance(doc, dict):
        raise ConfigError(path, f"the file holds {type(doc).__name__}: it must be a mapping with "
                                "current-context and contexts")
    unknown = sorted(set(map(str, doc)) - {"current-context", "contexts"})
    if unknown:
        raise ConfigError(path, f"{unknown[0]}: unknown field (fields: current-context, contexts)")
    raw = doc.get("contexts") or {}
    if not isinstance(raw, dict):
        raise ConfigError(path, f"contexts is {raw!r}: must be a mapping NAME -> {{coordinator, tls_dir}}")
    contexts = {name: _context(path, name, body) for name, body in raw.items()}
    current = doc.get("current-context")
    if current is not None and current not in contexts:
        raise ConfigError(path, f"current-context={current!r} names no context (contexts: "
                                f"{', '.join(contexts) or 'none'})")
    return Config(current=current, contexts=contexts)


def load(path: Path | None = None) -> Config:
    """The config file (an empty config when there is none)."""
    import yaml

    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(path, exc.strerror or str(exc)) from None
    try:
        return parse(path, yaml.safe_load(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(path, f"not valid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None


def save(config: Config, path: Path | None = None) -> Path:
    """Write atomically (a temporary file renamed over it), mode 0600; the directory is made 0700."""
    import yaml

    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path.parent)  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config.to_doc(), f, sort_keys=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def selected(config: Config, name: str | None, path: Path) -> Context | None:
    """The context ``name`` (--context / RANKCTL_CONTEXT), else the file's current one, else None."""
    name = name or config.current
    if name is None:
        return None
    if name not in config.contexts:
        raise ConfigError(path, f"no context {name!r} (contexts: {', '.join(config.contexts) or 'none'}; "
                                "`ctl config set-context NAME --coordinator HOST:PORT` adds one)")
    return config.contexts[name]


def configured(coordinator: str | None, context: str | None) -> bool:
    """Whether a coordinator was chosen at all (flag, env, a named or current context), rather than the default:
    ``ctl run`` starts an embedded one when none was."""
    if coordinator:
        return True
    path = config_path()
    return selected(load(path), context, path) is not None


def resolve(coordinator: str | None, tls_dir: str | None, context: str | None) -> tuple[str, str | None]:
    """The coordinator address and TLS directory, each: given (flag or env) > the selected context > default.
    The file is read only when something is missing or a context is named. A given address that cannot be one is
    refused naming where it came from (it waited ~5 s for a connection before)."""
    if coordinator is not None and (problem := address_problem(coordinator)):
        raise CtlError(f"--coordinator (or env RANKCTL_COORDINATOR): {problem}")
    if coordinator and tls_dir and not context:
        return coordinator, tls_dir
    path = config_path()
    chosen = selected(load(path), context, path) or Context(coordinator=DEFAULT_COORDINATOR)
    chosen_tls = os.path.expanduser(chosen.tls_dir) if chosen.tls_dir else None
    return coordinator or chosen.coordinator, tls_dir or chosen_tls
