// coevo dashboard: hand-written, no dependencies. Pages are rendered from /api/* JSON; curves are SVG
// and update live from the server-sent event stream /api/stream.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#2b6cb0", "#c05621", "#2f855a", "#9b2c2c", "#6b46c1", "#b7791f", "#2c7a7b", "#97266d"];
const NOISY = new Set(["success_train", "reward_mean", "judge_process_accuracy", "judge_outcome_accuracy",
  "judge_consistency"]);
const FRACTION_UNITS = new Set(["fraction won", "accuracy", "fraction"]);
const S = { meta: null, series: new Map(), state: null, dirty: false, lastState: 0 };

// ---- small helpers ---------------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v !== null && v !== undefined && v !== false) node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function s(tag, attrs) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function fmtT(sec) {
  sec = Math.max(0, Math.round(sec));
  const hh = Math.floor(sec / 3600), mm = Math.floor((sec % 3600) / 60), ss = sec % 60;
  const two = (x) => String(x).padStart(2, "0");
  return hh ? `${hh}:${two(mm)}:${two(ss)}` : `${mm}:${two(ss)}`;
}

function fmtN(v) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a >= 1000) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  if (a >= 0.01 || a === 0) return v.toFixed(3);
  return v.toExponential(2);
}

function pct(v) { return v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`; }

async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: ${r.status} ${await r.text()}`);
  return r.json();
}

function table(headers, rows, cls) {
  return h("table", { class: cls || "" },
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows.map((r) => h("tr", {}, r.map((c) => h("td", {}, c))))));
}

function link(href, text) { return h("a", { href }, text); }
function short(id) { return id && id.length > 22 ? id.slice(0, 10) + "…" + id.slice(-8) : id; }
function knobs(k) { return Object.entries(k || {}).map(([a, b]) => `${a}=${b}`).join(" "); }

// ---- charts ----------------------------------------------------------------------------------

function niceTicks(lo, hi, n) {
  const span = hi - lo || 1;
  const step0 = span / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((x) => x >= step0) || step0;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(+v.toFixed(10));
  return out;
}

const TIME_STEPS = [1, 2, 5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400];

function timeTicks(lo, hi, n) {
  const step = TIME_STEPS.find((x) => (hi - lo) / x <= n) || TIME_STEPS[TIME_STEPS.length - 1];
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(v);
  return out;
}

function ema(points, alpha) {
  let m = null;
  return points.map(([t, v]) => { m = m === null ? v : m + alpha * (v - m); return [t, m]; });
}

function seriesLabel(series, multiName) {
  const labels = Object.values(series.labels || {}).join(" ");
  return [multiName ? series.name : "", labels].filter(Boolean).join(" ") || series.name;
}

function isSmoothed(sr) { return NOISY.has(sr.name) && sr.points.length > 8; }

function latest(sr) {
  // a smoothed series shows its moving average (≈), others their last value
  return isSmoothed(sr) ? "≈" + fmtN(ema(sr.points, 0.15).at(-1)[1]) : fmtN(sr.points[sr.points.length - 1][1]);
}

function lineChart(svg, list, unit) {
  const W = 460, H = 210, L = 50, R = 10, T = 10, B = 26;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  let tMin = Infinity, tMax = -Infinity, vMin = Infinity, vMax = -Infinity;
  for (const sr of list) for (const [t, v] of sr.points) {
    tMin = Math.min(tMin, t); tMax = Math.max(tMax, t); vMin = Math.min(vMin, v); vMax = Math.max(vMax, v);
  }
  if (FRACTION_UNITS.has(unit)) { vMin = Math.min(0, vMin); vMax = Math.max(1, vMax); }
  if (vMax - vMin < 1e-9) { vMin -= 0.5; vMax += 0.5; }
  if (tMax - tMin < 1e-9) { tMax = tMin + 1; }
  const pad = (vMax - vMin) * 0.05;
  vMin -= FRACTION_UNITS.has(unit) ? 0 : pad; vMax += FRACTION_UNITS.has(unit) ? 0 : pad;
  const x = (t) => L + ((t - tMin) / (tMax - tMin)) * (W - L - R);
  const y = (v) => T + (1 - (v - vMin) / (vMax - vMin)) * (H - T - B);
  const axes = s("g", { class: "axes" });
  for (const v of niceTicks(vMin, vMax, 4)) {
    axes.append(s("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    const lab = s("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" }); lab.textContent = fmtN(v); axes.append(lab);
  }
  for (const t of timeTicks(tMin, tMax, 6)) {
    const lab = s("text", { x: x(t), y: H - 8, "text-anchor": "middle" }); lab.textContent = fmtT(t); axes.append(lab);
  }
  svg.append(axes);
  list.forEach((sr, i) => {
    const color = COLORS[i % COLORS.length];
    const g = s("g", { class: "series", "data-key": sr.key });
    const smooth = isSmoothed(sr);
    const line = smooth ? ema(sr.points, 0.15) : sr.points;
    const r = smooth ? 1.6 : sr.points.length > 120 ? 1.3 : 2.2;
    g.append(s("polyline", { class: "line", stroke: color, points: line.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ") }));
    for (const [t, v] of sr.points.slice(-400)) {
      g.append(s("circle", { class: smooth ? "pt faint" : "pt", cx: x(t).toFixed(1), cy: y(v).toFixed(1), r, fill: color }));
    }
    svg.append(g);
  });
}

function barChart(svg, list) {
  const W = 460, H = 210, L = 50, B = 26, T = 10;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const bars = list.map((sr) => ({ label: seriesLabel(sr, false), v: sr.points[sr.points.length - 1][1], key: sr.key }))
    .sort((a, b) => a.label.localeCompare(b.label, undefined, { numeric: true }));
  const vMax = Math.max(1, ...bars.map((b) => b.v));
  const bw = (W - L - 10) / Math.max(1, bars.length);
  bars.forEach((b, i) => {
    const hgt = (b.v / vMax) * (H - T - B);
    const g = s("g", { class: "series", "data-key": b.key });
    g.append(s("rect", { class: "pt bar", x: L + i * bw + 2, y: H - B - hgt, width: Math.max(1, bw - 4), height: hgt, fill: COLORS[0] }));
    const lab = s("text", { x: L + i * bw + bw / 2, y: H - 8, "text-anchor": "middle" }); lab.textContent = b.label;
    g.append(lab);
    svg.append(g);
  });
  const top = s("text", { x: L - 4, y: T + 8, "text-anchor": "end" }); top.textContent = fmtN(vMax); svg.append(top);
}

function drawChart(fig) {
  const id = fig.dataset.chart, chart = S.meta.charts[id];
  const list = [...S.series.entries()].map(([key, sr]) => ({ key, ...sr }))
    .filter((sr) => S.meta.specs[sr.name] && S.meta.specs[sr.name].chart === id && sr.points.length)
    .sort((a, b) => a.key.localeCompare(b.key));
  const svg = s("svg", { class: "plot", role: "img", "aria-label": chart.title });
  const names = new Set(list.map((sr) => sr.name));
  const total = list.reduce((n, sr) => n + sr.points.length, 0);
  fig.dataset.points = String(total);
  fig.classList.toggle("empty", total === 0);
  if (total === 0) {
    const msg = s("text", { x: 230, y: 105, "text-anchor": "middle", class: "nodata" }); msg.textContent = "no data yet";
    svg.setAttribute("viewBox", "0 0 460 210"); svg.append(msg);
  } else if (id === "staleness_hist") barChart(svg, list);
  else lineChart(svg, list, chart.unit);
  const legend = h("div", { class: "legend" }, list.map((sr, i) => h("span", { class: "key" },
    h("i", { style: `background:${COLORS[i % COLORS.length]}` }), seriesLabel(sr, names.size > 1),
    h("b", {}, latest(sr)))));
  fig.querySelector("svg")?.replaceWith(svg);
  fig.querySelector(".legend")?.replaceWith(legend);
}

function renderCurves(root) {
  const grid = h("div", { class: "grid", id: "charts" });
  for (const [id, chart] of Object.entries(S.meta.charts)) {
    const spec = Object.entries(S.meta.specs).filter(([, sp]) => sp.chart === id).map(([n, sp]) => `${n}: ${sp.help}`).join("\n");
    grid.append(h("figure", { class: "chart", "data-chart": id },
      h("figcaption", { title: spec }, chart.title, h("span", { class: "unit" }, ` [${chart.unit}]`)),
      s("svg", {}), h("div", { class: "legend" })));
  }
  root.replaceChildren(h("p", { class: "muted" }, "x axis: run time (m:ss). Noisy per-group series are drawn as dots with their moving average. Hover a title for what each series means."), grid);
  grid.querySelectorAll("figure.chart").forEach(drawChart);
}

function redraw() {
  if (!S.dirty) return;
  S.dirty = false;
  document.querySelectorAll("figure.chart").forEach(drawChart);
}

// ---- headline and state pages ----------------------------------------------------------------

function renderHeadline() {
  const st = S.state; if (!st) return;
  const sm = st.summary || {};
  const item = (label, value) => h("span", { class: "kv" }, h("small", {}, label), h("b", {}, value));
  const arrow = (a, b) => (a === null || a === undefined) ? "–" : `${pct(a)} → ${pct(b)}`;
  document.getElementById("headline").replaceChildren(
    item("policy success, train (first → last fifth of groups)", arrow(sm.policy_success_start, sm.policy_success_end)),
    item("held-out success (first → last round)", arrow(sm.heldout_success_start, sm.heldout_success_end)),
    item("judge process accuracy (first → last quarter)", arrow(sm.judge_process_accuracy_start, sm.judge_process_accuracy)),
    item("learner steps (policy / judge)", `${sm.learner_steps ?? 0} / ${sm.judge_learner_steps ?? 0}`),
    item("rewrites (accepted / proposed)", `${sm.rewrites_accepted ?? 0} / ${sm.rewrites_proposed ?? 0}`),
    item("trajectories", String((sm.events || {})["trajectory.completed"] || 0)));
  const status = document.getElementById("status");
  status.textContent = `run ${st.run_id || "?"} · ${fmtT(st.t || 0)} · ${st.finished ? "finished" : (st.live ? "live" : "stopped")}`;
  status.className = "status " + (st.finished ? "finished" : st.live ? "live" : "stopped");
}

async function refreshState(force) {
  const now = Date.now();
  if (!force && now - S.lastState < 2000) return;
  S.lastState = now;
  S.state = await api("/api/state");
  renderHeadline();
  const page = document.getElementById("page");
  if (page.dataset.page === "tasks") renderTasks(page);
  if (page.dataset.page === "agents") renderAgents(page);
}

function renderTasks(root) {
  const st = S.state;
  const slots = table(["slot", "split", "active task", "knobs", "difficulty", "last accuracy", "groups", "rewrites accepted / rejected", "candidate under measurement"],
    st.slots.map((x) => [x.slot_id, x.split || "–", x.task_id ? link(`/trace/${encodeURIComponent(x.task_id)}`, short(x.task_id)) : "–",
      knobs(x.knobs), fmtN(x.difficulty), pct(x.accuracy), String(x.groups), `${x.accepted} / ${x.rejected}`,
      x.candidate ? short(x.candidate) : "–"]), "slots");
  const verdict = (r) => r.accepted === true ? h("span", { class: "ok" }, "accepted") :
    r.accepted === false ? h("span", { class: "bad" }, "rejected") : h("span", { class: "muted" }, "measuring");
  const rewrites = table(["time", "slot", "parent → candidate", "direction", "rewriter", "knobs", "verdict", "reason", "accuracy parent → candidate"],
    st.rewrites.map((r) => [fmtT(r.t), r.slot_id, h("span", {}, short(r.parent_id), " → ",
      r.candidate_id ? link(`/trace/${encodeURIComponent(r.candidate_id)}`, short(r.candidate_id)) : "none"),
      r.direction, r.rewriter, r.knobs_after ? `${knobs(r.knobs_before)} → ${knobs(r.knobs_after)}` : "–",
      verdict(r), r.reason || "–", `${pct(r.parent_accuracy)} → ${pct(r.candidate_accuracy)}`]), "rewrites");
  root.replaceChildren(h("h2", {}, `Task slots (${st.slots.length})`), slots,
    h("h2", {}, `Rewrite lineage (${st.rewrites.length}, newest first)`), rewrites);
}

function renderAgents(root) {
  const st = S.state, now = Date.now() / 1000;
  const agents = table(["agent", "role", "state", "uptime", "restarts", "last heartbeat", "detail"],
    st.agents.map((a) => [a.agent_id, a.role, h("span", { class: `state ${a.state}` }, a.state), fmtT(a.uptime_s),
      String(a.restarts), `${fmtN(Math.max(0, now - a.last_seen))} s ago`, a.detail || ""]), "agents");
  const consumers = table(["consumer", "pending (not delivered)", "ack pending", "redelivered", "waiting pulls"],
    st.consumers.map((c) => [c.name, String(c.pending), String(c.ack_pending), String(c.redelivered), String(c.waiting)]), "consumers");
  const dead = table(["time", "consumer", "subject", "reason", "deliveries"],
    st.dead_letters.map((d) => [fmtT(d.t), d.consumer, d.subject, d.reason, String(d.delivery_count)]), "dead");
  root.replaceChildren(h("h2", {}, `Agents (${st.agents.length})`), agents,
    h("h2", {}, "Consumers (JetStream consumer info)"), consumers,
    h("h2", {}, `Dead letters (${st.dead_letters.length})`), st.dead_letters.length ? dead : h("p", { class: "muted" }, "none"));
}

async function renderTrajectories(root) {
  const list = await api("/api/trajectories?limit=400");
  const rows = list.map((t) => [fmtT(t.t), link(`/trajectory/${encodeURIComponent(t.trajectory_id)}`, short(t.trajectory_id)),
    short(t.task_id), t.purpose || "–", h("span", { class: `outcome ${t.outcome}` }, t.outcome), String(t.num_steps),
    pct(t.accuracy), (t.policy_versions || []).map((v) => `v${v}`).join(" "),
    t.learner_version ? `policy step ${t.learner_version}` : "–"]);
  root.replaceChildren(h("h2", {}, `Trajectories (newest ${list.length})`),
    table(["time", "trajectory", "task", "purpose", "outcome", "steps", "group accuracy", "sampled by", "trained by"], rows, "trajectories"));
}

function voteChip(v) {
  const text = v.status !== "ok" ? v.status : v.value > 0 ? "+1" : "−1";
  const cls = v.status !== "ok" ? "err" : v.value > 0 ? "pos" : "neg";
  return h("span", { class: `vote ${cls}`, title: v.rationale || "no rationale" }, text);
}

function renderLineage(lineage) {
  if (!lineage || !lineage.length) return h("p", { class: "muted" }, "an initial task (no rewrite lineage)");
  return h("ol", { class: "lineage" }, lineage.map((l) => h("li", {},
    `${short(l.parent_id)} → ${short(l.task_id)} (${l.direction}, ${l.rewriter}): `,
    h("b", { class: l.accepted ? "ok" : l.accepted === false ? "bad" : "muted" }, l.accepted ? "accepted" : l.accepted === false ? "rejected" : "pending"),
    l.reason ? ` — ${l.reason}` : "")));
}

function renderTrajectory(root, t) {
  const steps = t.steps.map((st) => h("tr", { class: "step" },
    h("td", {}, String(st.step)), h("td", { class: "action" }, st.action), h("td", { class: "result" }, st.result),
    h("td", {}, `v${st.policy_version}`), h("td", {}, st.reference_label === null ? "–" : String(st.reference_label)),
    h("td", { class: "votes" }, st.votes.length ? st.votes.map(voteChip) : h("span", { class: "muted" }, "no votes"),
      st.votes.some((v) => v.rationale) ? h("div", { class: "rationales" }, st.votes.filter((v) => v.rationale)
        .map((v) => h("div", { class: "rationale" }, `vote ${voteChip(v).textContent}: ${v.rationale}`))) : null),
    h("td", {}, st.advantage === null || st.advantage === undefined ? "–" : fmtN(st.advantage))));
  const g = t.group, ls = t.learner_step, w = t.weights;
  root.replaceChildren(
    h("h2", {}, "Trajectory ", h("code", {}, t.trajectory_id), " ", h("span", { class: `outcome ${t.outcome}` }, t.outcome)),
    h("p", {}, "task ", link(`/trace/${encodeURIComponent(t.task_id)}`, t.task_id),
      g ? ` · scored in ${g.group_id} (${g.purpose}): group accuracy ${pct(g.accuracy)}${g.flagged ? ` · flagged: ${g.flagged}` : ""}` : " · not scored yet"),
    h("h3", {}, "Rewrite lineage"), renderLineage(t.lineage),
    h("h3", {}, "Steps, votes and advantages"),
    t.steps.some((st) => st.votes.some((v) => v.rationale)) ? null : h("p", { class: "muted" },
      "no vote rationales: a judge in 'verdict' mode votes with one token (judge.mode = 'reasoned' writes them)"),
    h("table", { class: "steps" }, h("thead", {}, h("tr", {}, ["#", "action", "result", "policy version", "reference label", "judge votes (rationales below)", "advantage"].map((x) => h("th", {}, x)))),
      h("tbody", {}, steps)),
    h("h3", {}, "Training"),
    ls ? h("p", { class: "trained" }, `trained by policy learner step ${ls.version} (produced weights v${ls.version}, loss ${fmtN(ls.loss)})`)
      : h("p", { class: "muted" }, "not trained (yet): held-out, flagged, out of band, or still queued"),
    w && w.applied.length ? table(["server", "applied", "pause"], w.applied.map((a) => [a.server, a.ok ? "ok" : "FAILED", `${fmtN(a.pause_ms)} ms`]), "applied") : null);
}

function renderTrace(root, t) {
  if (t.kind === "trajectory" || t.kind === "step") return renderTrajectory(root, t);
  if (t.kind === "task") {
    return root.replaceChildren(h("h2", {}, "Task ", h("code", {}, t.task_id)), h("h3", {}, "Rewrite lineage"), renderLineage(t.lineage),
      h("h3", {}, `Groups (${t.groups.length})`), table(["group", "purpose", "accuracy"], t.groups.map((g) => [g.group_id, g.purpose, pct(g.accuracy)])),
      h("h3", {}, `Trajectories (${t.trajectories.length})`), h("ul", {}, t.trajectories.slice(-50).map((id) => h("li", {}, link(`/trajectory/${encodeURIComponent(id)}`, id)))));
  }
  root.replaceChildren(h("h2", {}, `Weights ${t.role} v${t.version}`), h("pre", {}, JSON.stringify(t, null, 2)));
}

// ---- routing and the live stream -------------------------------------------------------------

async function route() {
  const page = document.getElementById("page"), path = decodeURIComponent(location.pathname);
  const name = path === "/" ? "curves" : path.split("/")[1];
  page.dataset.page = name;
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === name || (name === "trajectory" && a.dataset.nav === "trajectories")));
  try {
    await refreshState(true);
    if (name === "curves") renderCurves(page);
    else if (name === "tasks") renderTasks(page);
    else if (name === "agents") renderAgents(page);
    else if (name === "trajectories") await renderTrajectories(page);
    else if (name === "trajectory" || name === "trace") {
      const ident = path.split("/").slice(2).join("/");
      renderTrace(page, await api(`/api/trace/${encodeURIComponent(ident)}`));
    }
    page.dataset.ready = "1";
  } catch (err) {
    page.replaceChildren(h("p", { class: "bad" }, String(err)));
    page.dataset.ready = "error";
  }
}

function connect() {
  const es = new EventSource("/api/stream");
  es.addEventListener("points", (m) => {
    for (const [key, name, labels, t, v] of JSON.parse(m.data)) {
      let sr = S.series.get(key);
      if (!sr) { sr = { name, labels, points: [] }; S.series.set(key, sr); }
      sr.points.push([t, v]);
      if (sr.points.length > 4000) sr.points = sr.points.filter((_, i) => i % 2 === 0);
    }
    S.dirty = true;
  });
  es.addEventListener("tick", () => { refreshState(false).catch(() => {}); });
  es.addEventListener("reload", () => { es.close(); boot(); });
  es.onerror = () => { document.getElementById("status").textContent = "disconnected (retrying…)"; };
}

async function boot() {
  S.meta = await api("/api/series");
  S.series = new Map(Object.entries(S.meta.series));
  await route();
}

boot().then(connect);
setInterval(redraw, 1000);
