"""Who a hang waits for: the attempt's failure reason, from the evidence the daemons sent.

When a job is hung (``coordinator.recovery.reconciler``), each rank whose collective counters had stopped
moving has sent, once, its counters per process group (``RankRecord.collectives``: ``worker.runs.hangwatch``'s
JSON, "the tp group [2, 3]: entered 83, completed 82, in all_reduce since T") and its Python stack
(``RankRecord.stack``); the daemons also report stopped processes (``RankRecord.process``).
``hang_reason`` compares them:

* a group some rank waits in, with the operation and its sequence number (the waiting rank's entered
  count in that group): for a collective, the members whose own count is below it never entered it;
  for point-to-point (``batch_isend_irecv``, ``send`` ...: counts differ by pipeline stage) the members
  that do not wait in that group are named;
* a rank that is stopped (SIGSTOP, a debugger), or whose counters stopped while it is in no collective
  (spinning, or blocked outside torch.distributed), is named first;
* each named rank: where it was last seen (node, phase, step, process state) and its stack's first frames.

Pure and bounded: one pass over the job's rank records (attribute and substring checks); JSON is parsed
only for the ranks it compares: the stopped and spinning ones, the first ``WAITING_READ`` waiting ranks, the
members of at most ``GROUPS_COMPARED`` groups some rank waits in (their shown members), so a hang of 65,536 ranks
costs about what one of a thousand does. The text is cut at ``REASON_CHARS``. Without evidence the reason is what the coordinator
alone knows (stopped ranks, the slowest step).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from rankctl.coordinator.diagnosis.pace import NAMING_EVIDENCE
from rankctl.coordinator.diagnosis.progress import rank_span
from rankctl.coordinator.model.records import RankRecord

P2P_OPS = frozenset({"batch_isend_irecv", "send", "recv", "isend", "irecv"})
GROUPS_COMPARED = 256    # groups some rank waits in, compared member by member, at most
WAITING_READ = NAMING_EVIDENCE   # waiting ranks whose evidence is read to find those groups, at most
GROUP_LINES = 4          # of them named in the reason
DETAILED = 3             # ranks described with where they were last seen and their stack
SPAN_RANKS = 64          # ranks listed in one span
MEMBERS_SHOWN = 16       # members printed for a group
STACK_FRAMES = 6         # frames of a stack in the reason
STACK_CHARS = 320
REASON_CHARS = 1900      # the job's reason keeps 2,000 characters; the attempt's row the whole text


@dataclass
class Evidence:
    """One rank's counters when they stopped moving (``worker.runs.hangwatch.evidence_json``)."""

    rank: int
    groups: list[dict[str, Any]]
    still_s: float | None
    waits_in: dict[str, Any] | None       # the group it is blocked in
    counters: bool = True                 # False: the rank had no counter file
    computing: bool = False               # its CPU time advanced outside any collective
    spinning: bool = False                # ... in a spin: the same Python stack twice, holding the GIL
    _by_key: dict[tuple, dict[str, Any]] | None = field(default=None, repr=False)

    def group(self, key: tuple) -> dict[str, Any] | None:
        if self._by_key is None:
            self._by_key = {group_key(g): g for g in self.groups}
        return self._by_key.get(key)


@dataclass
class Waiting:
    """A group some rank is blocked in."""

    key: tuple
    kind: str
    members: list[int]
    size: int
    op: str
    seq: int
    ranks: list[int] = field(default_factory=list)   # blocked in it
    ops: dict[int, str] = field(default_factory=dict)  # the operation each rank inside it is in (a mismatch: several)

    @property
    def p2p(self) -> bool:
        return self.op in P2P_OPS


def group_key(g: Mapping[str, Any]) -> tuple:
    """A group's identity: its kinds, lowest member and size (groups of one kind never overlap)."""
    members = g.get("members") or []
    return (str(g.get("kind", "")), members[0] if members else -1, int(g.get("size") or len(members)))


def parse(rec: RankRecord) -> Evidence | None:
    """A rank record's evidence; None when it has none (or it was withdrawn: the rank moved again)."""
    if not rec.collectives:
        return None
    try:
        doc = json.loads(rec.collectives)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list):
        return None
    groups = [g for g in doc["groups"] if isinstance(g, dict)]
    waits_in = next((g for g in groups if g.get("in")), None)
    still = doc.get("still_s")
    return Evidence(rank=rec.rank, groups=groups, still_s=float(still) if isinstance(still, (int, float)) else None,
                    waits_in=waits_in, counters=doc.get("counters", True) is not False,
                    computing=doc.get("computing") is True, spinning=doc.get("spinning") is True)


def primary(kind: str) -> str:
    """The first of the layout kinds a group is named by ("tp,tp_cp,tp_dp" -> "tp")."""
    return kind.split(",")[0] or "group"


def members_text(members: list[int], size: int) -> str:
    shown = ", ".join(str(m) for m in members[:MEMBERS_SHOWN])
    more = size - min(len(members), MEMBERS_SHOWN)
    return f"[{shown}{f', … {more} more' if more > 0 else ''}]"


def span(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    text = rank_span(sorted(ranks)[:SPAN_RANKS])
    return text + (f" (and {len(ranks) - SPAN_RANKS} more)" if len(ranks) > SPAN_RANKS else "")


# frames that only wrap the user's call (torch's logger, rankctl's counters, runpy): left out of a compact stack
_WRAPPERS = ("(c10d_logger.py:", ".counted (collectives.py:", "(<frozen runpy>:")
_PYSPY_FRAME = re.compile(r"^\s+(\S.*?) \((.+?)\)\s*$")
_FAULT_FRAME = re.compile(r'^\s+File "(.+?)", line (\d+) in (.+?)\s*$')


def compact_stack(stack: str) -> str:
    """The first thread's innermost frames as ``fn (file.py:12) <- caller (...)`` (py-spy or faulthandler)."""
    if not stack:
        return "none"
    if stack.startswith(("no stack", "stopped, no stack")):
        return stack.splitlines()[0][:STACK_CHARS]
    frames: list[str] = []
    started = False
    for line in stack.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            if started and frames:
                break  # the first thread only
            started = True
            continue
        m = _PYSPY_FRAME.match(line)
        if m:
            where = m.group(2).rsplit("/", 1)[-1]
            frames.append(f"{m.group(1)} ({where})")
        elif (m := _FAULT_FRAME.match(line)) is not None:
            frames.append(f"{m.group(3)} ({m.group(1).rsplit('/', 1)[-1]}:{m.group(2)})")
        if frames and any(w in frames[-1] for w in _WRAPPERS):
            frames.pop()
        if len(frames) >= STACK_FRAMES:
            break
    text = " <- ".join(frames) if frames else stack.strip().splitlines()[0]
    return text if len(text) <= STACK_CHARS else text[:STACK_CHARS - 1] + "…"


class Evidences:
    """Each rank's evidence, parsed on first use (a hang of a large job parses only what it compares)."""

    def __init__(self, ranks: Mapping[int, RankRecord]) -> None:
        self.ranks = ranks
        self._parsed: dict[int, Evidence | None] = {}

    def get(self, rank: int) -> Evidence | None:
        if rank not in self._parsed:
            rec = self.ranks.get(rank)
            self._parsed[rank] = parse(rec) if rec is not None and rec.collectives and not rec.exited else None
        return self._parsed[rank]


def waiting_of(ev: Evidence) -> Waiting:
    g = ev.waits_in or {}
    key = group_key(g)
    return Waiting(key=key, kind=str(g.get("kind", "group")), members=list(g.get("members") or []), size=key[2],
                   op=str(g.get("op", "?")), seq=int(g.get("entered") or 0), ranks=[ev.rank],
                   ops={ev.rank: str(g.get("op", "?"))})


def _compare(w: Waiting, evidence: Evidences, stopped: set[int]) -> tuple[list[int], list[int]]:
    """Complete ``w`` from its shown members' evidence: who else waits in it (its sequence number is the
    highest they entered), and (members that never entered it / are not in it, members without evidence)."""
    others: list[tuple[int, Evidence | None]] = []
    entered = {r: w.seq for r in w.ranks}
    for m in w.members:
        if m in w.ranks:
            continue
        ev = evidence.get(m)
        if ev is not None and ev.waits_in is not None and group_key(ev.waits_in) == w.key:
            w.ranks.append(m)
            w.ops[m] = str(ev.waits_in.get("op", "?"))
            seq = entered[m] = int(ev.waits_in.get("entered") or 0)
            if seq > w.seq and not w.p2p:
                w.seq, w.op = seq, str(ev.waits_in.get("op", w.op))
        else:
            others.append((m, ev))
    missing, silent = [], []
    if not w.p2p:  # a member still inside an earlier operation of the group never entered this one
        missing = [r for r in w.ranks if entered.get(r, w.seq) < w.seq]
        w.ranks = [r for r in w.ranks if r not in missing]
    w.ranks.sort()
    for m, ev in others:
        if ev is None:
            (missing if m in stopped else silent).append(m)
        elif w.p2p:
            missing.append(m)
        elif (mine := ev.group(w.key)) is None or int(mine.get("entered") or 0) < w.seq:
            missing.append(m)
    return missing, silent


def _where(rec: RankRecord | None, ev: Evidence | None, rank: int) -> str:
    if rec is None:
        return f"rank {rank}: no report"
    process = {"stopped": "stopped (SIGSTOP or a debugger)", "traced": "traced (a debugger)"}.get(rec.process, "running")
    if ev is None:
        doing = "no counters reported"
    elif not ev.counters:
        doing = "no collective counters"
    elif ev.waits_in is not None:
        g = ev.waits_in
        doing = f"waits in {primary(str(g.get('kind', '')))} {g.get('op', '?')} #{g.get('entered', 0)}"
    else:
        doing = "in no collective"
    if ev is not None and ev.computing and rec.process not in ("stopped", "traced"):
        doing += ", its CPU time advancing (computing)"
    if ev is not None and ev.spinning and rec.process not in ("stopped", "traced"):
        doing += ", spinning in Python (the same stack twice, holding the GIL)"
    if ev is not None and ev.still_s is not None:
        doing += f", counters still for {ev.still_s:.0f} s when sent"
    return (f"rank {rank} last seen on {rec.node}: phase {rec.phase}, step {rec.step}, process {process}, "
            f"{doing}; stack: {compact_stack(rec.stack)}")


def stop_line(rec: RankRecord) -> str:
    """The event naming a rank the daemon saw stopped or traced, as soon as it did: where, and in what."""
    ev = parse(rec)
    g = ev.waits_in if ev is not None else None
    doing = f"in {primary(str(g.get('kind', '')))} {g.get('op', '?')} #{g.get('entered', 0)}" if g else \
        "in no collective" if ev is not None else "no counters yet"
    if rec.process == "traced":
        return f"rank {rec.rank} held by a debugger (traced) on {rec.node}, {doing}: a pause"
    return (f"rank {rec.rank} stopped (SIGSTOP) on {rec.node}, {doing}, step {rec.step}: a hang if it stays "
            f"stopped about a second")


BLOCKED_SEEN = '"in":true'   # in a rank's evidence: it waits in a group (a substring test, no parse)


def hang_reason(ranks: Mapping[int, RankRecord], summary: Any, idle: float, rule: str,
                links: list[tuple[str, str]] | None = None, named: list[int] | None = None) -> str:
    """The failure reason of a hung attempt (see the module docstring); ``summary`` is the job's
    ``JobSummary`` (``min_step``, ``stragglers``); ``rule``: how it was judged (``Verdict.rule``). The node pairs
    whose link a group's wait points at go on ``links``; the ranks it points at (stopped, spinning, or never
    in the operation their peers wait in; ``SPAN_RANKS`` at most) on ``named``."""
    parts = [f"hang: no rank advanced for {idle:.0f} s ({rule})"]
    body, pointed, details = _body(ranks, links)
    parts += body
    if summary.stragglers:
        parts.append(f"slowest step {summary.min_step} held by {rank_span(summary.stragglers)}"
                     f"{' (and more)' if len(summary.stragglers) >= 16 else ''}")
    else:
        parts.append(f"every rank at step {summary.min_step}")
    parts += details
    if named is not None:
        named += pointed
    text = "; ".join(parts)
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def waiting_line(ranks: Mapping[int, RankRecord], named: list[int]) -> str:
    """Whom the waiting ranks wait for, where it is (its operation or its frame) and who waits for it: the text of
    the ``waiting`` event that names a hang before any judgement (the ranks pointed at go on ``named``)."""
    body, pointed, details = _body(ranks, None)
    named += pointed
    text = "; ".join(body + details)
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def _body(ranks: Mapping[int, RankRecord], links: list[tuple[str, str]] | None
          ) -> tuple[list[str], list[int], list[str]]:
    """(the lines naming the roots and the groups that wait, the ranks pointed at, where the first of those were
    last seen)."""
    sent = [r for r in ranks.values() if r.collectives and not r.exited]   # one pass: who sent evidence
    evidence = Evidences(ranks)
    stopped, roots, parts = _roots(ranks, sent, evidence)
    waiting, head = _waiting_groups(roots, sent, evidence)
    pointed: list[int] = list(roots)
    found: list[tuple[str, str]] = []
    shown, more = _group_lines(waiting, head, set(roots), evidence, stopped, pointed, ranks, found)
    parts += shown
    if links is not None:
        links += found
    if more:
        parts.append(f"{more} more group(s) waiting")
    if not waiting and not roots:
        parts.append("no rank sent collective counters")
    elif waiting and not found and not shown and not roots:
        parts.append(f"{len(waiting)} group(s) waiting, every shown member in them")
    pointed = list(dict.fromkeys(pointed))[:SPAN_RANKS]
    details = [_where(ranks.get(r), evidence.get(r), r) for r in pointed[:DETAILED]]
    return parts, pointed, details


def _roots(ranks: Mapping[int, RankRecord], sent: list[RankRecord], evidence: Evidences
           ) -> tuple[set[int], list[int], list[str]]:
    """(stopped ranks, the ranks a hang is likeliest rooted in, the lines naming them): stopped ones, and
    ones stalled outside any collective with their process running (spinning, or blocked outside
    torch.distributed)."""
    lines = []
    stopped_recs = sorted((r for r in ranks.values() if r.process == "stopped" and not r.exited), key=lambda r: r.rank)
    stopped = {r.rank for r in stopped_recs}
    if stopped_recs:
        nodes = sorted({r.node for r in stopped_recs})
        lines.append(f"{span(stopped)} stopped (SIGSTOP or a debugger) on {', '.join(nodes[:8])}"
                     f"{' …' if len(nodes) > 8 else ''}")
    spinning = sorted(r.rank for r in sent if BLOCKED_SEEN not in r.collectives and r.rank not in stopped
                      and evidence.get(r.rank) is not None)
    if spinning:
        spins = [r for r in spinning if (ev := evidence.get(r)) is not None and ev.spinning]
        lines.append(f"{span(spinning)} in no collective while no rank advanced (process running"
                     f"{f'; {span(spins)} spinning in Python' if spins else ''})")
    return stopped, sorted(stopped)[:SPAN_RANKS] + spinning[:SPAN_RANKS], lines


def _waiting_groups(roots: list[int], sent: list[RankRecord], evidence: Evidences
                    ) -> tuple[dict[tuple, Waiting], set[tuple]]:
    """Groups someone waits in, and the keys of those a root rank belongs to: first those (seen through the
    roots' own groups' members), then those of the other waiting ranks in rank order, GROUPS_COMPARED at most."""
    waiting: dict[tuple, Waiting] = {}
    head: set[tuple] = set()
    for r in roots[:16]:
        ev = evidence.get(r)
        for g in ev.groups if ev is not None else ():
            for m in (g.get("members") or [])[:MEMBERS_SHOWN]:
                other = evidence.get(m)
                if other is not None and other.waits_in is not None and group_key(other.waits_in) == group_key(g):
                    waiting.setdefault(group_key(g), waiting_of(other))
                    head.add(group_key(g))
                    break
    for i, r in enumerate(sorted(r.rank for r in sent if BLOCKED_SEEN in r.collectives)):
        if len(waiting) >= GROUPS_COMPARED or i >= WAITING_READ:
            break   # (every rank of a big job waiting in one group: 65,536 parses would hold the loop a second)
        ev = evidence.get(r)
        if ev is not None and ev.waits_in is not None and group_key(ev.waits_in) not in waiting:
            waiting[group_key(ev.waits_in)] = waiting_of(ev)
    return waiting, head


def link_of(w: Waiting, ranks: Mapping[int, RankRecord]) -> tuple[str, str] | None:
    """The two nodes of a group no member of which is missing from the operation some wait inside (each is inside
    it, or past it: a ring all-reduce lets a member finish before a peer has its last chunk): its ranks on one node
    wait for those on the other, so the link between them is the likeliest cause."""
    if w.size > len(w.members):
        return None
    nodes = sorted({rec.node for m in w.members if (rec := ranks.get(m)) is not None})
    return (nodes[0], nodes[1]) if len(nodes) == 2 else None


def _group_lines(waiting: dict[tuple, Waiting], head: set[tuple], roots: set[int], evidence: Evidences,
                 stopped: set[int], named: list[int], ranks: Mapping[int, RankRecord],
                 links: list[tuple[str, str]]) -> tuple[list[str], int]:
    """(the lines shown, how many more groups wait) for the groups some member is missing from, those of a
    root rank first, then the groups whose members all wait inside across two nodes (their pairs go on
    ``links``). The members named go on ``named``."""
    root_lines: list[str] = []   # groups a stopped or spinning rank is missing from (or stopped in)
    other_lines: list[str] = []
    link_lines: list[str] = []
    more = 0
    for k, w in waiting.items():
        missing, silent = _compare(w, evidence, stopped)
        stopped_in = [r for r in w.ranks if r in stopped]
        if not w.p2p and len({w.ops.get(r) for r in w.ranks}) > 1:
            named += [r for r in w.ranks if r not in named][:8]
            root_lines.append(f"{primary(w.kind)} group {members_text(w.members, w.size)} at #{w.seq} in different "
                              f"operations: {', '.join(f'rank {r} in {w.ops.get(r)}' for r in w.ranks[:8])}: a "
                              f"mismatch, they never complete")
            continue
        if not (missing or silent or stopped_in):
            pair = link_of(w, ranks) if not roots else None
            if pair is not None and pair not in links:
                links.append(pair)
                where = "inside it" if len(w.ranks) == w.size else "inside it or past it"
                link_lines.append(f"{primary(w.kind)} group {members_text(w.members, w.size)} waits in {w.op} "
                                  f"#{w.seq} with every member {where}, on nodes {pair[0]} and {pair[1]}: each "
                                  f"waits for the other; the link between {pair[0]} and {pair[1]} may be cut or "
                                  f"failing")
            continue
        lines = root_lines if k in head or roots.intersection(missing, silent, stopped_in) else other_lines
        if len(lines) >= GROUP_LINES:
            more += 1
            continue
        notes = ([f"{span(missing)} {'not in it' if w.p2p else 'never entered it'}"] if missing else []) + \
                ([f"{span(silent)} sent no counters"] if silent else []) + \
                ([f"{span(stopped_in)} stopped inside it"] if stopped_in else [])
        lines.append(f"{primary(w.kind)} group {members_text(w.members, w.size)} waits in {w.op} #{w.seq} "
                     f"({span(w.ranks)} {'in it' if w.p2p else 'entered it'}): {', '.join(notes)}")
        named += [r for r in missing + silent if r not in named][:8]
    shown = (root_lines + other_lines + link_lines)[:GROUP_LINES]
    return shown, more + len(root_lines) + len(other_lines) + len(link_lines) - len(shown)
