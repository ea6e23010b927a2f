// Parse Mermaid diagrams with mermaid's own parser, as the docs site's mermaid.min.js would.
// stdin: JSON [{"where": "docs/x.md:12", "text": "sequenceDiagram ..."}]
// stdout: JSON [{"where": ..., "error": "Parse error on line 2: ..."}] for those that fail.
// Most diagram types sanitise labels with DOMPurify while parsing: jsdom gives it a window.
import { JSDOM } from "jsdom";

const { window } = new JSDOM("<!doctype html><html><body></body></html>");
globalThis.window = window;
globalThis.document = window.document;

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const diagrams = JSON.parse(Buffer.concat(chunks).toString("utf8"));

const { default: mermaid } = await import("mermaid");
mermaid.initialize({ startOnLoad: false, logLevel: "fatal" });
const failures = [];
for (const { where, text } of diagrams) {
  try {
    await mermaid.parse(text);
  } catch (e) {
    failures.push({ where, error: String((e && e.message) || e) });
  }
}
process.stdout.write(JSON.stringify(failures));
