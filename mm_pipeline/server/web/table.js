// "Many files" mode: each file is uploaded, captioned with its modality's default prompt and
// forgotten by the server, a few at a time; the table fills as answers arrive and downloads as
// JSONL in the schema of `mmserve caption` (mm_pipeline/jobs/caption.py), one line per file in
// completion order, failures included.

import {OTHER_PROMPT, PROMPTS, ask, forget, kindOf, upload} from "./api.js";

const CAPTION_MAX_TOKENS = 64; // `mmserve caption`'s default, so the captions are the job's
const IN_FLIGHT = 4; // enough for the server to batch; more only queues behind the upload

const seconds = (ms) => Math.round(ms * 10) / 1e4; // 4 decimals, like the job's timings

export class CaptionTable {
  constructor(tbody, onChange) {
    this.tbody = tbody;
    this.onChange = onChange; // onChange(table) whenever a row changes state
    this.clear();
  }

  clear() {
    this.tbody.replaceChildren();
    // a new batch: rows still in flight from the old one finish into the old (detached) batch
    this.batch = {rows: [], queue: [], running: 0, records: []};
    this.onChange(this);
  }

  get total() { return this.batch.rows.length; }
  get finished() { return this.batch.records.length; }
  get complete() { return this.total > 0 && this.finished === this.total; }

  /** The finished rows as JSONL text. */
  jsonl() { return this.batch.records.map((r) => JSON.stringify(r) + "\n").join(""); }

  add(file) {
    const tr = document.createElement("tr");
    const cells = ["name", "status", "caption", "time"].map(() => tr.insertCell());
    cells[0].textContent = file.name || "pasted file";
    const row = {file, tr, status: cells[1], caption: cells[2], time: cells[3]};
    this.tbody.append(tr);
    this.batch.rows.push(row);
    this.batch.queue.push(row);
    this.setStatus(row, "queued");
    this.pump(this.batch);
  }

  setStatus(row, status, text = status) {
    row.tr.dataset.status = status;
    row.status.textContent = text;
    this.onChange(this);
  }

  pump(batch) {
    while (batch.running < IN_FLIGHT && batch.queue.length) {
      const row = batch.queue.shift();
      batch.running += 1;
      this.caption(row).then((record) => {
        batch.running -= 1;
        batch.records.push(record);
        if (batch === this.batch) this.onChange(this);
        this.pump(batch);
      });
    }
  }

  /** Upload, caption and forget one file; never rejects (a failure is a record with ``error``). */
  async caption(row) {
    const kind = kindOf(row.file);
    const record = {input: row.file.name || "pasted file", modality: kind, caption: null, error: null,
                    content_hash: null, prompt_tokens: 0, completion_tokens: 0, timings: {}};
    const start = performance.now();
    let fileId = null;
    try {
      this.setStatus(row, "uploading");
      const uploadedFile = await upload(row.file, (f) => { row.status.textContent = `uploading ${Math.round(f * 100)}%`; });
      fileId = uploadedFile.id;
      record.content_hash = uploadedFile.content_hash ?? null; // the same blake3 hex `mmserve caption` writes
      const uploaded = performance.now();
      this.setStatus(row, "captioning");
      const res = await ask(fileId, PROMPTS[kind] || OTHER_PROMPT, {
        maxTokens: CAPTION_MAX_TOKENS, onText: (piece) => { row.caption.textContent += piece; }});
      const end = performance.now();
      record.caption = res.text.trim();
      record.prompt_tokens = res.usage ? res.usage.prompt_tokens : 0;
      record.completion_tokens = res.usage ? res.usage.completion_tokens : 0;
      // read_s: the upload is this page's "read the bytes" step
      record.timings = {read_s: seconds(uploaded - start), first_token_s: seconds((res.firstAt ?? end) - start),
                        total_s: seconds(end - start)};
      row.caption.textContent = record.caption;
      row.time.textContent = `${record.timings.total_s.toFixed(2)} s (first token ${record.timings.first_token_s.toFixed(2)} s)`;
      this.setStatus(row, "done");
    } catch (err) {
      record.error = err.message || String(err);
      record.timings = {total_s: seconds(performance.now() - start)};
      row.caption.textContent = record.error;
      row.caption.className = "error";
      row.time.textContent = `${record.timings.total_s.toFixed(2)} s`;
      this.setStatus(row, "failed");
    } finally {
      if (fileId) forget(fileId); // like the job, which holds the bytes only while captioning
    }
    return record;
  }
}
