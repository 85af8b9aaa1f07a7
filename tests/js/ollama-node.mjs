// node tests/js/ollama-node.mjs HOST MODEL: the ollama npm library against the server's /api
// routes (list, chat whole and streamed, a JSON-schema format); prints what it got as JSON.
import { Ollama } from "ollama";

const [host, model] = process.argv.slice(2);
const ollama = new Ollama({ host });
const messages = [{ role: "user", content: "hello there" }];
const options = { temperature: 0, repeat_penalty: 1.0, num_predict: 8 };

const listed = await ollama.list();
const whole = await ollama.chat({ model, messages, options });
const parts = [];
for await (const part of await ollama.chat({ model, messages, options, stream: true })) {
  parts.push(part);
}
const schema = {
  type: "object",
  properties: { ok: { type: "boolean" } },
  required: ["ok"],
  additionalProperties: false,
};
const shaped = await ollama.chat({ model, messages, format: schema, options: { num_predict: 32 } });
console.log(
  JSON.stringify({
    models: listed.models.map((m) => m.model),
    whole: whole.message.content,
    wholeDone: whole.done,
    streamed: parts.map((p) => p.message.content).join(""),
    lastDone: parts[parts.length - 1].done,
    shaped: shaped.message.content,
  }),
);
