"""Hostile or mistyped job files are quick user errors, never work proportional to what they expand to.

Pure: no processes (tests/e2e/test_e2e_hostile.py shows the same through a real coordinator and ctl).
No clock: each test counts the work its input caused (YAML events walked, documents built, values quoted,
layouts and rank arrays made, see ``counting``) and asserts it against the documented limits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from unittest import mock

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from rankctl.cli.main import cli
from rankctl.contract import jobfile, names
from rankctl.contract import limits as L
from rankctl.contract import spec as spec_module
from rankctl.coordinator.scheduling.planner import plan_layout
from rankctl.contract.jobfile import SpecError, load_yaml_text, read_job_text
from rankctl.kinds.spec import build_spec
from rankctl.parallel import layout, placement
from rankctl.parallel.layout import GROUP_NAMES, LayoutError, ParallelConfig


@dataclass
class Work:
    """What validating one input did, counted at the functions that do the work."""

    events: int = 0        # YAML events the bounded reader walked (``jobfile._Shape.feed``)
    documents: int = 0     # YAML documents built into Python values (``construct_document``)
    quoted: int = 0        # values quoted back in an error (``jobfile.brief``)
    matched: int = 0       # unknown fields matched against the known ones (``jobfile.did_you_mean``)
    repr_steps: int = 0    # values the bounded repr visited (``names._REPR.repr1``)
    configs: int = 0       # ParallelConfigs constructed
    arrays: list[int] = field(default_factory=list)  # the size of every rank array built (``_Grid.groups``)
    rank_lists: int = 0    # groups turned into per-rank Python lists (``RankLayout.groups``)
    per_rank: int = 0      # ``node_of_rank`` asked about one rank (a Python loop over ranks), not an array


@contextlib.contextmanager
def counting() -> Iterator[Work]:
    """Count, while inside, the work of reading, validating and laying out a job (each function still runs)."""
    work = Work()

    def count(owner: object, name: str, note) -> contextlib.AbstractContextManager:  # noqa: ANN001 - note(args, result)
        original = getattr(owner, name)

        def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                note(args, result)
        return mock.patch.object(owner, name, counted)

    def add(attr: str):  # noqa: ANN202
        return lambda args, result: setattr(work, attr, getattr(work, attr) + 1)

    with contextlib.ExitStack() as stack:
        for owner, name, note in [
            (jobfile._Shape, "feed", add("events")),
            (jobfile._StrictLoader, "construct_document", add("documents")),
            (jobfile, "brief", add("quoted")),
            (jobfile, "did_you_mean", add("matched")),
            (names._REPR, "repr1", add("repr_steps")),
            (ParallelConfig, "__post_init__", add("configs")),
            (layout._Grid, "groups", lambda args, result: work.arrays.append(-1 if result is None else result.size)),
            (layout.RankLayout, "groups", add("rank_lists")),
            (placement, "node_of_rank",
             lambda args, result: setattr(work, "per_rank", work.per_rank + (not isinstance(args[0], np.ndarray)))),
        ]:
            stack.enter_context(count(owner, name, note))
        yield work


def alias_bomb(levels: int = 9) -> str:
    """The classic billion laughs: 9 levels of 9 aliases, 9**9 strings once expanded, ~450 bytes."""
    lines = ["name: bomb", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def nested_bomb(levels: int = 9, leaf: object = "lol") -> list:
    """The same blow-up built in Python: 9 shared references per level."""
    value: list = [leaf] * 9
    for _ in range(levels):
        value = [value] * 9
    return value


def refused(text: str, *words: str) -> tuple[str, Work]:
    """The refusal of ``text`` as a job file, which names ``words``, and the work it took: the text built once at
    most (never again per problem), nothing built when the YAML itself is refused, and no more values quoted or
    matched than the problems an answer shows."""
    with counting() as work, pytest.raises(SpecError) as err:
        build_spec(load_yaml_text(text, "job.yaml"))
    print(f"refused ({work}): {err.value}")
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert len(message) < 3000, message  # 20 problems at most, each value by a short prefix
    assert work.documents <= 1, work
    if "refused YAML" in message:   # from its events alone: no value exists yet
        assert work.documents == 0, work
    assert work.quoted <= L.MAX_ERRORS_SHOWN and work.matched <= L.MAX_ERRORS_SHOWN, work
    assert work.configs == 0 and work.arrays == [], work   # a job file's schema lays nothing out
    return message, work


def errors_of(doc: dict) -> str:
    with pytest.raises(SpecError) as err:
        build_spec(doc)
    return str(err.value)


# -- item 8: alias bombs, huge files, huge echoes -----------------------------

def test_alias_bomb_is_refused_without_expanding_it() -> None:
    text = alias_bomb()
    assert len(text) < 1024
    _, work = refused(text, "job.yaml", "more than 10000 values")
    # nothing built, and the walk stopped part-way through the text's own events: no alias was walked into
    assert work.documents == 0 and 0 < work.events < len(list(yaml.parse(text))), work


def test_more_aliases_than_the_limit_are_refused_even_when_small() -> None:
    text = "name: x\nk: &a 1\n" + "".join(f"r{i}: *a\n" for i in range(L.MAX_YAML_ALIASES + 1))
    _, work = refused(text, f"more than {L.MAX_YAML_ALIASES} aliases")
    assert work.documents == 0 and work.events == len(list(yaml.parse(text))) - 3, work  # at the 101st alias


def test_a_few_aliases_still_work() -> None:
    text = "name: x\nkind: comm-check\nresources: {nodes: &n 2, slots_per_node: *n}\n"
    assert build_spec(load_yaml_text(text)).world_size == 4


class Leaf:
    """A leaf of a value built from shared references that counts each time it is rendered; rendering more of
    them than an echo could show raises at once (instead of walking 9**10 of them)."""

    rendered = 0

    def __repr__(self) -> str:
        Leaf.rendered += 1
        if Leaf.rendered > 1000:
            raise WalkedWhole(f"{Leaf.rendered} leaves of a shared-reference value rendered")
        return "'lol'"


class WalkedWhole(Exception):
    """A value that should be echoed by a prefix was walked (not a ValueError: pydantic would take it in)."""


def test_a_value_built_from_shared_references_is_echoed_by_a_short_prefix() -> None:
    Leaf.rendered = 0
    leaf = Leaf()
    with counting() as work:
        message = errors_of({"name": "x", "junk": nested_bomb(leaf=leaf), "train": {"lr": nested_bomb(leaf=leaf)}})
    print(f"{work}: {message}")
    assert "junk (got [[[[" in message and "train.lr" in message and len(message) < 600
    # two values quoted, each by a bounded repr: at most maxlist items a level, maxlevel levels deep (85 steps),
    # which never reaches the leaves 10 levels down
    assert work.quoted == 2, work
    per_value = sum(names._REPR.maxlist ** level for level in range(names._REPR.maxlevel + 1))
    assert 0 < work.repr_steps <= 2 * per_value and Leaf.rendered == 0, (work, Leaf.rendered)


def test_a_long_bad_value_is_quoted_by_a_prefix_with_its_length() -> None:
    message, _ = refused("name: " + "a" * 100_000 + "\n", "name (got 'aaaa", "(100000 characters)")
    assert "a" * 100 not in message


def test_job_file_size_is_capped_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("name: x\n" + "#" * (L.MAX_JOB_FILE_BYTES + 10) + "\n")
    size = big.stat().st_size
    with pytest.raises(SpecError, match=f"job file is {size} bytes; the limit is 262144"):
        read_job_text(big)


def test_spec_yaml_sent_to_the_coordinator_is_capped_too() -> None:
    with pytest.raises(SpecError, match="the limit is 262144"):
        load_yaml_text("name: x\n" + "#" * L.MAX_JOB_FILE_BYTES, "job file")


def test_an_endless_file_is_read_no_further_than_the_cap() -> None:
    with pytest.raises(SpecError, match="more than 262144 bytes; the limit is 262144"):
        read_job_text("/dev/zero")


def test_overrides_are_bounded_like_the_file() -> None:
    levels = [f"&a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb_flow = "[" + ",".join(["&a0 [1,1,1,1,1,1,1,1,1]", *levels]) + "]"
    with pytest.raises(SpecError, match="more than 10000 values"):
        build_spec({"name": "x"}, [f"junk={bomb_flow}"])
    with pytest.raises(SpecError, match="nested deeper than the limit of 32"):
        build_spec({"name": "x"}, [".".join(["a"] * 40) + "=1"])
    assert build_spec({"name": "x"}, ["train.data=[not yaml"]).train.data == "[not yaml"  # taken as a string


# -- item 9: sizes that allocate the world -----------------------------------

@pytest.mark.parametrize("resources, field", [
    ({"nodes": 1, "slots_per_node": 150_000_000}, "resources.slots_per_node"),
    ({"nodes": 1_000_000_000, "slots_per_node": 1}, "resources.nodes"),
    ({"nodes": 1025, "slots_per_node": 1024}, "maximum world size of 1048576"),
])
def test_world_sizes_above_the_maximum_are_refused_before_any_layout(resources: dict, field: str) -> None:
    with counting() as work:
        message = errors_of({"name": "big", "kind": "comm-check", "resources": resources})
    print(f"{work}: {message}")
    assert field in message
    assert work.configs == 0 and work.arrays == [] and work.per_rank == 0, work   # nothing laid out


def test_the_largest_world_is_accepted_and_planned_in_bounded_size() -> None:
    from rankctl.kinds.spec import check_job

    spec = build_spec({"name": "big", "kind": "comm-check", "resources": {"nodes": 1024, "slots_per_node": 1024},
                       "parallel": {"tp": 8, "pp": 8}})
    with counting() as work:
        doc = plan_layout(check_job(spec), 1024)
    print(f"plan of {spec.world_size} ranks: {work}")
    assert "groups" not in doc and "node_of_rank" not in doc and "omitted" in doc
    # bounded by the world, per group name: one rank array of the world's size at most per name (pp's is shared
    # by embd and pos_embd), no group turned into Python lists, no Python loop over ranks
    assert 0 < len(work.arrays) <= len(GROUP_NAMES) and set(work.arrays) == {spec.world_size}, work.arrays
    assert work.rank_lists == 0 and work.per_rank == 0, work
    assert doc["kinds"]["tp"] == {"groups": 131072, "size": 8, "cross_node": 0}


@pytest.mark.parametrize("section, field, value", [
    ("parallel", "tp", L.MAX_PARALLEL_SIZE + 1), ("parallel", "vpp", L.MAX_VPP + 1),
    ("model", "layers", L.MAX_LAYERS + 1), ("model", "hidden", L.MAX_HIDDEN + 1),
    ("model", "heads", L.MAX_HEADS + 1), ("model", "ffn_hidden", L.MAX_FFN_HIDDEN + 1),
    ("model", "seq_len", L.MAX_SEQ_LEN + 1), ("model", "vocab", L.MAX_VOCAB + 1),
    ("train", "steps", L.MAX_STEPS + 1), ("train", "global_batch", L.MAX_BATCH + 1),
    ("train", "micro_batch", L.MAX_BATCH + 1), ("train", "eval_every", L.MAX_STEPS + 1),
    ("train", "checkpoint_every", L.MAX_STEPS + 1), ("train", "seed", 1 << 64),
    ("comm_check", "size_bytes", L.MAX_COMM_BYTES + 1), ("comm_check", "iters", L.MAX_COMM_ITERS + 1),
    ("restart", "max_restarts", L.MAX_RESTARTS + 1),
])
def test_every_count_has_a_documented_maximum(section: str, field: str, value: int) -> None:
    message = errors_of({"name": "x", section: {field: value}})
    assert f"{section}.{field} (got {value})" in message and "must be at most" in message


def test_moe_counts_have_maxima() -> None:
    message = errors_of({"name": "x", "model": {"moe": {"experts": L.MAX_EXPERTS + 1}}})
    assert "model.moe.experts" in message


def test_parallel_config_refuses_a_huge_world_before_allocating() -> None:
    with counting() as work, pytest.raises(LayoutError, match="world_size=4294967296 exceeds the maximum of 1048576 "
                                                              "ranks"):
        ParallelConfig(world_size=4_294_967_296)
    assert work.configs == 1 and work.arrays == [] and work.rank_lists == 0, work   # no rank array allocated


def test_ctl_plan_refuses_a_huge_world_with_exit_2() -> None:
    res = CliRunner().invoke(cli, ["plan", "--world-size", "4294967296"])
    assert res.exit_code == 2 and "exceeds the maximum of 1048576 ranks" in res.output, res.output
    res = CliRunner().invoke(cli, ["plan", "--world-size", "8", "--gpus-per-node", "100000000"])
    assert res.exit_code == 2 and "--gpus-per-node" in res.output


def test_plan_document_lists_ranks_only_for_small_worlds() -> None:
    small = plan_layout(ParallelConfig(world_size=L.PLAN_MAX_RANKS_LISTED, tp=8), 8)
    assert len(small["node_of_rank"]) == L.PLAN_MAX_RANKS_LISTED and small["groups"]["tp"][0] == list(range(8))
    large = plan_layout(ParallelConfig(world_size=2 * L.PLAN_MAX_RANKS_LISTED, tp=8), 8)
    assert "groups" not in large and "node_of_rank" not in large and "omitted" in large["note"]
    assert large["kinds"]["tp"]["groups"] == 2 * small["kinds"]["tp"]["groups"]


# -- item 10: bad bytes, deep nesting, names, non-finite numbers -------------

def test_non_utf8_file_names_the_byte_offset(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: x\n\xff\xfe junk\n")
    with pytest.raises(SpecError, match=r"bad.yaml: not UTF-8 text: byte 0xff at byte offset 8 \(line 2\)"):
        read_job_text(bad)


def test_deep_nesting_names_the_depth_limit() -> None:
    # refused at the first collection past the limit: the walk is as long as the limit, not as the nesting
    flow = "name: deep\nx: " + "[" * 10_000 + "]" * 10_000 + "\n"
    _, work = refused(flow, "nested deeper than the limit of 32 levels")
    assert work.documents == 0 and work.events <= 6 + L.MAX_YAML_DEPTH, work   # 6 up to "x:", then one a level
    _, work = refused("".join(" " * i + "a:\n" for i in range(40)) + " " * 40 + "b: 1\n", "the limit of 32 levels")
    assert work.documents == 0 and work.events <= 2 + 2 * (L.MAX_YAML_DEPTH + 1), work   # a key and a mapping a level


def test_an_integer_too_long_to_parse_is_a_yaml_error() -> None:
    refused("name: x\ntrain: {seed: " + "9" * 5000 + "}\n", "not valid YAML")


@pytest.mark.parametrize("name", ["abc\n", "abc\n\n", "-abc", "a" * 64, "ABC", "a/b", ""])
def test_job_names_are_matched_whole(name: str) -> None:
    assert "name (got" in errors_of({"name": name})


def test_name_rules_have_one_home() -> None:
    assert not hasattr(spec_module, "NAME_RE")


@pytest.mark.parametrize("text, field", [
    ("train: {lr: .inf}", "train.lr"), ("train: {lr: .nan}", "train.lr"),
    ("train: {grad_clip: .inf}", "train.grad_clip"), ("comm_check: {duration: .nan}", "comm_check.duration"),
    ("model: {moe: {experts: 2, aux_loss: .inf}}", "model.moe.aux_loss"),
    ("restart: {collective_timeout: .inf}", "restart.collective_timeout"),
])
def test_non_finite_numbers_are_refused_naming_the_field(text: str, field: str) -> None:
    refused(f"name: x\n{text}\n", f"{field} (got", "must be a finite number")


def test_a_number_written_as_a_string_is_refused_naming_the_field() -> None:
    refused("name: x\ntrain: {lr: 'inf'}\n", "train.lr (got 'inf')", "must be a number")


# -- restart.collective_timeout -----------------------------------------------

def test_collective_timeout_defaults_to_300_seconds_and_is_bounded() -> None:
    assert build_spec({"name": "x"}).to_dict()["restart"]["collective_timeout"] == 300.0
    assert build_spec({"name": "x", "restart": {"collective_timeout": 30}}).restart.collective_timeout == 30.0
    for bad in (0, -1.0, 86_400.5):
        assert "restart.collective_timeout" in errors_of({"name": "x", "restart": {"collective_timeout": bad}})


def test_a_file_of_many_problems_lists_the_first_few() -> None:
    text = "name: x\n" + "".join(f"k{i}: {'x' * 40}\n" for i in range(4000))
    message, work = refused(text, "unknown field", "... and 3980 more problems")
    assert message.count("unknown field") == L.MAX_ERRORS_SHOWN
    # the 3980 others are counted only: neither quoted nor matched against the known fields
    assert work.quoted == work.matched == L.MAX_ERRORS_SHOWN and work.documents == 1, work


@pytest.mark.parametrize("doc", [{"name": "k", "kind": "a" * 200_000},
                                 {"name": "k", "kind": "comm-check", "parallel": {"order": "x" * 200_000}}])
def test_a_long_kind_or_order_is_quoted_by_a_prefix_only(doc: dict) -> None:
    with pytest.raises(SpecError) as err:
        from rankctl.kinds.spec import check_job

        check_job(build_spec(doc))
    assert "(200000 characters)" in str(err.value) and len(str(err.value)) < 600


@pytest.mark.parametrize("text, section, owner", [
    ("kind: comm-check\ntrain: {steps: 5}\n", "train", "train"),
    ("kind: comm-check\npython: {entrypoint: t.py}\n", "python", "python"),
    ("kind: python\npython: {entrypoint: t.py}\ncomm_check: {iters: 2}\n", "comm_check", "comm-check"),
])
def test_a_section_of_another_kind_is_refused_not_stored(text: str, section: str, owner: str) -> None:
    refused(f"name: x\n{text}", f"{section}: a section of kind {owner}, not of kind")
