"""A path ``ctl`` makes absolute goes into the spec as it is (pure, no processes): nothing in a directory's name
(`` #``, ``: ``, a trailing ``:``, quotes, unicode) is read as YAML, so the directory shipped is the one named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rankctl.cli.jobread import read_job_file

ODD = ["wd #2", "wd: x", "wd:", "&anchor", "'quoted'", '"dq"', "ünï 😀", "a\\b", "[list]", "{map}"]


@pytest.mark.parametrize("name", ODD)
def test_a_python_workdir_and_the_job_files_own_directory_are_taken_literally(tmp_path: Path, name: str) -> None:
    (tmp_path / name).mkdir()
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "w", "kind": "python", "python": {"entrypoint": "train.py",
                                                                             "workdir": name}}))
    assert read_job_file(str(job), []).spec.python.workdir == str(tmp_path / name)
    (tmp_path / name / "own.yaml").write_text("name: w\nkind: python\npython: {entrypoint: train.py}\n")
    assert read_job_file(str(tmp_path / name / "own.yaml"), []).spec.python.workdir == str(tmp_path / name)


@pytest.mark.parametrize("name", ODD[:4])
def test_train_paths_relative_to_where_ctl_runs_are_taken_literally(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    name: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{name}.txt").write_text("some text " * 100)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "kind": "train", "train": {"data": f"{name}.txt",
                                                                           "checkpoint_dir": f"{name}-ck"}}))
    spec = read_job_file(str(job), []).spec
    assert spec.train.data == str(tmp_path / f"{name}.txt")
    assert spec.train.checkpoint_dir == str(tmp_path / f"{name}-ck")


@pytest.mark.parametrize("train, words", [
    ({"data": ""}, "train.data is empty"),
    ({"checkpoint_dir": "/tmp/a\x00b"}, "train.checkpoint_dir='/tmp/a\\x00b': a path cannot hold a NUL character"),
    ({"checkpoint_dir": "ck\x00"}, "train.checkpoint_dir='ck\\x00': a path cannot hold a NUL character"),
    ({"init_from": "x\x00"}, "train.init_from='x\\x00': a path cannot hold a NUL character"),
])
def test_an_empty_data_path_or_a_nul_in_a_train_path_is_refused_by_ctl(tmp_path: Path, train: dict,
                                                                       words: str) -> None:
    from rankctl.cli.errors import CtlError

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "kind": "train", "train": train}))
    with pytest.raises(CtlError) as err:
        read_job_file(str(job), [])
    assert words in str(err.value)
