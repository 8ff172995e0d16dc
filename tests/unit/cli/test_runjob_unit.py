"""``ctl run``'s job file from torchrun's flags (``cli/runjob.py``): pure, no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rankctl.cli.errors import CtlError
from rankctl.cli.jobread import read_job_doc
from rankctl.cli.runjob import RunArgs, job_document, job_name, job_yaml, local_ranks, node_range, procs_per_node


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "other.py").write_text("")
    return tmp_path


def test_nnodes_takes_n_and_min_max() -> None:
    assert node_range("3") == (3, 3)
    assert node_range("1:4") == (1, 4)
    for bad in ("0", "4:2", "x", "1:", ":2", "-1", "٣"):
        with pytest.raises(CtlError, match="--nnodes"):
            node_range(bad)


def test_nproc_per_node_counts_this_machine_for_auto_gpu_cpu() -> None:
    assert procs_per_node("4") == (4, "")
    assert procs_per_node("auto", gpus=0, cpus=6)[0] == 6
    assert procs_per_node("auto", gpus=8, cpus=96)[0] == 8
    assert procs_per_node("cpu", gpus=8, cpus=96)[0] == 96
    n, how = procs_per_node("gpu", gpus=2, cpus=96)
    assert n == 2 and "2 (this machine's GPUs)" in how
    for bad in ("0", "many", "gpu"):
        with pytest.raises(CtlError, match="--nproc-per-node"):
            procs_per_node(bad, gpus=0, cpus=4)


def test_local_ranks_filter() -> None:
    assert local_ranks("") is None
    assert local_ranks("0,3") == {0, 3}
    with pytest.raises(CtlError, match="--local-ranks-filter 'a'"):
        local_ranks("a")


def test_the_name_is_the_rdzv_id_or_the_targets() -> None:
    assert job_name(RunArgs(target="My_Train.py")) == "my-train"
    assert job_name(RunArgs(target="accelerate.scripts.test_script", module=True)) == "test-script"
    assert job_name(RunArgs(target="x.py", rdzv_id="exp-7")) == "exp-7"
    with pytest.raises(CtlError, match="--rdzv-id 'Exp 7' is the job's name"):
        job_name(RunArgs(target="x.py", rdzv_id="Exp 7"))


def test_the_job_file_maps_torchrun_flags_and_checks_as_ctl_submit_does(project: Path) -> None:
    args = RunArgs(nnodes="1:2", max_restarts=3, target="train.py", args=("--lr", "3e-4", "yes", "--coordinator"),
                   workdir=project)
    doc = job_document(args, slots=4)
    assert doc == {"name": "train", "kind": "python",
                   "resources": {"nodes": 2, "slots_per_node": 4, "min_nodes": 1},
                   "restart": {"max_restarts": 3},
                   "python": {"entrypoint": "train.py", "args": ["--lr", "3e-4", "yes", "--coordinator"],
                              "workdir": str(project)}}
    text = job_yaml(doc, "--nnodes=1:2 train.py --lr 3e-4\nyes")
    assert text.splitlines()[0] == "# ctl run --nnodes=1:2 train.py --lr 3e-4 yes"
    assert yaml.safe_load(text) == doc   # 3e-4 and yes stay strings
    read = read_job_doc(text, "ctl run", project, ())
    assert read.spec.python.args == ["--lr", "3e-4", "yes", "--coordinator"]
    assert read.spec.resources.min_nodes == 1 and read.spec.restart.max_restarts == 3
    assert read.layout.world_size == 8


def test_a_script_in_a_subdirectory_and_a_module(project: Path) -> None:
    assert job_document(RunArgs(target="sub/other.py", workdir=project), 1)["python"]["entrypoint"] == "sub/other.py"
    doc = job_document(RunArgs(target="pkg.main", module=True, workdir=project), 1)
    assert doc["python"]["module"] == "pkg.main" and "entrypoint" not in doc["python"]
    assert read_job_doc(job_yaml(doc, "-m pkg.main"), "ctl run", project, ()).spec.python.module == "pkg.main"


@pytest.mark.parametrize("args, message", [
    (dict(target="missing.py"), "script 'missing.py' not found"),
    (dict(target="../outside.py"), "is outside the working directory"),
    (dict(target="train.py", no_python=True), "--no-python: rankctl runs Python"),
])
def test_refused_before_anything_is_sent(project: Path, args: dict, message: str) -> None:
    (project.parent / "outside.py").write_text("")
    with pytest.raises(CtlError, match=message):
        job_document(RunArgs(workdir=project, **args), 1)


def test_a_bad_module_name_is_named(project: Path) -> None:
    doc = job_document(RunArgs(target="not a module", module=True, workdir=project), 1)
    with pytest.raises(CtlError, match="python.module 'not a module' is not a dotted module name"):
        read_job_doc(job_yaml(doc, ""), "ctl run", project, ())
    both = job_yaml({**doc, "python": {**doc["python"], "module": "a.b", "entrypoint": "train.py"}}, "")
    with pytest.raises(CtlError, match="give one of them, not both"):
        read_job_doc(both, "ctl run", project, ())
