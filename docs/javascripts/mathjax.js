// MathJax 3 settings (loaded before the MathJax file, which lies in javascripts/vendor/: the
// site renders formulas offline). Two kinds of pages hold math:
// - Markdown pages: pymdownx.arithmatex (generic mode) wraps it in .arithmatex as \( \) / \[ \],
//   and only those elements are typeset (a stray $ in prose stays a dollar sign);
// - rendered notebooks (mkdocs-jupyter, a .jp-Notebook on the page): their Markdown cells keep
//   $ $ and $$ $$ inside ordinary paragraphs, so the whole page is typeset there, code and
//   outputs (pre, code) excepted as MathJax does by default.
const notebook = document.querySelector(".jp-Notebook") !== null;
window.MathJax = {
  tex: {
    inlineMath: notebook ? [["$", "$"], ["\\(", "\\)"]] : [["\\(", "\\)"]],
    displayMath: notebook ? [["$$", "$$"], ["\\[", "\\]"]] : [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: notebook ? {} : { ignoreHtmlClass: ".*|", processHtmlClass: "arithmatex" },
};

document$.subscribe(() => {
  if (!window.MathJax.startup || !window.MathJax.typesetPromise) return;  // not loaded yet
  MathJax.startup.output.clearCache();
  MathJax.typesetClear();
  MathJax.texReset();
  MathJax.typesetPromise();
});
