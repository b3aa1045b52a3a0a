// lockmesh console: renders /console/api/state. Read-only; no framework.
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
  for (const id of ["seal", "clusters", "quorum", "classes", "draining", "grants", "holdwaits", "quotas", "saturated",
    "audit"]) {
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
      el("td", { class: "name" }, c.name), el("td", { class: "num open" }, c.open_grants),
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
    ["saturated keys", "num"], ["cluster"]], rows), note);
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

async function load() {
  clearTimeout(timer);
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: "Bearer " + token } : {};
  try {
    const r = await fetch("/console/api/state", { headers, cache: "no-store", credentials: "omit" });
    let body = null;
    try { body = await r.json(); } catch (_) { body = null; }
    if (r.ok && body) render(body);
    else renderError(r.status, body && body.code ? body.code : "http_" + r.status,
      body && body.message ? body.message : r.statusText);
  } catch (e) {
    renderError(0, "network", String(e));
  }
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
