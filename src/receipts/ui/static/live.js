// Live updates for the review console. The pages work without this script;
// with it, every region marked data-live is re-read from the server every
// body[data-refresh] seconds (the same URL, so the same escaping and the same
// access rules), clocks tick every second, and a button pauses and resumes it.
// A region being edited (focus inside, a box ticked, text typed) is left alone
// until the operator is done. No inline code: the CSP allows this file only.
(() => {
  "use strict";
  const body = document.body;
  const every = Math.max(1, Number(body.dataset.refresh) || 5) * 1000;
  const toggle = document.getElementById("live-toggle");
  const status = document.getElementById("live-status");
  const KEY = "receipts-live-paused";
  let paused = sessionStorage.getItem(KEY) === "1";
  let skew = Number(body.dataset.now) - Date.now(); // server clock minus ours
  let busy = false;

  function say(text) { if (status) status.textContent = text; }

  function showToggle() {
    if (!toggle) return;
    toggle.hidden = false;
    toggle.setAttribute("aria-pressed", String(paused));
    toggle.textContent = paused ? "Resume live updates" : "Pause live updates";
  }

  const TYPED = /^(text|password|search|number|email|url|tel|)$/;

  function edited(region) {
    const focused = document.activeElement;
    if (focused && region.contains(focused) && (focused.tagName === "SELECT"
        || focused.tagName === "TEXTAREA"
        || (focused.tagName === "INPUT" && TYPED.test(focused.getAttribute("type") || "")))) {
      return true; // the operator is typing or choosing here
    }
    for (const input of region.querySelectorAll("input, select, textarea")) {
      if (input.type !== "hidden" && changed(input)) return true;
    }
    for (const details of region.querySelectorAll("details[data-default-open]")) {
      if (details.open !== (details.dataset.defaultOpen === "1")) return true;
    }
    return false;
  }

  // Whether a control differs from what the server drew. A <select> has no
  // defaultValue (it would always look changed): compare each option's
  // selection with its defaultSelected (the first option when none is marked).
  function changed(input) {
    if (input.type === "checkbox" || input.type === "radio") {
      return input.checked !== input.defaultChecked;
    }
    if (input.tagName === "SELECT") {
      const options = [...input.options];
      const marked = options.some((o) => o.defaultSelected);
      return options.some((o, i) => o.selected
        !== (o.defaultSelected || (!marked && !input.multiple && i === 0)));
    }
    return input.value !== input.defaultValue;
  }

  function plural(n, unit) { return n + " " + unit + (n === 1 ? "" : "s"); }

  function ago(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return plural(s, "second");
    const m = Math.floor(s / 60);
    if (m < 60) return plural(m, "minute") + " " + plural(s % 60, "second");
    return plural(Math.floor(m / 60), "hour") + " " + plural(m % 60, "minute");
  }

  function tick() {
    const now = Date.now() + skew;
    for (const el of document.querySelectorAll("[data-at]")) {
      const at = Number(el.dataset.at);
      if (at) el.textContent = ago(now - at) + " ago";
    }
    for (const el of document.querySelectorAll("[data-until]")) {
      const until = Number(el.dataset.until);
      if (until) el.textContent = until > now ? ago(until - now) : "no time";
    }
  }

  async function refresh() {
    if (paused || busy || document.hidden) return;
    busy = true;
    try {
      const response = await fetch(location.href, {
        headers: { "X-Receipts-Live": "1" }, credentials: "same-origin", cache: "no-store",
      });
      const text = await response.text();
      if (!response.ok) {
        say("Not updated: " + text.slice(0, 200));
        return;
      }
      const fresh = new DOMParser().parseFromString(text, "text/html");
      const now = Number(fresh.body.dataset.now);
      if (now) skew = now - Date.now();
      let held = 0;
      for (const region of document.querySelectorAll("[data-live][id]")) {
        const next = fresh.getElementById(region.id);
        if (!next) continue;
        if (edited(region)) { held += 1; continue; }
        region.replaceWith(document.importNode(next, true));
      }
      tick();
      say(held ? "Updated; the part you are editing waits until you are done."
               : "Updated " + new Date(Date.now() + skew).toISOString().slice(11, 19) + " UTC");
    } catch (error) {
      say("Not updated: the page did not answer (" + error.message + ")");
    } finally {
      busy = false;
    }
  }

  if (toggle) {
    toggle.addEventListener("click", () => {
      paused = !paused;
      sessionStorage.setItem(KEY, paused ? "1" : "0");
      showToggle();
      say(paused ? "Live updates paused." : "Live updates on.");
      if (!paused) refresh();
    });
  }
  showToggle();
  say(paused ? "Live updates paused." : "Live updates on.");
  tick();
  setInterval(tick, 1000);
  setInterval(refresh, every);
  document.addEventListener("visibilitychange", () => { if (!document.hidden) refresh(); });
})();
