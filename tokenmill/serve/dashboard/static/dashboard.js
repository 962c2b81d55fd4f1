// tokenmill's live dashboard: plain JS and canvas, no external network.
// Data: server-sent events from /dashboard/events (read with fetch, so that the API key
// can go in an Authorization header), one "snapshot" event per engine snapshot and a
// "tick" event each second without one. The key comes from the URL fragment
// (#key=...: never sent to the server) or from the key field shown after a 401.
"use strict";

const $ = (id) => document.getElementById(id);
const STATE_NAMES = { F: "free", C: "cached, free", U: "in use", H: "in use, cached", S: "shared",
                      N: "reserved (null block)" };
// The block maps: the (full-attention) pool, and a hybrid cache's sliding-window pool.
const MAPS = { "kv-map": { key: "kv", tooltip: "tooltip" }, "kv-sliding-map": { key: "kv_sliding", tooltip: "tooltip-sliding" } };
const RATE_WINDOW_S = 5;
const HISTORY_S = 120;

const app = {
  key: null,
  latest: null,        // newest snapshot
  serverNow: null,     // server's monotonic clock at the newest event
  owners: {},          // canvas id -> (block id -> request ids holding it)
  layouts: {},         // canvas id -> {cell, cols, n} of its last drawing, for hover
  history: [],         // [serverNow, generation tok/s, prompt tok/s]
  chatId: null,        // the chat box's request id, highlighted everywhere
  modelId: null,
  dirty: false,
};

// ----- the key ------------------------------------------------------------------------

function initKey() {
  const match = /(?:^|[#&])key=([^&]*)/.exec(location.hash);
  if (match) {
    sessionStorage.setItem("tokenmill-key", decodeURIComponent(match[1]));
    history.replaceState(null, "", location.pathname + location.search);  // out of sight
  }
  app.key = sessionStorage.getItem("tokenmill-key");
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    app.key = $("key-input").value.trim();
    sessionStorage.setItem("tokenmill-key", app.key);
    $("key-form").hidden = true;
    connect();
  });
}

function authHeaders() {
  return app.key ? { Authorization: "Bearer " + app.key } : {};
}

// ----- the event stream -----------------------------------------------------------------

function setConnection(text, ok) {
  const el = $("connection");
  el.textContent = text;
  el.className = "pill " + (ok ? "ok" : "bad");
}

async function connect() {
  setConnection("connecting…", false);
  let response;
  try {
    response = await fetch("/dashboard/events", { headers: authHeaders(), cache: "no-store" });
  } catch (err) {
    return retry("server unreachable");
  }
  if (response.status === 401) {
    setConnection("API key needed", false);
    $("key-form").hidden = false;
    return;
  }
  if (!response.ok) return retry("HTTP " + response.status);
  setConnection("live", true);
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        handleEvent(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
      }
    }
  } catch (err) {
    /* the connection broke: reconnect below */
  }
  retry("disconnected");
}

function retry(reason) {
  setConnection(reason + ", retrying…", false);
  setTimeout(connect, 1000);
}

function handleEvent(block) {
  let type = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) type = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  if (!data.length) return;
  const payload = JSON.parse(data.join("\n"));
  if (type === "snapshot") {
    app.latest = payload;
    app.serverNow = payload.sent;
    app.owners = {};
    for (const [canvasId, map] of Object.entries(MAPS)) {
      if (payload[map.key]) app.owners[canvasId] = invertOwners(payload[map.key]);
    }
  } else if (type === "tick") {
    app.serverNow = payload.now;
  }
  recordRates();
  schedule();
}

function schedule() {
  if (app.dirty) return;
  app.dirty = true;
  requestAnimationFrame(() => { app.dirty = false; render(); });
}

// ----- derived numbers ----------------------------------------------------------------

function invertOwners(kv) {
  const owners = new Array(kv.num_blocks);
  for (const [rid, blocks] of Object.entries(kv.owners)) {
    for (const b of blocks) (owners[b] = owners[b] || []).push(rid);
  }
  return owners;
}

function stepRows(snapshot) {
  const f = snapshot.step_fields;
  return snapshot.steps.map((s) => Object.fromEntries(f.map((name, i) => [name, s[i]])));
}

// Tokens per second over the last RATE_WINDOW_S seconds of the server's clock, from the
// steps that ended in that window (the ring of steps may cover less: then over what it has).
function rates(snapshot, now) {
  const steps = stepRows(snapshot);
  if (!steps.length || now == null) return [0, 0];
  let start = now - RATE_WINDOW_S;
  if (steps.length >= 120 && steps[0].started > start) start = steps[0].started;
  let gen = 0, prompt = 0;
  for (const s of steps) {
    if (s.started + s.duration_ms / 1000 >= start) { gen += s.generated; prompt += s.prefill_tokens; }
  }
  const span = Math.max(now - start, 1e-3);
  return [gen / span, prompt / span];
}

function recordRates() {
  if (!app.latest) return;
  const [gen, prompt] = rates(app.latest, app.serverNow);
  const h = app.history;
  h.push([app.serverNow, gen, prompt]);
  while (h.length && h[0][0] < app.serverNow - HISTORY_S) h.shift();
}

// ----- rendering ------------------------------------------------------------------------

function setValue(id, value, text) {
  const el = $(id);
  el.dataset.value = String(value);
  el.textContent = text === undefined ? String(value) : text;
}

function render() {
  const s = app.latest;
  if (!s) return;
  const kv = s.kv, req = s.requests, c = s.counters;
  $("model").textContent = "model: " + s.model;
  $("engine-state").textContent = "engine: " + s.engine_state;
  setValue("snapshot-seq", s.seq, "#" + s.seq);
  setValue("num-running", req.num_running);
  setValue("num-waiting", req.num_waiting);
  setValue("num-preempted", req.num_preempted);
  setValue("kv-used", kv.num_used);
  setValue("kv-num-blocks", kv.num_blocks);
  setValue("kv-usage", kv.usage, (100 * kv.usage).toFixed(1) + " %");
  const count = (ch) => kv.states.split(ch).length - 1;
  setValue("kv-free", kv.num_free - kv.num_cached_free);
  setValue("kv-cached-free", kv.num_cached_free);
  setValue("kv-private", count("U"));
  setValue("kv-used-cached", count("H"));
  setValue("kv-shared", kv.num_shared);
  $("kv-caption").textContent = `${kv.num_blocks} blocks × ${kv.block_size} tokens; ` +
    `${kv.num_cached} hold a prefix-cache entry`;
  setValue("ctr-prefix-queries", kv.prefix_cache_queries);
  setValue("ctr-prefix-hits", kv.prefix_cache_hits);
  setValue("ctr-prompt-tokens", c.prompt_tokens_computed);
  setValue("ctr-generation-tokens", c.generation_tokens);
  setValue("ctr-preemptions", c.num_preemptions);
  setValue("ctr-steps", c.num_steps);
  setValue("ctr-spec-draft", c.spec_draft_tokens);
  setValue("ctr-spec-accepted", c.spec_accepted_tokens);
  setValue("ttft-count", s.ttft.count);
  setValue("itl-count", s.itl.count);
  const [gen, prompt] = rates(s, app.serverNow);
  $("gen-tps").textContent = gen.toFixed(1);
  $("prompt-tps").textContent = prompt.toFixed(0);
  drawBlockMap("kv-map", kv);
  $("sliding-pool").hidden = !s.kv_sliding;
  if (s.kv_sliding) {
    const sk = s.kv_sliding;
    $("kv-sliding-caption").textContent = `${sk.num_used} of ${sk.num_blocks - sk.num_reserved} blocks in use, ` +
      `${sk.num_cached_free} cached and free (blocks before a request's window are let go)`;
    drawBlockMap("kv-sliding-map", sk);
  }
  drawSteps(stepRows(s));
  drawHistory();
  drawHistogram("ttft-chart", "ttft-caption", s.ttft);
  drawHistogram("itl-chart", "itl-caption", s.itl);
  renderRequests(req);
  renderFinished(s.finished);
}

// A canvas sized to its CSS width and the given CSS height, in device pixels.
function prepare(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.parentElement.clientWidth;
  if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(cssHeight * ratio)) {
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    canvas.style.height = cssHeight + "px";
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, cssHeight);
  return [ctx, width];
}

// The palette lives in dashboard.css; read once (getComputedStyle per bar would cost a style pass each).
const palette = {};
const css = (name) => palette[name] ||
  (palette[name] = getComputedStyle(document.documentElement).getPropertyValue(name).trim());

// ----- the block map ------------------------------------------------------------------------

function drawBlockMap(canvasId, kv) {
  const canvas = $(canvasId);
  const width = canvas.clientWidth || canvas.parentElement.clientWidth;
  const n = kv.num_blocks;
  // Cells as large as fit in ~360 px of height, between 3 and 22 px.
  let cell = Math.floor(Math.sqrt((width * 360) / n));
  cell = Math.max(3, Math.min(22, cell));
  const cols = Math.max(1, Math.floor(width / cell));
  const rows = Math.ceil(n / cols);
  const [ctx] = prepare(canvas, rows * cell);
  app.layouts[canvasId] = { cell, cols, n };
  if (canvasId === "kv-map") app.layout = app.layouts[canvasId];
  const colours = { F: css("--free"), C: css("--cached"), U: css("--used"), H: css("--used-cached"),
                    S: css("--shared"), N: css("--reserved") };
  const gap = cell >= 6 ? 1 : 0;
  const mine = app.chatId ? new Set(mineBlocks(kv)) : null;
  for (let i = 0; i < n; i++) {
    const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    ctx.fillStyle = colours[kv.states[i]];
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (mine && mine.has(i)) {
      ctx.strokeStyle = "#111";
      ctx.lineWidth = Math.max(1, cell / 6);
      ctx.strokeRect(x + 0.5, y + 0.5, cell - gap - 1, cell - gap - 1);
    }
  }
}

function mineBlocks(kv) {
  const blocks = [];
  for (const [rid, ids] of Object.entries(kv.owners)) {
    if (rid === app.chatId || rid.startsWith(app.chatId + "#")) blocks.push(...ids);
  }
  return blocks;
}

function blockTooltip(event) {
  const canvasId = event.target.id, map = MAPS[canvasId];
  const tip = $(map.tooltip);
  const s = app.latest, layout = app.layouts[canvasId];
  if (!s || !layout || !s[map.key]) return;
  const kv = s[map.key];
  const rect = event.target.getBoundingClientRect();
  const x = event.clientX - rect.left, y = event.clientY - rect.top;
  const i = Math.floor(y / layout.cell) * layout.cols + Math.floor(x / layout.cell);
  if (x < 0 || x >= layout.cols * layout.cell || i < 0 || i >= layout.n) { tip.hidden = true; return; }
  const state = kv.states[i];
  const owners = app.owners[canvasId][i] || [];
  const lines = [`block ${i}: ${STATE_NAMES[state]}`];
  if (owners.length) lines.push(`held by ${owners.length}: ${owners.slice(0, 6).join(", ")}${owners.length > 6 ? ", …" : ""}`);
  const hash = kv.hashes[i];
  lines.push(hash ? `hash ${hash}…` : "no prefix-cache hash");
  tip.textContent = lines.join("\n");
  tip.hidden = false;
  tip.style.left = Math.min(x + 14, rect.width - 260) + "px";
  tip.style.top = y + 14 + "px";
}

// ----- charts ----------------------------------------------------------------------------------

function drawSteps(steps) {
  const [ctx, width] = prepare($("steps-chart"), 150);
  const slots = 120, barW = width / slots, top = 12, bottom = 150 - 14;
  const total = (s) => s.prefill_tokens + s.decode_tokens;
  const max = Math.max(1, ...steps.map(total));
  const scale = (bottom - top) / max;
  const offset = slots - steps.length;
  steps.forEach((s, k) => {
    const x = (offset + k) * barW;
    let y = bottom;
    // decode_tokens counts the verified proposals too: split them out of it.
    const plain = s.decode_tokens - s.spec_accepted - s.spec_rejected;
    for (const [tokens, colour] of [[s.prefill_tokens, "--prefill"], [plain, "--decode"],
                                    [s.spec_accepted, "--accepted"], [s.spec_rejected, "--rejected"]]) {
      if (tokens <= 0) continue;
      const h = tokens * scale;
      ctx.fillStyle = css(colour);
      ctx.fillRect(x, y - h, Math.max(1, barW - 1), h);
      y -= h;
    }
    if (s.preempted) {
      ctx.fillStyle = css("--preempt");
      ctx.beginPath();
      ctx.arc(x + barW / 2, Math.max(top, y - 5), 3, 0, 2 * Math.PI);
      ctx.fill();
    }
  });
  ctx.fillStyle = css("--muted");
  ctx.font = "11px system-ui";
  ctx.fillText(`${max} tokens`, 2, 10);
  ctx.fillText(`${steps.length ? "step " + steps[steps.length - 1].index : "no steps yet"}`, width - 80, 150 - 2);
  if (steps.length) {
    const last = steps[steps.length - 1];
    const ms = steps.map((s) => s.duration_ms).sort((a, b) => a - b);
    $("steps-caption").textContent = `last step #${last.index}: ${last.prefill_tokens} prefill + ` +
      `${last.decode_tokens} decode tokens, ${last.duration_ms.toFixed(1)} ms, ${last.running} running, ` +
      `${last.waiting} waiting; median step ${ms[Math.floor(ms.length / 2)].toFixed(1)} ms over ${steps.length}`;
  }
}

function drawHistory() {
  const canvas = $("tps-chart");
  const [ctx, width] = prepare(canvas, 56);
  const h = app.history;
  if (h.length < 2) return;
  const now = h[h.length - 1][0];
  const max = Math.max(1, ...h.map((p) => p[1]));
  ctx.strokeStyle = css("--decode");
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  h.forEach(([t, gen], k) => {
    const x = width - ((now - t) / HISTORY_S) * width, y = 52 - (gen / max) * 44;
    if (k === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = css("--muted");
  ctx.font = "11px system-ui";
  ctx.fillText(`max ${max.toFixed(1)} tok/s`, 2, 10);
}

function drawHistogram(canvasId, captionId, hist) {
  const [ctx, width] = prepare($(canvasId), 120);
  const caption = $(captionId);
  if (!hist.count) { caption.textContent = "no observations yet"; return; }
  let first = hist.counts.findIndex((n) => n > 0);
  let last = hist.counts.length - 1 - [...hist.counts].reverse().findIndex((n) => n > 0);
  first = Math.max(0, first - 1);
  last = Math.min(hist.counts.length - 1, last + 1);
  const shown = hist.counts.slice(first, last + 1);
  const max = Math.max(...shown);
  const barW = width / shown.length;
  const every = Math.ceil(48 / barW);  // a label per ~48 px
  ctx.font = "10px system-ui";
  shown.forEach((n, k) => {
    const h = (n / max) * 92;
    ctx.fillStyle = css("--prefill");
    ctx.fillRect(k * barW + 1, 100 - h, barW - 2, h);
    if (k % every) return;
    ctx.fillStyle = css("--muted");
    const bound = hist.bounds[first + k];
    ctx.fillText(bound === null ? "+Inf" : "≤" + fmtSeconds(bound), k * barW + 2, 114);
  });
  caption.textContent = `mean ${fmtSeconds(hist.sum / hist.count)}, p50 ≤ ${fmtSeconds(quantile(hist, 0.5))}, ` +
    `p90 ≤ ${fmtSeconds(quantile(hist, 0.9))} (bucket bounds, as Prometheus)`;
}

function quantile(hist, q) {
  let seen = 0;
  for (let i = 0; i < hist.counts.length; i++) {
    seen += hist.counts[i];
    if (seen >= q * hist.count) return hist.bounds[i] === null ? Infinity : hist.bounds[i];
  }
  return Infinity;
}

function fmtSeconds(s) {
  if (!isFinite(s)) return "∞";
  return s < 1 ? (s * 1000).toFixed(s < 0.01 ? 1 : 0) + " ms" : s.toFixed(s < 10 ? 2 : 0) + " s";
}

// ----- tables ------------------------------------------------------------------------------------

function cell(text) {
  const td = document.createElement("td");
  td.textContent = text;
  return td;
}

// A request id, shortened for the table (the whole id in its title).
function idCell(id) {
  const td = cell(id.length > 22 ? id.slice(0, 20) + "…" : id);
  td.className = "rid";
  td.title = id;
  return td;
}

function isMine(id) {
  return app.chatId !== null && (id === app.chatId || id.startsWith(app.chatId + "#"));
}

function renderRequests(req) {
  const body = $("requests").tBodies[0];
  body.replaceChildren();
  for (const r of [...req.running, ...req.waiting]) {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    tr.dataset.state = r.state;
    if (isMine(r.id)) tr.className = "mine";
    tr.append(idCell(r.id));
    const state = cell("");
    state.innerHTML = `<span class="state ${r.state}"></span>`;
    state.firstChild.textContent = r.state;
    if (r.priority) state.append(` p${r.priority}`);  // a priority other than the default 0
    tr.append(state);
    const progress = document.createElement("td");
    const prefilling = r.computed_tokens < r.prompt_tokens && r.output_tokens === 0;
    const fraction = prefilling ? r.computed_tokens / r.prompt_tokens : r.output_tokens / Math.max(1, r.max_tokens);
    progress.innerHTML = `<span class="bar"><i class="${prefilling ? "prefill" : "decode"}"></i></span>`;
    progress.querySelector("i").style.width = (100 * Math.min(1, fraction)).toFixed(1) + "%";
    progress.append(prefilling ? `prefill ${r.computed_tokens}/${r.prompt_tokens}`
                               : `decode ${r.output_tokens}/${r.max_tokens}`);
    tr.append(progress, cell(r.blocks), cell(r.cached_tokens), cell(r.preemptions));
    body.append(tr);
  }
  const listed = req.running.length + req.waiting.length;
  const total = req.num_running + req.num_waiting;
  $("requests-more").textContent = total === 0 ? "no request in the engine" :
    (total > listed ? `showing ${listed} of ${total}` : "");
}

function renderFinished(rows) {
  const body = $("finished").tBodies[0];
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    tr.dataset.reason = r.finish_reason;
    if (isMine(r.id)) tr.className = "mine";
    tr.append(idCell(r.id), cell(r.finish_reason), cell(r.prompt_tokens), cell(r.output_tokens),
              cell(r.cached_tokens), cell(r.ttft_s == null ? "–" : fmtSeconds(r.ttft_s)),
              cell(r.e2e_s == null ? "–" : fmtSeconds(r.e2e_s)));
    body.append(tr);
  }
}

// ----- the chat box -----------------------------------------------------------------------------

async function modelId() {
  if (app.modelId) return app.modelId;
  const response = await fetch("/v1/models", { headers: authHeaders() });
  if (!response.ok) throw new Error("GET /v1/models: HTTP " + response.status);
  app.modelId = (await response.json()).data[0].id;
  return app.modelId;
}

async function sendChat(event) {
  event.preventDefault();
  const button = $("chat-send"), out = $("chat-output"), status = $("chat-status");
  button.disabled = true;
  out.textContent = "";
  $("chat-id").textContent = "";
  app.chatId = null;
  status.textContent = "sending…";
  try {
    const body = {
      model: await modelId(),
      messages: [{ role: "user", content: $("chat-input").value }],
      max_tokens: parseInt($("chat-max-tokens").value, 10) || 64,
      stream: true,
    };
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(`HTTP ${response.status}: ${error.error ? error.error.message : ""}`);
    }
    status.textContent = "streaming";
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", finish = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (!app.chatId) { app.chatId = chunk.id; $("chat-id").textContent = chunk.id; schedule(); }
        for (const choice of chunk.choices || []) {
          if (choice.delta && choice.delta.content) out.textContent += choice.delta.content;
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    status.textContent = `done (${finish || "?"})`;
    status.dataset.finish = finish || "";
  } catch (err) {
    status.textContent = "failed: " + err.message;
  } finally {
    button.disabled = false;
    schedule();
  }
}

// ----- start ----------------------------------------------------------------------------------

initKey();
for (const [canvasId, map] of Object.entries(MAPS)) {
  $(canvasId).addEventListener("mousemove", blockTooltip);
  $(canvasId).addEventListener("mouseleave", () => { $(map.tooltip).hidden = true; });
}
$("chat-form").addEventListener("submit", sendChat);
window.addEventListener("resize", schedule);
window.tokenmillDashboard = app;  // for a console (and the browser test)
connect();
