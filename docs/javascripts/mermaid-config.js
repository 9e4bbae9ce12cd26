// Layout defaults for the diagrams on this site. Material calls mermaid.initialize() itself when a
// page has a diagram, replacing any earlier configuration, so the defaults are merged into that call.
// The state diagram has two pairs of parallel edges (extend, draft) and a self-loop (retire): Mermaid
// puts an edge's label at the middle of its curve, and with the default spacing (50, 50) the labels of
// a pair overlap. Tall ranks and narrow node spacing keep them apart (checked by eye in headless
// Chromium: tests/docs/test_docs_browser.py saves a screenshot).
(function () {
  if (typeof mermaid === "undefined") return;
  var initialize = mermaid.initialize.bind(mermaid);
  mermaid.initialize = function (config) {
    config = Object.assign({}, config);
    config.state = Object.assign({ nodeSpacing: 30, rankSpacing: 110 }, config.state);
    return initialize(config);
  };
})();
