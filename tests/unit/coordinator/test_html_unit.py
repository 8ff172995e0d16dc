"""Unit tests of coordinator.web.html: escaping, job links, ages, numbers, state badges, tables and the page shell."""

from __future__ import annotations

import pytest

from rankctl.coordinator.web.html import NAV, age, e, job_href, number, page, state_badge, table


def test_e_escapes_markup_and_both_quotes_and_shows_none_as_nothing() -> None:
    assert e('<a href="x">O\'Neil & co</a>') == "&lt;a href=&quot;x&quot;&gt;O&#x27;Neil &amp; co&lt;/a&gt;"
    assert e(None) == ""
    assert e(0) == "0" and e(False) == "False"


def test_job_href_quotes_the_whole_id_as_one_path_segment() -> None:
    assert job_href("train-00a1b2") == "/jobs/train-00a1b2"
    assert job_href("a/b c?d", "/logs") == "/jobs/a%2Fb%20c%3Fd/logs"


@pytest.mark.parametrize(("seconds", "text"), [
    (-5.0, "0 s"), (0.0, "0 s"), (3.2, "3 s"), (89.0, "89 s"), (90.0, "2 min"), (240.0, "4 min"),
    (5399.0, "90 min"), (5400.0, "1.5 h"), (9000.0, "2.5 h"), (2 * 86400.0 - 1, "48.0 h"), (2 * 86400.0, "2.0 d"),
    (3.1 * 86400, "3.1 d")])
def test_age_reads_in_seconds_minutes_hours_or_days(seconds: float, text: str) -> None:
    assert age(seconds) == text


@pytest.mark.parametrize(("value", "unit", "text"), [
    (1234567, "", "1,234,567"), (1000, " B", "1,000 B"), (-2500.4, "", "-2,500"), (999.5, "", "999.5"),
    (3.14159265, " s", "3.142 s"), (0, "", "0"), (0.000123456, "", "0.0001235")])
def test_number_groups_thousands_and_keeps_four_digits_below(value: float, unit: str, text: str) -> None:
    assert number(value, unit) == text


@pytest.mark.parametrize("value", [None, "12", True, [1]])
def test_number_of_anything_but_a_number_is_a_dash(value: object) -> None:
    assert number(value) == "–"


def test_state_badge_carries_a_lower_case_class_and_escapes_the_state() -> None:
    assert state_badge("RUNNING") == '<span class="state st-running">RUNNING</span>'
    assert state_badge('<X">') == '<span class="state st-&lt;x&quot;&gt;">&lt;X&quot;&gt;</span>'


def test_table_escapes_headers_but_takes_cells_as_already_escaped_html() -> None:
    out = table(["a<b", "c"], [["<i>1</i>", "2"], ["3", "4"]], table_id='t"1')
    assert out == ('<table id="t&quot;1"><thead><tr><th>a&lt;b</th><th>c</th></tr></thead>'
                   "<tbody><tr><td><i>1</i></td><td>2</td></tr><tr><td>3</td><td>4</td></tr></tbody></table>")


def test_table_without_an_id_or_rows_has_an_empty_body() -> None:
    assert table(["h"], []) == "<table><thead><tr><th>h</th></tr></thead><tbody></tbody></table>"


def test_page_holds_the_escaped_title_every_nav_link_and_the_body_as_given() -> None:
    html = page("jobs <all>", "<p>body</p>")
    assert html.startswith('<!doctype html><html lang="en">')
    assert "<title>jobs &lt;all&gt; · rankctl</title>" in html and "<h1>jobs &lt;all&gt;</h1>" in html
    assert all(f'<a href="{href}">{name}</a>' in html for href, name in NAV)
    assert "<main><h1>jobs &lt;all&gt;</h1><p>body</p></main>" in html
    assert 'class="who"' not in html and "dashboard.js" not in html


def test_page_shows_the_viewer_escaped_and_loads_the_script_when_asked() -> None:
    html = page("t", "", who="user <eve>", script=True)
    assert '<span class="who">user &lt;eve&gt;</span></header>' in html
    assert '<script src="/static/dashboard.js" defer></script></head>' in html
