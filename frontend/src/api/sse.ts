/** Server-sent events, as the backend writes them (`data: <json>\n\n`, last `data: [DONE]`).
 *
 * `SseParser` is incremental: network chunks may split a line, or even a `\r\n`, anywhere. */

export type SseMessage = { kind: "data"; payload: unknown } | { kind: "done" };

export class SseParser {
  private buffer = "";
  private dataLines: string[] = [];
  private lastWasCarriageReturn = false;

  /** Feeds decoded text; returns the events completed by it, in order. */
  feed(text: string): SseMessage[] {
    let chunk = text;
    // A "\r\n" split across two chunks: the "\r" already ended the line, so skip the "\n".
    if (this.lastWasCarriageReturn && chunk.startsWith("\n")) chunk = chunk.slice(1);
    this.lastWasCarriageReturn = chunk.endsWith("\r");
    this.buffer += chunk;
    const messages: SseMessage[] = [];
    const lines = this.buffer.split(/\r\n|\r|\n/);
    this.buffer = lines.pop() ?? "";
    for (const line of lines) {
      const message = this.takeLine(line);
      if (message) messages.push(message);
    }
    return messages;
  }

  /** Ends the stream: an event without its closing blank line is still delivered. */
  finish(): SseMessage[] {
    const messages: SseMessage[] = [];
    if (this.buffer !== "") {
      const message = this.takeLine(this.buffer);
      this.buffer = "";
      if (message) messages.push(message);
    }
    const last = this.dispatch();
    if (last) messages.push(last);
    return messages;
  }

  private takeLine(line: string): SseMessage | null {
    if (line === "") return this.dispatch();
    if (line.startsWith(":")) return null; // comment / keep-alive
    const colon = line.indexOf(":");
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.dataLines.push(value);
    return null; // event, id and retry do not matter to this client
  }

  private dispatch(): SseMessage | null {
    if (this.dataLines.length === 0) return null;
    const data = this.dataLines.join("\n");
    this.dataLines = [];
    if (data.trim() === "[DONE]") return { kind: "done" };
    try {
      return { kind: "data", payload: JSON.parse(data) };
    } catch {
      throw new SseFormatError(`the server sent an event that is not JSON: ${data.slice(0, 200)}`);
    }
  }
}

export class SseFormatError extends Error {}

/** Yields the JSON payloads of a streaming response until `[DONE]` or the end of the body. */
export async function* readSse(body: ReadableStream<Uint8Array>): AsyncGenerator<unknown, void, void> {
  const parser = new SseParser();
  const decoder = new TextDecoder();
  const reader = body.getReader();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      const messages = done ? [...parser.feed(decoder.decode()), ...parser.finish()] : parser.feed(decoder.decode(value, { stream: true }));
      for (const message of messages) {
        if (message.kind === "done") return;
        yield message.payload;
      }
      if (done) return;
    }
  } finally {
    // Leaving early (abort, [DONE]) must release the connection.
    reader.cancel().catch(() => undefined);
  }
}
