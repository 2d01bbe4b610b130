// Ductor's web console: pages over the operator's API of this listener.
//
// Every figure on a page is read from the API with the key the operator
// pastes once; the key lives in this tab's sessionStorage and goes only into
// the Authorization header of requests to this origin, never into a URL or
// a cookie. Pages are entries of PAGES: a page added there gets its place in
// the navigation and its route. Actions on a run are entries of RUN_ACTIONS,
// and a dead letter's Replay and Discard buttons, each shown only when the
// API this listener describes offers it.
"use strict";

(() => {
  const KEY_SLOT = "ductor.console.key";
  /** How often a page that shows live figures reads them again. */
  const REFRESH_MS = 3000;
  /** How often the overview's metrics are sampled, and how many are kept. */
  const SAMPLE_MS = 3000;
  const SAMPLES_KEPT = 200;
  const STATUSES = ["running", "succeeded", "failed", "cancelled"];
  const FILTERS = ["status", "workflow", "tenant", "correlation_id", "created_after", "created_before"];
  const PAGE_RUNS = 50;

  // ---------------------------------------------------------------- DOM

  const SVG = "http://www.w3.org/2000/svg";

  function build(make, tag, attrs, children) {
    const el = make(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name.startsWith("on")) el.addEventListener(name.slice(2), value);
      else if (name === "text") el.textContent = String(value);
      else el.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  /** An HTML element. */
  const h = (tag, attrs, ...children) => build((t) => document.createElement(t), tag, attrs, children);
  /** An SVG element. */
  const s = (tag, attrs, ...children) => build((t) => document.createElementNS(SVG, t), tag, attrs, children);

  const $ = (id) => document.getElementById(id);

  /** Replaces `el`'s children with those of `children` that are there. */
  const fill = (el, ...children) =>
    el.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));

  function notice(text, kind) {
    const el = $("notice");
    el.textContent = text || "";
    el.className = "notice" + (kind ? " " + kind : "");
  }

  // ---------------------------------------------------------------- time

  const pad = (n, w = 2) => String(n).padStart(w, "0");

  /** `2025-01-02 03:04:05Z`: UTC, to the second. */
  function stamp(iso) {
    if (!iso) return "";
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    return `${d.getUTCFullYear()}-${pad(d.getUTCMonth() + 1)}-${pad(d.getUTCDate())} ` +
      `${pad(d.getUTCHours())}:${pad(d.getUTCMinutes())}:${pad(d.getUTCSeconds())}Z`;
  }

  /** A duration in ms as people say it: `340 ms`, `2.5 s`, `3 min 4 s`. */
  function span(ms) {
    if (!Number.isFinite(ms)) return "";
    if (ms < 1000) return `${Math.max(0, Math.round(ms))} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 1 : 0)} s`;
    const min = Math.floor(ms / 60000);
    if (min < 60) return `${min} min ${Math.round((ms % 60000) / 1000)} s`;
    return `${Math.floor(min / 60)} h ${min % 60} min`;
  }

  const ms = (iso) => new Date(iso).getTime();

  // ---------------------------------------------------------------- API

  class Refusal extends Error {
    constructor(status, code, message) {
      super(message || `HTTP ${status}`);
      this.status = status;
      this.code = code || "";
    }
  }

  const key = () => sessionStorage.getItem(KEY_SLOT) || "";

  /** Calls this listener with the key; JSON back (text for /metrics). */
  async function api(method, path, body) {
    const headers = { Authorization: "Bearer " + key() };
    const init = { method, headers, cache: "no-store", credentials: "omit", redirect: "error" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    const text = await response.text();
    let json = null;
    if ((response.headers.get("content-type") || "").startsWith("application/json")) {
      try { json = JSON.parse(text); } catch (e) { json = null; }
    }
    if (!response.ok) {
      const error = (json && json.error) || {};
      const refusal = new Refusal(response.status, error.code, error.message || text.slice(0, 200));
      if (response.status === 401) keyRefused(refusal);
      throw refusal;
    }
    return json !== null ? json : text;
  }

  /** What this listener's API offers: "post /v1/runs/{run_id}/cancel", ... */
  const offered = new Set();

  async function readOffers() {
    try {
      const doc = await fetch("/v1/openapi.json", { cache: "no-store", credentials: "omit" }).then((r) => r.json());
      for (const [path, item] of Object.entries(doc.paths || {})) {
        for (const [verb, op] of Object.entries(item)) {
          const here = (op.servers || []).some((srv) => srv["x-ductor-listener"] === "admin");
          if (here) offered.add(`${verb} ${path}`);
        }
      }
    } catch (e) {
      notice("the API description could not be read: actions stay hidden", "warn");
    }
  }

  // ---------------------------------------------------------------- pages

  /**
   * The pages. `path` matches the part of the location's hash before `?`;
   * its groups are the page's parameters. `nav` names the page in the
   * navigation bar (pages without it are reached through links).
   */
  const PAGES = [];

  function definePage(page) {
    PAGES.push(page);
  }

  /** The page being shown: its timers, stopped when another is shown. */
  let current = { timers: [], alive: false };

  function every(period, fn) {
    const view = current;
    const tick = async () => {
      if (!view.alive) return;
      try { await fn(); } catch (e) { showError(e); }
      if (view.alive) view.timers.push(setTimeout(tick, period));
    };
    view.timers.push(setTimeout(tick, period));
  }

  function leave() {
    current.alive = false;
    current.timers.forEach(clearTimeout);
  }

  function route() {
    const hash = location.hash || "#/runs";
    const [path, search] = hash.slice(1).split("?");
    const query = new URLSearchParams(search || "");
    leave();
    current = { timers: [], alive: true };
    const main = $("page");
    if (!key()) {
      renderNav(null);
      main.replaceChildren(keyForm());
      $("key-input").focus();
      return;
    }
    for (const page of PAGES) {
      const match = page.path.exec(path);
      if (!match) continue;
      renderNav(page);
      main.replaceChildren(h("p", { class: "muted", text: "Loading…" }));
      const view = current;
      Promise.resolve(page.render(main, match.slice(1).map(decodeURIComponent), query))
        .catch((e) => { if (view.alive) showError(e, main); });
      return;
    }
    location.replace("#/runs");
  }

  function renderNav(active) {
    const nav = $("nav");
    nav.replaceChildren(...PAGES.filter((p) => p.nav).map((p) =>
      h("a", { href: p.href, id: `nav-${p.name}`, class: active && (active.name === p.name || active.under === p.name) ? "active" : "" }, p.nav)));
    $("forget-key").hidden = !key();
  }

  function showError(e, where) {
    const text = e instanceof Refusal
      ? `${e.status}${e.code ? " " + e.code : ""}: ${e.message}`
      : String(e && e.message ? e.message : e);
    if (where) where.replaceChildren(h("p", { class: "error", id: "page-error", text }));
    else notice(text, "error");
  }

  // ---------------------------------------------------------------- the key

  function keyForm(message) {
    const input = h("input", { id: "key-input", type: "password", autocomplete: "off", spellcheck: "false", placeholder: "dk_…", required: true });
    const form = h("form", { id: "key-form", class: "card narrow" },
      h("h1", { text: "Ductor console" }),
      h("p", {}, "Paste an API key with the ", h("code", { text: "admin" }), " scope (",
        h("code", { text: "ductor keys create --tenant ops --scopes admin" }),
        "). It stays in this tab's session storage and is sent only in the Authorization header of this listener's API."),
      h("label", { for: "key-input", text: "API key" }), input,
      h("button", { id: "key-submit", type: "submit", text: "Use key" }),
      h("p", { id: "key-error", class: "error", text: message || "" }));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      sessionStorage.setItem(KEY_SLOT, input.value.trim());
      try {
        await api("GET", "/v1/runs/counts");
        startSampling();
        route();
      } catch (e) {
        sessionStorage.removeItem(KEY_SLOT);
        $("key-error").textContent = e instanceof Refusal
          ? `This key is refused: ${e.status} ${e.code}. ${e.message}`
          : String(e);
      }
    });
    return form;
  }

  function keyRefused(refusal) {
    sessionStorage.removeItem(KEY_SLOT);
    leave();
    renderNav(null);
    $("page").replaceChildren(keyForm(`The key was refused (${refusal.code || refusal.status}); paste another.`));
  }

  // ---------------------------------------------------------------- runs

  const statusBadge = (status, id) => h("span", { class: `status status-${status}`, id, text: status });

  function runsQuery(query, keep) {
    const q = new URLSearchParams();
    for (const name of keep) {
      const value = query.get(name);
      if (value) q.set(name, value);
    }
    return q;
  }

  /** A `datetime-local` value (taken as UTC) as RFC 3339, and back. */
  const toRfc3339 = (local) => (local ? `${local.length === 16 ? local + ":00" : local}Z` : "");
  const toLocal = (rfc) => (rfc ? rfc.replace(/Z$/, "").slice(0, 19) : "");

  function filterForm(query) {
    const field = (name, label, input) => h("label", { class: "field" }, h("span", { text: label }), input);
    const text = (name) => h("input", { id: `f-${name}`, name, type: "text", value: query.get(name) || "" });
    const time = (name) => h("input", { id: `f-${name}`, name, type: "datetime-local", step: "1", value: toLocal(query.get(name)) });
    const status = h("select", { id: "f-status", name: "status" },
      h("option", { value: "", text: "any" }),
      STATUSES.map((st) => h("option", { value: st, selected: query.get("status") === st, text: st })));
    const form = h("form", { id: "filters", class: "filters" },
      field("status", "Status", status),
      field("workflow", "Workflow", text("workflow")),
      field("tenant", "Tenant", text("tenant")),
      field("correlation_id", "Correlation id", text("correlation_id")),
      field("created_after", "Created after (UTC)", time("created_after")),
      field("created_before", "Created before (UTC)", time("created_before")),
      h("div", { class: "field buttons" },
        h("button", { id: "apply-filters", type: "submit", text: "Filter" }),
        h("a", { href: "#/runs", class: "button quiet", id: "clear-filters", text: "Clear" })));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const q = new URLSearchParams();
      for (const name of FILTERS) {
        let value = form.elements[name].value.trim();
        if (name.startsWith("created_")) value = toRfc3339(value);
        if (value) q.set(name, value);
      }
      location.hash = "#/runs" + (q.toString() ? "?" + q : "");
    });
    return form;
  }

  function countsBar(query) {
    const bar = h("div", { id: "counts", class: "counts", "aria-live": "polite" });
    const draw = (counts) => {
      const others = runsQuery(query, FILTERS.filter((f) => f !== "status"));
      const link = (status, n) => {
        const q = new URLSearchParams(others);
        if (status !== "total") q.set("status", status);
        const active = (query.get("status") || "total") === status;
        return h("a", { href: "#/runs?" + q, id: `count-${status}`, class: `count count-${status}${active ? " active" : ""}` },
          h("span", { class: "n", text: n }), h("span", { class: "label", text: status === "total" ? "all" : status }));
      };
      fill(bar, STATUSES.map((st) => link(st, counts[st])), link("total", counts.total),
        counts.exact ? null : h("span", { class: "muted", text: "at least (counted up to the scan limit)" }));
    };
    const refresh = async () => {
      const q = runsQuery(query, FILTERS.filter((f) => f !== "status"));
      draw(await api("GET", "/v1/runs/counts" + (q.toString() ? "?" + q : "")));
    };
    return { bar, refresh };
  }

  function runRow(run) {
    return h("tr", { "data-run-id": run.run_id, "data-status": run.status },
      h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(run.run_id)}`, class: "mono run-link", text: run.run_id })),
      h("td", {}, statusBadge(run.status)),
      h("td", {}, `${run.workflow} `, h("span", { class: "muted", text: `v${run.workflow_version}` })),
      h("td", { text: run.tenant }),
      h("td", { text: `${run.step_index} · ${run.attempt}` }),
      h("td", { class: "mono", text: run.correlation_id || "" }),
      h("td", { title: run.created_at, text: stamp(run.created_at) }),
      h("td", { title: run.updated_at, text: stamp(run.updated_at) }));
  }

  definePage({
    name: "runs",
    nav: "Runs",
    href: "#/runs",
    path: /^\/runs\/?$/,
    async render(main, _params, query) {
      const counts = countsBar(query);
      const body = h("tbody", { id: "runs-body" });
      const pager = h("div", { class: "pager", id: "pager" });
      const table = h("table", { id: "runs-table", class: "grid" },
        h("thead", {}, h("tr", {}, ["Run", "Status", "Workflow", "Tenant", "Step · attempt", "Correlation id", "Created", "Updated"].map((t) => h("th", { text: t })))),
        body);
      main.replaceChildren(h("h1", { text: "Runs" }), counts.bar, filterForm(query), table, pager);
      const list = async () => {
        const q = runsQuery(query, [...FILTERS, "after"]);
        q.set("limit", String(PAGE_RUNS));
        const page = await api("GET", "/v1/runs?" + q);
        body.replaceChildren(...page.runs.map(runRow));
        if (!page.runs.length) body.append(h("tr", {}, h("td", { colspan: 8, class: "muted", id: "no-runs", text: "No runs match." })));
        const newest = runsQuery(query, FILTERS);
        const older = new URLSearchParams(newest);
        if (page.next) older.set("after", page.next);
        fill(pager,
          query.get("after") ? h("a", { href: "#/runs?" + newest, class: "button quiet", id: "newest", text: "← Newest" }) : null,
          page.next ? h("a", { href: "#/runs?" + older, class: "button", id: "older", text: "Older →" }) : null);
        table.dataset.loaded = "true";
      };
      await Promise.all([counts.refresh(), list()]);
      every(REFRESH_MS, counts.refresh);
      // The first page follows new runs; an older page stays as it was read.
      if (!query.get("after")) every(REFRESH_MS, list);
    },
  });

  // ---------------------------------------------------------------- one run

  /**
   * What an operator can do to a run. Each is shown on a run's page only
   * when this listener's API description offers its route (`offer`), and
   * only for runs it applies to (`applies`).
   */
  const RUN_ACTIONS = [
    {
      name: "cancel",
      label: "Cancel run",
      confirm: "Cancel this run: its current step is abandoned and the run ends as cancelled.",
      offer: "post /v1/runs/{run_id}/cancel",
      applies: (run) => run.status === "running",
      request: (run) => ["POST", `/v1/runs/${encodeURIComponent(run.run_id)}/cancel`, { reason: "cancelled from the console" }],
    },
    {
      name: "retry",
      label: "Retry run",
      confirm: "Retry this run from its failed step, with a fresh attempt.",
      offer: "post /v1/runs/{run_id}/retry",
      applies: (run) => run.status === "failed",
      request: (run) => ["POST", `/v1/runs/${encodeURIComponent(run.run_id)}/retry`, {}],
    },
  ];

  function actionBar(run, after) {
    const bar = h("div", { class: "actions", id: "run-actions" });
    for (const action of RUN_ACTIONS) {
      if (!offered.has(action.offer) || !action.applies(run)) continue;
      const confirmRow = h("span", { class: "confirm", id: `confirm-${action.name}-row`, hidden: true },
        h("span", { text: action.confirm + " " }),
        h("button", {
          id: `confirm-${action.name}`, type: "button", class: "danger",
          async onclick(event) {
            event.target.disabled = true;
            try {
              const [method, path, body] = action.request(run);
              await api(method, path, body);
              notice(`${action.name}: requested; the run's coordinator applies it in order`, "ok");
              confirmRow.hidden = true;
              after();
            } catch (e) {
              event.target.disabled = false;
              showError(e);
            }
          },
          text: "Yes",
        }),
        h("button", { type: "button", class: "quiet", onclick: () => { confirmRow.hidden = true; }, text: "No" }));
      bar.append(h("button", { id: `${action.name}-run`, type: "button", onclick: () => { confirmRow.hidden = false; }, text: action.label }), confirmRow);
    }
    return bar;
  }

  const json = (value) => h("pre", { class: "json" }, JSON.stringify(value, null, 2));

  function dataSection(history) {
    const part = (id, label, value, open) => (value === null || value === undefined ? null :
      h("details", { id, open }, h("summary", { text: label }), json(value)));
    return h("section", { class: "data" },
      h("h2", { text: "Data" }),
      part("run-input", "Input", history.input),
      part("run-output", "Output", history.output),
      part("run-error", "Error", history.error, history.run.status === "failed"),
      part("run-waiting", "Waiting", history.waiting),
      part("run-pending-retry", "Pending retry", history.pending_retry));
  }

  function attemptsTable(history) {
    return h("section", {},
      h("h2", { text: "Attempts" }),
      h("table", { class: "grid", id: "attempts" },
        h("thead", {}, h("tr", {}, ["Step", "Attempt", "Status", "Dispatched", "Took", "Deadline", "Error"].map((t) => h("th", { text: t })))),
        h("tbody", {}, history.attempts.map((a) => h("tr", { id: `attempt-${a.step_index}-${a.attempt}` },
          h("td", { text: a.step_index }), h("td", { text: a.attempt }), h("td", {}, statusBadge(a.status)),
          h("td", { text: stamp(a.dispatched_at) }),
          h("td", { text: a.finished_at ? span(ms(a.finished_at) - ms(a.dispatched_at)) : "…" }),
          h("td", { text: stamp(a.deadline) }),
          h("td", { class: "error-text", text: a.error || "" }))))));
  }

  function transitionsTable(history) {
    const effect = (e) => h("div", { class: "effect" },
      h("span", { class: "mono", text: e.ce_type }), " → ", h("span", { class: "mono muted", text: e.topic }), " ",
      h("span", { class: `publish publish-${e.publish_status}`, title: e.last_error || "", text: e.publish_status }));
    return h("section", {},
      h("h2", { text: "Transitions" }),
      h("table", { class: "grid", id: "transitions" },
        h("thead", {}, h("tr", {}, ["Seq", "Kind", "Status", "Step", "At", "Effects", "Detail"].map((t) => h("th", { text: t })))),
        h("tbody", {}, history.transitions.map((t) => h("tr", { "data-seq": t.seq },
          h("td", { text: t.seq }), h("td", { class: "mono", text: t.kind }),
          h("td", { text: `${t.from_status || "—"} → ${t.to_status}` }), h("td", { text: t.step_index }),
          h("td", { text: stamp(t.created_at) }),
          h("td", {}, t.effects.map(effect)),
          h("td", {}, h("details", {}, h("summary", { text: "detail" }), json(t.detail))))))));
  }

  /**
   * The run's timeline: a row per step; a bar per attempt from its dispatch
   * to its result (to now while it runs), coloured by its status; the gaps
   * between a step's attempts are its backoffs; a step without attempts is
   * a wait (a sleep or a signal), drawn from the transitions that entered
   * and left it; signals, the pending retry and deadlines are marks.
   */
  function timeline(history, now) {
    const run = history.run;
    const t0 = ms(run.created_at);
    const t1 = Math.max(run.finished_at ? ms(run.finished_at) : now, t0 + 50,
      ...history.attempts.map((a) => (a.finished_at ? ms(a.finished_at) : now)));
    const steps = 1 + Math.max(run.step_index, 0,
      ...history.attempts.map((a) => a.step_index), ...history.transitions.map((t) => t.step_index));
    const W = 960, LEFT = 90, RIGHT = 16, ROW = 30, TOP = 24;
    const x = (t) => LEFT + ((Math.min(Math.max(t, t0), t1) - t0) / (t1 - t0)) * (W - LEFT - RIGHT);
    const H = TOP + steps * ROW + 8;
    const svg = s("svg", { id: "timeline", class: "timeline", viewBox: `0 0 ${W} ${H}`, width: "100%", role: "img", "aria-label": "timeline of the run's steps and attempts" });
    // Axis: five ticks across the run's time.
    for (let i = 0; i <= 4; i += 1) {
      const t = t0 + ((t1 - t0) * i) / 4;
      svg.append(s("line", { x1: x(t), x2: x(t), y1: TOP - 4, y2: H - 8, class: "tick" }),
        s("text", { x: x(t), y: 12, class: "axis", "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle" }, `+${span(t - t0)}`));
    }
    const rowY = (i) => TOP + i * ROW;
    for (let i = 0; i < steps; i += 1) {
      svg.append(s("text", { x: 4, y: rowY(i) + ROW / 2 + 4, class: "label" }, `step ${i}`));
    }
    // Waits: a step without attempts, from the transition that entered it
    // to the one that left it (or now).
    const entered = (i) => history.transitions.find((t) => t.step_index >= i);
    const left = (i) => history.transitions.find((t) => t.step_index > i);
    for (let i = 0; i < steps; i += 1) {
      if (history.attempts.some((a) => a.step_index === i)) continue;
      const from = entered(i), to = left(i);
      if (!from) continue;
      const waiting = history.waiting && history.waiting.step_index === i ? history.waiting : null;
      const start = waiting ? ms(waiting.since) : ms(from.created_at);
      const end = to ? ms(to.created_at) : run.finished_at ? ms(run.finished_at) : now;
      const what = waiting ? (waiting.signal ? `awaiting signal “${waiting.signal}”` : "sleeping") : "wait";
      svg.append(s("rect", { x: x(start), y: rowY(i) + 8, width: Math.max(2, x(end) - x(start)), height: ROW - 16, rx: 2, class: `wait${waiting ? " live" : ""}`, "data-step": i },
        s("title", {}, `step ${i}: ${what}, ${span(end - start)}${waiting ? `, until ${stamp(waiting.until)}` : ""}`)));
      if (waiting) {
        const until = ms(waiting.until);
        svg.append(s("text", { x: Math.min(x(start) + 4, W - 160), y: rowY(i) + ROW / 2 + 4, class: "wait-label" }, `${what} until ${stamp(waiting.until)}`));
        if (until <= t1) svg.append(s("line", { x1: x(until), x2: x(until), y1: rowY(i) + 4, y2: rowY(i) + ROW - 4, class: "deadline" }));
      }
    }
    // Backoffs between a step's attempts, and the pending retry.
    const byStep = new Map();
    for (const a of history.attempts) {
      if (!byStep.has(a.step_index)) byStep.set(a.step_index, []);
      byStep.get(a.step_index).push(a);
    }
    for (const [i, list] of byStep) {
      list.sort((a, b) => a.attempt - b.attempt);
      for (let k = 1; k < list.length; k += 1) {
        const prev = list[k - 1], next = list[k];
        if (!prev.finished_at) continue;
        const y = rowY(i) + ROW / 2;
        const from = ms(prev.finished_at), to = ms(next.dispatched_at);
        // Between a failure for good and an operator's retry the run lay
        // failed: no backoff of its own.
        const retried = history.transitions.some((t) => t.kind === "run.retried" && ms(t.created_at) >= from && ms(t.created_at) <= to);
        svg.append(s("line", { x1: x(from), x2: x(to), y1: y, y2: y, class: retried ? "failed-gap" : "backoff" },
          s("title", {}, retried ? `failed until retried: ${span(to - from)}` : `backoff before attempt ${next.attempt}: ${span(to - from)}`)));
      }
    }
    const retry = history.pending_retry;
    if (retry && retry.due_at) {
      const last = history.attempts.find((a) => a.stamp === retry.after_stamp);
      if (last && last.finished_at) {
        const y = rowY(last.step_index) + ROW / 2;
        svg.append(s("line", { x1: x(ms(last.finished_at)), x2: x(Math.min(ms(retry.due_at), t1)), y1: y, y2: y, class: "backoff pending", id: "pending-retry" },
          s("title", {}, `retry due at ${stamp(retry.due_at)}`)));
      }
    }
    // Attempts.
    for (const a of history.attempts) {
      const start = ms(a.dispatched_at);
      const end = a.finished_at ? ms(a.finished_at) : now;
      const y = rowY(a.step_index) + 6;
      const bar = s("rect", {
        x: x(start), y, width: Math.max(3, x(end) - x(start)), height: ROW - 12, rx: 2,
        class: `bar att-${a.status}`, "data-step": a.step_index, "data-attempt": a.attempt, "data-status": a.status, tabindex: 0,
      }, s("title", {}, `step ${a.step_index}, attempt ${a.attempt}: ${a.status}, ${span(end - start)}${a.error ? " — " + a.error : ""}`));
      bar.addEventListener("click", () => showAttempt(a));
      svg.append(bar);
      if (a.status === "dispatched" && ms(a.deadline) <= t1) {
        svg.append(s("line", { x1: x(ms(a.deadline)), x2: x(ms(a.deadline)), y1: y - 2, y2: y + ROW - 10, class: "deadline" }));
      }
      if (a.status === "timed_out") {
        svg.append(s("text", { x: x(end) + 2, y: y + ROW / 2, class: "mark" }, "timeout"));
      }
    }
    // Signals received, and the run's end.
    for (const t of history.transitions) {
      const at = x(ms(t.created_at));
      if (t.kind === "run.signalled") {
        const y = rowY(t.step_index) + ROW / 2;
        svg.append(s("path", { d: `M${at} ${y - 6} L${at + 6} ${y} L${at} ${y + 6} L${at - 6} ${y} Z`, class: "signal" },
          s("title", {}, `signal at ${stamp(t.created_at)}`)));
      }
      if (t.kind === "run.cancelled" || t.kind === "run.failed" || t.kind === "run.succeeded") {
        svg.append(s("line", { x1: at, x2: at, y1: TOP - 4, y2: H - 8, class: `end end-${t.to_status}` },
          s("title", {}, `${t.kind} at ${stamp(t.created_at)}`)));
      }
      if (t.kind === "run.retried") {
        svg.append(s("line", { x1: at, x2: at, y1: TOP - 4, y2: H - 8, class: "retried" },
          s("title", {}, `retried by an operator at ${stamp(t.created_at)}`)));
      }
    }
    return svg;
  }

  function showAttempt(a) {
    const panel = $("attempt-detail");
    if (!panel) return;
    panel.hidden = false;
    panel.replaceChildren(h("h3", { text: `Step ${a.step_index}, attempt ${a.attempt}` }),
      h("dl", { class: "meta" },
        h("dt", { text: "status" }), h("dd", {}, statusBadge(a.status)),
        h("dt", { text: "stamp" }), h("dd", { class: "mono", text: a.stamp }),
        h("dt", { text: "dispatched" }), h("dd", { text: stamp(a.dispatched_at) }),
        h("dt", { text: "deadline" }), h("dd", { text: stamp(a.deadline) }),
        h("dt", { text: "finished" }), h("dd", { text: a.finished_at ? stamp(a.finished_at) : "not yet" }),
        h("dt", { text: "error" }), h("dd", { class: "error-text", text: a.error || "—" })));
  }

  const legend = () => h("div", { class: "legend" },
    ["dispatched", "succeeded", "failed", "timed_out", "cancelled"].map((st) => h("span", { class: `key att-${st}`, text: st })),
    h("span", { class: "key backoff-key", text: "backoff" }), h("span", { class: "key wait-key", text: "wait" }),
    h("span", { class: "key signal-key", text: "signal" }), h("span", { class: "key retried-key", text: "retried" }));

  definePage({
    name: "run",
    under: "runs",
    path: /^\/runs\/([^/]+)$/,
    async render(main, [runId]) {
      const path = `/v1/runs/${encodeURIComponent(runId)}/history`;
      let history = await api("GET", path);
      let seen = -1;
      const head = h("div", { id: "run-head" });
      const chart = h("div", { class: "chart-box" });
      const rest = h("div", {});
      const detail = h("div", { id: "attempt-detail", class: "card", hidden: true });
      main.replaceChildren(
        h("p", {}, h("a", { href: "#/runs", id: "back-to-runs", text: "← Runs" })),
        head,
        h("section", {}, h("h2", { text: "Timeline" }), legend(), chart, detail),
        rest);
      const reload = async () => {
        history = await api("GET", path);
        draw();
      };
      // An action is applied by the run's coordinator after the API took
      // it: the page reads the run again until its history moves on.
      let acted = null;
      const afterAction = async () => {
        acted = history.run.last_transition_seq;
        await reload();
      };
      const draw = () => {
        const run = history.run;
        chart.replaceChildren(timeline(history, Date.now()));
        if (run.last_transition_seq === seen) return;
        seen = run.last_transition_seq;
        head.replaceChildren(
          h("h1", {}, "Run ", h("span", { class: "mono", id: "run-id", text: run.run_id }), " ", statusBadge(run.status, "run-status")),
          h("dl", { class: "meta" },
            h("dt", { text: "workflow" }), h("dd", { text: `${run.workflow} v${run.workflow_version}` }),
            h("dt", { text: "tenant" }), h("dd", { text: run.tenant }),
            h("dt", { text: "pool" }), h("dd", { text: run.pool }),
            h("dt", { text: "correlation id" }), h("dd", { class: "mono", text: run.correlation_id || "—" }),
            h("dt", { text: "step · attempt" }), h("dd", { text: `${run.step_index} · ${run.attempt}` }),
            h("dt", { text: "created" }), h("dd", { text: stamp(run.created_at) }),
            h("dt", { text: "finished" }), h("dd", { text: run.finished_at ? `${stamp(run.finished_at)} (${span(ms(run.finished_at) - ms(run.created_at))})` : "—" })),
          actionBar(run, afterAction));
        rest.replaceChildren(dataSection(history), attemptsTable(history), transitionsTable(history));
      };
      draw();
      every(REFRESH_MS, async () => {
        // A finished run changes only when an operator acts on it: a
        // running run, or one whose action is not applied yet, is read again.
        const moved = acted === null || history.run.last_transition_seq !== acted;
        if (moved) acted = null;
        if (history.run.status === "running" || !moved) await reload();
      });
    },
  });

  // ---------------------------------------------------------------- dead letters

  const LETTER_STATUSES = ["pending", "replaying", "replayed", "discarded"];
  const LETTER_FILTERS = ["class", "stage", "status"];
  const PAGE_LETTERS = 50;
  /** The most of a key, a header or a value a letter's page shows. */
  const SHOWN_CHARS = 65536;

  const lettersHref = (q) => "#/dead-letters" + (q && q.toString() ? "?" + q : "");
  const letterHref = (id) => `#/dead-letters/${encodeURIComponent(id)}`;

  /** The counts by stage and class, summed by class: [[class, n, stages]], most first. */
  function byClass(counts) {
    const classes = new Map();
    for (const c of counts) {
      const one = classes.get(c.class) || { n: 0, stages: [] };
      one.n += c.letters;
      one.stages.push(`${c.stage}: ${c.letters}`);
      classes.set(c.class, one);
    }
    return [...classes].map(([cls, one]) => [cls, one.n, one.stages]).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
  }

  function classChips(query) {
    const bar = h("div", { id: "letter-classes", class: "counts", "aria-live": "polite" });
    const others = runsQuery(query, LETTER_FILTERS.filter((f) => f !== "class"));
    const chip = (cls, n, stages) => {
      const q = new URLSearchParams(others);
      if (cls !== null) q.set("class", cls);
      const active = (query.get("class") || null) === cls;
      return h("a", {
        href: lettersHref(q), class: `count count-class${cls === null ? " count-total" : ""}${active ? " active" : ""}`,
        id: cls === null ? "class-all" : null, "data-class": cls, title: stages ? stages.join(", ") : null,
      }, h("span", { class: "n", text: n }), h("span", { class: "label", text: cls === null ? "all classes" : cls }));
    };
    let drawn = null;
    const refresh = async () => {
      // The chips count every class of the other filters: a click moves
      // between them.
      const answer = await api("GET", "/v1/dead-letters/counts" + (others.toString() ? "?" + others : ""));
      // Unchanged chips stay the elements they were, under the pointer too.
      const seen = JSON.stringify(answer.counts);
      if (seen === drawn) return;
      drawn = seen;
      const classes = byClass(answer.counts);
      const all = classes.reduce((sum, c) => sum + c[1], 0);
      fill(bar, chip(null, all), classes.map(([cls, n, stages]) => chip(cls, n, stages)));
    };
    return { bar, refresh };
  }

  function letterFilterForm(query) {
    const status = h("select", { id: "lf-status", name: "status" },
      h("option", { value: "", text: "any" }),
      LETTER_STATUSES.map((st) => h("option", { value: st, selected: query.get("status") === st, text: st })));
    const stage = h("input", { id: "lf-stage", name: "stage", type: "text", value: query.get("stage") || "" });
    const form = h("form", { id: "letter-filters", class: "filters" },
      h("label", { class: "field" }, h("span", { text: "State" }), status),
      h("label", { class: "field" }, h("span", { text: "Stage" }), stage),
      h("div", { class: "field buttons" },
        h("button", { id: "apply-letter-filters", type: "submit", text: "Filter" }),
        h("a", { href: "#/dead-letters", class: "button quiet", id: "clear-letter-filters", text: "Clear" })));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const q = runsQuery(query, ["class"]);
      for (const name of ["status", "stage"]) {
        const value = form.elements[name].value.trim();
        if (value) q.set(name, value);
      }
      location.hash = lettersHref(q);
    });
    return form;
  }

  const source = (l) => `${l.source_topic} / ${l.source_partition} @ ${l.source_offset}`;

  function letterRow(l) {
    return h("tr", { "data-letter-id": l.id, "data-class": l.class, "data-status": l.status },
      h("td", { title: l.dead_lettered_at, text: stamp(l.dead_lettered_at) }),
      h("td", {}, h("a", { href: letterHref(l.id), class: "mono letter-link", text: l.class })),
      h("td", { text: l.stage }),
      h("td", { class: "mono", text: source(l) }),
      h("td", { class: "mono", title: "the run the input names (inputs are keyed by their run)", text: l.run_id || "—" }),
      h("td", { text: l.tenant || "—" }),
      h("td", {}, statusBadge(l.status)));
  }

  definePage({
    name: "letters",
    nav: "Dead letters",
    href: "#/dead-letters",
    path: /^\/dead-letters\/?$/,
    async render(main, _params, query) {
      const chips = classChips(query);
      const body = h("tbody", { id: "letters-body" });
      const pager = h("div", { class: "pager", id: "letters-pager" });
      const table = h("table", { id: "letters-table", class: "grid" },
        h("thead", {}, h("tr", {}, ["Time", "Class", "Stage", "Source (topic / partition @ offset)", "Run", "Tenant", "State"].map((t) => h("th", { text: t })))),
        body);
      main.replaceChildren(h("h1", { text: "Dead letters" }), chips.bar, letterFilterForm(query), table, pager);
      let drawn = null;
      const list = async () => {
        const q = runsQuery(query, [...LETTER_FILTERS, "after"]);
        q.set("limit", String(PAGE_LETTERS));
        const page = await api("GET", "/v1/dead-letters?" + q);
        // An unchanged page stays the rows it was, under the pointer too.
        const seen = JSON.stringify(page);
        if (seen === drawn) return;
        drawn = seen;
        body.replaceChildren(...page.letters.map(letterRow));
        if (!page.letters.length) body.append(h("tr", {}, h("td", { colspan: 7, class: "muted", id: "no-letters", text: "No dead letters match." })));
        const newest = runsQuery(query, LETTER_FILTERS);
        const older = new URLSearchParams(newest);
        if (page.next !== null && page.next !== undefined) older.set("after", String(page.next));
        fill(pager,
          query.get("after") ? h("a", { href: lettersHref(newest), class: "button quiet", id: "letters-newest", text: "← Newest" }) : null,
          page.next !== null && page.next !== undefined ? h("a", { href: lettersHref(older), class: "button", id: "letters-older", text: "Older →" }) : null);
        table.dataset.loaded = "true";
      };
      await Promise.all([chips.refresh(), list()]);
      every(REFRESH_MS, chips.refresh);
      // The first page follows new letters; an older page stays as it was read.
      if (!query.get("after")) every(REFRESH_MS, list);
    },
  });

  // ---------------------------------------------------------------- one letter

  /** Bytes as the API shows them ({utf8} or {base64}), bounded, for a `pre`. */
  function bytesText(bytes) {
    if (bytes === null || bytes === undefined) return { text: null, kind: "none" };
    if (bytes.utf8 !== undefined) return { text: bytes.utf8, kind: "text" };
    return { text: bytes.base64, kind: "base64" };
  }

  function bounded(text) {
    if (text.length <= SHOWN_CHARS) return [text, null];
    return [text.slice(0, SHOWN_CHARS), `the first ${SHOWN_CHARS} of ${text.length} characters`];
  }

  /** The value: pretty JSON when it parses, else as text (or base64), bounded. */
  function payload(letter) {
    const { text, kind } = bytesText(letter.value);
    if (text === null) return h("p", { class: "muted", id: "letter-value", text: "no value" });
    let shown = text, as = kind;
    if (kind === "text") {
      try { shown = JSON.stringify(JSON.parse(text), null, 2); as = "json"; } catch (e) { as = "text"; }
    }
    const [cut, note] = bounded(shown);
    return h("div", {},
      h("p", { class: "muted small" }, `${letter.value_bytes} bytes, shown as ${as}`,
        letter.value_cut ? " — only the first bytes were recorded" : "", note ? ` — ${note}` : ""),
      h("pre", { class: "json", id: "letter-value", "data-as": as }, cut));
  }

  function headersTable(letter) {
    if (letter.headers_dropped) return h("p", { class: "muted", text: "The headers were over the bound and were not recorded." });
    if (!letter.headers.length) return h("p", { class: "muted", id: "letter-headers", text: "no headers" });
    return h("table", { class: "grid", id: "letter-headers" },
      h("thead", {}, h("tr", {}, ["Header", "Value"].map((t) => h("th", { text: t })))),
      h("tbody", {}, letter.headers.map((hd) => {
        const { text, kind } = bytesText(hd.value);
        return h("tr", {}, h("td", { class: "mono", text: hd.key }),
          h("td", { class: "mono" }, text === null ? h("span", { class: "muted", text: "no value" }) : bounded(text)[0],
            kind === "base64" ? h("span", { class: "muted", text: " (base64)" }) : null));
      })));
  }

  function runLink(runId) {
    return h("a", { href: `#/runs/${encodeURIComponent(runId)}`, class: "mono", id: "outcome-run", text: runId });
  }

  /**
   * A replay's outcome: where the record landed and the run it names. A
   * start applies a moment after its replay: until the run is there the
   * outcome says so, and looks again while the page is open.
   */
  function replayOutcome(outcome, box) {
    const again = outcome.status === "already_replayed" ? " (an earlier replay; nothing was produced now)" : "";
    const run = outcome.run;
    const where = h("p", {}, `Replayed${again} to `, h("span", { class: "mono", text: `${outcome.topic} / ${outcome.partition} @ ${outcome.offset}` }),
      ` at ${stamp(outcome.replayed_at)}, ${outcome.signed ? "signed with its tenant's key" : "unsigned"}.`);
    const state = h("span", { id: "outcome-run-state" });
    const runLine = run
      ? h("p", {}, "Run: ", runLink(run.run_id), " ", state)
      : h("p", { class: "muted", id: "outcome-no-run", text: "The input names no run: the routing plane decides it (its run.accepted event names it)." });
    fill(box, h("h2", { text: "Replay" }), where, runLine);
    box.dataset.outcome = "replayed";
    box.hidden = false;
    if (!run) return;
    const view = current;
    const look = async () => {
      if (!view.alive) return;
      try {
        await api("GET", `/v1/runs/${encodeURIComponent(run.run_id)}/history`);
        state.textContent = "— started";
        state.className = "ok-text";
        state.dataset.exists = "true";
      } catch (e) {
        if (!(e instanceof Refusal && e.status === 404)) throw e;
        state.textContent = "— not applied yet; looking again";
        state.className = "muted";
        view.timers.push(setTimeout(() => look().catch((err) => showError(err)), REFRESH_MS));
      }
    };
    if (run.exists) { state.textContent = "— started"; state.className = "ok-text"; state.dataset.exists = "true"; }
    else look().catch((err) => showError(err));
  }

  function discardOutcome(outcome, box) {
    fill(box, h("h2", { text: "Discard" }),
      h("p", {}, `Discarded${outcome.status === "already_discarded" ? " earlier" : ""} at ${stamp(outcome.discarded_at)}: `,
        h("q", { id: "outcome-reason", text: outcome.reason })));
    box.dataset.outcome = "discarded";
    box.hidden = false;
  }

  /** The buttons of a letter: Replay and Discard (with its reason), where the API offers them. */
  function letterActions(letter, box, after) {
    const bar = h("div", { class: "actions", id: "letter-actions" });
    const base = `/v1/dead-letters/${encodeURIComponent(letter.id)}`;
    const act = async (button, method, path, body, show) => {
      button.disabled = true;
      try {
        const outcome = await api(method, path, body);
        show(outcome, box);
        notice(`letter ${letter.id}: ${outcome.status.replace("_", " ")}`, "ok");
        await after();
      } catch (e) {
        button.disabled = false;
        showError(e);
      }
    };
    const replayable = (letter.status === "pending" || letter.status === "replaying") &&
      !letter.value_cut && !letter.key_dropped && !letter.headers_dropped;
    if (offered.has("post /v1/dead-letters/{letter_id}/replay") && replayable) {
      const confirmRow = h("span", { class: "confirm", id: "confirm-replay-row", hidden: true },
        h("span", { text: "Produce this input again, once, to the topic it was read from. " }),
        h("button", { id: "confirm-replay", type: "button", class: "danger", text: "Yes",
          onclick: (event) => act(event.target, "POST", `${base}/replay`, undefined, replayOutcome) }),
        h("button", { type: "button", class: "quiet", onclick: () => { confirmRow.hidden = true; }, text: "No" }));
      bar.append(h("button", { id: "replay-letter", type: "button", onclick: () => { confirmRow.hidden = false; }, text: "Replay" }), confirmRow);
    }
    if (offered.has("post /v1/dead-letters/{letter_id}/discard") && letter.status === "pending") {
      const reason = h("input", { id: "discard-reason", type: "text", maxlength: 500, placeholder: "why it is not replayed", required: true });
      const form = h("form", { class: "confirm", id: "confirm-discard-row", hidden: true },
        h("label", { for: "discard-reason", text: "Reason " }), reason,
        h("button", { id: "confirm-discard", type: "submit", class: "danger", text: "Discard" }),
        h("button", { type: "button", class: "quiet", onclick: () => { form.hidden = true; }, text: "No" }));
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const why = reason.value.trim();
        if (!why) { reason.focus(); return; }
        act($("confirm-discard"), "POST", `${base}/discard`, { reason: why }, discardOutcome);
      });
      bar.append(h("button", { id: "discard-letter", type: "button", class: "quiet",
        onclick: () => { form.hidden = false; reason.focus(); }, text: "Discard" }), form);
    }
    return bar;
  }

  definePage({
    name: "letter",
    under: "letters",
    path: /^\/dead-letters\/([^/]+)$/,
    async render(main, [id]) {
      const path = `/v1/dead-letters/${encodeURIComponent(id)}`;
      const head = h("div", { id: "letter-head" });
      const outcome = h("section", { id: "letter-outcome", class: "card", hidden: true });
      const rest = h("div", {});
      main.replaceChildren(
        h("p", {}, h("a", { href: "#/dead-letters", id: "back-to-letters", text: "← Dead letters" })),
        head, outcome, rest);
      const show = (letter) => {
        const replay = letter.replay;
        head.replaceChildren(
          h("h1", {}, "Dead letter ", h("span", { class: "mono", id: "letter-id", text: letter.id }), " ",
            statusBadge(letter.status, "letter-status")),
          h("dl", { class: "meta" },
            h("dt", { text: "dead-lettered" }), h("dd", { text: stamp(letter.dead_lettered_at) }),
            h("dt", { text: "class" }), h("dd", { class: "mono", id: "letter-class", text: letter.class }),
            h("dt", { text: "stage" }), h("dd", { text: letter.stage }),
            h("dt", { text: "source" }), h("dd", { class: "mono", text: source(letter) }),
            h("dt", { text: "input type" }), h("dd", { class: "mono", text: letter.input_type || "—" }),
            h("dt", { text: "tenant" }), h("dd", { text: letter.tenant || "—" }),
            h("dt", { text: "run" }), h("dd", {}, letter.run_id ? h("a", { href: `#/runs/${encodeURIComponent(letter.run_id)}`, class: "mono", text: letter.run_id }) : "—"),
            replay ? [h("dt", { text: "replay" }), h("dd", { class: "mono", id: "letter-replay",
              text: replay.replayed_at ? `${replay.replay_id} → partition ${replay.partition} @ ${replay.offset}, ${stamp(replay.replayed_at)}` : `${replay.replay_id}, claimed ${stamp(replay.claimed_at)}, not recorded yet` })] : null,
            letter.discard ? [h("dt", { text: "discarded" }), h("dd", { id: "letter-discard" }, `${stamp(letter.discard.discarded_at)}: `, h("q", { text: letter.discard.reason }))] : null),
          letterActions(letter, outcome, reload));
        const key = bytesText(letter.key);
        rest.replaceChildren(
          h("section", {}, h("h2", { text: "Error" }), h("pre", { class: "json error-text", id: "letter-error" }, bounded(letter.error)[0])),
          h("section", {}, h("h2", { text: "Key" }),
            key.text === null ? h("p", { class: "muted", id: "letter-key", text: letter.key_dropped ? "over the bound: not recorded" : "no key" })
              : h("pre", { class: "json", id: "letter-key" }, bounded(key.text)[0], key.kind === "base64" ? " (base64)" : "")),
          h("section", {}, h("h2", { text: "Headers" }), headersTable(letter)),
          h("section", {}, h("h2", { text: "Value" }), payload(letter)));
      };
      const reload = async () => { show(await api("GET", path)); };
      await reload();
    },
  });

  // ---------------------------------------------------------------- overview

  /** One Prometheus text page as [{name, labels, value}]. */
  function parseMetrics(text) {
    const series = [];
    const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
    const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    for (const raw of text.split("\n")) {
      if (!raw || raw.startsWith("#")) continue;
      const m = line.exec(raw);
      if (!m) continue;
      const labels = {};
      for (const l of (m[2] || "").matchAll(label)) labels[l[1]] = l[2];
      const value = m[3] === "+Inf" ? Infinity : Number(m[3]);
      series.push({ name: m[1], labels, value });
    }
    return series;
  }

  /** The sum of the series of `name` whose labels include `match`. */
  function total(series, name, match = {}) {
    let sum = 0, found = false;
    for (const one of series) {
      if (one.name !== name) continue;
      if (Object.entries(match).some(([k, v]) => one.labels[k] !== v)) continue;
      sum += one.value;
      found = true;
    }
    return found ? sum : null;
  }

  /** The histogram `name`'s buckets as [[le, count]], ascending. */
  function buckets(series, name) {
    return series.filter((one) => one.name === `${name}_bucket`)
      .map((one) => [one.labels.le === "+Inf" ? Infinity : Number(one.labels.le), one.value])
      .sort((a, b) => a[0] - b[0]);
  }

  /** The q-quantile of the observations between two bucket readings. */
  function quantile(q, before, after) {
    const counts = after.map(([le, n], i) => [le, n - ((before[i] || [le, 0])[1])]);
    const all = counts.length ? counts[counts.length - 1][1] : 0;
    if (!(all > 0)) return null;
    const rank = q * all;
    let lower = 0, below = 0;
    for (const [le, n] of counts) {
      if (n >= rank) {
        if (!Number.isFinite(le)) return lower;
        return lower + ((le - lower) * (rank - below)) / Math.max(n - below, 1e-9);
      }
      lower = le;
      below = n;
    }
    return lower;
  }

  /** Samples of the metrics: {at, applied, deadLetters, backlog, apply}. */
  const samples = [];
  let sampling = null;

  async function sample() {
    const text = await api("GET", "/metrics");
    const series = parseMetrics(typeof text === "string" ? text : "");
    samples.push({
      at: Date.now(),
      applied: total(series, "ductor_inputs_total", { outcome: "applied" }),
      deadLetters: total(series, "ductor_dead_letters_total"),
      backlog: total(series, "ductor_outbox_backlog"),
      applyBuckets: buckets(series, "ductor_apply_seconds"),
      applySum: total(series, "ductor_apply_seconds_sum"),
      applyCount: total(series, "ductor_apply_seconds_count"),
    });
    while (samples.length > SAMPLES_KEPT) samples.shift();
    document.dispatchEvent(new Event("ductor:sample"));
  }

  function startSampling() {
    if (sampling || !key()) return;
    const tick = async () => {
      try { await sample(); } catch (e) { /* shown by the overview when it looks */ }
      sampling = setTimeout(tick, SAMPLE_MS);
    };
    sampling = setTimeout(tick, 0);
  }

  /** The points of each chart: [[at, value]] from consecutive samples. */
  function derive() {
    const out = { throughput: [], latency: [], backlog: [], deadLetters: [] };
    for (let i = 0; i < samples.length; i += 1) {
      const b = samples[i];
      if (b.backlog !== null) out.backlog.push([b.at, b.backlog]);
      if (i === 0) continue;
      const a = samples[i - 1];
      const dt = (b.at - a.at) / 1000;
      if (dt <= 0) continue;
      if (a.applied !== null && b.applied !== null) out.throughput.push([b.at, Math.max(0, b.applied - a.applied) / dt]);
      if (a.deadLetters !== null && b.deadLetters !== null) out.deadLetters.push([b.at, Math.max(0, b.deadLetters - a.deadLetters) / dt]);
      const p95 = quantile(0.95, a.applyBuckets, b.applyBuckets);
      if (p95 !== null) out.latency.push([b.at, p95 * 1000]);
      else out.latency.push([b.at, 0]);
    }
    return out;
  }

  function sparkline(id, points, unit) {
    const W = 320, H = 80, P = 4;
    const svg = s("svg", { id, class: "spark", viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", "data-points": points.length });
    // From the first point kept (a minute at least) to now.
    const now = Date.now();
    const from = Math.min(points.length ? points[0][0] : now, now - 60000);
    const max = Math.max(1e-9, ...points.map((p) => p[1]));
    const x = (t) => P + ((t - from) / (now - from)) * (W - 2 * P);
    const y = (v) => H - P - (v / max) * (H - 2 * P - 12);
    svg.append(s("line", { x1: P, x2: W - P, y1: H - P, y2: H - P, class: "baseline" }),
      s("text", { x: W - P, y: 11, class: "axis", "text-anchor": "end" }, `max ${fmt(max)} ${unit}`));
    if (points.length) {
      const d = points.map(([t, v], i) => `${i ? "L" : "M"}${x(t).toFixed(1)} ${y(v).toFixed(1)}`).join(" ");
      svg.append(s("path", { d: `${d} L${x(points[points.length - 1][0]).toFixed(1)} ${H - P} L${x(points[0][0]).toFixed(1)} ${H - P} Z`, class: "area" }),
        s("path", { d, class: "line" }));
    }
    return svg;
  }

  function fmt(v) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "—";
    if (v >= 100) return v.toFixed(0);
    if (v >= 10) return v.toFixed(1);
    return v.toFixed(2);
  }

  const CHARTS = [
    { id: "throughput", title: "Throughput", unit: "inputs/s", about: "inputs applied by the coordinator (ductor_inputs_total{outcome=\"applied\"})" },
    { id: "latency", title: "Apply latency", unit: "ms p95", about: "one batch loaded, folded and committed (ductor_apply_seconds)" },
    { id: "backlog", title: "Outbox backlog", unit: "intents", about: "effects committed and not yet published (ductor_outbox_backlog)" },
    { id: "deadLetters", title: "Dead letters", unit: "letters/s", about: "inputs sent to the dead-letter topic (ductor_dead_letters_total)" },
  ];

  definePage({
    name: "overview",
    nav: "Overview",
    href: "#/overview",
    path: /^\/overview$/,
    async render(main) {
      const grid = h("div", { class: "cards", id: "charts" });
      const when = h("p", { class: "muted", id: "sampled" });
      main.replaceChildren(h("h1", { text: "Overview" }),
        h("p", { class: "muted", text: `This listener's /metrics, sampled every ${SAMPLE_MS / 1000} s while the console is open; the last ${Math.round((SAMPLES_KEPT * SAMPLE_MS) / 60000)} minutes are kept in this tab.` }),
        grid, when);
      const view = current;
      const draw = () => {
        if (!view.alive) { document.removeEventListener("ductor:sample", draw); return; }
        const series = derive();
        grid.replaceChildren(...CHARTS.map((c) => {
          const points = series[c.id];
          const last = points.length ? points[points.length - 1][1] : null;
          return h("div", { class: "card chart", id: `chart-${c.id}` },
            h("h2", { text: c.title }),
            h("p", { class: "value" }, h("span", { class: "n", text: fmt(last) }), ` ${c.unit}`),
            sparkline(`spark-${c.id}`, points, c.unit),
            h("p", { class: "muted small", text: c.about }));
        }));
        const lastSample = samples[samples.length - 1];
        when.textContent = lastSample ? `${samples.length} samples; last at ${stamp(new Date(lastSample.at).toISOString())}` : "no sample yet";
      };
      document.addEventListener("ductor:sample", draw);
      draw();
      if (!samples.length) await sample();
    },
  });

  // ---------------------------------------------------------------- start

  function start() {
    // Counted where a test (or a person with the inspector) can see it.
    document.addEventListener("securitypolicyviolation", (event) => {
      const seen = Number(document.body.dataset.policyViolations || 0) + 1;
      document.body.dataset.policyViolations = String(seen);
      notice(`blocked by the page's security policy: ${event.violatedDirective}`, "error");
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_SLOT);
      clearTimeout(sampling);
      sampling = null;
      samples.length = 0;
      route();
    });
    window.addEventListener("hashchange", route);
    readOffers().finally(() => {
      startSampling();
      route();
      document.body.dataset.ready = "true";
    });
  }

  start();
})();
