// A small chat box: one streamed /v1/chat/completions request at a time; its text appears as
// it comes, and its final `colibri` frame goes to `onDone`.

import { auth } from "./api.js";

export class Chat {
  constructor(form, out, onDone) {
    Object.assign(this, { form, out, onDone, busy: false });
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      if (!this.busy) this.send().catch((err) => this.fail(String(err)));
    });
  }

  fail(msg) {
    this.out.dataset.state = "error";
    this.out.textContent = msg;
    this.done();
  }

  done() {
    this.busy = false;
    this.form.querySelector("button").disabled = false;
  }

  async send() {
    const prompt = this.form.elements.prompt.value;
    const maxTokens = +this.form.elements.max_tokens.value || 32;
    this.busy = true;
    this.form.querySelector("button").disabled = true;
    this.out.dataset.state = "running";
    this.out.textContent = "";
    const body = { messages: [{ role: "user", content: prompt }], max_tokens: maxTokens,
                   temperature: 0, stream: true };
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: auth.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
    });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try { msg += `: ${(await r.json()).error.message}`; } catch { /* not JSON */ }
      return this.fail(msg);
    }
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "", finish = null, final = null;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, at);
        buf = buf.slice(at + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) return this.fail(chunk.error.message);
          for (const c of chunk.choices || []) {
            if (c.delta && c.delta.content) this.out.textContent += c.delta.content;
            if (c.finish_reason) finish = c.finish_reason;
          }
          if (chunk.colibri) final = chunk;
        }
      }
    }
    if (!final) return this.fail("the stream ended without its colibri frame");
    this.out.dataset.state = "done";
    this.done();
    this.onDone({ colibri: final.colibri, usage: final.usage, finish, prompt });
  }
}
