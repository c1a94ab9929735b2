// Each scenario gets a fresh browser context (empty localStorage and sessionStorage).
import { join } from "node:path";

const ALBATROSS = "albatross workers=1 batch=32";
const LOAD_TIMEOUT = 120_000;

async function postJson(server, path, body) {
  const response = await fetch(server.url + path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
    signal: AbortSignal.timeout(LOAD_TIMEOUT),
  });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status} ${await response.text()}`);
}

/** Scenarios after the load test need a working model; load it over HTTP if it is not there. */
async function ensureLoaded(server) {
  const status = await (await fetch(server.url + "/status", { signal: AbortSignal.timeout(10_000) })).json();
  if (status.status === 3 && status.strategy === ALBATROSS) return;
  await postJson(server, "/switch-model", { model: "tiny.pth", strategy: ALBATROSS });
}

async function shot(page, screenshots, name) {
  if (screenshots) await page.screenshot({ path: join(screenshots, `${name}.png`) });
}

async function setSampling(page, prefix, values) {
  for (const [key, value] of Object.entries(values)) await page.getByTestId(`${prefix}-${key}`).fill(String(value));
}

async function cellCounts(page) {
  return page.getByTestId("batch-cell").evaluateAll((cells) =>
    cells.reduce((counts, cell) => ({ ...counts, [cell.dataset.status]: (counts[cell.dataset.status] ?? 0) + 1 }), {}),
  );
}

export const scenarios = [
  {
    name: "without a GPU, CUDA High Performance is offered but the CPU is preselected until the person picks",
    async run({ page, open, assert }) {
      const status = await (await fetch(open.url + "/status", { signal: AbortSignal.timeout(10_000) })).json();
      await page.goto(open.url);
      const device = page.getByTestId("device-select");
      const offered = await device.locator("option").evaluateAll((options) => options.map((option) => option.value));
      assert.deepEqual(offered, ["cpu", "cuda", "albatross"], "every device stays on offer");
      const expected = status.gpu_available ? "albatross" : "cpu";
      await page.waitForFunction(
        (value) => document.querySelector("[data-testid=device-select]")?.value === value,
        expected,
        { timeout: 10_000 },
      );
      await device.selectOption("albatross");
      await page.waitForTimeout(500); // settings are written 300 ms after the last change
      await page.reload();
      assert.equal(await page.getByTestId("device-select").inputValue(), "albatross", "a choice the person made is kept");
    },
  },
  {
    name: "CUDA High Performance shows workers, batch and the strategy line; other devices hide them",
    async run({ page, open, assert }) {
      await page.goto(open.url);
      const device = page.getByTestId("device-select");
      await device.selectOption("albatross");
      await assert.equal(await page.getByTestId("workers-input").inputValue(), "1", "default workers");
      await assert.equal(await page.getByTestId("batch-input").inputValue(), "32", "default batch");
      await page.getByTestId("strategy-value").getByText(ALBATROSS, { exact: true }).waitFor();
      await page.getByTestId("workers-input").fill("2");
      await page.getByTestId("batch-input").fill("960");
      await page.getByTestId("strategy-value").getByText("albatross workers=2 batch=960", { exact: true }).waitFor();
      await page.getByTestId("batch-input").fill("5000");
      assert.ok(await page.getByTestId("load-button").isDisabled(), "Load must be disabled while batch is out of range");
      await device.selectOption("cpu");
      assert.equal(await page.getByTestId("workers-input").count(), 0, "CPU must hide Workers");
      assert.equal(await page.getByTestId("batch-input").count(), 0, "CPU must hide Batch");
      await page.getByTestId("strategy-value").getByText("cpu fp32", { exact: true }).waitFor();
      await device.selectOption("cuda");
      assert.equal(await page.getByTestId("workers-input").count(), 0, "classic CUDA must hide Workers");
      await page.getByTestId("strategy-value").getByText("cuda fp16", { exact: true }).waitFor();
    },
  },
  {
    name: "settings persist in localStorage across a reload",
    async run({ page, open, screenshots, assert }) {
      await page.goto(open.url);
      await page.getByTestId("device-select").selectOption("albatross");
      await page.getByTestId("batch-input").fill("64");
      await page.getByTestId("language-select").selectOption("ja");
      await page.waitForTimeout(500); // settings are written 300 ms after the last change
      await page.reload();
      assert.equal(await page.getByTestId("batch-input").inputValue(), "64");
      await page.getByTestId("tab-configs").getByText("設定").waitFor();
      await page.getByTestId("strategy-value").getByText("albatross workers=1 batch=64", { exact: true }).waitFor();
      await shot(page, screenshots, "configs-ja");
    },
  },
  {
    name: "Save defaults posts the sampling defaults to /update-config",
    async run({ page, open, assert }) {
      await page.goto(open.url);
      await setSampling(page, "defaults", { temperature: 0.7, top_k: 40 });
      const saved = page.waitForRequest((request) => request.url().endsWith("/update-config"));
      await page.getByTestId("save-defaults").click();
      const body = JSON.parse((await saved).postData());
      assert.equal(body.temperature, 0.7);
      assert.equal(body.top_k, 40);
      await page.locator("[data-testid=defaults-notice][data-intent=success]").waitFor();
      await postJson(open, "/update-config", { temperature: 1.0, top_k: 0 });
    },
  },
  {
    name: "Load with CUDA High Performance posts the strategy and the server reaches working",
    async run({ page, open, screenshots, assert }) {
      await postJson(open, "/switch-model", { model: "", strategy: "cpu fp32" });
      await page.goto(open.url);
      await page.locator("[data-testid=server-state][data-state=offline]").first().waitFor();
      await page.getByTestId("device-select").selectOption("albatross");
      assert.equal(await page.getByTestId("model-select").inputValue(), "tiny.pth");
      const switched = page.waitForRequest((request) => request.url().endsWith("/switch-model"));
      await page.getByTestId("load-button").click();
      assert.deepEqual(JSON.parse((await switched).postData()), { model: "tiny.pth", strategy: ALBATROSS });
      await page.locator("[data-testid=load-notice][data-intent=success]").waitFor({ timeout: LOAD_TIMEOUT });
      await page.locator("[data-testid=server-state][data-state=working]").first().waitFor();
      await page.getByTestId("status-backend").getByText("albatross").waitFor();
      await page.getByTestId("status-batch").getByText("32", { exact: true }).waitFor();
      await page.getByTestId("status-model").getByText("tiny").waitFor();
      await shot(page, screenshots, "configs");
    },
  },
  {
    name: "a failed load shows the server's whole error message",
    async run({ page, open }) {
      await page.goto(open.url);
      await page.getByTestId("device-select").selectOption("albatross");
      await page.route("**/local-models", (route) =>
        route.fulfill({ json: { models: [{ name: "missing", path: "missing.pth", size_bytes: 1 }] } }),
      );
      await page.getByTestId("configs-refresh").click();
      await page.getByTestId("model-select").selectOption("missing.pth");
      await page.getByTestId("load-button").click();
      const notice = page.locator("[data-testid=load-notice][data-intent=error]");
      await notice.waitFor({ timeout: LOAD_TIMEOUT });
      await notice.getByText(/^HTTP \d{3}: .*missing\.pth/).waitFor();
      await ensureLoaded(open);
    },
  },
  {
    name: "chat streams a reply, shows usage and speed, regenerates and stops",
    async run({ page, open, screenshots, assert }) {
      await ensureLoaded(open);
      await page.goto(open.url + "/#chat");
      await setSampling(page, "chat", { max_tokens: 24 });
      const response = page.waitForResponse((candidate) => candidate.url().endsWith("/v1/chat/completions"));
      await page.getByTestId("chat-input").fill("Hello! Tell me about the sea.");
      await page.getByTestId("chat-send").click();
      const streamed = await response;
      assert.match(streamed.headers()["content-type"] ?? "", /^text\/event-stream/, "the reply must be a stream");
      const body = JSON.parse(streamed.request().postData());
      assert.equal(body.stream, true);
      assert.deepEqual(body.stream_options, { include_usage: true });
      assert.equal(body.max_tokens, 24);
      await page.getByTestId("chat-usage").getByText(/= \d+ tokens/).waitFor();
      await page.getByTestId("chat-usage-speed").getByText(/tokens\/s/).waitFor();
      const reply = page.getByTestId("chat-assistant-message");
      assert.equal(await reply.count(), 1);
      assert.notEqual((await reply.textContent()).replace("Assistant", "").trim(), "", "the reply must have text");
      await shot(page, screenshots, "chat");

      const regenerated = page.waitForResponse((candidate) => candidate.url().endsWith("/v1/chat/completions"));
      await page.getByTestId("chat-regenerate").click();
      await regenerated; // headers arrived: the page is busy until the stream ends
      await page.waitForFunction(() => !document.querySelector("[data-testid=chat-regenerate]").disabled);
      assert.equal(await page.getByTestId("chat-user-message").count(), 1, "regenerate keeps one user message");
      assert.equal(await page.getByTestId("chat-assistant-message").count(), 1, "regenerate replaces the reply");

      await setSampling(page, "chat", { max_tokens: 4000 });
      await page.getByTestId("chat-input").fill("Write a very long story.");
      await page.getByTestId("chat-send").click();
      await page.locator("[data-testid=chat-assistant-message][data-streaming=true]").getByText(/\S/).last().waitFor();
      await page.getByTestId("chat-stop").click();
      await page.getByTestId("chat-assistant-message").last().getByText("(stopped)").waitFor();
      assert.equal(await page.getByTestId("chat-error").count(), 0, "stopping is not an error");
    },
  },
  {
    name: "a batch of 8 goes out as one native request and ends with 8 done cells with text",
    async run({ page, open, screenshots, assert }) {
      await ensureLoaded(open);
      await page.goto(open.url + "/#completion");
      await setSampling(page, "completion", { max_tokens: 16 });
      await page.getByTestId("batch-count").fill("8");
      const requests = [];
      page.on("request", (request) => request.url().endsWith("/v1/chat/completions") && requests.push(request));
      await page.getByTestId("batch-start").click();
      await page.locator("[data-testid=batch-strip][data-phase=finished]").waitFor({ timeout: LOAD_TIMEOUT });
      assert.equal(requests.length, 1, "one request for the whole batch");
      const body = JSON.parse(requests[0].postData());
      assert.equal(body.contents.length, 8);
      assert.equal(body.stream, true);
      assert.equal(body.max_tokens, 16);
      assert.deepEqual(await cellCounts(page), { done: 8 });
      assert.equal(await page.getByTestId("batch-header").textContent(), "1-8/8 · 8/8 · Finished");
      for (const index of [0, 7]) {
        await page.locator(`[data-testid=batch-cell][data-index="${index}"]`).hover();
        const text = await page.getByTestId("batch-hover-text").textContent();
        assert.ok(text.trim().length > 0 && text !== "(no text yet)", `cell ${index + 1} must show its text`);
      }
      await page.context().grantPermissions(["clipboard-read", "clipboard-write"], { origin: open.url });
      const shown = await page.getByTestId("batch-hover-text").textContent();
      await page.getByTestId("batch-copy").click();
      await page.getByTestId("batch-copy").getByText("Copied").waitFor();
      assert.equal(await page.evaluate(() => navigator.clipboard.readText()), shown, "Copy puts the item's text on the clipboard");
      await shot(page, screenshots, "completion");
    },
  },
  {
    name: "stopping a batch midway marks the unfinished cells aborted",
    async run({ page, open, assert }) {
      await ensureLoaded(open);
      await page.goto(open.url + "/#completion");
      await setSampling(page, "completion", { max_tokens: 4000 });
      await page.getByTestId("batch-count").fill("8");
      await page.getByTestId("batch-start").click();
      await page.locator("[data-testid=batch-cell][data-status=running]").first().waitFor();
      await page.getByTestId("batch-stop").click();
      await page.locator("[data-testid=batch-strip][data-phase=stopped]").waitFor();
      const counts = await cellCounts(page);
      assert.ok((counts.aborted ?? 0) >= 1, `some cells must be aborted, got ${JSON.stringify(counts)}`);
      assert.equal((counts.running ?? 0) + (counts.pending ?? 0), 0, `no cell may stay open, got ${JSON.stringify(counts)}`);
      assert.match(await page.getByTestId("batch-header").textContent(), /^1-8\/8 · \d\/8 · Stopped$/);
    },
  },
  {
    name: "a batch of 1000 renders only the visible cells",
    async run({ page, open, assert }) {
      await ensureLoaded(open);
      await page.goto(open.url + "/#completion");
      await setSampling(page, "completion", { max_tokens: 4000 });
      await page.getByTestId("batch-count").fill("1000");
      await page.getByTestId("batch-start").click();
      await page.getByTestId("batch-header").getByText(/^1-\d+\/1000 · /).waitFor();
      const rendered = await page.getByTestId("batch-cell").count();
      assert.ok(rendered > 0 && rendered < 200, `only visible rows are rendered, got ${rendered} cells`);
      await page.getByTestId("batch-viewport").evaluate((element) => (element.scrollTop = element.scrollHeight));
      await page.locator('[data-testid=batch-cell][data-index="999"]').waitFor();
      await page.getByTestId("batch-stop").click();
      await page.locator("[data-testid=batch-strip][data-phase=stopped]").waitFor();
    },
  },
  {
    name: "a wrong password is refused in the prompt and the right one is kept for the session",
    async run({ page, guarded, screenshots, assert }) {
      await page.goto(guarded.url);
      const dialog = page.getByTestId("password-dialog");
      await dialog.waitFor();
      await page.getByTestId("password-input").fill("wrong guess");
      await page.getByTestId("password-submit").click();
      await page.getByTestId("password-wrong").waitFor();
      await shot(page, screenshots, "password");
      await page.getByTestId("password-input").fill("correct horse");
      await page.getByTestId("password-submit").click();
      await dialog.waitFor({ state: "detached" });
      await page.locator("[data-testid=server-state][data-state=offline]").first().waitFor();
      assert.equal(await page.evaluate(() => sessionStorage.getItem("rwkv-webui.password")), "correct horse");
      await page.reload();
      await page.locator("[data-testid=server-state][data-state=offline]").first().waitFor();
      assert.equal(await page.getByTestId("password-dialog").count(), 0, "no second prompt in the same session");
    },
  },
];
