"use strict";
// A token, when the endpoint needs one, comes in the address: #token=...
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const auth = token ? { Authorization: "Bearer " + token } : {};
let last = null;

async function getJson(path, init) {
  const r = await fetch(path, Object.assign({ headers: auth }, init || {}));
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.status);
  return body;
}

function set(id, value) { document.getElementById(id).textContent = value; }

// Everything from the server is put in as text or as attribute values,
// never parsed as HTML: a key or a reason is whatever a producer wrote.
function el(ns, tag, attrs, text) {
  const e = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

const SVG = "http://www.w3.org/2000/svg";

function drawTimeline(t) {
  const svg = document.getElementById("timeline");
  const w = 760, h = 180, pad = 24, bars = t.jobs.length - 1;
  const max = Math.max(1, ...t.jobs.slice(0, bars));
  const bw = (w - 2 * pad) / bars;
  const out = [];
  for (let i = 0; i < bars; i++) {
    const n = Number(t.jobs[i]), bh = Math.round((h - 2 * pad) * n / max);
    const from = new Date(t.from_ms + i * t.step_ms).toISOString().slice(11, 16);
    const bar = el(SVG, "rect", { class: "bar", "data-jobs": n, x: pad + i * bw + 1, y: h - pad - bh, width: bw - 2, height: bh, fill: "#4a7bd0" });
    bar.appendChild(el(SVG, "title", {}, `${from} UTC: ${n} jobs`));
    out.push(bar);
    if (i % 4 === 0) out.push(el(SVG, "text", { x: pad + i * bw, y: h - 6, "font-size": 10, fill: "#667" }, from));
  }
  out.push(el(SVG, "text", { x: pad, y: 14, "font-size": 11, fill: "#667" }, `max ${max} per bar`));
  svg.replaceChildren(...out);
  set("later", `${t.jobs[bars]} more due after 12 hours.`);
}

async function refresh() {
  try {
    const s = await getJson("/status");
    set("who", `instance ${s.instance_id || "(dynamic member)"} · partitions ${s.stats.owned.join(", ") || "none"} · ${s.ready ? "ready" : "not ready"}`);
    set("pending", s.stats.pending);
    set("due-now", s.pending_by_due.now);
    set("fired", s.stats.fired);
    const now = Date.now();
    if (last) set("rate", ((s.stats.fired - last.fired) * 1000 / Math.max(1, now - last.at)).toFixed(1));
    last = { fired: s.stats.fired, at: now };
    set("late-p50", s.fire_lateness_ms.p50_at_most ?? "–");
    set("late-p99", s.fire_lateness_ms.p99_at_most ?? "–");
    drawTimeline(s.due_timeline);
    const fair = Object.entries(s.fair || {});
    set("tenants", fair.length === 0
      ? "No fair topics: jobs are released in run-at order, not per tenant."
      : fair.map(([topic, f]) => `${topic}: ${f.tenants_waiting} tenants waiting, ${f.backlog ?? "–"} jobs released and not yet done`).join(" · "));
    document.body.dataset.loaded = "status";
  } catch (e) {
    set("who", "cannot read /status: " + e.message);
  }
}

async function refreshDead() {
  try {
    const d = await getJson("/dlq");
    set("dead", d.total);
    const rows = d.entries.slice(-50).reverse().map(e => {
      const tr = el(null, "tr");
      for (const cell of [e.job_id ?? "–", e.key ?? "–", e.attempt ?? "–",
        `${e.origin_topic}[${e.origin_partition}]@${e.origin_offset}`, e.reason]) {
        tr.appendChild(el(null, "td", {}, cell));
      }
      return tr;
    });
    document.getElementById("dead-rows").replaceChildren(...rows);
    document.body.dataset.dead = String(d.total);
  } catch (e) {
    set("dead", "?");
  }
}

async function refreshSchedules() {
  try {
    const s = await getJson("/schedules");
    set("schedules", s.held === 0 ? "No recurring schedule runs here." :
      `${s.held} recurring schedules run here (partitions ${s.partitions.join(", ")}); the first ${s.shown} by partition and id:`);
    const rows = s.schedules.map(r => {
      const tr = el(null, "tr");
      const when = r.cron ? `cron ${r.cron} (${r.time_zone})` : `every ${r.every}`;
      const paused = r.paused ? "paused" + (r.note ? ": " + r.note : "") : "";
      for (const cell of [r.id, when, r.next ?? "–", r.last ?? "–", r.late, r.dropped, paused]) {
        tr.appendChild(el(null, "td", {}, cell));
      }
      return tr;
    });
    document.getElementById("schedule-rows").replaceChildren(...rows);
    document.body.dataset.schedules = String(s.shown);
  } catch (e) {
    set("schedules", "cannot read /schedules: " + e.message);
  }
}

document.getElementById("replay").addEventListener("click", async () => {
  const b = document.getElementById("replay");
  b.disabled = true;
  set("replay-result", "replaying…");
  try {
    const r = await getJson("/dlq/replay", { method: "POST", headers: Object.assign({ "x-kairos-action": "replay" }, auth) });
    set("replay-result", `replayed ${r.replayed} of ${r.matched} dead letters written since the last replay ` +
      `(${r.not_jobs} carry no job; ${r.earlier_not_read} earlier ones not replayed again)`);
    document.body.dataset.replayed = String(r.replayed);
  } catch (e) {
    set("replay-result", "replay failed: " + e.message);
    document.getElementById("replay-result").className = "bad";
  }
  b.disabled = false;
});

refresh(); refreshDead(); refreshSchedules();
setInterval(refresh, 2000);
setInterval(refreshSchedules, 5000);
setInterval(refreshDead, 10000);
