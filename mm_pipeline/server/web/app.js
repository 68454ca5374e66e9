// Page wiring: API key field, theme toggle, mode switch, and files in by drop, picker or paste.

import {apiKey, modelName, setApiKey} from "./api.js";
import {addCard} from "./cards.js";
import {CaptionTable} from "./table.js";

const THEME_STORE = "mmserve.theme";
const $ = (id) => document.getElementById(id);

// ---- theme: the system's unless the toggle chose one (kept in local storage) -------------------
const systemDark = matchMedia("(prefers-color-scheme: dark)");

function applyTheme() {
  const chosen = localStorage.getItem(THEME_STORE);
  if (chosen) document.documentElement.dataset.theme = chosen;
  else delete document.documentElement.dataset.theme;
  const dark = chosen ? chosen === "dark" : systemDark.matches;
  $("theme").setAttribute("aria-pressed", String(dark));
}

$("theme").addEventListener("click", () => {
  const dark = $("theme").getAttribute("aria-pressed") === "true";
  localStorage.setItem(THEME_STORE, dark ? "light" : "dark");
  applyTheme();
});
systemDark.addEventListener("change", applyTheme);
applyTheme();

// ---- API key and model name ---------------------------------------------------------------------
async function showModel() {
  const name = await modelName();
  $("model").textContent = name ? `· ${name}` : "";
}

$("api-key").value = apiKey();
$("settings").addEventListener("submit", (e) => { e.preventDefault(); setApiKey($("api-key").value.trim()); showModel(); });
$("api-key").addEventListener("change", () => { setApiKey($("api-key").value.trim()); showModel(); });
$("api-key").addEventListener("input", () => setApiKey($("api-key").value.trim()));
showModel();

// ---- modes ------------------------------------------------------------------------------------
const table = new CaptionTable(document.querySelector("#captions tbody"), (t) => {
  $("table-progress").textContent = t.total ? `${t.finished} of ${t.total} done` : "";
  $("download").disabled = !t.complete;
  $("table-view").dataset.complete = String(t.complete);
});

function mode() { return document.querySelector('input[name="mode"]:checked').value; }

function showMode() {
  $("items").hidden = mode() !== "ask";
  $("table-view").hidden = mode() !== "table";
}

for (const radio of document.querySelectorAll('input[name="mode"]')) radio.addEventListener("change", showMode);
showMode();

$("download").addEventListener("click", () => {
  const url = URL.createObjectURL(new Blob([table.jsonl()], {type: "application/x-ndjson"}));
  const a = Object.assign(document.createElement("a"), {href: url, download: "captions.jsonl"});
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60000);
});

// ---- files in: picker, drop anywhere on the page, paste ----------------------------------------
function addFiles(files) {
  const list = [...files];
  $("notice").hidden = true;
  if (!list.length) return;
  const top = $("items").firstElementChild; // new cards go on top, in the order they were given
  for (const file of list) {
    if (mode() === "table") table.add(file); else addCard($("items"), file, top);
  }
}

$("files").addEventListener("change", () => { addFiles($("files").files); $("files").value = ""; });

$("clear").addEventListener("click", () => {
  if (mode() === "table") table.clear();
  else for (const remove of document.querySelectorAll("#items .remove")) remove.click();
});

const drop = $("drop");
window.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
window.addEventListener("dragleave", (e) => { if (!e.relatedTarget) drop.classList.remove("over"); });
window.addEventListener("drop", (e) => { // anywhere on the page, so a near miss does not navigate away
  e.preventDefault();
  drop.classList.remove("over");
  const files = e.dataTransfer ? e.dataTransfer.files : [];
  if (files.length) addFiles(files);
  else Object.assign($("notice"), {hidden: false, textContent: "Nothing to add: drop files (images, videos, audio)."});
});

document.addEventListener("paste", (e) => {
  const files = e.clipboardData ? [...e.clipboardData.files] : [];
  if (!files.length) return; // plain text pastes into the fields as usual
  e.preventDefault();
  addFiles(files);
});
