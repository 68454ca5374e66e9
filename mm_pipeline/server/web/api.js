// The server's HTTP API as the page uses it: upload with progress, a streamed answer, errors in words.
// Plain ES module served as is (no build step).

// The defaults of `mmserve caption`, so a caption here equals the job's caption.
export const PROMPTS = {image: "Describe this image.", video: "Describe this video.", audio: "Describe this audio."};
export const OTHER_PROMPT = "Describe this file.";
const KEY_STORE = "mmserve.apiKey";
const UPLOAD_TIMEOUT_MS = 10 * 60 * 1000;

const HINTS = {
  400: "The server could not use this", 401: "API key missing or wrong", 403: "Not allowed",
  404: "Not found", 413: "Too large", 415: "Unsupported media type", 429: "The server is busy, try again",
  500: "The server failed", 503: "The server is unavailable, try again",
};

/** "image" | "video" | "audio" from the browser's MIME type, or null (the server sniffs anyway). */
export function kindOf(file) {
  const top = (file.type || "").split("/")[0];
  return Object.hasOwn(PROMPTS, top) ? top : null;
}

export function apiKey() { return localStorage.getItem(KEY_STORE) || ""; }

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key); else localStorage.removeItem(KEY_STORE);
}

function authHeaders() {
  const key = apiKey().trim();
  return key ? {Authorization: "Bearer " + key} : {};
}

/** An error response in words: a hint for the status, then the message from OpenAI's error JSON. */
export function describeError(status, bodyText) {
  let message = "";
  try {
    const error = JSON.parse(bodyText).error;
    message = error.message || "";
    // a part of the page's own one-file chat ("messages[0].content[0]: ..."): the card names the file
    if (error.param && message.startsWith("messages[")) message = message.replace(/^messages\[[^:]*: /, "");
  } catch (_) { /* not OpenAI's error JSON */ }
  if (!message) message = (bodyText || "").trim().slice(0, 300) || "the server sent no details";
  return `${HINTS[status] || "Request failed"} (HTTP ${status}): ${message}`;
}

/** POST /v1/files; ``onProgress(fraction)`` while the bytes go out. Resolves to the file object. */
export function upload(file, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest(); // fetch has no upload progress; XHR does
    xhr.open("POST", "v1/files");
    for (const [k, v] of Object.entries(authHeaders())) xhr.setRequestHeader(k, v);
    xhr.timeout = UPLOAD_TIMEOUT_MS;
    xhr.upload.onprogress = (e) => { if (e.lengthComputable && e.total) onProgress(e.loaded / e.total); };
    xhr.onload = () => {
      if (xhr.status >= 200 && xhr.status < 300) { onProgress(1); resolve(JSON.parse(xhr.responseText)); }
      else reject(Object.assign(new Error("Upload failed. " + describeError(xhr.status, xhr.responseText)),
                                {status: xhr.status}));
    };
    xhr.onerror = () => reject(new Error("Upload failed: the server could not be reached."));
    xhr.ontimeout = () => reject(new Error(`Upload failed: no answer within ${UPLOAD_TIMEOUT_MS / 60000} minutes.`));
    const form = new FormData();
    form.append("purpose", "user_data");
    form.append("file", file, file.name || "pasted");
    xhr.send(form);
  });
}

/** DELETE /v1/files/{id}; best effort (the page no longer needs the file). */
export function forget(fileId) {
  fetch(`v1/files/${encodeURIComponent(fileId)}`, {method: "DELETE", headers: authHeaders()}).catch(() => {});
}

/** The served model's id, or "" when the server does not tell (e.g. a key is needed). */
export async function modelName() {
  try {
    const r = await fetch("v1/models", {headers: authHeaders()});
    return r.ok ? ((await r.json()).data[0] || {}).id || "" : "";
  } catch (_) { return ""; }
}

/**
 * Ask about an uploaded file and stream the answer: ``onText(piece)`` per SSE chunk.
 * Resolves to {text, usage, encoderHits, sentAt, firstAt, endAt} (performance.now() times).
 */
export async function ask(fileId, prompt, {maxTokens = null, onText = () => {}} = {}) {
  const body = {
    messages: [{role: "user", content: [{type: "file", file: {file_id: fileId}}, {type: "text", text: prompt}]}],
    stream: true, stream_options: {include_usage: true}, temperature: 0,
  };
  if (maxTokens) body.max_tokens = maxTokens;
  const sentAt = performance.now();
  let r;
  try {
    r = await fetch("v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json", ...authHeaders()}, body: JSON.stringify(body),
    });
  } catch (err) {
    throw new Error("The server could not be reached: " + err.message);
  }
  if (!r.ok) throw new Error(describeError(r.status, await r.text()));
  const out = {text: "", usage: null, encoderHits: Number(r.headers.get("X-Encoder-Cache-Hits") || 0),
               sentAt, firstAt: null, endAt: null};
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) { // one SSE event per blank-line-terminated block
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") { out.endAt = performance.now(); return out; }
        const msg = JSON.parse(data);
        if (msg.error) throw new Error(`The answer failed (${msg.error.code || "error"}): ${msg.error.message}`);
        if (msg.usage) out.usage = msg.usage;
        for (const choice of msg.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (!piece) continue;
          if (out.firstAt === null) out.firstAt = performance.now();
          out.text += piece;
          onText(piece);
        }
      }
    }
  }
  throw new Error("The answer stopped before it was complete (the connection closed).");
}
