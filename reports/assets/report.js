// Draws the report's figures lazily so a 1,024-rank report is usable within seconds:
//   1. the charts in (or within NEAR_PX of) the first viewport draw at once, in page order;
//   2. a chart that scrolls near the viewport (IntersectionObserver; a finding's "show the evidence" link too) jumps
//      the queue;
//   3. the rest draw one at a time when the browser is idle (requestIdleCallback, else a timer), so scrolling and
//      hovering stay responsive in between.
// Each figure's JSON sits in a <script type="application/json"> element (escaped: it never contains "<") and is
// parsed only when its chart draws. Every chart div carries its final height (min-height) before it draws, so the
// page does not jump and the viewport test sees the real layout.
//
// For tests, benchmarks and printing:
//   data-drawn="1" on every drawn chart; body[data-first-screen="done"] when the first viewport's charts are drawn;
//   body[data-charts="done"] when all are drawn;
//   window.dtprofReport.drawAll() draws every remaining chart now and returns a Promise resolved when all are drawn
//   (also triggered by opening the report with "#draw-all" in the URL, and before printing);
//   window.dtprofReport.times: {firstScreen (chart ids), firstScreenMs, allDrawnMs} (performance.now(), i.e. since navigation started) and
//   drawMs (chart id -> ms to parse and draw it).
(function () {
  var NEAR_PX = 300;
  var charts = Array.prototype.slice.call(document.querySelectorAll("div.chart[data-fig]"));
  var config = { displaylogo: false, responsive: true, showLink: false, showSendToCloud: false,
                 toImageButtonOptions: { format: "png", scale: 2 } };
  var state = new Map();          // div -> "waiting" | "drawing" | "drawn"
  var urgent = [];                // charts near the viewport, drawn before idle work
  var busy = false, forced = false, idlePending = false, remaining = charts.length;
  var allDone = [], times = { firstScreenMs: null, allDrawnMs: null, drawMs: {} };
  var firstScreen = charts.filter(function (div) {
    var r = div.getBoundingClientRect();
    return r.bottom >= -NEAR_PX && r.top <= window.innerHeight + NEAR_PX;
  });
  charts.forEach(function (div) { state.set(div, "waiting"); });
  times.firstScreen = firstScreen.map(function (div) { return div.id; });

  function finishOne(div) {
    state.set(div, "drawn");
    remaining -= 1;
    if (times.firstScreenMs === null && firstScreen.every(function (d) { return state.get(d) === "drawn"; })) {
      times.firstScreenMs = performance.now();
      document.body.setAttribute("data-first-screen", "done");
    }
    if (remaining === 0) {
      times.allDrawnMs = performance.now();
      document.body.setAttribute("data-charts", "done");
      if (observer) observer.disconnect();
      allDone.forEach(function (resolve) { resolve(); });
    }
  }

  // Large heatmaps arrive as 16-bit codes (reports/html.py, quantize_heatmap_z): value = offset + code * scale,
  // 65535 = no value. Rebuilt here as rows of numbers (null = gap) before plotting.
  function dequantize(spec) {
    (spec.data || []).forEach(function (trace) {
      var q = trace.z && trace.z.dtprof_quantized;
      if (!q) return;
      var bin = atob(q.bdata), bytes = new Uint8Array(bin.length);
      for (var k = 0; k < bin.length; k++) bytes[k] = bin.charCodeAt(k);
      var codes = new Uint16Array(bytes.buffer), rows = q.shape[0], cols = q.shape[1], z = new Array(rows);
      for (var r = 0; r < rows; r++) {
        var row = new Array(cols);
        for (var c = 0; c < cols; c++) {
          var code = codes[r * cols + c];
          row[c] = code === 65535 ? null : q.offset + code * q.scale;
        }
        z[r] = row;
      }
      trace.z = z;
    });
    return spec;
  }

  function draw(div, then) {
    state.set(div, "drawing");
    busy = true;
    var t0 = performance.now();
    function done() { finishOne(div); busy = false; then(); }
    var spec;
    try {
      spec = dequantize(JSON.parse(document.getElementById(div.getAttribute("data-fig")).textContent));
    } catch (e) {
      console.error("dtprof: figure " + div.id + " has unreadable data: " + e);
      setTimeout(done, 0);
      return;
    }
    Plotly.newPlot(div, spec.data, spec.layout, config).then(function () {
      div.setAttribute("data-drawn", "1");
      times.drawMs[div.id] = Math.round(performance.now() - t0);
      setTimeout(done, 0);   // yield to the browser between charts (paint, input)
    }, function (e) {
      console.error("dtprof: figure " + div.id + " failed to draw: " + e);
      setTimeout(done, 0);
    });
  }

  function nextWaiting(list) {
    while (list.length && state.get(list[0]) !== "waiting") list.shift();
    return list.length ? list.shift() : null;
  }

  var idleQueue = charts.slice();
  function pump() {
    if (busy || remaining === 0) return;
    var div = nextWaiting(urgent);
    if (div) { draw(div, pump); return; }
    if (forced) { div = nextWaiting(idleQueue); if (div) draw(div, pump); return; }
    if (idlePending) return;
    idlePending = true;
    var onIdle = function () {
      idlePending = false;
      if (busy) return;
      var d = nextWaiting(urgent) || nextWaiting(idleQueue);
      if (d) draw(d, pump);
    };
    if (window.requestIdleCallback) window.requestIdleCallback(onIdle, { timeout: 1000 });
    else setTimeout(onIdle, 50);
  }

  function drawAll() {
    forced = true;
    var p = new Promise(function (resolve) {
      if (remaining === 0) resolve(); else allDone.push(resolve);
    });
    pump();
    return p;
  }

  var observer = null;
  if (window.IntersectionObserver) {
    observer = new IntersectionObserver(function (entries) {
      entries.forEach(function (e) {
        if (e.isIntersecting && state.get(e.target) === "waiting") urgent.push(e.target);
      });
      pump();
    }, { rootMargin: NEAR_PX + "px 0px" });
    charts.forEach(function (div) { observer.observe(div); });
  }

  window.dtprofReport = { drawAll: drawAll, times: times };
  window.addEventListener("beforeprint", drawAll);
  if (charts.length === 0) {
    times.firstScreenMs = times.allDrawnMs = performance.now();
    document.body.setAttribute("data-first-screen", "done");
    document.body.setAttribute("data-charts", "done");
    return;
  }
  if (firstScreen.length === 0) {
    times.firstScreenMs = performance.now();
    document.body.setAttribute("data-first-screen", "done");
  }
  urgent = firstScreen.slice();
  if (location.hash === "#draw-all") drawAll(); else pump();
})();
