"""Unit tests of kinds.comm_check.render: comm-check rows pivoted per group kind and the result's table."""

from __future__ import annotations

from typing import Any

from rankctl.kinds.comm_check.render import comm_rows, tables


def _row(kind: str, op: str, groups: int = 4, size: int = 2, mean: float = 12.4, most: float = 30.6,
         busbw: float = 1.23456) -> dict[str, Any]:
    return {"kind": kind, "op": op, "groups": groups, "size": size, "mean_us": mean, "max_us": most,
            "min_busbw_gbps": busbw}


def _rows_table(title: str, rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    return title, rows


def test_comm_rows_pivot_each_kinds_ops_into_one_row_with_readable_names_and_units() -> None:
    rows = comm_rows([_row("tp", "allreduce", mean=12.4, most=30.6, busbw=1.23456),
                      _row("tp", "allgather", mean=7.5, most=8.49, busbw=20.0),
                      _row("dp", "broadcast", groups=2, size=4, mean=100.0, most=100.0, busbw=0.5)])
    assert rows == [
        {"kind": "tp", "groups x size": "4 x 2",
         "all-reduce us (mean/max)": "12 / 31", "all-reduce busbw GB/s (min)": "1.23",
         "all-gather us (mean/max)": "8 / 8", "all-gather busbw GB/s (min)": "20"},
        {"kind": "dp", "groups x size": "2 x 4",
         "broadcast us (mean/max)": "100 / 100", "broadcast busbw GB/s (min)": "0.5"},
    ]


def test_comm_rows_take_the_groups_and_size_of_a_kinds_first_row() -> None:
    rows = comm_rows([_row("pp", "allreduce", groups=1, size=8), _row("pp", "allgather", groups=9, size=9)])
    assert rows[0]["groups x size"] == "1 x 8"


def test_comm_rows_without_an_op_name_the_columns_by_the_empty_op() -> None:
    row = _row("ep", "")
    del row["op"]
    assert set(comm_rows([row])[0]) == {"kind", "groups x size", " us (mean/max)", " busbw GB/s (min)"}


def test_comm_rows_of_no_rows_are_empty() -> None:
    assert comm_rows([]) == []


def test_tables_give_one_comm_table_titled_with_the_message_size() -> None:
    result = {"comm": [_row("tp", "allreduce")], "size_bytes": 1048576}
    [(key, (title, rows))] = tables(result, _rows_table)
    assert key == "comm" and title == "comm-check per kind (1048576 bytes per rank)"
    assert rows == comm_rows(result["comm"])


def test_tables_without_a_size_leave_it_out_of_the_title() -> None:
    [(_, (title, _))] = tables({"comm": [_row("tp", "allreduce")], "size_bytes": 0}, _rows_table)
    assert title == "comm-check per kind"


def test_tables_leave_a_comm_value_of_another_shape_to_the_generic_table() -> None:
    assert tables({}, _rows_table) == []
    assert tables({"comm": []}, _rows_table) == []
    assert tables({"comm": "text"}, _rows_table) == []
    assert tables({"comm": [1, 2]}, _rows_table) == []
    assert tables({"comm": [{"kind": "tp", "mean_us": 1.0}]}, _rows_table) == []
