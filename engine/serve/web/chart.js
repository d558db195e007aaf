// A small SVG line chart: series of (x, y) points, linear or log axes, vertical marks, hover values.
// GenChart.draw(svg, {series: [{name, cls, points: [{x, y}]}], xlog, ylog, xbase, ybase, yunit, xlabel,
//                     ylabel, fmtX, fmtY, marks: [{x, label, cls}], empty})
// xbase/ybase: a log axis's ticks are powers of it (default 10); yunit: a linear y axis's ticks are
// round multiples of the largest power of it below the top (1024: bytes in KiB, MiB, ...).
// Colours come from style.css (classes s0..s7), so light and dark themes both apply.
"use strict";

const GenChart = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 480, H = 270, BASE = {l: 62, r: 14, t: 12, b: 44};   // margins (the top grows with the legend)

  function el(name, attrs, parent, text) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }

  function niceStep(span, count) {
    const raw = span / Math.max(count, 1), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * mag >= raw) return m * mag;
    return 10 * mag;
  }

  function linTicks(lo, hi, unit) {
    if (unit) {
      const u = Math.pow(unit, Math.max(0, Math.floor(Math.log(Math.max(Math.abs(hi), 1)) / Math.log(unit))));
      return linTicks(lo / u, hi / u).map(v => v * u);
    }
    const step = niceStep(hi - lo, 5), out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
    return out;
  }

  function logTicks(lo, hi, base) {
    const out = [];
    for (let k = Math.ceil(Math.log(lo) / Math.log(base) - 1e-9); Math.pow(base, k) <= hi * (1 + 1e-9); k++) {
      out.push(Math.pow(base, k));
    }
    if (out.length < 2 && base === 10) return logTicks(lo, hi, 2);
    const every = Math.ceil(out.length / 7);
    return out.filter((_, i) => i % every === 0);
  }

  // the range of the values, widened to something drawable
  function extent(values, log, zero) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (log) {
      lo = Math.max(lo, Number.MIN_VALUE);
      if (hi <= lo) { lo /= 2; hi = lo * 4; }
      return [lo / 1.15, hi * 1.15];
    }
    if (zero) lo = Math.min(lo, 0);
    if (hi <= lo) { hi = lo + (Math.abs(lo) || 1); }
    const pad = (hi - lo) * 0.06;
    return [zero && lo === 0 ? 0 : lo - pad, hi + pad];
  }

  function scale(lo, hi, a, b, log) {
    if (log) {
      const l0 = Math.log(lo), l1 = Math.log(hi);
      return v => a + (Math.log(v) - l0) / (l1 - l0) * (b - a);
    }
    return v => a + (v - lo) / (hi - lo) * (b - a);
  }

  function draw(svg, opt) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    const fmtX = opt.fmtX || String, fmtY = opt.fmtY || String;
    const series = (opt.series || []).map(s => ({...s, points: s.points.filter(p =>
      Number.isFinite(p.x) && Number.isFinite(p.y) && (!opt.xlog || p.x > 0) && (!opt.ylog || p.y > 0))}));
    const all = series.flatMap(s => s.points);
    const items = opt.legend === false || !all.length ? [] : legendItems(series);
    const M = {...BASE, t: BASE.t + (items.length ? items[items.length - 1].row + 1 : 0) * 13};
    el("text", {x: M.l + (W - M.l - M.r) / 2, y: H - 6, class: "label", "text-anchor": "middle"}, svg, opt.xlabel || "");
    el("text", {x: 12, y: M.t + (H - M.t - M.b) / 2, class: "label", "text-anchor": "middle",
                transform: `rotate(-90 12 ${M.t + (H - M.t - M.b) / 2})`}, svg, opt.ylabel || "");
    if (!all.length) {
      el("text", {x: W / 2, y: H / 2, class: "label", "text-anchor": "middle"}, svg, opt.empty || "no data yet");
      return;
    }
    const marks = (opt.marks || []).filter(m => Number.isFinite(m.x) && (!opt.xlog || m.x > 0));
    const [x0, x1] = extent(all.map(p => p.x).concat(marks.map(m => m.x)), opt.xlog, false);
    const [y0, y1] = extent(all.map(p => p.y), opt.ylog, !opt.ylog);
    const sx = scale(x0, x1, M.l, W - M.r, opt.xlog), sy = scale(y0, y1, H - M.b, M.t, opt.ylog);

    const grid = el("g", {class: "grid"}, svg), axis = el("g", {class: "axis"}, svg);
    const xt = opt.xlog ? logTicks(x0, x1, opt.xbase || 10) : linTicks(x0, x1);
    const yt = opt.ylog ? logTicks(y0, y1, opt.ybase || 10) : linTicks(y0, y1, opt.yunit);
    for (const v of xt) {
      el("line", {x1: sx(v), x2: sx(v), y1: M.t, y2: H - M.b}, grid);
      el("text", {x: sx(v), y: H - M.b + 14, "text-anchor": "middle"}, axis, fmtX(v));
    }
    for (const v of yt) {
      el("line", {x1: M.l, x2: W - M.r, y1: sy(v), y2: sy(v)}, grid);
      el("text", {x: M.l - 5, y: sy(v) + 3, "text-anchor": "end"}, axis, fmtY(v));
    }
    el("rect", {x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, class: "frame"}, svg);
    for (const m of marks) {
      el("line", {x1: sx(m.x), x2: sx(m.x), y1: M.t, y2: H - M.b, class: "mark " + (m.cls || "")}, svg);
      el("text", {x: sx(m.x) + 3, y: H - M.b - 5, class: "marklabel"}, svg, m.label || "");
    }
    const dots = [];
    series.forEach((s, i) => {
      const cls = s.cls || `s${i % 8}`;
      if (s.points.length > 1) {
        el("polyline", {class: `line ${cls}`, points: s.points.map(p => `${sx(p.x)},${sy(p.y)}`).join(" ")}, svg);
      }
      const every = Math.max(1, Math.ceil(s.points.length / 60));   // a live series: not every token's dot
      s.points.forEach((p, j) => {
        if (j % every === 0 || j === s.points.length - 1) el("circle", {class: `dot ${cls}`, cx: sx(p.x), cy: sy(p.y), r: 2.6}, svg);
        dots.push({X: sx(p.x), Y: sy(p.y), p, s});
      });
    });
    legend(svg, items);
    hover(svg, dots, fmtX, fmtY, opt);
  }

  // the legend above the plot, left to right, in as many rows as it needs
  function legendItems(series) {
    let x = BASE.l, row = 0;
    return series.map((s, i) => {
      const w = 26 + s.name.length * 5.6 + 10;
      if (x + w > W - BASE.r && x > BASE.l) { row++; x = BASE.l; }
      const item = {s, cls: s.cls || `s${i % 8}`, x, row};
      x += w;
      return item;
    });
  }

  function legend(svg, items) {
    const g = el("g", {class: "legend"}, svg);
    for (const {s, cls, x, row} of items) {
      const y = 12 + row * 13;
      el("line", {x1: x, x2: x + 16, y1: y - 3, y2: y - 3, class: `line ${cls}`}, g);
      el("text", {x: x + 20, y}, g, s.name);
    }
  }

  function hover(svg, dots, fmtX, fmtY, opt) {
    const tip = el("g", {class: "tip", visibility: "hidden"}, svg);
    const box = el("rect", {rx: 3}, tip), text = el("text", {}, tip);
    const ring = el("circle", {r: 5, class: "ring"}, svg);
    ring.setAttribute("visibility", "hidden");
    svg.onmouseleave = () => { tip.setAttribute("visibility", "hidden"); ring.setAttribute("visibility", "hidden"); };
    svg.onmousemove = ev => {
      const m = svg.getScreenCTM();
      if (!m) return;
      const pt = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(m.inverse());
      let best = null, bd = 30 * 30;
      for (const d of dots) {
        const dd = (d.X - pt.x) ** 2 + (d.Y - pt.y) ** 2;
        if (dd < bd) { bd = dd; best = d; }
      }
      if (!best) { svg.onmouseleave(); return; }
      while (text.firstChild) text.removeChild(text.firstChild);
      const lines = [best.s.name, `${opt.xlabel || "x"}: ${fmtX(best.p.x)}`, `${opt.ylabel || "y"}: ${fmtY(best.p.y)}`];
      lines.forEach((line, i) => el("tspan", {x: 6, dy: i ? 12 : 11}, text, line));
      const w = Math.max(...lines.map(l => l.length)) * 5.6 + 12, h = lines.length * 12 + 6;
      box.setAttribute("width", w); box.setAttribute("height", h);
      const tx = Math.min(Math.max(best.X + 8, 0), W - w), ty = Math.min(Math.max(best.Y - h - 6, 0), H - h);
      tip.setAttribute("transform", `translate(${tx},${ty})`);
      tip.setAttribute("visibility", "visible");
      ring.setAttribute("cx", best.X); ring.setAttribute("cy", best.Y); ring.setAttribute("visibility", "visible");
    };
  }

  function bytes(n) {
    if (!Number.isFinite(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return `${n >= 100 || i === 0 ? Math.round(n) : n.toFixed(n >= 10 ? 1 : 2)} ${units[i]}`;
  }

  function count(n) {
    if (n >= 1e6) return `${+(n / 1e6).toPrecision(3)}M`;
    if (n >= 1e4) return `${+(n / 1e3).toPrecision(3)}k`;
    return String(+n.toPrecision(4));
  }

  return {draw, bytes, count};
})();
