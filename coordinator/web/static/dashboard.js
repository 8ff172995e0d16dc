// The job page: fetch the live fragment every second and swap it in; rank logs on demand.
// Everything shown is rendered by the server; this file only moves HTML around.
(function () {
  "use strict";
  const live = document.getElementById("live");
  if (!live) return;
  const form = document.getElementById("log-form");
  let page = new URLSearchParams(location.search).get("page") || "0";
  let busy = false;

  function terminal() {
    const body = document.getElementById("live-body");
    return body && body.dataset.terminal === "1";
  }

  async function poll() {
    if (busy) return;
    busy = true;
    try {
      const r = await fetch(live.dataset.src + "?page=" + encodeURIComponent(page), {cache: "no-store"});
      if (r.ok) live.innerHTML = await r.text();
    } catch (e) { /* the coordinator restarts: try again next second */ }
    busy = false;
  }

  async function showLog(rank) {
    document.getElementById("log-rank").textContent = rank;
    form.rank.value = rank;
    const out = document.getElementById("log-lines");
    out.textContent = "reading…";
    const r = await fetch(form.action + "?rank=" + encodeURIComponent(rank), {cache: "no-store"});
    out.textContent = await r.text();
  }

  live.addEventListener("click", function (ev) {
    const link = ev.target.closest("a[data-page]");
    if (link) { ev.preventDefault(); page = link.dataset.page; poll(); return; }
    const cell = ev.target.closest(".rank-cell");
    if (cell) showLog(cell.dataset.rank);
  });
  form.addEventListener("submit", function (ev) { ev.preventDefault(); showLog(form.rank.value); });

  const timer = setInterval(function () {
    if (terminal()) { poll(); clearInterval(timer); return; }
    poll();
  }, 1000);
  showLog(form.rank.value);
})();
