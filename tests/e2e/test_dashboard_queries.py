"""Every dashboard route answers a bad query parameter or path id with 400 naming the parameter, the value and
the rule: never a 500, never a traceback in the log (issue 24 item 7)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from test_dashboard import CC, get, serve

pytestmark = pytest.mark.grpc_in_process
# the query parameters of each GET route; a new route must be listed here (the test fails otherwise)
PARAMS = {"/": ["before"], "/jobs/{job_id}": ["page"], "/jobs/{job_id}/live": ["page"],
          "/jobs/{job_id}/data.json": ["page"], "/jobs/{job_id}/logs": ["rank"], "/nodes": ["page"],
          "/plan": [], "/metrics": [], "/static/{name}": []}
BAD = ["2147483648", "99999999999999999999", "-1", "abc", "1.5", "", " 1", "\u0661", "9" * 5000]


def test_every_route_refuses_bad_query_values_with_400_naming_them(tmp_path: Path) -> None:
    async def test(coord, s: aiohttp.ClientSession) -> None:  # noqa: ANN001
        job = coord.core.submit(CC, queue_anyway=True)
        routes = {r.resource.canonical for r in coord.http.runner.app.router.routes() if r.method == "GET"}
        assert routes == set(PARAMS), f"list the query parameters of {routes ^ set(PARAMS)} in PARAMS"
        answers = []
        for route, names in PARAMS.items():
            path = route.replace("{job_id}", job.id).replace("{name}", "dashboard.js")
            for name in names:
                for value in BAD:
                    async with s.get(coord.http_url + path, params={name: value}) as r:
                        answers.append((route, name, value[:12], r.status, await r.text()))
        for route, name, value, status, text in answers:
            assert status == 400, (route, name, value, status, text[:200])
            assert name in text and "must be" in text, (route, name, value, text[:200])
            assert len(text) < 400, (route, name, value)
        status, text = await get(s, coord, f"/jobs/{job.id}/logs")
        assert status == 400 and "rank is required" in text
        status, text = await get(s, coord, f"/jobs/{job.id}/logs?rank=2147483647")
        assert status == 400 and "is not a rank of job" in text
        top = "2147483647"  # the largest accepted: clamped to the last page, never an error
        for path in ("/?before=0", f"/?before={top}", f"/nodes?page={top}", f"/jobs/{job.id}?page={top}",
                     f"/jobs/{job.id}/live?page={top}", f"/jobs/{job.id}/data.json?page={top}"):
            assert (await get(s, coord, path))[0] == 200, path

    with capture_logs() as logs:
        serve(test, tmp_path)
    assert not [e for e in logs if e.get("log_level") in ("error", "critical") or "exc_info" in e], logs


@pytest.mark.parametrize("route", [r for r in PARAMS if "{job_id}" in r])
def test_a_huge_or_unprintable_job_id_is_400_and_an_unknown_one_404(tmp_path: Path, route: str) -> None:
    async def test(coord, s: aiohttp.ClientSession) -> None:  # noqa: ANN001
        status, text = await get(s, coord, route.replace("{job_id}", "j" * 5000) + "?rank=0")
        assert status == 400 and "job id" in text and "at most 128" in text, (status, text[:200])
        status, text = await get(s, coord, route.replace("{job_id}", "%07x") + "?rank=0")
        assert status == 400 and "printable" in text, (status, text[:200])
        status, _ = await get(s, coord, route.replace("{job_id}", "no-such-job") + "?rank=0")
        assert status == 404
    serve(test, tmp_path)
