// lockmesh console: renders /console/api/state, plots /console/api/history and
// drills into /console/api/classes/<class>. Read-only; no framework, no library.
//
// The operator token comes from the URL fragment (#token=..., never sent to a
// server) or the paste box, lives in this tab's sessionStorage only and is sent
// only as `Authorization: Bearer` to this origin's API. Everything the API says is
// rendered with textContent (never as HTML), so no value can become markup.
"use strict";

const TOKEN_KEY = "lockmesh.console.token";
const REFRESH_MS = 5000;
let timer = null;

function takeTokenFromFragment() {
  const h = window.location.hash;
  if (h.startsWith("#token=")) {
    const t = decodeURIComponent(h.slice("#token=".length)).trim();
    if (t) sessionStorage.setItem(TOKEN_KEY, t);
    // Drop the fragment from the address bar and the history entry.
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") e.className = v;
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === undefined || c === null) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function age(ms) {
  if (ms === undefined || ms === null) return "-";
  const s = Math.floor(ms / 1000);
  if (s < 1) return ms + "ms";
  if (s < 60) return (ms / 1000).toFixed(1) + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  if (s < 86400) return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  return Math.floor(s / 86400) + "d" + String(Math.floor((s % 86400) / 3600)).padStart(2, "0") + "h";
}

function when(unixMs) {
  if (!unixMs) return "-";
  return new Date(unixMs).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function table(headers, rows) {
  const head = el("tr", {}, ...headers.map(([h, cls]) => el("th", { class: cls }, h)));
  return el("table", {}, el("thead", {}, head), el("tbody", {}, ...rows));
}

function fill(id, ...nodes) {
  const body = document.querySelector("#" + id + " .body");
  body.replaceChildren(...nodes);
}

function renderError(status, code, message) {
  const box = document.getElementById("error");
  box.replaceChildren(
    el("strong", {}, status === 401 ? "Not signed in: " : status === 403 ? "Not allowed: " : "Error: "),
    el("span", { class: "code", id: "error-code" }, code),
    " (HTTP " + status + ") ",
    el("span", { id: "error-message" }, message),
  );
  box.hidden = false;
  drillClass = null;
  document.getElementById("drill").hidden = true;
  document.getElementById("plot-links").replaceChildren();
  for (const id of ["seal", "plots", "clusters", "quorum", "classes", "draining", "grants", "holdwaits", "quotas",
    "saturated", "audit"]) {
    fill(id, el("span", { class: "muted" }, status === 401 ? "sign in to see this" : "unavailable"));
  }
}

function renderSeal(s) {
  const state = s.sealed
    ? el("span", { class: "bad", id: "seal-state" }, "SEALED")
    : el("span", { class: "ok", id: "seal-state" }, "not sealed");
  const parts = [el("p", {}, state, s.sealed ? " (" + s.reason + ")" : "", "  epoch ", el("b", { id: "epoch" }, s.epoch ?? "?"))];
  if (s.sealed) {
    parts.push(el("p", {}, s.detail || ""), el("p", { class: "muted" }, "since " + when(s.since_ms) +
      "; every request is refused until the epoch advance (lockctl epoch-advance)"));
  }
  if (s.explicit) parts.push(el("p", { class: "bad" }, "explicit seal in the epoch record: " + s.explicit));
  fill("seal", ...parts);
}

function renderQuorum(e) {
  const c = e.cluster || {};
  const q = c.quorum
    ? el("span", { class: "ok", id: "quorum-state" }, "quorum")
    : el("span", { class: "bad", id: "quorum-state" }, "NO QUORUM");
  const lines = [
    el("p", {}, q, "  " + (c.voting_reachable ?? 0) + " of " + (c.voting ?? 0) + " voting members answer; leader " +
      (c.leader || "none agreed")),
    el("p", { class: e.reachable ? "muted" : "bad" }, e.reachable
      ? "this arbiter's seal check reads etcd linearizably"
      : "this arbiter cannot read etcd linearizably for " + age(e.failing_for_ms)),
  ];
  if (c.error) lines.push(el("p", { class: "bad" }, c.error));
  for (const a of c.alarms || []) lines.push(el("p", { class: "bad" }, "alarm: " + a));
  const rows = (c.members || []).map((m) => el("tr", { "data-member": m.id },
    el("td", {}, m.name || "-"), el("td", { class: "digest" }, m.id), el("td", {}, m.version || "-"),
    el("td", {}, m.leader ? "leader" : m.learner ? "learner" : "follower"),
    el("td", { class: "num" }, m.raft_term ?? "-"), el("td", { class: "num" }, m.raft_index ?? "-"),
    el("td", { class: m.reachable && !(m.errors || []).length ? "ok" : "bad" },
      m.reachable && !(m.errors || []).length ? "ok" : (m.errors || []).join("; ") || "unreachable")));
  lines.push(table([["member"], ["id"], ["version"], ["role"], ["term", "num"], ["index", "num"], ["health"]], rows));
  fill("quorum", ...lines);
}

// Every cluster the arbiter reads (coord first): its epoch, seal, quorum and
// hold scan. An arbiter before issue 18 sends no `clusters`.
function renderClusters(clusters) {
  if (!clusters || !clusters.length) {
    fill("clusters", el("p", { class: "muted" }, "this arbiter reports its coord cluster only (above)"));
    return;
  }
  const rows = clusters.map((c) => {
    const v = c.etcd || {};
    const scan = c.scan || {};
    return el("tr", { "data-cluster": c.cluster },
      el("td", { class: "name" }, c.cluster), el("td", { class: "num" }, c.epoch ?? "?"),
      el("td", { class: c.sealed ? "bad" : "ok" }, c.sealed ? "SEALED (" + c.sealed + ")" : "not sealed"),
      el("td", { class: v.quorum ? "ok" : "bad" }, (v.quorum ? "quorum " : "NO QUORUM ") +
        (v.voting_reachable ?? 0) + "/" + (v.voting ?? 0)),
      el("td", { class: "num" }, scan.error ? "-" : scan.holds),
      el("td", { class: scan.error || c.policies_error || v.error ? "bad" : "muted" },
        [scan.error, c.policies_error, v.error].filter((e) => e).join("; ") ||
          "read at etcd revision " + scan.revision + (scan.truncated ? " (truncated)" : "")));
  });
  fill("clusters", table([["cluster"], ["epoch", "num"], ["seal"], ["etcd"], ["holds", "num"], ["scan"]], rows));
}

function posture(c) {
  const e = c.enforcement || {};
  if (e.posture === "fenced") {
    const p = c.pause_test || {};
    return el("span", {}, "fenced; pause test ",
      p.passing ? el("span", { class: "ok" }, "passing until " + when((p.expires_unix_s || 0) * 1000).slice(0, 10))
        : el("span", { class: "bad" }, "NOT PASSING"));
  }
  return el("span", {}, "advisory until " + e.waiver_expiry,
    e.waiver_expired ? el("span", { class: "bad" }, " (waiver EXPIRED)") : "", " risk owner " + e.risk_owner);
}

function renderClasses(classes) {
  const rows = classes.map((c) => el("tr", { "data-class": c.name },
    el("td", { class: "name" }, c.name), el("td", {}, c.tier), el("td", {}, posture(c)),
    el("td", { class: "num" }, c.ttl_s + "s"), el("td", {}, c.fairness),
    el("td", { class: "num desired" }, c.desired_max_holders),
    el("td", { class: "num limit" }, c.limit ?? "?"),
    el("td", { class: c.state === "draining" ? "bad state" : "state" }, c.state ?? "?")));
  fill("classes", table([["class"], ["tier"], ["enforcement"], ["TTL", "num"], ["fairness"],
    ["maxHolders (desired)", "num"], ["limit (authoritative)", "num"], ["state"]], rows));
}

function renderDraining(draining) {
  if (!draining.length) {
    fill("draining", el("p", { class: "ok", id: "no-draining" }, "no class is draining"));
    return;
  }
  const rows = draining.map((d) => el("tr", { "data-class": d.class },
    el("td", { class: "name" }, d.class), el("td", { class: "num limit" }, d.limit),
    el("td", { class: "num target" }, d.pending_move ? "prefix move" : d.pending_target ?? "?"),
    el("td", { class: "num" }, d.change_epoch), el("td", { class: "num age" }, age(d.draining_age_ms)),
    el("td", { class: "cluster" }, d.cluster ?? "-")));
  fill("draining", el("p", { class: "bad" }, "these classes admit nothing until the change is resumed or cancelled"),
    table([["class"], ["limit", "num"], ["pending target", "num"], ["change epoch", "num"], ["draining for", "num"],
      ["cluster"]], rows));
}

// One row per class (over every cluster); on a split deployment, below it one
// row per cluster with holds of the class there.
function renderGrants(classes, scan) {
  const rows = [];
  for (const c of classes) {
    const split = (c.clusters || []).length > 1;
    rows.push(el("tr", { "data-class": c.name },
      el("td", { class: "name" }, drillButton(c.name)), el("td", { class: "num open" }, c.open_grants),
      el("td", { class: "num" }, c.keys_held), el("td", { class: "num" }, age(c.oldest_grant_age_ms)),
      el("td", { class: "num" }, c.saturated_keys), el("td", { class: "cluster" }, split ? "all" : "-")));
    if (!split) continue;
    for (const k of c.clusters.filter((k) => k.open_grants > 0)) {
      rows.push(el("tr", { "data-class": c.name, "data-cluster": k.cluster, class: "sub" },
        el("td", { class: "name muted" }, c.name), el("td", { class: "num open" }, k.open_grants),
        el("td", { class: "num" }, k.keys_held), el("td", { class: "num" }, age(k.oldest_grant_age_ms)),
        el("td", { class: "num" }, k.saturated_keys), el("td", { class: "cluster" }, k.cluster)));
    }
  }
  const note = scan.error ? el("p", { class: "bad" }, scan.error)
    : el("p", { class: "muted" }, scan.holds + " holds read at etcd revision " + scan.revision +
      (scan.truncated ? " (truncated)" : ""));
  fill("grants", table([["class"], ["open grants", "num"], ["keys", "num"], ["oldest", "num"],
    ["saturated keys", "num"], ["cluster"]], rows), note,
    el("p", { class: "muted" }, "a class's saturated keys and their waiters: activate its name"));
}

function renderSaturated(keys) {
  if (!keys.length) {
    fill("saturated", el("p", { class: "muted" }, "no key is at its limit"));
    return;
  }
  const rows = keys.map((k) => el("tr", { "data-digest": k.digest },
    el("td", { class: "digest" }, k.digest), el("td", {}, k.class),
    el("td", { class: "num" }, k.holders + "/" + k.limit), el("td", { class: "num" }, age(k.oldest_age_ms)),
    el("td", { class: "num" }, k.waiters_here), el("td", { class: "cluster" }, k.cluster ?? "-")));
  fill("saturated", table([["key digest"], ["class"], ["holders", "num"], ["oldest", "num"],
    ["waiting here", "num"], ["cluster"]], rows));
}

// Holds and waits by namespace and class (ADR-033): the open holds and the oldest
// are over every cluster (every arbiter shows the same); the rest is this
// arbiter's. An arbiter before issue 21 sends no `holds_and_waits`.
function renderHoldsWaits(rows) {
  if (!rows || !rows.length) {
    fill("holdwaits", el("p", { class: "muted" }, "no hold and no waiter"));
    return;
  }
  const trs = rows.map((r) => el("tr", { "data-labels": r.namespace + "/" + r.class },
    el("td", {}, r.namespace), el("td", {}, r.class), el("td", { class: "num" }, r.open_holds),
    el("td", { class: "num" }, r.open_holds ? age(r.oldest_hold_ms) : "-"),
    el("td", { class: "num" }, r.gated_waiters),
    el("td", { class: "num" }, r.gated_waiters ? age(r.oldest_gated_wait_ms) : "-"),
    el("td", { class: "num" }, r.key_gated), el("td", { class: "num" }, r.lock_contended),
    el("td", { class: "num" }, r.grants_after_wait),
    el("td", { class: "num" }, r.grants_after_wait ? (r.wakeups / r.grants_after_wait).toFixed(1) : "-"),
    el("td", { class: "num" }, r.pickups ? age(r.pickup_mean_ms) : "-")));
  fill("holdwaits", table([["namespace"], ["class"], ["open holds", "num"], ["oldest hold", "num"],
    ["gated here", "num"], ["oldest gated wait", "num"], ["key_gated answers", "num"],
    ["lock_contended answers", "num"], ["grants after a wait", "num"], ["wake-ups per grant", "num"],
    ["pickup (mean)", "num"]], trs),
    el("p", { class: "muted" }, "open holds and the oldest hold: every cluster, the same on every arbiter; " +
      "the rest: this arbiter, since it started"));
}

// Shadow policies (docs/CLASSES.md): what promoting each class's candidate would
// have changed over the last 24 hours at this arbiter.
function renderShadow(rows) {
  if (!rows || !rows.length) {
    fill("shadow", el("p", { class: "muted" }, "no candidate policy decided differently in the last 24 hours"));
    return;
  }
  const trs = rows.map((r) => el("tr", { "data-shadow": r.class + "/" + r.decision + "/" + r.reason },
    el("td", {}, r.class), el("td", {}, r.decision), el("td", {}, r.reason), el("td", { class: "num" }, r.count)));
  fill("shadow", table([["class"], ["the candidate"], ["reason"], ["decisions", "num"]], trs),
    el("p", { class: "muted" }, "would_refuse: granted or renewed, the candidate would have refused; " +
      "would_grant: refused, the candidate would have granted. This arbiter, last 24 hours; " +
      "every arbiter's: lockctl audit shadow"));
}

function quotaCell(u) {
  if (!u) return el("td", { class: "num muted" }, "-");
  return el("td", { class: "num" + (u.percent >= 80 ? " bad" : "") }, u.used + "/" + u.limit + " (" + u.percent + " %)");
}

function renderQuotas(quotas) {
  if (!quotas || !quotas.length) {
    fill("quotas", el("p", { class: "muted" }, "no namespace holds a session or a lock"));
    return;
  }
  const rows = quotas.map((q) => el("tr", { "data-namespace": q.namespace, "data-alert": String(q.alert) },
    el("td", {}, q.namespace), el("td", {}, q.cluster), quotaCell(q.sessions), quotaCell(q.holds),
    quotaCell(q.waiters), el("td", { class: "num" }, q.acquires_per_s)));
  fill("quotas", table([["namespace"], ["cluster"], ["sessions", "num"], ["holds", "num"],
    ["waiting here", "num"], ["acquires/s", "num"]], rows),
    el("p", { class: "muted" }, "red: at or above 80 % of the quota (the alert's threshold)"));
}

function renderAudit(a) {
  if (!a.configured) {
    fill("audit", el("p", { class: "muted", id: "audit-off" }, a.message));
    return;
  }
  if (a.error) {
    fill("audit", el("p", { class: "bad" }, a.error));
    return;
  }
  const rows = (a.events || []).map((e) => el("tr", { "data-kind": e.kind },
    el("td", { class: "num" }, e.revision), el("td", {}, e.kind), el("td", {}, e.class ?? "-"),
    el("td", { class: "digest" }, e.digest ? e.digest.slice(0, 16) : "-"), el("td", {}, when(e.at_ms))));
  fill("audit", table([["revision", "num"], ["event"], ["class"], ["key digest"], ["at"]], rows));
}

// === Plots (the arbiter's history, /console/api/history) ===================
//
// Drawn as SVG by this script (no library): one line per class, the latest
// sample on the right. Each line carries its figures as data attributes
// (data-last: the newest sample's value; grants and refusals also data-total:
// the counter since the arbiter started, at that sample), and every chart has a
// values table (the newest samples, newest first) for keyboard and screen-reader
// users. Charts are redrawn at the page's width when it changes.

const SVG_NS = "http://www.w3.org/2000/svg";
const COLOURS = 8;
const VALUE_ROWS = 12;
const AGE_LABELS = ["<1s", "<5s", "<10s", "<30s", "<1m", "<5m", "<15m", "<1h", "<4h", "4h+"];
let lastState = null;
let lastHistory = null;
let drillClass = null;
let drillOpener = null;
let lastDrill = null;

function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== undefined && v !== null) e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c !== undefined && c !== null) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

// A number for people: at most two decimals, no trailing zeros.
function num(v) {
  if (v === null || v === undefined) return "-";
  return String(Math.round(v * 100) / 100);
}

function clock(unixMs) {
  return new Date(unixMs).toISOString().slice(11, 19);
}

// The smallest of 1, 2, 5 x 10^n at or above v (the y axis' top).
function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function chartWidth(host) {
  const w = host && host.clientWidth ? host.clientWidth : 360;
  return Math.max(240, Math.min(w, 900));
}

// A line chart: `lines` [{key, label, values (null: no value), attrs}] over the
// sample times `at` (unix ms), the x axis spanning `spanMs` up to the newest.
function lineChart(width, at, spanMs, lines, unit) {
  const H = 150, L = 52, R = 10, T = 8, B = 22;
  const w = width - L - R, h = H - T - B;
  const end = at.length ? at[at.length - 1] : Date.now();
  const start = end - spanMs;
  const max = niceMax(Math.max(0, ...lines.flatMap((l) => l.values.filter((v) => v !== null))));
  const x = (t) => L + Math.max(0, (t - start) / spanMs) * w;
  const y = (v) => T + h - (v / max) * h;
  const g = svg("svg", { width, height: H, viewBox: "0 0 " + width + " " + H, role: "img", class: "chart-svg" });
  for (const f of [0, 0.5, 1]) {
    g.append(svg("line", { x1: L, x2: L + w, y1: y(max * f), y2: y(max * f), class: "grid" }),
      svg("text", { x: L - 4, y: y(max * f) + 4, class: "tick", "text-anchor": "end" }, num(max * f) + unit));
  }
  const mins = Math.round(spanMs / 60000);
  g.append(svg("text", { x: L, y: H - 6, class: "tick" }, "-" + mins + "m"),
    svg("text", { x: L + w / 2, y: H - 6, class: "tick", "text-anchor": "middle" }, "-" + Math.round(mins / 2) + "m"),
    svg("text", { x: L + w, y: H - 6, class: "tick", "text-anchor": "end" }, clock(end)));
  lines.forEach((l, i) => {
    let d = "";
    let pen = "M";
    l.values.forEach((v, j) => {
      if (v === null || at[j] < start) { pen = "M"; return; }
      d += pen + x(at[j]).toFixed(1) + "," + y(v).toFixed(1) + " ";
      pen = "L";
    });
    const last = l.values.length ? l.values[l.values.length - 1] : null;
    g.append(svg("path", { d: d.trim() || "M0,0", class: "line c" + (i % COLOURS), "data-key": l.key,
      "data-last": last ?? "", "data-last-at": at.length ? end : "", ...l.attrs }));
    // A few samples (a young arbiter) are drawn as dots too: a line of two points
    // at the right edge is hard to read.
    l.values.forEach((v, j) => {
      const few = at.length <= 60 && j < l.values.length - 1;
      if (v !== null && at[j] >= start && (few || j === l.values.length - 1)) {
        g.append(svg("circle", { cx: x(at[j]), cy: y(v), r: j === l.values.length - 1 ? 3 : 2,
          class: "dot c" + (i % COLOURS) }));
      }
    });
  });
  return g;
}

function legend(lines, fmtLast) {
  return el("ul", { class: "legend" }, ...lines.map((l, i) => el("li", {},
    el("span", { class: "sw c" + (i % COLOURS), "aria-hidden": "true" }), l.label + " ",
    el("b", {}, fmtLast(l)))));
}

// The newest samples, newest first: a row per sample, a cell per line (its
// plotted value in data-value; a count per window also in data-count).
function valuesTable(at, lines, cell) {
  const rows = [];
  for (let j = at.length - 1; j >= Math.max(0, at.length - VALUE_ROWS); j--) {
    rows.push(el("tr", { "data-at": at[j] }, el("td", {}, clock(at[j])),
      ...lines.map((l) => el("td", { class: "num", "data-key": l.key, "data-value": l.values[j] ?? "",
        "data-count": l.raw && l.counts ? l.raw[j] : null }, cell(l, j)))));
  }
  return el("details", {}, el("summary", {}, "values (newest " + VALUE_ROWS + " samples)"),
    table([["sample (UTC)"], ...lines.map((l) => [l.label, "num"])], rows));
}

function figure(id, title, scope, body) {
  return el("figure", { class: "chart", id }, el("figcaption", {}, el("b", {}, title), " ",
    el("span", { class: "muted" }, scope)), ...body);
}

// The classes with a non-zero value in `field`, largest first (at most COLOURS).
function classLines(h, field, toValue) {
  const sum = (c) => c[field].reduce((a, b) => a + b, 0);
  return h.classes.filter((c) => c[field].some((v) => v > 0)).sort((a, b) => sum(b) - sum(a) || (a.class < b.class ? -1 : 1))
    .slice(0, COLOURS).map((c) => ({ key: c.class, label: c.class, raw: c[field], c,
      values: c[field].map((v, j) => toValue(v, j)) }));
}

// Per-second rates of per-window counts: the window of sample j runs from the
// previous sample (the first: from the start).
function rateOf(h) {
  return (v, j) => {
    const from = j > 0 ? h.at_ms[j - 1] : h.started_ms;
    const s = Math.max(1, h.at_ms[j] - from) / 1000;
    return Math.round((v / s) * 1000) / 1000;
  };
}

function emptyNote(lines, what) {
  return lines.length ? null : el("p", { class: "muted" }, what);
}

function counterChart(h, width, field, id, title, scope) {
  const lines = classLines(h, field, rateOf(h));
  for (const l of lines) {
    const j = l.raw.length - 1;
    l.counts = true;
    l.attrs = { "data-series": field, "data-class": l.key, "data-total": l.c[field + "_total"],
      "data-last-count": j >= 0 ? l.raw[j] : "" };
  }
  const span = h.capacity * h.interval_ms;
  return figure(id, title, scope, [lineChart(width, h.at_ms, span, lines, "/s"),
    emptyNote(lines, "none in the last hour"),
    legend(lines, (l) => num(l.values[l.values.length - 1]) + "/s, " + l.c[field + "_total"] + " since start"),
    valuesTable(h.at_ms, lines, (l, j) => l.raw[j] + " (" + num(l.values[j]) + "/s)")]);
}

function gaugeChart(h, width, field, id, title, scope, scale, unit) {
  const lines = classLines(h, field, (v) => v / scale);
  for (const l of lines) l.attrs = { "data-series": field, "data-class": l.key };
  const span = h.capacity * h.interval_ms;
  return figure(id, title, scope, [lineChart(width, h.at_ms, span, lines, unit),
    emptyNote(lines, "none in the last hour"),
    legend(lines, (l) => num(l.values[l.values.length - 1]) + unit),
    valuesTable(h.at_ms, lines, (l, j) => num(l.values[j]) + unit)]);
}

function etcdChart(h, width) {
  const e = h.etcd;
  const ms = (v) => (v === null ? null : Math.round(v / 10) / 100);
  const lines = [
    { key: "mean", label: "mean", values: e.mean_us.map(ms), attrs: { "data-series": "etcd_mean_ms" } },
    { key: "max", label: "slowest", values: e.max_us.map(ms), attrs: { "data-series": "etcd_max_ms" } },
  ];
  const failed = e.failures.reduce((a, b) => a + b, 0);
  const span = h.capacity * h.interval_ms;
  return figure("chart-etcd", "etcd latency (seal checks)", "this arbiter", [
    lineChart(width, h.at_ms, span, lines, "ms"),
    legend(lines, (l) => num(l.values[l.values.length - 1]) + "ms"),
    el("p", { class: failed ? "bad" : "muted", id: "etcd-failures" }, failed + " failed checks in the last hour; " +
      "a check is one linearizable read of the epoch record, once a second"),
    valuesTable(h.at_ms, lines, (l, j) => num(l.values[j]) + "ms")]);
}

// Open holds by age (bars), fleet-wide: from the hold scans.
function agesChart(ages, width, id, scope) {
  if (!ages) return figure(id, "Open holds by age", scope, [el("p", { class: "bad" }, "the hold scan failed")]);
  const H = 150, L = 52, R = 10, T = 8, B = 22;
  const w = width - L - R, h = H - T - B;
  const n = ages.counts.length;
  const max = niceMax(Math.max(...ages.counts));
  const bw = w / n;
  const g = svg("svg", { width, height: H, viewBox: "0 0 " + width + " " + H, role: "img", class: "chart-svg" });
  for (const f of [0, 0.5, 1]) {
    const yy = T + h - f * h;
    g.append(svg("line", { x1: L, x2: L + w, y1: yy, y2: yy, class: "grid" }),
      svg("text", { x: L - 4, y: yy + 4, class: "tick", "text-anchor": "end" }, num(max * f)));
  }
  ages.counts.forEach((c, i) => {
    const bh = (c / max) * h;
    g.append(svg("rect", { x: L + i * bw + 2, y: T + h - bh, width: Math.max(1, bw - 4), height: bh, class: "bar",
      "data-bucket": AGE_LABELS[i] ?? String(i), "data-count": c }, svg("title", {}, (AGE_LABELS[i] ?? i) + ": " + c)));
    // Narrow bars label every other bucket (the values table names them all).
    if (bw >= 36 || i % 2 === 0) {
      g.append(svg("text", { x: L + i * bw + bw / 2, y: H - 6, class: "tick", "text-anchor": "middle" },
        AGE_LABELS[i] ?? ""));
    }
  });
  const total = ages.counts.reduce((a, b) => a + b, 0);
  const rows = ages.counts.map((c, i) => el("tr", {}, el("td", {}, AGE_LABELS[i] ?? String(i)), el("td", { class: "num" }, c)));
  return figure(id, "Open holds by age", scope, [g, el("p", { class: "muted" }, total + " open holds, now"),
    el("details", {}, el("summary", {}, "values"), table([["age"], ["open holds", "num"]], rows))]);
}

function grafanaLink(url) {
  if (!url || !/^https?:\/\//.test(url)) return null;
  return el("a", { href: url, target: "_blank", rel: "noopener noreferrer", class: "grafana" },
    "Grafana dashboard (every arbiter)");
}

// The six charts at width `w`.
function charts(s, h, w) {
  return [
    counterChart(h, w, "grants", "chart-grants", "Grants per second by class", "this arbiter"),
    counterChart(h, w, "refusals", "chart-refusals", "Refusals per second by class", "this arbiter"),
    gaugeChart(h, w, "gated_waiters", "chart-waiters", "Waiters by class", "gated at this arbiter", 1, ""),
    gaugeChart(h, w, "oldest_hold_ms", "chart-oldest", "Oldest hold by class", "every arbiter's holds", 1000, "s"),
    agesChart(s.hold_ages, w, "chart-ages", "every arbiter's holds, now"),
    etcdChart(h, w),
  ];
}

// Draws `make(width)` into `grid` at the width its cells are laid out at (drawn
// twice when that width changed since the last time).
function drawGrid(grid, make) {
  const cell = grid.querySelector(".chart");
  let w = chartWidth(cell || grid);
  grid.replaceChildren(...make(w));
  const laid = chartWidth(grid.querySelector(".chart"));
  if (Math.abs(laid - w) > 4) grid.replaceChildren(...make(laid));
}

function renderPlots() {
  const s = lastState, h = lastHistory;
  const g = s ? grafanaLink(s.grafana_url) : null;
  document.getElementById("plot-links").replaceChildren(g ||
    el("span", { class: "muted" }, "no Grafana dashboard configured (console.grafana_url)"));
  if (!s || !h) return;
  const body = document.querySelector("#plots .body");
  let grid = body.querySelector(".charts");
  if (!grid) {
    grid = el("div", { class: "charts" });
    body.replaceChildren(el("p", { class: "muted", id: "plots-note" }), grid);
  }
  document.getElementById("plots-note").textContent = h.at_ms.length
    ? "one sample every " + h.interval_ms / 1000 + " s; " + h.at_ms.length + " of " + h.capacity +
      " kept in the arbiter's memory since " + when(h.started_ms)
    : "no sample yet: the first is taken " + h.interval_ms / 1000 + " s after the arbiter starts";
  drawGrid(grid, (w) => charts(s, h, w));
}

// === Drill-down: one class (/console/api/classes/<class>) ===================

function drillButton(name) {
  return el("button", { type: "button", class: "drill", "data-drill": name, "data-focus-key": "drill:" + name,
    "aria-controls": "drill", title: "show " + name + "'s saturated keys and waiters" }, name);
}

async function openDrill(name, opener) {
  drillClass = name;
  drillOpener = opener || null;
  const box = document.getElementById("drill");
  box.hidden = false;
  document.getElementById("drill-title").textContent = "Class " + name;
  await loadDrill();
  box.focus({ preventScroll: true });
  box.scrollIntoView({ block: "start" });
}

function closeDrill() {
  drillClass = null;
  lastDrill = null;
  document.getElementById("drill").hidden = true;
  const back = drillOpener && document.contains(drillOpener) ? drillOpener
    : document.querySelector("[data-focus-key=\"drill:" + CSS.escape(String(drillOpener?.dataset?.drill ?? "")) + "\"]");
  if (back) back.focus();
}

async function loadDrill() {
  if (!drillClass) return;
  const name = drillClass;
  const r = await api("/console/api/classes/" + encodeURIComponent(name));
  if (drillClass !== name) return;
  lastDrill = r.ok ? r.body : null;
  renderDrill(r);
}

function renderDrill(r) {
  const body = document.querySelector("#drill .body");
  const close = el("button", { type: "button", id: "drill-close", "data-focus-key": "drill-close" }, "Close (Esc)");
  close.addEventListener("click", closeDrill);
  if (!r.ok) {
    body.replaceChildren(close, el("p", { class: "bad" }, r.code + ": " + r.message));
    return;
  }
  const d = r.body;
  const scan = d.scan || {};
  const plural = (n, one, many) => n + " " + (n === 1 ? one : many);
  const summary = el("p", {}, plural(d.open_grants, "open hold", "open holds") + ", " +
    plural(d.saturated_keys, "key", "keys") + " at the limit",
    scan.error ? el("span", { class: "bad" }, " (" + scan.error + ")") : "");
  const keys = d.saturated.length
    ? table([["key digest"], ["holders", "num"], ["oldest hold", "num"], ["waiting here", "num"], ["cluster"]],
      d.saturated.map((k) => el("tr", { "data-digest": k.digest },
        el("td", { class: "digest wrap" }, k.digest), el("td", { class: "num" }, k.holders + "/" + k.limit),
        el("td", { class: "num" }, age(k.oldest_age_ms)),
        el("td", { class: "num" + (k.waiters_here ? " warn" : ""), "data-waiters": k.waiters_here ?? 0 },
          k.waiters_here ?? 0),
        el("td", { class: "cluster" }, k.cluster ?? "-"))))
    : el("p", { class: "muted" }, "no key of " + d.class + " is at its limit");
  const waits = d.holds_and_waits.length
    ? table([["namespace"], ["open holds", "num"], ["oldest hold", "num"], ["gated here", "num"],
      ["oldest gated wait", "num"]], d.holds_and_waits.map((w) => el("tr", { "data-labels": w.namespace + "/" + w.class },
      el("td", {}, w.namespace), el("td", { class: "num" }, w.open_holds),
      el("td", { class: "num" }, w.open_holds ? age(w.oldest_hold_ms) : "-"),
      el("td", { class: "num" }, w.gated_waiters),
      el("td", { class: "num" }, w.gated_waiters ? age(w.oldest_gated_wait_ms) : "-"))))
    : null;
  const grid = el("div", { class: "charts" });
  const g = grafanaLink(lastState && lastState.grafana_url);
  body.replaceChildren(...[el("p", { class: "links" }, close, g ? " " : "", g), summary,
    el("h3", {}, "Saturated keys (at most 100), with the acquires waiting for each at this arbiter"), keys,
    waits ? el("h3", {}, "Waiters by namespace") : null, waits, el("h3", {}, "Last hour"), grid].filter((n) => n));
  const h = lastHistory;
  const only = h ? { ...h, classes: h.classes.filter((c) => c.class === d.class) } : null;
  drawGrid(grid, (w) => [
    ...(only ? [counterChart(only, w, "grants", "drill-grants", "Grants per second", "this arbiter"),
      counterChart(only, w, "refusals", "drill-refusals", "Refusals per second", "this arbiter"),
      gaugeChart(only, w, "gated_waiters", "drill-waiters", "Waiters", "gated at this arbiter", 1, "")] : []),
    agesChart(d.hold_ages, w, "drill-ages", "every arbiter's holds, now"),
  ]);
}

document.getElementById("drill").addEventListener("keydown", (ev) => {
  if (ev.key === "Escape") closeDrill();
});
document.addEventListener("click", (ev) => {
  const b = ev.target.closest && ev.target.closest("button[data-drill]");
  if (b) openDrill(b.dataset.drill, b);
});

// What has the keyboard focus and which values tables are open, to keep both
// across a refresh (every table is drawn again).
function keepFocus() {
  const a = document.activeElement;
  const open = [...document.querySelectorAll("figure.chart details[open]")].map((d) => d.closest("figure").id);
  const key = a && a.dataset ? a.dataset.focusKey || (a.tagName === "SUMMARY" ? "sum:" + a.closest("figure")?.id : null)
    : null;
  return { key, open };
}

function restoreFocus(k) {
  for (const id of k.open) {
    const d = document.querySelector("#" + CSS.escape(id) + " details");
    if (d) d.open = true;
  }
  if (!k.key) return;
  const t = k.key.startsWith("sum:")
    ? document.querySelector("#" + CSS.escape(k.key.slice(4)) + " summary")
    : document.querySelector("[data-focus-key=\"" + CSS.escape(k.key) + "\"]");
  if (t && document.activeElement !== t) t.focus({ preventScroll: true });
}

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => {
    const k = keepFocus();
    renderPlots();
    if (drillClass && lastDrill) renderDrill({ ok: true, body: lastDrill });
    restoreFocus(k);
  }, 100);
});

function render(s) {
  document.getElementById("error").hidden = true;
  document.getElementById("meta").textContent = "read-only; arbiter " + s.version + "; signed in as " +
    s.operator.sub + "; " + when(s.generated_ms);
  const reg = s.registry || {};
  renderSeal(s.seal);
  renderClusters(s.clusters);
  renderQuorum(s.etcd);
  renderClasses(s.classes);
  if (reg.valid === false) {
    document.querySelector("#classes .body").prepend(
      el("p", { class: "bad" }, "the registry file on disk was refused: " + (reg.errors || []).join("; ")));
  }
  renderDraining(s.draining);
  renderGrants(s.classes, s.scan);
  renderHoldsWaits(s.holds_and_waits);
  renderQuotas(s.quotas);
  renderShadow(s.shadow);
  renderSaturated(s.saturated);
  renderAudit(s.audit);
}

// One API call with the tab's token: {ok, status, body} or {ok: false, status,
// code, message} (the API's refusal, or `network`).
async function api(path) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: "Bearer " + token } : {};
  try {
    const r = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    let body = null;
    try { body = await r.json(); } catch (_) { body = null; }
    if (r.ok && body) return { ok: true, status: r.status, body };
    return { ok: false, status: r.status, code: body && body.code ? body.code : "http_" + r.status,
      message: body && body.message ? body.message : r.statusText };
  } catch (e) {
    return { ok: false, status: 0, code: "network", message: String(e) };
  }
}

async function load() {
  clearTimeout(timer);
  const [st, hi] = await Promise.all([api("/console/api/state"), api("/console/api/history")]);
  const focus = keepFocus();
  // Every panel is drawn again: keep the reader where they were.
  const [sx, sy] = [window.scrollX, window.scrollY];
  if (st.ok) {
    lastState = st.body;
    lastHistory = hi.ok ? hi.body : null;
    render(st.body);
    if (!hi.ok) fill("plots", el("p", { class: "bad" }, "history: " + hi.code + " (HTTP " + hi.status + ") " + hi.message));
    renderPlots();
    await loadDrill();
  } else {
    lastState = null;
    lastHistory = null;
    renderError(st.status, st.code, st.message);
  }
  restoreFocus(focus);
  window.scrollTo(sx, sy);
  timer = setTimeout(load, REFRESH_MS);
}

document.getElementById("signin").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("token");
  const t = input.value.trim();
  input.value = "";
  if (t) sessionStorage.setItem(TOKEN_KEY, t);
  load();
});
document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  load();
});

takeTokenFromFragment();
load();
