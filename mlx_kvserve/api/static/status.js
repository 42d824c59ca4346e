// The status page: reads /v1/status once, then follows /v1/status/events (server-sent events,
// read with fetch so the API key can travel in the Authorization header, which EventSource
// cannot send). Every figure is written as text and, raw, in the element's data-value.
"use strict";

const KEY = "mlx-kvserve-api-key";
const $ = (sel) => document.querySelector(sel);
let charts = null;

function headers() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: "Bearer " + key } : {};
}

function get(obj, path) {
  return path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);
}

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}

function fmtSeconds(s) {
  if (s == null) return "–";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function format(value, how) {
  if (value == null) return "–";
  if (how === "bytes") return fmtBytes(value);
  if (how === "seconds") return fmtSeconds(value);
  if (how === "percent") return (100 * value).toFixed(1) + " %";
  if (how === "ratio") return value.toFixed(2);
  if (typeof value === "number") return value.toLocaleString("en-US");
  return String(value);
}

function cell(row, text, value) {
  const td = document.createElement("td");
  td.textContent = text;
  if (value !== undefined) td.dataset.value = String(value);
  row.appendChild(td);
  return td;
}

function fillTable(id, items, fill) {
  const body = $(id + " tbody");
  body.replaceChildren();
  for (const item of items) {
    const row = document.createElement("tr");
    fill(row, item);
    body.appendChild(row);
  }
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

function render(s) {
  $("#main").hidden = false;
  $("#conn-error").hidden = true;
  const badge = $("#server-status");
  badge.className = "badge " + s.status;
  for (const el of document.querySelectorAll("[data-field]")) {
    const value = get(s, el.dataset.field);
    el.dataset.value = value == null ? "" : String(value);
    el.textContent = el.dataset.field === "uptime_seconds" ? fmtSeconds(value) : format(value, el.dataset.format);
  }
  fillTable("#models", s.models, (row, m) => {
    cell(row, m.id);
    cell(row, m.loaded ? "yes" : m.error ? "failed: " + m.error : "loading", m.loaded);
    cell(row, format(m.context_length), m.context_length);
    cell(row, m.layers || "–");
    cell(row, fmtBytes(m.kv_bytes_per_token), m.kv_bytes_per_token);
    cell(row, (m.aliases || []).join(", "));
  });
  fillTable("#chains", (s.cache && s.cache.chains) || [], (row, c) => {
    cell(row, c.key);
    cell(row, format(c.tokens), c.tokens);
    const td = cell(row, "");
    const bar = document.createElement("div");
    bar.className = "chain";
    for (const link of c.links) {
      const seg = document.createElement("div");
      seg.className = "link " + link.kind;
      seg.title = `${link.tokens} tokens (${link.kind}, ${link.reason})`;
      bar.appendChild(seg);
    }
    // each link's width follows the tokens it adds to the chain
    let before = 0;
    c.links.forEach((link, i) => {
      bar.children[i].style.flexGrow = String(Math.max(1, link.tokens - before));
      before = link.tokens;
    });
    td.appendChild(bar);
    cell(row, fmtBytes(c.bytes), c.bytes);
    cell(row, format(c.hits), c.hits);
    cell(row, clock(c.last_used), c.last_used);
  });
  fillTable("#recent", s.recent, (row, r) => {
    cell(row, clock(r.ended), r.ended);
    cell(row, r.kind);
    cell(row, format(r.prompt_tokens), r.prompt_tokens);
    cell(row, (100 * r.cached_share).toFixed(0) + " %", r.cached_share);
    cell(row, format(r.completion_tokens), r.completion_tokens);
    cell(row, fmtSeconds(r.ttft_seconds), r.ttft_seconds);
    cell(row, r.decode_tps ? r.decode_tps.toFixed(1) + " tok/s" : "–", r.decode_tps);
    cell(row, r.cache_source);
    cell(row, r.finish_reason);
  });
  drawCharts(s.series);
  document.body.dataset.updated = String(s.time);
}

function chart(id, label, color) {
  const el = $(id);
  return new uPlot(
    {
      width: Math.max(260, el.clientWidth),
      height: 200,
      series: [{}, { label, stroke: color, width: 2, spanGaps: true, points: { show: true } }],
      axes: [{}, { size: 50 }],
      legend: { show: false },
    },
    [[], []],
    el,
  );
}

function drawCharts(series) {
  if (typeof uPlot === "undefined" || !series) return;
  if (!charts) {
    charts = {
      throughput: chart("#chart-throughput", "tokens/s", "#0066cc"),
      ttft: chart("#chart-ttft", "TTFT (s)", "#d35400"),
    };
  }
  charts.throughput.setData([series.time, series.tokens_per_second]);
  charts.ttft.setData([series.time, series.ttft_seconds]);
}

function askForKey(message) {
  $("#key-form").hidden = false;
  $("#main").hidden = true;
  $("#key-error").textContent = message || "";
  $("#key-input").focus();
}

async function follow() {
  // The event stream, parsed by hand: "event: status" blocks with one "data:" line each.
  for (;;) {
    try {
      const response = await fetch("/v1/status/events", { headers: headers() });
      if (response.status === 401) return askForKey("That key was not accepted.");
      if (!response.ok || !response.body) throw new Error("HTTP " + response.status);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
          if (data) render(JSON.parse(data));
        }
      }
    } catch (err) {
      $("#conn-error").hidden = false;
      $("#conn-error").textContent = "Lost the server (" + err.message + "); trying again.";
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

async function start() {
  const response = await fetch("/v1/status", { headers: headers() }).catch(() => null);
  if (response && response.status === 401) return askForKey(sessionStorage.getItem(KEY) ? "That key was not accepted." : "");
  $("#key-form").hidden = true;
  if (response && response.ok) render(await response.json());
  follow();
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("#key-input").value);
  start();
});

start();
