// The trajectory viewer's pages (miles/run/viewer.py embeds their data as JSON in #miles-data). No library, no
// network: the same file runs in pages served by `miles view` and in the static copy `miles report` writes.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("miles-data").textContent);
  const app = document.getElementById("app");
  let tokenView = "mask"; // or "gap": how the response's tokens are shaded, kept from one sample to the next

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  // The page's data holds a NaN or an infinity as the string JavaScript spells it (JSON has no such number).
  const NONFINITE = new Set(["NaN", "Infinity", "-Infinity"]);
  function num(x) { return typeof x === "number" && isFinite(x) ? x : null; }
  function fmt(x) {
    if (NONFINITE.has(x)) return x;
    x = num(x);
    if (x === null) return "—";
    return Number.isInteger(x) ? String(x) : String(Number(x.toPrecision(4)));
  }
  function rewardRaw(sample) {
    const r = sample.reward;
    return r !== null && typeof r === "object" ? r.score : r;
  }
  function rewardOf(sample) { return num(rewardRaw(sample)); }
  function rewardText(r) {
    return r !== null && typeof r === "object" ? fmt(r.score) + "  " + JSON.stringify(r) : fmt(r);
  }

  // What a step file holds that is not a sample: each named by file and line; the samples around it are shown.
  function unreadableItems(source, list, count) {
    const items = list.map((u) => el("li", {}, (u.line === null ? source : `${source}, line ${u.line}`) + ": " + u.why));
    if (count > list.length) items.push(el("li", {}, `${source}: and ${count - list.length} more`));
    return items;
  }
  function unreadableNotice(items) {
    return el("div", {id: "unreadable", class: "error"},
      el("p", {}, "Not shown: what cannot be read (every other sample is shown)."), el("ul", {}, items));
  }

  // ----- the index: one row per step --------------------------------------------------------------------------
  function indexPage() {
    document.title = "Trajectories: " + data.run;
    app.append(el("nav", {}, data.back ? el("a", {href: data.back}, "← report") : null));
    app.append(el("h1", {}, "Trajectories of ", el("code", {text: data.run})));
    app.append(el("p", {class: "note"}, `${data.steps.length} step(s), the first groups of each ` +
      "(run.trajectories). Mean reward: of the samples shown." + (data.live ? " Reload for the steps written since." : "")));
    const bad = data.steps.filter((s) => s.unreadable_count);
    if (bad.length) app.append(unreadableNotice(bad.flatMap((s) => unreadableItems(s.source, s.unreadable, s.unreadable_count))));
    const rows = data.steps.map((s) => el("tr", {},
      el("td", {}, el("a", {href: s.file, class: "step-link"}, "step " + s.step)),
      el("td", {class: "num"}, String(s.samples)),
      el("td", {class: "num mean-reward"}, fmt(s.mean_reward)),
      el("td", {class: "num"}, String(s.failed)),
      el("td", {class: "num"}, fmt(s.mean_length)),
      el("td", {class: "num"}, String(s.pages)),
      el("td", {class: "num unreadable-count"}, s.unreadable_count ? String(s.unreadable_count) : "")));
    app.append(el("table", {id: "steps"},
      el("thead", {}, el("tr", {}, ["step", "samples", "mean reward", "failed", "mean response tokens", "pages",
        "unreadable lines"].map((h) => el("th", {}, h)))),
      el("tbody", {}, rows)));
  }

  // ----- a step: its samples, filters, and one sample's detail -------------------------------------------------
  const COLUMNS = [
    ["group", (s) => s.group], ["index", (s) => s.index], ["reward", rewardOf], ["status", (s) => s.status],
    ["reason", (s) => s.reason], ["turns", (s) => s.turns], ["response tokens", (s) => s.tokens.length],
    ["advantage", (s) => num(s.advantage)],
  ];
  let sortColumn = null, sortDescending = false;

  function stepPage() {
    document.title = `Step ${data.step}: ${data.run}`;
    app.append(el("nav", {}, el("a", {href: data.index}, "← all steps"),
      data.prev ? el("a", {href: data.prev, id: "prev"}, "← step " + data.prev_step) : null,
      data.next ? el("a", {href: data.next, id: "next"}, "step " + data.next_step + " →") : null));
    app.append(el("h1", {}, `Step ${data.step} `, el("small", {}, el("code", {text: data.run}))));
    if (data.pages.length > 1) app.append(pager());
    if (data.unreadable_count) app.append(unreadableNotice(unreadableItems(data.source, data.unreadable, data.unreadable_count)));
    const statuses = [...new Set(data.samples.map((s) => s.status))].sort();
    const input = (id, label) => el("label", {}, label + " ",
      el("input", {id, type: "number", step: "any", size: 6, oninput: renderList}));
    app.append(el("form", {id: "filters", onsubmit: (e) => e.preventDefault()},
      input("f-reward-min", "reward ≥"), input("f-reward-max", "≤"),
      el("label", {}, "status ", el("select", {id: "f-status", onchange: renderList},
        el("option", {value: ""}, "any"), statuses.map((s) => el("option", {value: s}, s)))),
      input("f-len-min", "response tokens ≥"), input("f-len-max", "≤")));
    app.append(el("p", {id: "count", class: "note"}));
    app.append(el("table", {id: "samples"},
      el("thead", {}, el("tr", {}, COLUMNS.map(([name], i) => el("th", {
        class: "sortable", title: "sort", onclick: () => {
          sortDescending = sortColumn === i ? !sortDescending : false;
          sortColumn = i;
          renderList();
        }}, name)))),
      el("tbody", {})));
    app.append(el("section", {id: "detail"}));
    renderList();
    window.addEventListener("hashchange", showFromHash);
    showFromHash();
  }

  // The step's pages: each shows some of its samples (miles/run/viewer.py, PAGE_SAMPLES); the first, the last and
  // those near this one are linked.
  function pager() {
    const n = data.page_number, last = data.pages.length;
    const link = (number, text, id) => el("a", {href: data.pages[number - 1][0], class: "page-link", id}, text);
    const parts = [n > 1 ? link(n - 1, "← page " + (n - 1), "prev-page") : null];
    let gap = false;
    for (let number = 1; number <= last; number++) {
      if (number === 1 || number === last || Math.abs(number - n) <= 3) {
        parts.push(number === n ? el("b", {class: "current-page"}, String(number)) : link(number, String(number)));
        gap = false;
      } else if (!gap) {
        parts.push(el("span", {}, "…"));
        gap = true;
      }
    }
    parts.push(n < last ? link(n + 1, "page " + (n + 1) + " →", "next-page") : null);
    return el("nav", {id: "pager"}, `page ${n} of ${last}: `, parts);
  }

  function bound(id) {
    const value = document.getElementById(id).value;
    return value === "" ? null : Number(value);
  }

  function renderList() {
    const rMin = bound("f-reward-min"), rMax = bound("f-reward-max");
    const lMin = bound("f-len-min"), lMax = bound("f-len-max");
    const status = document.getElementById("f-status").value;
    let shown = data.samples.map((s, i) => [s, data.first + i]).filter(([s]) => {
      const reward = rewardOf(s), length = s.tokens.length;
      if ((rMin !== null || rMax !== null) && reward === null) return false;
      return (rMin === null || reward >= rMin) && (rMax === null || reward <= rMax) &&
        (lMin === null || length >= lMin) && (lMax === null || length <= lMax) && (!status || s.status === status);
    });
    if (sortColumn !== null) {
      const key = COLUMNS[sortColumn][1];
      const rank = (v) => v === null || v === undefined ? -Infinity : v;
      shown = shown.slice().sort(([a], [b]) => {
        const x = rank(key(a)), y = rank(key(b));
        return (x < y ? -1 : x > y ? 1 : 0) * (sortDescending ? -1 : 1);
      });
    }
    const selected = selectedPosition();
    document.querySelector("#samples tbody").replaceChildren(...shown.map(([s, position]) => el("tr", {
      "data-position": position, class: position === selected ? "sample selected" : "sample",
      onclick: () => { location.hash = "sample-" + position; },
    },
      el("td", {}, el("a", {href: "#sample-" + position}, String(s.group))),
      el("td", {class: "num"}, String(s.index)),
      el("td", {class: "num"}, fmt(rewardRaw(s))),
      el("td", {class: "status-" + s.status}, s.status),
      el("td", {}, s.reason || ""),
      el("td", {class: "num"}, fmt(s.turns)),
      el("td", {class: "num"}, String(s.tokens.length)),
      el("td", {class: "num"}, fmt(s.advantage)))));
    const count = `${shown.length} of ${data.samples.length} samples`;
    document.getElementById("count").textContent = data.pages.length === 1 ? count : count + " on this page " +
      `(samples ${data.first + 1} to ${data.first + data.samples.length} of the step's ${data.total})`;
  }

  // #sample-N: the N-th sample of the step's file (from 0), on whichever page holds it.
  function hashPosition() {
    const match = /^#sample-(\d+)$/.exec(location.hash);
    return match ? Number(match[1]) : null;
  }
  function selectedPosition() {
    const position = hashPosition();
    return position !== null && position >= data.first && position < data.first + data.samples.length ? position : null;
  }

  function showFromHash() {
    const position = selectedPosition();
    const wanted = hashPosition();
    const other = position === null && wanted !== null &&
      data.pages.find(([, first, count]) => wanted >= first && wanted < first + count);
    if (other) return location.replace(other[0] + location.hash);
    for (const row of document.querySelectorAll("#samples tr.sample")) {
      row.classList.toggle("selected", Number(row.dataset.position) === position);
    }
    const box = document.getElementById("detail");
    box.replaceChildren();
    if (position !== null) renderDetail(box, data.samples[position - data.first]);
  }

  // Log-prob gap |train - rollout| on a log scale: below 1e-4 white, 1 and above deep red.
  const GAP_LOW = -4, GAP_HIGH = 0;
  function gapColour(gap) {
    const t = Math.min(1, Math.max(0, (Math.log10(Math.max(gap, 1e-12)) - GAP_LOW) / (GAP_HIGH - GAP_LOW)));
    const stops = [[255, 255, 255], [253, 216, 53], [220, 38, 38]];
    const [a, b, u] = t < 0.5 ? [stops[0], stops[1], t * 2] : [stops[1], stops[2], t * 2 - 1];
    return `rgb(${a.map((c, i) => Math.round(c + (b[i] - c) * u)).join(",")})`;
  }

  function tokenText(token) {
    if (token === "") return "∅";
    return token.replace(/\n/g, "↵\n").replace(/\t/g, "→\t");
  }

  function renderTokens(s) {
    const tokens = el("div", {id: "tokens", class: "tokens"});
    s.tokens.forEach((token, i) => {
      const policy = s.loss_mask[i] === 1;
      const at = (list) => Array.isArray(list) ? list[i] : null;
      const rollout = num(at(s.rollout_logprobs)), train = num(at(s.train_logprobs));
      const gap = policy && rollout !== null && train !== null ? Math.abs(train - rollout) : null;
      const title = [`token ${i}: ${JSON.stringify(token)}`,
        policy ? "policy token (loss mask 1)" : "observation (loss mask 0: not trained on)",
        `rollout log-prob: ${fmt(policy ? at(s.rollout_logprobs) : null)}`, `train log-prob: ${fmt(at(s.train_logprobs))}`,
        `|train - rollout|: ${gap === null ? "—" : gap.toExponential(2)}`, `advantage: ${fmt(at(s.advantages))}`];
      // the numbers, under the token in the "values" view: its rollout log-prob and its advantage
      const values = el("small", {class: "vals"}, el("i", {class: "v-logprob"}, policy ? fmt(at(s.rollout_logprobs)) : "·"),
        el("i", {class: "v-advantage"}, policy ? fmt(at(s.advantages)) : "·"));
      const span = el("span", {class: policy ? "tok pol" : "tok obs", title: title.join("\n")}, tokenText(token), values);
      if (gap !== null) {
        span.style.setProperty("--gap", gapColour(gap));
        span.dataset.gap = gap;
      }
      tokens.append(span);
    });
    return tokens;
  }

  function legend() {
    const ticks = [];
    for (let e = GAP_LOW; e <= GAP_HIGH; e++) ticks.push(el("span", {}, e === GAP_LOW ? "≤1e" + e : "1e" + e));
    const stops = [];
    for (let i = 0; i <= 10; i++) stops.push(gapColour(Math.pow(10, GAP_LOW + (GAP_HIGH - GAP_LOW) * i / 10)));
    return [
      el("div", {class: "legend legend-mask"},
        el("span", {class: "tok pol"}, "policy token"), " sampled by the policy, trained on (loss mask 1)  ",
        el("span", {class: "tok obs"}, "observation"), " tool output or environment text (loss mask 0)"),
      el("div", {class: "legend legend-gap"}, "|train log-prob − rollout log-prob| of each policy token (nats):",
        el("div", {class: "scale"}, el("div", {class: "bar", style: `background: linear-gradient(to right, ${stops.join(",")})`}),
          el("div", {class: "ticks"}, ticks)),
        el("span", {class: "tok obs"}, "observation"), " not sampled: no gap; ",
        el("span", {class: "tok pol nogap"}, "grey"), " no trainer log-prob (failed sample, rollout-only run)"),
      el("div", {class: "legend legend-values"}, "under each policy token: its log-prob as the engine sampled it, then "
        + "its advantage (· for an observation: not sampled, not trained on)"),
    ];
  }

  function renderPrompt(prompt) {
    if (typeof prompt === "string") return el("pre", {class: "prompt"}, prompt);
    if (!Array.isArray(prompt)) return el("pre", {class: "prompt"}, JSON.stringify(prompt, null, 2));
    return el("div", {class: "prompt"}, prompt.map((message) => {
      const content = message && typeof message === "object" ? message.content : message;
      const parts = Array.isArray(content) ? content : [content];
      return el("div", {class: "message"}, el("b", {}, (message && message.role) || ""),
        parts.map((part) => {
          if (typeof part === "string") return el("pre", {}, part);
          if (part && part.type === "image") return el("span", {class: "image-part"}, "[image]");
          if (part && typeof part.text === "string") return el("pre", {}, part.text);
          return el("pre", {}, JSON.stringify(part, null, 2));
        }));
    }));
  }

  function renderToolCalls(calls) {
    const turns = new Map();
    for (const call of calls) {
      if (!turns.has(call.turn)) turns.set(call.turn, []);
      turns.get(call.turn).push(call);
    }
    return el("div", {id: "tool-calls"}, [...turns].map(([turn, list]) => el("div", {class: "turn"},
      el("h4", {}, "turn " + turn),
      el("ul", {}, list.map((call) => el("li", {class: "tool-call"},
        el("code", {class: "tool-name"}, call.name || "(no name)"),
        el("pre", {class: "arguments"}, typeof call.arguments === "string" ? call.arguments
          : JSON.stringify(call.arguments, null, 2)),
        call.error ? el("div", {class: "error"}, "error: " + call.error) : null))))));
  }

  function renderDetail(box, s) {
    const field = (name, value, id) => el("tr", {}, el("th", {}, name), el("td", {id}, value));
    box.append(el("h2", {}, `Group ${s.group}, sample ${s.index}`),
      el("table", {class: "fields"},
        field("reward", rewardText(s.reward), "d-reward"),
        field("status", s.status, "d-status"),
        field("reason", s.reason || "—", "d-reason"),
        field("advantage (mean over its loss tokens)", fmt(s.advantage), "d-advantage"),
        field("turns", fmt(s.turns), "d-turns"),
        field("label", s.label === null || s.label === undefined ? "—" : typeof s.label === "string" ? s.label
          : JSON.stringify(s.label), "d-label"),
        field("weight versions", JSON.stringify(s.weight_versions), "d-weights"),
        field("tokens", `${s.prompt_tokens.length} prompt, ${s.tokens.length} response ` +
          `(${s.loss_mask.filter((m) => m === 1).length} trained)`, "d-tokens")),
      el("h3", {}, "Prompt"), renderPrompt(s.prompt),
      el("details", {}, el("summary", {}, `prompt as ${s.prompt_tokens.length} tokens`),
        el("div", {class: "tokens prompt-tokens"}, s.prompt_tokens.map((t) => el("span", {class: "tok"}, tokenText(t))))));
    const response = el("div", {id: "response", class: "view-" + tokenView});
    const toggle = (value, label) => el("label", {}, el("input", {
      type: "radio", name: "token-view", id: "view-" + value, value, checked: tokenView === value,
      onchange: () => { tokenView = value; response.className = "view-" + value; },
    }), " " + label);
    response.append(el("div", {class: "toggle"}, "shade tokens by: ", toggle("mask", "loss mask"),
      toggle("gap", "log-prob gap (rollout vs training)"), toggle("values", "loss mask, with each token's log-prob and advantage")),
      ...legend(), renderTokens(s));
    box.append(el("h3", {}, `Response: ${s.tokens.length} tokens`), response,
      el("h3", {}, "Response text (what the reward scored)"), el("pre", {id: "response-text"}, s.response_text || ""));
    box.append(el("h3", {}, `Tool calls (${s.tool_calls.length})`),
      s.tool_calls.length ? renderToolCalls(s.tool_calls) : el("p", {class: "note"}, "none"));
    if (s.images.length) {
      box.append(el("h3", {}, `Images (${s.images.length})`), el("div", {id: "images"}, s.images.map((image, i) =>
        image.src ? el("figure", {}, el("img", {src: image.src, alt: "image " + (i + 1), title: image.ref, class: "sample-image"}),
          el("figcaption", {}, image.ref))
          : el("p", {class: "error image-refused"}, `image not shown: ${image.ref} (${image.why})`))));
    }
  }

  if (data.page === "index") indexPage();
  else stepPage();
})();
