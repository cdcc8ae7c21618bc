// rlctl report: the curves of one or more runs and a rollout browser, drawn from the JSON embedded in the page.
// No network: everything this page shows is in the element #rlctl-data.
"use strict";
const D = JSON.parse(document.getElementById("rlctl-data").textContent);
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const state = { smooth: D.smooth, lo: null, hi: null };
const el = (tag, attrs = {}, text) => {
  const e = tag.startsWith("svg:") ? document.createElementNS("http://www.w3.org/2000/svg", tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
};
const finite = (v) => typeof v === "number" && isFinite(v);
const fmt = (v) => (v === null || v === undefined ? "-" : !finite(v) ? String(v) : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(3) : +v.toPrecision(4) + "");

const tick = (v) => (v !== 0 && (Math.abs(v) >= 1e4 || Math.abs(v) < 1e-2) ? v.toExponential(1) : +v.toPrecision(3) + "");
function ema(ys, w) {  // TensorBoard's debiased EMA; non-finite values are skipped
  let acc = 0, norm = 0;
  return ys.map((v) => { if (finite(v)) { acc = acc * w + (1 - w) * v; norm = norm * w + (1 - w); } return norm ? acc / norm : null; });
}

function series(run, chart) {  // [{x, y}] of one metric of one run (y null where the value was NaN/inf)
  const recs = chart.kind === "eval" ? run.evals : run.train;
  return recs.filter((r) => chart.key in r && (typeof r[chart.key] === "number" || r[chart.key] === null)).map((r) => ({ x: r.step, y: r[chart.key] }));
}

function header() {
  const h = document.querySelector("header");
  h.append(el("h1", {}, D.title));
  const legend = el("div", { class: "legend" });
  D.runs.forEach((r, i) => { const s = el("span"); s.append(el("i", { style: `background:${COLORS[i % COLORS.length]}` }), document.createTextNode(`${r.name} (${r.method})`)); legend.append(s); });
  h.append(legend);
  const lab = el("label", {}, "smoothing ");
  const slider = el("input", { type: "range", min: "0", max: "0.99", step: "0.01", value: String(state.smooth), id: "smooth" });
  const val = el("span", { id: "smooth-value" }, String(state.smooth));
  slider.addEventListener("input", () => { state.smooth = +slider.value; val.textContent = slider.value; drawAll(); });
  lab.append(slider, val);
  const reset = el("button", { id: "reset-zoom" }, "reset zoom");
  reset.addEventListener("click", () => { state.lo = state.hi = null; drawAll(); });
  h.append(lab, reset, el("span", { class: "muted", style: "color:#bbb" }, "drag on a chart to zoom, double-click to reset"));
}

function summaryTable(main) {
  main.append(el("h2", {}, "summary"));
  const t = el("table", { class: "summary" });
  const rows = [["run", (s) => s.run], ["status", (s) => s.status], ["steps", (s) => `${s.steps}${s.total_steps ? " of " + s.total_steps : ""}`],
    ["time", (s) => (finite(s.time_s) ? s.time_s.toFixed(1) + " s" : "-")], ["tokens/s", (s) => fmt(s.tokens_per_s)],
    ["metric", (s) => `${s.metric}: first ${fmt(s.first)}, last ${fmt(s.last)}, best ${fmt(s.best)}${s.best_step ? " at step " + s.best_step : ""}`],
    ["last eval", (s) => (s.evals.length ? Object.entries(s.evals[s.evals.length - 1]).filter(([k]) => !k.startsWith("time")).map(([k, v]) => `${k} ${fmt(v)}`).join(", ") : "none")]];
  for (const [name, f] of rows) {
    const tr = el("tr"); tr.append(el("th", {}, name));
    D.runs.forEach((r) => tr.append(el("td", {}, f(r.summary))));
    t.append(tr);
  }
  main.append(t);
}

const charts = [];
function buildCharts(main) {
  let section = null, grid = null;
  for (const c of D.charts) {
    if (c.section !== section) { section = c.section; main.append(el("h2", {}, section)); grid = el("div", { class: "grid" }); main.append(grid); }
    const box = el("div", { class: "chart", "data-metric": c.key, "data-kind": c.kind });
    box.append(el("div", { class: "title" }, c.kind === "eval" ? `eval: ${c.key}` : c.key));
    const svg = el("svg:svg", { viewBox: "0 0 340 180", preserveAspectRatio: "none" });
    const readout = el("div", { class: "readout" });
    box.append(svg, readout); grid.append(box);
    const chart = { ...c, svg, readout, lines: D.runs.map((r) => series(r, c)) };
    charts.push(chart); zoomable(chart);
  }
}

const M = { l: 44, r: 8, t: 6, b: 18, w: 340, h: 180 };
function scales(chart) {
  const all = chart.lines.flat();
  const xs = all.map((p) => p.x);
  const x0 = state.lo ?? Math.min(...xs), x1 = state.hi ?? Math.max(...xs);
  const ys = all.filter((p) => p.x >= x0 && p.x <= x1 && finite(p.y)).map((p) => p.y);
  let y0 = ys.length ? Math.min(...ys) : 0, y1 = ys.length ? Math.max(...ys) : 1;
  if (y0 === y1) { y0 -= Math.abs(y0) * 0.05 || 0.5; y1 += Math.abs(y1) * 0.05 || 0.5; }
  const sx = (x) => M.l + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (M.w - M.l - M.r);
  const sy = (y) => M.t + (1 - (y - y0) / (y1 - y0)) * (M.h - M.t - M.b);
  return { x0, x1, y0, y1, sx, sy };
}

function pathOf(points, s) {  // "M..L.." with a break at every null
  let d = "", pen = false;
  for (const p of points) {
    if (!finite(p.y) || p.x < s.x0 || p.x > s.x1) { pen = false; continue; }
    d += `${pen ? "L" : "M"}${s.sx(p.x).toFixed(1)},${s.sy(p.y).toFixed(1)}`; pen = true;
  }
  return d;
}

function axes(svg, s) {
  const g = el("svg:g", { class: "axis" });
  for (let i = 0; i <= 3; i++) {
    const y = s.y0 + ((s.y1 - s.y0) * i) / 3;
    g.append(el("svg:line", { x1: M.l, x2: M.w - M.r, y1: s.sy(y), y2: s.sy(y) }), el("svg:text", { x: M.l - 3, y: s.sy(y) + 3, "text-anchor": "end" }, tick(y)));
  }
  const raw = Math.max(1, (s.x1 - s.x0) / 6), mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((v) => v >= raw);  // 1, 2, 5 x 10^k: integer steps only
  for (let x = Math.ceil(s.x0 / step) * step; x <= s.x1; x += step) g.append(el("svg:text", { x: s.sx(x), y: M.h - 4, "text-anchor": "middle" }, String(x)));
  svg.append(g);
}

function draw(chart) {
  const svg = chart.svg; svg.replaceChildren();
  const s = scales(chart); chart.s = s; axes(svg, s);
  chart.lines.forEach((pts, i) => {
    const color = COLORS[i % COLORS.length], run = D.runs[i].name;
    const n = pts.filter((p) => finite(p.y)).length;
    if (chart.kind === "eval" || pts.length === 1) {
      const g = el("svg:g", { class: "points", "data-run": run, "data-points": n });
      g.append(el("svg:path", { d: pathOf(pts, s), stroke: color, "stroke-opacity": 0.5, fill: "none" }));
      pts.filter((p) => finite(p.y) && p.x >= s.x0 && p.x <= s.x1).forEach((p) => g.append(el("svg:circle", { cx: s.sx(p.x), cy: s.sy(p.y), r: 3, fill: color })));
      svg.append(g); return;
    }
    svg.append(el("svg:path", { class: "raw", d: pathOf(pts, s), stroke: color, "stroke-opacity": state.smooth ? 0.25 : 1, fill: "none", "stroke-width": 1, "data-run": run, "data-points": n }));
    if (state.smooth) {
      const sm = ema(pts.map((p) => p.y), state.smooth).map((y, j) => ({ x: pts[j].x, y }));
      svg.append(el("svg:path", { class: "smoothed", d: pathOf(sm, s), stroke: color, fill: "none", "stroke-width": 1.8, "data-run": run }));
    }
  });
  chart.cursor = el("svg:line", { y1: M.t, y2: M.h - M.b, stroke: "#999", "stroke-dasharray": "2,2", visibility: "hidden" });
  chart.band = el("svg:rect", { y: M.t, height: M.h - M.t - M.b, fill: "#3b7dd8", "fill-opacity": 0.15, visibility: "hidden" });
  svg.append(chart.cursor, chart.band);
}
function drawAll() { charts.forEach(draw); }

function stepAt(chart, ev) {  // the step under the mouse
  const r = chart.svg.getBoundingClientRect();
  const px = ((ev.clientX - r.left) / r.width) * M.w, s = chart.s;
  return s.x0 + ((px - M.l) / (M.w - M.l - M.r)) * (s.x1 - s.x0);
}
function zoomable(chart) {
  let from = null;
  chart.svg.addEventListener("mousedown", (ev) => { from = stepAt(chart, ev); });
  chart.svg.addEventListener("mousemove", (ev) => {
    const x = stepAt(chart, ev), s = chart.s;
    chart.cursor.setAttribute("x1", s.sx(x)); chart.cursor.setAttribute("x2", s.sx(x)); chart.cursor.setAttribute("visibility", "visible");
    chart.readout.textContent = chart.lines.map((pts, i) => {
      const near = pts.reduce((b, p) => (b === null || Math.abs(p.x - x) < Math.abs(b.x - x) ? p : b), null);
      return near ? `${D.runs.length > 1 ? D.runs[i].name + " " : ""}step ${near.x}: ${fmt(near.y)}` : "";
    }).filter(Boolean).join("  |  ");
    if (from !== null) {
      const a = s.sx(Math.min(from, x)), b = s.sx(Math.max(from, x));
      chart.band.setAttribute("x", a); chart.band.setAttribute("width", b - a); chart.band.setAttribute("visibility", "visible");
    }
  });
  chart.svg.addEventListener("mouseleave", () => { chart.cursor.setAttribute("visibility", "hidden"); from = null; chart.band.setAttribute("visibility", "hidden"); });
  chart.svg.addEventListener("mouseup", (ev) => {
    const to = stepAt(chart, ev);
    if (from !== null && Math.abs(to - from) >= 1) { state.lo = Math.floor(Math.min(from, to)); state.hi = Math.ceil(Math.max(from, to)); drawAll(); }
    from = null;
  });
  chart.svg.addEventListener("dblclick", () => { state.lo = state.hi = null; drawAll(); });
}

// ---------------------------------------------------------------- the rollout browser
function browser(main) {
  const withSamples = D.runs.map((r, i) => [r, i]).filter(([r]) => r.samples.length);
  main.append(el("h2", {}, "rollouts"));
  const box = el("div", { class: "browser", id: "rollouts" }); main.append(box);
  if (!withSamples.length) { box.append(el("p", { class: "muted" }, "no samples.jsonl in these runs (set --samples-every)")); return; }
  const c = el("div", { class: "controls" });
  const sel = (id, options) => { const s = el("select", { id }); options.forEach(([v, t]) => s.append(el("option", { value: v }, t))); return s; };
  const runSel = sel("run-select", withSamples.map(([r, i]) => [String(i), r.name]));
  const stepSel = el("select", { id: "step-select" });
  const sortSel = sel("sort-select", [["reward-desc", "reward, high first"], ["reward-asc", "reward, low first"], ["advantage-desc", "advantage, high first"], ["advantage-asc", "advantage, low first"]]);
  const finishSel = sel("finish-select", [["any", "any finish"], ["stop", "stopped"], ["length", "truncated"]]);
  const minR = el("input", { id: "min-reward", type: "number", step: "any", placeholder: "min reward", style: "width:90px" });
  const maxR = el("input", { id: "max-reward", type: "number", step: "any", placeholder: "max reward", style: "width:90px" });
  const text = el("input", { id: "text-filter", type: "search", placeholder: "text in prompt or response" });
  const count = el("span", { id: "sample-count", class: "muted" });
  const label = (t, e) => { const l = el("label", {}, t + " "); l.append(e); return l; };
  c.append(label("run", runSel), label("step", stepSel), label("sort", sortSel), finishSel, minR, maxR, text, count);
  const list = el("div", { id: "sample-list" });
  box.append(c, list);
  const fillSteps = () => {
    const run = D.runs[+runSel.value];
    const steps = [...new Set(run.samples.map((s) => s.step))].sort((a, b) => a - b);
    stepSel.replaceChildren(...steps.map((s) => el("option", { value: String(s) }, String(s))));
    stepSel.value = String(steps[steps.length - 1]);
  };
  const show = () => renderSamples(list, count, D.runs[+runSel.value], +stepSel.value, sortSel.value, finishSel.value, minR.value, maxR.value, text.value.toLowerCase());
  runSel.addEventListener("change", () => { fillSteps(); show(); });
  [stepSel, sortSel, finishSel].forEach((e) => e.addEventListener("change", show));
  [minR, maxR, text].forEach((e) => e.addEventListener("input", show));
  fillSteps(); show();
}

const FINISH = { length: "truncated", stop: "stopped" };
const finishOf = (s) => s.finish_reason || (s.truncated ? "length" : "stop");
function renderSamples(list, count, run, step, sort, finish, minR, maxR, text) {
  const [key, dir] = sort.split("-");
  const keep = run.samples.filter((s) => s.step === step
    && (finish === "any" || finishOf(s) === finish)
    && (minR === "" || s.reward >= +minR) && (maxR === "" || s.reward <= +maxR)
    && (!text || (s.prompt + "\n" + s.response + "\n" + JSON.stringify(s.messages || "")).toLowerCase().includes(text)));
  const groups = new Map();
  for (const s of keep) { if (!groups.has(s.prompt)) groups.set(s.prompt, []); groups.get(s.prompt).push(s); }
  const sign = dir === "desc" ? -1 : 1, val = (s) => (finite(s[key]) ? s[key] : -Infinity);
  list.replaceChildren();
  count.textContent = `${keep.length} samples of ${groups.size} prompts at step ${step}`;
  for (const [prompt, samples] of groups) {
    samples.sort((a, b) => sign * (val(a) - val(b)));
    const p = el("div", { class: "prompt", "data-step": String(step) });
    p.append(el("div", { class: "role" }, "prompt"), el("pre", {}, prompt));
    if (samples[0].ground_truth !== null && samples[0].ground_truth !== undefined) p.append(el("div", { class: "truth" }, `ground truth: ${samples[0].ground_truth}`));
    for (const s of samples) p.append(sampleCard(s));
    list.append(p);
  }
}

function sampleCard(s) {
  const d = el("div", { class: "sample", "data-reward": String(s.reward) });
  const bits = [`reward ${fmt(s.reward)}`, `advantage ${fmt(s.advantage)}`, `${s.response_len} tokens`, FINISH[finishOf(s)] || finishOf(s)];
  if (s.turns) bits.push(`${s.turns} turns`);
  d.append(el("div", { class: "meta" }, bits.join(" · ")));
  if (Array.isArray(s.messages) && s.messages.length) {
    for (const m of s.messages) {
      const msg = el("div", { class: `msg ${m.role}` });
      msg.append(el("div", { class: "role" }, m.role + (m.name ? ` (${m.name})` : "") + (m.dropped ? " - dropped: not read by the policy (no room left)" : "")));
      if (m.content) msg.append(el("pre", {}, typeof m.content === "string" ? m.content : JSON.stringify(m.content)));
      for (const call of m.tool_calls || []) msg.append(el("pre", { class: "tool-call" }, `→ ${JSON.stringify(call.function || call)}`));
      d.append(msg);
    }
  } else d.append(el("pre", {}, s.response));
  return d;
}

const main = document.querySelector("main");
header(); summaryTable(main); buildCharts(main); drawAll(); browser(main);
document.body.setAttribute("data-ready", "1");
