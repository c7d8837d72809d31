/* kvflow view: the page script inlined into index.html.
 *
 * The data are strict JSON in <script type="application/json"> blocks: `kvflow-index` (runs,
 * problems, pairs, distributions; parsed at once) and `kvflow-run-<i>` (one run's problems in
 * full; parsed when one of its problems is opened). Everything shown follows from the URL hash,
 * e.g. #run=1&vs=0&filter=rescued&problem=gsm8k/12, so a view can be linked, reloaded, and
 * checked by a headless browser without clicks. Errors are written to <body data-errors>;
 * <body data-ready="1"> says a render finished. Text from the results is only ever set with
 * textContent (never parsed as HTML).
 */
"use strict";
(function () {
  var errors = [];
  function reportError(message) {
    errors.push(String(message));
    document.body.setAttribute("data-errors", errors.join(" | "));
  }
  window.addEventListener("error", function (e) { reportError(e.message || e); });
  window.addEventListener("unhandledrejection", function (e) { reportError(e.reason); });

  var SVGNS = "http://www.w3.org/2000/svg";
  var PALETTE = ["#2f6fdf", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f"];
  var PRUNED = "#d62728", KEPT = "#2f6fdf";
  var INDEX = JSON.parse(document.getElementById("kvflow-index").textContent);
  var details = {};

  // ------------------------------------------------------------------ helpers
  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }
  function sv(tag, attrs, children) {
    var node = document.createElementNS(SVGNS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }
  function setAttrs(node, attrs) {
    Object.keys(attrs || {}).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === "text") node.textContent = String(v);
      else if (k === "onclick") node.addEventListener("click", v);
      else if (k === "onchange") node.addEventListener("change", v);
      else if (k === "oninput") node.addEventListener("input", v);
      else node.setAttribute(k, v === true ? "" : String(v));
    });
  }
  function append(node, children) {
    (children || []).forEach(function (c) {
      if (c === null || c === undefined || c === false) return;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
  function num(x, digits) {
    if (x === null || x === undefined) return "–";
    return Math.abs(x) >= 100 ? Math.round(x).toLocaleString("en") : x.toFixed(digits === undefined ? 2 : digits);
  }
  function runDetails(i) {
    if (!(i in details)) details[i] = JSON.parse(document.getElementById("kvflow-run-" + i).textContent);
    return details[i];
  }
  function sourceColor(run, source) {
    if (source === "fallback") return "#98a2b3";
    var i = run.proposers.indexOf(source);
    return PALETTE[(i < 0 ? run.proposers.length : i) % PALETTE.length];
  }
  function rgba(hex, alpha) {
    var n = parseInt(hex.slice(1), 16);
    return "rgba(" + (n >> 16) + "," + ((n >> 8) & 255) + "," + (n & 255) + "," + alpha.toFixed(2) + ")";
  }

  // ------------------------------------------------------------------ state (the URL hash)
  function state() {
    var p = new URLSearchParams(location.hash.replace(/^#/, ""));
    var run = parseInt(p.get("run") || "0", 10);
    if (!(run >= 0 && run < INDEX.runs.length)) run = 0;
    var vs = p.has("vs") ? parseInt(p.get("vs"), 10) : null;
    if (!(vs >= 0 && vs < INDEX.runs.length) || vs === run) vs = null;
    return { run: run, vs: vs, filter: p.get("filter") || "all", q: p.get("q") || "",
             sort: p.get("sort") || "", desc: p.get("desc") === "1", problem: p.get("problem") || null,
             step: p.has("step") ? parseInt(p.get("step"), 10) : null, only: p.get("only") || null };
  }
  function go(changes) {
    var s = state();
    Object.keys(changes).forEach(function (k) { s[k] = changes[k]; });
    var p = new URLSearchParams();
    p.set("run", s.run);
    if (s.vs !== null) p.set("vs", s.vs);
    if (s.filter && s.filter !== "all") p.set("filter", s.filter);
    if (s.q) p.set("q", s.q);
    if (s.sort) p.set("sort", s.sort);
    if (s.desc) p.set("desc", "1");
    if (s.problem) p.set("problem", s.problem);
    if (s.problem && s.step !== null && s.step !== undefined) p.set("step", s.step);
    if (s.only) p.set("only", s.only);
    location.hash = p.toString();
  }

  // ------------------------------------------------------------------ runs
  function renderRuns(s) {
    var box = clear(document.getElementById("runs-table"));
    var paths = INDEX.config_paths;
    var sources = [];
    INDEX.runs.forEach(function (r) { r.proposers.forEach(function (p) { if (sources.indexOf(p) < 0) sources.push(p); }); });
    // the fields that tell the runs apart come right after their names: at the end of a wide
    // table they sat past the right edge of a 1400-pixel window, behind a scroll bar
    var head = ["#", "run"].concat(paths).concat(["problems", "complete", "accuracy", "95% CI", "degenerate",
      "mean steps", "mean tokens"]).concat(sources.map(function (x) { return "steps: " + x; }))
      .concat(["early exit", "recorded"]);
    var numeric = function (h) { return !(h === "run" || paths.indexOf(h) >= 0 || h === "recorded" || h === "complete" || h === "95% CI"); };
    var thead = el("tr", {}, head.map(function (h) {
      if (paths.indexOf(h) < 0) return el("th", { class: numeric(h) ? "num" : null, text: h });
      // a configuration path may break after its dots (<wbr>), never inside a name
      var parts = [];
      h.split(".").forEach(function (part, k, all) {
        parts.push(part + (k < all.length - 1 ? "." : ""));
        if (k < all.length - 1) parts.push(el("wbr"));
      });
      return el("th", { class: "config", title: h }, parts);
    }));
    var rows = INDEX.runs.map(function (r) {
      var m = r.metrics;
      var cells = [String(r.index), r.dir].concat(r.config).concat([String(m.problems), r.complete ? "yes" : "no",
        pct(m.accuracy) + " (" + m.correct + "/" + m.problems + ")",
        m.ci ? "[" + pct(m.ci[0]) + ", " + pct(m.ci[1]) + "]" : "–", pct(m.degeneration_rate), num(m.mean_steps),
        num(m.mean_output_tokens, 0)].concat(sources.map(function (x) {
          return r.proposers.indexOf(x) >= 0 ? pct(m.step_share[x]) : "–"; }))
        .concat([pct(m.early_exit_fraction), [r.recorded.signals ? "signals" : "", r.recorded.candidates ? "candidates" : ""]
          .filter(Boolean).join(", ") || "–"]));
      return el("tr", { class: "clickable" + (r.index === s.run ? " selected" : ""), "data-run": r.index,
                        onclick: function () { go({ run: r.index, problem: null, vs: s.vs === r.index ? null : s.vs }); } },
        cells.map(function (c, k) { return el("td", { class: numeric(head[k]) ? "num" : null, text: c }); }));
    });
    box.appendChild(el("div", { class: "scroll" }, [el("table", { id: "runs" }, [el("thead", {}, [thead]), el("tbody", {}, rows)])]));
    var note = paths.length ? "After each run's name: the configuration fields that differ between these runs (– = not set: the " +
      "default). Click a run to see its problems." : "Click a run to see its problems.";
    box.appendChild(el("p", { class: "note", text: note }));
  }

  // ------------------------------------------------------------------ problems of a run
  var PROBLEM_COLUMNS = [
    { key: "id", label: "id" }, { key: "correct", label: "correct" }, { key: "steps", label: "steps", num: true },
    { key: "tokens", label: "tokens", num: true }, { key: "degenerate", label: "degenerate" },
    { key: "finish", label: "finish" }, { key: "seconds", label: "seconds", num: true },
    { key: "sources", label: "committed steps by source" }];

  function pairOf(a, b) {
    for (var i = 0; i < INDEX.pairs.length; i++) {
      if (INDEX.pairs[i].a === a && INDEX.pairs[i].b === b) return INDEX.pairs[i];
    }
    return null;
  }
  function outcomeOf(before, after) {
    return before ? (after ? "both right" : "broken") : (after ? "rescued" : "both wrong");
  }
  function passes(row, filter) {
    switch (filter) {
      case "correct": return row.correct;
      case "wrong": return !row.correct;
      case "degenerate": return row.degenerate;
      case "all": return true;
      default: return row.outcome === filter;  // an outcome class of the comparison
    }
  }

  function renderProblems(s) {
    var run = INDEX.runs[s.run];
    document.getElementById("run-title").textContent = "#" + run.index + " " + run.dir;
    var box = clear(document.getElementById("problems-body"));
    var other = s.vs !== null ? INDEX.runs[s.vs] : null;
    var before = {};
    if (other) other.problems.forEach(function (p) { before[p.id] = p.correct; });
    var rows = run.problems.map(function (p) {
      var row = Object.assign({}, p);
      if (other) row.outcome = p.id in before ? outcomeOf(before[p.id], p.correct) : "not in both";
      return row;
    });

    // controls: compare, filter, search
    var vsSelect = el("select", { id: "vs", onchange: function (e) {
      go({ vs: e.target.value === "" ? null : parseInt(e.target.value, 10), filter: "all" }); } },
      [el("option", { value: "", text: "(none)" })].concat(INDEX.runs.filter(function (r) { return r.index !== run.index; })
        .map(function (r) { return el("option", { value: r.index, text: "#" + r.index + " " + r.dir, selected: r.index === s.vs }); })));
    var filters = ["all", "correct", "wrong", "degenerate"].concat(other ? ["both right", "rescued", "broken", "both wrong"] : []);
    var filterSelect = el("select", { id: "filter", onchange: function (e) { go({ filter: e.target.value }); } },
      filters.map(function (f) { return el("option", { value: f, text: f, selected: f === s.filter }); }));
    var search = el("input", { type: "search", id: "search", placeholder: "problem id contains…", value: s.q,
                               onchange: function (e) { go({ q: e.target.value }); } });
    box.appendChild(el("div", { class: "controls" }, [
      el("label", { text: "compare with" }), vsSelect, el("label", { text: "show" }), filterSelect, search]));

    if (other) box.appendChild(renderPair(other, run));

    var visible = rows.filter(function (r) {
      return passes(r, s.filter) && (!s.q || r.id.toLowerCase().indexOf(s.q.toLowerCase()) >= 0);
    });
    var columns = PROBLEM_COLUMNS.concat(other ? [{ key: "outcome", label: "vs #" + other.index }] : []);
    if (s.sort) {
      visible.sort(function (a, b) {
        var x = a[s.sort], y = b[s.sort];
        if (s.sort === "sources") { x = x.length; y = y.length; }
        var c = x === y ? 0 : (x === null || x === undefined) ? 1 : (y === null || y === undefined) ? -1 : x < y ? -1 : 1;
        return s.desc ? -c : c;
      });
    }
    box.appendChild(el("p", { class: "note", id: "problems-count", "data-visible": visible.length, "data-total": rows.length,
      text: "showing " + visible.length + " of " + rows.length + " problems (click a column to sort, a problem to open it)" }));
    var thead = el("tr", {}, columns.map(function (c) {
      var cls = "sortable" + (c.num ? " num" : "") + (s.sort === c.key ? (s.desc ? " sorted-desc" : " sorted-asc") : "");
      return el("th", { class: cls, "data-key": c.key, text: c.label,
                        onclick: function () { go({ sort: c.key, desc: s.sort === c.key ? !s.desc : false }); } });
    }));
    var body = visible.map(function (r) {
      return el("tr", { class: "clickable" + (r.id === s.problem ? " selected" : ""), "data-id": r.id,
                        onclick: function () { go({ problem: r.id }); } }, columns.map(function (c) {
        var v = r[c.key];
        if (c.key === "correct") return el("td", { class: v ? "yes" : "no", text: v ? "yes" : "no" });
        if (c.key === "degenerate") return el("td", { class: v ? "no" : null, text: v ? "yes" : "no" });
        if (c.key === "sources") return el("td", {}, [strip(run, v)]);
        if (c.key === "seconds") return el("td", { class: "num", text: num(v, 1) });
        return el("td", { class: c.num ? "num" : null, text: v === null || v === undefined ? "–" : String(v) });
      }));
    });
    box.appendChild(el("div", { class: "scroll tall" }, [el("table", { id: "problems" }, [el("thead", {}, [thead]), el("tbody", {}, body)])]));
  }

  function strip(run, sources) {
    // one square per committed step, coloured by its source (an index into run.proposers; -1 = fallback)
    var names = sources.map(function (i) { return i < 0 ? "fallback" : run.proposers[i]; });
    return el("span", { class: "strip", title: names.join(" ") }, names.map(function (src) {
      return el("span", { style: "background:" + sourceColor(run, src) });
    }));
  }

  function renderPair(a, b) {
    var pair = pairOf(a.index, b.index);
    if (!pair) return el("p", { class: "note", text: "Runs #" + a.index + " and #" + b.index + " share no problem." });
    var cells = ["both right", "rescued", "broken", "both wrong"];
    return el("div", { id: "pair", "data-p": pair.p_value }, [
      el("table", {}, [
        el("thead", {}, [el("tr", {}, [el("th", { text: "#" + a.index + " → #" + b.index })].concat(
          cells.map(function (c) { return el("th", { class: "num", text: c }); })).concat([el("th", { text: "exact McNemar p" })]))]),
        el("tbody", {}, [el("tr", {}, [el("td", { text: pair.problems + " common problems" })].concat(
          cells.map(function (c) { return el("td", { class: "num", "data-outcome": c, text: String(pair[c]) }); })).concat(
          [el("td", { class: "pvalue", text: pair.p_value < 0.001 ? "< 0.001" : pair.p_value.toFixed(3) })]))])]),
      el("p", { class: "note", text: "rescued = wrong in #" + a.index + ", right in #" + b.index + "; broken = the reverse. " +
        "The p-value is the two-sided exact McNemar test (a sign test on the rescued and broken problems): how likely so " +
        "uneven a split is if neither run were better." })]);
  }

  // ------------------------------------------------------------------ one problem (Figure 7)
  function renderProblem(s) {
    var box = clear(document.getElementById("problem"));
    if (!s.problem) { box.hidden = true; return; }
    box.hidden = false;
    var run = INDEX.runs[s.run];
    var all = runDetails(s.run);
    var p = all[s.problem];
    box.appendChild(el("h2", { text: "Problem " + s.problem + " in run #" + run.index + " " + run.dir }));
    if (!p) { box.appendChild(el("p", { class: "empty", text: "This run has no record of " + s.problem + "." })); return; }
    box.appendChild(el("dl", { class: "kv" }, [
      el("dt", { text: "gold" }), el("dd", { id: "gold", text: p.gold }),
      el("dt", { text: "prediction" }), el("dd", { id: "prediction", class: p.correct ? "yes" : "no",
        text: (p.prediction === null ? "(none)" : p.prediction) + (p.correct ? "  (correct)" : "  (wrong)") }),
      el("dt", { text: "finish" }), el("dd", { text: p.finish || "–" }),
      el("dt", { text: "steps" }), el("dd", { text: String(p.steps.length) })]));
    box.appendChild(el("h3", { text: "Question" }));
    box.appendChild(el("div", { class: "question", text: p.question || "" }));

    var scores = p.steps.map(function (x) { return x.score; }).filter(function (x) { return x !== null; });
    var lo = Math.min.apply(null, scores), hi = Math.max.apply(null, scores);
    var counts = {};
    p.steps.forEach(function (x) { counts[x.source] = (counts[x.source] || 0) + 1; });
    box.appendChild(el("h3", { text: "Committed trajectory" }));
    box.appendChild(el("div", { class: "legend" }, run.proposers.map(function (src) {
      return el("span", {}, [el("span", { class: "swatch", style: "background:" + sourceColor(run, src) }),
        src + ": " + (counts[src] || 0) + " steps"]);
    }).concat([el("span", { class: "note", text: "deeper colour = higher score within this problem; palest = unscored " +
      "(a single candidate); wavy underline = a fallback step (every candidate pruned)" })])));
    var traj = el("div", { class: "trajectory", id: "trajectory" }, p.steps.map(function (x, k) {
      var rel = x.score === null || !(hi > lo) ? (x.score === null ? 0 : 1) : (x.score - lo) / (hi - lo);
      var alpha = x.score === null ? 0.18 : 0.2 + 0.55 * rel;
      var cls = "step" + (x.score === null ? " unscored" : "") + (x.fallback ? " fallback" : "");
      return el("span", { class: cls, "data-step": k, "data-source": x.source, "data-score": x.score === null ? "" : x.score,
        style: "background:" + rgba(sourceColor(run, x.source), alpha),
        title: "step " + k + " · " + x.source + " · score " + (x.score === null ? "–" : x.score) + " · " + x.tokens + " tokens" },
        [el("span", { class: "stepno", text: String(k) }), x.text]);
    }));
    box.appendChild(traj);
    box.appendChild(renderCandidates(run, p, s.step));
  }

  function renderCandidates(run, p, openStep) {
    var wrap = el("div", { id: "candidates" });
    wrap.appendChild(el("h3", { text: "Candidates at each step" }));
    if (!p.candidates.length) {
      wrap.appendChild(el("p", { class: "empty", text: "Not recorded: rerun with --set run.record_candidates=true " +
        "(every candidate's text, score and finish) and run.record_signals=true (pruners' per-token signals)." }));
      return wrap;
    }
    if (!run.recorded.candidates) {
      wrap.appendChild(el("p", { class: "note", text: "This run recorded the pruners' signals only (run.record_signals): " +
        "candidates of the pruned proposers, without their text; run.record_candidates keeps every candidate." }));
    }
    p.candidates.forEach(function (cands, k) {
      var pruned = cands.filter(function (c) { return (c.finish || "").indexOf("pruned:") === 0; }).length;
      var step = p.steps[k];
      var summary = "step " + k + ": " + cands.length + " candidate" + (cands.length === 1 ? "" : "s") +
        (pruned ? ", " + pruned + " pruned" : "") + (step ? " — committed: " + step.source : " — nothing committed");
      // open: the step the URL names (#...&step=k), else every step where a pruner stopped a candidate
      var open = openStep !== null ? k === openStep : pruned > 0;
      wrap.appendChild(el("details", { class: "step-candidates", "data-step": k, open: open },
        [el("summary", { text: summary })].concat(cands.map(function (c) { return candidateCard(run, c); }))));
    });
    return wrap;
  }

  function candidateCard(run, c) {
    var isPruned = (c.finish || "").indexOf("pruned:") === 0;
    var head = c.source + " #" + c.index + " · " + (c.finish || "?") +
      (c.score !== undefined ? " · score " + (c.score === null ? "–" : c.score) : "") +
      (c.tokens !== undefined ? " · " + c.tokens + " tokens" : "") +
      (c.committed === true ? " · committed" : c.committed === false ? " · not committed" : "");
    var card = el("div", { class: "candidate" + (c.committed ? " committed" : "") + (isPruned ? " pruned" : ""),
      "data-source": c.source, "data-finish": c.finish, style: "border-left-color:" + sourceColor(run, c.source) },
      [el("div", { class: "head", text: head })]);
    if (c.text !== undefined && c.text !== null) card.appendChild(el("pre", { text: c.text }));
    Object.keys(c.signals || {}).forEach(function (name) {
      card.appendChild(signalTrace(name, c.signals[name], run.thresholds[name],
        c.finish === "pruned:" + name ? PRUNED : KEPT));
    });
    return card;
  }

  function extent(values) {
    var v = values.filter(function (x) { return x !== null && x !== undefined; });
    return v.length ? [Math.min.apply(null, v), Math.max.apply(null, v)] : [0, 1];
  }
  function signalTrace(name, trace, threshold, color) {
    // the per-token signal of one candidate with the pruner's threshold (Figure 3, one candidate)
    var W = 360, H = 84, L = 46, R = 8, T = 16, B = 14;
    var range = extent(trace.concat(threshold === undefined || threshold === null ? [] : [threshold]));
    if (range[1] === range[0]) range = [range[0] - 0.5, range[1] + 0.5];
    var x = function (i) { return L + (W - L - R) * i / Math.max(1, trace.length - 1); };
    var y = function (v) { return T + (H - B - T) * (1 - (v - range[0]) / (range[1] - range[0])); };
    var d = "", pen = false, warmup = 0;
    trace.forEach(function (v, i) {
      if (v === null) { pen = false; warmup += 1; return; }
      d += (pen ? "L" : "M") + x(i).toFixed(1) + "," + y(v).toFixed(1);
      pen = true;
    });
    var svg = sv("svg", { width: W, height: H, class: "signal", "data-signal": name, "data-tokens": trace.length }, [
      sv("title", { text: name + " per generated token (" + warmup + " tokens before the pruner's window filled)" }),
      sv("text", { x: L, y: 11, text: name + " per token · " + trace.length + " tokens" +
        (threshold === undefined || threshold === null ? "" : " · threshold " + threshold) }),
      sv("text", { x: 2, y: y(range[1]) + 4, text: range[1].toPrecision(3) }),
      sv("text", { x: 2, y: y(range[0]) + 4, text: range[0].toPrecision(3) }),
      sv("line", { x1: L, x2: L, y1: T, y2: H - B, stroke: "#d0d5dd" }),
      sv("path", { d: d || "M0,0", fill: "none", stroke: color, "stroke-width": 1.5 })]);
    if (threshold !== undefined && threshold !== null) {
      svg.appendChild(sv("line", { x1: L, x2: W - R, y1: y(threshold), y2: y(threshold), stroke: "#111",
        "stroke-dasharray": "4,3", class: "threshold", "data-threshold": threshold }));
    }
    return svg;
  }

  // ------------------------------------------------------------------ a run's signals (Figure 3 a-d)
  function renderSignals(s) {
    var run = INDEX.runs[s.run];
    var box = clear(document.getElementById("signals-body"));
    if (!run.distributions.length) {
      box.appendChild(el("p", { class: "empty", text: "No signals recorded in this run (run.record_signals: true on a " +
        "pipeline with pruners records them)." }));
    } else {
      box.appendChild(el("p", { class: "note", text: "Base candidates (" + run.proposers[0] + "), one value each: the " +
        "extreme of its trace in the direction the pruner flags (max of entropy, min of the gzip ratio). Red: stopped by " +
        "this pruner; blue: the others. Dashed: the configured threshold." }));
      var charts = el("div", { class: "charts" });
      run.distributions.forEach(function (dist) {
        charts.appendChild(histogram(dist));
        charts.appendChild(meanTrace(dist));
      });
      box.appendChild(charts);
    }
    box.appendChild(el("h3", { text: "Committed-step share along the trajectory" }));
    box.appendChild(shareChart(run));
  }

  function histogram(dist) {
    var W = 360, H = 190, L = 36, B = 30, T = 8;
    var bins = dist.counts.kept.length;
    var tallest = 1;
    for (var i = 0; i < bins; i++) tallest = Math.max(tallest, dist.counts.kept[i] + dist.counts.pruned[i]);
    var bw = (W - L - 8) / bins;
    var y = function (c) { return T + (H - B - T) * (1 - c / tallest); };
    var xv = function (v) { return L + (W - L - 8) * (v - dist.lo) / (dist.hi - dist.lo); };
    var svg = sv("svg", { width: W, height: H, class: "histogram", "data-signal": dist.signal });
    for (i = 0; i < bins; i++) {
      var kept = dist.counts.kept[i], pruned = dist.counts.pruned[i];
      if (kept) svg.appendChild(sv("rect", { x: L + i * bw, y: y(kept), width: bw - 1, height: y(0) - y(kept), fill: KEPT }));
      if (pruned) svg.appendChild(sv("rect", { x: L + i * bw, y: y(kept + pruned), width: bw - 1,
        height: y(kept) - y(kept + pruned), fill: PRUNED }));
    }
    svg.appendChild(sv("line", { x1: L, x2: W - 8, y1: y(0), y2: y(0), stroke: "#98a2b3" }));
    svg.appendChild(sv("text", { x: L, y: H - 16, text: String(dist.lo) }));
    svg.appendChild(sv("text", { x: W - 40, y: H - 16, text: String(dist.hi) }));
    svg.appendChild(sv("text", { x: 2, y: T + 8, text: String(tallest) }));
    svg.appendChild(sv("text", { x: L + 40, y: H - 3, text: (dist.direction === "high" ? "max " : "min ") + dist.signal +
      " per candidate" }));
    if (dist.threshold !== null && dist.threshold !== undefined) {
      svg.appendChild(sv("line", { x1: xv(dist.threshold), x2: xv(dist.threshold), y1: T, y2: y(0), stroke: "#111",
        "stroke-dasharray": "4,3", class: "threshold", "data-threshold": dist.threshold }));
    }
    return el("div", { class: "chart" }, [el("div", { class: "title", text: dist.signal + ": " + dist.candidates.kept +
      " kept, " + dist.candidates.pruned + " pruned" + (dist.threshold === null ? "" : ", threshold " + dist.threshold) }), svg]);
  }

  function meanTrace(dist) {
    var W = 360, H = 190, L = 36, B = 30, T = 8;
    var both = dist.mean_trace.kept.concat(dist.mean_trace.pruned).concat(dist.threshold === null ? [] : [dist.threshold]);
    var range = extent(both);
    if (range[1] === range[0]) range = [range[0] - 0.5, range[1] + 0.5];
    var n = Math.max(dist.mean_trace.kept.length, dist.mean_trace.pruned.length, 2);
    var x = function (i) { return L + (W - L - 8) * i / (n - 1); };
    var y = function (v) { return T + (H - B - T) * (1 - (v - range[0]) / (range[1] - range[0])); };
    var svg = sv("svg", { width: W, height: H, class: "mean-trace", "data-signal": dist.signal });
    [["kept", KEPT], ["pruned", PRUNED]].forEach(function (pair) {
      var d = "", pen = false;
      dist.mean_trace[pair[0]].forEach(function (v, i) {
        if (v === null) { pen = false; return; }
        d += (pen ? "L" : "M") + x(i).toFixed(1) + "," + y(v).toFixed(1);
        pen = true;
      });
      if (d) svg.appendChild(sv("path", { d: d, fill: "none", stroke: pair[1], "stroke-width": 1.5 }));
    });
    if (dist.threshold !== null && dist.threshold !== undefined) {
      svg.appendChild(sv("line", { x1: L, x2: W - 8, y1: y(dist.threshold), y2: y(dist.threshold), stroke: "#111",
        "stroke-dasharray": "4,3", class: "threshold", "data-threshold": dist.threshold }));
    }
    svg.appendChild(sv("text", { x: 2, y: T + 8, text: range[1].toPrecision(3) }));
    svg.appendChild(sv("text", { x: 2, y: H - B, text: range[0].toPrecision(3) }));
    svg.appendChild(sv("text", { x: L + 40, y: H - 3, text: "token position in the step (mean over candidates)" }));
    return el("div", { class: "chart" }, [el("div", { class: "title", text: dist.signal + " by token: mean of kept vs pruned" }), svg]);
  }

  function shareChart(run) {
    var data = run.step_share_by_position;
    if (!data.positions) return el("p", { class: "empty", text: "No committed steps." });
    var W = Math.max(360, Math.min(900, 24 * data.positions + 60)), H = 180, L = 36, B = 28, T = 8;
    var bw = (W - L - 8) / data.positions;
    var svg = sv("svg", { width: W, height: H, class: "share" });
    var sources = Object.keys(data.sources);
    for (var k = 0; k < data.positions; k++) {
      var total = 0;
      sources.forEach(function (src) { total += data.sources[src][k]; });
      var y0 = H - B;
      sources.forEach(function (src) {
        var h = total ? (H - B - T) * data.sources[src][k] / total : 0;
        if (h > 0) svg.appendChild(sv("rect", { x: L + k * bw, y: y0 - h, width: Math.max(1, bw - 1), height: h,
          fill: sourceColor(run, src), "data-source": src, "data-position": k }, [sv("title", {
            text: "step " + k + ": " + src + " " + data.sources[src][k] + " of " + total + " trajectories" })]));
        y0 -= h;
      });
      if (k % Math.ceil(data.positions / 12) === 0) svg.appendChild(sv("text", { x: L + k * bw, y: H - B + 11, text: String(k) }));
    }
    svg.appendChild(sv("text", { x: 2, y: T + 8, text: "100%" }));
    svg.appendChild(sv("text", { x: 8, y: H - B, text: "0%" }));
    svg.appendChild(sv("text", { x: L + 20, y: H - 3, text: "step position in the trajectory" }));
    return el("div", { class: "chart" }, [el("div", { class: "legend" }, sources.map(function (src) {
      return el("span", {}, [el("span", { class: "swatch", style: "background:" + sourceColor(run, src) }), src]);
    })), svg]);
  }

  // ------------------------------------------------------------------ page
  function render() {
    document.body.removeAttribute("data-ready");
    var s = state();
    renderRuns(s);
    renderProblems(s);
    renderProblem(s);
    renderSignals(s);
    // #...&only=runs|problems|problem|signals shows that section alone (a figure, a screenshot)
    [["runs", "runs-section"], ["problems", "problems-section"], ["signals", "signals-section"]].forEach(function (pair) {
      document.getElementById(pair[1]).hidden = !!s.only && s.only !== pair[0];
    });
    if (s.only && s.only !== "problem") document.getElementById("problem").hidden = true;
    document.body.setAttribute("data-ready", "1");
  }
  var shown = state().problem;
  window.addEventListener("hashchange", function () {
    try {
      render();
      var now = state().problem;
      if (now && now !== shown) document.getElementById("problem").scrollIntoView();  // a problem just opened
      shown = now;
    } catch (e) { reportError(e && e.stack ? e.stack : e); }
  });
  try { render(); } catch (e) { reportError(e && e.stack ? e.stack : e); }
})();
