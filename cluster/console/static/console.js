// The console's only script (served from /static/console.js: the CSP allows no inline script).
// - forms with data-confirm ask before they post (Cancel, Purge): the text is read from the
//   attribute, never built into code, so an id cannot become script;
// - an element #live with data-refresh-url is replaced by the same element of that URL every
//   data-refresh-ms while the tab is visible, at most a day of rounds per page load.
(function () {
  document.addEventListener("submit", function (ev) {
    const form = ev.target;
    const button = ev.submitter;
    const text = (button && button.dataset.confirm) || form.dataset.confirm;
    if (text && !window.confirm(text)) ev.preventDefault();
  });
  const live = document.getElementById("live");
  if (!live || !live.dataset.refreshUrl) return;
  const every = Math.max(1000, parseInt(live.dataset.refreshMs || "5000", 10));
  let rounds = 0;
  const maxRounds = Math.floor(86400000 / every);
  setInterval(async function () {
    if (document.hidden || ++rounds > maxRounds) return;
    try {
      const r = await fetch(live.dataset.refreshUrl, {credentials: "same-origin"});
      if (!r.ok) return;
      const t = document.createElement("template");
      t.innerHTML = await r.text();
      const fresh = t.content.querySelector("#live");
      const now = document.getElementById("live");
      if (fresh && now) now.replaceWith(fresh);
    } catch (e) { /* the next round tries again */ }
  }, every);
})();
