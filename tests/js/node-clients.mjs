// node tests/js/node-clients.mjs BASE_URL MODEL: prints run()'s result as JSON.
import OpenAI from "openai";
import { run } from "./clients.mjs";

const [baseURL, model] = process.argv.slice(2);
console.log(JSON.stringify(await run(OpenAI, { baseURL, model, apiKey: "unused", browser: false })));
