// The compare tab: one message to two to four panes, each streaming from its own attention
// configuration, with the server's live numbers per pane (the `gen` field of each chunk, asked for
// with stream_options.include_stats) and a shared live chart. A pane picks one of the server's fixed
// configurations or one that takes a number (hybrid auto:K, window W: `custom` in /web/config), checked
// here against its bounds and then by the server, whose 400 is shown in the pane. The API key (when the server has one)
// is kept in sessionStorage and sent as `Authorization: Bearer`.
"use strict";

(() => {
  const KEY = "gen.apiKey";
  const MIN_PANES = 2, MAX_PANES = 4;
  const $ = (sel, root = document) => root.querySelector(sel);
  const page = {config: null, panes: [], ready: false};
  window.gen = page;   // the page's state, for scripts (and the browser test): panes, their points and text

  class KeyNeeded extends Error {}
  const RETRY_S = 3;   // seconds between tries to read /web/config
  class Invalid extends Error {}   // a pane's number the page refuses before asking the server

  // ---------------------------------------------------------------- the server
  async function api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    const key = sessionStorage.getItem(KEY);
    if (key) headers.Authorization = "Bearer " + key;
    let r;
    try {
      r = await fetch(path, Object.assign({}, options, {headers}));
    } catch (e) {   // the browser's words ("Failed to fetch") say neither what failed nor what to do
      if (e.name === "AbortError") throw e;
      throw new Error(`Could not reach the server at ${location.origin} (${e.message}): is gen serve still running?`);
    }
    if (r.status === 401) {
      const why = await errorText(r);   // a key sent and refused: a typo, or the server's key changed
      askKey(key ? `The server refused the key this tab sent (${why}): enter the one given to gen serve --api-key` : why);
      throw new KeyNeeded("the server asks for an API key");
    }
    return r;
  }

  async function errorText(r) {
    try {
      const body = await r.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (e) {
      return `HTTP ${r.status} ${r.statusText}`;
    }
  }

  function notice(text) {
    const el = $("#notice");
    el.textContent = text || "";
    el.hidden = !text;
  }

  // ---------------------------------------------------------------- the key
  function askKey(message) {
    $("#key-form").hidden = false;
    $("#key-note").textContent = message || "kept in this tab only (sessionStorage)";
    $("#key-input").focus();
  }

  function setupKey() {
    $("#key-button").onclick = () => {
      const form = $("#key-form");
      form.hidden = !form.hidden;
      if (!form.hidden) $("#key-input").focus();
    };
    $("#key-form").onsubmit = ev => {
      ev.preventDefault();
      const key = $("#key-input").value.trim();
      if (/[^\x20-\x7e]/.test(key)) {   // an HTTP header carries it: printable ASCII (gen serve's rule too)
        $("#key-note").textContent = "an API key is printable ASCII (no \u201csmart\u201d quotes or other symbols): check it was pasted as given";
        return;
      }
      if (key) sessionStorage.setItem(KEY, key);
      $("#key-input").value = "";
      $("#key-form").hidden = true;
      if (!page.ready) start();
    };
    $("#key-forget").onclick = () => {
      sessionStorage.removeItem(KEY);
      $("#key-note").textContent = "forgotten";
    };
  }

  // ---------------------------------------------------------------- panes
  class Pane {
    constructor(configId) {
      this.el = $("#pane-template").content.firstElementChild.cloneNode(true);
      this.select = $(".config", this.el);
      this.param = $(".param", this.el);
      const option = (c, parent) => {
        const o = document.createElement("option");
        o.value = c.id;
        o.textContent = c.label;
        parent.appendChild(o);
      };
      for (const c of page.config.configurations) option(c, this.select);
      if (allConfigurations().length > page.config.configurations.length) {
        const group = document.createElement("optgroup");
        group.label = "with a number";
        for (const c of page.config.custom) option(c, group);
        this.select.appendChild(group);
      }
      this.select.value = configId;
      this.select.addEventListener("change", () => { this.bindParam(); this.blank(); redraw(); });
      this.param.addEventListener("input", () => { this.checkParam(); redraw(); });
      this.bindParam();
      this.transcript = $(".transcript", this.el);
      this.history = [];          // chat: this pane's messages (its own answers)
      this.text = "";             // completion: this pane's prompt and answers so far
      this.points = [];           // {context, state_bytes, token_ms} per chunk of the current turn
      this.stats = null;          // the last `gen` field
      this.answer = "";           // the current turn's answer
      this.finish = null;
      this.controller = null;
      this.turns = 0;             // counts the pane's clears: a turn cleared while it ran leaves the pane alone
      $(".remove", this.el).onclick = () => removePane(this);
      this.setStatus("idle");
    }

    get configuration() {
      return allConfigurations().find(c => c.id === this.select.value);
    }

    // the number input beside the picker: shown, bounded and preset for a configuration that takes one
    bindParam() {
      const p = this.configuration.param;
      this.param.hidden = !p;
      if (!p) return;
      const list = p.format === "list";   // layer numbers, comma-separated: a text box
      this.param.type = list ? "text" : "number";
      this.param.inputMode = list ? "text" : "numeric";
      this.param.classList.toggle("list", list);
      this.param.min = p.min;
      if (p.max === null) this.param.removeAttribute("max"); else this.param.max = p.max;
      this.param.setAttribute("aria-label", p.name);
      this.param.dataset.name = p.name;
      if (this.param.dataset.for !== this.configuration.id) {
        this.param.value = p.value;
        this.param.dataset.for = this.configuration.id;
      }
      this.checkParam();
    }

    // the pane's number (a list of layers: the numbers), or an Invalid error saying what it must be
    paramValue() {
      const p = this.configuration.param, raw = this.param.value.trim();
      if (p.format === "list") {
        const layers = /^\d+(\s*,\s*\d+)*$/.test(raw) ? raw.split(",").map(Number) : [];
        if (!layers.length || layers.some(i => i < p.min || i > p.max) || new Set(layers).size !== layers.length)
          throw new Invalid(`${p.name} must list distinct layers from ${p.min} to ${p.max}, comma-separated ` +
                            `(${p.title}); got ${JSON.stringify(raw)}`);
        return layers;
      }
      const v = /^\d+$/.test(raw) ? Number(raw) : NaN;
      if (!(v >= p.min && (p.max === null || v <= p.max))) {
        const range = p.max === null ? `at least ${p.min}` : `from ${p.min} to ${p.max}`;
        throw new Invalid(`${p.name} must be a whole number ${range} (${p.title}); got ${JSON.stringify(raw)}`);
      }
      return v;
    }

    checkParam() {
      try {
        this.paramValue();
        this.param.removeAttribute("aria-invalid");
        this.param.title = this.configuration.param.title;
      } catch (e) {
        this.param.setAttribute("aria-invalid", "true");
        this.param.title = e.message;
      }
    }

    // what this pane is, as its legend says it: a configuration's label, its number filled in
    get label() {
      const c = this.configuration;
      if (!c.param) return c.label;
      const v = this.param.value.trim() || "?";
      return c.label.replace(new RegExp(`\\b${c.param.name}\\b`), v);
    }

    // the request fields of this pane's run (a request carries its whole run: attention, softmax_layers, window)
    runFields() {
      const c = this.configuration, out = {};
      if (c.attention) out.attention = c.attention;
      if (c.softmax_layers) out.softmax_layers = c.softmax_layers;
      if (c.window) out.window = c.window;
      if (c.param) {
        const v = this.paramValue();
        out[c.param.field] = c.param.format && c.param.format !== "list" ? c.param.format.replace("{}", v) : v;
      }
      return out;
    }

    setStatus(status, detail) {
      this.status = status;
      this.el.dataset.status = status;
      $(".status", this.el).textContent = detail || (status === "idle" ? "" : status);
      this.select.disabled = this.param.disabled = status === "streaming";
    }

    bubble(role, text) {
      const div = document.createElement("div");
      div.className = `msg ${role}`;
      div.textContent = text;
      this.transcript.appendChild(div);
      this.transcript.scrollTop = this.transcript.scrollHeight;
      return div;
    }

    show(stats) {
      const fmt = {
        tokens_per_s: v => v.toFixed(1),
        ttft_ms: v => `${v.toFixed(0)} ms`,
        ms_per_token: v => v.toFixed(2),
        state_bytes: v => GenChart.bytes(v),
        context: v => String(v),
      };
      for (const [name, f] of Object.entries(fmt)) {
        const dd = $(`[data-stat="${name}"]`, this.el), v = stats[name];
        if (v === null || v === undefined) {   // not measured this turn (one token: no ms/token): not the last turn's
          dd.textContent = "\u2013";
          delete dd.dataset.value;
          continue;
        }
        dd.textContent = f(v);
        dd.dataset.value = v;
      }
      $('[data-stat="state_bytes"]', this.el).title =
        `${stats.state_bytes} bytes: this row at ${stats.state_tokens} tokens (${stats.attention}); ` +
        `the whole ${stats.attention} batch: ${GenChart.bytes(stats.batch_state_bytes)} for ${stats.batch_rows} row(s)`;
      $('[data-stat="context"]', this.el).title =
        `${stats.prompt_tokens} prompt + ${stats.completion_tokens} generated tokens`;
    }

    async run(message) {
      const cfg = page.config;
      let fields;
      try {
        fields = this.runFields();
      } catch (e) {
        if (!(e instanceof Invalid)) throw e;
        this.bubble("user", message);
        this.bubble("error", e.message);   // this pane sits the turn out; its conversation is unchanged
        this.setStatus("error", "error");
        this.param.focus();
        return;
      }
      const body = Object.assign({model: cfg.model, stream: true, stream_options: {include_usage: true, include_stats: true},
                                  max_tokens: intValue("#max-tokens"), temperature: floatValue("#temperature", 0)}, fields);
      if ($("#ignore-eos").checked) body.ignore_eos = true;
      let url;
      if (cfg.chat) {
        this.history.push({role: "user", content: message});
        body.messages = this.history.slice();
        url = "/v1/chat/completions";
      } else {
        this.text += message;
        body.prompt = this.text;
        url = "/v1/completions";
      }
      this.bubble("user", message);
      const out = this.bubble("assistant", "");
      this.answer = "";
      this.finish = null;
      this.points = [];
      this.blank();
      this.controller = new AbortController();
      const turn = this.turns;
      this.setStatus("streaming");
      redraw();
      let failed = false;
      try {
        const r = await api(url, {method: "POST", headers: {"Content-Type": "application/json"},
                                  body: JSON.stringify(body), signal: this.controller.signal});
        if (!r.ok) throw new Error(await errorText(r));
        await readEvents(r, obj => this.chunk(obj, out));
        const full = this.finish === "length" && this.stats && this.stats.attention !== "linear" &&
          this.stats.context >= cfg.max_context;   // a KV cache stops at the server's --max-context
        this.setStatus("done", full ? `done (context limit ${cfg.max_context})` : this.finish ? `done (${this.finish})` : "done");
      } catch (e) {
        if (turn !== this.turns) return;   // cleared while it ran: the pane is no longer this turn's
        if (e.name === "AbortError") this.setStatus("stopped");
        else {
          failed = true;
          this.setStatus("error", "error");
          this.bubble("error", e.message);   // the server's one line (a 400: what this model cannot run)
        }
      } finally {
        if (turn === this.turns) {
          this.controller = null;
          this.render();   // the last numbers are shown by the time the status says the answer ended
          if (failed && !this.answer) {   // nothing came back: the turn is not in this pane's conversation
            if (cfg.chat) this.history.pop();
            else this.text = this.text.slice(0, this.text.length - message.length);
          } else if (cfg.chat) this.history.push({role: "assistant", content: this.answer});
          else this.text += this.answer;
          redraw();
        }
      }
    }

    // a fresh conversation: the turn running (if any) stops and is forgotten (it ends in no status,
    // no answer kept)
    clear() {
      this.stop();
      this.turns += 1;
      this.controller = null;
      this.history = [];
      this.text = "";
      this.points = [];
      this.blank();
      this.transcript.textContent = "";
      this.setStatus("idle");
    }

    // one chunk: the text grows (one text node, appended to), the numbers and points are kept; what is
    // shown follows once per frame (render), however many chunks arrive in between
    chunk(obj, out) {
      if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
      const choice = obj.choices && obj.choices[0];
      if (choice) {
        const piece = page.config.chat ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (piece) {
          this.answer += piece;
          if (!out.firstChild) out.appendChild(document.createTextNode(""));
          out.firstChild.appendData(piece);
          this.scroll = true;
        }
        if (choice.finish_reason) this.finish = choice.finish_reason;
      }
      if (obj.gen) {
        this.stats = obj.gen;
        this.fresh = true;
        const last = this.points[this.points.length - 1];
        if (!last || last.context !== obj.gen.context)   // the finish chunk repeats its token's numbers
          this.points.push({context: obj.gen.context, state_bytes: obj.gen.state_bytes, token_ms: obj.gen.token_ms});
      }
      redraw();
    }

    // the numbers shown back to "–": a new turn, a clear, another configuration (none of them the last turn's)
    blank() {
      this.stats = null;
      this.fresh = false;
      for (const dd of this.el.querySelectorAll("[data-stat]")) {
        dd.textContent = "\u2013";
        delete dd.dataset.value;
        dd.removeAttribute("title");
      }
    }

    render() {
      if (this.fresh) { this.show(this.stats); this.fresh = false; }
      if (this.scroll) { this.transcript.scrollTop = this.transcript.scrollHeight; this.scroll = false; }
    }

    stop() {
      if (this.controller) this.controller.abort();   // the connection closes: the server drops the row
    }
  }

  // Server-Sent Events from a fetch response: each `data:` payload (JSON) to `onData` until [DONE]; a
  // stream that breaks or ends before [DONE] is an error (the answer was cut, whatever it says)
  async function readEvents(response, onData) {
    const reader = response.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      let value, done;
      try {
        ({value, done} = await reader.read());
      } catch (e) {
        if (e.name === "AbortError") throw e;
        throw new Error(`The connection to the server broke before the answer ended (${e.message}): ` +
                        "is gen serve still running?");
      }
      if (done) throw new Error("The server's stream ended before the answer did (no `data: [DONE]`)");
      buffer += decoder.decode(value, {stream: true});
      let m;
      while ((m = /\r\n\r\n|\n\n|\r\r/.exec(buffer))) {
        const block = buffer.slice(0, m.index);
        buffer = buffer.slice(m.index + m[0].length);
        const data = block.split(/\r\n|\n|\r/).filter(l => l.startsWith("data:"))
          .map(l => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;            // a comment (ping) or an event with no data
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }

  function intValue(sel) {   // a whole number >= 1, else an Invalid error naming the field (0 ran as 128)
    const raw = $(sel).value.trim(), v = /^\d+$/.test(raw) ? Number(raw) : NaN;
    if (!(v >= 1)) throw new Invalid(`${$(sel).closest("label").textContent.trim()} must be a whole number >= 1, ` +
                                     `got ${JSON.stringify(raw)}`);
    return v;
  }

  function floatValue(sel, fallback) {
    const v = parseFloat($(sel).value);
    return Number.isFinite(v) && v >= 0 ? v : fallback;
  }

  function allConfigurations() {
    return page.config.configurations.concat(page.config.custom || []);
  }

  function addPane(configId) {
    if (page.panes.length >= MAX_PANES) return;
    const used = new Set(page.panes.map(p => p.select.value));
    const ids = allConfigurations().map(c => c.id);
    const pane = new Pane(configId || ids.find(id => id !== "default" && !used.has(id)) || "default");
    page.panes.push(pane);
    $("#panes").appendChild(pane.el);
    layout();
  }

  function removePane(pane) {
    if (page.panes.length <= MIN_PANES) return;
    pane.stop();
    page.panes.splice(page.panes.indexOf(pane), 1);
    pane.el.remove();
    layout();
  }

  function layout() {
    page.panes.forEach((p, i) => { p.el.dataset.slot = i; $(".swatch", p.el).className = `swatch s${i}`; });
    $("#panes").dataset.count = page.panes.length;
    $("#add-pane").disabled = page.panes.length >= MAX_PANES;
    for (const p of page.panes) $(".remove", p.el).disabled = page.panes.length <= MIN_PANES;
    redraw();
  }

  // ---------------------------------------------------------------- sending and stopping
  function busy() {
    return page.panes.some(p => p.status === "streaming");
  }

  function send() {
    const box = $("#prompt"), message = box.value;
    if (!message.trim()) return;
    if (!page.ready) {
      notice("The page has not read the server's configuration yet: wait a moment (the server may be starting).");
      return;
    }
    if (busy()) {
      notice("The panes are still answering: wait, or press Esc to stop them.");
      return;
    }
    try {
      intValue("#max-tokens");
    } catch (e) {
      if (!(e instanceof Invalid)) throw e;
      notice(e.message);   // the message stays in the box
      $("#max-tokens").focus();
      return;
    }
    notice("");
    box.value = "";
    for (const p of page.panes) p.run(message);
  }

  function stopAll() {
    for (const p of page.panes) p.stop();
  }

  function clearAll() {
    for (const p of page.panes) p.clear();
    redraw();
  }

  // ---------------------------------------------------------------- the live chart
  const CHART_POINTS = 400;   // per pane: a long answer is drawn from every n-th point (and the last)

  function thin(points) {
    const every = Math.ceil(points.length / CHART_POINTS);
    return every <= 1 ? points : points.filter((_, i) => i % every === 0 || i === points.length - 1);
  }

  let pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      for (const p of page.panes) p.render();
      const series = key => page.panes.map((p, i) => ({
        name: `${i + 1}: ${p.label}`, cls: `s${i}`,
        points: thin(p.points.filter(q => q[key] !== null && q[key] !== undefined)).map(q => ({x: q.context, y: q[key]})),
      }));
      GenChart.draw($("#live-bytes"), {series: series("state_bytes"), xlabel: "context (tokens)",
        ylabel: "state bytes (own row)", fmtY: GenChart.bytes, yunit: 1024, fmtX: GenChart.count, empty: "send a message"});
      GenChart.draw($("#live-ms"), {series: series("token_ms"), ylog: true, xlabel: "context (tokens)",
        ylabel: "ms per token", fmtY: v => (+v.toPrecision(3)).toString(), fmtX: GenChart.count,
        empty: "send a message"});
    });
  }

  // ---------------------------------------------------------------- tabs, keys, start
  function setupTabs() {
    const tabs = [["#tab-compare", "#compare"], ["#tab-bench", "#bench"]];
    for (const [tab, panel] of tabs) {
      $(tab).onclick = () => {
        for (const [t, p] of tabs) {
          $(t).setAttribute("aria-selected", String(t === tab));
          $(p).hidden = t !== tab;
        }
        if (panel === "#bench") GenBench.show();
      };
    }
  }

  function setupKeys() {
    $("#prompt").addEventListener("keydown", ev => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
        ev.preventDefault();
        send();
      }
    });
    document.addEventListener("keydown", ev => {
      if (ev.key === "Escape") stopAll();
    });
    $("#composer").onsubmit = ev => { ev.preventDefault(); send(); };
    $("#stop").onclick = stopAll;
    $("#clear").onclick = clearAll;
    $("#add-pane").onclick = () => { if (page.ready) addPane(); };
  }

  async function start() {
    if (page.ready || page.starting) return;   // (the key form and a retry may both call it)
    page.starting = true;
    try {
      const r = await api("/web/config");
      if (!r.ok) throw new Error(await errorText(r));
      page.config = await r.json();
    } catch (e) {
      page.starting = false;
      if (!(e instanceof KeyNeeded)) {   // a server still starting or restarting: try again until it answers
        notice(`Could not read the server's configuration: ${e.message} (trying again every ${RETRY_S} s)`);
        setTimeout(start, RETRY_S * 1000);
      }
      return;
    }
    page.starting = false;
    notice("");
    const cfg = page.config;
    $("#model").textContent = cfg.model;
    $("#mode").textContent = cfg.chat ? "chat (the model's template)"
      : "completion (no chat template): each send continues the pane's text";
    const ids = cfg.configurations.map(c => c.id);
    for (const id of ["softmax", "linear"]) addPane(ids.includes(id) ? id : "default");
    page.ready = true;
    $("#prompt").focus();
  }

  setupKey();
  setupTabs();
  setupKeys();
  GenBench.init(api);
  start();
})();
