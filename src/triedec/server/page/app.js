// triedec playground: chats through /v1/chat/completions (streaming, "trace": true) and colours each
// token by its origin. Model and user text only ever reach the page as text (textContent, SVG text
// nodes), never as HTML. The API key lives in sessionStorage and travels in a header only.
"use strict";

const KEY = "triedec-api-key";
const KNOWN = new Set(["model", "context", "prompt", "recycling", "store", "lookahead", "grammar", "draft"]);
const $ = (id) => document.getElementById(id);
const state = { info: null, history: [], busy: false, selected: null };

function originClass(origin) { return "o-" + (KNOWN.has(origin) ? origin : "unknown"); }

function keysRequired() {
  const meta = document.querySelector('meta[name="triedec-keys"]');
  return meta !== null && meta.content === "required";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return response.status + ": " + body.error.message;
  } catch (e) { /* not JSON */ }
  return "HTTP " + response.status;
}

function askForKey() {
  $("key-dialog").hidden = false;
  $("key-input").focus();
}

async function loadInfo() {
  if (keysRequired() && !sessionStorage.getItem(KEY)) { askForKey(); return; }
  const response = await fetch("/triedec/info", { headers: headers() });
  if (!response.ok) {
    showError(await errorOf(response));
    if (response.status === 401) askForKey();
    return;
  }
  showError("");
  $("key-dialog").hidden = true;
  $("key-open").hidden = !keysRequired();
  state.info = await response.json();
  $("model").textContent = state.info.model;
  $("exactness").textContent = state.info.exactness;
  $("max-tokens").max = String(state.info.max_tokens_limit);
  fillMethods();
  fillLegend();
}

function fillMethods() {
  const select = $("method");
  select.replaceChildren();
  for (const m of state.info.methods) {
    const option = document.createElement("option");
    option.value = m.name;
    option.textContent = m.name;
    select.appendChild(option);
  }
  select.value = state.info.method;
  fillOptions();
}

function currentMethod() { return state.info.methods.find((m) => m.name === $("method").value); }

function fillOptions() {
  const m = currentMethod();
  $("method-description").textContent = m.description;
  const box = $("options");
  box.replaceChildren();
  const legend = document.createElement("legend");
  legend.textContent = "Options";
  box.appendChild(legend);
  const defaults = m.name === state.info.method ? state.info.method_options : {};
  for (const o of m.options) {
    const label = document.createElement("label");
    const input = document.createElement("input");
    input.dataset.option = o.name;
    input.dataset.type = o.type;
    const value = o.name in defaults ? defaults[o.name] : o.default;
    if (o.type === "bool") {
      input.type = "checkbox";
      input.checked = Boolean(value);
      label.className = "check";
      label.append(input, " " + o.name);
    } else {
      input.type = o.type.startsWith("int") || o.type.startsWith("float") ? "number" : "text";
      if (o.type.startsWith("float")) input.step = "any";
      if (o.maximum !== null) input.max = String(o.maximum);
      input.placeholder = value === null ? "auto" : String(value);
      if (value !== null && value !== o.default) input.value = String(value);
      label.append(o.name + (o.maximum !== null ? " (≤ " + o.maximum + ")" : ""), input);
    }
    box.appendChild(label);
  }
  $("compare").disabled = m.equals !== "greedy";
  if (m.equals !== "greedy") $("compare").checked = false;
}

function methodOptions() {
  const out = {};
  for (const input of $("options").querySelectorAll("input[data-option]")) {
    const o = currentMethod().options.find((x) => x.name === input.dataset.option);
    if (input.type === "checkbox") {
      if (input.checked !== Boolean(o.default)) out[o.name] = input.checked;
    } else if (input.value !== "") {
      out[o.name] = input.type === "number" ? Number(input.value) : input.value;
    }
  }
  return out;
}

function fillLegend() {
  const list = $("legend");
  list.replaceChildren();
  for (const [origin, meaning] of Object.entries(state.info.origins)) {
    const item = document.createElement("li");
    const swatch = document.createElement("span");
    swatch.className = "swatch tok " + originClass(origin);
    swatch.textContent = origin;
    item.append(swatch, meaning);
    item.title = meaning;
    list.appendChild(item);
  }
}

// ---- one answer -------------------------------------------------------------------------------

function newMessage(who, parent) {
  const box = document.createElement("div");
  box.className = "message " + (who === "you" ? "user" : "assistant");
  const label = document.createElement("div");
  label.className = "who";
  label.textContent = who;
  const body = document.createElement("div");
  body.className = "body";
  box.append(label, body);
  (parent || $("messages")).appendChild(box);
  return box;
}

class Answer {
  constructor(box, method) {
    this.box = box;
    this.body = box.querySelector(".body");
    this.method = method;
    this.steps = [];
    this.tokens = [];
    this.final = null;
    this.started = performance.now();
  }

  addStep(step, logprobs) {  // logprobs: the step's tokens' entries (OpenAI's chat shape), or null
    this.steps.push(step);
    const accepted = step.tokens.length;
    step.tokens.forEach((token, i) => {
      const span = document.createElement("span");
      const origin = step.origins[i];
      span.className = "tok " + originClass(origin);
      span.dataset.origin = origin;
      span.dataset.step = String(step.step);
      span.dataset.token = String(token);
      span.textContent = step.text[i];
      const drafts = step.origins.filter((o) => o !== "model").length;
      span.title = "step " + step.step + " · this step produced " + accepted + " token" + (accepted === 1 ? "" : "s") +
        " (" + drafts + " accepted draft" + (drafts === 1 ? "" : "s") + ") · origin: " + origin;
      const entry = logprobs && logprobs[i];
      if (entry) {
        span.dataset.logprob = String(entry.logprob);
        span.title += " · logprob " + entry.logprob.toFixed(3) + " (p " + Math.exp(entry.logprob).toFixed(3) + ")";
        if (entry.top_logprobs.length) {
          span.title += " · likeliest: " + entry.top_logprobs.map(
            (t) => JSON.stringify(t.token) + " " + t.logprob.toFixed(2)).join(", ");
        }
      }
      span.addEventListener("click", () => this.select(step, span));
      this.body.appendChild(span);
      this.tokens.push(token);
    });
    if (step.tree) drawTree(step, this.method);
  }

  addText(text) {  // text the stream held back until the end (a partial character or stop string)
    const span = document.createElement("span");
    span.className = "tail";
    span.textContent = text;
    this.body.appendChild(span);
  }

  select(step, span) {
    if (state.selected) state.selected.classList.remove("selected");
    span.classList.add("selected");
    state.selected = span;
    if (step.tree) {
      drawTree(step, this.method);
    } else {
      $("tree").replaceChildren();
      $("tree-title").textContent = "Step " + step.step + ": the prefill's forward chose this token (no tree)";
    }
  }

  get seconds() { return (performance.now() - this.started) / 1000; }

  finish(ext) {
    this.final = ext;
    this.box.dataset.stats = JSON.stringify({ accepted_by_origin: ext.accepted_by_origin,
      accepted_per_step: ext.accepted_per_step, new_tokens: ext.new_tokens, tokens_per_s: ext.tokens_per_s });
    this.box.dataset.tokens = JSON.stringify(this.tokens);
    this.box.dataset.done = "true";
  }
}

async function stream(messages, method, options, sampling, answer) {
  const body = { messages, stream: true, trace: true, method, method_options: options, ...sampling };
  if (method !== "beam") Object.assign(body, { logprobs: true, top_logprobs: 5 });  // beam reports none
  const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  if (!response.ok) throw new Error(await errorOf(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const ext = chunk.triedec || {};
      const choice = chunk.choices && chunk.choices[0];
      if (ext.trace) {
        const logprobs = choice && choice.logprobs ? choice.logprobs.content.slice() : null;
        for (const step of ext.trace) answer.addStep(step, logprobs && logprobs.splice(0, step.tokens.length));
      } else if (choice && choice.delta && choice.delta.content) {
        answer.addText(choice.delta.content);
      }
      if (choice && choice.finish_reason) answer.finish(ext);
      if (answer === state.live) liveFigures(answer);
    }
  }
}

function sampling() {
  const out = { max_tokens: Number($("max-tokens").value) || 128 };
  out.temperature = Number($("temperature").value) || 0;
  out.top_p = Number($("top-p").value) || 1;
  if ($("seed").value !== "") out.seed = Number($("seed").value);
  const schema = $("schema").value.trim();  // the server checks it: a bad schema is its 400, shown as any error
  if (schema) out.guided_json = schema;
  return out;
}

async function send() {
  const text = $("prompt").value;
  if (!text.trim() || state.busy || !state.info) return;
  state.busy = true;
  $("send").disabled = true;
  showError("");
  $("compare-result").hidden = true;
  const method = $("method").value;
  const options = methodOptions();
  const params = sampling();
  const compare = $("compare").checked;
  if (compare && params.seed === undefined) params.seed = Math.floor(Math.random() * 2 ** 31);
  const user = newMessage("you");
  user.querySelector(".body").textContent = text;
  const messages = [...state.history, { role: "user", content: text }];
  try {
    let main;
    if (compare) {
      const pair = document.createElement("div");
      pair.className = "pair";
      $("messages").appendChild(pair);
      const base = new Answer(newMessage("ar", pair), "ar");
      main = new Answer(newMessage(method, pair), method);
      state.live = base;
      await stream(messages, "ar", {}, params, base);
      state.live = main;
      await stream(messages, method, options, params, main);
      showComparison(base, main);
    } else {
      main = new Answer(newMessage(method), method);
      state.live = main;
      await stream(messages, method, options, params, main);
    }
    liveFigures(main);
    $("prompt").value = "";
    state.history = [...messages, { role: "assistant", content: main.body.textContent }];
  } catch (e) {
    showError(e.message);
  } finally {
    state.busy = false;
    $("send").disabled = false;
  }
}

function showComparison(base, main) {
  const a = base.tokens, b = main.tokens;
  let first = -1;
  for (let i = 0; i < Math.max(a.length, b.length); i++) {
    if (a[i] !== b[i]) { first = i; break; }
  }
  const box = $("compare-result");
  box.hidden = false;
  box.dataset.equal = String(first < 0);
  box.className = first < 0 ? "equal" : "different";
  const ratio = base.final && main.final && base.final.tokens_per_s > 0 ?
    (main.final.tokens_per_s / base.final.tokens_per_s).toFixed(2) + "x ar's tokens/s" : "";
  box.dataset.ratio = ratio;
  box.textContent = first < 0 ?
    "equal: the same " + a.length + " tokens as ar. " + main.method + ": " + ratio :
    "different: first at token " + first + " (ar " + a.length + " tokens, " + main.method + " " + b.length + ")";
}

function liveFigures(answer) {
  const steps = answer.steps.filter((s) => s.step > 0);
  const tokens = steps.reduce((n, s) => n + s.tokens.length, 0);
  $("tpf").textContent = steps.length ? (tokens / steps.length).toFixed(2) : "–";
  const tps = answer.final ? answer.final.tokens_per_s : answer.tokens.length / answer.seconds;
  $("tps").textContent = tps.toFixed(1);
  $("steps").textContent = String(steps.length);
  // the prompt's tokens whose KV came from the prefix trie (an earlier turn's, a document's) of all of them
  $("cached").textContent = answer.final && answer.final.cached_tokens !== undefined ?
    answer.final.cached_tokens + " of " + (answer.final.prompt_tokens ?? "?") : "–";
  const counts = {};
  for (const s of answer.steps) for (const o of s.origins) counts[o] = (counts[o] || 0) + 1;
  const list = $("origin-counts");
  list.replaceChildren();
  for (const [origin, n] of Object.entries(counts).sort((x, y) => y[1] - x[1])) {
    const item = document.createElement("li");
    item.dataset.origin = origin;
    item.dataset.count = String(n);
    const swatch = document.createElement("span");
    swatch.className = "swatch tok " + originClass(origin);
    swatch.textContent = origin;
    item.append(swatch, String(n) + " token" + (n === 1 ? "" : "s"));
    list.appendChild(item);
  }
  drawChart(steps.map((s) => s.tokens.length));
}

// ---- pictures ---------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function drawChart(values) {
  const svg = $("chart");
  svg.replaceChildren();
  const width = 300, height = 80, top = Math.max(1, ...values);
  const bar = Math.max(1, Math.min(12, width / Math.max(1, values.length)));
  values.slice(-Math.floor(width / bar)).forEach((v, i) => {
    const h = (v / top) * (height - 14);
    svg.appendChild(svgEl("rect", { class: "bar", x: i * bar, y: height - h, width: Math.max(1, bar - 1), height: h }));
  });
  svg.appendChild(svgEl("text", { x: 2, y: 10 }, "max " + top));
}

function drawTree(step, method) {
  const tree = step.tree;
  const svg = $("tree");
  svg.replaceChildren();
  const n = tree.tokens.length;
  const kids = Array.from({ length: n }, () => []);
  const depth = new Array(n).fill(0);
  for (let i = 1; i < n; i++) { kids[tree.parents[i]].push(i); depth[i] = depth[tree.parents[i]] + 1; }
  const row = new Array(n).fill(0);
  let rows = 0;
  const order = [0];
  while (order.length) {  // depth-first: each leaf gets a row of its own
    const i = order.pop();
    if (kids[i].length === 0) row[i] = rows++;
    for (let k = kids[i].length - 1; k >= 0; k--) order.push(kids[i][k]);
  }
  for (let i = n - 1; i >= 0; i--) if (kids[i].length) row[i] = row[kids[i][0]];  // a parent on its first child's row
  const accepted = new Set(tree.accepted);
  const dx = 92, dy = 22, w = 84, h = 17;
  const width = (Math.max(...depth) + 1) * dx + 10, height = Math.max(rows, 1) * dy + 10;
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const pos = (i) => [5 + depth[i] * dx, 5 + row[i] * dy];
  for (let i = 1; i < n; i++) {
    const [x0, y0] = pos(tree.parents[i]), [x1, y1] = pos(i);
    const on = accepted.has(i) && accepted.has(tree.parents[i]);
    svg.appendChild(svgEl("path", { class: "edge" + (on ? " accepted" : ""),
      d: `M${x0 + w} ${y0 + h / 2} C${x0 + w + 6} ${y0 + h / 2} ${x1 - 6} ${y1 + h / 2} ${x1} ${y1 + h / 2}` }));
  }
  for (let i = 0; i < n; i++) {
    const [x, y] = pos(i);
    const sources = tree.sources[i];
    const origin = sources.length ? sources[0] : "model";
    const g = svgEl("g", { "data-node": i, "data-accepted": String(accepted.has(i)) });
    g.appendChild(svgEl("rect", { class: "node " + originClass(origin) + (accepted.has(i) ? " accepted" : ""),
      x, y, width: w, height: h, rx: 3 }));
    const label = (accepted.has(i) && i > 0 ? "✓ " : "") + JSON.stringify(tree.texts ? tree.texts[i] : tree.tokens[i]);
    g.appendChild(svgEl("text", { x: x + 3, y: y + 12 }, label.length > 14 ? label.slice(0, 13) + "…" : label));
    g.appendChild(svgEl("title", {}, "token " + tree.tokens[i] + (i === 0 ? " (root: the last committed token)" :
      " · drafted by " + (sources.join(", ") || "nothing")) + (accepted.has(i) ? " · accepted" : "")));
    svg.appendChild(g);
  }
  $("tree-title").textContent = (method === "beam" ? "Live hypotheses after step " : "Tree of step ") + step.step +
    " (" + n + " nodes, " + (tree.accepted.length - 1) + (method === "beam" ? " on the best beam)" : " accepted" +
    (tree.pruned ? "; " + tree.pruned + " drafted node" + (tree.pruned === 1 ? "" : "s") +
     " pruned by the grammar before the forward" : "") + ")");
}

// ---- wiring -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("method").addEventListener("change", fillOptions);
  $("send").addEventListener("click", send);
  $("clear").addEventListener("click", () => { state.history = []; $("messages").replaceChildren(); });
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(); });
  $("key-open").addEventListener("click", askForKey);
  $("key-save").addEventListener("click", () => {
    sessionStorage.setItem(KEY, $("key-input").value.trim());
    $("key-input").value = "";
    loadInfo().catch((e) => showError(e.message));
  });
  loadInfo().catch((e) => showError(e.message));
});
