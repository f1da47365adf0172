// Draws the report's figures one after another so the header and cards show at once. Each figure's JSON sits in
// a <script type="application/json"> element (escaped: it never contains "<"). Progress is exposed for tests:
// data-drawn="1" on every drawn chart, body[data-charts="done"] when all are drawn.
(function () {
  var charts = Array.prototype.slice.call(document.querySelectorAll("div.chart[data-fig]"));
  var config = { displaylogo: false, responsive: true, showLink: false, showSendToCloud: false,
                 toImageButtonOptions: { format: "png", scale: 2 } };
  var i = 0;
  function next() {
    if (i >= charts.length) { document.body.setAttribute("data-charts", "done"); return; }
    var div = charts[i++];
    var spec;
    try {
      spec = JSON.parse(document.getElementById(div.getAttribute("data-fig")).textContent);
    } catch (e) {
      console.error("dtprof: figure " + div.id + " has unreadable data: " + e);
      setTimeout(next, 0);
      return;
    }
    Plotly.newPlot(div, spec.data, spec.layout, config).then(function () {
      div.setAttribute("data-drawn", "1");
      setTimeout(next, 0);
    }, function (e) {
      console.error("dtprof: figure " + div.id + " failed to draw: " + e);
      setTimeout(next, 0);
    });
  }
  next();
})();
