// relayrl view: polls the JSON API next to this page and draws sessions, one episode, curves.
// Plain DOM + canvas, no libraries; every string from the API goes in through textContent.
"use strict";

const POLL_MS = 2000;
const CHARTS = [
  { title: "reward", keys: ["reward_mean", "eval_reward"] },
  { title: "loss", keys: ["loss"] },
  { title: "KL", keys: ["approx_kl", "ref_kl"] },
  { title: "tool-call rate", keys: ["tool_call_rate", "parse_failure_rate"] },
];
const COLORS = ["#1565c0", "#e65100", "#2e7d32", "#6a1b9a"];
let selected = null;
let lastSessionsJson = "";
let lastMetricsLen = -1;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "title") e.title = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmt(x, digits = 3) {
  return x === null || x === undefined ? "–" : Number(x).toFixed(digits);
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  if (!r.ok) throw new Error(url + ": HTTP " + r.status);
  return r.json();
}

function filterQuery() {
  const params = new URLSearchParams();
  for (const input of document.querySelectorAll("#filters [name]")) {
    if (input.value !== "") params.set(input.name, input.value);
  }
  return params.toString();
}

function fillSelect(name, values) {
  const sel = document.querySelector(`#filters [name=${name}]`);
  const keep = sel.value;
  const have = new Set([...sel.options].map((o) => o.value));
  const want = name === "abort_reason" ? ["none", ...values] : values;
  for (const v of want) if (!have.has(v)) sel.append(el("option", { value: v }, v));
  sel.value = keep;
}

async function refreshSessions() {
  const data = await getJSON("api/sessions?" + filterQuery());
  const text = JSON.stringify(data);
  if (text === lastSessionsJson) return;
  lastSessionsJson = text;
  fillSelect("state", data.facets.state);
  fillSelect("abort_reason", data.facets.abort_reason);
  fillSelect("branch_reason", data.facets.branch_reason);
  document.getElementById("count").textContent = `${data.matched} of ${data.total}`;
  const body = document.querySelector("#sessions tbody");
  body.replaceChildren();
  for (const s of data.sessions) {
    const tr = el("tr", { "data-session": s.id },
      el("td", { class: "sid", title: s.id }, s.id),
      el("td", {}, s.state),
      el("td", {}, fmt(s.reward, 2)),
      el("td", {}, s.calls),
      el("td", {}, s.segments),
      el("td", {}, s.tool_calls),
      el("td", {}, s.abort_reason || ""),
      el("td", {}, s.branch_reasons.join(" ")));
    if (s.id === selected) tr.classList.add("selected");
    tr.addEventListener("click", () => showEpisode(s.id));
    body.append(tr);
  }
}

// Shade a trained token by its probability: green when the policy was sure, red when not.
function shade(logprob) {
  const p = Math.exp(Math.max(-20, Math.min(0, logprob)));
  return `hsl(${Math.round(120 * p)} 60% 80%)`;
}

function segLink(id) {
  return el("a", { href: "#seg-" + id, class: "seglink" }, id);
}

// Segments and what each continues: a compaction's summary call, a sub-agent's spawning call.
function renderSegments(segments) {
  const list = el("ul", { class: "segments" });
  for (const g of segments) {
    const li = el("li", {}, segLink(g.id), ` · ${g.reason} · ${g.calls} calls`);
    if (g.parent_segment_id) {
      li.append(" · continues ", segLink(g.parent_segment_id), ` from call ${g.parent_call_id}`);
      if (g.link_rule) li.append(` (rule ${g.link_rule})`);
    }
    list.append(li);
  }
  return list;
}

function renderRow(row) {
  const box = el("div", { class: "row", id: "seg-" + row.segment_id });
  const trained = row.tokens.filter((t) => t[1]).length;
  const head = el("div", { class: "head" },
    `segment ${row.segment_id} · opened by ${row.branch_reason || "?"} · reward ${fmt(row.reward)} · ` +
    `${row.tokens.length} tokens, ${trained} trained`);
  if (row.parent_segment_id) head.append(" · continues ", segLink(row.parent_segment_id));
  box.append(head);
  const starts = new Map(row.turns.map((t, i) => [t.start, i]));
  const tokens = el("div", { class: "tokens" });
  let version = null;
  row.tokens.forEach(([text, mask, lp, v], i) => {
    if (starts.has(i)) tokens.append(el("span", { class: "boundary", title: `call ${row.turns[starts.get(i)].id}` }, "▌"));
    if (mask && v !== version) {
      tokens.append(el("span", { class: "vmark", title: `weight version ${v}` }, "v" + v));
      version = v;
    }
    const span = el("span", {
      class: "tok " + (mask ? "trained" : "ctx"),
      title: mask ? `#${i} logprob ${lp} (p=${Math.exp(lp).toFixed(3)}) version ${v}` : `#${i} context`,
    }, text);
    if (mask) span.style.background = shade(lp);
    tokens.append(span);
  });
  box.append(tokens);
  const list = el("ol", { class: "turns" });
  for (const t of row.turns) {
    const li = el("li", {},
      `call ${t.id}: tokens [${t.start}, ${t.end}) · finish ${t.finish_reason} · reward ${fmt(t.reward)}` +
      ` · credited ${fmt(t.credited_reward)}` + (t.branch_reason ? ` · branch ${t.branch_reason}` : ""));
    for (const c of t.tool_calls) li.append(" ", el("span", { class: "toolcall" }, `${c.name}(${c.arguments})`));
    list.append(li);
  }
  box.append(list);
  return box;
}

async function showEpisode(id) {
  selected = id;
  for (const tr of document.querySelectorAll("#sessions tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.session === id);
  }
  const data = await getJSON("api/sessions/" + encodeURIComponent(id));
  const s = data.session;
  document.getElementById("episode-id").textContent =
    `${s.id} · ${s.state} · reward ${fmt(s.reward)} · ${s.calls} calls, ${s.segments} segments, ` +
    `${s.tool_calls} tool calls · versions ${s.versions.join(",")}`;
  const box = document.getElementById("episode");
  box.replaceChildren();
  if (data.note) box.append(el("p", { class: "note" }, data.note));
  if (!data.rows.length) box.append(el("p", {}, "no recorded calls"));
  if (data.segments && data.segments.length > 1) box.append(renderSegments(data.segments));
  for (const row of data.rows) box.append(renderRow(row));
}

function drawChart(canvas, series) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.clearRect(0, 0, w, h);
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) {
    ctx.fillStyle = "#999"; ctx.font = "12px sans-serif"; ctx.fillText("no data yet", 8, h / 2);
    return;
  }
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  const L = 44, R = 6, T = 6, B = 18;
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (w - L - R);
  const Y = (y) => T + (1 - (y - y0) / (y1 - y0)) * (h - T - B);
  ctx.strokeStyle = "#ccc"; ctx.lineWidth = 1;
  ctx.strokeRect(L, T, w - L - R, h - T - B);
  ctx.fillStyle = "#666"; ctx.font = "10px sans-serif";
  ctx.fillText(y1.toPrecision(3), 2, T + 8);
  ctx.fillText(y0.toPrecision(3), 2, h - B);
  ctx.fillText(String(x0), L, h - 4);
  ctx.fillText(String(x1), w - R - 20, h - 4);
  series.forEach((s, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.fillStyle = ctx.strokeStyle; ctx.lineWidth = 1.5;
    ctx.beginPath();
    s.points.forEach(([x, y], j) => (j ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    if (s.points.length < 60) for (const [x, y] of s.points) ctx.fillRect(X(x) - 1.5, Y(y) - 1.5, 3, 3);
  });
}

async function refreshMetrics() {
  const data = await getJSON("api/metrics");
  document.getElementById("metrics-path").textContent = data.path || "(no metrics.jsonl)";
  if (data.records.length === lastMetricsLen) return;
  lastMetricsLen = data.records.length;
  const box = document.getElementById("charts");
  box.replaceChildren();
  for (const spec of CHARTS) {
    const series = spec.keys.map((k) => ({
      key: k,
      points: data.records.filter((r) => typeof r[k] === "number").map((r) => [r.step, r[k]]),
    })).filter((s) => s.points.length);
    const title = el("div", { class: "title" }, spec.title + ": ");
    series.forEach((s, i) => title.append(el("span", { style: `color:${COLORS[i]}` }, s.key + " ")));
    const canvas = el("canvas", { "data-chart": spec.title });
    box.append(el("div", { class: "chart" }, title, canvas));
    drawChart(canvas, series);
  }
}

async function tick() {
  try {
    await Promise.all([refreshSessions(), refreshMetrics()]);
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    document.getElementById("status").textContent = "error: " + e.message;
  }
}

document.getElementById("filters").addEventListener("input", () => { lastSessionsJson = ""; tick(); });
tick();
setInterval(tick, POLL_MS);
