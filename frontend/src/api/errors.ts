/** Errors from the server, with the server's own message kept whole. */

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
  ) {
    super(message);
    this.name = "ApiError";
  }
}

/** The server reported an error inside a stream that had already started. */
export class StreamError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "StreamError";
  }
}

/** The person closed the password prompt instead of answering it. */
export class AuthCancelledError extends Error {
  constructor() {
    super("password required");
    this.name = "AuthCancelledError";
  }
}

/** The message in an error body: `{"error": "..."}`, `{"error": {"message"}}`, FastAPI's
 * `{"detail": ...}`, or else the raw text. Nothing is shortened: the person needs all of it. */
export function errorMessageFromBody(body: string): string {
  let parsed: unknown;
  try {
    parsed = JSON.parse(body);
  } catch {
    return body.trim();
  }
  return messageOf(parsed) ?? body.trim();
}

export function messageOf(value: unknown): string | null {
  if (typeof value === "string") return value;
  if (typeof value !== "object" || value === null) return null;
  const record = value as Record<string, unknown>;
  for (const key of ["error", "detail", "message"]) {
    const inner = record[key];
    if (inner === undefined) continue;
    if (Array.isArray(inner)) return inner.map((entry) => describeValidationEntry(entry)).join("; ");
    const text = messageOf(inner);
    if (text !== null) return text;
  }
  return null;
}

function describeValidationEntry(entry: unknown): string {
  if (typeof entry !== "object" || entry === null) return String(entry);
  const { loc, msg } = entry as { loc?: unknown; msg?: unknown };
  const where = Array.isArray(loc) ? loc.filter((part) => part !== "body").join(".") : "";
  const what = typeof msg === "string" ? msg : JSON.stringify(entry);
  return where ? `${where}: ${what}` : what;
}

export function describeError(error: unknown): string {
  if (error instanceof ApiError) return `HTTP ${error.status}: ${error.message}`;
  if (error instanceof Error) return error.message;
  return String(error);
}

export function isAbortError(error: unknown): boolean {
  return error instanceof DOMException ? error.name === "AbortError" : error instanceof Error && error.name === "AbortError";
}
