// The playground's whole logic: plain browser JavaScript, no build step, no dependency, same origin only.
// It reads the served models (/v1/models) and the API's own schema (/openapi.json) to show only the fields the
// server takes, submits to /v1/generate, follows the job's SSE stream (read with fetch, which can send the API
// key; EventSource cannot), and fetches the outputs as blobs (an <img src> could not send the key either).
"use strict";

const $ = (id) => document.getElementById(id);
const TERMINAL = new Set(["succeeded", "failed", "canceled", "expired"]);
const KEY_STORE = "meshserve.apiKey"; // sessionStorage: gone with the tab, never in localStorage or the URL

let cards = []; // the /v1/models cards
let requestFields = new Set(); // GenerateRequest's properties, from /openapi.json (empty: not readable)
let objectUrls = []; // blob: URLs of the shown outputs, revoked before the next run

function apiHeaders(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The API's one error shape, {"error": {"code", "message", "field"}}, as a sentence (its message as is).
async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON: fall through */ }
  return `${response.status} ${response.statusText}`;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

function setStatus(text) { $("job-status").textContent = text; }

// -- what the server serves --------------------------------------------------------------------------------

async function loadSchema() {
  try {
    const r = await fetch("/openapi.json");
    if (!r.ok) return;
    const schema = await r.json();
    const props = schema.components.schemas.GenerateRequest.properties || {};
    requestFields = new Set(Object.keys(props));
  } catch (e) { requestFields = new Set(); }
}

async function loadModels() {
  let r;
  try {
    r = await fetch("/v1/models", { headers: apiHeaders() });
  } catch (e) {
    $("server-status").textContent = "the server does not answer; retrying";
    setTimeout(loadModels, 2000);
    return;
  }
  if (r.status === 401) {
    $("key-box").hidden = false;
    $("server-status").textContent = await errorOf(r);
    return;
  }
  if (!r.ok) {
    $("server-status").textContent = `${await errorOf(r)}; retrying`;
    setTimeout(loadModels, 2000);
    return;
  }
  cards = (await r.json()).data;
  if (!cards.length) { // the API is up but no pool is ready yet (still compiling)
    $("server-status").textContent = "no model is ready yet; retrying";
    setTimeout(loadModels, 2000);
    return;
  }
  const select = $("model");
  const previous = select.value;
  select.replaceChildren(...cards.map((c) => new Option(c.id, c.id)));
  if (cards.some((c) => c.id === previous)) select.value = previous;
  $("server-status").textContent = `${cards.length} model${cards.length > 1 ? "s" : ""} served`;
  selectModel();
}

function currentCard() { return cards.find((c) => c.id === $("model").value); }

function tasksOf(card) { return card.tasks || [card.task]; }

// Fill the fields with the model's defaults and show only what it takes.
function selectModel() {
  const card = currentCard();
  if (!card) return;
  const d = card.defaults, l = card.limits;
  $("width").value = d.width; $("height").value = d.height;
  for (const id of ["width", "height"]) {
    $(id).min = l.min_size; $(id).max = l.max_size; $(id).step = l.size_multiple;
  }
  $("steps").value = d.num_inference_steps; $("steps").min = l.min_steps; $("steps").max = l.max_steps;
  $("guidance").value = d.guidance_scale;
  $("frames-row").hidden = !l.frames;
  if (l.frames) $("num-frames").value = l.frames.default;
  const sizes = l.buckets ? l.buckets.map(([w, h]) => `${w}x${h}`).join(", ")
    : `${l.min_size}..${l.max_size}, multiples of ${l.size_multiple}`;
  $("model-info").textContent = `${card.family}, ${tasksOf(card).join(", ")}; sizes ${sizes}; ` +
    `steps ${l.min_steps}..${l.max_steps}`;
  // Image inputs once the server takes them (the request has the field) and this model does (its tasks).
  const tasks = tasksOf(card).join(" ");
  const takesImage = requestFields.has("image") && /image-to|inpaint|edit/.test(tasks);
  $("image-inputs").hidden = !takesImage;
  $("mask-row").hidden = !(takesImage && requestFields.has("mask") && /inpaint/.test(tasks));
  // A model with no strength (FLUX.1 Kontext's edits) leaves the field out: the API would refuse one.
  $("strength-row").hidden = !(takesImage && requestFields.has("strength") && l.strength);
  // A control model (FLUX.1 Canny / Depth) needs its control image on every request.
  $("control-row").hidden = !(requestFields.has("control_image") && l.control_image);
  // A ControlNet (SDXL): its scale, its window of steps (fractions) and guess mode, where the card's defaults
  // list them; left empty, the model's defaults apply (the placeholders).
  const controlnet = requestFields.has("controlnet_conditioning_scale") && d.controlnet_conditioning_scale != null;
  $("controlnet-row").hidden = !controlnet;
  if (controlnet) {
    $("controlnet-scale").placeholder = `${d.controlnet_conditioning_scale} (default)`;
    $("control-start").placeholder = `${d.control_guidance_start ?? 0}`;
    $("control-end").placeholder = `${d.control_guidance_end ?? 1}`;
    $("guess-mode").checked = Boolean(d.guess_mode);
  }
  const strength = l.strength; // {min (exclusive), max, defaults: {task: value}}: the placeholder is img2img's
  $("strength").max = strength ? strength.max : 1;
  $("strength").placeholder = strength && strength.defaults["image-to-image"] != null
    ? `${strength.defaults["image-to-image"]} (default)` : "default";
  // The step cache once the server takes it (the request has the field) and this model has one (limits.cache:
  // {method: {default_threshold}}); "off" by default, the method kept across models that have it.
  const methods = requestFields.has("cache") && l.cache ? Object.keys(l.cache) : [];
  $("cache-row").hidden = !methods.length;
  const method = $("cache-method"), chosen = method.value;
  method.replaceChildren(new Option("off", ""), ...methods.map((m) => new Option(m, m)));
  if (methods.includes(chosen)) method.value = chosen;
  selectCacheMethod();
}

// The threshold field follows the method: its default as the placeholder, disabled while the cache is off.
function selectCacheMethod() {
  const card = currentCard(), method = $("cache-method").value;
  const entry = card && card.limits.cache && method ? card.limits.cache[method] : null;
  $("cache-threshold").disabled = !entry;
  $("cache-threshold").placeholder = entry ? `${entry.default_threshold} (default)` : "";
}

// -- one generation -----------------------------------------------------------------------------------------

function readDataUrl(input) {
  const file = input.files && input.files[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function numberOf(id) {
  const v = $(id).valueAsNumber;
  return Number.isFinite(v) ? v : undefined;
}

async function requestBody() {
  const card = currentCard();
  const body = { prompt: $("prompt").value }; // sent as typed: the API says what is wrong with it
  if (card) body.model = card.id;
  if ($("negative-prompt").value) body.negative_prompt = $("negative-prompt").value;
  for (const [id, field] of [["width", "width"], ["height", "height"], ["steps", "num_inference_steps"],
    ["guidance", "guidance_scale"], ["seed", "seed"]]) {
    const v = numberOf(id);
    if (v !== undefined) body[field] = v;
  }
  if (card && card.limits.frames && numberOf("num-frames") !== undefined) body.num_frames = numberOf("num-frames");
  if (!$("image-inputs").hidden) {
    const image = await readDataUrl($("image"));
    if (image) body.image = image;
    const mask = $("mask-row").hidden ? null : await readDataUrl($("mask"));
    if (mask) body.mask = mask;
    if (!$("strength-row").hidden && numberOf("strength") !== undefined) body.strength = numberOf("strength");
  }
  if (!$("control-row").hidden) {
    const control = await readDataUrl($("control-image"));
    if (control) body.control_image = control;
  }
  if (!$("control-row").hidden && !$("controlnet-row").hidden) {
    for (const [id, field] of [["controlnet-scale", "controlnet_conditioning_scale"],
      ["control-start", "control_guidance_start"], ["control-end", "control_guidance_end"]]) {
      const v = numberOf(id);
      if (v !== undefined) body[field] = v;
    }
    if ($("guess-mode").checked) body.guess_mode = true;
  }
  if (!$("cache-row").hidden && $("cache-method").value) {
    body.cache = { method: $("cache-method").value };
    if (numberOf("cache-threshold") !== undefined) body.cache.threshold = numberOf("cache-threshold");
  }
  if (requestFields.has("previews")) body.previews = true;
  return body;
}

function resetOutput() {
  for (const url of objectUrls) URL.revokeObjectURL(url);
  objectUrls = [];
  showError("");
  $("result").replaceChildren();
  $("details").hidden = true;
  $("preview").hidden = true;
  $("preview").removeAttribute("src");
  $("preview").dataset.shown = "0";
  const bar = $("progress");
  bar.hidden = true; bar.value = 0; bar.max = 1; bar.dataset.events = "0";
}

async function generate(event) {
  event.preventDefault();
  const button = $("generate");
  button.disabled = true;
  resetOutput();
  try {
    const r = await fetch("/v1/generate", {
      method: "POST",
      headers: apiHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(await requestBody()),
    });
    if (!r.ok) {
      if (r.status === 401) $("key-box").hidden = false;
      showError(await errorOf(r));
      setStatus("");
      return;
    }
    let job = await r.json();
    $("job-id").textContent = job.id;
    setStatus(`${job.status}`);
    if (!TERMINAL.has(job.status)) {
      await followEvents(job.id).catch(() => {}); // no stream, or a broken one: polling below still ends it
      job = await waitForEnd(job.id);
    }
    await showJob(job);
  } catch (e) {
    showError(String(e));
  } finally {
    button.disabled = false;
    loadRecent().catch(() => {});
  }
}

// The job's SSE stream, parsed by hand from a fetch body; returns at its terminal event or when it ends.
async function followEvents(jobId) {
  const r = await fetch(`/v1/jobs/${jobId}/events`, { headers: apiHeaders({ Accept: "text/event-stream" }) });
  if (!r.ok || !r.body) return;
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      return; // the connection broke: the caller polls the job instead
    }
    const { value, done } = chunk;
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let type = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) type = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (!data) continue; // a keep-alive comment
      const payload = JSON.parse(data);
      onEvent(type, payload);
      if (TERMINAL.has(type) || TERMINAL.has(payload.status)) { reader.cancel(); return; }
    }
  }
}

function onEvent(type, data) {
  const bar = $("progress");
  if (type === "progress" && data.total_steps) {
    bar.hidden = false;
    bar.max = data.total_steps; bar.value = data.step;
    bar.dataset.events = String(Number(bar.dataset.events) + 1);
    setStatus(`step ${data.step} of ${data.total_steps}`);
  } else if (type === "preview") {
    const src = previewSource(data);
    if (src) {
      $("preview").src = src; $("preview").hidden = false;
      $("preview").dataset.shown = String(Number($("preview").dataset.shown || 0) + 1);
    }
  } else if (type === "error") {
    showError(data.message || "the event stream broke");
  } else {
    setStatus(data.status || type);
  }
}

// A preview event's picture: the first data:image/ URL in it (a field, or the first of a list of them, one per
// output), so the page keeps working whatever the event's other fields are.
function previewSource(data) {
  for (const v of Object.values(data)) {
    for (const item of Array.isArray(v) ? v : [v]) {
      const url = typeof item === "string" ? item : item && typeof item === "object" ? previewSource(item) : null;
      if (url && url.startsWith("data:image/")) return url;
    }
  }
  return null;
}

// Polls until the job ends (the stream may have ended early: a dropped connection, an expired stream).
async function waitForEnd(jobId) {
  for (;;) {
    const r = await fetch(`/v1/jobs/${jobId}`, { headers: apiHeaders() });
    if (!r.ok) throw new Error(await errorOf(r));
    const job = await r.json();
    if (TERMINAL.has(job.status)) return job;
    setStatus(job.status === "queued" && job.queue_position != null ? `queued (${job.queue_position} ahead)` : job.status);
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
}

const seconds = (s) => (s == null ? "-" : `${s.toFixed(2)} s`);

async function showJob(job) {
  setStatus(job.status);
  if (job.status !== "succeeded") {
    showError(job.error ? job.error.message : `the job ended ${job.status}`);
    return;
  }
  showError(""); // a stream error on the way (the job went on and succeeded)
  const bar = $("progress");
  bar.hidden = false; bar.max = job.progress.total_steps || 1; bar.value = bar.max;
  $("preview").hidden = true;
  for (const output of job.outputs) {
    // The API's own output route is fetched with the key and shown from memory; an output on another origin
    // (an object store, a CDN: `output_url_base`, signed URLs) is shown from there and never sent the key.
    let url = output.url;
    if (new URL(output.url, location.href).origin === location.origin) {
      const r = await fetch(output.url, { headers: apiHeaders() });
      if (!r.ok) { showError(await errorOf(r)); return; }
      url = URL.createObjectURL(await r.blob());
      objectUrls.push(url);
    }
    const media = output.content_type.startsWith("video/") ? document.createElement("video")
      : document.createElement("img");
    if (media.tagName === "VIDEO") { media.controls = true; media.loop = true; media.autoplay = true; media.muted = true; }
    else media.alt = job.params.prompt;
    media.src = url;
    media.className = "output";
    const link = document.createElement("a");
    link.href = url;
    link.download = `${job.id}-${output.index}.${output.content_type.split("/")[1]}`;
    link.textContent = `Download (${output.content_type.split("/")[1]})`;
    const figure = document.createElement("figure");
    const caption = document.createElement("figcaption");
    caption.append(`${output.width}x${output.height}, seed ${output.seed ?? job.params.seed} `, link);
    figure.append(media, caption);
    $("result").append(figure);
  }
  $("seed-used").textContent = job.outputs.map((o) => o.seed ?? job.params.seed).join(", ");
  const t = job.timings;
  $("timings").textContent = `queue ${seconds(t.queue_s)}, inference ${seconds(t.inference_s)}, total ${seconds(t.total_s)}`;
  const cached = job.cached_steps != null; // a job that asked for a step cache
  $("cached-label").hidden = !cached; $("cached-steps").hidden = !cached;
  $("cached-steps").textContent = cached ? `${job.cached_steps} of ${job.progress.total_steps}` : "";
  $("details").hidden = false;
}

// The caller's last jobs (GET /v1/jobs), newest first: one that ended opens again on a click.
async function loadRecent() {
  if (!$("key-box").hidden && !sessionStorage.getItem(KEY_STORE)) return; // keys on, none given yet
  const r = await fetch("/v1/jobs?limit=10", { headers: apiHeaders() });
  if (!r.ok) return; // a key refused (the key box says so), or a server without the listing
  const items = (await r.json()).data.map((job) => {
    const button = document.createElement("button");
    button.type = "button";
    button.className = "recent-job";
    button.dataset.job = job.id;
    button.textContent = `${job.status} · ${job.model} · ${job.params.prompt}`;
    button.title = job.params.prompt;
    button.addEventListener("click", () => openJob(job.id));
    const item = document.createElement("li");
    item.append(button);
    return item;
  });
  $("recent").replaceChildren(...items);
  $("history").hidden = items.length === 0;
}

async function openJob(jobId) {
  resetOutput();
  $("job-id").textContent = jobId;
  try {
    const r = await fetch(`/v1/jobs/${jobId}`, { headers: apiHeaders() });
    if (!r.ok) { showError(await errorOf(r)); return; }
    const job = await r.json();
    if (TERMINAL.has(job.status)) await showJob(job);
    else setStatus(job.status);
  } catch (e) {
    showError(String(e));
  }
}

// -- wiring ------------------------------------------------------------------------------------------------

function useKey() {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY_STORE, key);
  else sessionStorage.removeItem(KEY_STORE);
  loadModels();
  loadRecent().catch(() => {});
}

document.addEventListener("DOMContentLoaded", async () => {
  $("form").addEventListener("submit", generate);
  $("model").addEventListener("change", selectModel);
  $("cache-method").addEventListener("change", selectCacheMethod);
  $("key-use").addEventListener("click", useKey);
  $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); useKey(); } });
  if (sessionStorage.getItem(KEY_STORE)) { $("key-box").hidden = false; $("api-key").value = sessionStorage.getItem(KEY_STORE); }
  await loadSchema();
  await loadModels();
  await loadRecent().catch(() => {});
});
