"""One job of the hang corpus (``tests/e2e/hangcorpus.py``) for ``bench/hangs.py``, on rankctl or on a launcher.

Both kinds of job answer the same questions: the ranks' pids, whether the job ended, when the system ended it
(``acted``), which ranks it named and when (``namings``), whether a healthy job came through, and ``stop``. A
watcher thread polls each job every ``POLL_S`` (rankctl: ``ctl status`` every 0.25 s; a launcher: its ranks in /proc).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import cluster
from hangcorpus import JOB, SCRIPT
from recovery import GLOG, signal_all
from systems import ElasticJob, Proc, alive, stamp

HERE = Path(__file__).resolve().parent
CORPUS_RANK = HERE / "corpus_rank.py"
POLL_S = 0.02
FINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
NAMES = re.compile(r"\branks? (\d+)(?:-(\d+))?")
MONITOR = re.compile(r"RankMonServer\d+@[^\]]*:(\d+)\] Did not get")
FAILED = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: (\d+)\)")


def named_ranks(text: str) -> list[int]:
    """The ranks a rankctl message names first (``rank 1``, ``ranks 0-1``): its first mention."""
    m = NAMES.search(text)
    if m is None:
        return []
    return list(range(int(m[1]), int(m[2] or m[1]) + 1))


def when(line: str) -> float | None:
    """A launcher line's stamp: NVRx's (``systems.stamp``) or torch elastic's glog prefix (``E1208 00:55:28.675``)."""
    t = stamp(line)
    if t is None and (m := GLOG.match(line)):
        mon, day, hh, mm, ss = m.groups()
        t = datetime(datetime.now().year, int(mon), int(day), int(hh), int(mm)).timestamp() + float(ss)
    return t


class Watched:
    """A job with a watcher thread calling ``poll`` until ``stop``."""

    def __init__(self, marks: Path) -> None:
        self.marks, self._done = marks, threading.Event()
        marks.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a lost poll is retried
                pass

    def poll(self) -> None:
        raise NotImplementedError

    def mark(self, name: str) -> float | None:
        """The epoch seconds a ``pause-*`` mark holds, or the mark file's time (``external-R``, ``stop-me-R``)."""
        path = self.marks / name
        try:
            text = path.read_text().strip()
            return float(text) if text else path.stat().st_mtime
        except (OSError, ValueError):
            return None

    def stop_watching(self) -> None:
        self._done.set()


class RankctlCorpus(Watched):
    """A ``kind: python`` job of the corpus (hangcorpus's ``JOB``), submitted to a running ``ProcCluster``."""

    def __init__(self, c: cluster.ProcCluster, where: Path, mode: str, case: str, hang_timeout: float | None) -> None:
        super().__init__(where / "marks")
        self.c, work = c, where / "work"
        work.mkdir(parents=True, exist_ok=True)
        (work / "corpus.py").write_text(SCRIPT)
        job_file = where / "job.yaml"
        timeout = "" if hang_timeout is None else f", hang_timeout: {hang_timeout:g}"
        job_file.write_text(JOB.format(name=where.name, workdir=work, mode=mode, marks=self.marks, case=case,
                                       timeout=timeout))
        self.id, self.state, self._pids, self._at = c.submit(str(job_file)), {}, {}, 0.0
        self._thread.start()

    def poll(self) -> None:
        if time.monotonic() - self._at >= 0.25 and self.state.get("state") not in FINAL:
            self._at = time.monotonic()
            self.state = cluster.status(self.c.address, self.id)

    def pids(self) -> dict[int, int]:
        for r in (0, 1):
            if r not in self._pids:
                try:
                    self._pids[r] = cluster.rank_pid(self.id, r)
                except AssertionError:
                    pass
        return dict(self._pids)

    def finished(self) -> bool:
        return self.state.get("state") in FINAL

    def attempt1(self) -> dict:
        attempts = self.state.get("attempts") or []
        return attempts[0] if attempts else {}

    def acted(self, t0: float, spare: frozenset[int] = frozenset()) -> float | None:
        """Attempt 1's end (``finished_at``), if after ``t0``."""
        t = self.attempt1().get("finished_at") or None
        return t if t is not None and t >= t0 else None

    def events(self) -> list[tuple[str, str, float]]:
        return cluster.timed_events(self.c.address, self.id)

    def namings(self, t0: float, until: float) -> list[tuple[float, list[int]]]:
        """(when, the ranks named first) of each ``stall``, ``stopped`` or ``transition`` event in [t0, until] that
        names a rank."""
        return [(t, ranks) for k, m, t in self.events() if k in ("stall", "stopped", "transition")
                and t0 <= t <= until and (ranks := named_ranks(m))]

    def healthy(self, t_done: float | None, timeout: float) -> tuple[bool, float | None]:
        """(succeeded on attempt 1, when the attempt ended otherwise), once the job ended."""
        final = cluster.wait_state(self.c.address, self.id, FINAL, timeout)
        ok = final.get("state") == "SUCCEEDED" and final.get("attempt") == 1
        self.state = final
        return ok, None if ok else (self.attempt1().get("finished_at") or time.time())

    def stop(self) -> None:
        self.stop_watching()
        if not self.finished():
            cluster.ctl(self.c.address, "cancel", self.id)
        try:
            cluster.wait_for(lambda: not cluster.rank_pids(self.id), 60, f"{self.id}'s ranks to exit", 0.2)
        except AssertionError:
            signal_all(cluster.rank_pids(self.id), signal.SIGKILL)


class LauncherJob(ElasticJob):
    """torchrun or ft_launcher, ``--standalone``, 2 ranks of ``corpus_rank.py``, ``--max-restarts=0``: a rank it
    ends is a death the bench sees, not a new attempt."""

    def start(self, args: list[str]) -> Proc:
        self.n += 1
        name = f"agent-{self.n}"
        return Proc([*self.launcher, *args, "--max-restarts=0", "--monitor-interval=0.1", "--local-addr=127.0.0.1",
                     f"--log-dir={self.where / ('logs-' + name)}", str(CORPUS_RANK), *self.rank_args],
                    self.where / f"{name}.log", {"OMP_NUM_THREADS": "1"}, cwd=self.where)


class LauncherCorpus(Watched):
    """A corpus job under a peer launcher (``systems.Elastic``: its launcher, FT config and heartbeat mode)."""

    def __init__(self, system, where: Path, mode: str, case: str) -> None:  # noqa: ANN001
        super().__init__(where / "marks")
        launcher = [str(system.python), "-m", "torch.distributed.run"]
        if system.ft is not None:
            launcher = [str(system.python.parent / "ft_launcher")]
            if system.ft:
                (where / "ft.yaml").write_text(system.ft)
                launcher.append(f"--ft-cfg-path={where / 'ft.yaml'}")
            else:
                launcher.append("--ignore-missing-fault-tol-cfg")
        self.job = LauncherJob(where, 2, launcher, [system.mode, mode, str(self.marks), case], "flat")
        self.deaths: dict[int, float] = {}
        self.exited: float | None = None
        self._thread.start()

    def poll(self) -> None:
        for pid in self.pids().values():
            if pid not in self.deaths and not alive(pid):
                self.deaths[pid] = time.time()
        if self.exited is None and self.job.procs[0].p.poll() is not None:
            self.exited = time.time()

    def pids(self) -> dict[int, int]:
        out = {}
        for path in self.marks.glob("pid-*"):
            try:
                out[int(path.name.split("-")[1])] = int(path.read_text())
            except ValueError:
                pass
        return out

    def finished(self) -> bool:
        return self.exited is not None

    def acted(self, t0: float, spare: frozenset[int] = frozenset()) -> float | None:
        """The first death of a rank process after ``t0`` but those in ``spare`` (the bench's own kill); else the
        launcher's exit."""
        deaths = [t for pid, t in self.deaths.items() if t >= t0 and pid not in spare]
        return min(deaths) if deaths else self.exited

    def namings(self, t0: float, until: float) -> list[tuple[float, list[int]]]:
        """(when, rank) of each line blaming a rank in [t0, until]: a rank monitor's ``Did not get .. heartbeat``
        or the agent's ``failed (exitcode ..) local_rank .. (pid P)`` (the lines ``systems.ElasticJob.named``
        reads)."""
        by_pid = {pid: rank for rank, pid in self.pids().items()}
        out: list[tuple[float, list[int]]] = []
        for p in self.job.procs:
            t = None   # (an unstamped line goes with the stamp before it)
            for line in p.text().splitlines():
                t = when(line) or t
                if t is None or t < t0 or t > until:
                    continue
                if m := MONITOR.search(line):
                    out.append((t, [int(m[1])]))
                elif (m := FAILED.search(line)) and int(m[1]) in by_pid:
                    out.append((t, [by_pid[int(m[1])]]))
        return sorted(out)

    def healthy(self, t_done: float | None, timeout: float) -> tuple[bool, float | None]:
        """(came through, when it was ended otherwise), once the launcher exited: a rank dead before the outside
        phase ended, or a launcher that exited non-zero."""
        cluster.wait_for(self.finished, timeout, "the launcher's exit", 0.1)
        early = [t for t in self.deaths.values() if t_done is None or t < t_done]
        if early or self.job.procs[0].p.returncode != 0:
            return False, min(early, default=self.exited)
        return True, None

    def stop(self) -> None:
        self.stop_watching()
        self.job.stop()
