// "One at a time" mode: a card per file with a preview, its upload progress and the answers to the
// questions asked about it (the first one, the modality's default prompt, is asked on upload).

import {OTHER_PROMPT, PROMPTS, ask, forget, kindOf, upload} from "./api.js";

const PREVIEW_TAGS = {image: "img", video: "video", audio: "audio"};
const FINAL_UPLOAD_ERRORS = new Set([400, 413, 415]); // the same bytes would fail again: no retry

export function formatBytes(n) {
  const units = ["bytes", "KB", "MB", "GB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function clone(id) { return document.getElementById(id).content.firstElementChild.cloneNode(true); }

function preview(file, kind) {
  const box = document.createElement("div");
  if (!kind) { box.textContent = "No preview for this file type."; box.className = "muted"; return box; }
  const el = document.createElement(PREVIEW_TAGS[kind]);
  el.src = URL.createObjectURL(file);
  if (kind === "image") el.alt = `Preview of ${file.name}`; else { el.controls = true; el.preload = "metadata"; }
  el.setAttribute("aria-label", `Preview of ${file.name}`);
  el.addEventListener("error", () => { // e.g. a codec this browser lacks; the server may still read it
    box.replaceChildren(Object.assign(document.createElement("p"), {
      className: "muted", textContent: "This browser cannot preview this file."}));
  }, {once: true});
  box.append(el);
  return box;
}

/** Stats of one answer: time to first token, decode rate, prefix-cache and encoder-cache reuse. */
function showStats(li, res) {
  const stat = (name, text) => { li.querySelector(`[data-stat="${name}"]`).textContent = text; };
  const tokens = res.usage ? res.usage.completion_tokens : 0;
  stat("ttft", res.firstAt === null ? "–" : `${Math.round(res.firstAt - res.sentAt)} ms`);
  // tokens after the first over the time after the first: the decode rate, without the prefill
  const decodeS = res.firstAt === null ? 0 : (res.endAt - res.firstAt) / 1000;
  stat("tps", tokens > 1 && decodeS > 0 ? ((tokens - 1) / decodeS).toFixed(1) : "–");
  const details = res.usage && res.usage.prompt_tokens_details;
  stat("cached", details ? `${details.cached_tokens} of ${res.usage.prompt_tokens}` : "–");
  stat("encoder", String(res.encoderHits));
}

async function runQuestion(card, prompt) {
  const li = clone("answer-template");
  li.querySelector(".question").textContent = prompt;
  const text = li.querySelector(".text");
  card.answers.prepend(li); // newest first: the answer being streamed stays in view
  card.askButton.disabled = true;
  try {
    const res = await ask(card.fileId, prompt, {onText: (piece) => { text.textContent += piece; }});
    text.textContent = res.text;
    showStats(li, res);
    li.dataset.state = "done";
  } catch (err) {
    const box = li.querySelector(".error");
    box.textContent = err.message || String(err);
    box.hidden = false;
    li.querySelector(".stats").hidden = true;
    if (!text.textContent) text.hidden = true;
    li.dataset.state = "error";
  } finally {
    card.askButton.disabled = false;
  }
}

/** Add a card for ``file`` to ``container`` (before ``before``, or last): upload it, then ask the
 * default question. */
export function addCard(container, file, before = null) {
  const kind = kindOf(file);
  const node = clone("item-template");
  const card = {
    node, fileId: null, answers: node.querySelector(".answers"), askButton: node.querySelector(".ask-button"),
  };
  node.dataset.kind = kind || "unknown";
  node.querySelector(".name").textContent = file.name || "pasted file";
  node.querySelector(".meta").textContent = `${kind || "type unknown"} · ${formatBytes(file.size)}`;
  node.querySelector(".preview").append(preview(file, kind));
  const prompt = node.querySelector(".prompt");
  prompt.value = PROMPTS[kind] || OTHER_PROMPT;
  const bar = node.querySelector("progress");
  const status = node.querySelector(".upload-text");
  node.querySelector(".ask").addEventListener("submit", (e) => {
    e.preventDefault();
    if (card.fileId && !card.askButton.disabled && prompt.value.trim()) runQuestion(card, prompt.value.trim());
  });
  prompt.addEventListener("keydown", (e) => { // Ctrl/Cmd+Enter asks; Enter alone is a new line
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); card.askButton.click(); }
  });
  node.querySelector(".remove").addEventListener("click", () => {
    if (card.fileId) forget(card.fileId);
    node.remove();
  });
  const failure = node.querySelector(".upload-error");
  const retry = node.querySelector(".retry");

  function start() {
    node.dataset.upload = "uploading";
    status.textContent = "uploading…";
    failure.hidden = retry.hidden = true;
    upload(file, (f) => { bar.value = f; status.textContent = `${Math.round(f * 100)}%`; })
      .then((obj) => {
        card.fileId = obj.id;
        node.dataset.upload = "done";
        status.textContent = "uploaded";
        card.askButton.disabled = false;
        return runQuestion(card, prompt.value.trim());
      })
      .catch((err) => {
        node.dataset.upload = "error";
        status.textContent = "";
        bar.value = 0;
        failure.textContent = err.message || String(err);
        failure.hidden = false;
        retry.hidden = FINAL_UPLOAD_ERRORS.has(err.status); // e.g. retry after typing the API key
      });
  }

  retry.addEventListener("click", start);
  container.insertBefore(node, before);
  start();
  return card;
}
