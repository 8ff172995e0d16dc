"""The pre-flight's judgement and what the coordinator keeps of it (pure; the e2e test with a delayed link
is in ``tests/e2e/test_e2e_netns_faults.py``)."""

from __future__ import annotations

import json

from rankctl.contract.preflight import line
from rankctl.contract.spec import JobSpec
from rankctl.coordinator.diagnosis.preflight import parse
from rankctl.runtime.preflight import SLOW_ABS_S, Outcome, judge, preflight_on


def test_a_node_whose_messages_are_far_slower_than_the_others_is_excluded() -> None:
    assert judge([0.0002, 0.201], {}) == {1: "its link is slow: messages from it take 201 ms one way, the other "
                                             "nodes' 0.2 ms (pre-flight, 128 KiB messages)"}
    assert judge([0.0002, 0.0003, 0.0004, 0.2], {}).keys() == {3}
    assert judge([0.2, 0.2], {}) == {}                     # both ways alike: no node can be told apart
    assert judge([0.0002, SLOW_ABS_S * 0.9], {}) == {}      # slower, but under the absolute floor
    assert judge([0.03, 0.06], {}) == {}                    # over the floor, but not 10x the others
    assert judge([0.0002], {}) == {}                        # alone: nothing to compare with
    assert judge([0.0, 0.0002, 0.3], {}).keys() == {2}      # 0: not probed, left out of the comparison
    unhealthy = judge([0.0002, 0.0002], {0: "GPU 3: 2 uncorrected ECC errors since the driver loaded"})
    assert unhealthy == {0: "its GPUs report problems: GPU 3: 2 uncorrected ECC errors since the driver loaded "
                            "(pre-flight, NVML)"}


def test_the_outcome_travels_as_bounded_json_and_reads_as_one_line() -> None:
    out = Outcome(kinds={"tp": 0.00021, "dp": 0.0004}, egress=[0.0001, 0.0002, 0.201], exclude={2: "slow"},
                  gpu="no NVIDIA driver: NVML Shared Library Not Found")
    kept = parse(out.to_json(), ["node-0", "node-1", "node-2"])
    assert kept is not None and kept.exclude == [(2, "slow")]
    assert kept.figures == {"tp": 0.21, "dp": 0.4, "link_median": 0.2, "link_max": 201.0}
    assert line(kept.figures, kept.note) == ("all-reduce tp 0.21 ms, dp 0.40 ms; links 0.20 ms one way (slowest "
                                             "201.00 ms); slowest link from node-2; GPUs: no NVIDIA driver: NVML "
                                             "Shared Library Not Found")
    assert parse("not json", ["a"]) is None and parse("[1]", ["a"]) is None
    hostile = json.dumps({"kinds_ms": {f"k{i}": i for i in range(100)}, "exclude": {"7": "x" * 5000, "-1": "y"},
                          "links": {"median_ms": "fast", "max_node": 99}})
    kept = parse(hostile, ["a", "b"])
    assert kept is not None and len(kept.figures) == 32 and kept.exclude == [] and kept.note == ""


def test_it_is_on_by_default_for_multi_node_jobs_only() -> None:
    def spec(nodes: int, preflight: object = None) -> JobSpec:
        restart = {} if preflight is None else {"preflight": preflight}
        return JobSpec.model_validate({"name": "p", "resources": {"nodes": nodes}, "restart": restart})
    assert preflight_on(spec(2)) and not preflight_on(spec(1))
    assert not preflight_on(spec(2, False)) and preflight_on(spec(1, True))


# -- the check itself, across real ranks (forked, gloo on a FileStore) ---------------------------------------

def _preflight_rank(rank: int, world: int, store_path: str, pp: int, out_dir: str) -> None:
    import os
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from rankctl.parallel.groups import ProcessGroups
    from rankctl.parallel.layout import ParallelConfig, RankLayout
    from rankctl.runtime import preflight

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    groups = RankLayout(ParallelConfig(world_size=world, pp=pp, tp=world // pp)).rank_groups(rank)
    ctx = SimpleNamespace(assignment=SimpleNamespace(rank=rank, world_size=world,
                                                     spec=SimpleNamespace(resources=SimpleNamespace(slots_per_node=1))),
                          groups=ProcessGroups.build(rank, world, groups), device=torch.device("cpu"))
    out = preflight.run(ctx)
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        f.write(out.to_json())


def test_every_rank_of_a_pipeline_gets_the_same_figures_though_their_groups_differ(tmp_path) -> None:
    """pp4 over 4 one-slot nodes: the middle stages have no embedding group, the ends have one; every rank still
    takes part in the same world collectives (no hang), finds the same figures, and excludes no node."""
    from ranks import fork_ranks

    assert fork_ranks(4, _preflight_rank, str(tmp_path / "store"), 4, str(tmp_path)) == [0] * 4
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(4)]
    assert all(o["kinds_ms"] == outs[0]["kinds_ms"] and o["exclude"] == {} for o in outs), outs
    assert set(outs[0]["kinds_ms"]) == {"pp"} and outs[0]["links"]["median_ms"] > 0, outs[0]
