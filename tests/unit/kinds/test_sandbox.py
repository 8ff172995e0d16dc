"""The worker's path sandbox (``worker.files.sandbox``): pure, on files under tmp_path, no processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankctl.contract.assignment import RankAssignment
from rankctl.contract.jobfile import SpecError
from rankctl.contract.names import job_id_problem, job_name_problem
from rankctl.contract.spec import JobSpec
from rankctl.kinds.spec import build_spec
from rankctl.kinds.python import run as python_run
from rankctl.kinds.python.checks import node_paths as python_paths
from rankctl.kinds.train.checks import node_paths as train_paths
from rankctl.worker.files import paths
from rankctl.worker.files import sandbox
from rankctl.worker.files.sandbox import allowed_roots, assignment_problem, derived_problem, path_problem

HOSTILE_NAMES = ["..", ".", "/", "a/b", "../etc", "x\x00y", "a" * 64, "", "A", "-a", "a-", "a" * 100_000, 7, None]


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """state/ and data/ (the roots), data2/ (a prefix trick), outside/secret, links leading out and in."""
    t = {name: tmp_path / name for name in ("state", "data", "data2", "outside")}
    for d in t.values():
        d.mkdir()
    (t["data"] / "corpus.txt").write_text("text")
    (t["outside"] / "secret").write_text("secret")
    (t["data"] / "leak").symlink_to(t["outside"] / "secret")
    (t["outside"] / "in").symlink_to(t["data"] / "corpus.txt")
    t["roots"] = allowed_roots([str(t["data"])], str(t["state"]))
    return t


def train(data: str):
    return build_spec({"name": "j", "kind": "train", "train": {"data": data}})


def python(entrypoint: str, workdir: str | None = None, **extra):
    return build_spec({"name": "j", "kind": "python", "python": {"entrypoint": entrypoint, "workdir": workdir, **extra}})


def test_roots_are_the_state_dir_by_default_then_the_data_roots_as_real_paths(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert allowed_roots([], str(tmp_path / "state")) == [str(tmp_path / "state")]
    roots = allowed_roots([str(tmp_path / "link"), str(tmp_path / "real")], str(tmp_path / "state"))
    assert roots == [str(tmp_path / "state"), str(tmp_path / "real")]
    with pytest.raises(ValueError, match="not a directory"):
        allowed_roots([str(tmp_path / "missing")], str(tmp_path / "state"))
    with pytest.raises(ValueError, match="empty --data-root"):
        allowed_roots([""], str(tmp_path / "state"))


def test_paths_under_a_root_are_allowed_in_any_root(tree) -> None:
    roots = tree["roots"]
    for ok in (tree["data"] / "corpus.txt", tree["data"], tree["state"] / "x" / "not-yet-there",
               tree["data"] / "sub" / ".." / "corpus.txt", tree["outside"] / "in"):
        assert path_problem("train.data", str(ok), roots) is None, ok


@pytest.mark.parametrize("escape", ["outside/secret", "data/../outside/secret", "data/leak", "data2/x",
                                    "data/../data2/x", "state/../outside", "/etc/shadow", "/"])
def test_escapes_are_refused(tree, escape: str) -> None:
    value = escape if escape.startswith("/") else str(tree["state"].parent / escape)
    problem = path_problem("train.data", value, tree["roots"])
    assert problem is not None and problem.startswith(f"train.data: {value} is outside the allowed roots")


def test_the_message_names_field_value_and_roots(tree) -> None:
    assert path_problem("train.data", "/etc/shadow", tree["roots"]) == (
        f"train.data: /etc/shadow is outside the allowed roots ({tree['state']}, {tree['data']}); a worker "
        "allows only paths under its --data-root directories and its state dir")


def test_a_refusal_does_not_depend_on_whether_the_file_exists(tree) -> None:
    roots, outside = tree["roots"], tree["outside"]
    there = path_problem("f", str(outside / "secret"), roots)
    assert there.replace("secret", "X") == path_problem("f", str(outside / "nothing"), roots).replace("nothing", "X")


def test_unusable_values_are_refused_without_echoing_them_whole(tree) -> None:
    roots = tree["roots"]
    assert "NUL" in path_problem("train.data", str(tree["data"]) + "/a\x00b", roots)
    long = path_problem("train.data", str(tree["data"]) + "/" + "a" * 5000, roots)
    assert "over 4096 characters" in long and len(long) < 600
    for value, text in (("", "''"), (5, "5"), (None, "None")):
        assert path_problem("train.data", value, roots) == f"train.data: {text} is not a path"


def test_builtin_data_names_no_file_wherever_the_ranks_run(tree, tmp_path: Path) -> None:
    assert train_paths(train("builtin:pydoc"), "", "/") == []
    assert assignment_problem(train("builtin:pydoc"), tree["roots"], cwd="/") is None
    assert assignment_problem(build_spec({"name": "c", "kind": "comm-check"}), tree["roots"], cwd="/") is None


def test_relative_data_is_resolved_against_the_ranks_directory(tree, monkeypatch) -> None:
    roots = tree["roots"]
    assert assignment_problem(train("corpus.txt"), roots, cwd=str(tree["data"])) is None
    assert assignment_problem(train("../outside/secret"), roots, cwd=str(tree["data"])) == (
        path_problem("train.data", "../outside/secret", roots, path=str(tree["outside"] / "secret")))
    assert "train.data: corpus.txt is outside" in assignment_problem(train("corpus.txt"), roots, cwd="/")
    monkeypatch.chdir(tree["data"])  # the default: this process's directory, which the launcher inherits
    assert assignment_problem(train("corpus.txt"), roots) is None
    assert assignment_problem(train("leak"), roots) is not None


def test_train_node_path_is_the_file_the_rank_opens(tree, monkeypatch) -> None:
    """``load_tokens`` opens the value relative to its directory: the sandbox checks that very file."""
    from rankctl.kinds.train.data import encode, load_tokens

    monkeypatch.chdir(tree["data"])
    [(field, value, path)] = train_paths(train("corpus.txt"), "", os.getcwd())
    assert (field, value) == ("train.data", "corpus.txt") and os.path.samefile(path, "corpus.txt")
    assert list(load_tokens(value)) == list(encode("text"))


def test_python_workdir_and_script_must_lie_under_a_root(tree) -> None:
    roots, data, out = tree["roots"], str(tree["data"]), str(tree["outside"])
    assert assignment_problem(python("train.py", data), roots, cwd="/") is None
    assert assignment_problem(python("pkg.mod:main", data), roots, cwd="/") is None  # a function names no file
    assert assignment_problem(python("train.py", out), roots, cwd="/").startswith(f"python.workdir: {out} is outside")
    assert assignment_problem(python(f"{out}/x.py", data), roots, cwd="/").startswith("python.entrypoint:")
    assert assignment_problem(python("../outside/x.py", data), roots, cwd="/").startswith("python.entrypoint:")
    assert assignment_problem(python("train.py"), roots, cwd="/").startswith("python.entrypoint: train.py is outside")
    assert assignment_problem(python("~/x.py", data, env={"HOME": out}), roots, cwd="/") is not None
    assert assignment_problem(python("~/x.py", data, env={"HOME": data}), roots, cwd="/") is None


def test_a_shipped_workdir_is_the_nodes_copy_not_the_spec_path(tree) -> None:
    """``python.workdir`` of a shipped job says where ctl found it; the ranks run in the daemon's copy."""
    roots, copy = tree["roots"], str(tree["state"] / "workdirs" / ("ab" * 32))
    spec = python("train.py", "/home/someone/project", workdir_blob="sha256:" + "ab" * 32)
    assert assignment_problem(spec, roots, workdir=copy, cwd="/") is None
    assert assignment_problem(spec, roots, cwd="/").startswith("python.workdir: /home/someone/project is outside")


@pytest.mark.parametrize(("entrypoint", "workdir"), [("train.py", "wd"), ("sub/../train.py", "/ABS"),
                                                     ("train.py", None), ("/ABS/train.py", "wd")])
def test_python_node_paths_are_the_files_the_rank_runs(tree, monkeypatch, entrypoint: str, workdir) -> None:
    """The script path the rank computes after its ``chdir(workdir)`` (``run._script_path``) is the one checked,
    a relative workdir included (the rank joins it twice)."""
    base = tree["data"]
    entrypoint, workdir = entrypoint.replace("/ABS", str(base)), workdir and workdir.replace("/ABS", str(base))
    for d in (base / "wd", base / "wd" / "wd", base / "sub"):
        d.mkdir(exist_ok=True)
    for d in (base, base / "wd", base / "wd" / "wd"):
        (d / "train.py").write_text("")
    monkeypatch.chdir(base)
    checked = dict((f, p) for f, _, p in python_paths(python(entrypoint, workdir), "", os.getcwd()))
    if workdir:
        os.chdir(workdir)  # as run.run does before it looks for the script
    ran = python_run._script_path(entrypoint, workdir)
    assert os.path.realpath(checked["python.entrypoint"]) == os.path.realpath(ran)


def test_a_node_path_that_is_not_a_string_never_reaches_the_sandbox() -> None:
    """The daemon validates the spec once when it expands the Assign: a typed spec holds only strings there."""
    with pytest.raises(SpecError, match="train.data"):
        train(5)
    with pytest.raises(SpecError, match="python.workdir"):
        python("x.py", 3)


# -- paths formed from ids ------------------------------------------------------------------------

@pytest.mark.parametrize("bad", HOSTILE_NAMES)
def test_hostile_names_are_refused_by_the_name_rules(bad) -> None:
    assert job_name_problem(bad) is not None and job_id_problem(bad) is not None
    a = RankAssignment(job_id="j-000000", attempt=1, rank=0, world_size=1, local_rank=0, node="n", coords={},
                       groups={}, rendezvous="127.0.0.1:1", backend="gloo", kind="train",
                       spec=JobSpec.model_construct(name=bad))  # as if validation were bypassed
    with pytest.raises(paths.Refused, match="job name"):  # the daemon's check of every expanded assignment
        paths.check_assignment(a, "j-000000", 1)


@pytest.mark.parametrize("bad", HOSTILE_NAMES)
def test_hostile_ids_are_refused_before_any_path_is_formed(tmp_path: Path, monkeypatch, bad) -> None:
    def formed(*args: object) -> None:
        raise AssertionError(f"a path was formed from {args!r}")

    monkeypatch.setattr(paths, "inside", formed)
    monkeypatch.setattr(sandbox, "ShardStore", formed)
    ok_id = "job-abcdef"
    assert "job name" in derived_problem(str(tmp_path), ok_id, 1, bad, [0])
    assert "job id" in derived_problem(str(tmp_path), bad, 1, "job", [0])
    with pytest.raises(paths.Refused, match="job id"):
        paths.run_dir_for(tmp_path, bad, 1)


@pytest.mark.parametrize(("attempt", "ranks", "words"), [
    (-1, [0], "attempt '-1'"), (True, [0], "attempt 'True'"), ("1", [0], "attempt '1'"), (1, [-1], "rank '-1'"),
    (1, [0, "1/../x"], "rank '1/../x'"), (1, [False], "rank 'False'")])
def test_bad_attempts_and_ranks_are_refused(tmp_path: Path, attempt, ranks, words: str) -> None:
    problem = derived_problem(str(tmp_path), "job-abcdef", attempt, "job", ranks)
    assert problem == f"{words} must be a non-negative integer"


def test_good_ids_form_one_entry_per_path(tmp_path: Path) -> None:
    longest = "a" * 63
    assert derived_problem(str(tmp_path), f"{longest}-abcdef", 2, longest, range(4)) is None
    assert derived_problem(str(tmp_path / "x" / ".."), "j-000000", 0, "j", [10**6]) is None


def test_a_state_dir_link_leading_jobs_elsewhere_is_refused(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "state" / "jobs").symlink_to(tmp_path / "elsewhere")
    assert "resolves outside the state dir" in derived_problem(str(tmp_path / "state"), "j-000000", 1, "j", [0])


def checkpointing(name: str, checkpoint_dir: str):
    return build_spec({"name": name, "kind": "train", "train": {"data": "builtin:pydoc",
                                                                   "checkpoint_dir": checkpoint_dir}})


def test_a_written_path_must_be_reached_through_no_link_below_a_root(tree) -> None:
    roots = sandbox.write_roots([str(tree["data"])], str(tree["state"]))
    ck = tree["data"] / "ck"
    ck.mkdir()
    (ck / "out").symlink_to(tree["outside"])
    (tree["data"] / "inlink").symlink_to(ck)   # a link that stays inside still counts: no link at all
    assert sandbox.written_problem(checkpointing("fresh", str(ck)), roots) is None
    assert "passes through the symbolic link" in sandbox.written_problem(checkpointing("out", str(ck)), roots)
    assert "passes through the symbolic link" in sandbox.written_problem(
        checkpointing("fresh", str(tree["data"] / "inlink")), roots)
    for bad in (str(tree["data"] / ".." / "outside"), str(tree["outside"])):
        assert "is not under a root as written" in sandbox.written_problem(checkpointing("fresh", bad), roots)
