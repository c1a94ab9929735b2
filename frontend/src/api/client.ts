/** HTTP to the backend (docs/api.md), with the password flow: the first 401 asks the person for
 * the password once, keeps it for the browser session and sends it as a Bearer token. */

import { ApiError, AuthCancelledError, errorMessageFromBody } from "./errors";

export const PASSWORD_KEY = "rwkv-webui.password";

/** Asks the person for the password; `wrong` says the last one was refused. Null: they gave up. */
export type PasswordPrompt = (wrong: boolean) => Promise<string | null>;

export interface KeyValueStore {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
  removeItem(key: string): void;
}

export class ApiClient {
  private pendingPrompt: Promise<string | null> | null = null;

  constructor(
    private readonly baseUrl: string,
    private readonly sessionStore: KeyValueStore,
    private readonly promptPassword: PasswordPrompt,
    private readonly fetchImpl: typeof fetch = (input, init) => fetch(input, init),
  ) {}

  /** Sends a request; on 401 asks for the password and retries until it is accepted or refused. */
  async request(path: string, init: RequestInit = {}): Promise<Response> {
    for (;;) {
      const sent = this.sessionStore.getItem(PASSWORD_KEY);
      const headers = new Headers(init.headers);
      if (sent !== null) headers.set("Authorization", `Bearer ${sent}`);
      const response = await this.fetchImpl(this.baseUrl + path, { ...init, headers });
      if (response.status !== 401) return response;
      await response.body?.cancel();
      const password = await this.askPassword(sent);
      if (password === null) throw new AuthCancelledError();
    }
  }

  async getJson<T>(path: string, signal?: AbortSignal): Promise<T> {
    return this.readJson<T>(await this.request(path, { signal }));
  }

  async postJson<T>(path: string, body: unknown, signal?: AbortSignal): Promise<T> {
    return this.readJson<T>(await this.request(path, jsonInit(body, signal)));
  }

  /** Posts and returns the response once it is known to be a success (for streams). */
  async postForStream(path: string, body: unknown, signal: AbortSignal): Promise<Response> {
    const response = await this.request(path, jsonInit(body, signal));
    if (!response.ok) throw new ApiError(response.status, errorMessageFromBody(await response.text()));
    if (response.body === null) throw new ApiError(response.status, "the server sent an empty stream");
    return response;
  }

  private async readJson<T>(response: Response): Promise<T> {
    const text = await response.text();
    if (!response.ok) throw new ApiError(response.status, errorMessageFromBody(text));
    try {
      return JSON.parse(text) as T;
    } catch {
      throw new ApiError(response.status, `the server sent something that is not JSON: ${text}`);
    }
  }

  /** One prompt at a time: requests refused together all wait for the same answer. */
  private async askPassword(refused: string | null): Promise<string | null> {
    const current = this.sessionStore.getItem(PASSWORD_KEY);
    // Another request already got a new password while this one was in flight: just retry.
    if (this.pendingPrompt === null && current !== refused) return current;
    if (this.pendingPrompt === null) {
      this.pendingPrompt = this.promptPassword(refused !== null).then((password) => {
        if (password !== null) this.sessionStore.setItem(PASSWORD_KEY, password);
        return password;
      });
      this.pendingPrompt.finally(() => {
        this.pendingPrompt = null;
      });
    }
    return this.pendingPrompt;
  }
}

/** The header replicas behind a balancer or Ray Serve route sessions by (docs/api.md). */
export const SESSION_HEADER = "X-Session-Id";

/** A body naming a state session (`session_id`) also names it in SESSION_HEADER, so that every turn
 * reaches the replica that holds the session's state in memory. */
function jsonInit(body: unknown, signal?: AbortSignal): RequestInit {
  const headers: Record<string, string> = { "Content-Type": "application/json" };
  const sessionId = typeof body === "object" && body !== null ? (body as { session_id?: unknown }).session_id : undefined;
  if (typeof sessionId === "string" && sessionId !== "") headers[SESSION_HEADER] = sessionId;
  return { method: "POST", headers, body: JSON.stringify(body), signal };
}
