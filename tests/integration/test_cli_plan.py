"""``ctl plan`` through click's CliRunner, and the no-torch start-up promise in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rankctl.cli.main import cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_flags_human_output() -> None:
    res = run("plan", "--world-size", "16", "--tp", "2", "--pp", "4", "--gpus-per-node", "4")
    assert res.exit_code == 0, res.output
    assert "node 3 (ranks 12-15)" in res.output
    assert "dense:  tp=2 cp=1 dp=2 pp=4" in res.output
    tp_line = next(line for line in res.output.splitlines() if line.split()[:1] == ["tp"])
    assert tp_line.split() == ["tp", "8", "2", "0"]  # 8 groups of 2, none cross a node
    pp_line = next(line for line in res.output.splitlines() if line.split()[:1] == ["pp"])
    assert pp_line.split() == ["pp", "4", "4", "4"]
    assert "communicator" in res.output


def test_warns_when_tp_crosses_nodes() -> None:
    res = run("plan", "--world-size", "8", "--tp", "4", "--gpus-per-node", "2")
    assert res.exit_code == 0
    assert "warning: 4 of 2 tp" not in res.output
    assert "warning: 2 of 2 tp groups cross a node boundary" in res.output


def test_one_rank_and_json() -> None:
    res = run("plan", "--world-size", "16", "--tp", "2", "--pp", "4", "--rank", "5", "--json")
    doc = json.loads(res.output)
    assert doc["groups"]["pp"] == [1, 5, 9, 13] and doc["coords"]["pp"] == 1 and doc["node"] == 0
    res = run("plan", "--world-size", "16", "--tp", "2", "--pp", "4", "--json", "--gpus-per-node", "4")
    doc = json.loads(res.output)
    assert doc["groups"]["dp"][:3] == [[0, 2], [1, 3], [4, 6]]
    assert doc["config"]["dp"] == 2 and doc["node_of_rank"][12] == 3


def test_job_file_with_overrides() -> None:
    res = run("plan", str(EXAMPLES / "comm-check.yaml"), "--set", "parallel.tp=4", "--set", "parallel.pp=1")
    assert res.exit_code == 0, res.output
    assert "dense:  tp=4 cp=1 dp=2 pp=1" in res.output


@pytest.mark.parametrize(
    "args, words",
    [
        (["--world-size", "12", "--tp", "5"], ["world_size=12", "tp*pp*cp=5"]),
        (["--world-size", "8", "--tp", "2", "--vpp", "2"], ["vpp=2"]),
        (["--world-size", "8", "--order", "tp-xx-dp-pp"], ["unknown token 'xx'"]),
        (["--world-size", "8", "--rank", "8"], ["rank=8", "outside"]),
        ([], ["--world-size"]),
    ],
)
def test_flag_errors_exit_2(args: list[str], words: list[str]) -> None:
    res = run("plan", *args)
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.output


@pytest.mark.parametrize(
    "sets, words",
    [
        (["model.heads=3", "parallel.tp=2"], ["model.heads=3", "parallel.tp=2"]),
        (["model.layers=3", "parallel.pp=2"], ["model.layers=3", "pp*vpp=2"]),
        (["parallel.cp=2", "parallel.pp=1", "model.seq_len=126"], ["model.seq_len=126", "2*parallel.cp=4"]),
        (["parallel.ep=2", "model.moe={experts: 3, top_k: 1}"], ["model.moe.experts=3", "parallel.ep=2",
                                                                 "the same number of whole experts"]),
        (["model.vocab=100"], ["model.vocab=100", "read as bytes", "at least 256 tokens"]),   # failed at run time
        (["train.global_batch=10", "train.micro_batch=4"], ["train.global_batch=10", "micro_batch*dp=8"]),
        (["parallel.tp=three"], ["parallel.tp", "'three'", "must be an integer"]),
        (["model.colour=red"], ["model.colour", "unknown field"]),
        (["parallel.order=tp-pp"], ["omits dp"]),
    ],
)
def test_job_file_errors_exit_2(sets: list[str], words: list[str]) -> None:
    args = ["plan", str(EXAMPLES / "gpt-3d.yaml")]
    for s in sets:
        args += ["--set", s]
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.output, (w, res.output)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nparallel: {tp: 2\n")
    res = run("plan", str(bad))
    assert res.exit_code == 2 and "not valid YAML" in res.output
    res = run("plan", str(tmp_path / "nope.yaml"))
    assert res.exit_code == 2 and "cannot read" in res.output


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["plan", "--world-size", "65536", "--tp", "8", "--cp", "2", "--pp", "8", "--ep", "8"]],
)
def test_cli_never_imports_torch(argv: list[str]) -> None:
    code = (
        "import sys\nfrom rankctl.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'grpc' not in sys.modules, 'grpc imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_plan_and_submit_read_a_job_file_through_one_function_with_the_kinds_overrides(tmp_path, monkeypatch) -> None:
    """ctl plan read the file without the kind's overrides that submit applies; both now call read_job_file,
    which validates once and applies the kind's overrides to the typed spec."""
    from rankctl.cli.jobread import read_job_file

    (tmp_path / "job.yaml").write_text("name: rel\nkind: train\ntrain: {data: corpus.txt, steps: 2}\n")
    monkeypatch.chdir(tmp_path)
    read = read_job_file(str(tmp_path / "job.yaml"), ("train.steps=3",))
    assert read.spec.train.data == str(tmp_path / "corpus.txt") and read.spec.train.steps == 3
    assert read.sets == ["train.steps=3", f'train.data="{tmp_path / "corpus.txt"}"']
    assert read.layout.world_size == 1
    out = run("plan", str(tmp_path / "job.yaml"), "--json")
    assert out.exit_code == 0, out.output


def test_an_elastic_job_shows_every_world_size_it_may_run_at(tmp_path: Path) -> None:
    job = tmp_path / "el.yaml"
    job.write_text("name: el\nkind: train\nresources: {nodes: 4, slots_per_node: 2, min_nodes: 2}\nparallel: {tp: 2}\n"
                   "model: {layers: 2, hidden: 32, heads: 4, seq_len: 16, vocab: 256}\n"
                   "train: {steps: 10, global_batch: 24, micro_batch: 2, checkpoint_dir: /shared/ck}\n")
    res = run("plan", str(job))
    assert res.exit_code == 0, res.output
    assert ("elastic (resources.min_nodes=2): the job may run at\n"
            "  4 node(s): world_size=8 dp=4, 3 micro-batch(es) per rank a step\n"
            "  3 node(s): world_size=6 dp=3, 4 micro-batch(es) per rank a step\n"
            "  2 node(s): world_size=4 dp=2, 6 micro-batch(es) per rank a step") in res.output
    doc = json.loads(run("plan", str(job), "--json").output)
    assert [(r["nodes"], r["micro_batches_per_rank"]) for r in doc["elastic"]] == [(4, 3), (3, 4), (2, 6)]
    res = run("plan", str(job), "--set", "train.global_batch=16")   # 16 / (2 * 3): dp3 cannot take it
    assert res.exit_code == 2
    assert "resources.min_nodes=2: on 3 node(s) (6 ranks) the job cannot run: train.global_batch=16 is not " \
           "divisible by train.micro_batch*dp=6" in res.output


def test_a_misspelt_field_names_the_one_meant(tmp_path: Path) -> None:
    """``paralel:`` and ``parallel.tpp`` said only "unknown field": now the closest field at that place is named."""
    job = tmp_path / "typo.yaml"
    job.write_text((EXAMPLES / "gpt-3d.yaml").read_text() + "paralel: {tp: 2}\n")
    res = run("plan", str(job), "--set", "parallel.tpp=2", "--set", "model.colour=red")
    assert res.exit_code == 2, res.output
    assert "paralel (got {'tp': 2}): unknown field (did you mean parallel?)" in res.output, res.output
    assert "parallel.tpp (got 2): unknown field (did you mean tp?)" in res.output, res.output
    assert "model.colour (got 'red'): unknown field\n" in res.output + "\n", res.output   # nothing close: no guess


@pytest.mark.parametrize("argv, meant", [(["stauts"], "status"), (["slurm", "sbumit"], "submit"),
                                         (["checkpoint", "exprot"], "export")])
def test_a_misspelt_command_names_the_one_meant(argv: list[str], meant: str) -> None:
    res = CliRunner().invoke(cli, argv)
    assert res.exit_code == 2 and f"No such command '{argv[-1]}'. (did you mean {meant}?)" in res.output, res.output


def test_layout_flags_apply_to_a_job_file_and_world_size_is_refused() -> None:
    """``ctl plan FILE --tp 4`` exited 0 showing the file's tp=2: the flags now apply as ``--set parallel.X=V``."""
    example = str(EXAMPLES / "gpt-tp-dp.yaml")
    flagged, set_ = run("plan", example, "--tp", "1", "--order", "tp-cp-ep-pp-dp"), \
        run("plan", example, "--set", "parallel.tp=1", "--set", "parallel.order=tp-cp-ep-pp-dp")
    assert flagged.exit_code == 0 and "tp=1 cp=1 dp=4" in flagged.output and "order=tp-cp-ep-pp-dp" in flagged.output
    assert flagged.output == set_.output
    bad = run("plan", example, "--tp", "3")
    assert bad.exit_code == 2 and "parallel" in bad.output and "tp" in bad.output, bad.output
    world = run("plan", example, "--world-size", "8")
    assert world.exit_code == 2 and "--world-size=8 cannot apply to a job file" in world.output, world.output


def test_plan_states_the_restart_default_and_the_numerical_bound() -> None:
    example = str(EXAMPLES / "gpt-tp-dp.yaml")
    unset, given = run("plan", example), run("plan", example, "--set", "restart.max_restarts=3")
    assert "restarts: max_restarts 0 (the default, unset in the file;\n  an allocation with spares raises an unset " \
        "max_restarts to the number of spares)" in unset.output, unset.output
    assert "restarts: max_restarts 3 (from the file)" in given.output, given.output
    assert "numerics: in fp32 on CPU, per-step losses equal the serial run's within 1e-5 relative for the first" \
        in unset.output and "drift apart by up to ~1e-2" in unset.output
    assert "numerics:" not in run("plan", str(EXAMPLES / "comm-check.yaml")).output


def test_plan_speaks_of_slots_not_gpus_on_a_machine_with_none() -> None:
    """Issue 53, item 15: ``ctl plan`` said "x 2 gpus" whatever the machine; a slot holds one rank, GPU or CPU."""
    from click.testing import CliRunner

    from rankctl.cli.main import cli

    out = CliRunner().invoke(cli, ["plan", "--world-size", "4", "--tp", "2", "--gpus-per-node", "2"])
    assert out.exit_code == 0, out.output
    assert "on 2 node(s) x 2 slots" in out.output and "gpus" not in out.output.split("\n")[0], out.output
