// MathJax 3 settings (loaded before the MathJax file, which lies in javascripts/vendor/: the
// site renders formulas offline). Two kinds of pages hold math:
// - Markdown pages: pymdownx.arithmatex (generic mode) wraps it in .arithmatex as \( \) / \[ \];
// - rendered notebooks (mkdocs-jupyter): their Markdown cells keep $ $ and $$ $$.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"], ["$", "$"]],
    displayMath: [["\\[", "\\]"], ["$$", "$$"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex|jp-RenderedMarkdown",
  },
};

document$.subscribe(() => {
  if (!window.MathJax.startup || !window.MathJax.typesetPromise) return;  // not loaded yet
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
