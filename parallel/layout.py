"""Megatron-exact rank layout: which ranks form which communication group.

Pure rank math (stdlib and numpy, no torch). Ranks are numbered over a grid of
parallel dimensions listed in ``order``, the first token varying fastest. With
the default order ``tp-cp-ep-dp-pp`` and the dense grid (ep = 1)::

    rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))

Expert layers factor the same ranks a second time, ``(etp, ep, edp, pp)``
with cp = 1, in the same order; both factorisations must agree on pp groups.

An "X" group holds the ranks whose X coordinate differs and every other
coordinate is equal. Combined groups (``tp_dp`` ...) vary several dimensions.
This reproduces ``megatron.core.parallel_state.initialize_model_parallel``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cached_property, lru_cache
from typing import Any, Iterator

import numpy as np

from rankctl.contract.limits import MAX_PARALLEL_SIZE, MAX_VPP, MAX_WORLD_SIZE
from rankctl.contract.names import shown
from rankctl.contract.spec import DEFAULT_ORDER

TOKENS = ("tp", "cp", "ep", "dp", "pp")
# Megatron's RankGenerator appends tokens missing from ``order`` in this order.
_APPEND_ORDER = ("tp", "pp", "dp", "ep", "cp")
MAX_ORDER_CHARS = 32   # "tp-cp-ep-dp-pp" is 14


class GroupName(StrEnum):
    """The name of a kind of process group: one closed set, defined here and imported everywhere else.
    Members are strings (``GroupName.TP == "tp"``), so assignments, JSON and user code keep plain names."""

    TP = "tp"
    PP = "pp"
    DP = "dp"
    CP = "cp"
    DP_CP = "dp_cp"
    MP = "mp"
    TP_CP = "tp_cp"
    TP_DP = "tp_dp"
    TP_DP_CP = "tp_dp_cp"
    EMBD = "embd"
    POS_EMBD = "pos_embd"
    EP = "ep"
    EXPT_TP = "expt_tp"
    TP_EP = "tp_ep"
    TP_EP_PP = "tp_ep_pp"
    EXPT_DP = "expt_dp"
    WORLD = "world"  # every rank: the default group (a rank's groups, never a layout's)


G = GroupName
# group name -> the grid dimensions that vary inside one group of it
DENSE_GROUPS: dict[GroupName, tuple[str, ...]] = {
    G.TP: ("tp",),
    G.PP: ("pp",),
    G.DP: ("dp",),
    G.CP: ("cp",),
    G.DP_CP: ("dp", "cp"),
    G.MP: ("tp", "pp"),
    G.TP_CP: ("tp", "cp"),
    G.TP_DP: ("tp", "dp"),
    G.TP_DP_CP: ("tp", "dp", "cp"),
}
EXPERT_GROUPS: dict[GroupName, tuple[str, ...]] = {
    G.EP: ("ep",),
    G.EXPT_TP: ("tp",),
    G.TP_EP: ("tp", "ep"),
    G.TP_EP_PP: ("tp", "ep", "pp"),
    G.EXPT_DP: ("dp",),
}
EMBEDDING_GROUPS = (G.EMBD, G.POS_EMBD)
GROUP_NAMES: tuple[GroupName, ...] = (*DENSE_GROUPS, *EMBEDDING_GROUPS, *EXPERT_GROUPS)
assert set(GROUP_NAMES) | {G.WORLD} == set(GroupName)


class LayoutError(ValueError):
    """A parallel configuration that Megatron would reject (or that cannot be laid out)."""


def _fmt(**values: object) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


@dataclass(frozen=True)
class _Grid:
    """One factorisation of the ranks: sizes per token, in rank order (fastest first)."""

    tokens: tuple[str, ...]
    sizes: tuple[int, ...]

    @cached_property
    def strides(self) -> tuple[int, ...]:
        out, acc = [], 1
        for s in self.sizes:
            out.append(acc)
            acc *= s
        return tuple(out)

    @property
    def world_size(self) -> int:
        return int(np.prod(self.sizes, dtype=np.int64))

    def size(self, token: str) -> int:
        return self.sizes[self.tokens.index(token)]

    def coords(self, rank: int) -> dict[str, int]:
        return {t: (rank // d) % s for t, s, d in zip(self.tokens, self.sizes, self.strides)}

    def groups(self, varying: tuple[str, ...]) -> np.ndarray:
        """All groups as a (num_groups, group_size) array; rows and members ascending."""
        n = len(self.tokens)
        grid = np.arange(self.world_size, dtype=np.int64).reshape(self.sizes[::-1])
        axis = {t: n - 1 - i for i, t in enumerate(self.tokens)}  # C order: last axis fastest
        mask = [t in varying for t in self.tokens]
        fixed_axes = [axis[t] for t, m in zip(self.tokens, mask) if not m][::-1]
        vary_axes = [axis[t] for t, m in zip(self.tokens, mask) if m][::-1]
        group_size = int(np.prod([self.size(t) for t in self.tokens if t in varying], dtype=np.int64))
        return grid.transpose(fixed_axes + vary_axes).reshape(-1, group_size)

    def group_of(self, rank: int, varying: tuple[str, ...]) -> list[int]:
        """The one group of ``rank``: O(group size), independent of the world size."""
        members = [rank]
        for t, s, d in zip(self.tokens, self.sizes, self.strides):
            if t not in varying or s == 1:
                continue
            idx = (rank // d) % s
            members = [m + (j - idx) * d for j in range(s) for m in members]
        return sorted(members)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Sizes of every parallel dimension; dp and the expert data-parallel size are derived.

    Raises ``LayoutError`` on construction when Megatron would reject the layout.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    order: str = DEFAULT_ORDER
    _tokens: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_sizes()
        object.__setattr__(self, "order", self.order.strip().lower())
        self._check_divisibility()
        object.__setattr__(self, "_tokens", self._check_order())
        if self.vpp is not None and self.pp == 1:
            raise LayoutError(
                f"vpp={self.vpp} needs pipeline parallelism: virtual pipeline chunks require pp > 1 (pp=1)"
            )
        self._check_expert_grid()

    # -- derived sizes -------------------------------------------------------
    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def model_size(self) -> int:
        return self.tp * self.pp * self.cp

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d.update(dp=self.dp, expert_dp=self.expert_dp)
        return d

    # -- grids ---------------------------------------------------------------
    def _grid(self, sizes: dict[str, int]) -> _Grid:
        tokens = self._tokens
        return _Grid(tokens=tokens, sizes=tuple(sizes[t] for t in tokens))

    @cached_property
    def dense_grid(self) -> _Grid:
        return self._grid({"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp})

    @cached_property
    def expert_grid(self) -> _Grid:
        return self._grid(
            {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        )

    # -- validation ----------------------------------------------------------
    def _check_sizes(self) -> None:
        named = {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep}
        if self.etp is not None:
            named["etp"] = self.etp
        if self.vpp is not None:
            named["vpp"] = self.vpp
        for name, value in named.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"{name}={value!r} must be an integer")
            if value < 1:
                raise LayoutError(f"{name}={value} must be at least 1")
            most = MAX_WORLD_SIZE if name == "world_size" else MAX_VPP if name == "vpp" else MAX_PARALLEL_SIZE
            if value > most:
                raise LayoutError(f"{name}={value} exceeds the maximum of {most}"
                                  + (" ranks" if name == "world_size" else ""))
        if not isinstance(self.order, str):
            raise LayoutError(f"order={shown(self.order)} must be a string such as 'tp-cp-ep-dp-pp'")
        if len(self.order) > MAX_ORDER_CHARS:   # every later message quotes it
            raise LayoutError(f"order={shown(self.order)} must be at most {MAX_ORDER_CHARS} characters: the tokens "
                              f"{', '.join(TOKENS)} joined by '-'")

    def _check_order(self) -> tuple[str, ...]:
        given = tuple(self.order.split("-"))
        for tok in given:
            if tok not in TOKENS:
                raise LayoutError(
                    f"order={self.order!r} has unknown token {tok!r}: tokens are {', '.join(TOKENS)}"
                )
        dup = sorted({t for t in given if given.count(t) > 1})
        if dup:
            raise LayoutError(f"order={self.order!r} repeats {', '.join(dup)}: each token may appear once")
        dense = {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}
        expert = {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}
        names = {"tp": ("tp", "etp"), "cp": ("cp",), "ep": ("ep",), "dp": ("dp", "expert_dp"), "pp": ("pp",)}
        missing = [t for t in TOKENS if t not in given and (dense[t] != 1 or expert[t] != 1)]
        if missing:
            detail = _fmt(**{n: getattr(self, "expert_tp" if n == "etp" else n) for t in missing for n in names[t]})
            raise LayoutError(
                f"order={self.order!r} omits {', '.join(missing)} ({detail}): "
                "a dimension whose size is not 1 must appear in the order"
            )
        return given + tuple(t for t in _APPEND_ORDER if t not in given)

    def _check_divisibility(self) -> None:
        if self.world_size % self.model_size:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by tp*pp*cp={self.model_size} "
                f"({_fmt(tp=self.tp, pp=self.pp, cp=self.cp)})"
            )
        expert_model = self.expert_tp * self.ep * self.pp
        if self.world_size % expert_model:
            raise LayoutError(
                f"world_size={self.world_size} is not divisible by etp*ep*pp={expert_model} "
                f"({_fmt(etp=self.expert_tp, ep=self.ep, pp=self.pp)})"
            )

    def _check_expert_grid(self) -> None:
        if not (self._tokens_given[-1] == "pp" or self.pp == 1 or self.expert_dp == self.dp):
            raise LayoutError(
                f"order={self.order!r} does not end in pp, so the expert data-parallel size must equal dp, "
                f"but expert_dp={self.expert_dp} and dp={self.dp} "
                f"({_fmt(tp=self.tp, cp=self.cp, etp=self.expert_tp, ep=self.ep, pp=self.pp)})"
            )
        if self.pp == 1 or self._tokens_given[-1] == "pp":
            return   # pp outermost in both grids (or pipelines of one rank): the same pipelines, without building them
        dense_pp = self.dense_grid.groups(("pp",))
        expert_pp = self.expert_grid.groups(("pp",))
        if not np.array_equal(dense_pp, expert_pp):
            raise LayoutError(
                f"dense and expert pp groups differ for order={self.order!r} "
                f"({_fmt(tp=self.tp, cp=self.cp, etp=self.expert_tp, ep=self.ep, pp=self.pp)}): "
                f"e.g. dense {dense_pp[0].tolist()} vs expert {expert_pp[0].tolist()}; "
                "both factorisations must give the same pipelines"
            )

    @property
    def _tokens_given(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))


def layout_words(parallel: Any, world_size: int) -> str:
    """"tp2 pp2 dp2": every parallel size above 1 of a layout (a spec's ``parallel`` or a ``ParallelConfig``) at
    ``world_size`` ranks, and always dp: how ``ctl status`` names an attempt's layout and a resume's."""
    p = parallel
    dp = max(1, world_size // max(1, p.tp * p.pp * p.cp))
    sizes = [("tp", p.tp), ("pp", p.pp), ("vpp", p.vpp or 1), ("cp", p.cp), ("ep", p.ep)]
    return " ".join([f"{k}{v}" for k, v in sizes if v > 1] + [f"dp{dp}"])


class RankLayout:
    """Every communication group of a ``ParallelConfig``, by group name."""

    names: tuple[GroupName, ...] = GROUP_NAMES

    def __init__(self, config: ParallelConfig) -> None:
        self.config = config
        self._cache: dict[str, np.ndarray] = {}

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def group_array(self, name: str) -> np.ndarray:
        """All groups of ``name`` as a (num_groups, group_size) int64 array."""
        if name not in self._cache:
            built = self._build(name)
            built.setflags(write=False)   # shared by every caller in the process (``shared_layout``)
            self._cache[name] = built
        return self._cache[name]

    def _build(self, name: str) -> np.ndarray:
        cfg = self.config
        if name in DENSE_GROUPS:
            return cfg.dense_grid.groups(DENSE_GROUPS[name])
        if name in EXPERT_GROUPS:
            return cfg.expert_grid.groups(EXPERT_GROUPS[name])
        if name == "embd":
            pp = self.group_array("pp")
            return pp[:, [0]] if cfg.pp == 1 else pp[:, [0, -1]]
        if name == "pos_embd":
            return self.group_array("pp")[:, [0]]
        raise KeyError(f"unknown group name {name!r}; names are {', '.join(GROUP_NAMES)}")

    def groups(self, name: str) -> list[list[int]]:
        return self.group_array(name).tolist()

    def iter_groups(self, cache: bool = True) -> Iterator[tuple[str, np.ndarray]]:
        """(name, groups) for every group name; ``cache=False`` keeps one name's array alive at a time."""
        for name in self.names:
            yield name, self.group_array(name) if cache or name in self._cache else self._build(name)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank={rank} is outside the world (0..{self.world_size - 1})")

    def rank_groups(self, rank: int) -> dict[str, list[int]]:
        """The groups ``rank`` belongs to, one per group name; cost independent of world size.

        ``embd`` and ``pos_embd`` appear only for the ranks that are members.
        """
        self._check_rank(rank)
        cfg = self.config
        out: dict[str, list[int]] = {}
        for name, varying in DENSE_GROUPS.items():
            out[name] = cfg.dense_grid.group_of(rank, varying)
        pipeline = out["pp"]
        embd = pipeline[:1] if cfg.pp == 1 else [pipeline[0], pipeline[-1]]
        if rank in embd:
            out["embd"] = embd
        if rank == pipeline[0]:
            out["pos_embd"] = pipeline[:1]
        for name, varying in EXPERT_GROUPS.items():
            out[name] = cfg.expert_grid.group_of(rank, varying)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates (tp, cp, dp, pp), ep from the expert grid, and etp, edp."""
        self._check_rank(rank)
        dense = self.config.dense_grid.coords(rank)
        expert = self.config.expert_grid.coords(rank)
        return {
            "tp": dense["tp"],
            "cp": dense["cp"],
            "ep": expert["ep"],
            "dp": dense["dp"],
            "pp": dense["pp"],
            "etp": expert["tp"],
            "edp": expert["dp"],
        }

    def to_dict(self) -> dict:
        return {"config": self.config.to_dict(), "groups": {k: self.groups(k) for k in self.names}}


LAYOUTS_KEPT = 16   # layouts a process keeps (a 65,536-rank one holds about 8 MB of group arrays once built)


@lru_cache(maxsize=LAYOUTS_KEPT)
def shared_layout(config: ParallelConfig) -> RankLayout:
    """The one ``RankLayout`` of ``config`` in this process: its group arrays are built once, whoever asks (the
    coordinator's planner at every attempt and its PlanJob, the daemon at every Assign of that layout, the rank)."""
    return RankLayout(config)
