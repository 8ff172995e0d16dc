"""The replicated store without etcd: a transaction's row changes, applied in order to a copy, rebuild the same
database; a replica that refuses a commit leaves nothing in the leader's copy; --store values are checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankctl.coordinator.store import mirror
from rankctl.coordinator.ha.etcd import StoreURL, StoreURLError
from rankctl.coordinator.model.records import EventRecord, NodeRecord, RankRecord
from rankctl.coordinator.model.states import JobState
from rankctl.coordinator.store.database import Store, StoreError, replicated
from test_store import _job


class Log:
    """A replica that keeps the entries (or refuses them)."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, list]] = []
        self.refuse = False

    def commit(self, changes: list, what: str) -> None:
        if self.refuse:
            raise StoreError(f"the coordinator could not store {what}: refused; nothing was changed")
        self.entries.append((len(self.entries) + 1, mirror.decode(mirror.encode({"changes": changes}))["changes"]))

    submit = commit   # a store's replica, as a standby's journal


def dump(store: Store) -> dict[str, list]:
    db = store._db  # noqa: SLF001
    return {t: sorted(map(tuple, db.execute(f"SELECT * FROM {t}").fetchall()), key=repr) for t in mirror.KEYS}


def test_the_log_of_a_leaders_transactions_rebuilds_its_database_and_a_snapshot_plus_the_rest_too(tmp_path: Path) -> None:
    log = Log()
    leader = replicated(tmp_path / "a", log, None, [], "leader")
    job = _job()
    leader.insert_job(job)
    with leader.transaction("several"):
        job.state, job.nodes = JobState.RUNNING, ["n0"]
        leader.update_job(job)
        leader.append_event(EventRecord(job.id, 1, 1.0, JobState.RUNNING, "transition", "started"))
        leader.put_rank(job.id, RankRecord(0, "n0", "running", step=3, updated_at=2.0))
        leader.put_node(NodeRecord("n0", "10.0.0.1", 4, {}, "s1", 17, 5.0))
        leader.set_drain("n0", "ECC", 3.0)
    snapshot, upto = leader.serialize(), len(log.entries)
    leader.clear_ranks(job.id)                    # a delete of several rows: captured row by row
    leader.clear_drain("n0")
    leader.add_exclusion(job.id, "n1", "failed twice", 4.0)
    assert len(log.entries) == 5                  # one entry per outermost transaction

    from_log = replicated(tmp_path / "b", Log(), None, log.entries, "copy")
    from_snapshot = replicated(tmp_path / "c", Log(), snapshot, log.entries[upto:], "copy")
    assert dump(from_log) == dump(leader) == dump(from_snapshot)
    assert from_log.load_jobs()[0] == leader.load_jobs()[0] and from_log.ranks(job.id) == {}
    assert from_log.load_exclusions() == {job.id: {"n1": "failed twice"}}
    for s in (leader, from_log, from_snapshot):
        s.close()


def test_a_refused_replication_rolls_the_leaders_copy_back(tmp_path: Path) -> None:
    log = Log()
    store = replicated(tmp_path, log, None, [], "leader")
    store.insert_job(_job())
    log.refuse = True
    with pytest.raises(StoreError, match="refused"):
        store.insert_job(_job("b-000002", name="b"))
    assert [j.id for j in store.load_jobs()] == ["a-000001"] and len(log.entries) == 1
    log.refuse = False
    store.insert_job(_job("c-000003", name="c"))  # nothing of the refused one rides along
    assert [t for t, _, _ in log.entries[-1][1]] == ["jobs"] and len(log.entries[-1][1]) == 1
    store.close()


@pytest.mark.parametrize(("text", "endpoints", "prefix"), [
    ("etcd://127.0.0.1:2379", ("127.0.0.1:2379",), "/rankctl"),
    ("etcd://a:1,b:2,[::1]:3/team/x/", ("a:1", "b:2", "[::1]:3"), "/team/x"),
])
def test_store_urls(text: str, endpoints: tuple, prefix: str) -> None:
    url = StoreURL.parse(text)
    assert (url.endpoints, url.prefix) == (endpoints, prefix)


@pytest.mark.parametrize(("text", "says"), [
    ("http://127.0.0.1:2379", "it must be etcd://"),
    ("etcd://", "'(none)' is not HOST:PORT"),
    ("etcd://host", "'host' is not HOST:PORT"),
    ("etcd://h:99999", "'h:99999' is not HOST:PORT"),
    ("etcd://h:1/a b", "prefix '/a b'"),
])
def test_bad_store_urls_name_the_value_and_the_rule(text: str, says: str) -> None:
    with pytest.raises(StoreURLError) as err:
        StoreURL.parse(text)
    assert says in str(err.value) and text in str(err.value)


def test_a_registration_storm_is_one_store_write_and_a_name_taken_twice_at_once_is_refused(tmp_path: Path) -> None:
    from rankctl.coordinator.jobs.core import Coordinator
    from rankctl.coordinator.model.errors import NodeNameTaken
    from rankctl.coordinator.model.records import NodeHello

    log = Log()
    store = replicated(tmp_path, log, None, [], "leader")
    core = Coordinator(store)
    sent: list = []
    hellos = [(NodeHello(f"n{i}", "127.0.0.1", 2, {}, (29500,), (), f"s{i}"), sent.append) for i in range(50)]
    hellos.append((NodeHello("n0", "127.0.0.1", 2, {}, (29500,), (), "another-daemon"), sent.append))
    before = len(log.entries)
    out = core.register_many(hellos)
    assert len(log.entries) == before + 1                        # fifty records, one replicated entry
    assert [t for t, _, _ in log.entries[-1][1]].count("nodes") == 50
    assert isinstance(out[-1], NodeNameTaken) and "at the same moment" in str(out[-1])
    assert sum(1 for s in core.nodes if s.status.value == "READY") == 50
    assert sum(1 for m in sent if m is not None and m.WhichOneof("body") == "registered") == 50
    store.close()
