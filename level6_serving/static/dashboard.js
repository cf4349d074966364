// The live dashboard's script: read frames from /dashboard/events, draw them; send prompts.
//
// A frame (level6_serving/dashboard.py, build_frame) is one JSON object:
//   pool.state[b]   0 free, 1 cached (free, holding a prefix), 2 used by one request, 3 shared
//   pool.owner[b]   index into frame.requests of the first holder (-1 none, -2 a request not listed)
//   pool.shared     [[block, refs], ...] for every block held by more than one request
//   pool.cached_lru the cached-but-free blocks, evicted first, first
//   pool.cells      a pool of more than 512 blocks: per run of pool.cell_size blocks, [free, cached, used, shared]
//   requests        [id, sample index, status, prompt, output, computed, preemptions, blocks, max_tokens]
//   steps           [time, batch, prefill, decode, seconds, preempted, generated, drafted, accepted]
//                   for every step since the last frame
// The event stream is read with fetch(), not EventSource, so that an API key can be sent.
// A frame seen twice (the latest is replayed to a page that reconnects) is drawn, not counted twice.
// Not here: anything that changes the engine (the page only reads, and sends ordinary completions).
"use strict";

const FREE = 0, CACHED = 1, USED = 2, SHARED = 3;
const KEEP_STEPS = 240, KEEP_FRAMES = 90;
const $ = (id) => document.getElementById(id);
let info = { model: "", completions: false };
let key = sessionStorage.getItem("ladder-api-key") || "";
let steps = [];  // the last KEEP_STEPS step rows
let series = { tps: [], ttft: [], acc: [], rej: [] };  // one value per frame
let lastFrame = null;

function headers(json) {
  const h = {};
  if (key) h["Authorization"] = "Bearer " + key;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

function colour(id) {  // FNV-1a, then the golden ratio: ids that differ by one character get far-apart hues
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619) >>> 0;
  const hue = Math.floor(((h * 0.6180339887) % 1) * 360), light = 48 + (h >>> 28);
  return `hsl(${hue} 62% ${light}%)`;
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = "status " + (cls || "");
}

// --- the connection -------------------------------------------------------------------------
async function loadInfo() {
  const r = await fetch("/dashboard/info", { headers: headers() });
  if (r.status === 401) return false;
  info = await r.json();
  $("model").textContent = info.model;
  // An 8-bit cache says what it buys: the blocks the same memory holds in the model's dtype.
  const kv = info.kv_cache_dtype === info.model_dtype ? "" :
    ` · KV in ${info.kv_cache_dtype} (${info.blocks_in_model_dtype} blocks in ${info.model_dtype})`;
  $("engine").textContent = `${info.engine} · ${info.mode} · ${info.num_blocks} blocks of ${info.block_size} tokens` +
    kv + (info.prefix_caching ? " · prefix caching" : "") + (info.speculative ? " · speculative" : "");
  const offline = !info.completions;
  $("offline").hidden = !offline;
  for (const id of ["send", "burst", "prompt"]) $(id).disabled = offline;
  $("drafts-row").hidden = !info.speculative;
  return true;
}

// Server-sent events, as both streams send them: events end with a blank line, and each `data: ` line's
// payload goes to onData as it arrives (a chunk of the body may hold half an event, or several).
async function readEvents(response, onData) {
  const reader = response.body.getReader(), text = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += text.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) if (line.startsWith("data: ")) onData(line.slice(6));
    }
  }
}

async function connect() {
  if (document.body.dataset.auth === "1" && !key) return askForKey("");  // not a 401 in the console first
  try {
    if (!(await loadInfo())) return askForKey("");
    const r = await fetch("/dashboard/events", { headers: headers() });
    if (r.status === 401) return askForKey("that key was refused");
    if (!r.ok) throw new Error("HTTP " + r.status);
    $("keybox").hidden = true;
    setStatus("live", "live");
    await readEvents(r, (data) => onFrame(JSON.parse(data)));
    setStatus("the stream ended; reconnecting…", "down");
  } catch (e) {
    setStatus("disconnected; retrying…", "down");
  }
  setTimeout(connect, 1000);
}

function askForKey(message) {
  $("keybox").hidden = false;
  $("keymsg").textContent = message;
  setStatus("needs an API key", "down");
}

$("keygo").addEventListener("click", () => {
  key = $("key").value.trim();
  sessionStorage.setItem("ladder-api-key", key);
  connect();
});

// --- a frame -------------------------------------------------------------------------------------
function onFrame(f) {
  if (lastFrame && f.seq <= lastFrame.seq) {
    if (f.seq < lastFrame.seq) {  // a new engine behind the same URL (a restarted server): start over
      steps = []; series = { tps: [], ttft: [], acc: [], rej: [] }; lastFrame = null;
    } else {  // the same frame again (a reconnect): draw it, count nothing twice
      drawPool(f); drawQueues(f);
      return;
    }
  }
  const dt = lastFrame ? f.time - lastFrame.time : 0;
  lastFrame = f;
  steps = steps.concat(f.steps).slice(-KEEP_STEPS);
  let generated = 0, drafted = 0, accepted = 0;
  for (const s of f.steps) { generated += s[6]; drafted += s[7]; accepted += s[8]; }
  push(series.tps, dt > 0 ? generated / dt : null);
  push(series.ttft, f.ttft.count ? f.ttft.sum / f.ttft.count : null);
  push(series.acc, accepted);
  push(series.rej, drafted - accepted);
  drawPool(f);
  drawQueues(f);
  drawTimeline();
  drawSparks();
}

function push(arr, v) {
  arr.push(v);
  if (arr.length > KEEP_FRAMES) arr.shift();
}

function fitCanvas(c, height) {
  const ratio = window.devicePixelRatio || 1, w = c.clientWidth || c.parentElement.clientWidth;
  c.width = Math.round(w * ratio);
  c.height = Math.round(height * ratio);
  c.style.height = height + "px";
  const g = c.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [g, w];
}

// --- the block pool -----------------------------------------------------------------------------
// A pool is drawn one square per block when they fit at READABLE px or more (a number fits on them):
// grey free, yellow cached, its request's colour when held, a black edge and its reference count when
// shared. A bigger pool (the CPU server's default is 10,922 blocks) would be a field of 4-pixel squares in
// which a burst is a sliver of the first row and no count can be read. For a pool of more than 512 blocks
// the server also counts its blocks in cells of pool.cell_size consecutive blocks (dashboard.py,
// pool_cells); when the blocks do not fit, each cell is drawn as a little stacked bar: from the bottom,
// the share of its blocks that are shared (dark), held by one request (blue), cached (yellow); the grey
// left on top is free. Fixed colours, not the requests': a cell's blocks belong to many. A click on a
// cell zooms into its blocks, drawn as a small pool's are; Escape or the button goes back out.
const READABLE = 14;
const FREE_COLOUR = "#e6e6e6", CACHED_COLOUR = "#f7dc8c", CACHED_EDGE = "#b98900";
const HELD_COLOUR = "hsl(210 65% 55%)", SHARED_COLOUR = "#2b2d42";
let grid = null;  // what the last drawing put where: for the hover tip and the click
let zoom = null;  // the cell zoomed into, or null: the whole pool

function layout(n, width, biggest) {  // the biggest squares (at most `biggest` px) that fit n into 360 px of height
  let cell = biggest;
  while (cell > 4 && Math.ceil(n / Math.floor(width / cell)) * cell > 360) cell--;
  return [cell, Math.max(1, Math.floor(width / cell))];
}

function drawPool(f) {
  const p = f.pool, per = p.cell_size || 1, c = $("pool"), width = c.clientWidth || c.parentElement.clientWidth;
  const big = per > 1 && layout(p.shown, width, 22)[0] < READABLE;  // too many blocks to draw one by one
  if (zoom !== null && (!big || zoom * per >= p.shown)) zoom = null;  // a wider window, a new engine's pool
  const cells = big && zoom === null;  // the whole big pool, a square a run of blocks
  const lo = zoom === null ? 0 : zoom * per, hi = zoom === null ? p.shown : Math.min(p.shown, lo + per);
  const n = cells ? p.cells.length : hi - lo;
  const [cell, cols] = layout(n, width, cells ? 24 : zoom === null ? 22 : 40);
  const [g] = fitCanvas(c, Math.max(Math.ceil(n / cols) * cell, cell));
  const refs = new Map(p.shared);
  grid = { f, cell, cols, n, lo, per: cells ? per : 1, refs };
  const [occupied, numbers] = cells ? drawCells(g, p, cell, cols) : drawBlocks(g, f, lo, hi, cell, cols, refs);
  let used = 0, cached = 0;  // over the whole pool, whatever is drawn
  for (const s of p.state) { if (s === USED || s === SHARED) used++; else if (s === CACHED) cached++; }
  // for tests and anyone scripting the page: what is drawn, where, and what the counts are
  Object.assign(c.dataset, { seq: f.seq, used, shared: p.shared.length, cached, occupied, refs: numbers,
                             view: cells ? "cells" : zoom === null ? "blocks" : "zoom", cell, cols, per: grid.per });
  c.classList.toggle("zoomable", cells);
  $("blocks-legend").hidden = cells;
  $("cells-legend").hidden = !cells;
  $("cells-per").textContent = `${per} consecutive blocks`;
  $("zoombar").hidden = zoom === null;
  $("zoom-range").textContent = `blocks ${lo}–${hi - 1} of ${p.num_blocks}`;
  const more = p.num_blocks > p.shown ? ` (the first ${p.shown} drawn)` : "";
  $("pool-summary").textContent = `${p.num_blocks - p.num_free} of ${p.num_blocks} held · ${p.shared.length} shared · ` +
    `${cached} cached · ${p.num_free - cached} empty${more}`;
  drawLRU(p);
}

function drawBlocks(g, f, lo, hi, cell, cols, refs) {  // blocks lo..hi-1, a square each; returns [held, numbers drawn]
  const p = f.pool;
  let held = 0, numbers = 0;
  for (let b = lo; b < hi; b++) {
    const x = ((b - lo) % cols) * cell, y = Math.floor((b - lo) / cols) * cell, s = p.state[b], o = p.owner[b];
    const id = o >= 0 ? f.requests[o][0] : "(not listed)";
    g.fillStyle = s === FREE ? FREE_COLOUR : s === CACHED ? CACHED_COLOUR : colour(id);
    g.fillRect(x + 1, y + 1, cell - 2, cell - 2);
    if (s === CACHED) { g.strokeStyle = CACHED_EDGE; g.lineWidth = 1; g.strokeRect(x + 1.5, y + 1.5, cell - 3, cell - 3); }
    if (s === USED || s === SHARED) held++;
    if (s === SHARED) {
      g.strokeStyle = "#111"; g.lineWidth = 2; g.strokeRect(x + 2, y + 2, cell - 4, cell - 4);
      if (cell >= READABLE) {  // smaller, and the number is a smudge: the edge alone says "shared"
        g.fillStyle = "#111"; g.font = `bold ${Math.floor(cell * 0.55)}px system-ui`;
        g.textAlign = "center"; g.textBaseline = "middle";
        g.fillText(String(refs.get(b)), x + cell / 2, y + cell / 2 + 1);
        numbers++;
      }
    }
  }
  return [held, numbers];
}

function drawCells(g, p, cell, cols) {  // each cell a stacked bar of its shares; returns [cells holding any, 0]
  const inner = cell - 2;
  let occupied = 0;
  p.cells.forEach(([free, cached, used, shared], i) => {
    const x = (i % cols) * cell + 1, top = Math.floor(i / cols) * cell + 1, total = free + cached + used + shared;
    g.fillStyle = FREE_COLOUR; g.fillRect(x, top, inner, inner);
    let y = top + inner;  // each share stacks on the one below it
    for (const [k, fill] of [[shared, SHARED_COLOUR], [used, HELD_COLOUR], [cached, CACHED_COLOUR]]) {
      if (!k) continue;
      const h = Math.min(y - top, Math.max(2, Math.round(inner * k / total)));  // one block of 22 still shows
      y -= h; g.fillStyle = fill; g.fillRect(x, y, inner, h);
    }
    if (used + shared) {  // an edge too: one held block in a cell of 22 is a sliver of fill, but the edge shows
      g.strokeStyle = shared ? SHARED_COLOUR : HELD_COLOUR; g.lineWidth = 2;
      g.strokeRect(x + 1, top + 1, inner - 2, inner - 2);
      occupied++;
    }
  });
  return [occupied, 0];
}

function drawLRU(p) {
  const c = $("lru"), [g, w] = fitCanvas(c, 16), k = p.cached_lru.length;
  $("lru-count").textContent = k ? `${k} blocks: the left one goes first when a block is needed` : "none";
  const cell = Math.max(2, Math.min(16, Math.floor(w / Math.max(k, 1))));
  for (let i = 0; i < k && (i + 1) * cell <= w; i++) {
    g.fillStyle = CACHED_COLOUR; g.fillRect(i * cell + 1, 1, cell - 2, 14);
    g.strokeStyle = CACHED_EDGE; g.strokeRect(i * cell + 1.5, 1.5, cell - 3, 13);
  }
}

function squareAt(e) {  // the index of the square under the mouse in the last drawing, or -1
  if (!grid) return -1;
  const r = $("pool").getBoundingClientRect(), col = Math.floor((e.clientX - r.left) / grid.cell);
  const i = Math.floor((e.clientY - r.top) / grid.cell) * grid.cols + col;
  return col < grid.cols && i >= 0 && i < grid.n ? i : -1;
}

function blockTip(b) {
  const p = grid.f.pool, o = p.owner[b], s = p.state[b];
  const who = o >= 0 ? `request ${grid.f.requests[o][0]}` : o === -2 ? "a request not listed" : "";
  const what = ["free", "free, holding a prefix that a later request may reuse", "held by " + who,
                `shared by ${grid.refs.get(b)} requests (first: ${who})`][s];
  return `block ${b}: ${what}`;
}

function cellTip(i) {
  const p = grid.f.pool, [free, cached, used, shared] = p.cells[i];
  const lo = i * grid.per, hi = Math.min(p.shown, lo + grid.per) - 1;
  let most = 0;
  for (const [b, r] of p.shared) if (b >= lo && b <= hi) most = Math.max(most, r);
  return `blocks ${lo}–${hi}: ${used} held by one request, ${shared} shared` + (shared ? ` (by up to ${most})` : "") +
    `, ${cached} cached, ${free} free · click to see them`;
}

function zoomTo(i) {  // i: a cell of the whole pool, or null for the whole pool
  zoom = i;
  $("tip").textContent = "\u00a0";
  if (grid) drawPool(grid.f);
}

$("pool").addEventListener("mousemove", (e) => {
  const i = squareAt(e);
  $("tip").textContent = i < 0 ? "\u00a0" : grid.per > 1 ? cellTip(i) : blockTip(grid.lo + i);
});
$("pool").addEventListener("click", (e) => {
  const i = squareAt(e);
  if (i >= 0 && grid.per > 1) zoomTo(i);
});
$("zoomout").addEventListener("click", () => zoomTo(null));
document.addEventListener("keydown", (e) => { if (e.key === "Escape" && zoom !== null) zoomTo(null); });

// --- the queues ---------------------------------------------------------------------------------
function cellOf(text, cls) {
  const td = document.createElement("td");
  if (cls) td.className = cls;
  td.textContent = text;
  return td;
}

function drawQueues(f) {
  $("nrunning").textContent = f.running;
  $("nwaiting").textContent = f.waiting;
  const run = document.createElement("tbody"), wait = document.createElement("tbody");
  for (const [id, index, status, prompt, output, computed, preempted, blocks, maxTokens] of f.requests) {
    const tr = document.createElement("tr"), name = cellOf(index ? `${id} #${index}` : id, "id");
    const dot = document.createElement("span");
    dot.className = "dot"; dot.style.background = colour(id);
    name.prepend(dot);
    tr.append(name);
    if (status === "running") {
      // the prompt's share of what the request may grow to, filled as its prefill goes; then the output
      const total = Math.max(prompt + Math.max(maxTokens, output), 1), bar = document.createElement("div");
      const td = document.createElement("td");
      bar.className = "bar";
      bar.title = `prompt ${Math.min(computed, prompt)} of ${prompt} computed; output ${output} of at most ${maxTokens}`;
      const pr = document.createElement("i"), dn = document.createElement("i");
      pr.className = "prompt"; pr.style.width = (100 * Math.min(computed, prompt) / total) + "%";
      dn.className = "done"; dn.style.left = (100 * prompt / total) + "%"; dn.style.width = (100 * output / total) + "%";
      bar.append(pr, dn); td.append(bar); tr.append(td);
      tr.append(cellOf(prompt), cellOf(output), cellOf(blocks), cellOf(preempted || ""));
      run.append(tr);
    } else {
      tr.append(cellOf(status), cellOf(prompt), cellOf(output), cellOf(preempted || ""));
      wait.append(tr);
    }
  }
  $("running").replaceChild(run, $("running").tBodies[0]);
  $("waiting").replaceChild(wait, $("waiting").tBodies[0]);
  $("more").textContent = f.requests_more ? `and ${f.requests_more} more requests not listed` : "";
}

// --- the timeline and the sparklines --------------------------------------------------------------
function drawTimeline() {
  const [g, w] = fitCanvas($("timeline"), 150), h = 150, n = steps.length;
  if (!n) return;
  const bw = w / KEEP_STEPS;
  const maxTok = Math.max(1, ...steps.map((s) => s[2] + s[3]));
  const maxBatch = Math.max(1, ...steps.map((s) => s[1]));
  const maxMs = Math.max(1e-6, ...steps.map((s) => s[4]));
  steps.forEach((s, i) => {
    const x = i * bw, pre = (s[2] / maxTok) * (h - 14), dec = (s[3] / maxTok) * (h - 14);
    g.fillStyle = "#3b7dd8"; g.fillRect(x, h - dec, Math.max(bw - 0.5, 0.5), dec);
    g.fillStyle = "#e07b39"; g.fillRect(x, h - dec - pre, Math.max(bw - 0.5, 0.5), pre);
  });
  line(g, steps.map((s) => s[1] / maxBatch), bw, h - 14, "#222", 14);
  line(g, steps.map((s) => s[4] / maxMs), bw, h - 14, "#2a9d55", 14);
  g.fillStyle = "#555"; g.font = "11px system-ui"; g.textAlign = "left"; g.textBaseline = "top";
  g.fillText(`tokens ≤ ${maxTok} · batch ≤ ${maxBatch} · step ≤ ${(maxMs * 1000).toFixed(1)} ms`, 4, 1);
}

function line(g, ys, dx, h, colour, top) {
  g.strokeStyle = colour; g.lineWidth = 1.5; g.beginPath();
  ys.forEach((y, i) => { const px = i * dx + dx / 2, py = top + h - y * h; i ? g.lineTo(px, py) : g.moveTo(px, py); });
  g.stroke();
}

function spark(id, values, colour) {
  const [g, w] = fitCanvas($(id), 36), h = 34, vals = values.filter((v) => v !== null);
  if (!vals.length) return;
  const max = Math.max(...vals) || 1, dx = w / KEEP_FRAMES;
  g.fillStyle = colour;
  values.forEach((v, i) => { if (v !== null) { const bh = (v / max) * h; g.fillRect(i * dx, 35 - bh, Math.max(dx - 1, 1), bh); } });
}

function drawSparks() {
  spark("spark-tps", series.tps, "#3b7dd8");
  spark("spark-ttft", series.ttft, "#e07b39");
  const last = (a) => { for (let i = a.length - 1; i >= 0; i--) if (a[i] !== null) return a[i]; return null; };
  const tps = last(series.tps), ttft = last(series.ttft);
  $("tps").textContent = tps === null ? "–" : tps.toFixed(1);
  $("ttft").textContent = ttft === null ? "–" : ttft.toFixed(3);
  if (info.speculative) {
    const [g, w] = fitCanvas($("spark-drafts"), 36), dx = w / KEEP_FRAMES;
    const max = Math.max(1, ...series.acc.map((a, i) => a + series.rej[i]));
    series.acc.forEach((a, i) => {
      const ha = (a / max) * 34, hr = (series.rej[i] / max) * 34;
      g.fillStyle = "#2a9d55"; g.fillRect(i * dx, 35 - ha, Math.max(dx - 1, 1), ha);
      g.fillStyle = "#d64545"; g.fillRect(i * dx, 35 - ha - hr, Math.max(dx - 1, 1), hr);
    });
    const a = series.acc.reduce((x, y) => x + y, 0), r = series.rej.reduce((x, y) => x + y, 0);
    $("drafts").textContent = a + r ? `${(100 * a / (a + r)).toFixed(0)} % kept` : "–";
  }
}

// --- prompts ------------------------------------------------------------------------------------
async function complete(prompt, maxTokens, temperature, onText) {
  const body = { model: info.model, prompt, max_tokens: maxTokens, temperature, stream: true };
  const r = await fetch("/v1/completions", { method: "POST", headers: headers(true), body: JSON.stringify(body) });
  if (!r.ok) throw new Error((await r.json()).error.message);
  await readEvents(r, (data) => {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);  // rejects complete(): the caller shows it
    for (const c of chunk.choices) onText(c.text);
  });
}

function numberIn(id, fallback) {  // an emptied field is the default, not 0
  const text = $(id).value.trim(), v = Number(text);
  return text !== "" && Number.isFinite(v) ? v : fallback;
}

$("send").addEventListener("click", async () => {
  const out = $("answer");
  out.textContent = "";
  $("send").disabled = true;
  try {
    await complete($("prompt").value, numberIn("max-tokens", 64), numberIn("temperature", 0.8), (t) => { out.textContent += t; });
  } catch (e) {
    out.textContent += `\n[error: ${e.message}]`;
  } finally {
    $("send").disabled = false;
  }
});

// Eight prompts whose first ~130 characters are the same: with prefix caching on, the later ones
// find the first one's full blocks (drawn shared), and when they finish those blocks stay cached.
// Short enough for the built-in models' 256-token context with room for the answers.
const PREFIX = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" +
  "First Citizen:\nYou are all resolved rather to die than to famish?\n\n";
const ENDINGS = ["All:", "Second Citizen:", "MENENIUS:", "MARCIUS:", "First Senator:", "COMINIUS:", "VOLUMNIA:", "BRUTUS:"];

$("burst").addEventListener("click", async () => {
  // The first request goes alone, and the others once its first token is out: by then its prompt's
  // blocks are computed and named, so the other seven find them. (Sent in the same step, all eight
  // would compute their own copies: a block is found only once it is full and computed.)
  const status = $("burst-status"), n = ENDINGS.length;
  let done = 0, failed = 0, started;
  const first = new Promise((resolve) => { started = resolve; });
  const show = () => { status.textContent = `${done} of ${n} done` + (failed ? `, ${failed} failed` : ""); };
  const send = (end, onText) => complete(PREFIX + end + "\n", 40, 0.8, onText)
    .catch(() => { failed++; }).finally(() => { done++; started(); show(); });
  show();
  const all = [send(ENDINGS[0], () => started())];
  await first;
  for (const end of ENDINGS.slice(1)) all.push(send(end, () => {}));
  await Promise.all(all);
});

window.addEventListener("resize", () => { if (lastFrame) { drawPool(lastFrame); drawTimeline(); drawSparks(); } });
connect();
