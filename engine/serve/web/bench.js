// The bench tab: `gen bench --json` reports (the user's files, or those the server ships in docs/)
// drawn as the bench's two panels: decode ms/token and state bytes against context depth, log axes,
// hover values, the crossovers marked. Nothing is measured here: sweeps do not run in the server.
"use strict";

const GenBench = (() => {
  const $ = (sel, root = document) => root.querySelector(sel);
  const loaded = [];   // {name, report}
  let api = null, listed = false;

  function init(apiFetch) {
    api = apiFetch;
    $("#bench-files").onchange = async ev => {
      for (const file of ev.target.files) {
        try {
          add(file.name, JSON.parse(await file.text()));
        } catch (e) {
          problem(`${file.name}: ${e.message}`);
        }
      }
      ev.target.value = "";
    };
  }

  // the first time the tab is shown: the server's shipped files, as buttons
  async function show() {
    draw();
    if (listed) return;
    try {
      const r = await api("/web/bench");
      if (!r.ok) return;
      listed = true;
      const {files} = await r.json();
      const box = $("#shipped");
      box.textContent = files.length ? "or a shipped one: " : "";
      for (const f of files) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "quiet";
        b.textContent = f.name;
        b.title = `${f.model || "?"} on ${f.cpu || "?"}`;
        b.onclick = async () => {
          try {
            const got = await api("/web/bench/" + encodeURIComponent(f.name));
            if (!got.ok) throw new Error(`HTTP ${got.status}`);
            add(f.name, await got.json());
          } catch (e) {   // a key asked for (the compare tab's form opens), a server gone: said here
            problem(`${f.name}: ${e.message}`);
          }
        };
        box.appendChild(b);
      }
    } catch (e) { /* no key yet: the compare tab asks for it */ }
  }

  function problem(text) {
    const li = document.createElement("li");
    li.className = "error";
    li.textContent = text;
    $("#bench-loaded").appendChild(li);
  }

  // why `report` is not a bench report, or null
  function check(report) {
    const rs = report && report.results;
    if (!Array.isArray(rs) || !rs.length) return "no `results` list: not a `gen bench --json` report";
    for (const r of rs) {
      for (const k of ["context", "decode_ms_per_token", "state_bytes"]) {
        if (typeof r[k] !== "number") return `a result has no number \`${k}\`: not a \`gen bench --json\` report`;
      }
    }
    return null;
  }

  function add(name, report) {
    const why = check(report);
    if (why) { problem(`${name}: ${why}`); return; }
    const i = loaded.findIndex(f => f.name === name);
    if (i >= 0) loaded.splice(i, 1);
    loaded.push({name, report});
    list();
    draw();
  }

  function list() {
    const ul = $("#bench-loaded");
    ul.textContent = "";
    for (const f of loaded) {
      const li = document.createElement("li"), s = f.report.settings || {}, m = s.machine || {};
      li.textContent = `${f.name}: ${s.model || "?"}, ${m.cpu || "?"}, ${m.threads || "?"} thread(s), ${s.dtype || "?"} `;
      const x = document.createElement("button");
      x.type = "button";
      x.className = "quiet";
      x.textContent = "remove";
      x.onclick = () => { loaded.splice(loaded.indexOf(f), 1); list(); draw(); };
      li.appendChild(x);
      ul.appendChild(li);
    }
  }

  const label = r => r.configuration || r.attention;
  const entry = r => r.entry || r.attention;

  // the first depth where linear decodes faster than softmax, log-interpolated (engine.bench.report)
  function crossover(results) {
    const soft = {}, lin = {};
    for (const r of results) {
      if (entry(r) === "softmax") soft[r.context] = r.decode_ms_per_token;
      if (entry(r) === "linear") lin[r.context] = r.decode_ms_per_token;
    }
    const common = Object.keys(soft).filter(c => c in lin).map(Number).sort((a, b) => a - b);
    let prev = null;
    for (const c of common) {
      const gap = lin[c] - soft[c];
      if (gap < 0) {
        if (!prev) return c;
        const t = prev[1] / (prev[1] - gap);
        return Math.round(Math.exp(Math.log(prev[0]) + t * (Math.log(c) - Math.log(prev[0]))));
      }
      prev = [c, gap];
    }
    return null;
  }

  function draw() {
    const ms = [], bytes = [], msMarks = [], byteMarks = [];
    const many = loaded.length > 1;
    let k = 0;
    for (const f of loaded) {
      const groups = new Map();
      for (const r of [...f.report.results].sort((a, b) => a.context - b.context)) {
        const name = label(r) + (r.feature_map ? ` (${r.feature_map})` : "");
        if (!groups.has(name)) groups.set(name, []);
        groups.get(name).push(r);
      }
      for (const [name, rs] of groups) {
        const shown = many ? `${f.name}: ${name}` : name, cls = `s${k++ % 8}`;
        ms.push({name: shown, cls, points: rs.map(r => ({x: r.context, y: r.decode_ms_per_token}))});
        bytes.push({name: shown, cls, points: rs.map(r => ({x: r.context, y: r.state_bytes}))});
      }
      const summary = f.report.summary || {}, pre = many ? `${f.name}: ` : "";
      const cross = summary.decode_crossover ? summary.decode_crossover.estimate : crossover(f.report.results);
      if (cross) msMarks.push({x: cross, label: `${pre}crossover ~${cross}`, cls: "cross"});
      if (summary.memory_crossover_slots) {
        byteMarks.push({x: summary.memory_crossover_slots, label: `${pre}memory crossover ${summary.memory_crossover_slots}`,
                        cls: "memcross"});
      }
    }
    const empty = "open a bench file";
    GenChart.draw($("#bench-ms"), {series: ms, xlog: true, xbase: 2, ylog: true, marks: msMarks,
      xlabel: "context depth (tokens)", ylabel: "decode ms per token", fmtX: GenChart.count,
      fmtY: v => (+v.toPrecision(3)).toString(), empty});
    GenChart.draw($("#bench-bytes"), {series: bytes, xlog: true, xbase: 2, ylog: true, marks: byteMarks,
      ybase: 2, xlabel: "context depth (tokens)", ylabel: "state bytes", fmtX: GenChart.count, fmtY: GenChart.bytes, empty});
  }

  return {init, show, add, loaded};
})();
