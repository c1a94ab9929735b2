import { describe, expect, it } from "vitest";
import { readSse, SseFormatError, SseParser, type SseMessage } from "../../src/api/sse";

function feedAll(parts: string[]): SseMessage[] {
  const parser = new SseParser();
  return [...parts.flatMap((part) => parser.feed(part)), ...parser.finish()];
}

describe("SseParser", () => {
  it("yields each data event's JSON and a done marker for [DONE]", () => {
    const messages = feedAll(['data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n']);
    expect(messages).toEqual([
      { kind: "data", payload: { a: 1 } },
      { kind: "data", payload: { b: 2 } },
      { kind: "done" },
    ]);
  });

  it("gives the same events however the stream is split into chunks", () => {
    const stream = 'data: {"text":"héllo ✿"}\r\n\r\n: keep-alive\n\ndata: {"n":2}\n\ndata: [DONE]\n\n';
    const whole = feedAll([stream]);
    for (let cut = 1; cut < stream.length; cut += 1) {
      const split = feedAll([stream.slice(0, cut), stream.slice(cut)]);
      expect(split, `split at character ${cut}`).toEqual(whole);
    }
    const byCharacter = feedAll([...stream]);
    expect(byCharacter).toEqual(whole);
    expect(whole).toHaveLength(3);
  });

  it("joins multi-line data with newlines and ignores comments and other fields", () => {
    const messages = feedAll([": comment\nevent: message\nid: 7\ndata: {\"x\":\ndata: 5}\n\n"]);
    expect(messages).toEqual([{ kind: "data", payload: { x: 5 } }]);
  });

  it("delivers a last event that lacks its closing blank line", () => {
    expect(feedAll(['data: {"last":true}'])).toEqual([{ kind: "data", payload: { last: true } }]);
  });

  it("reports an event that is not JSON, quoting it", () => {
    const parser = new SseParser();
    expect(() => parser.feed("data: not json\n\n")).toThrow(SseFormatError);
  });
});

describe("readSse", () => {
  function bodyOf(parts: Uint8Array[]): ReadableStream<Uint8Array> {
    return new ReadableStream({
      start(controller) {
        for (const part of parts) controller.enqueue(part);
        controller.close();
      },
    });
  }

  it("decodes UTF-8 split across network chunks and stops at [DONE]", async () => {
    const bytes = new TextEncoder().encode('data: {"t":"中文"}\n\ndata: [DONE]\n\ndata: {"after":1}\n\n');
    const cut = bytes.indexOf(0xe4) + 1; // inside the first character's three bytes
    const payloads: unknown[] = [];
    for await (const payload of readSse(bodyOf([bytes.slice(0, cut), bytes.slice(cut)]))) payloads.push(payload);
    expect(payloads).toEqual([{ t: "中文" }]);
  });
});
