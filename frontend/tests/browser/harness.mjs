// Process plumbing for the browser tests: the real backend with a tiny random checkpoint, and
// Debian's headless Chromium driven over CDP by playwright-core (no browser download).
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

export const FRONTEND = resolve(dirname(fileURLToPath(import.meta.url)), "../..");
export const REPO = resolve(FRONTEND, "..");
const BACKEND = join(REPO, "backend-python");
const PYTHON = process.env.PYTHON ?? (existsSync(join(REPO, ".venv/bin/python")) ? join(REPO, ".venv/bin/python") : "python3");
const CHROMIUM = process.env.CHROMIUM ?? "/usr/bin/chromium";

/** Newest modification time among the files the build reads. */
function newestSourceMs() {
  const sources = [join(FRONTEND, "index.html"), join(FRONTEND, "vite.config.ts"), join(FRONTEND, "package-lock.json")];
  for (const entry of readdirSync(join(FRONTEND, "src"), { recursive: true })) sources.push(join(FRONTEND, "src", entry));
  return Math.max(...sources.map((path) => statSync(path).mtimeMs));
}

/** Builds dist when it is missing, older than a source file, or `--rebuild` is given. */
export function ensureBuilt() {
  const index = join(FRONTEND, "dist/index.html");
  const fresh = existsSync(index) && statSync(index).mtimeMs >= newestSourceMs();
  if (fresh && !process.argv.includes("--rebuild")) return;
  console.log("building frontend/dist ...");
  const built = spawnSync(join(FRONTEND, "node_modules/.bin/vite"), ["build", "--logLevel", "warn"], { cwd: FRONTEND, stdio: "inherit" });
  if (built.status !== 0) throw new Error("vite build failed");
}

export function freePort() {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address();
      server.close(() => resolvePort(port));
    });
  });
}

export function makeTempDir(prefix) {
  return mkdtempSync(join(tmpdir(), prefix));
}

// EOS (id 0) is impossible too: with random weights a reply ended by EOS after a few dozen tokens
// about one time in three, and a scenario that stops a stream midway then found nothing to stop.
export function writeTinyCheckpoint(modelsDir) {
  const output = join(modelsDir, "tiny.pth");
  const made = spawnSync(
    PYTHON,
    ["-m", "albatross.random_checkpoint", "--layers", "2", "--width", "128", "--impossible-ids", "0,65530-65535", "--output", output],
    { cwd: BACKEND, encoding: "utf8" },
  );
  if (made.status !== 0) throw new Error(`random_checkpoint failed:\n${made.stdout}\n${made.stderr}`);
  return output;
}

/** Starts `main.py --webui` and resolves once /healthz answers; `stop()` ends it. */
export async function startBackend({ modelsDir, password }) {
  const port = await freePort();
  const args = [join(BACKEND, "main.py"), "--webui", "--host", "127.0.0.1", "--port", String(port), "--models-dir", modelsDir];
  if (password) args.push("--password", password);
  const child = spawn(PYTHON, args, { cwd: REPO, env: { ...process.env, RWKV_V7_ON: "1" }, stdio: ["ignore", "pipe", "pipe"] });
  let log = "";
  child.stdout.on("data", (data) => (log += data));
  child.stderr.on("data", (data) => (log += data));
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`backend exited with ${child.exitCode}:\n${log}`);
    try {
      if ((await fetch(`${url}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      child.kill("SIGKILL");
      throw new Error(`backend did not answer /healthz within 60 s:\n${log}`);
    }
    await new Promise((done) => setTimeout(done, 200));
  }
  return {
    url,
    log: () => log,
    stop: () =>
      new Promise((done) => {
        if (child.exitCode !== null) return done();
        child.once("exit", () => done());
        child.kill("SIGTERM");
        setTimeout(() => child.kill("SIGKILL"), 5000).unref();
      }),
  };
}

/** Launches Chromium with the flags the project uses and connects playwright to it over CDP. */
export async function launchChromium() {
  if (!existsSync(CHROMIUM)) {
    throw new Error(`no Chromium at ${CHROMIUM}: install Debian's (apt-get install -y chromium) or set CHROMIUM`);
  }
  const userDataDir = makeTempDir("webui-chromium-");
  const child = spawn(
    CHROMIUM,
    [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
      `--user-data-dir=${userDataDir}`,
      "--remote-debugging-port=0",
      "--window-size=1400,1000",
      "about:blank",
    ],
    { stdio: ["ignore", "ignore", "pipe"] },
  );
  let stderr = "";
  child.stderr.on("data", (data) => (stderr += data));
  const portFile = join(userDataDir, "DevToolsActivePort");
  const deadline = Date.now() + 30_000;
  while (!existsSync(portFile) || readFileSync(portFile, "utf8").split("\n").length < 2) {
    if (child.exitCode !== null) throw new Error(`chromium exited with ${child.exitCode}:\n${stderr}`);
    if (Date.now() > deadline) throw new Error(`chromium did not open its debugging port:\n${stderr}`);
    await new Promise((done) => setTimeout(done, 100));
  }
  const port = readFileSync(portFile, "utf8").split("\n")[0].trim();
  const browser = await chromium.connectOverCDP(`http://127.0.0.1:${port}`);
  return {
    browser,
    close: async () => {
      await browser.close().catch(() => undefined);
      child.kill("SIGTERM");
      await new Promise((done) => (child.exitCode !== null ? done() : child.once("exit", done)));
      // Chromium helpers may still be flushing the profile for a moment after the browser exits;
      // a profile left in the temp dir is harmless, a throw here would skip the servers' shutdown.
      try {
        rmSync(userDataDir, { recursive: true, force: true, maxRetries: 25, retryDelay: 200 });
      } catch (error) {
        console.log(`(left the browser profile ${userDataDir}: ${error.code ?? error})`);
      }
    },
  };
}
