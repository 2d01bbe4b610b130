// Parses and validates an AsyncAPI document with the AsyncAPI initiative's
// own parser, resolving its references to the schema files beside it.
// Usage: node check.mjs <path/to/asyncapi.json>
import { readFileSync } from "node:fs";
import { resolve } from "node:path";
import { pathToFileURL } from "node:url";
import { Parser, fromFile } from "@asyncapi/parser";

const path = resolve(process.argv[2] ?? "schemas/asyncapi.json");
const parser = new Parser();
const { document, diagnostics } = await fromFile(parser, path).parse({
  source: pathToFileURL(path).href,
});
// Severity 0 is an error; 1-3 are warnings, hints and information.
const errors = diagnostics.filter((d) => d.severity === 0);
for (const d of diagnostics) {
  const where = d.path?.join("/") || "(document)";
  console.log(`${d.severity === 0 ? "error" : "note"}: ${where}: ${d.message} [${d.code}]`);
}
if (!document || errors.length > 0) {
  console.error(`${path}: not a valid AsyncAPI document (${errors.length} errors)`);
  process.exit(1);
}
const channels = document.channels().all().map((c) => c.id());
const messages = document.allMessages().all().map((m) => m.id());
console.log(`${path}: valid AsyncAPI ${document.version()}: ${channels.length} channels, ${messages.length} messages`);
JSON.parse(readFileSync(path, "utf8"));
