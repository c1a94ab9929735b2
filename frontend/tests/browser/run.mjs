// Browser tests of the web GUI against the real backend (tiny random RWKV-7 model, CPU).
// `npm run test:browser` runs them; `-- --screenshots` also writes docs/images/*.png.
import assert from "node:assert/strict";
import { mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import { ensureBuilt, launchChromium, makeTempDir, REPO, startBackend, writeTinyCheckpoint } from "./harness.mjs";
import { scenarios } from "./scenarios.mjs";

const screenshots = process.argv.includes("--screenshots") ? join(REPO, "docs/images") : null;
const only = process.argv.find((arg) => arg.startsWith("--only="))?.slice("--only=".length);

// Every wait inside a scenario has its own timeout; this catches anything that has none.
const SCENARIO_TIMEOUT_MS = 180_000;

function withTimeout(promise, ms, name) {
  let timer;
  const expired = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${name}: no result within ${ms / 1000} s`)), ms);
  });
  return Promise.race([promise, expired]).finally(() => clearTimeout(timer));
}

async function main() {
  ensureBuilt();
  const modelsDir = makeTempDir("webui-models-");
  writeTinyCheckpoint(modelsDir);
  if (screenshots) mkdirSync(screenshots, { recursive: true });
  const open = await startBackend({ modelsDir });
  const guarded = await startBackend({ modelsDir, password: "correct horse" });
  const chromium = await launchChromium();
  let passed = 0;
  let failed = 0;
  const failures = [];
  try {
    for (const scenario of scenarios) {
      if (only && !scenario.name.includes(only)) continue;
      const context = await chromium.browser.newContext({ viewport: { width: 1400, height: 950 } });
      const page = await context.newPage();
      page.setDefaultTimeout(30_000);
      const started = Date.now();
      try {
        await withTimeout(scenario.run({ page, open, guarded, screenshots, assert }), SCENARIO_TIMEOUT_MS, scenario.name);
        passed += 1;
        console.log(`✓ ${scenario.name} (${((Date.now() - started) / 1000).toFixed(1)} s)`);
      } catch (error) {
        failed += 1;
        failures.push(`${scenario.name}: ${String(error?.message ?? error).split("\n")[0]}`);
        console.log(`✗ ${scenario.name}\n  ${String(error?.stack ?? error).replaceAll("\n", "\n  ")}`);
      } finally {
        await context.close();
      }
    }
  } finally {
    // Each step on its own: one that throws must not leave the servers running (node would not exit).
    for (const step of [() => chromium.close(), () => open.stop(), () => guarded.stop(), () => rmSync(modelsDir, { recursive: true, force: true })]) {
      try {
        await step();
      } catch (error) {
        failed += 1;
        failures.push(`clean-up: ${String(error?.message ?? error).split("\n")[0]}`);
        console.log(`✗ clean-up: ${String(error?.stack ?? error)}`);
      }
    }
  }
  if (failed > 0) {
    console.log("--- backend log (open server, last 4000 characters) ---");
    console.log(open.log().slice(-4000));
    // Again after the log, so the tail that CI keeps names what failed.
    for (const failure of failures) console.log(`✗ ${failure}`);
  }
  console.log(`${passed} passed, ${failed} failed`);
  process.exitCode = failed === 0 ? 0 : 1;
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
