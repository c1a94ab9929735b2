import { describe, expect, it } from "vitest";
import { ApiClient, PASSWORD_KEY, SESSION_HEADER, type KeyValueStore } from "../../src/api/client";
import { ApiError, AuthCancelledError, errorMessageFromBody } from "../../src/api/errors";

class MemoryStore implements KeyValueStore {
  readonly values = new Map<string, string>();
  getItem(key: string): string | null {
    return this.values.get(key) ?? null;
  }
  setItem(key: string, value: string): void {
    this.values.set(key, value);
  }
  removeItem(key: string): void {
    this.values.delete(key);
  }
}

/** A server that accepts only `Bearer secret` and records the Authorization header of each call. */
function protectedServer(seen: (string | null)[]): typeof fetch {
  return async (_input, init) => {
    const auth = new Headers(init?.headers).get("Authorization");
    seen.push(auth);
    return auth === "Bearer secret"
      ? new Response(JSON.stringify({ status: 3 }), { status: 200 })
      : new Response(JSON.stringify({ error: "unauthorized" }), { status: 401 });
  };
}

describe("ApiClient password flow", () => {
  it("asks once after a 401, keeps the answer for the session and sends it as Bearer", async () => {
    const store = new MemoryStore();
    const seen: (string | null)[] = [];
    const prompts: boolean[] = [];
    const client = new ApiClient("", store, async (wrong) => (prompts.push(wrong), "secret"), protectedServer(seen));
    await expect(client.getJson("/status")).resolves.toEqual({ status: 3 });
    await expect(client.getJson("/status")).resolves.toEqual({ status: 3 });
    expect(prompts, "one prompt, not told the password was wrong").toEqual([false]);
    expect(seen).toEqual([null, "Bearer secret", "Bearer secret"]);
    expect(store.getItem(PASSWORD_KEY)).toBe("secret");
  });

  it("says the password was wrong and asks again until it is accepted", async () => {
    const answers = ["guess", "secret"];
    const prompts: boolean[] = [];
    const seen: (string | null)[] = [];
    const client = new ApiClient("", new MemoryStore(), async (wrong) => (prompts.push(wrong), answers.shift()!), protectedServer(seen));
    await client.getJson("/status");
    expect(prompts).toEqual([false, true]);
    expect(seen).toEqual([null, "Bearer guess", "Bearer secret"]);
  });

  it("asks only once for requests refused at the same time", async () => {
    let prompts = 0;
    let answer: (password: string) => void = () => undefined;
    const client = new ApiClient(
      "",
      new MemoryStore(),
      () => ((prompts += 1), new Promise<string>((resolve) => (answer = resolve))),
      protectedServer([]),
    );
    const both = Promise.all([client.getJson("/a"), client.getJson("/b")]);
    await new Promise((resolve) => setTimeout(resolve, 10));
    answer("secret");
    await expect(both).resolves.toHaveLength(2);
    expect(prompts).toBe(1);
  });

  it("fails with AuthCancelledError when the person closes the prompt", async () => {
    const client = new ApiClient("", new MemoryStore(), async () => null, protectedServer([]));
    await expect(client.getJson("/status")).rejects.toBeInstanceOf(AuthCancelledError);
  });

  it("raises the server's whole error message with its status", async () => {
    const reason = "failed to load: " + "x".repeat(500);
    const client = new ApiClient("", new MemoryStore(), async () => null, async () =>
      new Response(JSON.stringify({ error: reason }), { status: 500 }),
    );
    const error = await client.postJson("/switch-model", {}).catch((caught: unknown) => caught);
    expect(error).toBeInstanceOf(ApiError);
    expect((error as ApiError).status).toBe(500);
    expect((error as ApiError).message).toBe(reason);
  });
});

describe("errorMessageFromBody", () => {
  it.each([
    ['{"error": "no model loaded"}', "no model loaded"],
    ['{"error": {"message": "bad field", "type": "x"}}', "bad field"],
    ['{"detail": "Not Found"}', "Not Found"],
    ['{"detail": [{"loc": ["body", "max_tokens"], "msg": "must be >= 0"}]}', "max_tokens: must be >= 0"],
    ["plain text failure", "plain text failure"],
  ])("reads %s", (body, message) => {
    expect(errorMessageFromBody(body)).toBe(message);
  });
});

describe("ApiClient session routing", () => {
  it("names a state session in X-Session-Id and sends no such header otherwise", async () => {
    const sent: (string | null)[] = [];
    const server: typeof fetch = async (_input, init) => {
      sent.push(new Headers(init?.headers).get(SESSION_HEADER));
      return new Response(JSON.stringify({ ok: true }), { status: 200 });
    };
    const client = new ApiClient("", new MemoryStore(), async () => null, server);
    await client.postJson("/state/chat/completions", { session_id: "chat-7", contents: ["hi"] });
    await client.postForStream("/multi_state/chat/completions", { session_id: "tree", dialogue_idx: 0, contents: ["hi"] }, new AbortController().signal);
    await client.postJson("/v1/chat/completions", { messages: [] });
    expect(sent).toEqual(["chat-7", "tree", null]);
  });
});
