/* meshrun console: charts (uPlot) and actions, all against the public /v1 API of this same service.
   Charts are kept in window.meshrunCharts by name (their data is what the page drew). */
(function () {
  "use strict";
  var meshrun = (window.meshrun = {});
  var charts = (window.meshrunCharts = {});
  var builders = {};
  var ACTIVE = ["QUEUED", "STARTING", "RUNNING"];
  // the CSP allows no injected <style> elements: console.css styles htmx's indicators itself
  if (window.htmx) window.htmx.config.includeIndicatorStyles = false;
  // a form fragment answered 422 (input out of range) says what to fix: show it like any other answer
  document.addEventListener("htmx:beforeSwap", function (e) {
    if (e.detail.xhr && e.detail.xhr.status === 422) { e.detail.shouldSwap = true; e.detail.isError = false; }
  });

  // ------------------------------------------------------------------------------------------ helpers
  function css(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }
  function csrf() { var m = document.querySelector('meta[name="csrf-token"]'); return m ? m.content : ""; }
  function $(sel, root) { return (root || document).querySelector(sel); }
  function esc(s) { var d = document.createElement("div"); d.textContent = s == null ? "" : String(s); return d.innerHTML; }

  function api(method, url, body) {
    var opts = { method: method, credentials: "same-origin", headers: { "Accept": "application/json", "X-CSRF-Token": csrf() } };
    if (body !== undefined) { opts.headers["Content-Type"] = "application/json"; opts.body = JSON.stringify(body); }
    return fetch(url, opts).then(function (r) {
      return r.text().then(function (text) {
        var data = null;
        try { data = text ? JSON.parse(text) : null; } catch (e) { data = null; }
        if (!r.ok) {
          var msg = data && data.error ? data.error.message : (r.status + " " + r.statusText);
          var err = new Error(msg); err.status = r.status; err.body = data; throw err;
        }
        return data;
      });
    });
  }
  meshrun.api = api;

  var toastTimer = null;
  function toast(msg, isError) {
    var t = document.getElementById("toast");
    if (!t) return;
    t.textContent = msg; t.className = "toast" + (isError ? " error" : ""); t.hidden = false;
    clearTimeout(toastTimer); toastTimer = setTimeout(function () { t.hidden = true; }, isError ? 7000 : 3500);
  }
  meshrun.toast = toast;

  var fmt = {
    num: function (v) { return v == null ? "–" : (Math.abs(v) >= 1000 || (Math.abs(v) < 0.01 && v !== 0) ? v.toPrecision(3) : +v.toPrecision(4) + ""); },
    rate: function (v) {
      if (v == null) return "–";
      var a = Math.abs(v);
      return a >= 1e9 ? (v / 1e9).toPrecision(3) + "G" : a >= 1e6 ? (v / 1e6).toPrecision(3) + "M" : a >= 1e3 ? (v / 1e3).toPrecision(3) + "k" : v.toPrecision(3);
    },
    pct: function (v) { return v == null ? "–" : (100 * v).toFixed(1) + "%"; },
    /* the one size format, as api/spec/units.py format_bytes: binary units, 3 significant digits */
    bytes: function (v) {
      if (v == null) return "–";
      var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
      while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; i++; }
      if (!i) return Math.trunc(v) + " B";
      var a = Math.abs(v);
      return v.toFixed(a >= 100 ? 0 : a >= 10 ? 1 : 2) + " " + u[i];
    },
    seconds: function (v) { return v == null ? "–" : v < 1 ? (v * 1000).toPrecision(3) + " ms" : v.toPrecision(3) + " s"; },
    /* an axis's ticks in one unit (ms when every tick is under a second, else s): never "0.00 ms" next to "1.00 s" */
    secondsAxis: function (vals) {
      var top = Math.max.apply(null, vals.map(function (v) { return Math.abs(v || 0); }));
      return vals.map(function (v) { return v == null ? "" : top < 1 ? +(v * 1000).toPrecision(3) + " ms" : +v.toPrecision(3) + " s"; });
    },
  };
  meshrun.fmt = fmt;

  /* y range of a share (0..1): from 0, a little above the largest value, never an empty range */
  function shareRange(u, min, max) { return [0, Math.min(1, Math.max(0.02, (max || 0) * 1.15))]; }
  function fromZero(u, min, max) { return [0, max > 0 ? max * 1.1 : 1]; }
  // steps are whole numbers: ticks at 1, 2, 5, 10, 20, 25, 50, ...
  var STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 2.5e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6, 1e7];
  var ANSI = /\u001b\[[0-9;]*[A-Za-z]/g;

  function palette() { return [css("--c1"), css("--c2"), css("--c3"), css("--c4"), css("--c5"), "#a855f7", "#14b8a6", "#f97316", "#64748b", "#84cc16"]; }

  // ------------------------------------------------------------------------------------------- charts
  /* A line chart. spec: {x: [...], xLabel, series: [{label, values, color, dash}], yFmt, points, scatter} */
  function chart(name, el, spec) {
    if (!el || !window.uPlot) return null;
    builders[name] = function () { return chart(name, el, spec); };
    if (charts[name]) { charts[name].destroy(); delete charts[name]; }
    var shown = spec.series.filter(function (s) { return s.values.some(function (v) { return v != null; }); });
    if (!spec.x.length || !shown.length) {
      el.innerHTML = '<div class="chart-empty">' + esc(spec.empty || "Not measured for this run yet") + "</div>";
      return null;
    }
    el.innerHTML = "";
    var muted = css("--muted"), line = css("--line");
    var n = spec.x.length;
    var axis = function (extra) {
      return Object.assign({ stroke: muted, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 }, font: "11px " + css("--sans") }, extra);
    };
    var opts = {
      width: Math.max(280, el.clientWidth), height: spec.height || 220,
      scales: { x: { time: false } },
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
      legend: { show: spec.legend !== false },
      series: [{ label: spec.xLabel || "step", value: function (u, v) { return v == null ? "–" : (spec.xFmt || fmt.num)(v); } }].concat(shown.map(function (s) {
        return {
          label: s.label, stroke: s.color, width: s.width || 1.75, dash: s.dash, spanGaps: true,
          fill: spec.fill ? s.color + "14" : undefined,
          paths: s.scatter ? function () { return null; } : undefined,
          points: { show: s.scatter ? true : (spec.points != null ? spec.points : n <= 60), size: s.scatter ? 8 : 5, fill: s.color, stroke: s.color },
          value: function (u, v) { return v == null ? "–" : (spec.yFmt || fmt.num)(v); },
        };
      })),
      axes: [axis({ values: function (u, vals) { return vals.map(function (v) { return (spec.xFmt || fmt.num)(v); }); },
                    incrs: spec.xFmt ? undefined : STEP_INCRS }),
             axis({ size: 64, values: function (u, vals) { return spec.yAxisFmt ? spec.yAxisFmt(vals) : vals.map(function (v) { return (spec.yFmt || fmt.num)(v); }); } })],
    };
    if (spec.yRange) opts.scales.y = { range: spec.yRange };
    var u = new uPlot(opts, [spec.x].concat(shown.map(function (s) { return s.values; })), el);
    charts[name] = u;
    if (window.ResizeObserver && !el._observed) {
      el._observed = true;
      new ResizeObserver(function () { var c = charts[name]; if (c && el.clientWidth) c.setSize({ width: el.clientWidth, height: c.height }); }).observe(el);
    }
    return u;
  }
  meshrun.chart = chart;

  function redrawAll() { Object.keys(builders).forEach(function (k) { builders[k](); }); }

  // ------------------------------------------------------------------------------------------- theme
  document.addEventListener("click", function (ev) {
    var t = ev.target.closest("[data-theme-toggle]");
    if (!t) return;
    var root = document.documentElement;
    var dark = root.dataset.theme ? root.dataset.theme === "dark" : window.matchMedia("(prefers-color-scheme: dark)").matches;
    root.dataset.theme = dark ? "light" : "dark";
    try { localStorage.setItem("meshrun-theme", root.dataset.theme); } catch (e) { /* private mode */ }
    redrawAll();
  });

  // ---------------------------------------------------------------------------------- cancel / resume
  document.addEventListener("click", function (ev) {
    var c = ev.target.closest("[data-cancel]");
    if (c) {
      var id = c.dataset.cancel;
      if (!window.confirm("Cancel run " + id + "?")) return;
      c.disabled = true;
      api("POST", "/v1/runs/" + encodeURIComponent(id) + "/cancel").then(function (run) {
        toast("Run " + run.id + " is " + run.status.toLowerCase()); refresh();
      }).catch(function (e) { c.disabled = false; toast(e.message, true); });
      return;
    }
    var r = ev.target.closest("[data-resume]");
    if (r) openResume(r.dataset.resume, JSON.parse(r.dataset.layout || "{}"));
  });

  function refresh() {
    var table = document.getElementById("runs-table");
    if (table && window.htmx) window.htmx.ajax("GET", "/ui/runs", { target: table, swap: "outerHTML", values: window.htmx.values(document.getElementById("run-filters")) });
    else setTimeout(function () { window.location.reload(); }, 600);
  }

  function openResume(id, layout) {
    var dlg = document.getElementById("resume-dialog");
    if (!dlg) return;
    var f = document.getElementById("resume-form");
    $('[data-field="run"]', f).textContent = id;
    ["dp", "tp", "pp"].forEach(function (k) { f.elements[k].value = layout[k] || 1; });
    f.elements.zero_stage.value = String(layout.zero_stage || 0);
    f.elements.keep.checked = true;
    var err = $('[data-field="error"]', f); err.hidden = true;
    dlg.returnValue = "";
    dlg.onclose = function () {
      if (dlg.returnValue !== "resume") return;
      var body = {};
      if (!f.elements.keep.checked) {
        body.layout = Object.assign({}, layout, { dp: +f.elements.dp.value, tp: +f.elements.tp.value, pp: +f.elements.pp.value, zero_stage: +f.elements.zero_stage.value });
      }
      api("POST", "/v1/runs/" + encodeURIComponent(id) + "/resume", body).then(function (run) {
        toast("Run " + run.id + " resumed: " + run.status.toLowerCase());
        if (document.getElementById("run-root")) setTimeout(function () { window.location.reload(); }, 500); else refresh();
      }).catch(function (e) { err.textContent = e.message; err.hidden = false; dlg.showModal(); });
    };
    ["dp", "tp", "pp", "zero_stage"].forEach(function (k) { f.elements[k].oninput = function () { f.elements.keep.checked = false; }; });
    dlg.showModal();
  }

  // ------------------------------------------------------------------------------------------ run page
  meshrun.runPage = function () {
    var root = document.getElementById("run-root");
    if (!root) return;
    var id = root.dataset.runId;
    var status = root.dataset.status;
    var seriesUrl = "/v1/runs/" + encodeURIComponent(id) + "/metrics?points=2000";

    function draw(data) {
      var rows = data.items || [];
      var xs = rows.map(function (r) { return r.step; });
      var col = function (k, f) { return rows.map(function (r) { return r[k] == null ? null : (f ? f(r[k]) : r[k]); }); };
      var note = document.querySelector('[data-chart-note="loss"]');
      if (note) note.textContent = !rows.length ? "" : data.downsampled ? rows.length + " of " + data.series_rows + " steps (min and max kept)" : rows.length + " steps";
      chart("loss", $("#chart-loss"), { x: xs, series: [{ label: "loss", values: col("loss"), color: css("--c1") }], empty: "No steps recorded yet" });
      chart("tokens_per_s", $("#chart-tps"), { x: xs, yFmt: fmt.rate, series: [{ label: "tokens/s", values: col("tokens_per_s"), color: css("--c2") }] });
      chart("mfu", $("#chart-mfu"), { x: xs, yFmt: fmt.pct, yRange: shareRange, series: [{ label: "MFU", values: col("mfu"), color: css("--c4") }] });
      chart("step_time_s", $("#chart-step"), { x: xs, yFmt: fmt.seconds, yAxisFmt: fmt.secondsAxis, series: [{ label: "step time", values: col("step_time_s"), color: css("--c3") }] });
      chart("peak_memory_bytes", $("#chart-mem"), { x: xs, yFmt: fmt.bytes, series: [{ label: "peak memory", values: col("peak_memory_bytes"), color: css("--c5") }] });
      chart("comm_fraction", $("#chart-comm"), { x: xs, yFmt: fmt.pct, yRange: shareRange, series: [{ label: "communication", values: col("comm_fraction"), color: css("--c2") }],
        empty: "Not measured for this run (no data-parallel collectives timed)" });
      // layout.sync async_ps / local_sgd / diloco: their cards appear only when the rows carry their metrics
      syncChart("staleness", { x: xs, yRange: fromZero, series: [
        { label: "mean", values: col("staleness_mean"), color: css("--c2") },
        { label: "max", values: col("staleness_max"), color: css("--c5"), dash: [5, 4] }] });
      // cross-group traffic exists only for the sync modes that exchange across groups: all zero (a pp or plain dp
      // run reports 0) means the run has no such traffic, so no card
      syncChart("cross_group_bytes", { x: xs, yFmt: fmt.bytes, yRange: fromZero, nonzero: true,
        series: [{ label: "bytes/step", values: col("cross_group_bytes"), color: css("--c3") }] });
      syncChart("replica_divergence", { x: xs, points: true,
        series: [{ label: "divergence", values: col("replica_divergence"), color: css("--c4") }] });
    }
    function syncChart(name, spec) {
      var card = document.querySelector('[data-sync-chart="' + name + '"]');
      if (!card) return;
      var has = spec.series.some(function (s) { return s.values.some(function (v) { return v != null && !(spec.nonzero && v === 0); }); });
      card.hidden = !has;
      if (has) chart(name, card.querySelector(".chart"), spec);
    }
    function load() { return api("GET", seriesUrl).then(draw).catch(function (e) { toast("metrics: " + e.message, true); }); }

    // memory per rank (final summary): one bar per rank
    var peaks = JSON.parse(root.dataset.peaks || "[]");
    var rp = document.getElementById("rank-peaks");
    if (rp) {
      if (peaks.length) {
        var max = Math.max.apply(null, peaks.map(function (p) { return p[1]; })) || 1;
        rp.innerHTML = '<div class="small muted">peak per rank</div>' + peaks.map(function (p) {
          return '<div class="rk-row"><span class="mono small">rank ' + p[0] + '</span><div class="rk-bar"><div style="width:' +
            (100 * p[1] / max).toFixed(1) + '%"></div></div><span class="mono small">' + fmt.bytes(p[1]) + "</span></div>";
        }).join("");
      } else {
        rp.outerHTML = '<p class="small muted not-measured">Per-rank peaks appear when the run ends.</p>';
      }
    }

    // predicted vs measured breakdown, when the service measures it
    var bd = document.getElementById("breakdown");
    api("GET", "/v1/runs/" + encodeURIComponent(id) + "/breakdown").then(function (data) {
      renderBreakdown(bd, data);
      var pl = document.getElementById("pipeline"), tl = data && (data.pipeline || data.pipeline_timeline);
      if (pl && tl) renderPipeline(pl, tl.events || tl);
    })
      .catch(function (e) {
        bd.dataset.state = "absent";
        bd.innerHTML = '<p class="muted not-measured">Not measured for this run' + (e.status === 404 ? "" : " (" + esc(e.message) + ")") + ".</p>";
      });

    // logs tail (and follow)
    var logs = document.getElementById("logs"), follow = document.getElementById("logs-follow");
    var cursor = null;
    function pullLogs() {
      var url = "/v1/runs/" + encodeURIComponent(id) + "/logs?limit=65536" + (cursor ? "&cursor=" + encodeURIComponent(cursor) : "&tail=true");
      return api("GET", url).then(function (page) {
        var text = (page.logs || "").replace(ANSI, "");
        if (!cursor) logs.textContent = (page.offset ? "… (" + page.offset + " earlier characters)\n" : "") + (text || "(no output yet)");
        else if (text) { if (logs.textContent === "(no output yet)") logs.textContent = ""; logs.textContent += text; }
        var first = !cursor;
        cursor = page.next_cursor || cursor;
        if (first || (follow && follow.checked)) logs.scrollTop = logs.scrollHeight;  // the tail is what matters
      }).catch(function (e) { logs.textContent = e.status === 503 ? "Logs come from the Ray runtime, which this service process does not run." : "Logs are not available: " + e.message; });
    }

    load(); pullLogs();
    if (ACTIVE.indexOf(status) >= 0) {
      var timer = setInterval(function () {
        var live = document.getElementById("run-live");
        var now = live ? live.dataset.status : status;
        load();
        if (follow && follow.checked) pullLogs();
        if (ACTIVE.indexOf(now) < 0) { clearInterval(timer); setTimeout(function () { window.location.reload(); }, 1500); }
      }, 3000);
    }
  };

  function renderBreakdown(el, data) {
    var terms = data && (data.terms || data.breakdown || data);
    var rows = [];
    if (Array.isArray(terms)) {
      terms.forEach(function (t) { rows.push([t.term || t.name, t.predicted_s != null ? t.predicted_s : t.predicted, t.measured_s != null ? t.measured_s : t.measured, t.share]); });
      var st = data.step_time_s;  // the whole step, and how much of it the terms name (they tile it)
      if (st && (st.measured_s != null || st.predicted_s != null)) rows.push(["step (total)", st.predicted_s, st.measured_s, st.share]);
    } else if (terms && typeof terms === "object") {
      var p = terms.predicted || {}, m = terms.measured || {};
      Object.keys(Object.assign({}, p, m)).forEach(function (k) { if (typeof (p[k] != null ? p[k] : m[k]) === "number") rows.push([k, p[k], m[k]]); });
    }
    if (!rows.length) { el.dataset.state = "absent"; el.innerHTML = '<p class="muted not-measured">Not measured for this run.</p>'; return; }
    el.dataset.state = "shown";
    var max = Math.max.apply(null, rows.map(function (r) { return Math.max(r[1] || 0, r[2] || 0); })) || 1;
    var named = "";
    if (data && typeof data.unaccounted_s === "number" && data.step_time_s && data.step_time_s.measured_s) {
      var total = data.step_time_s.measured_s;
      named = '<p class="small muted named-terms">Named terms: ' + (100 * (total - data.unaccounted_s) / total).toFixed(1) + "% of the measured step (unaccounted " + fmt.seconds(Math.abs(data.unaccounted_s) < 1e-9 ? 0 : data.unaccounted_s) + ").</p>";
    }
    el.innerHTML = '<table class="table compact"><thead><tr><th>Term</th><th class="num">Predicted</th><th class="num">Measured</th><th class="num">Share</th><th class="w-bar"></th></tr></thead><tbody>' +
      rows.map(function (r) {
        return "<tr><td>" + esc(String(r[0]).replace(/_/g, " ")) + '</td><td class="num mono">' + fmt.seconds(r[1]) + '</td><td class="num mono">' + fmt.seconds(r[2]) +
          '</td><td class="num mono">' + (typeof r[3] === "number" ? (100 * r[3]).toFixed(0) + "%" : "-") +
          '</td><td><div class="stack" style="height:6px"><span class="seg c1" style="width:' + (100 * (r[1] || 0) / max) + '%"></span></div><div class="stack" style="height:6px;margin-top:2px"><span class="seg c3" style="width:' + (100 * (r[2] || 0) / max) + '%"></span></div></td></tr>';
      }).join("") + '</tbody></table><div class="legend small"><span><i class="seg c1"></i>predicted</span><span><i class="seg c3"></i>measured</span></div>' + named;
  }

  /* A pipeline timeline: one lane per stage (or rank), one box per forward/backward slot, positioned by time. */
  function renderPipeline(el, events) {
    if (!Array.isArray(events) || !events.length) return;
    var num = function (e, ks) { for (var i = 0; i < ks.length; i++) if (typeof e[ks[i]] === "number") return e[ks[i]]; return null; };
    var evs = events.map(function (e) {
      return { lane: num(e, ["stage", "rank", "pp_rank"]), t0: num(e, ["start_s", "start", "t0"]), t1: num(e, ["end_s", "end", "t1"]),
               kind: String(e.kind || e.op || e.phase || ""), mb: num(e, ["microbatch", "mb"]) };
    }).filter(function (e) { return e.lane != null && e.t0 != null && e.t1 != null && e.t1 > e.t0; });
    if (!evs.length) return;
    var lo = Math.min.apply(null, evs.map(function (e) { return e.t0; })), hi = Math.max.apply(null, evs.map(function (e) { return e.t1; }));
    var lanes = Array.from(new Set(evs.map(function (e) { return e.lane; }))).sort(function (a, b) { return a - b; });
    el.innerHTML = '<div class="pipe">' + lanes.map(function (l) {
      return '<div class="pipe-lane"><span class="mono small">stage ' + l + '</span><div class="pipe-track">' + evs.filter(function (e) { return e.lane === l; }).map(function (e) {
        var cls = /back|bwd|^b$/i.test(e.kind) ? "c3" : /fwd|forw|^f$/i.test(e.kind) ? "c1" : "c4";
        return '<span class="pipe-box seg ' + cls + '" style="left:' + (100 * (e.t0 - lo) / (hi - lo)) + "%;width:" + Math.max(0.3, 100 * (e.t1 - e.t0) / (hi - lo)) +
          '%" title="' + esc(e.kind) + (e.mb != null ? " mb " + e.mb : "") + " " + fmt.seconds(e.t1 - e.t0) + '"></span>';
      }).join("") + "</div></div>";
    }).join("") + '</div><div class="legend small"><span><i class="seg c1"></i>forward</span><span><i class="seg c3"></i>backward</span><span><i class="seg c4"></i>other</span><span>' + fmt.seconds(hi - lo) + " shown</span></div>";
  }

  // -------------------------------------------------------------------------------------- compare page
  meshrun.comparePage = function () {
    var root = document.getElementById("compare-root");
    if (!root) return;
    var ids = JSON.parse(root.dataset.runs), names = JSON.parse(root.dataset.names), colors = palette();
    document.querySelectorAll(".swatch[data-series]").forEach(function (s) { s.style.background = colors[+s.dataset.series % colors.length]; });
    Promise.all(ids.map(function (id) { return api("GET", "/v1/runs/" + encodeURIComponent(id) + "/metrics?points=1000"); })).then(function (all) {
      function overlay(name, el, xOf, yKey, yFmt, xLabel, xFmt) {
        var tables = all.map(function (d) {
          var rows = d.items.filter(function (r) { return r[yKey] != null && xOf(r, d) != null; });
          var pairs = rows.map(function (r) { return [xOf(r, d), r[yKey]]; }).sort(function (a, b) { return a[0] - b[0]; });
          return [pairs.map(function (p) { return p[0]; }), pairs.map(function (p) { return p[1]; })];
        });
        var joined = uPlot.join(tables.filter(function (t) { return t[0].length; }));
        if (!joined) { chart(name, el, { x: [], series: [{ label: "", values: [] }] }); return; }
        var k = 0, series = [];
        tables.forEach(function (t, i) { if (t[0].length) { series.push({ label: names[i], values: joined[++k], color: colors[i % colors.length] }); } });
        chart(name, el, { x: joined[0], series: series, yFmt: yFmt, xLabel: xLabel, xFmt: xFmt, points: false });
      }
      var t0 = all.map(function (d) { var f = d.items.find(function (r) { return r.time; }); return f ? Date.parse(f.time) : null; });
      overlay("cmp_loss_step", $("#chart-cmp-loss"), function (r) { return r.step; }, "loss", fmt.num, "step");
      overlay("cmp_loss_time", $("#chart-cmp-time"), function (r, d) {
        var i = all.indexOf(d); return r.time && t0[i] != null ? (Date.parse(r.time) - t0[i]) / 1000 : null;
      }, "loss", fmt.num, "seconds", function (v) { return v == null ? "–" : Math.abs(v) >= 10 ? v.toFixed(0) + " s" : +v.toFixed(2) + " s"; });
      overlay("cmp_tps_step", $("#chart-cmp-tps"), function (r) { return r.step; }, "tokens_per_s", fmt.rate, "step");
    }).catch(function (e) { toast(e.message, true); });
  };

  // ----------------------------------------------------------------------------------------- plan page
  meshrun.planPage = function () {
    var results = document.getElementById("plan-results"), dlg = document.getElementById("submit-dialog");
    var f = document.getElementById("submit-form");
    results.addEventListener("click", function (ev) {
      var b = ev.target.closest("[data-submit-layout]");
      if (!b) return;
      var tr = b.closest("tr"), ranked = document.getElementById("plan-ranked");
      var req = JSON.parse(ranked.dataset.request), layout = JSON.parse(tr.dataset.layout);
      $('[data-field="layout"]', f).textContent = tr.dataset.layoutLabel;  // str(ResolvedLayout), rendered by the server
      $('[data-field="mbs"]', f).textContent = tr.dataset.mbs;
      var err = $('[data-field="error"]', f); err.hidden = true;
      dlg.returnValue = "";
      dlg.onclose = function () {
        if (dlg.returnValue !== "submit") return;
        var model = Object.assign({}, req.model);
        if (req.seq_len) model.seq_len = req.seq_len;
        var spec = {
          name: f.elements.name.value, model: model, layout: layout, precision: req.precision,
          activation_checkpointing: tr.dataset.ac || "none",
          batch: { global_batch_size: req.global_batch_size, micro_batch_size: +tr.dataset.mbs },
          train: { steps: +f.elements.steps.value },
        };
        api("POST", "/v1/runs", spec).then(function (run) { window.location.href = "/runs/" + encodeURIComponent(run.id); })
          .catch(function (e) { err.textContent = e.message; err.hidden = false; dlg.showModal(); });
      };
      dlg.showModal();
    });
  };

  // ---------------------------------------------------------------------------------------- sweep page
  meshrun.sweepPage = function () {
    var el = document.getElementById("chart-scatter");
    if (!el) return;
    var sc = JSON.parse(el.dataset.scatter || "{}"), after = JSON.parse(el.dataset.after || "[]");
    var before = [sc.x || [], sc.y || []];
    var pts = after.filter(function (p) { return p.predicted_after != null && p.measured_tokens_per_s != null; })
      .map(function (p) { return [p.predicted_after, p.measured_tokens_per_s]; }).sort(function (a, b) { return a[0] - b[0]; });
    var all = before[0].concat(before[1], pts.map(function (p) { return p[0]; }), pts.map(function (p) { return p[1]; }));
    if (!all.length) { chart("sweep_scatter", el, { x: [], series: [{ label: "", values: [] }], empty: "No trial measured yet" }); return; }
    var lo = Math.min.apply(null, all) * 0.9, hi = Math.max.apply(null, all) * 1.1;
    var tables = [before, [[lo, hi], [lo, hi]]];
    if (pts.length) tables.push([pts.map(function (p) { return p[0]; }), pts.map(function (p) { return p[1]; })]);
    var j = uPlot.join(tables);
    var series = [{ label: "trials (planner before)", values: j[1], color: css("--c1"), scatter: true },
                  { label: "measured = predicted", values: j[2], color: css("--muted"), dash: [4, 4], width: 1 }];
    if (pts.length) series.push({ label: "after calibration", values: j[3], color: css("--c4"), scatter: true });
    chart("sweep_scatter", el, { x: j[0], series: series, xLabel: "predicted tokens/s", xFmt: fmt.rate, yFmt: fmt.rate, height: 260 });
  };
})();
